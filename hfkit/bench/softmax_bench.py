"""Fused softmax benchmark: `hfkit.ops.softmax(x, bias, mask)` against eager and `torch.compile`.

The shapes are the Evoformer's attention logits, x [S, H, N, N]: MSA row attention (S MSA rows, H=8,
pair bias [1, H, N, N] shared by every row, key mask [S, 1, 1, N]) and triangle attention (S = N rows,
H=4), in FastFold's semantics `softmax(x + bias + (mask - 1)·1e9)` (`hfkit.ops.softmax_reference`).
Softmax is memory-bound: each row reports GB/s of the minimum traffic (forward: read x and the bias
once, write y; backward: read y and dy, write dx and the bias gradient) as a percentage of the copy
bandwidth measured in the same run. The goal is 80% of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from hfkit.bench.ceilings import Ceilings, resolve_device
from hfkit.bench.kernels import (
    KernelBench,
    KernelRun,
    Steps,
    free_memory,
    max_abs_err,
)
from hfkit.bench.layernorm import DTYPES
from hfkit.bench.results import ResultRow, check_choice
from hfkit.bench.timing import rotating
from hfkit.ops.softmax import MASK_INF

__all__ = [
    "CHECK_TOL",
    "MODES",
    "PROVIDERS",
    "SOFTMAX_SHAPES",
    "eager_softmax",
    "run_softmax_benchmark",
    "softmax_bytes",
    "softmax_shapes",
]

PROVIDERS = ("hfkit", "eager", "compile")
MODES = ("fwd", "fwd+bwd")
# (S, H, N, N): MSA row attention logits (H=8) and triangle attention logits (S = N, H=4).
SOFTMAX_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    (128, 8, 256, 256),
    (256, 8, 384, 384),
    (128, 8, 512, 512),
    (256, 4, 256, 256),
    (384, 4, 384, 384),
)
CPU_SHAPES: tuple[tuple[int, int, int, int], ...] = ((3, 2, 10, 10), (2, 3, 17, 17))
CHECK_TOL = {"bf16": 0.01, "fp16": 2e-3, "fp32": 1e-4}  # max abs error of probabilities in [0, 1]
_CHECK_ROWS = 8


def softmax_shapes(device: torch.device | str | None = None, quick: bool = False) -> list[tuple[int, ...]]:
    """`SOFTMAX_SHAPES` on a GPU (`quick`: the first and the fourth), tiny odd shapes on a CPU."""
    if resolve_device(device).type != "cuda":
        return list(CPU_SHAPES)
    return [SOFTMAX_SHAPES[0], SOFTMAX_SHAPES[3]] if quick else list(SOFTMAX_SHAPES)


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


class _Set(NamedTuple):
    x: torch.Tensor
    bias: torch.Tensor
    mask: torch.Tensor
    dy: torch.Tensor


def _make_set(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> _Set:
    s, h, n, k = shape
    mask = torch.ones(s, 1, 1, k, device=device, dtype=dtype)
    mask[..., k - max(1, k // 64) :] = 0
    return _Set(
        torch.randn(shape, device=device, dtype=dtype, generator=gen),
        torch.randn((1, h, n, k), device=device, dtype=dtype, generator=gen),
        mask,
        torch.randn(shape, device=device, dtype=dtype, generator=gen),
    )


def _provider_fn(provider: str) -> Callable[..., torch.Tensor]:
    if provider == "hfkit":
        from hfkit.ops import softmax

        return softmax
    if provider == "eager":
        return eager_softmax
    if provider == "compile":
        torch._dynamo.reset()  # a fresh cache per shape, so no shape-generic kernels (see layernorm.py)
        return torch.compile(eager_softmax, dynamic=False)
    raise ValueError(f"providers: unknown provider {provider!r}; expected one of {PROVIDERS}")


def _build(
    f: Callable[..., torch.Tensor], sets: list[_Set], backward: bool, dtype_name: str
) -> Callable[[], Steps]:
    def build() -> Steps:
        leaves = [
            (s.x.detach().requires_grad_(backward), s.bias.detach().requires_grad_(backward)) for s in sets
        ]

        def run(k: int) -> Callable[[], None]:
            def step() -> None:
                for (x, bias), s in zip(leaves[:k], sets[:k], strict=True):
                    y = f(x, bias, s.mask)
                    if backward:
                        torch.autograd.grad(y, (x, bias), s.dy)

            return step

        def check() -> dict[str, float | bool | int]:
            from hfkit.ops import softmax_reference

            s = sets[0]
            r = min(_CHECK_ROWS, s.x.shape[0])
            y = f(*leaves[0], s.mask)[:r]
            with torch.no_grad():
                ref = softmax_reference(s.x[:r].float(), s.bias.float(), s.mask[:r].float())
            err = max_abs_err(y, ref)
            return {"max_abs_err_vs_fp32_ref": err, "check_rows": r, "check_ok": err <= CHECK_TOL[dtype_name]}

        return Steps(run(len(sets)), run(1), len(sets), check)

    return build


def run_softmax_benchmark(
    device: torch.device | str | None = None,
    shapes: Sequence[Sequence[int]] | None = None,
    dtypes: Sequence[str] = ("bf16", "fp32"),
    modes: Sequence[str] = MODES,
    providers: Sequence[str] = PROVIDERS,
    progress: bool = True,
    *,
    quick: bool = False,
    ceilings: Ceilings | None = None,
    command: str | None = None,
    warmup: int | None = None,
    reps: int | None = None,
    on_row: Callable[[ResultRow], None] | None = None,
) -> KernelBench:
    """Time the fused softmax over (shape, dtype, provider, mode); return rows, ceilings, skipped.

    shapes: x [S, H, N, K] (bias [1, H, N, K], mask [S, 1, 1, K]); None picks `softmax_shapes`. Each
    provider is checked against `softmax_reference` in float32 before it is timed; the forward+backward
    step differentiates x and the bias. Defaults: warm-up 5, 30 replays on a GPU (1 and 3 on a CPU).
    """

    device = resolve_device(device)
    on_cuda = device.type == "cuda"
    dtypes = check_choice("dtypes", dtypes, list(DTYPES))
    modes = check_choice("modes", modes, MODES)
    providers = check_choice("providers", providers, PROVIDERS)
    shape_list = [
        tuple(int(d) for d in s) for s in (shapes if shapes is not None else softmax_shapes(device, quick))
    ]
    bad = [s for s in shape_list if len(s) != 4 or min(s) <= 0]
    if bad or not shape_list:
        raise ValueError(f"shapes: expected 4-d shapes [S, H, N, K] of positive sizes, got {shape_list}")
    run = KernelRun(
        device,
        total=len(shape_list) * len(dtypes) * len(providers) * len(modes),
        desc="softmax",
        progress=progress,
        ceilings=ceilings,
        command=command,
        warmup=warmup,
        reps=reps,
        gpu_reps=30,
        on_row=on_row,
    )
    for shape in shape_list:
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            itemsize = torch.empty((), dtype=dtype).element_size()
            gen = torch.Generator(device=device).manual_seed(0)
            per_set = softmax_bytes(shape, itemsize, True)
            make = lambda: _make_set(shape, dtype, device, gen)  # noqa: B023 - used before the loop moves on
            sets = rotating(make, per_set, 256 << 20, 4) if on_cuda else [make()]
            for provider in providers:
                f = _provider_fn(provider)
                for mode in modes:
                    backward = mode == "fwd+bwd"
                    run.measure(
                        f"{'x'.join(map(str, shape))} {dtype_name} {mode} {provider}",
                        op="softmax",
                        provider=provider,
                        mode=mode,
                        shape=shape,
                        dtype=dtype_name,
                        nbytes=softmax_bytes(shape, itemsize, backward),
                        flops=None,
                        build=_build(f, sets, backward, dtype_name),
                        extra={
                            "rotating_sets": len(sets),
                            "bias": [1, *shape[1:]],
                            "mask": [shape[0], 1, 1, shape[3]],
                        },
                    )
            del sets
            free_memory(device)
    return run.result()
