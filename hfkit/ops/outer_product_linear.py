"""The outer product mean's core `linear_out(flatten(sum_s a_s ⊗ b_s))`, recomputing the outer product
in the backward instead of keeping it.

The outer product mean (AF2 supplement Algorithm 10) sums, over the MSA rows s, the outer product of two
c-wide projections a[s, i] and b[s, j], then projects the c*c result of every residue pair (i, j) to c_z.
Run as `einsum` then `nn.Linear`, autograd keeps that [*, N, N, c*c] outer product from the forward to the
backward for the linear's weight gradient: 128 MB per Evoformer block at AlphaFold's sizes in bfloat16
(N 256, c 32), the largest tensor a block keeps. `outer_product_linear` keeps a and b ([*, S, N, c], 2 MB
each there) and recomputes the outer product in the backward: one matmul of S*N*N*c*c multiply-adds
(about 17 GFLOP at those sizes) against the memory. The matmuls are the same cuBLAS (or CPU) ones
`einsum` and `nn.Linear` run, on every device. Under `torch.autocast` they run in the autocast dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812

from hfkit.ops._checks import check_float, check_matmul_dtype, check_optional, check_same_device
from hfkit.ops._linear import autocast_operands, column_sums

__all__ = ["outer_product_linear", "outer_product_linear_reference"]


def _swap_axes(x: torch.Tensor, dim0: int, dim1: int) -> torch.Tensor:
    """`x.transpose(dim0, dim1).contiguous()` for a contiguous x whose last axis stays put, the rows of
    that last axis moved as 8-byte words where they divide into them: a permuting copy runs at a
    fraction of the card's bandwidth per element, so fewer, wider elements copy faster."""
    row_bytes = x.shape[-1] * x.element_size()
    aligned = row_bytes % 8 == 0 and x.storage_offset() * x.element_size() % 8 == 0
    if x.is_contiguous() and aligned and x.element_size() < 8:
        wide = x.view(torch.int64).transpose(dim0, dim1).contiguous()
        return wide.view(x.dtype)
    return x.transpose(dim0, dim1).contiguous()


def _outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [*, S, I, C], b [*, S, J, E] -> [*, I, J, C*E]: sum over s of a[s, i] ⊗ b[s, j], as one matmul
    with rows (i, c) and columns (j, e), then (c, j) swapped."""
    s, i, c = a.shape[-3:]
    j, e = b.shape[-2:]
    batch = math.prod(a.shape[:-3])  # explicit: -1 is ambiguous when S or I is 0
    rows = torch.bmm(a.reshape(batch, s, i * c).transpose(1, 2), b.reshape(batch, s, j * e))
    return _swap_axes(rows.view(batch, i, c, j, e), 2, 3).view(*a.shape[:-3], i, j, c * e)


def outer_product_linear_reference(
    a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain torch: `F.linear(einsum('...sic,...sje->...ijce', a, b).flatten(-2), weight, bias)`."""
    return F.linear(torch.einsum("...sic,...sje->...ijce", a, b).flatten(-2), weight, bias)


def _check(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_float("a", a)
    check_float("b", b)
    check_float("weight", weight)
    if a.dim() < 3 or b.dim() != a.dim() or a.shape[:-3] != b.shape[:-3] or a.shape[-3] != b.shape[-3]:
        raise ValueError(
            f"a, b: expected [*, S, I, C] and [*, S, J, E] with the same * and S, got {list(a.shape)} and "
            f"{list(b.shape)}"
        )
    width = a.shape[-1] * b.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != width:
        raise ValueError(f"weight: expected [N, {width}] (C*E), got {list(weight.shape)}")
    check_same_device("b", b, "a", a)
    check_same_device("weight", weight, "a", a)
    check_optional("bias", bias, (weight.shape[0],), "a", a)
    dtype, kind = a.dtype, a.device.type  # once: each attribute read builds a Python object
    for name, t in (("b", b), ("weight", weight), ("bias", bias)):
        check_matmul_dtype(name, t, dtype, kind)


def outer_product_linear(
    a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`linear(flatten(einsum('...sic,...sje->...ijce', a, b)), weight, bias)` with autograd, the outer
    product recomputed in the backward.

    a: [*, S, I, C], b: [*, S, J, E]; weight [N, C*E], bias [N] or None (an `nn.Linear`'s parameters).
    Returns [*, I, J, N]. Gradients equal autograd's through the plain composition. Raises ValueError
    naming the argument on bad shapes, dtypes or devices.
    """
    _check(a, b, weight, bias)
    return _OuterProductLinear.apply(*autocast_operands(a.device.type, a, b, weight, bias))


class _OuterProductLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, weight, bias):
        ctx.save_for_backward(a, b, weight)
        ctx.has_bias = bias is not None
        return F.linear(_outer(a, b), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        a, b, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dy2 = dy.reshape(math.prod(dy.shape[:-1]), dy.shape[-1])
        grad_w = grad_bias = grad_a = grad_b = None
        if needs[2]:
            outer = _outer(a, b)  # recomputed: the forward did not keep it
            grad_w = dy2.t().mm(outer.reshape(dy2.shape[0], outer.shape[-1]))
            del outer
        if ctx.has_bias and needs[3]:
            grad_bias = column_sums(dy2)
        if needs[0] or needs[1]:
            # The gradient of the outer product with rows (i, c) and columns (j, e): the layout in which
            # both of a's and b's gradients are plain matmuls with the other operand.
            s, i, c = a.shape[-3:]
            j, e = b.shape[-2:]
            batch = math.prod(a.shape[:-3])
            d_outer = dy.matmul(weight).reshape(batch, i, j, c, e)
            d_rows = _swap_axes(d_outer, 2, 3).view(batch, i * c, j * e)
            if needs[0]:
                grad_a = torch.bmm(b.reshape(batch, s, j * e), d_rows.transpose(1, 2)).view(a.shape)
            if needs[1]:
                grad_b = torch.bmm(a.reshape(batch, s, i * c), d_rows).view(b.shape)
        return grad_a, grad_b, grad_w, grad_bias
