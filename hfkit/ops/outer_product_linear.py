"""The outer product mean's core `linear_out(flatten(sum_s a_s ⊗ b_s))`, recomputing the outer product
in the backward instead of keeping it.

The outer product mean (AF2 supplement Algorithm 10) sums, over the MSA rows s, the outer product of two
c-wide projections a[s, i] and b[s, j], then projects the c*c result of every residue pair (i, j) to c_z.
Run as `einsum` then `nn.Linear`, autograd keeps that [*, N, N, c*c] outer product from the forward to the
backward for the linear's weight gradient: 128 MB per Evoformer block at AlphaFold's sizes in bfloat16
(N 256, c 32), the largest tensor a block keeps. `outer_product_linear` keeps a and b ([*, S, N, c], 2 MB
each there) and recomputes the outer product in the backward: S*N*N*c*c multiply-adds (about 17 GFLOP
at those sizes) against the memory.

Layouts. The outer product is built as [*, I, J, E, C], c innermost: for each i it is the matmul of b as
[(j, e), s] with a[:, i] [s, c], so one batched matmul over i gives it in place, and the linear reads it
with the weight's columns reordered to (e, c) (a copy of the small weight). As one matmul with rows
(i, c) and columns (j, e) it would need a copy swapping c and j, of the whole outer product. The
backward builds the outer product's gradient once per operand, each time in a layout whose contraction
with the other operand is again a batched matmul, and frees it before the next: no permuting copy of an
outer-product-sized tensor anywhere, and at most one such tensor alive at a time. The batched matmuls
read the operand they share across the batch in place, with batch stride 0 (cuBLAS strided-batched).
Under `torch.autocast` the matmuls run in the autocast dtype.

Those batched matmuls are thin (C columns) and read the whole of b (or of the gradient's operand) once
per i: cheaper than the copies while that stays in L2, dearer as S grows. Past STRIDE0_MAX_ROWS MSA rows
the outer product is one matmul with rows (i, c) and columns (j, e) and the copy swapping c and j
(`_outer_ijce`), the backward likewise: at S = 128 the batched layout takes about half the time of
the copying one (CUDA graphs, H200, N 256 and 384, bf16, forward + backward), at 512 0.87-0.91 of it,
at 1024 1.19-1.25 times, at 5120 2.3-2.9 times (`hfkit bench outer_product_linear` times both:
data/results/h200/outer_product_linear.json).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F  # noqa: N812

from hfkit.ops._checks import check_float, check_matmul_dtype, check_optional, check_same_device
from hfkit.ops._linear import autocast_operands, column_sums, no_kept_ones

__all__ = ["outer_product_linear", "outer_product_linear_reference"]

# The most MSA rows S at which the outer product is built by batched matmuls without a copy (see the
# module docstring); beyond, one matmul and a copy swapping c and j.
STRIDE0_MAX_ROWS = 512
# The forward projects before it contracts over the MSA rows (`_outer_projected`: no [*, I, J, C*E]
# outer product at all) from PROJECT_MIN_PAIRS pairs I*J, where that does at most
# PROJECT_MAX_FLOP_RATIO times the two-matmul path's multiply-adds (S*N <= 2*E*(S + N): S <= 128 at
# AlphaFold's widths) and holds no more memory (I*E >= S*N: I >= 512 there). H200, bf16, S 128,
# C = E = 32, N 128 (the op alone): 26.6 against 34.9 ms at I = J = 4096, where the outer product is
# 34 GB; 6.9 against 6.6 at 2048.
PROJECT_MIN_PAIRS = 1 << 23
PROJECT_MAX_FLOP_RATIO = 2.0


def _shared_bmm(shared: torch.Tensor, batched: torch.Tensor, out: torch.Tensor) -> None:
    """out[p] = shared @ batched[p] for every p: shared [M, K], batched [P, K, Q], out [P, M, Q]. One
    batched matmul with `shared` broadcast over p (batch stride 0), read in place by cuBLAS and by the
    CPU's float32 and float64 matmuls; oneDNN's CPU bfloat16 and float16 batched matmul would first copy
    it P times (more than the outer product's size), so there it is P plain matmuls."""
    if shared.device.type == "cpu" and shared.dtype in (torch.bfloat16, torch.float16):
        for p in range(batched.shape[0]):
            torch.mm(shared, batched[p], out=out[p])
    else:
        torch.bmm(shared.expand(batched.shape[0], *shared.shape), batched, out=out)


def _outer_ijec(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, S, I, C], b [B, S, J, E] -> [B, I, J*E, C]: sum over s of b[s, j, e] a[s, i, c], the outer
    product with its (c, e) pair in (e, c) order, so that no permuting copy of it is needed: for each i,
    b as [(j, e), s] times a[:, i] [s, c] (a strided view of a), batched over i."""
    batch, s, i, c = a.shape
    j, e = b.shape[-2:]
    outer = a.new_empty(batch, i, j * e, c)
    for k in range(batch):  # a batched matmul has one batch stride: b's is 0 over i, not over *
        _shared_bmm(b[k].reshape(s, j * e).t(), a[k].transpose(0, 1), outer[k])
    return outer


def _projects_first(s: int, i: int, j: int, e: int, n: int) -> bool:
    """Whether the forward takes `_outer_projected` (see PROJECT_MIN_PAIRS): multiply-adds S*N per
    (i, j, c) against E*(S + N) for the outer product and its projection; its [C, S*J, N] operand no
    larger than the [I, J, C*E] outer product."""
    flops_ok = s * n <= PROJECT_MAX_FLOP_RATIO * e * (s + n)
    return i * j >= PROJECT_MIN_PAIRS and i * e >= s * n and flops_ok


def _outer_projected(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """a [B, S, I, C], b [B, S, J, E], weight [N, C*E] -> [B, I, J, N] without the outer product:
    y[i, (j, n)] = sum over (c, s) of a[s, i, c] p[(c, s), (j, n)], where p[c, s, j, n] = sum over e of
    b[s, j, e] weight[n, (c, e)] ([C, S*J, N], b read in place by a batched matmul over c). One matmul of
    I rows, C*S deep and J*N wide, writing the output in place; p is S*N/(I*E) of the outer product's
    size, at the cost of S*N instead of E*(S + N) multiply-adds per (i, j, c)."""
    batch, s, i, c = a.shape
    j, e = b.shape[-2:]
    n = weight.shape[0]
    w = weight.view(n, c, e).permute(1, 2, 0)  # [C, E, N]
    out = a.new_empty(batch, i, j * n)
    for k in range(batch):
        p = torch.matmul(b[k].reshape(s * j, e), w).view(c * s, j * n)
        rows = a[k].permute(1, 2, 0).reshape(i, c * s)  # [I, (C, S)]: a copy of a
        if bias is None:
            torch.mm(rows, p, out=out[k])
        else:
            torch.addmm(bias.repeat(j), rows, p, out=out[k])
        del p
    return out.view(batch, i, j, n)


def _swap_middle(x: torch.Tensor) -> torch.Tensor:
    """x [B, P, Q, R, T] -> [B, P, R, Q, T] contiguous: the copy swapping the middle axes."""
    return x.transpose(2, 3).contiguous()


def _outer_ijce(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, S, I, C], b [B, S, J, E] -> [B, I, J, C, E]: one matmul a as [(i, c), s] times b as
    [s, (j, e)], then the copy swapping c and j."""
    batch, s, i, c = a.shape
    j, e = b.shape[-2:]
    rows = torch.bmm(a.reshape(batch, s, i * c).transpose(1, 2), b.reshape(batch, s, j * e))
    return _swap_middle(rows.view(batch, i, c, j, e))


def _contract_pairs(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [B, S, K], d [B, P, K, Q] -> [B, S, P, Q]: for each pair row p, x times d[:, p], batched over
    p. Returned as a transposed view of the contiguous [B, P, S, Q] result (a gradient of x's size,
    which autograd takes in any layout)."""
    batch, p = d.shape[:2]
    out = d.new_empty(batch, p, x.shape[1], d.shape[-1])
    for k in range(batch):
        _shared_bmm(x[k], d[k], out[k])
    return out.transpose(1, 2)


def _permute_weight_columns(weight: torch.Tensor, first: int, second: int) -> torch.Tensor:
    """weight [N, first*second] with columns in (first, second) order -> [N, second*first] with them in
    (second, first) order: a copy of the weight (or its gradient) only, never of the outer product."""
    return weight.unflatten(1, (first, second)).transpose(1, 2).reshape(weight.shape[0], -1)


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
    return _by_layout(a, b, weight, bias, a.shape[-3] > STRIDE0_MAX_ROWS)


def _by_layout(
    a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, by_rows: bool
) -> torch.Tensor:
    """`outer_product_linear` (checked arguments) with the outer product built as one matmul and a
    swapping copy (by_rows) or by stride-0 batched matmuls: `hfkit bench outer_product_linear` times
    both. While torch.compile traces, the custom op `hfkit::outer_product_linear` (opaque to the
    compiler, the same forward and backward): traced through, the backward's recomputed outer product
    was merged with the forward's and kept for the backward (128 MB a block at AlphaFold's sizes), and
    the batched matmuls' `out=` slices became copies of the whole outer product."""
    operands = autocast_operands(a.device.type, a, b, weight, bias)
    if torch.compiler.is_compiling():
        return torch.ops.hfkit.outer_product_linear(*operands, by_rows)
    return _OuterProductLinear.apply(*operands, by_rows)


def _forward(
    a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, by_rows: bool
) -> torch.Tensor:
    """The outer product, built as [*, I, J, E, C] (`_outer_ijec`) and projected with the weight's
    columns reordered to (e, c) to match; with `by_rows`, `_outer_ijce` and the weight as it is; at
    long sequences (`_projects_first`) no outer product: `_outer_projected`."""
    s, i, c = a.shape[-3:]
    j, e = b.shape[-2:]
    batch = math.prod(a.shape[:-3])  # explicit: -1 is ambiguous when S or I is 0
    a3, b3 = a.reshape(batch, s, i, c), b.reshape(batch, s, j, e)
    if _projects_first(s, i, j, e, weight.shape[0]):
        return _outer_projected(a3, b3, weight, bias).view(*a.shape[:-3], i, j, weight.shape[0])
    if by_rows:
        return F.linear(_outer_ijce(a3, b3).view(*a.shape[:-3], i, j, c * e), weight, bias)
    outer = _outer_ijec(a3, b3)
    weight_ec = _permute_weight_columns(weight, c, e)
    return F.linear(outer.view(*a.shape[:-3], i, j, e * c), weight_ec, bias)


def _backward(
    a: torch.Tensor,
    b: torch.Tensor,
    weight: torch.Tensor,
    dy: torch.Tensor,
    needs: tuple[bool, bool, bool, bool],
    by_rows: bool,
) -> tuple[torch.Tensor | None, ...]:
    """(grad_a, grad_b, grad_weight, grad_bias), each None where `needs` (in that order) says so.

    The outer product's gradient is built twice from dy, once per operand, in the layout whose
    contraction with the other operand is a batched matmul: [*, I, J, E, C] for a's (sum over j, e),
    [*, J, I, C, E] for b's (sum over i, c; from dy with i and j swapped, a copy C*E/N times the size
    of the outer product's). Every large temporary is freed before the next one is made, and none is
    a permuting copy. With `by_rows`: `_backward_by_rows`."""
    s, i, c = a.shape[-3:]
    j, e = b.shape[-2:]
    n = weight.shape[0]
    batch = math.prod(a.shape[:-3])
    a3, b3 = a.reshape(batch, s, i, c), b.reshape(batch, s, j, e)
    dy2 = dy.reshape(batch * i * j, n)
    if by_rows:
        return _backward_by_rows(a3, b3, weight, dy2, needs, a.shape, b.shape)
    grad_w = grad_bias = grad_a = grad_b = None
    if needs[2]:
        outer = _outer_ijec(a3, b3)  # recomputed: the forward did not keep it
        grad_w = _permute_weight_columns(dy2.t().mm(outer.view(dy2.shape[0], e * c)), e, c)
        del outer
    if needs[3]:
        grad_bias = column_sums(dy2)
    if needs[0]:
        # d outer [B, I, (J, E), C]; grad_a[s, i, c] = sum over (j, e) of b[s, (j, e)] d[i, (j, e), c]
        d_outer = dy2.mm(_permute_weight_columns(weight, c, e)).view(batch, i, j * e, c)
        grad_a = _contract_pairs(b3.reshape(batch, s, j * e), d_outer).reshape(a.shape)
        del d_outer
    if needs[1]:
        # d outer [B, J, (I, C), E]; grad_b[s, j, e] = sum over (i, c) of a[s, (i, c)] d[j, (i, c), e]
        dy_ji = dy.reshape(batch, i, j, n).transpose(1, 2).reshape(batch * j * i, n)
        d_outer = dy_ji.mm(weight).view(batch, j, i * c, e)
        del dy_ji
        grad_b = _contract_pairs(a3.reshape(batch, s, i * c), d_outer).reshape(b.shape)
    return grad_a, grad_b, grad_w, grad_bias


def _save(ctx, a, b, weight, bias, by_rows) -> None:
    """What the backward reads: a, b and the weight (not the outer product), and the layout."""
    ctx.save_for_backward(a, b, weight)
    ctx.has_bias = bias is not None
    ctx.by_rows = by_rows


def _needs(ctx) -> tuple[bool, bool, bool, bool]:
    """Which of (a, b, weight, bias) need a gradient."""
    return (*ctx.needs_input_grad[:3], ctx.has_bias and ctx.needs_input_grad[3])


class _OuterProductLinear(torch.autograd.Function):
    """`_forward`, keeping a, b and the weight; `_backward` recomputes the outer product from them."""

    @staticmethod
    def forward(ctx, a, b, weight, bias, by_rows):
        _save(ctx, a, b, weight, bias, by_rows)
        return _forward(a, b, weight, bias, by_rows)

    @staticmethod
    def backward(ctx, dy):
        a, b, weight = ctx.saved_tensors
        return *_backward(a, b, weight, dy, _needs(ctx), ctx.by_rows), None


# The compiler's view of the op (`_by_layout`): two custom ops whose bodies are `_forward` and
# `_backward`. A custom op returns tensors only: gradients not asked for come back empty.
@torch.library.custom_op("hfkit::outer_product_linear", mutates_args=())
def _outer_product_linear_op(
    a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, by_rows: bool
) -> torch.Tensor:
    return _forward(a, b, weight, bias, by_rows)


@_outer_product_linear_op.register_fake
def _(a, b, weight, bias, by_rows):
    return a.new_empty((*a.shape[:-3], a.shape[-2], b.shape[-2], weight.shape[0]))


@torch.library.custom_op("hfkit::outer_product_linear_backward", mutates_args=())
def _outer_product_linear_backward_op(
    a: torch.Tensor,
    b: torch.Tensor,
    weight: torch.Tensor,
    dy: torch.Tensor,
    need_a: bool,
    need_b: bool,
    need_weight: bool,
    need_bias: bool,
    by_rows: bool,
) -> list[torch.Tensor]:
    with no_kept_ones():  # compiled code calls this op, maybe inside a CUDA-graph tree's pool
        grads = _backward(a, b, weight, dy, (need_a, need_b, need_weight, need_bias), by_rows)
    return [g.contiguous() if g is not None else dy.new_empty(0) for g in grads]


@_outer_product_linear_backward_op.register_fake
def _(a, b, weight, dy, need_a, need_b, need_weight, need_bias, by_rows):
    shapes = (a.shape, b.shape, weight.shape, weight.shape[:1])
    needs = (need_a, need_b, need_weight, need_bias)
    return [dy.new_empty(shape if need else (0,)) for shape, need in zip(shapes, needs, strict=True)]


def _setup_op(ctx, inputs, output) -> None:
    _save(ctx, *inputs)


def _backward_op(ctx, dy):
    a, b, weight = ctx.saved_tensors
    needs = _needs(ctx)
    grads = torch.ops.hfkit.outer_product_linear_backward(a, b, weight, dy, *needs, ctx.by_rows)
    return *(g if need else None for g, need in zip(grads, needs, strict=True)), None


_outer_product_linear_op.register_autograd(_backward_op, setup_context=_setup_op)


def _backward_by_rows(a3, b3, weight, dy2, needs, a_shape, b_shape):
    """`_backward` past STRIDE0_MAX_ROWS rows: the outer product recomputed as
    [B, I, J, C, E] (`_outer_ijce`) for the weight's gradient, and the outer product's gradient swapped
    once to [B, (I, C), (J, E)], where both operand gradients are one batched matmul each."""
    batch, s, i, c = a3.shape
    j, e = b3.shape[-2:]
    grad_w = grad_bias = grad_a = grad_b = None
    if needs[2]:
        outer = _outer_ijce(a3, b3)
        grad_w = dy2.t().mm(outer.view(dy2.shape[0], c * e))
        del outer
    if needs[3]:
        grad_bias = column_sums(dy2)
    if needs[0] or needs[1]:
        d_rows = _swap_middle(dy2.mm(weight).view(batch, i, j, c, e)).view(batch, i * c, j * e)
        if needs[0]:
            grad_a = torch.bmm(b3.reshape(batch, s, j * e), d_rows.transpose(1, 2)).view(a_shape)
        if needs[1]:
            grad_b = torch.bmm(a3.reshape(batch, s, i * c), d_rows).view(b_shape)
    return grad_a, grad_b, grad_w, grad_bias
