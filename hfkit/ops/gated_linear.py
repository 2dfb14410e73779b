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

`gated_linear_add_(z, g, o, weight, bias)` is `z += linear(sigmoid(g) * o)` in place, without autograd,
for inference (`hfkit.model.inference.lean_forward`): one kernel reads g, o and z and writes z, where the
gate, the linear and a residual add read and write [*, K] three times. Triangle attention's output at
N = 4096 (bfloat16, 4096² rows of 128, H200, torch.profiler over the lean block): 5.0 ms a call, where
the gate kernel (2.9 ms), the linear (2.3) and the add (2.9) took 8.1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from hfkit.ops._checks import (
    check_float,
    check_matmul_dtype,
    check_no_autograd,
    check_optional,
    check_same_device,
)
from hfkit.ops._linear import autocast_operands, column_sums, rows_linear
from hfkit.ops._triton import HAS_TRITON, cdiv, dot, dot_mode, hfkit_op, launch, next_power_of_2, rows_view
from hfkit.ops.elementwise import (
    sigmoid_gate_backward,
    sigmoid_gate_forward,
    sigmoid_gate_reference,
    uses_triton,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["gated_linear", "gated_linear_add_", "gated_linear_reference"]

# (BLOCK_M, num_warps) of `gated_linear_add_`'s kernel: a program takes BLOCK_M rows by all K inputs
# and up to 128 outputs (a first choice, not swept: 5.0 ms at N = 4096 is 82% of the card's copy rate
# for the 16 GiB it reads and writes).
ADD_TILE = (64, 4)
# Outputs a program computes at once (wider outputs take more programs, each recomputing the gate).
ADD_MAX_N = 128
# Inputs a program holds (K beyond this runs `gated_linear` then an add).
ADD_MAX_K = 256


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


def gated_linear_add_(
    z: torch.Tensor, g: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`z += F.linear(sigmoid(g) * o, weight, bias)` in place; returns z. Inference only: raises
    RuntimeError when autograd would need a graph (grad mode on and an argument requiring grad).
    g, o [*, K]; z [*, N] with g's leading shape, contiguous; weight [N, K]; bias [N] or None. Where
    `gated_linear` runs the gate kernel (CUDA, or CPU under `TRITON_INTERPRET=1`), K is at most
    `ADD_MAX_K` and z, weight and bias share the gate's dtype, one kernel computes the linear on the gated
    rows in float32 and adds it and the bias to z (one rounding, where the unfused ops round the gate's
    output, the linear's and the sum); otherwise `z.add_(gated_linear(g, o, weight, bias))`."""
    _check(g, o, weight, bias)
    if z.shape != (*g.shape[:-1], weight.shape[0]):
        raise ValueError(f"z: expected {[*g.shape[:-1], weight.shape[0]]}, got {list(z.shape)}")
    check_same_device("z", z, "g", g)
    check_no_autograd("gated_linear_add_", z, g, o, weight, bias)
    k, n = weight.shape[1], weight.shape[0]
    dtype = torch.promote_types(g.dtype, o.dtype)
    fused = uses_triton(g, o, z) and z.is_contiguous() and k <= ADD_MAX_K and g.numel() > 0
    fused = fused and all(t.dtype == dtype for t in (z, weight) + ((bias,) if bias is not None else ()))
    if not fused:
        return z.add_(gated_linear(g, o, weight, bias))
    _gated_linear_add(z.view(-1, n), rows_view(g, k), rows_view(o, k), weight.contiguous(), bias)
    return z


if HAS_TRITON:

    @triton.jit
    def _gated_linear_add_kernel(
        Z, G, O, W, Bias, M, N, K, stride_g, stride_o,
        HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # z[rows, cols] += (sigmoid(g) * o)[rows] @ W[cols].T + bias[cols]: the gate in float32, rounded
        # to the operands' dtype for the dot (as `gated_linear` rounds it), the sum in float32. Grid
        # (row blocks, column blocks); rows index in 64 bits (a pair representation passes 2**31 elements).
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        r_ok = rows < M
        c_ok = cols < N
        k_ok = ks < K
        rk = r_ok[:, None] & k_ok[None, :]
        g = tl.load(G + rows[:, None] * stride_g + ks[None, :], mask=rk, other=0.0).to(tl.float32)
        o = tl.load(O + rows[:, None] * stride_o + ks[None, :], mask=rk, other=0.0).to(tl.float32)
        x = (tl.sigmoid(g) * o).to(W.dtype.element_ty)
        w = tl.load(W + cols[None, :] * K + ks[:, None], mask=k_ok[:, None] & c_ok[None, :], other=0.0)
        acc = dot(x, w, DOT)
        if HAS_BIAS:
            acc += tl.load(Bias + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        zp = Z + rows[:, None] * N + cols[None, :]
        ok = r_ok[:, None] & c_ok[None, :]
        acc += tl.load(zp, mask=ok, other=0.0).to(tl.float32)
        tl.store(zp, acc.to(Z.dtype.element_ty), mask=ok)

    @hfkit_op("gated_linear_add", mutates_args={"z"})
    def _gated_linear_add(
        z: torch.Tensor, g: torch.Tensor, o: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> None:
        """z [M, N] += linear(sigmoid(g) * o) for g, o [M, K] with unit column stride."""
        m, n = z.shape
        k = g.shape[1]
        block_m, warps = ADD_TILE
        block_n = min(ADD_MAX_N, max(16, next_power_of_2(n)))
        launch(_gated_linear_add_kernel, (cdiv(m, block_m), cdiv(n, block_n)),
            z, g, o, weight, bias, m, n, k, g.stride(0), o.stride(0),
            HAS_BIAS=bias is not None, DOT=dot_mode(g),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=max(16, next_power_of_2(k)), num_warps=warps,
        )  # fmt: skip
