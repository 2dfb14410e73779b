"""The transitions' two-layer ReLU network, keeping its input (not its 4x-wide hidden layer) for the backward.

`relu_mlp(x, w1, b1, w2, b2)` is `linear_2(relu(linear_1(x)))`, the MSA and pair transitions of the
Evoformer (AF2 supplement Algorithms 9 and 15; hidden width 4 c). Run as modules, autograd keeps the
hidden layer [*, 4 c] from the forward to the backward: the largest tensor each transition saves
(64 MB at AlphaFold's pair sizes in bfloat16). Here the backward recomputes it from x with the first
matmul instead: one [*, c] x [c, 4 c] matmul more (about 9 GFLOP at those sizes) against 4x the input's
memory kept alive. The matmuls are the same cuBLAS (or CPU) ones `nn.Linear` runs, on every device.
Under `torch.autocast` the matmuls run in the autocast dtype, as `nn.Linear` does there.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812

from hfkit.ops._checks import check_float, check_matmul_dtype, check_optional, check_same_device
from hfkit.ops._linear import autocast_operands, column_sums
from hfkit.ops.elementwise import row_scale

__all__ = ["relu_mlp", "relu_mlp_reference"]


def relu_mlp_reference(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: `F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)`, times `scale` where given."""
    y = F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)
    return y if scale is None else y * scale


def _check(x, w1, b1, w2, b2, scale) -> None:
    check_float("x", x)
    if scale is not None:
        check_float("scale", scale)
    check_float("w1", w1)
    check_float("w2", w2)
    if x.dim() < 1:
        raise ValueError("x: expected at least one dim [*, C], got a 0-d tensor")
    if w1.dim() != 2 or w1.shape[1] != x.shape[-1]:
        raise ValueError(f"w1: expected [H, {x.shape[-1]}], got {list(w1.shape)}")
    if w2.dim() != 2 or w2.shape[1] != w1.shape[0]:
        raise ValueError(f"w2: expected [N, {w1.shape[0]}], got {list(w2.shape)}")
    check_same_device("w1", w1, "x", x)
    check_same_device("w2", w2, "x", x)
    check_optional("b1", b1, (w1.shape[0],), "x", x)
    check_optional("b2", b2, (w2.shape[0],), "x", x)
    dtype, kind = x.dtype, x.device.type  # once: each attribute read builds a Python object
    for name, t in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)):
        check_matmul_dtype(name, t, dtype, kind)


def relu_mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`linear_2(relu(linear_1(x)))` with autograd, the hidden layer recomputed in the backward; with
    `scale` ([*, 1], a factor per row such as the transitions' mask), that times `scale`.

    x: [*, C]; w1 [H, C], b1 [H] or None; w2 [N, H], b2 [N] or None (two `nn.Linear`s' parameters).
    Returns [*, N] (in torch's promoted dtype of the product and `scale`). Gradients equal autograd's
    through the plain composition. The scale is applied inside this op's own autograd (`row_scale`
    forward and backward, no autograd node of its own) and takes no gradient; a scale that requires
    one, or that broadcasts over x's leading dims, is applied by `row_scale` after the op. Raises
    ValueError naming the argument on bad shapes, dtypes or devices.
    """
    _check(x, w1, b1, w2, b2, scale)
    if scale is not None and (scale.requires_grad or scale.shape[:-1] != x.shape[:-1]):
        return row_scale(relu_mlp(x, w1, b1, w2, b2), scale)
    return _ReluMLP.apply(*autocast_operands(x.device.type, x, w1, b1, w2, b2), scale)


def _hidden(x2: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None) -> torch.Tensor:
    """relu(x2 @ w1ᵀ + b1) for 2-d x2: on CUDA with a bias, one cuBLASLt matmul whose epilogue adds
    the bias and applies the ReLU (no separate pass over the 4x-wide hidden layer); else matmul, then
    relu in place. The forward and the backward's recompute both call this, so their ReLU masks agree."""
    if b1 is not None and x2.is_cuda:
        return torch._addmm_activation(b1, x2, w1.t())
    return F.linear(x2, w1, b1).relu_()


class _ReluMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, scale):
        hidden = _hidden(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), w1, b1)
        hidden = hidden.view(*x.shape[:-1], w1.shape[0])
        ctx.save_for_backward(x, w1, b1, w2, scale)
        ctx.has_b2 = b2 is not None
        y = F.linear(hidden, w2, b2)
        return y if scale is None else row_scale(y, scale)

    @staticmethod
    def backward(ctx, dy):
        x, w1, b1, w2, scale = ctx.saved_tensors
        needs = ctx.needs_input_grad
        if scale is not None:  # d(y * s)/dy = s, in the matmuls' dtype
            dy = row_scale(dy, scale).to(w2.dtype)
        rows = math.prod(x.shape[:-1])
        x2 = x.reshape(rows, x.shape[-1])
        dy2 = dy.reshape(rows, dy.shape[-1])
        hidden = _hidden(x2, w1, b1)  # recomputed: the forward did not keep it
        grad_w2 = dy2.t().mm(hidden) if needs[3] else None
        grad_b2 = column_sums(dy2) if ctx.has_b2 and needs[4] else None
        # relu's gradient selects (autograd's own threshold_backward, in place: one pass), never
        # multiplies: an inf or NaN in dy @ w2 where the unit is off must give 0, not inf * 0 = NaN.
        d_hidden = dy2.mm(w2)
        torch.ops.aten.threshold_backward.grad_input(d_hidden, hidden, 0, grad_input=d_hidden)
        del hidden
        grad_w1 = d_hidden.t().mm(x2) if needs[1] else None
        grad_b1 = column_sums(d_hidden) if b1 is not None and needs[2] else None
        grad_x = d_hidden.mm(w1).view(x.shape) if needs[0] else None
        return grad_x, grad_w1, grad_b1, grad_w2, grad_b2, None
