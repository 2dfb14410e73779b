"""`multi_linear`: several linear layers of one input, `[F.linear(x, w_i, b_i) for each i]`, one gradient.

Gated attention projects one normalized input four or five times (q, k, v, the gate and, in triangle
attention, the pair bias). Run as separate linears, autograd meets four or five gradients for that
input and adds them one at a time: three [*, C] adds per attention, each a read of two tensors and a
write of one (at AlphaFold's training sizes ~14 µs each on an H200, ~14 per Evoformer block). Here the
backward sums the products Σ dy_i w_i inside the GEMMs: each product after the first accumulates
into the gradient as the GEMM writes it (`addmm_`, beta 1), a read of the gradient instead of an
add's three passes. The forward is one GEMM per layer, so each output is a dense tensor of its own
(as a separate linear's; stacking the weights into one GEMM made strided column slices, which the
attention's outputs and gradients followed and copies undid: 15 ms more in the af2_initial step on an
H200; in inference at N = 4096 too, triangle attention's five projections as one [M, 128] x [128, 528]
GEMM take 9.0 against 13.5 ms, but the attention reading strided q, k, v then takes 157.7 against
152.7 ms and the gate reading a strided g 12.0 against 7.0 (a probe, not committed); again without
gradients, with the Gluon forward reading the column slices through TMA and the gate with their row
stride, in the whole block: the two GEMMs 19.2 against 26.8 ms, but the attention forwards 298.0
against 279.5 ms (rows 1040 instead of 256 bytes apart), the block 510 against 502 ms; and a Triton
kernel normalizing x (the LayerNorm) and writing the four projections as dense slices of one buffer,
reading x once, took 16.0-22.7 against 12.9 ms for the LayerNorm and the five GEMMs at N = 4096 (a
probe, not committed). The weight gradients are the products `dy_iᵀ x` and the bias gradients
column sums, as `nn.Linear`'s.

It runs wherever torch runs (the products are torch's matmuls); while `torch.compile` traces it is
`multi_linear_reference`, which Inductor compiles. Under `torch.autocast` the operands take the
autocast dtype, as `nn.Linear`'s do there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812
from torch.autograd.function import once_differentiable

from hfkit.ops._checks import check_float, check_matmul_dtype, check_optional, check_same_device
from hfkit.ops._linear import autocast_operands, column_sums, rows_linear

__all__ = ["multi_linear", "multi_linear_reference"]


def multi_linear_reference(
    x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor, ...]:
    """Plain torch: `F.linear(x, w_i, b_i)` for each weight, what `multi_linear` is tested against."""
    return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))


def _check(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> None:
    check_float("x", x)
    if x.dim() < 1:
        raise ValueError("x: expected [*, K], got a 0-d tensor")
    if len(weights) == 0 or len(weights) != len(biases):
        raise ValueError(
            f"weights, biases: expected one bias (or None) per weight and at least one weight, "
            f"got {len(weights)} weights and {len(biases)} biases"
        )
    kind = x.device.type
    for i, (w, b) in enumerate(zip(weights, biases, strict=True)):
        check_float(f"weights[{i}]", w)
        if w.dim() != 2 or w.shape[1] != x.shape[-1]:
            raise ValueError(f"weights[{i}]: expected [N, {x.shape[-1]}], got {list(w.shape)}")
        check_same_device(f"weights[{i}]", w, "x", x)
        check_optional(f"biases[{i}]", b, (w.shape[0],), "x", x)
        check_matmul_dtype(f"weights[{i}]", w, x.dtype, kind)
        check_matmul_dtype(f"biases[{i}]", b, x.dtype, kind)


def multi_linear(
    x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]
) -> tuple[torch.Tensor, ...]:
    """`F.linear(x, w_i, b_i)` for each (w_i, b_i), with autograd: one gradient of x accumulated inside
    the backward's GEMMs (see the module docstring).

    x: [*, K] in float32, bfloat16 or float16; weights: [N_i, K] each; biases: [N_i] or None each.
    Returns a tuple of [*, N_i] tensors, each contiguous. Raises
    ValueError naming the argument on bad shapes, dtypes or devices.
    """
    _check(x, weights, biases)
    if torch.compiler.is_compiling():
        return multi_linear_reference(x, weights, biases)
    x, *params = autocast_operands(x.device.type, x, *weights, *biases)
    n = len(weights)
    return _MultiLinear.apply(x, n, *params)


class _MultiLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, *params):
        weights, biases = params[:n], params[n:]
        ctx.save_for_backward(x, *weights)
        ctx.has_bias = [b is not None for b in biases]
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no product of zeros
        # One GEMM per output: each comes out dense in its own buffer, the layout a separate linear
        # gives (one GEMM of the stacked weights would read x once, but its outputs are strided
        # column slices, which attention's output and gradients then follow and copies undo).
        return tuple(rows_linear(x, w, b) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    @once_differentiable
    def backward(ctx, *dys):
        x, *weights = ctx.saved_tensors
        needs = ctx.needs_input_grad
        n = len(weights)
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = None
        grad_w: list[torch.Tensor | None] = [None] * n
        grad_b: list[torch.Tensor | None] = [None] * n
        for i, (dy, w) in enumerate(zip(dys, weights, strict=True)):
            if dy is None:
                continue
            dy2 = dy.reshape(-1, w.shape[0])
            if needs[0]:
                if grad_x is None:
                    grad_x = dy2.mm(w)
                else:
                    grad_x.addmm_(dy2, w)
            if needs[2 + i]:
                grad_w[i] = dy2.t().mm(x2)
            if ctx.has_bias[i] and needs[2 + n + i]:
                grad_b[i] = column_sums(dy2)
        if grad_x is not None:
            grad_x = grad_x.view(x.shape)
        return grad_x, None, *grad_w, *grad_b
