"""MultiheadAttention benchmark: `hfkit.nn.MultiheadAttention` against `torch.nn.MultiheadAttention`
(eager) and `torch.compile` of it.

The cases are hfai.nn's published configurations, self-attention (query = key = value) with
`batch_first=True`: batch 200, sequence 256, embed 1024, 16 heads; and batch 5000, sequence 64,
embed 512, 8 heads. A case's shape is [B, L, E, H]. Every provider gets the same weights and is called
with `need_weights=False` (the call that does not materialise the attention probabilities). The op is
compute-bound: each row reports TFLOP/s of its matmuls (projections and attention) against the bf16
matmul rate measured in the same run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hfkit.bench.cases._module import (
    CHECK_BATCHES,
    CHECK_TOL,
    Wrap,
    check_notes,
    module_provider,
    module_steps,
)
from hfkit.bench.runner import (
    DTYPES,
    Option,
    Prepared,
    ShapeCase,
    Steps,
    max_abs_err,
    op_benchmark,
    pick_profile,
)

__all__ = ["BENCHMARK", "CHECK_TOL", "HFAI_SHAPES", "SMOKE_SHAPES", "mha_flops", "multihead_attention_cases"]

# (B, L, E, H): hfai.nn's two MultiheadAttention configurations.
HFAI_SHAPES: tuple[tuple[int, int, int, int], ...] = ((200, 256, 1024, 16), (5000, 64, 512, 8))
SMOKE_SHAPES: tuple[tuple[int, int, int, int], ...] = ((2, 5, 12, 3), (3, 7, 33, 3))
# Max abs error of the output (values of order 1) against the float32 reference on the same weights.


def multihead_attention_cases(
    profile: str = "full", shapes: Sequence[Sequence[int]] | None = None
) -> list[ShapeCase]:
    """Cases [B, L, E, H]: `shapes` when given, else `HFAI_SHAPES` ("full") or tiny odd ones ("smoke")."""
    chosen = (
        shapes if shapes is not None else pick_profile(profile, {"full": HFAI_SHAPES, "smoke": SMOKE_SHAPES})
    )
    cases = [ShapeCase(tuple(int(d) for d in s)) for s in chosen]
    if not cases or any(len(c.shape) != 4 or min(c.shape) <= 0 or c.shape[2] % c.shape[3] for c in cases):
        raise ValueError(
            "shapes: expected 4-d shapes [B, L, E, H] of positive sizes with E divisible by H, got "
            f"{[c.shape for c in cases]}"
        )
    return cases


def mha_flops(shape: Sequence[int], backward: bool) -> int:
    """Matmul flops of one self-attention call on [B, L, E] with H heads: the q/k/v projection
    (2·B·L·E·3E), scores and their product with v (2 · 2·B·L·L·E) and the output projection
    (2·B·L·E·E); the backward does twice the forward's."""
    b, seq, e, _ = shape
    fwd = 8 * b * seq * e * e + 4 * b * seq * seq * e
    return 3 * fwd if backward else fwd


def _provider(name: str, case: ShapeCase, device: torch.device) -> Wrap:
    return module_provider(name, "MultiheadAttention")


def _prepare(case: ShapeCase, dtype_name: str, device: torch.device) -> Prepared:
    dtype, (b, seq, e, h) = DTYPES[dtype_name], case.shape
    gen = torch.Generator(device=device).manual_seed(0)
    weights = nn.MultiheadAttention(e, h, batch_first=True, device=device, dtype=dtype)
    with torch.no_grad():  # drawn from `gen` (the same in every run), with non-zero biases
        for w in (weights.in_proj_weight, weights.out_proj.weight):
            w.normal_(0.0, e**-0.5, generator=gen)
        for bias in (weights.in_proj_bias, weights.out_proj.bias):
            bias.normal_(0.0, 0.02, generator=gen)
    x, dy = (torch.randn(b, seq, e, device=device, dtype=dtype, generator=gen) for _ in range(2))
    # One input set: at these sizes the matmuls, not cache reuse, set the time.
    return Prepared({"state": weights.state_dict(), "x": x, "dy": dy}, {"self_attention": True})


def _build(case: ShapeCase, wrap: Wrap, prepared: Prepared, mode: str, dtype_name: str) -> Steps:
    backward = mode == "fwd+bwd"
    dtype, (_, _, e, h) = DTYPES[dtype_name], case.shape
    x, dy, state = prepared.inputs["x"], prepared.inputs["dy"], prepared.inputs["state"]
    module = nn.MultiheadAttention(e, h, batch_first=True, device=x.device, dtype=dtype)
    module.load_state_dict(state)

    def check(f: Callable[..., Any]) -> dict[str, Any]:
        from hfkit.ops import multihead_attention_reference

        r = min(CHECK_BATCHES, x.shape[0])
        with torch.no_grad():
            y = f(x[:r], x[:r], x[:r], need_weights=False)[0]
            ref, _ = multihead_attention_reference(
                x[:r].float(), x[:r].float(), x[:r].float(), h,
                module.in_proj_weight.float(), module.in_proj_bias.float(),
                module.out_proj.weight.float(), module.out_proj.bias.float(),
                need_weights=False, batch_first=True,
            )  # fmt: skip
        err = max_abs_err(y, ref)
        return check_notes(err, r, dtype_name)

    return module_steps(module, wrap, x, dy, backward, lambda f, t: f(t, t, t, need_weights=False)[0], check)


def _cost(case: ShapeCase, dtype_name: str, mode: str) -> tuple[int, int]:
    b, seq, e, _ = case.shape
    itemsize = torch.empty((), dtype=DTYPES[dtype_name]).element_size()
    backward = mode == "fwd+bwd"
    # Read x and the weights, write y; the backward also reads dy and writes dx and the weight gradients.
    activations, weights = b * seq * e, 4 * e * e + 4 * e
    nbytes = (2 * activations + weights) * itemsize
    return (2 * nbytes if backward else nbytes), mha_flops(case.shape, backward)


BENCHMARK = op_benchmark(
    "multihead_attention",
    "MultiheadAttention, self-attention without weights: hfkit vs eager, compile",
    multihead_attention_cases,
    (_prepare, _provider, _build, _cost),
    default_dtypes=("bf16", "fp32"),
    options=(Option("shapes", "shapes", "shapes BxLxExH, e.g. 200x256x1024x16"),),
    gpu_reps=20,
)
