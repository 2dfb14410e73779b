"""Communication benchmark: allreduce bandwidth per backend and size, and the seed's DDP step decomposition.

Run from Python with `run_comms_benchmark` (or `hfkit bench comms`), which launches the worker under
torchrun as a subprocess with a timeout, hands it one `CommsConfig` (as JSON, its only argument), and
returns the rows rank 0 wrote. Allreduce rows (op "allreduce") give the median time per message size with
nccl-tests' bandwidths: algbw = S/t and busbw = algbw·2(n-1)/n. DDP rows (op "ddp_step") repeat the
seed's experiment on a stack of Linear layers with AlphaFold's 93.2M parameters (or a scaled-down count):
backward alone on one process, backward on n processes without synchronization, and backward plus
gradient synchronization per backend with overlap on and off; overhead = that minus backward alone.
Allreduce rows go to `--out` (`comms.json`), DDP rows to `ddp_path(out)` beside it (`ddp.json`).

Stage rates (`hfkit.parallel.cost_model.StageRates`, `measure_stage_rates`), measured in the same run as the
allreduce: pinned device→host and host→device GB/s per rank, one rank alone and every local rank copying at
once, and both directions at once on two streams (CUDA only; on a CPU skipped entries with the reason); the
host sum (a 2-input add, counting read, read, write) and a host copy (read, write) on the threads a rank has
(`hfkit.parallel.hfreduce.default_threads`), every rank at once. Before the allreduce on `STAGE_BYTES` buffers
(`meta["stage_rates"]`, and one entry per measurement in `meta["stage_rows"]`); then for each hfreduce size on
buffers of what the pipeline moves in one step, one chunk (the message, when smaller), kept in the row's
`extra["stage_rates"]` with `bound_ms`, the time a pipelined host-staged allreduce of that size cannot beat
with those rates, and `bound_fraction` = bound / measured time (1 = at the bound). The bound
(`hfkit.parallel.cost_model.hfreduce_bound`), for L local ranks and chunks of c bytes: on GPUs the stages
device→host c/D, the sum of this rank's 1/L slice over the L slots (L+1)·(c/L)/H and host→device c/U overlap,
both copies at once limited by 2c/B, so T = c/D + (L+1)·(c/L)/H + c/U (one chunk's latency of fill) +
(chunks−1)·max(c/D, c/U, 2c/B, (L+1)·(c/L)/H); on a CPU the copies into and out of the slots and the sum share
the rank's cores, T = 4S/C + (L+1)·S/(L·H); messages up to the small-path limit: T = in + (L+1)·S/H + out. On
several nodes the cross-node stage is not measured: no bound there.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hfkit.bench.results import ENV_KEYS, ResultFile, ResultRow, environment_info, make_row
from hfkit.bench.timing import Timing
from hfkit.parallel.cost_model import StageRates, hfreduce_bound
from hfkit.parallel.hfreduce import HostReduce, default_threads, host_worker, run_on

__all__ = [
    "AF2_PARAMS",
    "CommsConfig",
    "STAGE_BYTES",
    "algbw_gbps",
    "busbw_gbps",
    "build_param_model",
    "ddp_path",
    "default_backends",
    "load_comms_results",
    "measure_stage_rates",
    "message_sizes",
    "parse_bytes",
    "run_comms_benchmark",
    "main",
]

AF2_PARAMS = 93_200_000
GB = 1e9
# Stage rates are measured on buffers of this size: beyond the CPU's caches, as a large allreduce is.
STAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class CommsConfig:
    """What one worker run measures (the arguments of `run_comms_benchmark`): allreduce over `backends`
    at `message_sizes(min_bytes, max_bytes, factor)` (`max_bytes` None: 1 GiB on GPUs, 64 MiB on a
    CPU), at most `reps` timed repetitions within `budget_s` a size after `warmup` calls; with `ddp`
    the DDP step of a `params`-parameter model on `batch` rows, `ddp_reps` steps a configuration,
    `bucket_mb` buckets. `chunk_mb`: hfreduce's pipeline chunk (None: `HostReduce`'s default).
    `timeout_s` bounds every collective; `cpu` keeps CPU tensors and gloo where CUDA exists; rank 0
    writes to `out` (and `ddp_path(out)`) with `command` in every row."""

    out: str
    command: str | None = None
    backends: tuple[str, ...] = ("gloo", "hfreduce")
    min_bytes: int = 4 << 10
    max_bytes: int | None = None
    factor: int = 4
    warmup: int = 3
    reps: int = 30
    budget_s: float = 1.0
    ddp: bool = True
    params: int = AF2_PARAMS
    batch: int = 16
    ddp_reps: int = 5
    bucket_mb: float = 25.0
    chunk_mb: float | None = None
    timeout_s: float = 600.0
    cpu: bool = False


def algbw_gbps(nbytes: float, seconds: float) -> float:
    """nccl-tests' algorithm bandwidth in GB/s: message size over time, S/t."""
    return float("nan") if seconds <= 0 else nbytes / seconds / GB


def busbw_gbps(nbytes: float, seconds: float, world_size: int) -> float:
    """nccl-tests' bus bandwidth of an allreduce in GB/s: algbw·2(n-1)/n (0 on one rank).

    A ring allreduce moves 2(n-1)/n·S through each rank's link, so busbw is comparable with the link's
    own bandwidth whatever the rank count.
    """
    return algbw_gbps(nbytes, seconds) * 2 * (world_size - 1) / world_size


def parse_bytes(text: str | int) -> int:
    """'64M', '64MB', '4K', '1G', '65536' -> bytes (binary multiples: K = 1024)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)(?:i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"expected a size such as 4K, 64M, 1G or 65536, got {text!r}")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def message_sizes(min_bytes: int = 4 << 10, max_bytes: int = 64 << 20, factor: int = 4) -> list[int]:
    """Sizes from `min_bytes` up to `max_bytes` by `factor` (powers of 4 by default), `max_bytes` included."""
    if min_bytes < 4 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"message_sizes: bad range {min_bytes}..{max_bytes} by {factor}")
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    if sizes[-1] != max_bytes:
        sizes.append(max_bytes)
    return sizes


def default_backends() -> list[str]:
    """nccl, gloo, hfreduce where CUDA is present; gloo, hfreduce on a CPU."""
    return ["nccl", "gloo", "hfreduce"] if torch.cuda.is_available() else ["gloo", "hfreduce"]


def build_param_model(n_params: int, width: int = 2048) -> nn.Sequential:
    """A stack of Linear(width, width) layers plus one narrower last layer totalling ≈ `n_params`.

    The last layer's output width is chosen so the total lands within one layer row of `n_params`;
    read the exact count from `sum(p.numel() for p in model.parameters())`. For small counts the width
    shrinks so that there are at least 8 layers (DDP needs several buckets to overlap anything).
    """
    if n_params < 16:
        raise ValueError(f"n_params: expected >= 16, got {n_params}")
    width = max(2, min(width, int((n_params / 8) ** 0.5)))
    per = width * width + width
    layers: list[nn.Module] = []
    full = max(0, (n_params - width - 1) // per)
    for _ in range(full):
        layers.append(nn.Linear(width, width))
    rest = n_params - full * per
    out = max(1, rest // (width + 1))
    layers.append(nn.Linear(width, out))
    return nn.Sequential(*layers)


# ----------------------------------------------------------------------------------------------------
# The worker (runs under torchrun)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(values: Sequence[float], group: Any) -> list[float]:
    # A collective finishes on the slowest rank: report per repetition the maximum across ranks.
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


class _Comm:
    """One allreduce per backend: nccl/gloo on their own process groups, hfreduce a `HostReduce`
    (`reducer`) with chunks of `chunk_mb` (None: its default)."""

    def __init__(self, backend: str, device: torch.device, chunk_mb: float | None = None) -> None:
        self.backend = backend
        self.device = device if backend in ("nccl", "hfreduce") else torch.device("cpu")
        self.group = dist.new_group(backend=backend) if backend in ("nccl", "gloo") else None
        chunk = {} if chunk_mb is None else {"chunk_mb": chunk_mb}
        self.reducer = HostReduce(**chunk) if backend == "hfreduce" else None

    def __call__(self, tensor: torch.Tensor) -> None:
        if self.reducer is not None:
            self.reducer.allreduce_(tensor)
        else:
            dist.all_reduce(tensor, group=self.group)

    def close(self) -> None:
        if self.reducer is not None:
            self.reducer.close()


def _median_seconds(fn: Callable[[], None], reps: int, device: torch.device, ctrl: Any, alone: bool,
                    calls: int = 1) -> float:  # fmt: skip
    """The median over `reps` of the slowest rank's seconds per call of `fn`, timed over `calls`
    back-to-back calls after a barrier (after one warm-up call); with `alone` only rank 0 runs it
    while the others wait."""
    runs = dist.get_rank() == 0 or not alone
    times = []
    for i in range(reps + 1):
        dist.barrier(group=ctrl)
        t0 = time.perf_counter()
        if runs:
            for _ in range(calls if i else 1):
                fn()
            _sync(device)
        if i:
            times.append((time.perf_counter() - t0) / calls if runs else 0.0)
    return float(np.median(_max_over_ranks(times, ctrl)))


def _calls_for(nbytes: int) -> int:
    # Small buffers are timed over several calls, so that a timing covers ~STAGE_BYTES (at most 100).
    return int(min(100, max(1, STAGE_BYTES // max(1, nbytes))))


def _host_seconds(nbytes: int, stream_bytes: int, threads: int, reps: int, ctrl: Any) -> tuple[float, float]:
    """Seconds of a 2-input add of `nbytes` of fp32, and of copying `stream_bytes` into and out of an
    `nbytes` buffer chunk by chunk (as hfreduce copies a CPU tensor to its slot and back), where
    HostReduce runs them (`run_on`: a host worker with `threads` intra-op threads, or the calling thread
    for small ops), every rank at once (the slowest rank's median)."""
    n = max(1, nbytes // 4)
    a, b, out = (torch.ones(n) for _ in range(3))
    big = torch.ones(max(n, stream_bytes // 4))
    cpu = torch.device("cpu")
    worker = host_worker(threads)

    def copy_chunks() -> None:
        for lo in range(0, big.numel(), n):
            m = min(n, big.numel() - lo)
            run_on(worker, lambda lo=lo, m=m: out[:m].copy_(big[lo : lo + m]), m)
            run_on(worker, lambda lo=lo, m=m: big[lo : lo + m].copy_(out[:m]), m)

    try:
        summed = _median_seconds(lambda: run_on(worker, lambda: torch.add(a, b, out=out), n), reps, cpu, ctrl,
                                 False, _calls_for(nbytes))  # fmt: skip
        copied = _median_seconds(copy_chunks, reps, cpu, ctrl, False, _calls_for(big.numel() * 4))
    finally:
        worker.shutdown()
    return summed, copied


def measure_stage_rates(
    device: torch.device,
    ctrl: Any,
    local_ranks: int,
    host_bytes: int = STAGE_BYTES,
    copy_bytes: int = STAGE_BYTES,
    stream_bytes: int | None = None,
    reps: int = 5,
) -> tuple[StageRates, list[dict[str, Any]]]:
    """hfreduce's stage rates on this node (collective over the default group; `ctrl` a gloo group),
    and one entry per measurement (stage, mode, gbps, bytes, traffic counted per byte, skipped reason).

    Host, on buffers of `host_bytes` (what fits in the caches matters: the worker measures on one chunk, the
    working set of one pipeline step): a 2-input add ("host_sum", 3 bytes of traffic per byte), and
    `stream_bytes` (default `host_bytes`; the worker: the message) copied into and out of that buffer
    chunk by chunk, as hfreduce moves a CPU tensor through its slot ("host_copy", 4: a read and a write
    each way), on `default_threads(local_ranks)` threads, every rank at once. Device copies of
    `copy_bytes` (hfreduce's copy size: one chunk; CUDA `device` only, else skipped with the reason): pinned
    device→host (d2h) and host→device (h2d) per rank, "alone" (rank 0, the others waiting) and "all_ranks"
    (every rank of the run at once; ranks sharing a GPU share its copy engines), and "bidir" (each rank copies
    both ways at once on two streams; both directions' bytes count). Rates are per rank, of the slowest rank,
    each copy waited for as hfreduce waits for its chunk's.
    """
    threads = default_threads(local_ranks)
    entries: list[dict[str, Any]] = []
    rates: dict[str, float] = {}

    def add(stage: str, mode: str, seconds: float | None, nbytes: int, traffic: int,
            skipped: str | None = None) -> None:  # fmt: skip
        gbps = None if seconds is None else traffic * nbytes / seconds / GB
        entries.append({"stage": stage, "mode": mode, "gbps": gbps, "bytes": nbytes, "traffic": traffic,
                        "skipped": skipped})  # fmt: skip
        if gbps is not None:
            # StageRates' names: d2h_alone_gbps, d2h_all_gbps, ..., bidir_all_gbps, host_sum_gbps.
            short = {"alone": "_alone", "all_ranks": "_all"}[mode] if stage in ("d2h", "h2d", "bidir") else ""
            rates[f"{stage}{short}_gbps"] = gbps

    stream_bytes = stream_bytes or host_bytes
    summed, copied = _host_seconds(host_bytes, stream_bytes, threads, reps, ctrl)
    add("host_sum", "all_ranks", summed, host_bytes, 3)
    add("host_copy", "all_ranks", copied, stream_bytes, 4)  # in and out, each a read and a write
    if device.type != "cuda":
        reason = "no CUDA device: CPU tensors go to and from the slots by host copies (host_copy)"
        for stage, mode in (("d2h", "alone"), ("d2h", "all_ranks"), ("h2d", "alone"), ("h2d", "all_ranks")):
            add(stage, mode, None, copy_bytes, 1, reason)
        add("bidir", "all_ranks", None, copy_bytes, 2, reason)
        return StageRates(local_ranks=local_ranks, threads=threads, **rates), entries
    host = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    dev2 = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    down, up = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def d2h() -> None:
        with torch.cuda.stream(down):
            host.copy_(dev, non_blocking=True)
        down.synchronize()

    def h2d() -> None:
        with torch.cuda.stream(up):
            dev2.copy_(host2, non_blocking=True)
        up.synchronize()

    def both() -> None:
        with torch.cuda.stream(down):
            host.copy_(dev, non_blocking=True)
        with torch.cuda.stream(up):
            dev2.copy_(host2, non_blocking=True)
        down.synchronize()
        up.synchronize()

    calls = _calls_for(copy_bytes)
    for mode, alone in (("alone", True), ("all_ranks", False)):
        add("d2h", mode, _median_seconds(d2h, reps, device, ctrl, alone, calls), copy_bytes, 1)
        add("h2d", mode, _median_seconds(h2d, reps, device, ctrl, alone, calls), copy_bytes, 1)
    add("bidir", "all_ranks", _median_seconds(both, reps, device, ctrl, False, calls), copy_bytes, 2)
    return StageRates(local_ranks=local_ranks, threads=threads, **rates), entries


def _time_allreduce(
    comm: _Comm, nbytes: int, warmup: int, max_reps: int, budget_s: float, ctrl: Any
) -> tuple[list[float], int]:
    """Per-call seconds for each repetition (slowest rank), and the calls per repetition.

    As in nccl-tests, a repetition times `inner` back-to-back calls after a barrier and divides by
    `inner`: for small messages one call is shorter than the skew with which ranks leave the barrier.
    """
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=comm.device)
    for _ in range(warmup):
        comm(x)
    _sync(comm.device)
    # Estimate one call to choose calls per repetition (>= ~20 ms) and repetitions within the budget;
    # the estimate is the slowest rank's, so every rank makes the same choice.
    dist.barrier(group=ctrl)
    t0 = time.perf_counter()
    for _ in range(3):
        comm(x)
    _sync(comm.device)
    est = _max_over_ranks([(time.perf_counter() - t0) / 3], ctrl)[0]
    inner = int(min(200, max(1, 0.02 / max(est, 1e-7))))
    reps = int(min(max_reps, max(3, budget_s / max(est * inner, 1e-6))))
    times = []
    for _ in range(reps):
        dist.barrier(group=ctrl)
        t0 = time.perf_counter()
        for _ in range(inner):
            comm(x)
        _sync(comm.device)
        times.append((time.perf_counter() - t0) / inner)
    return _max_over_ranks(times, ctrl), inner


def _row(env: dict[str, Any], op: str, provider: str, mode: str, shape: list[int], times_s: Sequence[float],
         nbytes: int, gbps: float, extra: dict[str, Any]) -> ResultRow:  # fmt: skip
    t = Timing.from_samples([s * 1e3 for s in times_s], "wall")
    return make_row(env, t, op=op, provider=provider, mode=mode, shape=shape, dtype="fp32", nbytes=nbytes,
                    gbps=gbps, extra=extra)  # fmt: skip


def _allreduce_rows(config: CommsConfig, env: dict[str, Any], device: torch.device, ctrl: Any,
                    log: Callable[[str], None]) -> list[ResultRow]:  # fmt: skip
    """Allreduce rows per backend and size; on one node hfreduce rows also get the stage rates
    measured at their size (`measure_stage_rates`) and the bound they give (`hfreduce_bound`)."""
    world = dist.get_world_size()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = max(1, world // local_ranks)
    rows = []
    # Sizes outer, backends inner: the backends are compared at a size within seconds of each other,
    # under the same load from anything else on the machine.
    comms = [_Comm(backend, device, config.chunk_mb) for backend in config.backends]
    try:
        for nbytes, comm in itertools.product(
            message_sizes(config.min_bytes, config.max_bytes, config.factor), comms
        ):
            backend = comm.backend
            times, inner = _time_allreduce(comm, nbytes, config.warmup, config.reps, config.budget_s, ctrl)
            t = float(np.median(times))
            extra = {
                "algbw_gbps": algbw_gbps(nbytes, t),
                "busbw_gbps": busbw_gbps(nbytes, t, world),
                "world_size": world,
                "nodes": nodes,
                "device": str(comm.device.type),
                "calls_per_rep": inner,
            }
            bound = ""
            if comm.reducer is not None and nodes == 1:
                hr = comm.reducer
                # The rates of one pipeline step (one chunk, or the message when smaller): what the
                # caches hold and each copy's latency are part of what the pipeline can reach.
                step = min(nbytes, hr.chunk_bytes)
                streamed = min(nbytes, STAGE_BYTES)
                rates, _ = measure_stage_rates(device, ctrl, local_ranks, step, step, streamed)
                bound_s = hfreduce_bound(
                    nbytes, rates, hr.chunk_bytes, hr.small_bytes, cuda=device.type == "cuda"
                )
                extra.update(
                    stage_rates=rates.as_dict(),
                    bound_ms=bound_s * 1e3,
                    bound_fraction=bound_s / t,
                    path="small" if nbytes <= hr.small_bytes else "pipelined",
                    chunk_bytes=hr.chunk_bytes,
                    threads=hr.threads,
                )
                bound = f"  bound {bound_s * 1e3:9.3f} ms ({bound_s / t:.0%})"
            rows.append(_row(env, "allreduce", backend, "allreduce", [nbytes], times, nbytes,
                             extra["algbw_gbps"], extra))  # fmt: skip
            log(
                f"allreduce {backend:9s} {nbytes:>11,d} B  {t * 1e3:9.3f} ms"
                f"  busbw {extra['busbw_gbps']:.2f} GB/s{bound}"
            )
    finally:
        for comm in comms:
            comm.close()
    return rows


def _step_times(model: nn.Module, x: torch.Tensor, reps: int, ctrl: Any, device: torch.device,
                after_backward: Callable[[], None] | None = None,
                split: bool = False) -> tuple[list[float], list[float]]:  # fmt: skip
    """Per-rep (backward [+ sync]) and, with `split`, the sync part alone; forward is not timed."""
    total, sync_part = [], []
    for _ in range(reps + 1):  # the first repetition is a warm-up
        model.zero_grad(set_to_none=False)
        loss = model(x).square().mean()
        _sync(device)
        dist.barrier(group=ctrl)
        t0 = time.perf_counter()
        loss.backward()
        _sync(device)
        t1 = time.perf_counter()
        if after_backward is not None:
            after_backward()
            _sync(device)
        t2 = time.perf_counter()
        total.append(t2 - t0)
        sync_part.append(t2 - t1 if split else 0.0)
    return _max_over_ranks(total[1:], ctrl), _max_over_ranks(sync_part[1:], ctrl)


def _ddp_rows(config: CommsConfig, env: dict[str, Any], device: torch.device, ctrl: Any,
              log: Callable[[str], None]) -> list[ResultRow]:  # fmt: skip
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = build_param_model(config.params).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randn(config.batch, model[0].in_features, device=device)
    base = {
        "world_size": world,
        "params": n_params,
        "layers": len(model),
        "batch": config.batch,
        "device": device.type,
        "scaled_down": n_params < 0.99 * AF2_PARAMS,
        "grad_bytes": n_params * 4,
    }
    shape = [n_params]
    rows: list[ResultRow] = []

    def add(provider: str, mode: str, times: Sequence[float], alone: float | None, **more: Any) -> None:
        t = float(np.median(times))
        extra = {**base, **more}
        if alone is not None:
            extra["comm_overhead_s"] = t - alone
        rows.append(_row(env, "ddp_step", provider, mode, shape, times, n_params * 4, 0.0, extra))
        log(
            f"ddp_step {provider:9s} {mode:24s} {t:8.3f} s"
            + (f"  overhead {t - alone:+.3f} s" if alone else "")
        )

    # Backward alone: rank 0 only, the others wait at a barrier (one process, as the seed's 1 GPU).
    alone_times: list[float] = []
    if rank == 0:
        for i in range(config.ddp_reps + 1):
            model.zero_grad(set_to_none=False)
            loss = model(x).square().mean()
            _sync(device)
            t0 = time.perf_counter()
            loss.backward()
            _sync(device)
            if i:
                alone_times.append(time.perf_counter() - t0)
    dist.barrier(group=ctrl)
    buf = torch.tensor(alone_times if rank == 0 else [0.0] * config.ddp_reps, dtype=torch.float64)
    dist.broadcast(buf, 0, group=ctrl)
    alone_times = buf.tolist()
    alone = float(np.median(alone_times))
    add("none", "backward_alone", alone_times, None, processes=1)
    # All ranks at once, no synchronization: what sharing the machine costs before any communication.
    conc, _ = _step_times(model, x, config.ddp_reps, ctrl, device)
    add("none", "backward_concurrent", conc, alone)

    for backend in config.backends:
        for overlap in (True, False):
            ddp, impl = _wrap_ddp(model, backend, overlap, config.bucket_mb)
            if ddp is None:
                log(f"ddp_step {backend}: skipped ({impl})")
                break
            sync = getattr(ddp, "sync_grad", None)
            total, sync_part = _step_times(ddp, x, config.ddp_reps, ctrl, device, after_backward=sync,
                                           split=not overlap)  # fmt: skip
            mode = "backward+sync_overlap" if overlap else "backward+sync_no_overlap"
            add(backend, mode, total, alone, overlap=overlap, bucket_mb=config.bucket_mb, impl=impl)
            if not overlap:
                add(backend, "sync_only_no_overlap", sync_part, None, overlap=False,
                    bucket_mb=config.bucket_mb, impl=impl)  # fmt: skip
            # hfkit's DDP keeps hooks on the parameters until closed; the next wrap adds its own.
            if hasattr(ddp, "close"):
                ddp.close()
            del ddp
    return rows


def _wrap_ddp(model: nn.Module, backend: str, overlap: bool, bucket_mb: float) -> tuple[Any, str]:
    """hfkit's DDP when present; otherwise (nccl/gloo only) torch's DDP, overlap only."""
    try:
        from hfkit.parallel import DistributedDataParallel
    except ImportError:
        DistributedDataParallel = None  # noqa: N806
    if DistributedDataParallel is not None:
        return DistributedDataParallel(model, backend=backend, bucket_mb=bucket_mb, overlap=overlap), "hfkit"
    if backend == "hfreduce" or not overlap:
        return None, "hfkit.parallel.DistributedDataParallel not available"
    group = dist.new_group(backend=backend)
    wrapped = nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=bucket_mb)
    return wrapped, "torch"


def main(argv: Sequence[str] | None = None) -> int:
    """The torchrun worker, given a `CommsConfig` as JSON (its one argument): measure, then rank 0
    writes the rows to `out`; returns the exit status."""
    config = CommsConfig(**json.loads((sys.argv[1:] if argv is None else argv)[0]))
    cuda = torch.cuda.is_available() and not config.cpu
    backends = [b for b in config.backends if cuda or b != "nccl"]
    config = replace(
        config, max_bytes=config.max_bytes or ((1 << 30) if cuda else (64 << 20)), backends=backends
    )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    n_gpus = torch.cuda.device_count() if cuda else 0
    shared_gpu = cuda and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > n_gpus
    if shared_gpu:
        # More ranks than GPUs (e.g. 2 ranks on a 1-GPU machine): NCCL refuses two ranks on one
        # device, so it is dropped; hfreduce and gloo still run, ranks sharing GPUs round-robin.
        config = replace(config, backends=[b for b in config.backends if b != "nccl"])
    timeout = timedelta(seconds=config.timeout_s)
    if cuda and not shared_gpu:
        from hfkit.parallel.launch import init_distributed

        init_distributed("nccl", timeout)  # sets the device from LOCAL_RANK, then env://
    else:
        if cuda:
            torch.cuda.set_device(local_rank % n_gpus)
        dist.init_process_group("gloo", init_method="env://", timeout=timeout)
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank % n_gpus) if cuda else torch.device("cpu")
    if shared_gpu and rank == 0:
        print(f"{dist.get_world_size()} ranks on {n_gpus} GPU(s): nccl skipped", flush=True)
    # Timings, maxima and barriers travel on a gloo group: cheap, and independent of the measured one.
    ctrl = dist.new_group(backend="gloo")
    env_all = environment_info(device, config.command)
    env = {k: env_all[k] for k in ENV_KEYS}
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    stage_meta: dict[str, Any] = {}
    if "hfreduce" in config.backends:
        # The machine's rates on buffers beyond the caches of most hosts (STAGE_BYTES) in the meta;
        # the hfreduce rows carry the rates at their own size.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        rates, entries = measure_stage_rates(device, ctrl, local_ranks)
        stage_meta = {"stage_rates": rates.as_dict(), "stage_rows": entries}
        for e in entries:
            rate = f"{e['gbps']:8.2f} GB/s" if e["gbps"] is not None else f"skipped: {e['skipped']}"
            log(f"stage {e['stage']:9s} {e['mode']:9s} {e['bytes']:>11,d} B {rate}")
    rows = _allreduce_rows(config, env, device, ctrl, log)
    if config.ddp:
        rows += _ddp_rows(config, env, device, ctrl, log)
    if rank == 0:
        meta = {**env_all, "world_size": dist.get_world_size(), "backends": config.backends, **stage_meta}
        for path, part in ((config.out, "allreduce"), (ddp_path(config.out), "ddp_step")):
            chosen = [r for r in rows if r.op == part]
            if chosen:
                ResultFile(path, meta).save(chosen)
                print(f"wrote {len(chosen)} rows to {path}", flush=True)
    dist.barrier(group=ctrl)
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------------------------------
# The driver


def ddp_path(out: str | os.PathLike[str]) -> Path:
    """Where the DDP rows of a run writing allreduce rows to `out` go: `ddp.json` beside a
    `comms.json`, else `<stem>.ddp.json`."""
    out = Path(out)
    return out.with_name("ddp.json" if out.name == "comms.json" else f"{out.stem}.ddp.json")


def load_comms_results(folder: str | os.PathLike[str]) -> Any:
    """The allreduce and DDP rows of one results folder (`comms.json` and `ddp.json`) as one
    DataFrame (`hfkit.bench.load_results` columns); FileNotFoundError when the folder has neither."""
    import pandas as pd

    from hfkit.bench.results import load_results

    folder = Path(folder)
    files = [folder / "comms.json", ddp_path(folder / "comms.json")]
    frames = [load_results(f) for f in files if f.exists()]
    if not frames:
        raise FileNotFoundError(f"folder: {folder} has no comms.json or ddp.json")
    return pd.concat(frames, ignore_index=True)


def run_comms_benchmark(
    nproc: int = 2,
    backends: Sequence[str] | None = None,
    max_bytes: int | str | None = None,
    min_bytes: int | str = 4 << 10,
    factor: int = 4,
    ddp: bool = True,
    params: int = AF2_PARAMS,
    ddp_reps: int = 5,
    batch: int = 16,
    chunk_mb: float | None = None,
    reps: int = 30,
    budget_s: float = 1.0,
    out: str | os.PathLike[str] | None = None,
    command: str | None = None,
    timeout_s: float = 600.0,
    cpu: bool = False,
    log: Callable[[str], None] | None = print,
) -> list[dict[str, Any]]:
    """Launch the worker under torchrun (`nproc` local ranks) and return the rows it wrote (dicts):
    allreduce rows to `out`, DDP rows to `ddp_path(out)`.

    The worker runs as `python -m torch.distributed.run --standalone --nproc-per-node N -m
    hfkit.bench.comms '<CommsConfig as JSON>'` in a subprocess, killed after `timeout_s` (then a
    RuntimeError with its output tail). `out` keeps the JSON (default: a temporary file, deleted).
    `cpu` forces CPU tensors and gloo even where CUDA exists. The stored command is `command`, else
    the torchrun line.
    """
    tmp = None
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="hfkit-comms-")
        out = Path(tmp.name) / "comms.json"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    config = CommsConfig(
        out=str(out), backends=tuple(backends or default_backends()),
        min_bytes=parse_bytes(min_bytes), max_bytes=None if max_bytes is None else parse_bytes(max_bytes),
        factor=factor, reps=reps, budget_s=budget_s, ddp=ddp, params=params, batch=batch, ddp_reps=ddp_reps,
        chunk_mb=chunk_mb, timeout_s=max(30.0, timeout_s - 30), cpu=cpu,
    )  # fmt: skip
    worker = ["-m", "hfkit.bench.comms"]
    typed = shlex.join(["torchrun", *launcher[3:], *worker, json.dumps(asdict(config))])
    cmd = [*launcher, *worker, json.dumps(asdict(replace(config, command=command or typed)))]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # N ranks share the cores; torchrun would set it anyway
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines: list[str] = []
        deadline = time.monotonic() + timeout_s
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        while True:
            chunk = proc.stdout.readline()
            if chunk:
                lines.append(chunk)
                if log is not None and not chunk.startswith(("W1", "[W", "WARNING", "*****")):
                    log(chunk.rstrip())
                continue
            if proc.poll() is not None:
                rest = proc.stdout.read() or ""
                lines += rest.splitlines(keepends=True)
                break
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                tail = "".join(lines[-40:])
                raise RuntimeError(f"comms benchmark: killed after {timeout_s:.0f} s; output tail:\n{tail}")
            time.sleep(0.05)
        if proc.returncode != 0:
            tail = "".join(lines[-60:])
            raise RuntimeError(f"comms benchmark failed (exit {proc.returncode}); output tail:\n{tail}")
        written = [p for p in (Path(out), ddp_path(out)) if p.exists()]
        return [row for p in written for row in json.loads(p.read_text())["rows"]]
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
