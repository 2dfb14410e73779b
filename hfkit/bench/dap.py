"""DAP benchmark (`hfkit bench dap`): one Evoformer block, or a stack of K blocks, run with Dynamic Axial
Parallelism over G local processes (nccl on GPUs, one GPU a process; gloo on CPU), against the same
module on one process, with duality async on and off.

Rows (`ResultRow`s, op "dap_block" (K = 1) or "dap_stack", shape [S, N], one per (N, provider, mode),
mode "fwd" or "fwd+bwd"):

- provider `single_process`: the module on rank 0 alone (the other ranks idle at a barrier), full inputs;
- `dap_overlap`: `to_dap(module, group, overlap=True).forward_sharded` on every rank's shards (inputs
  padded to multiples of the DAP group size and sharded before timing, as a stack shards once);
- `dap_sync`: the same with `overlap=False` (every collective waited for where it is launched).

Times are wall clock (CUDA synchronized) of one call per repetition, every rank starting after a
barrier; a repetition's time is its slowest rank's. `launch` "eager" calls the module from Python
(the host's launch cost included: a block at af2_initial sizes is host-bound so); "graph" captures each
provider's whole call (forward, and backward with its collectives: nccl records them into the graph)
as one CUDA graph per rank after three warm-up calls and times its replays, so that the GPU's work
is what scales (`extra["launch"]`; single-process data parallelism is not captured: not with
`dap_size` < G). fwd+bwd runs backward of the outputs' sum, the
parameter gradients' all-reduce over the group included. `peak_mem_bytes` is the largest rank's peak
above its inputs (CUDA; None on a CPU), `extra["peak_mem_bytes_per_rank"]` every rank's.
`extra["comm_elements"]` is `hfkit.parallel.dap.dap_block_comm` (elements each rank receives in one
block's forward, by collective), `comm_bytes` the mode's total per rank (fwd+bwd: twice the forward,
plus `param_grad_elements` all-reduced once), `speedup_vs_single` the single-process p50 over this
row's. `max_rel_err_vs_single` (DAP rows): max |DAP - single| / max |single| of the forward outputs on
the check inputs (every rank runs the single module for it; None where `single_process` is not among
the providers: at the N only DAP fits, ranks keep only their shards).

Layouts and settings (each in `extra`, and in the rows' key, so one results file holds them all):
`dap_size` D (default G): G / D data-parallel replicas of D-rank DAP groups (`dap_groups`), each replica
running the same inputs; in fwd+bwd the replicas then average their parameter gradients with
`hfkit.parallel.ddp.DistributedDataParallel`'s `sync_grad` over the dp group (inside the timed call,
after the backward: with `overlap=True` its buckets would hide part of it). `scaling_efficiency` =
`speedup_vs_single` x (G / D) / G: samples a second per GPU against one process's. `n_blocks` K and
`checkpoint` (K > 1: per-block recomputation in backward, the collectives run again); `chunk_size` (the
modules' chunking, for long-sequence inference: `--modes fwd`). A DAP provider that runs out of memory
stops the run (its peers wait at a collective): sweep N for the largest that fits with one run per N and
`--append`.

Profiles: "full" (GPUs: `af2_initial` sizes, S = 128, N = 256, 512, bf16, fused ops swapped in) and
"smoke" (a CPU in seconds: the `tiny` preset, S = 6, N = 12, 17 (17: padded), fp32, plain torch).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hfkit.bench.model import bench_config, evoformer_block_flops, make_block
from hfkit.bench.results import ENV_KEYS, ResultFile, ResultRow, check_choice, environment_info, make_row
from hfkit.bench.runner import DTYPES, MODES, pick_profile
from hfkit.bench.timing import Timing, capture_graph
from hfkit.model import EvoformerStack, ModelConfig

__all__ = [
    "DAP_PROFILES",
    "LAUNCHES",
    "PROVIDERS",
    "DapProfile",
    "dap_results_folder",
    "dap_row_key",
    "run_dap_benchmark",
    "summary_table",
]

PROVIDERS = ("single_process", "dap_overlap", "dap_sync")
LAUNCHES = ("eager", "graph")


@dataclass(frozen=True)
class DapProfile:
    """What a profile runs: preset, MSA depth S, the N values, dtype, whether hfkit's fused modules are
    swapped in, and (warmup, reps) per configuration."""

    config: ModelConfig
    n_seq: int
    sizes: tuple[int, ...]
    dtype: str
    fused: bool
    warmup: int
    reps: int


DAP_PROFILES: dict[str, DapProfile] = {
    "full": DapProfile(bench_config(quick=False), 128, (256, 512), "bf16", True, 2, 10),
    "smoke": DapProfile(bench_config(quick=True), 6, (12, 17), "fp32", False, 1, 3),
}


@dataclass(frozen=True)
class _Spec:
    """What every rank runs (picklable: GPU ranks are spawned, not forked)."""

    profile: DapProfile
    sizes: tuple[int, ...]
    n_seq: int
    dtype: str
    modes: tuple[str, ...]
    providers: tuple[str, ...]
    cuda: bool
    warmup: int
    reps: int
    n_blocks: int = 1
    checkpoint: bool = False
    dap_size: int | None = None  # None: every rank in one DAP group
    chunk_size: int | None = None
    launch: str = "eager"
    extra_notes: dict[str, Any] = field(default_factory=dict)


def dap_results_folder(device_slug: str, nproc: int) -> str:
    """The results folder of a DAP run: the device's slug ('cpu', 'h200'), with `x<G>` for G > 1 GPUs
    (results depend on the GPU count), as `hfkit bench comms` names its folders."""
    return f"{device_slug}x{nproc}" if device_slug != "cpu" and nproc > 1 else device_slug


def _perturbed_module(spec: _Spec, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The preset's block, or its stack of `spec.n_blocks` blocks (with `spec.checkpoint`), dropout off,
    eval, every parameter perturbed (the zero-initialised output projections would make the check
    trivial), on `device` in `dtype`; fused modules swapped in when the profile says so."""
    torch.manual_seed(0)  # the initialisation: the same on every rank, forked or spawned
    if spec.n_blocks == 1:
        model = make_block(spec.profile.config)
    else:
        config = spec.profile.config.replace(
            no_blocks=spec.n_blocks, msa_dropout=0.0, pair_dropout=0.0, checkpoint=spec.checkpoint
        )
        model = EvoformerStack.from_config(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    model = model.to(device, dtype).eval()
    if spec.profile.fused:
        from hfkit.nn.convert import to_hfkit

        model = to_hfkit(model)
    return model


def _inputs(
    config: ModelConfig, s: int, n: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """m [1, S, N, c_m], z [1, N, N, c_z] (random, the same on every rank), all-ones masks."""
    gen = torch.Generator().manual_seed(1)
    m = torch.randn((1, s, n, config.c_m), generator=gen).to(device, dtype)
    z = torch.randn((1, n, n, config.c_z), generator=gen).to(device, dtype)
    ones = lambda *shape: torch.ones(shape, device=device, dtype=dtype)  # noqa: E731
    return m, z, ones(1, s, n), ones(1, n, n)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _call(fn: Any, args: Sequence[torch.Tensor], backward: bool, module: nn.Module, dp: Any) -> None:
    """One forward (with `backward`: forward and backward of the outputs' sum, then, where `dp` (a
    `_data_parallel` wrapper) is given, the parameter gradients averaged over its group) of fn(*args)."""
    if not backward:
        with torch.no_grad():
            fn(*args)
        return
    module.zero_grad(set_to_none=True)
    args = [a.detach().requires_grad_() if a.is_floating_point() and i < 2 else a for i, a in enumerate(args)]
    out = fn(*args)
    sum(o.float().sum() for o in out).backward()
    if dp is not None:
        dp.sync_grad()


def _data_parallel(model: nn.Module, group: Any) -> Any:
    """The kit's `DistributedDataParallel` over `group` for the blocks' parameters of `model` (a block,
    or a stack: its blocks), which its DAP modules share; `overlap=False`, so its hooks leave every
    backward alone and `sync_grad()` averages the gradients in its buckets after the backward."""
    from hfkit.parallel.ddp import DistributedDataParallel

    blocks = model.blocks if isinstance(model, EvoformerStack) else model
    return DistributedDataParallel(blocks, process_group=group, overlap=False)


def _measure(
    fn: Any, args: Sequence[torch.Tensor], backward: bool, module: nn.Module, spec: _Spec, active: bool,
    device: torch.device, ctrl: Any, dp: Any = None,
) -> dict[str, Any]:  # fmt: skip
    """This rank's per-repetition milliseconds (`samples_ms`, empty where not `active`) and its peak
    bytes above what was allocated before the call (`peak`: CUDA; None elsewhere), or the `error` of
    running out of memory (then the remaining repetitions only keep the barriers). Every repetition
    starts after a barrier on every rank."""
    result: dict[str, Any] = {"samples_ms": [], "peak": None}
    base = 0
    graphed = spec.launch == "graph"
    run = lambda: _call(fn, args, backward, module, dp)  # noqa: E731
    for i in range(spec.warmup + spec.reps + 1):
        dist.barrier(group=ctrl)
        if not active:
            continue
        # The peak of the first call after warm-up (graphs: from before the capture, the pool included).
        if i == (0 if graphed else spec.warmup) and device.type == "cuda":
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        error = None
        try:
            if graphed and i == 0:  # three warm-up calls and the capture (nccl records its collectives)
                run = capture_graph(run).replay
            _sync(device)
            start = time.perf_counter()
            run()
            _sync(device)
        except torch.OutOfMemoryError as err:
            error = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        if error is not None:  # outside the except block: its traceback (and tensors) are gone
            result, active = {"error": error}, False
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        elapsed = (time.perf_counter() - start) * 1e3
        if i == spec.warmup and device.type == "cuda":
            result["peak"] = int(torch.cuda.max_memory_allocated(device) - base)
        elif i > spec.warmup:
            result["samples_ms"].append(elapsed)
    return result


def _rank_main(rank: int, spec: _Spec) -> dict[str, Any]:
    """One rank: for each N, the check and every (provider, mode)'s samples and peak."""
    from hfkit.parallel.dap import dap_groups, pad_to_multiple, to_dap

    device = torch.device("cuda", torch.cuda.current_device()) if spec.cuda else torch.device("cpu")
    ctrl = dist.new_group(backend="gloo") if spec.cuda else None  # barriers off the measured group
    dap_group = dp_group = None
    if spec.dap_size is not None and spec.dap_size < dist.get_world_size():
        groups = dap_groups(spec.dap_size)
        dap_group, dp_group = groups.dap, groups.dp
    group_size, dap_rank = dist.get_world_size(dap_group), dist.get_rank(dap_group)
    dtype = DTYPES[spec.dtype]
    model = _perturbed_module(spec, device, dtype)  # the block or the stack
    replicas = None if dp_group is None else _data_parallel(model, dp_group)
    daps = {
        "dap_overlap": to_dap(model, dap_group, overlap=True),
        "dap_sync": to_dap(model, dap_group, overlap=False),
    }
    chunk = spec.chunk_size
    single = "single_process" in spec.providers
    out: dict[str, Any] = {}
    for n in spec.sizes:
        # Without the single module, the whole inputs stay on the host: each rank moves its shards.
        full = _inputs(spec.profile.config, spec.n_seq, n, device if single else torch.device("cpu"), dtype)
        if single:  # the check needs the whole module on every rank: not where only DAP runs (long N)
            with torch.no_grad():
                expected = model(*full, chunk_size=chunk)
                got = daps["dap_overlap"](*full, chunk_size=chunk)
            errs = [
                float((g - e).abs().max() / e.abs().max().clamp_min(1e-30))
                for g, e in zip(got, expected, strict=True)
            ]
            out[f"check {n}"] = max(errs)
            del expected, got
        padded = [pad_to_multiple(pad_to_multiple(t, 1, group_size), 2, group_size) for t in full]
        sharded = (
            padded[0].chunk(group_size, 1)[dap_rank].contiguous(),
            padded[1].chunk(group_size, 1)[dap_rank].contiguous(),
        )
        sharded_args = tuple(t.to(device) for t in (*sharded, padded[2], padded[3]))
        del padded
        if not single:
            del full  # each rank keeps its shards and the masks only
        for provider in spec.providers:
            for mode in spec.modes:
                key = f"{provider} {mode} {n}"
                backward = mode == "fwd+bwd"
                if provider == "single_process":
                    fn = lambda *a: model(*a, chunk_size=chunk)  # noqa: E731
                    args, active, module, dp = full, rank == 0, model, None
                else:
                    dap = daps[provider]
                    fn = lambda *a, dap=dap, n=n: dap.forward_sharded(*a, spec.n_seq, n, chunk)  # noqa: E731
                    args, active, module, dp = sharded_args, True, dap, replicas
                out[key] = _measure(fn, args, backward, module, spec, active, device, ctrl, dp)
                if "error" in out[key] and provider != "single_process":
                    raise RuntimeError(f"{key}: {out[key]['error']}")  # the peers wait at a collective
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return out


def _rows(results: list[dict[str, Any]], spec: _Spec, env: dict[str, Any], backend: str) -> list[ResultRow]:
    """The rows from every rank's results."""
    from hfkit.parallel.dap import dap_block_comm

    config, g, k = spec.profile.config, len(results), spec.n_blocks
    d = spec.dap_size or g
    elem = torch.tensor([], dtype=DTYPES[spec.dtype]).element_size()
    n_params = k * sum(p.numel() for p in make_block(config).parameters())  # the blocks' (not s's linear)
    layout = {"n_blocks": k, "checkpoint": spec.checkpoint, "dap_size": d, "dp_size": g // d}
    layout.update(chunk_size=spec.chunk_size, launch=spec.launch)
    rows: list[ResultRow] = []
    for n in spec.sizes:
        comm = {name: k * v for name, v in dap_block_comm(spec.n_seq, n, config, d).items()}
        single_p50: dict[str, float] = {}
        for provider in spec.providers:
            for mode in spec.modes:
                per_rank = [r[f"{provider} {mode} {n}"] for r in results]
                dap = provider != "single_process"
                extra: dict[str, Any] = {"nproc": g, "backend": backend, "overlap": provider == "dap_overlap"}
                extra.update(layout, **spec.extra_notes)
                if dap:
                    fwd_elems = sum(comm.values())
                    total = fwd_elems * (2 if mode == "fwd+bwd" else 1)
                    total += n_params if mode == "fwd+bwd" else 0
                    extra.update(
                        comm_elements=comm, comm_bytes=total * elem, param_grad_elements=n_params,
                        max_rel_err_vs_single=results[0].get(f"check {n}"),
                    )  # fmt: skip
                    if mode == "fwd+bwd" and g > d:
                        extra["dp_grad_elements"] = n_params  # one flat all-reduce over the dp group
                flops = k * evoformer_block_flops(spec.n_seq, n, config) * (3 if mode == "fwd+bwd" else 1)
                common = dict(
                    op="dap_block" if k == 1 else "dap_stack", provider=provider, mode=mode,
                    shape=[spec.n_seq, n], dtype=spec.dtype, flops=flops,
                )  # fmt: skip
                failed = [r["error"] for r in per_rank if "error" in r]
                if failed:
                    extra["error"] = failed[0]
                    rows.append(make_row(env, None, **common, extra=extra))
                    continue
                active = [r for r in per_rank if r["samples_ms"]]
                slowest = [max(reps) for reps in zip(*(r["samples_ms"] for r in active), strict=True)]
                timing = Timing.from_samples(slowest, "wall")
                peaks = [r["peak"] for r in active]
                extra["peak_mem_bytes_per_rank"] = peaks
                if not dap:
                    single_p50[mode] = timing.p50
                elif mode in single_p50:
                    extra["speedup_vs_single"] = single_p50[mode] / timing.p50
                    extra["scaling_efficiency"] = extra["speedup_vs_single"] * (g // d) / g
                peak = None if any(p is None for p in peaks) else max(peaks)
                rows.append(make_row(env, timing, **common, peak_mem_bytes=peak, extra=extra))
    return rows


def run_dap_benchmark(
    nproc: int = 2,
    *,
    device: str | None = None,
    profile: str | None = None,
    sizes: Sequence[int] | None = None,
    n_seq: int | None = None,
    dtype: str | None = None,
    modes: Sequence[str] = MODES,
    providers: Sequence[str] = PROVIDERS,
    warmup: int | None = None,
    reps: int | None = None,
    n_blocks: int = 1,
    checkpoint: bool = False,
    dap_size: int | None = None,
    chunk_size: int | None = None,
    launch: str = "eager",
    out: str | Path | None = None,
    append: bool = False,
    command: str | None = None,
    timeout_s: float = 600.0,
) -> list[ResultRow]:
    """Run the DAP benchmark (see the module docstring) over `nproc` local processes; return its rows.

    `n_blocks` K: one block (1) or a stack of K blocks, with per-block recomputation where
    `checkpoint`; `dap_size` D (a divisor of `nproc`; default `nproc`): `nproc` / D data-parallel
    replicas of D-rank DAP groups; `chunk_size`: the modules' chunking (None: none); `launch` "eager" or
    "graph" (the module docstring).

    `device` "cpu" runs gloo on CPU processes even where GPUs exist; otherwise GPUs (nccl, one a process:
    `nproc` must not exceed the GPU count) if any. `profile` ("full" or "smoke", `DAP_PROFILES`; default
    full on GPUs, smoke on a CPU) gives the defaults of `sizes` (N), `n_seq` (S), `dtype`, `warmup` and
    `reps`. Rows go to `out` when given (with `append`, rows already there stay unless this run
    measures the same configuration). Every rank is killed after `timeout_s` (a RuntimeError then).
    """
    from hfkit.bench.ceilings import resolve_device
    from hfkit.parallel.launch import spawn_local

    resolved = resolve_device(device)
    cuda = resolved.type == "cuda"
    if nproc < 1:
        raise ValueError(f"nproc: expected >= 1, got {nproc}")
    if cuda and nproc > torch.cuda.device_count():
        raise ValueError(
            f"nproc: expected at most the {torch.cuda.device_count()} GPUs (nccl: one a rank), got {nproc}"
        )
    prof = pick_profile(profile or ("full" if cuda else "smoke"), DAP_PROFILES)
    dtype = dtype or prof.dtype
    check_choice("dtype", [dtype], list(DTYPES))
    modes = tuple(check_choice("modes", modes, MODES))
    providers = tuple(check_choice("providers", providers, PROVIDERS))
    sizes = tuple(int(n) for n in (sizes or prof.sizes))
    if any(n < 1 for n in sizes):
        raise ValueError(f"sizes: expected positive N values, got {list(sizes)}")
    if not isinstance(n_blocks, int) or n_blocks < 1:
        raise ValueError(f"n_blocks: expected >= 1, got {n_blocks!r}")
    if checkpoint and n_blocks == 1:
        raise ValueError("checkpoint: recomputes the blocks of a stack; expected n_blocks > 1")
    if dap_size is not None and (not isinstance(dap_size, int) or dap_size < 1 or nproc % dap_size):
        raise ValueError(f"dap_size: expected a positive divisor of nproc {nproc}, got {dap_size!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")
    if launch not in LAUNCHES:
        raise ValueError(f"launch: expected one of {', '.join(LAUNCHES)}, got {launch!r}")
    if launch == "graph" and (not cuda or (dap_size is not None and dap_size < nproc)):
        raise ValueError("launch: 'graph' needs CUDA and one DAP group of every rank (no dap_size < nproc)")
    spec = _Spec(
        profile=prof, sizes=sizes, n_seq=n_seq or prof.n_seq, dtype=dtype, modes=modes, providers=providers,
        cuda=cuda, warmup=prof.warmup if warmup is None else warmup, reps=reps or prof.reps,
        n_blocks=n_blocks, checkpoint=checkpoint, dap_size=dap_size, chunk_size=chunk_size, launch=launch,
    )  # fmt: skip
    if not cuda:
        spec = replace(spec, extra_notes={"threads_per_rank": 1})
    backend = "nccl" if cuda else "gloo"
    env = environment_info(resolved, command)
    results = spawn_local(_rank_main, nproc, spec, backend=backend, timeout_s=timeout_s)
    rows = _rows(results, spec, {k: env[k] for k in ENV_KEYS}, backend)
    if out is not None:
        meta = {**env, "world_size": nproc, "backend": backend}
        ResultFile(out, meta, append=append, key=dap_row_key).save(rows)
    return rows


def dap_row_key(row: Mapping[str, Any]) -> tuple:
    """`row_key` and the layout: processes, blocks, DAP group size, chunk size, checkpointing and launch
    (rows written before these were recorded: one block, one DAP group of every rank, no chunking,
    eager). GPU runs of different process counts go to different folders; CPU runs share one."""
    from hfkit.bench.results import row_key

    extra = row.get("extra") or {}
    g = extra.get("nproc")
    layout = (g, extra.get("n_blocks", 1), extra.get("dap_size", g), extra.get("chunk_size"))
    return (*row_key(row), *layout, extra.get("checkpoint", False), extra.get("launch", "eager"))


def summary_table(rows: Sequence[ResultRow]) -> Any:
    """A readable table of DAP rows: provider, mode, S x N, processes G, DAP group size D, blocks K,
    p50 ms, speedup over one process and scaling efficiency, the largest rank's peak MiB, MiB each rank
    receives, and the error if any."""
    import pandas as pd

    mib = lambda v: math.nan if v is None else float(v) / 2**20  # noqa: E731
    return pd.DataFrame(
        {
            "provider": [r.provider for r in rows],
            "mode": [r.mode for r in rows],
            "S x N": ["x".join(map(str, r.shape)) for r in rows],
            "G": [r.extra.get("nproc") for r in rows],
            "D": [r.extra.get("dap_size", r.extra.get("nproc")) for r in rows],
            "K": [r.extra.get("n_blocks", 1) for r in rows],
            "p50 ms": [r.p50_ms for r in rows],
            "speedup": [r.extra.get("speedup_vs_single", math.nan) for r in rows],
            "efficiency": [r.extra.get("scaling_efficiency", math.nan) for r in rows],
            "peak MiB": [mib(r.peak_mem_bytes) for r in rows],
            "comm MiB": [mib(r.extra.get("comm_bytes", 0)) for r in rows],
            "rel err": [r.extra.get("max_rel_err_vs_single", math.nan) for r in rows],
            "error": [r.extra.get("error", "") for r in rows],
        }
    ).round({"p50 ms": 2, "speedup": 2, "efficiency": 2, "peak MiB": 1, "comm MiB": 3})
