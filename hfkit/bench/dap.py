"""DAP benchmark (`hfkit bench dap`): one Evoformer block run with Dynamic Axial Parallelism over G local
processes (nccl on GPUs, one GPU a process; gloo on CPU), against the same block on one process, with
duality async on and off.

Rows (`ResultRow`s, op "dap_block", shape [S, N], one per (N, provider, mode), mode "fwd" or
"fwd+bwd"):

- provider `single_process`: the block on rank 0 alone (the other ranks idle at a barrier), full inputs;
- `dap_overlap`: `to_dap(block, group, overlap=True).forward_sharded` on every rank's shards (inputs
  padded to multiples of G and sharded before timing, as a stack shards once);
- `dap_sync`: the same with `overlap=False` (every collective waited for where it is launched).

Times are wall clock (CUDA synchronized) of one call per repetition, every rank starting after a
barrier; a repetition's time is its slowest rank's. fwd+bwd runs backward of the outputs' sum, the
parameter gradients' all-reduce over the group included. `peak_mem_bytes` is the largest rank's peak
above its inputs (CUDA; None on a CPU), `extra["peak_mem_bytes_per_rank"]` every rank's.
`extra["comm_elements"]` is `hfkit.parallel.dap.dap_block_comm` (elements each rank receives in one
block's forward, by collective), `comm_bytes` the mode's total per rank (fwd+bwd: twice the forward,
plus `param_grad_elements` all-reduced once), `speedup_vs_single` the single-process p50 over this
row's. `max_rel_err_vs_single` (DAP rows): max |DAP - single| / max |single| of the forward outputs on
the check inputs (every rank runs the single block for it).

Profiles: "full" (GPUs: `af2_initial` sizes, S = 128, N = 256, 512, bf16, fused ops swapped in) and
"smoke" (a CPU in seconds: the `tiny` preset, S = 6, N = 12, 17 (17: padded), fp32, plain torch).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hfkit.bench.model import bench_config, evoformer_block_flops, make_block
from hfkit.bench.results import ENV_KEYS, ResultFile, ResultRow, check_choice, environment_info, make_row
from hfkit.bench.runner import DTYPES, MODES, pick_profile
from hfkit.bench.timing import Timing
from hfkit.model import ModelConfig

__all__ = [
    "DAP_PROFILES",
    "PROVIDERS",
    "DapProfile",
    "dap_results_folder",
    "run_dap_benchmark",
    "summary_table",
]

PROVIDERS = ("single_process", "dap_overlap", "dap_sync")


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
    extra_notes: dict[str, Any] = field(default_factory=dict)


def dap_results_folder(device_slug: str, nproc: int) -> str:
    """The results folder of a DAP run: the device's slug ('cpu', 'h200'), with `x<G>` for G > 1 GPUs
    (results depend on the GPU count), as `hfkit bench comms` names its folders."""
    return f"{device_slug}x{nproc}" if device_slug != "cpu" and nproc > 1 else device_slug


def _perturbed_block(profile: DapProfile, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The preset's block (dropout off, eval), every parameter perturbed (its zero-initialised output
    projections would make the check trivial), on `device` in `dtype`; fused modules swapped in when the
    profile says so."""
    torch.manual_seed(0)  # the initialisation: the same on every rank, forked or spawned
    block = make_block(profile.config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    block = block.to(device, dtype).eval()
    if profile.fused:
        from hfkit.nn.convert import to_hfkit

        block = to_hfkit(block)
    return block


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


def _call(fn: Any, args: Sequence[torch.Tensor], backward: bool, module: nn.Module) -> None:
    """One forward (with `backward`: forward and backward of the outputs' sum) of fn(*args)."""
    if not backward:
        with torch.no_grad():
            fn(*args)
        return
    module.zero_grad(set_to_none=True)
    args = [a.detach().requires_grad_() if a.is_floating_point() and i < 2 else a for i, a in enumerate(args)]
    out = fn(*args)
    sum(o.float().sum() for o in out).backward()


def _measure(
    fn: Any, args: Sequence[torch.Tensor], backward: bool, module: nn.Module, spec: _Spec, active: bool,
    device: torch.device, ctrl: Any,
) -> dict[str, Any]:  # fmt: skip
    """This rank's per-repetition milliseconds (`samples_ms`, empty where not `active`) and its peak
    bytes above what was allocated before the call (`peak`: CUDA; None elsewhere), or the `error` of
    running out of memory (then the remaining repetitions only keep the barriers). Every repetition
    starts after a barrier on every rank."""
    result: dict[str, Any] = {"samples_ms": [], "peak": None}
    base = 0
    for i in range(spec.warmup + spec.reps + 1):
        dist.barrier(group=ctrl)
        if not active:
            continue
        if i == spec.warmup and device.type == "cuda":  # the first call after warm-up: the peak
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        error = None
        _sync(device)
        start = time.perf_counter()
        try:
            _call(fn, args, backward, module)
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
    from hfkit.parallel.dap import pad_to_multiple, to_dap

    group_size = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if spec.cuda else torch.device("cpu")
    ctrl = dist.new_group(backend="gloo") if spec.cuda else None  # barriers off the measured group
    dtype = DTYPES[spec.dtype]
    block = _perturbed_block(spec.profile, device, dtype)
    daps = {"dap_overlap": to_dap(block, None, overlap=True), "dap_sync": to_dap(block, None, overlap=False)}
    out: dict[str, Any] = {}
    for n in spec.sizes:
        full = _inputs(spec.profile.config, spec.n_seq, n, device, dtype)
        with torch.no_grad():
            expected = block(*full)
            got = daps["dap_overlap"](*full)
        errs = [
            float((g - e).abs().max() / e.abs().max().clamp_min(1e-30))
            for g, e in zip(got, expected, strict=True)
        ]
        out[f"check {n}"] = max(errs)
        del expected, got
        padded = [pad_to_multiple(pad_to_multiple(t, 1, group_size), 2, group_size) for t in full]
        sharded = (
            padded[0].chunk(group_size, 1)[rank].contiguous(),
            padded[1].chunk(group_size, 1)[rank].contiguous(),
        )
        sharded_args = (*sharded, padded[2], padded[3])
        for provider in spec.providers:
            for mode in spec.modes:
                key = f"{provider} {mode} {n}"
                backward = mode == "fwd+bwd"
                if provider == "single_process":
                    fn, args, active, module = block, full, rank == 0, block
                else:
                    dap = daps[provider]
                    fn = lambda *a, dap=dap, n=n: dap.forward_sharded(*a, spec.n_seq, n)  # noqa: E731
                    args, active, module = sharded_args, True, dap
                out[key] = _measure(fn, args, backward, module, spec, active, device, ctrl)
                if "error" in out[key] and provider != "single_process":
                    raise RuntimeError(f"{key}: {out[key]['error']}")  # the peers wait at a collective
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return out


def _rows(results: list[dict[str, Any]], spec: _Spec, env: dict[str, Any], backend: str) -> list[ResultRow]:
    """The rows from every rank's results."""
    from hfkit.parallel.dap import dap_block_comm

    config, g = spec.profile.config, len(results)
    elem = torch.tensor([], dtype=DTYPES[spec.dtype]).element_size()
    n_params = sum(p.numel() for p in make_block(config).parameters())
    rows: list[ResultRow] = []
    for n in spec.sizes:
        comm = dap_block_comm(spec.n_seq, n, config, g)
        single_p50: dict[str, float] = {}
        for provider in spec.providers:
            for mode in spec.modes:
                per_rank = [r[f"{provider} {mode} {n}"] for r in results]
                dap = provider != "single_process"
                extra: dict[str, Any] = {"nproc": g, "backend": backend, "overlap": provider == "dap_overlap"}
                extra.update(spec.extra_notes)
                if dap:
                    fwd_elems = sum(comm.values())
                    total = fwd_elems * (2 if mode == "fwd+bwd" else 1)
                    total += n_params if mode == "fwd+bwd" else 0
                    extra.update(
                        comm_elements=comm, comm_bytes=total * elem, param_grad_elements=n_params,
                        max_rel_err_vs_single=results[0][f"check {n}"],
                    )  # fmt: skip
                flops = evoformer_block_flops(spec.n_seq, n, config) * (3 if mode == "fwd+bwd" else 1)
                common = dict(
                    op="dap_block", provider=provider, mode=mode, shape=[spec.n_seq, n], dtype=spec.dtype,
                    flops=flops,
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
    out: str | Path | None = None,
    append: bool = False,
    command: str | None = None,
    timeout_s: float = 600.0,
) -> list[ResultRow]:
    """Run the DAP benchmark (see the module docstring) over `nproc` local processes; return its rows.

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
    spec = _Spec(
        profile=prof, sizes=sizes, n_seq=n_seq or prof.n_seq, dtype=dtype, modes=modes, providers=providers,
        cuda=cuda, warmup=prof.warmup if warmup is None else warmup, reps=reps or prof.reps,
    )  # fmt: skip
    if not cuda:
        spec = replace(spec, extra_notes={"threads_per_rank": 1})
    backend = "nccl" if cuda else "gloo"
    env = environment_info(resolved, command)
    results = spawn_local(_rank_main, nproc, spec, backend=backend, timeout_s=timeout_s)
    rows = _rows(results, spec, {k: env[k] for k in ENV_KEYS}, backend)
    if out is not None:
        meta = {**env, "world_size": nproc, "backend": backend}
        ResultFile(out, meta, append=append).save(rows)
    return rows


def summary_table(rows: Sequence[ResultRow]) -> Any:
    """A readable table of dap_block rows: provider, mode, S x N, p50 ms, speedup over one process,
    the largest rank's peak MiB, MiB each rank receives, and the error if any."""
    import pandas as pd

    mib = lambda v: math.nan if v is None else float(v) / 2**20  # noqa: E731
    return pd.DataFrame(
        {
            "provider": [r.provider for r in rows],
            "mode": [r.mode for r in rows],
            "S x N": ["x".join(map(str, r.shape)) for r in rows],
            "G": [r.extra.get("nproc") for r in rows],
            "p50 ms": [r.p50_ms for r in rows],
            "speedup": [r.extra.get("speedup_vs_single", math.nan) for r in rows],
            "peak MiB": [mib(r.peak_mem_bytes) for r in rows],
            "comm MiB": [mib(r.extra.get("comm_bytes", 0)) for r in rows],
            "rel err": [r.extra.get("max_rel_err_vs_single", math.nan) for r in rows],
            "error": [r.extra.get("error", "") for r in rows],
        }
    ).round({"p50 ms": 2, "speedup": 2, "peak MiB": 1, "comm MiB": 3})
