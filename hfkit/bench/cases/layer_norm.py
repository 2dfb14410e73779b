"""LayerNorm benchmark: hfkit's fused LayerNorm against eager (`F.layer_norm`) and `torch.compile`.

The shapes are the LayerNorm inputs of an AlphaFold 2 training step (the census in hfai's AlphaFold
article, where LayerNorm was about 30% of GPU time) plus hfai.nn's own benchmark shape, normalized over
the last dim. LayerNorm is memory-bound, so each row reports GB/s against the device-to-device copy
ceiling measured in the same run, and `extra` carries a copy of the same tensor timed the same way: the
practical floor for that shape (`copy_gbps_same_size`, `copy_floor_ms`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from hfkit.bench.ceilings import Ceilings, resolve_device
from hfkit.bench.results import ResultRow
from hfkit.bench.runner import (
    DTYPES,
    MODES,
    Benchmark,
    Option,
    Prepared,
    ShapeCase,
    Steps,
    pick_profile,
    run_benchmark,
)
from hfkit.bench.timing import rotating, time_step

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "BENCHMARK",
    "CENSUS_SHAPES",
    "FULL_SHAPES",
    "HFAI_SHAPE",
    "SMOKE_SHAPES",
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
    tensor_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator(device=device).manual_seed(0)

    def make_set() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(shape, device=device, dtype=dtype, generator=gen)
        dy = torch.randn(shape, device=device, dtype=dtype, generator=gen)
        return x, dy, torch.empty_like(x)  # the last: destination of the same-size copy

    on_cuda = device.type == "cuda"
    # On a GPU, enough sets that one loop moves well past L2; on a CPU one set (nothing to defeat).
    sets = rotating(make_set, 3 * tensor_bytes) if on_cuda else [make_set()]
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
    itemsize = torch.empty((), dtype=DTYPES[dtype_name]).element_size()
    return TRAFFIC[mode] * math.prod(case.shape) * itemsize, None


BENCHMARK = Benchmark(
    name="layer_norm",
    description="LayerNorm at AlphaFold's shapes: hfkit vs eager, compile",
    providers=("hfkit", "eager", "compile"),
    dtypes=tuple(DTYPES),
    default_dtypes=("fp32", "bf16"),
    cases=layer_norm_cases,
    prepare=_prepare,
    provider=_provider,
    build=_build,
    cost=_cost,
    options=(Option("shapes", "shapes", "x shapes, e.g. 1x256x256x128,1x256x384"),),
    gpu_warmup=10,
    gpu_reps=50,
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
