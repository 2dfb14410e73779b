"""Long-sequence inference benchmark (`hfkit bench longseq`): one Evoformer block at AlphaFold's sizes
(`af2_initial`: c_m 256, c_z 128; S = 128 MSA rows), inference (no grad, dropout off), time and peak
memory against the number of residues N and the chunk size, on one device.

Rows (`ResultRow`s, every one measured by the shared runner's `measure_case` unless said otherwise):

- `longseq_block`, one per (N, provider, chunk): providers `hfkit_unchunked` (the `to_hfkit` block's
  forward, chunk_size None), `hfkit_chunked` (the same forward with its own `chunk_size`: attention,
  outer product mean and transitions chunked, out of place) and `hfkit_lean`
  (`hfkit.model.inference.lean_forward` of the same block: in place, every op chunked; chunk "auto"
  chooses per op from free memory), and `openfold_chunked`: OpenFold's own `EvoformerBlock` (from
  `hfkit.bench.peers.load_openfold`; skipped rows where it is absent) as its inference runs it, its
  `chunk_size` for every chunked op and residual updates in place (`OPENFOLD_INFERENCE`), int chunks
  only, with its own random weights (no error check). `peak_mem_bytes` is the peak above the inputs;
  `extra` has `total_peak_bytes` (peak + inputs + parameters) and, at N <= `check_max_n`, the relative error
  against the unchunked forward.
- `longseq_stack_estimate`: 48 x (the preset's block count) a `longseq_block` or `longseq_max_n` row's
  times: an estimate of the stack's inference time, not a measurement (`extra["estimate"]` says so);
  the stack's parameters add little to one block's peak.
- `longseq_max_n`: the largest N whose `hfkit_lean` block runs: N doubled from `search_start` until a
  run fails for lack of memory (or `search_limit` is reached), then bisected to `search_resolution`.
  Each attempt is one call in its own out-of-memory guard, with memory freed between attempts; the
  row's time is that one call's wall time (first call on those shapes), `extra["attempts"]` lists them.
- `longseq_stack`, with `stack_n`: a real run of the preset's whole stack (48 blocks) through
  `lean_forward` at N = `stack_n`.

Profiles: "full" (a GPU: N = 1024, 2048, 4096; chunks 32, 64, 128, auto; search from 4096 to 32768 at
a resolution of 256) and "smoke" (a CPU in seconds: the `tiny` preset, S = 4, N = 9, 16, chunks 4, 5,
auto; the search capped at N = 24, where a CPU never runs out of memory). On a CPU hfkit's ops run
their plain-torch references.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hfkit.bench.ceilings import Ceilings, bench_ceilings, resolve_device
from hfkit.bench.model import bench_config, evoformer_block_flops, make_block, reference_ops_on_cpu
from hfkit.bench.peers import load_openfold, openfold_evoformer_block
from hfkit.bench.results import (
    ENV_KEYS,
    ResultFile,
    ResultRow,
    check_choice,
    environment_info,
    make_row,
    row_key,
)
from hfkit.bench.runner import (
    DTYPES,
    Steps,
    free_memory,
    max_abs_err,
    measure_case,
    pick_profile,
    randomize_parameters,
)
from hfkit.bench.timing import Timing
from hfkit.model import EvoformerStack, ModelConfig
from hfkit.model.inference import lean_forward, resolve_chunk_sizes

__all__ = [
    "LONGSEQ_PROFILES",
    "PROVIDERS",
    "LongseqProfile",
    "largest_fitting_n",
    "run_longseq_benchmark",
    "summary_table",
]

PROVIDERS = ("hfkit_unchunked", "hfkit_chunked", "hfkit_lean", "openfold_chunked")
# OpenFold's inference settings: its own chunked forward, residual updates in place.
OPENFOLD_INFERENCE = {"use_lma": False, "inplace_safe": True, "_mask_trans": True}
# Relative error (max |difference| / max |reference|) against the unchunked forward above which a
# row is flagged: bf16 rounding differs between chunkings by ~1e-2 at most; a wrong chunk gives O(1).
CHECK_REL_TOL = {"bf16": 0.05, "fp16": 0.05, "fp32": 1e-4}


@dataclass(frozen=True)
class LongseqProfile:
    """What a profile runs: the preset, MSA depth S, the N values and chunks of the block rows, the
    largest N checked against the unchunked forward, and the largest-N search's start, limit and
    resolution."""

    config: ModelConfig
    n_seq: int
    sizes: tuple[int, ...]
    chunks: tuple[int | str, ...]
    check_max_n: int
    search_start: int
    search_limit: int
    search_resolution: int


LONGSEQ_PROFILES: dict[str, LongseqProfile] = {
    "full": LongseqProfile(
        config=bench_config(quick=False),
        n_seq=128,
        sizes=(1024, 2048, 4096),
        chunks=(32, 64, 128, "auto"),
        check_max_n=1024,
        search_start=4096,
        search_limit=32768,
        search_resolution=256,
    ),
    "smoke": LongseqProfile(
        config=bench_config(quick=True),
        n_seq=4,
        sizes=(9, 16),
        chunks=(4, 5, "auto"),
        check_max_n=16,
        search_start=8,
        search_limit=24,
        search_resolution=4,
    ),
}


def largest_fitting_n(fits: Callable[[int], bool], start: int, limit: int, resolution: int) -> int | None:
    """The largest N for which `fits(N)` holds, found by doubling N from `start` (capped at `limit`)
    until it fails, then bisecting between the largest N that fit and the smallest that failed until
    they are `resolution` apart (bisection points are multiples of `resolution`). None if no N tried
    fits. `fits` is called once per N tried, in order."""
    for name, value in (("start", start), ("limit", limit), ("resolution", resolution)):
        if value < 1:
            raise ValueError(f"{name}: expected >= 1, got {value}")
    lo, hi = 0, None  # lo: the largest N that fit (0: none yet); hi: the smallest that failed
    n = min(start, limit)
    while hi is None:
        if not fits(n):
            hi = n
        elif n >= limit:
            return n
        else:
            lo, n = n, min(2 * n, limit)
    while hi - lo > resolution:
        mid = (lo + hi) // 2 // resolution * resolution
        if mid <= lo:
            mid = lo + resolution
        if mid >= hi:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo or None


def _hfkit_module(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """`module` randomized, on `device` in `dtype`, in eval mode, with hfkit's fused modules swapped in."""
    import hfkit.nn  # noqa: F401 - registers every swap
    from hfkit.nn.convert import to_hfkit

    module = randomize_parameters(module).to(device, dtype).eval()
    return to_hfkit(module)


def _inputs(config: ModelConfig, s: int, n: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """m [1, S, N, c_m], z [1, N, N, c_z] (random) and all-ones masks."""
    gen = torch.Generator(device=device).manual_seed(seed)
    m = torch.randn((1, s, n, config.c_m), device=device, dtype=dtype, generator=gen)
    z = torch.randn((1, n, n, config.c_z), device=device, dtype=dtype, generator=gen)
    return (
        m,
        z,
        torch.ones((1, s, n), device=device, dtype=dtype),
        torch.ones((1, n, n), device=device, dtype=dtype),
    )


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _forward(block: nn.Module, provider: str, chunk: int | str | None, inputs, offload_msa: bool):
    """One inference call of `provider`; returns (m, z). The lean path and OpenFold's (in place, as its
    inference runs) update `inputs` in place."""
    m, z, msa_mask, pair_mask = inputs
    with torch.no_grad():
        if provider == "openfold_chunked":
            return block(m, z, msa_mask, pair_mask, chunk_size=chunk, **OPENFOLD_INFERENCE)
        if provider == "hfkit_lean":
            return lean_forward(block, m, z, msa_mask, pair_mask, chunk_size=chunk, offload_msa=offload_msa)
        return block(m, z, msa_mask, pair_mask, chunk_size=None if provider == "hfkit_unchunked" else chunk)


@dataclass
class _Run:
    """What the run shares: device, dtype, row environment, ceilings, the result file and the rows."""

    device: torch.device
    dtype: str
    env: dict[str, Any]
    ceilings: Ceilings | None
    file: ResultFile | None
    progress: Any
    rows: list[ResultRow]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def add(self, row: ResultRow) -> ResultRow:
        self.rows.append(row)
        self.progress.update(1)
        if self.file is not None:
            self.file.save(self.rows, ceilings=self.ceilings, partial=True)
        return row

    def cpu_path(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if self.device.type == "cuda" else reference_ops_on_cpu()


def _block_steps(
    run: _Run,
    block: nn.Module,
    provider: str,
    chunk: int | str | None,
    shape: tuple[int, int],
    config: ModelConfig,
    reference: Callable[[], tuple | None],
    offload_msa: bool,
) -> Steps:
    """The runner's `Steps` for one block row: inputs made here (inside the runner's guard, so running
    out of memory while making them gives an error row), one call a step, and a check that returns the
    row's notes (input and parameter bytes, the lean path's chunks) and, where `reference()` is not
    None (N <= the profile's `check_max_n`), the error against the unchunked forward."""
    s, n = shape
    inputs = _inputs(config, s, n, run.device, run.torch_dtype)
    notes: dict[str, Any] = {
        "inputs_bytes": _nbytes(inputs),
        "params_bytes": _nbytes(list(block.parameters())),
    }
    if provider == "hfkit_lean":
        notes["chunks"] = resolve_chunk_sizes(block, inputs[0], inputs[1], chunk)
    call = functools.partial(_forward, block, provider, chunk, inputs, offload_msa)

    def check() -> dict[str, Any]:
        ref = reference()
        if ref is None:
            return notes
        fresh = [t.clone() for t in ref[2]]  # the reference's own inputs (the lean path consumes them)
        m, z = _forward(block, provider, chunk, fresh, offload_msa)
        errs = {
            "rel_err_m_vs_unchunked": max_abs_err(m, ref[0]) / max(float(ref[0].abs().max()), 1e-30),
            "rel_err_z_vs_unchunked": max_abs_err(z, ref[1]) / max(float(ref[1].abs().max()), 1e-30),
        }
        return {**notes, **errs, "check_ok": max(errs.values()) <= CHECK_REL_TOL[run.dtype]}

    return Steps(call, call, 1, check)


def _estimate_row(run: _Run, row: ResultRow, n_blocks: int) -> ResultRow:
    """`n_blocks` x the times of a block row (an estimate, not a measurement)."""
    scale = lambda v: v * n_blocks  # noqa: E731
    timing = Timing(scale(row.p20_ms), scale(row.p50_ms), scale(row.p80_ms), row.n_reps, row.method)
    keep = ("chunk_size", "chunks", "total_peak_bytes", "inputs_bytes", "params_bytes")
    extra = {k: row.extra[k] for k in keep if k in row.extra}
    extra.update(
        estimate=f"{n_blocks} x one block's time from the {row.op} row (not measured)", n_blocks=n_blocks
    )
    return make_row(
        run.env, timing, op="longseq_stack_estimate", provider=row.provider, mode=row.mode, shape=row.shape,
        dtype=row.dtype, flops=None if row.flops is None else row.flops * n_blocks, ceilings=run.ceilings,
        peak_mem_bytes=row.peak_mem_bytes, extra=extra,
    )  # fmt: skip


class _Reference:
    """The unchunked forward's (m, z, inputs) on fixed inputs at one N, made on first use; None for N
    above `check_max_n` (where it may not fit)."""

    def __init__(
        self, run: _Run, block: nn.Module, config: ModelConfig, shape: tuple[int, int], check_max_n: int
    ) -> None:
        self.run, self.block, self.config, self.shape = run, block, config, shape
        self.checked = shape[1] <= check_max_n
        self.value: tuple | None = None

    def __call__(self) -> tuple | None:
        if self.checked and self.value is None:
            inputs = _inputs(self.config, *self.shape, self.run.device, self.run.torch_dtype, seed=1)
            m, z = _forward(self.block, "hfkit_unchunked", None, [t.clone() for t in inputs], False)
            self.value = (m, z, inputs)
        return self.value


def _openfold_block(run: _Run, config: ModelConfig) -> tuple[nn.Module | None, str | None]:
    """OpenFold's own `EvoformerBlock` at `config`'s sizes (randomized like hfkit's, on the run's device
    and dtype, in eval mode), or (None, why not) where OpenFold is absent (`load_openfold`)."""
    of, reason = load_openfold()
    if of is None:
        return None, reason
    module = randomize_parameters(openfold_evoformer_block(of, config)).to(run.device, run.torch_dtype).eval()
    return module, None


def _bench_blocks(
    run: _Run,
    profile: LongseqProfile,
    block: nn.Module,
    sizes: Sequence[int],
    chunks: Sequence[int | str],
    providers: Sequence[str],
    offload_msa: bool,
    timing: tuple[int, int],
) -> None:
    config, s = profile.config, profile.n_seq
    theirs, why_not = _openfold_block(run, config) if "openfold_chunked" in providers else (None, None)
    for n in sizes:
        reference = _Reference(run, block, config, (s, n), profile.check_max_n)
        for provider in providers:
            for chunk in [None] if provider == "hfkit_unchunked" else chunks:
                if provider in ("hfkit_chunked", "openfold_chunked") and chunk == "auto":
                    continue  # "auto" is the lean path's choice; the module's forward takes an int
                notes = {"chunk_size": chunk, "n_blocks": 1, "grad": False, "dropout": "off"}
                if provider == "hfkit_lean":
                    notes["offload_msa"] = offload_msa
                key = dict(op="longseq_block", provider=provider, mode="fwd", shape=[s, n], dtype=run.dtype)
                flops = evoformer_block_flops(s, n, config)
                module, check_against = block, reference
                if provider == "openfold_chunked":
                    if theirs is None:
                        notes["error"] = f"skipped: {why_not}"
                        row = make_row(run.env, None, ceilings=run.ceilings, flops=flops, extra=notes, **key)
                        run.add(row)
                        continue
                    notes["inference"] = "OpenFold's EvoformerBlock, its own weights: " + ", ".join(
                        f"{k}={v}" for k, v in OPENFOLD_INFERENCE.items()
                    )
                    # Other weights than hfkit's block: no error check against its forward.
                    module, check_against = theirs, lambda: None
                build = functools.partial(
                    _block_steps, run, module, provider, chunk, (s, n), config, check_against, offload_msa
                )
                with run.cpu_path():
                    row = measure_case(
                        env=run.env, ceilings=run.ceilings, device=run.device, **key, nbytes=0, flops=flops,
                        build=build, warmup=timing[0], reps=timing[1], extra=notes, graph=False,
                    )  # fmt: skip
                if row.peak_mem_bytes is not None and "inputs_bytes" in row.extra:
                    row.extra["total_peak_bytes"] = (
                        row.peak_mem_bytes + row.extra["inputs_bytes"] + row.extra["params_bytes"]
                    )
                run.add(row)
                if row.method != "error":
                    run.add(_estimate_row(run, row, config.no_blocks))
                free_memory(run.device)
        del reference
        free_memory(run.device)


def _lean_once(
    run: _Run, block: nn.Module, config: ModelConfig, s: int, n: int, chunk: int | str, offload_msa: bool
) -> dict[str, Any]:
    """One `lean_forward` call of `block` at N = n: wall seconds (synchronized), peak bytes above the
    inputs and in total, and the chunks used. Raises what the call raises (out of memory)."""
    device = run.device
    inputs = _inputs(config, s, n, device, run.torch_dtype)
    chunks = resolve_chunk_sizes(block, inputs[0], inputs[1], chunk)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    with run.cpu_path():
        _forward(block, "hfkit_lean", chunk, inputs, offload_msa)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    record: dict[str, Any] = {"n": n, "fits": True, "seconds": seconds, "chunks": chunks}
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        record.update(peak_mem_bytes=int(peak - base), total_peak_bytes=int(peak))
    return record


def _attempt(
    run: _Run, block: nn.Module, config: ModelConfig, s: int, n: int, chunk: int | str, offload_msa: bool
) -> dict[str, Any]:
    """`_lean_once` in its own out-of-memory guard; memory is freed after it either way."""
    error = None
    try:
        record = _lean_once(run, block, config, s, n, chunk, offload_msa)
    except torch.OutOfMemoryError as err:
        error = " ".join(f"{type(err).__name__}: {err}".split())[:300]
    if error is not None:  # outside the except block: its traceback (and the tensors it holds) is gone
        record = {"n": n, "fits": False, "error": error}
    free_memory(run.device)
    run.progress.set_postfix_str(f"N={n} {'fits' if record['fits'] else 'out of memory'}")
    return record


def _bench_max_n(
    run: _Run,
    profile: LongseqProfile,
    block: nn.Module,
    chunk: int | str,
    offload_msa: bool,
    search: tuple[int, int, int],
) -> None:
    """The largest-N search's row (and its 48-block estimate); an error row if the search fails."""
    config, s = profile.config, profile.n_seq
    start, limit, resolution = search
    attempts: list[dict[str, Any]] = []

    def fits(n: int) -> bool:
        attempts.append(_attempt(run, block, config, s, n, chunk, offload_msa))
        return attempts[-1]["fits"]

    extra: dict[str, Any] = {
        "chunk_size": chunk, "offload_msa": offload_msa, "search_start": start, "search_limit": limit,
        "search_resolution": resolution, "attempts": attempts, "grad": False, "dropout": "off",
    }  # fmt: skip
    error = best = None
    try:
        best = largest_fitting_n(fits, start, limit, resolution)
    except Exception as err:  # noqa: BLE001 - a failed search gives an error row, not a lost run
        error = " ".join(f"{type(err).__name__}: {err}".split())[:300]
    free_memory(run.device)
    if best is None:
        extra["error"] = error or f"no N from {start} down to {resolution} fits"
        row = make_row(
            run.env, None, op="longseq_max_n", provider="hfkit_lean", mode="fwd", shape=[s, 0],
            dtype=run.dtype, ceilings=run.ceilings, extra=extra,
        )  # fmt: skip
        run.add(row)
        return
    record = next(a for a in attempts if a["n"] == best and a["fits"])
    extra.update(
        capped=best >= limit,
        chunks=record["chunks"],
        timing="one call, the first on these shapes (wall clock, synchronized)",
    )
    if "total_peak_bytes" in record:
        extra["total_peak_bytes"] = record["total_peak_bytes"]
    ms = record["seconds"] * 1e3
    row = make_row(
        run.env, Timing(ms, ms, ms, 1, "wall"), op="longseq_max_n", provider="hfkit_lean", mode="fwd",
        shape=[s, best], dtype=run.dtype, flops=evoformer_block_flops(s, best, config),
        ceilings=run.ceilings, peak_mem_bytes=record.get("peak_mem_bytes"), extra=extra,
    )  # fmt: skip
    run.add(row)
    run.add(_estimate_row(run, row, config.no_blocks))


def _bench_stack(
    run: _Run, profile: LongseqProfile, n: int, chunk: int | str, offload_msa: bool, timing: tuple[int, int]
) -> None:
    """A real run of the preset's whole stack through `lean_forward` at N = n."""
    config, s = profile.config, profile.n_seq
    notes = {"chunk_size": chunk, "n_blocks": config.no_blocks, "offload_msa": offload_msa, "grad": False}

    def build() -> Steps:
        stack = _hfkit_module(
            EvoformerStack.from_config(config.replace(msa_dropout=0.0, pair_dropout=0.0)),
            run.device,
            run.torch_dtype,
        )
        inputs = _inputs(config, s, n, run.device, run.torch_dtype)
        chunks = resolve_chunk_sizes(stack, inputs[0], inputs[1], chunk)

        def call() -> None:
            lean_forward(stack, *inputs, chunk_size=chunk, offload_msa=offload_msa)

        return Steps(call, call, 1, lambda: {"chunks": chunks})

    with run.cpu_path():
        row = measure_case(
            env=run.env, ceilings=run.ceilings, device=run.device, op="longseq_stack",
            provider="hfkit_lean", mode="fwd", shape=[s, n], dtype=run.dtype, nbytes=0,
            flops=config.no_blocks * evoformer_block_flops(s, n, config), build=build, warmup=timing[0],
            reps=timing[1], extra=notes, graph=False,
        )  # fmt: skip
    run.add(row)
    free_memory(run.device)


def _row_key(row: Mapping[str, Any]) -> tuple:
    """`row_key` and the chunk size: the same block at two chunk sizes is two configurations."""
    return (*row_key(row), str((row.get("extra") or {}).get("chunk_size")))


def run_longseq_benchmark(
    device: torch.device | str | None = None,
    *,
    profile: str = "full",
    sizes: Sequence[int] | None = None,
    chunks: Sequence[int | str] | None = None,
    providers: Sequence[str] = ("hfkit_unchunked", "hfkit_lean"),
    dtype: str = "bf16",
    search: bool = True,
    search_chunk: int | str = "auto",
    search_start: int | None = None,
    search_limit: int | None = None,
    search_resolution: int | None = None,
    stack_n: int | None = None,
    offload_msa: bool = False,
    out: str | Path | None = None,
    append: bool = False,
    ceilings: Ceilings | None = None,
    command: str | None = None,
    progress: bool = True,
) -> list[ResultRow]:
    """Run the long-sequence benchmark (see the module docstring) on `device`; return its rows.

    `profile` ("full" or "smoke", `LONGSEQ_PROFILES`) gives the defaults of `sizes` (N of the block
    rows), `chunks` (ints or "auto" for the chunked and lean providers) and the search's start, limit
    and resolution; `search_chunk` is the lean path's chunk in the search and the stack run. `search`
    False skips the largest-N search; `stack_n` adds a real run of the whole stack at that N. Rows are
    saved to `out` after each one (with `append`, rows already there stay unless this run measures the
    same configuration). Ceilings are measured first unless given.
    """
    from tqdm.auto import tqdm

    prof = pick_profile(profile, LONGSEQ_PROFILES)
    device = resolve_device(device)
    providers = check_choice("providers", providers, PROVIDERS)
    check_choice("dtype", [dtype], list(DTYPES))
    sizes = [int(n) for n in (sizes or prof.sizes)]
    chunks = list(chunks or prof.chunks)
    for c in chunks:
        if c != "auto" and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"chunks: expected positive ints or 'auto', got {c!r}")
    if any(n < 1 for n in sizes):
        raise ValueError(f"sizes: expected positive N values, got {sizes}")
    config, on_cuda = prof.config, device.type == "cuda"
    env = environment_info(device, command)
    ceilings = ceilings or bench_ceilings(device)
    per_n = sum(1 if p == "hfkit_unchunked" else len(chunks) for p in providers)
    bar = tqdm(total=2 * len(sizes) * per_n + 2 * search + (stack_n is not None), disable=not progress)
    run = _Run(
        device=device,
        dtype=dtype,
        env={k: env[k] for k in ENV_KEYS},
        ceilings=ceilings,
        file=None if out is None else ResultFile(out, env, append=append, key=_row_key),
        progress=bar,
        rows=[],
    )
    timing = (1, 3) if on_cuda else (0, 1)  # (warmup, reps): a block takes seconds at long N
    try:
        block = _hfkit_module(make_block(config), device, run.torch_dtype)
        _bench_blocks(run, prof, block, sizes, chunks, providers, offload_msa, timing)
        if search:
            limits = (
                search_start or prof.search_start,
                search_limit or prof.search_limit,
                search_resolution or prof.search_resolution,
            )
            _bench_max_n(run, prof, block, search_chunk, offload_msa, limits)
        del block
        free_memory(device)
        if stack_n is not None:
            _bench_stack(run, prof, stack_n, search_chunk, offload_msa, (0, 1))
    finally:
        bar.close()
    if run.file is not None:
        run.file.save(run.rows, ceilings=ceilings)
    return run.rows


def summary_table(rows: Sequence[ResultRow]) -> Any:
    """A readable table of longseq rows: op, provider, S x N, chunk, seconds (p50), peak GiB above the
    inputs and in total, whether it is an estimate, and the error if any."""
    import pandas as pd

    def gib(v: Any) -> float:
        return math.nan if v is None else float(v) / 2**30

    return pd.DataFrame(
        {
            "op": [r.op for r in rows],
            "provider": [r.provider for r in rows],
            "S x N": ["x".join(map(str, r.shape)) for r in rows],
            "chunk": [str(r.extra.get("chunk_size")) for r in rows],
            "p50 s": [r.p50_ms / 1e3 for r in rows],
            "peak GiB": [gib(r.peak_mem_bytes) for r in rows],
            "total GiB": [gib(r.extra.get("total_peak_bytes")) for r in rows],
            "estimate": ["estimate" in r.extra for r in rows],
            "error": [r.extra.get("error", "") for r in rows],
        }
    ).round({"p50 s": 3, "peak GiB": 2, "total GiB": 2})
