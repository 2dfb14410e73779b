"""The gated attention output `linear(sigmoid(g) * o)`, keeping only g and o for the backward.

Gated attention (AF2 supplement Algorithm 7, and every attention of the Evoformer) ends with
`linear_o(sigmoid(g) * o)`. Run as a gate then a linear, autograd keeps three [*, K] tensors alive from
the forward to the backward: g and o for the gate's gradient, and the gated product for the linear's
weight gradient. `gated_linear` keeps g and o only and recomputes the product in the backward with the
fused gate kernel (`hfkit.ops.sigmoid_gate`): one [*, K] tensor less per attention (16 MB at
AlphaFold's pair sizes in bfloat16) for one elementwise kernel more. The matmuls are cuBLAS's.

On CUDA (and on CPU under `TRITON_INTERPRET=1`) it runs the gate kernels; elsewhere
`gated_linear_reference`, the plain-torch composition. Under `torch.autocast` the linear runs in the
autocast dtype, as `nn.Linear` does there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from hfkit.ops._checks import check_float, check_matmul_dtype, check_optional, check_same_device
from hfkit.ops._linear import autocast_operands, column_sums, rows_linear
from hfkit.ops.elementwise import (
    sigmoid_gate_backward,
    sigmoid_gate_forward,
    sigmoid_gate_reference,
    uses_triton,
)

__all__ = ["gated_linear", "gated_linear_reference"]


def gated_linear_reference(
    g: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain torch: `F.linear(sigmoid(g) * o, weight, bias)`, what `gated_linear` is tested against."""
    return F.linear(sigmoid_gate_reference(g, o), weight, bias)


def _check(g: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_float("g", g)
    check_float("o", o)
    check_float("weight", weight)
    if g.shape != o.shape or g.dim() < 1:
        raise ValueError(f"g, o: expected one shape [*, K], got {list(g.shape)} and {list(o.shape)}")
    if weight.dim() != 2 or weight.shape[1] != g.shape[-1]:
        raise ValueError(f"weight: expected [N, {g.shape[-1]}], got {list(weight.shape)}")
    check_same_device("o", o, "g", g)
    check_same_device("weight", weight, "g", g)
    check_optional("bias", bias, (weight.shape[0],), "g", g)
    dtype = torch.promote_types(g.dtype, o.dtype)  # sigmoid(g) * o's, which the linear multiplies
    kind = g.device.type
    check_matmul_dtype("weight", weight, dtype, kind)
    check_matmul_dtype("bias", bias, dtype, kind)


def gated_linear(
    g: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(sigmoid(g) * o, weight, bias)` with autograd, keeping g and o (not their product).

    g, o: [*, K] (e.g. `linear_g(x)` and the attention output with its heads flattened), float32,
    bfloat16 or float16; weight [N, K], bias [N] or None (an `nn.Linear`'s). Returns [*, N]. Raises
    ValueError naming the argument on bad shapes, dtypes or devices.
    """
    _check(g, o, weight, bias)
    if not uses_triton(g, o) or g.numel() == 0:
        return gated_linear_reference(g, o, weight, bias)
    weight, bias = autocast_operands(g.device.type, weight, bias)
    return _GatedLinear.apply(g, o, weight, bias)


class _GatedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, o, weight, bias):
        gated = sigmoid_gate_forward(g, o)  # g, o checked by gated_linear
        ctx.save_for_backward(g, o, weight)
        ctx.has_bias = bias is not None
        return rows_linear(gated.to(weight.dtype), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        g, o, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dy2 = dy.reshape(-1, weight.shape[0])
        grad_w = grad_b = None
        if needs[2]:
            gated = sigmoid_gate_forward(g, o)  # recomputed: the forward did not keep it
            grad_w = dy2.t().mm(gated.reshape(-1, weight.shape[1]).to(dy2.dtype))
        if ctx.has_bias and needs[3]:
            grad_b = column_sums(dy2)
        grad_g = grad_o = None
        if needs[0] or needs[1]:
            d_gated = dy2.mm(weight).view(g.shape)
            grad_g, grad_o = sigmoid_gate_backward(d_gated, g, o)
        return grad_g, grad_o, grad_w, grad_b
