"""LayerNorm benchmark: hfkit's fused LayerNorm against eager (`F.layer_norm`) and `torch.compile`.

The shapes are the LayerNorm inputs of an AlphaFold 2 training step (the census in hfai's AlphaFold
article, where LayerNorm was about 30% of GPU time) plus hfai.nn's own benchmark shape, normalized over
the last dim. LayerNorm is memory-bound, so each row reports GB/s against the device-to-device copy
ceiling measured in the same run, and `extra` carries a copy of the same tensor timed the same way: the
practical floor for that shape (`copy_gbps_same_size`, `copy_floor_ms`).

`TILES` (`hfkit bench layer_norm --tiles`) sweeps the kernels alone: the forward over (BLOCK_M,
num_warps), the backward over (BLOCK_M, num_warps, programs per SM, next-block prefetch, per-slot
weight-grad partials): the data behind `hfkit.ops.layer_norm._fwd_config`/`_bwd_config`.
"""

from __future__ import annotations

import importlib
import itertools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from hfkit.bench.ceilings import Ceilings, resolve_device
from hfkit.bench.results import ResultRow
from hfkit.bench.runner import (
    DTYPES,
    MODES,
    Option,
    Prepared,
    ShapeCase,
    Steps,
    TileSweep,
    op_benchmark,
    pick_profile,
    run_benchmark,
)
from hfkit.bench.timing import rotating, time_step
from hfkit.ops._linear import column_sums

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "BENCHMARK",
    "CENSUS_SHAPES",
    "FULL_SHAPES",
    "HFAI_SHAPE",
    "SMOKE_SHAPES",
    "TILES",
    "layer_norm_cases",
    "layernorm_errors",
    "run_layernorm_benchmark",
    "smoke_shape",
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
EPS = 1e-5
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


# The smoke profile: three census shapes, scaled down.
SMOKE_SHAPES: tuple[tuple[int, ...], ...] = tuple(
    smoke_shape(s) for s in ((1, 256, 256, 128), (1, 256, 384), (1, 1, 256, 256, 64))
)


def layer_norm_cases(profile: str = "full", shapes: Sequence[Sequence[int]] | None = None) -> list[ShapeCase]:
    """x shapes (normalized over the last dim): `shapes` when given, else `FULL_SHAPES` (profile
    "full") or `SMOKE_SHAPES` ("smoke")."""
    chosen = (
        shapes if shapes is not None else pick_profile(profile, {"full": FULL_SHAPES, "smoke": SMOKE_SHAPES})
    )
    cases = [ShapeCase(tuple(int(d) for d in s)) for s in chosen]
    if not cases or any(len(c.shape) == 0 or min(c.shape) <= 0 for c in cases):
        raise ValueError(
            f"shapes: expected non-empty shapes of positive sizes, got {[c.shape for c in cases]}"
        )
    return cases


def _torch_layer_norm(
    x: torch.Tensor, normalized_shape: Sequence[int], weight, bias, eps: float
) -> torch.Tensor:
    return F.layer_norm(x, normalized_shape, weight, bias, eps)


def _provider(name: str, case: ShapeCase, device: torch.device) -> Any:
    if name == "hfkit":
        from hfkit.ops import layer_norm

        return layer_norm
    if name == "eager":
        return F.layer_norm
    # A fresh Dynamo cache per case: otherwise the second shape would trigger automatic dynamic shapes
    # and later shapes would run a shape-generic kernel, not what a model compiled at one size gets.
    torch._dynamo.reset()
    return torch.compile(_torch_layer_norm, dynamic=False)


def _prepare(case: ShapeCase, dtype_name: str, device: torch.device) -> Prepared:
    dtype, shape = DTYPES[dtype_name], case.shape
    tensor_bytes = math.prod(shape) * dtype.itemsize
    gen = torch.Generator(device=device).manual_seed(0)

    def make_set() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(shape, device=device, dtype=dtype, generator=gen)
        dy = torch.randn(shape, device=device, dtype=dtype, generator=gen)
        return x, dy, torch.empty_like(x)  # the last: destination of the same-size copy

    on_cuda = device.type == "cuda"
    # On a GPU, enough sets that one loop moves well past L2; on a CPU one set (nothing to defeat).
    sets = rotating(make_set, 3 * tensor_bytes, device=device)
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size if on_cuda else None

    # The same-size copy: the practical floor for a pass over this tensor, timed like the op.
    def copy_loop() -> None:
        for x, _, out in sets:
            out.copy_(x)

    copy_timing, _ = time_step(copy_loop, device, len(sets), 10 if on_cuda else 1, 50 if on_cuda else 3)
    w = torch.randn(shape[-1:], device=device, dtype=dtype, generator=gen)
    b = torch.randn(shape[-1:], device=device, dtype=dtype, generator=gen)
    rot_bytes = len(sets) * 3 * tensor_bytes
    extra = {
        "rotating_sets": len(sets),
        "rotating_bytes": rot_bytes,
        "l2_bytes": l2_bytes,
        # With rotating's max_sets reached, small shapes still fit in L2: their numbers are cache-assisted.
        "l2_resident": bool(l2_bytes is not None and rot_bytes <= l2_bytes),
        "copy_p50_ms": copy_timing.p50,
        "copy_method": copy_timing.method,
        "copy_gbps_same_size": 2 * tensor_bytes / (copy_timing.p50 * 1e-3) / 1e9,
    }
    return Prepared((sets, w, b, tensor_bytes), extra)


def _build(case: ShapeCase, f: Any, prepared: Prepared, mode: str, dtype_name: str) -> Steps:
    sets, w0, b0, tensor_bytes = prepared.inputs
    backward = mode == "fwd+bwd"
    normalized = case.shape[-1:]
    w, b = (t.detach().clone().requires_grad_(backward) for t in (w0, b0))
    pairs = [(x.detach().requires_grad_(backward), dy) for x, dy, _ in sets]

    def run(k: int):
        def step() -> torch.Tensor:
            for x, dy in pairs[:k]:
                y = f(x, normalized, w, b, EPS)
                if backward:
                    torch.autograd.grad(y, (x, w, b), dy)
            return y

        return step

    def check() -> dict[str, Any]:
        # The guard that fast numbers come from right answers: the forward against float64.
        x = sets[0][0].double()
        y_ref = F.layer_norm(x, normalized, w0.double(), b0.double(), EPS)
        y = f(pairs[0][0], normalized, w, b, EPS)
        nbytes = TRAFFIC[mode] * tensor_bytes
        return {
            "max_abs_err_vs_fp64": float((y.detach().double() - y_ref).abs().max()),
            "copy_floor_ms": nbytes / (prepared.extra["copy_gbps_same_size"] * 1e9) * 1e3,
        }

    return Steps(run(len(pairs)), run(1), len(pairs), check)


def _cost(case: ShapeCase, dtype_name: str, mode: str) -> tuple[int, None]:
    itemsize = DTYPES[dtype_name].itemsize
    return TRAFFIC[mode] * math.prod(case.shape) * itemsize, None


def _kernels() -> Any:
    # hfkit.ops re-exports the function `layer_norm`, which shadows the module of the same name.
    return importlib.import_module("hfkit.ops.layer_norm")


def _tile_inputs(case: ShapeCase, dtype_name: str, device: torch.device) -> tuple:
    # Rotating [M, N] sets (x, dy, y, mean, rstd, out) with the statistics the backward reads.
    kernels, dtype = _kernels(), DTYPES[dtype_name]
    n, m = case.shape[-1], math.prod(case.shape[:-1])
    gen = torch.Generator(device=device).manual_seed(0)
    w, b = (torch.randn(n, device=device, dtype=dtype, generator=gen) for _ in range(2))

    def make() -> tuple[torch.Tensor, ...]:
        x, dy = (torch.randn((m, n), device=device, dtype=dtype, generator=gen) for _ in range(2))
        y, mean, rstd = torch.empty_like(x), torch.empty(m, device=device), torch.empty(m, device=device)
        kernels._launch_fwd(x, y, w, b, mean, rstd, EPS, kernels._fwd_config(n, x.element_size()))
        return x, dy, y, mean, rstd, torch.empty_like(x)

    tensor_bytes = m * n * dtype.itemsize
    return rotating(make, 3 * tensor_bytes, device=device), w, b


def _tile_launch(inputs: tuple, pass_: str, tiles: tuple) -> Callable[[], torch.Tensor]:
    kernels, (sets, w, b) = _kernels(), inputs
    m, n = sets[0][0].shape
    if pass_ == "bwd":
        *cfg, per_sm, prefetch, acc2d = tiles
        programs = kernels._bwd_programs(m, tuple(cfg), w.device, per_sm)
        partials = [torch.empty(programs, 2 * n, device=w.device) for _ in sets]

    def step() -> torch.Tensor:
        for i, (x, dy, _, mean, rstd, out) in enumerate(sets):
            if pass_ == "fwd":
                kernels._launch_fwd(x, out, w, b, mean, rstd, EPS, tiles)
            else:
                dwb = partials[i]
                kernels._launch_bwd(x, dy, out, w, mean, rstd, dwb, True, programs, cfg, prefetch, acc2d)
                column_sums(dwb)  # as the op sums them
        return out

    return step


def _tile_grid(case: ShapeCase, pass_: str) -> list[tuple]:
    block_n = 1 << (case.shape[-1] - 1).bit_length()
    fits = lambda bm, warps: bm * block_n <= 16384 and warps * 32 <= bm * block_n  # noqa: E731
    if pass_ == "fwd":
        return [(bm, block_n, w) for bm in (1, 2, 4, 8, 16, 32, 64) for w in (1, 2, 4, 8, 16) if fits(bm, w)]
    bm0 = _kernels()._bwd_config(case.shape[-1], 4)[0]
    tiles = [(bm, block_n, w) for bm in sorted({max(1, bm0 // 2), bm0, 2 * bm0}) for w in (1, 2, 4)]
    variants = itertools.product((8, 16, 32), (False, True), (False, True))  # per SM, prefetch, acc2d
    return [(*t, *v) for t, v in itertools.product([t for t in tiles if fits(t[0], t[2])], list(variants))]


def _tile_default(case: ShapeCase, dtype_name: str, pass_: str, device: torch.device) -> tuple:
    kernels, n = _kernels(), case.shape[-1]
    itemsize = DTYPES[dtype_name].itemsize
    if pass_ == "fwd":
        return kernels._fwd_config(n, itemsize)
    cfg = kernels._bwd_config(n, itemsize)
    # What `_bwd_programs` and `_launch_bwd` pick when not told: 16 warps an SM, prefetch for 2-byte types.
    return (*cfg, max(1, 16 // cfg[2]), itemsize < 4, True)


def _tile_cost(case: ShapeCase, dtype_name: str, pass_: str) -> tuple[int, None]:
    # Forward: read x, write y; backward: read x and dy, write dx (statistics and weights are small).
    itemsize = DTYPES[dtype_name].itemsize
    return (2 if pass_ == "fwd" else 3) * math.prod(case.shape) * itemsize, None


TILES = TileSweep(
    passes=("fwd", "bwd"),
    fields={
        "fwd": ("block_m", "block_n", "warps"),
        "bwd": ("block_m", "block_n", "warps", "per_sm", "prefetch", "acc2d"),
    },
    grid=_tile_grid,
    default=_tile_default,
    prepare=_tile_inputs,
    launch=_tile_launch,
    calls=lambda inputs: len(inputs[0]),
    cost=_tile_cost,
)

BENCHMARK = op_benchmark(
    "layer_norm",
    "LayerNorm at AlphaFold's shapes: hfkit vs eager, compile",
    layer_norm_cases,
    (_prepare, _provider, _build, _cost),
    default_dtypes=("fp32", "bf16"),
    options=(Option("shapes", "shapes", "x shapes, e.g. 1x256x256x128,1x256x384"),),
    gpu_warmup=10,
    gpu_reps=50,
    tiles=TILES,
)


def run_layernorm_benchmark(
    device: torch.device | str | None = None,
    shapes: Sequence[Sequence[int]] | None = None,
    dtypes: Sequence[str] = ("fp32", "bf16"),
    modes: Sequence[str] = MODES,
    providers: Sequence[str] = BENCHMARK.providers,
    progress: bool = True,
    *,
    profile: str | None = None,
    ceilings: Ceilings | None = None,
    command: str | None = None,
    warmup: int | None = None,
    reps: int | None = None,
) -> tuple[list[ResultRow], Ceilings]:
    """Time LayerNorm over the (shape, dtype, provider, mode) grid on `device`; return rows and ceilings.

    x: `shape`, normalized over `shape[-1]`, with random weight and bias. "fwd+bwd" also runs
    `torch.autograd.grad(y, (x, w, b), dy)`. `shapes=None` picks `layer_norm_cases(profile)` (profile
    default: "full" on a GPU, "smoke" on a CPU). A failing provider gives an error row.
    """
    device = resolve_device(device)
    profile = profile or ("full" if device.type == "cuda" else "smoke")
    result = run_benchmark(
        BENCHMARK, layer_norm_cases(profile, shapes), device, dtypes=dtypes, modes=modes, providers=providers,
        progress=progress, ceilings=ceilings, command=command, warmup=warmup, reps=reps,
    )  # fmt: skip
    return result.rows, result.ceilings


def layernorm_errors(
    shapes: Sequence[Sequence[int]],
    dtypes: Sequence[str] = ("fp32", "bf16"),
    device: torch.device | str | None = None,
    eps: float = EPS,
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
            x0, w0, b0, dy = (
                torch.randn(s, device=device, dtype=dtype, generator=gen)
                for s in (shape, normalized, normalized, shape)
            )
            results = []
            for f in (layer_norm, F.layer_norm):
                x, w, b = (t.detach().clone().requires_grad_(True) for t in (x0, w0, b0))
                y = f(x, normalized, w, b, eps)
                results.append((y.detach(), *torch.autograd.grad(y, (x, w, b), dy)))
            y64 = F.layer_norm(x0.double(), normalized, w0.double(), b0.double(), eps)
            diffs = [float((a.float() - t.float()).abs().max()) for a, t in zip(*results, strict=True)]
            records.append(
                {"shape": "x".join(map(str, shape)), "dtype": dtype_name}
                | dict(zip(("y", "dx", "dweight", "dbias"), diffs, strict=True))
                | {"torch_y_vs_fp64": float((results[1][0].double() - y64).abs().max())}
            )
    return pd.DataFrame.from_records(records)
