"""LayerNorm benchmark: hfkit's fused LayerNorm against torch eager and torch.compile.

The shapes are the LayerNorm inputs of an AlphaFold 2 training step (the census in hfai's AlphaFold
article, where LayerNorm was about 30% of GPU time) plus hfai.nn's own benchmark shape, normalized over
the last dim. LayerNorm is memory-bound, so each row reports GB/s against the device-to-device copy
ceiling measured in the same run, and `extra` carries a copy of the same tensor timed the same way: the
practical floor for that shape. Every provider is timed alike: a CUDA graph of a loop over rotating
input sets (so the L2 cache is not what is measured), with CUDA events as the fallback.
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from hfkit.bench.ceilings import Ceilings, bench_ceilings, resolve_device
from hfkit.bench.results import ResultRow, check_choice, row_environment, rows_to_frame, with_speedup
from hfkit.bench.timing import peak_memory, rotating, time_step

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "CENSUS_SHAPES",
    "DTYPES",
    "FULL_SHAPES",
    "GPU_QUICK_SHAPES",
    "HFAI_SHAPE",
    "MODES",
    "PROVIDERS",
    "default_shapes",
    "layernorm_errors",
    "run_layernorm_benchmark",
    "smoke_shape",
    "summary_table",
]

# AlphaFold 2 LayerNorm input shapes from hfai's step profile (the census), normalized over the last dim.
CENSUS_SHAPES: tuple[tuple[int, ...], ...] = (
    (1, 256, 256, 128),
    (1, 132, 256, 256),
    (1, 1, 256, 256, 64),
    (1, 128, 256, 256),
    (1, 256, 132, 256),
    (1, 256, 128, 256),
    (1, 256, 384),
    (1, 1024, 256, 64),
    (1, 256, 1024, 64),
    (1, 4, 256, 256, 64),
    (1, 256, 256),
)
# hfai.nn's LayerNorm benchmark configuration.
HFAI_SHAPE: tuple[int, ...] = (200, 128, 1024)
FULL_SHAPES: tuple[tuple[int, ...], ...] = CENSUS_SHAPES + (HFAI_SHAPE,)
# A GPU subset for smoke runs: the largest pair tensor, a small MSA row, the tiniest shape and hfai's.
GPU_QUICK_SHAPES: tuple[tuple[int, ...], ...] = (
    (1, 256, 256, 128),
    (1, 4, 256, 256, 64),
    (1, 256, 384),
    (1, 256, 256),
    HFAI_SHAPE,
)

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES: tuple[str, ...] = ("fwd", "fwd+bwd")
PROVIDERS: tuple[str, ...] = ("hfkit", "torch", "compile")
# Minimum traffic per call in units of the tensor's size: fwd reads x and writes y; fwd+bwd also reads
# x, dy and writes dx in the backward (mean/rstd and the weight/bias traffic are small and left out).
TRAFFIC = {"fwd": 2, "fwd+bwd": 5}


def smoke_shape(shape: Sequence[int], max_rows: int = 16) -> tuple[int, ...]:
    """Scale a shape down for CPU runs: keep the normalized (last) dim, halve the largest leading dim
    until at most `max_rows` rows remain. (1, 256, 256, 128) -> (1, 4, 4, 128)."""
    dims = [int(d) for d in shape]
    while math.prod(dims[:-1]) > max_rows:
        i = max(range(len(dims) - 1), key=lambda j: dims[j])
        dims[i] = max(1, dims[i] // 2)
    return tuple(dims)


# CPU runs (CI, laptops, the Triton interpreter): three census shapes, scaled down.
CPU_SMOKE_SHAPES: tuple[tuple[int, ...], ...] = tuple(
    smoke_shape(s) for s in ((1, 256, 256, 128), (1, 256, 384), (1, 1, 256, 256, 64))
)


def default_shapes(device: torch.device | str | None = None, quick: bool = False) -> list[tuple[int, ...]]:
    """Shapes to run on `device`: all of `FULL_SHAPES` on a GPU (`GPU_QUICK_SHAPES` when quick), and
    the scaled-down `CPU_SMOKE_SHAPES` on a CPU whatever `quick` says."""
    if resolve_device(device).type != "cuda":
        return list(CPU_SMOKE_SHAPES)
    return list(GPU_QUICK_SHAPES if quick else FULL_SHAPES)


def _torch_layer_norm(
    x: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    return F.layer_norm(x, normalized_shape, weight, bias, eps)


def _provider_fn(provider: str) -> Callable[..., torch.Tensor]:
    if provider == "hfkit":
        from hfkit.ops import layer_norm

        return layer_norm
    if provider == "torch":
        return F.layer_norm
    if provider == "compile":
        # A fresh Dynamo cache per configuration: otherwise the second shape would trigger automatic
        # dynamic shapes and later shapes would run a shape-generic kernel, not what a model compiled
        # at one crop size gets. dynamic=False says the same explicitly.
        torch._dynamo.reset()
        return torch.compile(_torch_layer_norm, dynamic=False)
    raise ValueError(f"provider: expected one of {PROVIDERS}, got {provider!r}")


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def run_layernorm_benchmark(
    device: torch.device | str | None = None,
    shapes: Sequence[Sequence[int]] | None = None,
    dtypes: Sequence[str] = ("fp32", "bf16"),
    modes: Sequence[str] = MODES,
    providers: Sequence[str] = PROVIDERS,
    progress: bool = True,
    *,
    quick: bool = False,
    ceilings: Ceilings | None = None,
    command: str | None = None,
    warmup: int | None = None,
    reps: int | None = None,
    eps: float = 1e-5,
) -> tuple[list[ResultRow], Ceilings]:
    """Time LayerNorm over the (shape, dtype, mode, provider) grid on `device`; return rows and ceilings.

    x: `shape`, normalized over `shape[-1]`, with random weight and bias. `mode` is "fwd" (y = f(x)) or
    "fwd+bwd" (also `torch.autograd.grad(y, (x, w, b), dy)`); providers are "hfkit"
    (`hfkit.ops.layer_norm`), "torch" (`F.layer_norm` eager) and "compile" (`torch.compile` of a
    function calling `F.layer_norm`). `shapes=None` picks `default_shapes(device, quick)`: the census on
    a GPU, tiny shapes on a CPU. Ceilings are measured first unless given. `command` is stored in every
    row (default: this process's command line). Shapes are freed before the next one starts.
    """
    from tqdm.auto import tqdm

    device = resolve_device(device)
    on_cuda = device.type == "cuda"
    check_choice("dtypes", dtypes, list(DTYPES))
    check_choice("modes", modes, MODES)
    check_choice("providers", providers, PROVIDERS)
    shape_list = [
        tuple(int(d) for d in s) for s in (shapes if shapes is not None else default_shapes(device, quick))
    ]
    if not shape_list or any(len(s) == 0 or min(s) <= 0 for s in shape_list):
        raise ValueError(f"shapes: expected non-empty shapes of positive sizes, got {shape_list}")
    warmup = warmup if warmup is not None else (10 if on_cuda else 2)
    reps = reps if reps is not None else (50 if on_cuda else 10)

    ceilings = ceilings or bench_ceilings(device)
    row_env = row_environment(device, command)
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size if on_cuda else None

    rows: list[ResultRow] = []
    bar = tqdm(
        total=len(shape_list) * len(dtypes) * len(modes) * len(providers),
        disable=not progress,
        desc="layernorm",
    )
    for shape in shape_list:
        for dtype_name in dtypes:
            rows.extend(
                _bench_shape(
                    shape,
                    DTYPES[dtype_name],
                    device,
                    modes,
                    providers,
                    ceilings,
                    row_env,
                    l2_bytes,
                    warmup,
                    reps,
                    eps,
                    bar,
                )
            )
            # Free this shape's rotating sets and graph pools before allocating the next one's.
            gc.collect()
            if on_cuda:
                torch.cuda.empty_cache()
    bar.close()
    return rows, ceilings


def _bench_shape(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    modes: Sequence[str],
    providers: Sequence[str],
    ceilings: Ceilings,
    row_env: dict[str, Any],
    l2_bytes: int | None,
    warmup: int,
    reps: int,
    eps: float,
    bar: Any,
) -> list[ResultRow]:
    on_cuda = device.type == "cuda"
    normalized = (shape[-1],)
    tensor_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator(device=device).manual_seed(0)

    def make_set() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(shape, device=device, dtype=dtype, generator=gen)
        dy = torch.randn(shape, device=device, dtype=dtype, generator=gen)
        out = torch.empty_like(x)  # destination of the same-size copy
        return x, dy, out

    # On a GPU, enough sets that one loop moves well past L2; on a CPU one set (nothing to defeat).
    sets = rotating(make_set, 3 * tensor_bytes) if on_cuda else [make_set()]
    rot_bytes = len(sets) * 3 * tensor_bytes
    cache_note = {
        "rotating_sets": len(sets),
        "rotating_bytes": rot_bytes,
        "l2_bytes": l2_bytes,
        # With max_sets reached, small shapes still fit in L2: their numbers are cache-assisted.
        "l2_resident": bool(l2_bytes is not None and rot_bytes <= l2_bytes),
    }

    # The same-size copy: the practical floor for a pass over this tensor, timed exactly like the op.
    def copy_loop() -> None:
        for x, _, out in sets:
            out.copy_(x)

    copy_timing, _ = time_step(copy_loop, device, len(sets), warmup, reps)
    copy_gbps_same = 2 * tensor_bytes / (copy_timing.p50 * 1e-3) / 1e9

    w0 = torch.randn(normalized, device=device, dtype=dtype, generator=gen)
    b0 = torch.randn(normalized, device=device, dtype=dtype, generator=gen)
    x_ref = sets[0][0].double()
    y_ref = F.layer_norm(x_ref, normalized, w0.double(), b0.double(), eps)

    rows: list[ResultRow] = []
    for mode in modes:
        backward = mode == "fwd+bwd"
        w = w0.detach().clone().requires_grad_(backward)
        b = b0.detach().clone().requires_grad_(backward)
        xs = [x.detach().requires_grad_(backward) for x, _, _ in sets]
        dys = [dy for _, dy, _ in sets]
        nbytes = TRAFFIC[mode] * tensor_bytes
        for provider in providers:
            bar.set_postfix_str(f"{'x'.join(map(str, shape))} {_dtype_name(dtype)} {mode} {provider}")
            f = _provider_fn(provider)
            step = _make_step(f, xs, dys, w, b, normalized, eps, backward)
            try:
                timing, note = time_step(step, device, len(xs), warmup, reps)
            except Exception as err:  # noqa: BLE001 - one broken provider must not lose the others' rows
                warnings.warn(
                    f"layernorm benchmark: provider {provider!r} failed on {shape} {dtype} {mode}: "
                    f"{type(err).__name__}: {err}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                bar.update(1)
                continue
            extra: dict[str, Any] = dict(cache_note)
            if note:
                extra["note"] = note
            extra.update(_peak_and_error(f, xs[0], dys[0], w, b, normalized, eps, backward, y_ref))
            gbps = nbytes / (timing.p50 * 1e-3) / 1e9
            copy_floor_ms = nbytes / (copy_gbps_same * 1e9) * 1e3
            extra.update(
                copy_p50_ms=copy_timing.p50,
                copy_method=copy_timing.method,
                copy_gbps_same_size=copy_gbps_same,
                copy_floor_ms=copy_floor_ms,
                pct_copy_same_size=100.0 * gbps / copy_gbps_same,
            )
            peak = extra.pop("peak_mem_bytes", None)
            rows.append(
                ResultRow(
                    **row_env,
                    op="layer_norm",
                    provider=provider,
                    mode=mode,
                    shape=list(shape),
                    dtype=_dtype_name(dtype),
                    p20_ms=timing.p20,
                    p50_ms=timing.p50,
                    p80_ms=timing.p80,
                    method=timing.method,
                    n_reps=timing.n,
                    bytes=nbytes,
                    gbps=gbps,
                    pct_copy=100.0 * gbps / ceilings.copy_gbps if ceilings.copy_gbps > 0 else None,
                    peak_mem_bytes=peak,
                    extra=extra,
                )
            )
            bar.update(1)
    return rows


def _make_step(
    f: Callable[..., torch.Tensor],
    xs: Sequence[torch.Tensor],
    dys: Sequence[torch.Tensor],
    w: torch.Tensor,
    b: torch.Tensor,
    normalized: tuple[int, ...],
    eps: float,
    backward: bool,
) -> Callable[[], None]:
    """One timed call: the op (and its backward) on every rotating set in turn."""

    def step() -> None:
        for x, dy in zip(xs, dys, strict=True):
            y = f(x, normalized, w, b, eps)
            if backward:
                torch.autograd.grad(y, (x, w, b), dy)

    return step


def _peak_and_error(
    f: Callable[..., torch.Tensor],
    x: torch.Tensor,
    dy: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor,
    normalized: tuple[int, ...],
    eps: float,
    backward: bool,
    y_ref: torch.Tensor,
) -> dict[str, Any]:
    """One extra call on the first set: peak memory above what was allocated (CUDA only) and the
    forward's max abs error against float64, a guard that fast numbers come from right answers."""

    def call() -> torch.Tensor:
        y = f(x, normalized, w, b, eps)
        if backward:
            torch.autograd.grad(y, (x, w, b), dy)
        return y

    peak, y = peak_memory(call, x.device)
    out: dict[str, Any] = {"max_abs_err_vs_fp64": float((y.detach().double() - y_ref).abs().max())}
    if peak is not None:
        out["peak_mem_bytes"] = peak
    return out


def layernorm_errors(
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[str] = ("fp32", "bf16"),
    device: torch.device | str | None = None,
    eps: float = 1e-5,
    seed: int = 0,
) -> pd.DataFrame:
    """Max abs differences between `hfkit.ops.layer_norm` and `F.layer_norm`, forward and gradients.

    For each shape (x: [*, C], normalized over C) and dtype, draws random x, weight, bias and dy, runs
    both forward and backward, and reports max |hfkit - torch| for y, dx, dweight and dbias, plus
    torch's own forward error against float64 (`torch_y_vs_fp64`) as the scale of rounding to expect.
    """
    import pandas as pd

    from hfkit.ops import layer_norm

    device = resolve_device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    records = []
    for shape in shapes:
        shape = tuple(int(d) for d in shape)
        normalized = (shape[-1],)
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            x0 = torch.randn(shape, device=device, dtype=dtype, generator=gen)
            w0 = torch.randn(normalized, device=device, dtype=dtype, generator=gen)
            b0 = torch.randn(normalized, device=device, dtype=dtype, generator=gen)
            dy = torch.randn(shape, device=device, dtype=dtype, generator=gen)
            results = []
            for f in (layer_norm, F.layer_norm):
                x, w, b = (t.detach().clone().requires_grad_(True) for t in (x0, w0, b0))
                y = f(x, normalized, w, b, eps)
                results.append((y.detach(), *torch.autograd.grad(y, (x, w, b), dy)))
            y64 = F.layer_norm(x0.double(), normalized, w0.double(), b0.double(), eps)
            diffs = [float((a.float() - t.float()).abs().max()) for a, t in zip(*results, strict=True)]
            records.append(
                {
                    "shape": "x".join(map(str, shape)),
                    "dtype": dtype_name,
                    "y": diffs[0],
                    "dx": diffs[1],
                    "dweight": diffs[2],
                    "dbias": diffs[3],
                    "torch_y_vs_fp64": float((results[1][0].double() - y64).abs().max()),
                }
            )
    return pd.DataFrame.from_records(records)


def summary_table(results: pd.DataFrame | Sequence[ResultRow], baseline: str = "torch") -> pd.DataFrame:
    """A readable table: shape, dtype, mode, provider, p50 µs, GB/s, % copy, speed-up vs `baseline`."""
    frame = results if not isinstance(results, Sequence) else rows_to_frame(results)
    if "shape_str" not in frame:
        frame = rows_to_frame(frame.to_dict("records"))
    frame = with_speedup(frame, baseline)
    table = frame[["shape_str", "dtype", "mode", "provider", "p50_us", "gbps", "pct_copy", "speedup"]]
    return table.rename(
        columns={
            "shape_str": "shape",
            "p50_us": "p50 µs",
            "gbps": "GB/s",
            "pct_copy": "% copy",
            "speedup": f"speed-up vs {baseline}",
        }
    ).round({"p50 µs": 1, "GB/s": 1, "% copy": 1, f"speed-up vs {baseline}": 2})
