"""Fused softmax benchmark: `hfkit.ops.softmax(x, bias, mask)` against eager and `torch.compile`.

The shapes are the Evoformer's attention logits, x [S, H, N, N]: MSA row attention (S MSA rows, H=8,
pair bias [1, H, N, N] shared by every row, key mask [S, 1, 1, N]) and triangle attention (S = N rows,
H=4), in FastFold's semantics `softmax(x + bias + (mask - 1)·1e9)` (`hfkit.ops.softmax_reference`).
Softmax is memory-bound: each row reports GB/s of the minimum traffic (forward: read x and the bias
once, write y; backward: read y and dy, write dx and the bias gradient) as a percentage of the copy
bandwidth measured in the same run. The goal is 80% of it.

`TILES` (`hfkit bench softmax --tiles`) sweeps the forward and backward kernels alone over (rows a
program, num_warps): the data behind `hfkit.ops.softmax._config`.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hfkit.bench.runner import (
    DTYPES,
    Option,
    Prepared,
    ShapeCase,
    Steps,
    TileSweep,
    max_abs_err,
    op_benchmark,
    pick_profile,
)
from hfkit.bench.timing import rotating
from hfkit.ops.softmax import MASK_INF

__all__ = [
    "BENCHMARK",
    "CHECK_TOL",
    "SOFTMAX_SHAPES",
    "TILES",
    "eager_softmax",
    "softmax_bytes",
    "softmax_cases",
]

# (S, H, N, N): MSA row attention logits (H=8) and triangle attention logits (S = N, H=4).
SOFTMAX_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (128, 8, 256, 256),
    (256, 8, 384, 384),
    (128, 8, 512, 512),
    (256, 4, 256, 256),
    (384, 4, 384, 384),
)
SMOKE_SHAPES: tuple[tuple[int, int, int, int], ...] = ((3, 2, 10, 10), (2, 3, 17, 17))
CHECK_TOL = {"bf16": 0.01, "fp16": 2e-3, "fp32": 1e-4}  # max abs error of probabilities in [0, 1]
_CHECK_ROWS = 8


def softmax_cases(profile: str = "full", shapes: Sequence[Sequence[int]] | None = None) -> list[ShapeCase]:
    """x shapes [S, H, N, K]: `shapes` when given, else `SOFTMAX_SHAPES` ("full") or tiny odd ones
    ("smoke")."""
    chosen = (
        shapes
        if shapes is not None
        else pick_profile(profile, {"full": SOFTMAX_SHAPES, "smoke": SMOKE_SHAPES})
    )
    cases = [ShapeCase(tuple(int(d) for d in s)) for s in chosen]
    if not cases or any(len(c.shape) != 4 or min(c.shape) <= 0 for c in cases):
        raise ValueError(
            f"shapes: expected 4-d shapes [S, H, N, K] of positive sizes, got {[c.shape for c in cases]}"
        )
    return cases


def softmax_bytes(shape: Sequence[int], itemsize: int, backward: bool) -> int:
    """Minimum traffic of one call on x [S, H, N, K] with bias [1, H, N, K] and a mask [S, 1, 1, K]
    of the same itemsize: read x, bias and mask, write y; the backward reads y and dy and writes dx
    and dbias."""
    s, h, n, k = shape
    x = s * h * n * k * itemsize
    bias = h * n * k * itemsize
    fwd = 2 * x + bias + s * k * itemsize
    return fwd + 3 * x + bias if backward else fwd


def eager_softmax(x: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`softmax(x + bias + (mask - 1)·1e9)` over the last dim with torch ops in x's dtype, as a model
    written in plain PyTorch does it (each add a separate pass over the logits)."""
    return torch.softmax(x + bias + (mask - 1.0) * MASK_INF, dim=-1)


def _provider(name: str, case: ShapeCase, device: torch.device) -> Any:
    if name == "hfkit":
        from hfkit.ops import softmax

        return softmax
    if name == "eager":
        return eager_softmax
    torch._dynamo.reset()  # a fresh cache per case, so no shape-generic kernels (see layer_norm.py)
    return torch.compile(eager_softmax, dynamic=False)


def _prepare(case: ShapeCase, dtype_name: str, device: torch.device) -> Prepared:
    dtype, (s, h, n, k) = DTYPES[dtype_name], case.shape
    gen = torch.Generator(device=device).manual_seed(0)

    def make() -> tuple[torch.Tensor, ...]:
        mask = torch.ones(s, 1, 1, k, device=device, dtype=dtype)
        mask[..., k - max(1, k // 64) :] = 0
        x, bias, dy = (
            torch.randn(t, device=device, dtype=dtype, generator=gen)
            for t in (case.shape, (1, h, n, k), case.shape)
        )
        return x, bias, mask, dy

    per_set = softmax_bytes(case.shape, dtype.itemsize, True)
    sets = rotating(make, per_set, 256 << 20, 4, device=device)
    return Prepared(sets, {"rotating_sets": len(sets), "bias": [1, h, n, k], "mask": [s, 1, 1, k]})


def _build(case: ShapeCase, f: Any, prepared: Prepared, mode: str, dtype_name: str) -> Steps:
    backward = mode == "fwd+bwd"
    sets = prepared.inputs
    leaves = [
        (x.detach().requires_grad_(backward), b.detach().requires_grad_(backward)) for x, b, _, _ in sets
    ]

    def run(k: int):
        def step() -> None:
            for (x, bias), (_, _, mask, dy) in zip(leaves[:k], sets[:k], strict=True):
                y = f(x, bias, mask)
                if backward:
                    torch.autograd.grad(y, (x, bias), dy)

        return step

    def check() -> dict[str, Any]:
        from hfkit.ops import softmax_reference

        x, bias, mask, _ = sets[0]
        r = min(_CHECK_ROWS, x.shape[0])
        y = f(*leaves[0], mask)[:r]
        with torch.no_grad():
            ref = softmax_reference(x[:r].float(), bias.float(), mask[:r].float())
        err = max_abs_err(y, ref)
        return {"max_abs_err_vs_fp32_ref": err, "check_rows": r, "check_ok": err <= CHECK_TOL[dtype_name]}

    return Steps(run(len(sets)), run(1), len(sets), check)


def _cost(case: ShapeCase, dtype_name: str, mode: str) -> tuple[int, None]:
    itemsize = DTYPES[dtype_name].itemsize
    return softmax_bytes(case.shape, itemsize, mode == "fwd+bwd"), None


def _kernels() -> Any:
    # hfkit.ops re-exports the function `softmax`, which shadows the module of the same name.
    return importlib.import_module("hfkit.ops.softmax")


def _tile_inputs(case: ShapeCase, dtype_name: str, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    # The benchmark's rotating (x, bias, mask, dy) sets, with each set's y and an output buffer.
    sets = _prepare(case, dtype_name, device).inputs
    return [(*t, torch.ops.hfkit.softmax_fwd(*t[:3]), torch.empty_like(t[0])) for t in sets]


def _tile_launch(
    sets: list[tuple[torch.Tensor, ...]], pass_: str, tiles: tuple
) -> Callable[[], torch.Tensor]:
    kernels = _kernels()

    def step() -> torch.Tensor:
        for x, bias, mask, dy, y, out in sets:
            if pass_ == "fwd":
                kernels.launch_fwd(x, bias, mask, out, tiles)
            else:
                kernels.launch_bwd(dy, y, out, tiles)
        return out

    return step


def _tile_cost(case: ShapeCase, dtype_name: str, pass_: str) -> tuple[int, None]:
    # The backward kernel reads y and dy and writes dx; the bias gradient is a separate reduction.
    itemsize = DTYPES[dtype_name].itemsize
    x_bytes = itemsize * case.shape[0] * case.shape[1] * case.shape[2] * case.shape[3]
    return (softmax_bytes(case.shape, itemsize, False) if pass_ == "fwd" else 3 * x_bytes), None


_TILE_GRID = list(itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8, 16)))  # (rows a program, num_warps)
TILES = TileSweep(
    passes=("fwd", "bwd"),
    fields={"fwd": ("block_m", "warps"), "bwd": ("block_m", "warps")},
    grid=lambda case, pass_: _TILE_GRID,
    default=lambda case, dtype_name, pass_, device: _kernels()._config(case.shape[-1], pass_),
    prepare=_tile_inputs,
    launch=_tile_launch,
    calls=len,
    cost=_tile_cost,
)

BENCHMARK = op_benchmark(
    "softmax",
    "fused softmax with pair bias and key mask: hfkit vs eager, compile",
    softmax_cases,
    (_prepare, _provider, _build, _cost),
    default_dtypes=("bf16", "fp32"),
    options=(Option("shapes", "shapes", "x shapes SxHxNxK, e.g. 128x8x256x256"),),
    gpu_reps=30,
    tiles=TILES,
)
