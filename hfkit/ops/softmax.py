"""Fused softmax with an additive bias and a key mask: Triton kernels, a torch custom op, the reference.

`softmax(x, bias, mask)` computes `softmax(x + bias + (mask - 1) * 1e9)` over the last dim, the fused
softmax of FastFold's Evoformer (pair bias broadcast over MSA rows, masked keys). `bias` and `mask`
broadcast to `x`; the gradient of a broadcast bias is summed over its broadcast dims. On CUDA (and on
CPU under `TRITON_INTERPRET=1`) it runs the kernels below, registered as `hfkit::softmax_fwd` /
`hfkit::softmax_bwd` through `torch.library.triton_op`; everywhere else it runs `softmax_reference`.
Statistics are float32; the output keeps x's dtype.
"""

from __future__ import annotations

import torch

from hfkit.ops._checks import broadcasts_to, check_float, check_optional
from hfkit.ops._triton import HAS_TRITON, cdiv, hfkit_op, launch, next_power_of_2, triton_can_run

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["MASK_INF", "MAX_FUSED_SIZE", "softmax", "softmax_reference", "uses_triton"]

# OpenFold's `inf`: a masked key gets a logit bias of -MASK_INF. It is finite, so a row whose keys are
# all masked gives (nearly) uniform weights rather than NaN, as in OpenFold.
MASK_INF = 1e9
# One row lives in registers.
MAX_FUSED_SIZE = 16384
_LEAD = 4  # leading dims the kernel indexes bias and mask by


def softmax_reference(
    x: torch.Tensor, bias: torch.Tensor | None = None, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain-torch fused softmax: the specification every fast path is tested against.

    x: [*, K]; bias: broadcastable to x; mask: broadcastable to x (bool or 0/1, 1 = keep). Computes
    `softmax((x + bias) + (mask - 1) * MASK_INF, dim=-1)` in float32 (float64 for float64 input) and
    returns it in x's dtype. A row with every key masked comes out (nearly) uniform: the logits are
    all about -1e9, where float32 no longer resolves their differences.
    """
    compute = torch.promote_types(x.dtype, torch.float32)
    a = x.to(compute)
    if bias is not None:
        a = a + bias.to(compute)
    if mask is not None:
        a = a + (mask.to(compute) - 1.0) * MASK_INF
    return torch.softmax(a, dim=-1).to(x.dtype)


def _check_inputs(x: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor | None) -> None:
    check_float("x", x)
    if x.dim() < 1:
        raise ValueError("x: expected at least one dim (the softmax dim), got a 0-d tensor")
    check_optional("bias", bias, None, "x", x)
    check_optional("mask", mask, None, "x", x, floating=False)
    for name, t in (("bias", bias), ("mask", mask)):
        if t is not None and not broadcasts_to(t.shape, x.shape):
            raise ValueError(f"{name}: shape {list(t.shape)} does not broadcast to x's shape {list(x.shape)}")


def uses_triton(x: torch.Tensor) -> bool:
    """Whether `softmax` takes the Triton path for x (CUDA, or CPU under TRITON_INTERPRET=1 outside
    torch.compile; float32/bfloat16/float16; rows of at most `MAX_FUSED_SIZE`)."""
    return x.shape[-1] <= MAX_FUSED_SIZE and triton_can_run(x)


def _lead_strides(x: torch.Tensor, t: torch.Tensor | None) -> tuple[list[int], int]:
    """Strides of t expanded to x over x's leading dims (0 where broadcast), and its last-dim stride."""
    if t is None:
        return [0] * (x.dim() - 1), 0
    e = t.expand(x.shape)
    return list(e.stride()[:-1]), e.stride(-1)


def _merge_lead(sizes: list[int], strides: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Merge adjacent leading dims that every tensor walks as one (stride[i] == stride[i+1] * size[i+1])."""
    out_sizes = [sizes[0]] if sizes else []
    out_strides = [[s[0]] for s in strides] if sizes else [[] for _ in strides]
    for i in range(1, len(sizes)):
        if all(o[-1] == s[i] * sizes[i] for o, s in zip(out_strides, strides, strict=True)):
            out_sizes[-1] *= sizes[i]
            for o, s in zip(out_strides, strides, strict=True):
                o[-1] = s[i]
        else:
            out_sizes.append(sizes[i])
            for o, s in zip(out_strides, strides, strict=True):
                o.append(s[i])
    return out_sizes, out_strides


def _fits(x: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor | None) -> bool:
    """Whether the kernel can index bias and mask by strides over at most `_LEAD` merged leading dims."""
    sizes = list(x.shape[:-1])
    strides = [_lead_strides(x, bias)[0], _lead_strides(x, mask)[0]]
    return len(_merge_lead(sizes, strides)[0]) <= _LEAD


def softmax(
    x: torch.Tensor, bias: torch.Tensor | None = None, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Fused `softmax(x + bias + (mask - 1) * 1e9)` over the last dim of x, with autograd.

    x: [*, K] in float32, bfloat16 or float16 (float64 runs the reference), e.g. [B, S, H, Q, K];
    bias: broadcastable to x, e.g. a pair bias [B, 1, H, Q, K] (its gradient is summed over the
    broadcast dims and keeps bias's dtype); mask: broadcastable to x, bool or 0/1 floats, 1 = keep,
    e.g. [B, S, 1, 1, K]. Statistics in float32; output in x's dtype. See `softmax_reference` for the
    semantics of fully masked rows. Raises ValueError naming the argument on bad shapes, dtypes or
    devices.
    """
    _check_inputs(x, bias, mask)
    if not uses_triton(x) or x.numel() == 0:
        return softmax_reference(x, bias, mask)
    if mask is not None:
        mask = mask.detach().to(torch.float32)
    if not _fits(x, bias, mask):  # more than 4 independent broadcast patterns: materialize them
        bias = bias.expand(x.shape).contiguous() if bias is not None else None
        mask = mask.expand(x.shape).contiguous() if mask is not None else None
    return _softmax_fwd(x, bias, mask)


if HAS_TRITON:

    @triton.jit
    def _row_offset(row, d1, d2, d3, s0, s1, s2, s3):
        # Offset of `row` (row-major over the 4 merged leading dims) in a tensor with these strides.
        i3 = row % d3
        r = row // d3
        i2 = r % d2
        r = r // d2
        i1 = r % d1
        i0 = r // d1
        return i0 * s0 + i1 * s1 + i2 * s2 + i3 * s3

    @triton.jit
    def _softmax_fwd_kernel(
        X, Bias, Mask, Y,
        M, K, d1, d2, d3,
        sb0, sb1, sb2, sb3, sbk, sm0, sm1, sm2, sm3, smk,
        mask_inf,
        HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # Float arguments in float32 (torch.compile passes Python floats as float64 scalars).
        mask_inf = tl.cast(mask_inf, tl.float32)
        # Traffic: read x (and the broadcast bias and mask, mostly cache hits), write y once. Each
        # program owns BLOCK_M whole rows in registers; x and y are contiguous [M, K].
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        col_ok = cols < K
        ok = row_ok[:, None] & col_ok[None, :]
        a = tl.load(X + rows[:, None] * K + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            off = _row_offset(rows, d1, d2, d3, sb0, sb1, sb2, sb3)
            a += tl.load(Bias + off[:, None] + cols[None, :] * sbk, mask=ok, other=0.0).to(tl.float32)
        if HAS_MASK:
            off = _row_offset(rows, d1, d2, d3, sm0, sm1, sm2, sm3)
            m = tl.load(Mask + off[:, None] + cols[None, :] * smk, mask=ok, other=1.0)
            a += (m - 1.0) * mask_inf
        a = tl.where(col_ok[None, :], a, float("-inf"))
        e = tl.exp(a - tl.max(a, axis=1)[:, None])
        y = e / tl.sum(e, axis=1)[:, None]
        tl.store(Y + rows[:, None] * K + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _softmax_bwd_kernel(Y, DY, DX, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        # Traffic: read y and dy, write dx. dx = y * (dy - sum(y * dy)) per row, in float32.
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.arange(0, BLOCK_K)
        ok = (rows < M)[:, None] & (cols < K)[None, :]
        offs = rows[:, None] * K + cols[None, :]
        y = tl.load(Y + offs, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
        dx = y * (dy - tl.sum(y * dy, axis=1)[:, None])
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=ok)

    def _config(k: int, pass_: str) -> tuple[int, int]:
        """(BLOCK_M, num_warps) of the 'fwd' or 'bwd' kernel for rows of k, from the H200 sweep
        (`hfkit bench softmax --tiles`, data/results/h200/tuning/softmax.json). Forward: about
        1024 elements a program, 32 a thread (one warp up to K = 1024), the best or within 3% of it at
        every Evoformer shape; its default of 2048 elements on 4+ warps was up to 36% slower. Backward:
        about 2048 elements a program, 16 a thread, within 1% of the best everywhere (it moves as many
        bytes as a copy)."""
        block_k = _block_k(k)
        per_program = 1024 if pass_ == "fwd" else 2048
        per_thread = 32 if pass_ == "fwd" else 16
        block_m = max(1, per_program // block_k)
        return block_m, max(1, min(16, block_m * block_k // (32 * per_thread)))

    def _block_k(k: int) -> int:
        # Tiles are compile-time constants: under dynamic shapes int() specialises on the row length
        # (a guard), where a symbolic size would leave a SymInt in the traced kernel call.
        return max(16, next_power_of_2(int(k)))

    def launch_fwd(
        x: torch.Tensor,
        bias: torch.Tensor | None,
        mask: torch.Tensor | None,
        y: torch.Tensor,
        tiles: tuple[int, int],
    ) -> None:
        """Run the forward kernel on contiguous x into y; `tiles`: (BLOCK_M rows a program, num_warps)."""
        k = x.shape[-1]
        m = x.numel() // k
        (bs, bsk), (ms, msk) = _lead_strides(x, bias), _lead_strides(x, mask)
        sizes, (bs, ms) = _merge_lead(list(x.shape[:-1]), [bs, ms])
        pad = _LEAD - len(sizes)
        sizes, bs, ms = [1] * pad + sizes, [0] * pad + bs, [0] * pad + ms
        block_m, warps = tiles
        launch(_softmax_fwd_kernel, (cdiv(m, block_m),),
            x, bias, mask, y,
            m, k, sizes[1], sizes[2], sizes[3],
            *bs, bsk, *ms, msk,
            MASK_INF,
            HAS_BIAS=bias is not None, HAS_MASK=mask is not None,
            BLOCK_M=block_m, BLOCK_K=_block_k(k), num_warps=warps,
        )  # fmt: skip

    def launch_bwd(dy: torch.Tensor, y: torch.Tensor, dx: torch.Tensor, tiles: tuple[int, int]) -> None:
        """Run the backward kernel on contiguous dy, y into dx with `tiles` = (BLOCK_M, num_warps)."""
        k = y.shape[-1]
        m = y.numel() // k
        block_m, warps = tiles
        launch(
            _softmax_bwd_kernel,
            (cdiv(m, block_m),),
            y,
            dy,
            dx,
            m,
            k,
            BLOCK_M=block_m,
            BLOCK_K=_block_k(k),
            num_warps=warps,
        )

    @hfkit_op("softmax_fwd")
    def _softmax_fwd(x: torch.Tensor, bias: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor:
        xc = x.contiguous()
        y = torch.empty_like(xc)
        launch_fwd(xc, bias, mask, y, _config(x.shape[-1], "fwd"))
        return y

    @hfkit_op("softmax_bwd")
    def _softmax_bwd(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        dx = torch.empty_like(y)
        launch_bwd(dy.contiguous(), y, dx, _config(y.shape[-1], "bwd"))
        return dx

    def _setup_context(ctx, inputs, output) -> None:
        x, bias, _mask = inputs
        ctx.save_for_backward(output)
        ctx.x_shape = x.shape
        ctx.bias_meta = (bias.shape, bias.dtype) if bias is not None else None

    def _backward(ctx, dy):
        (y,) = ctx.saved_tensors
        dx = _softmax_bwd(dy, y)
        dbias = None
        if ctx.bias_meta is not None and ctx.needs_input_grad[1]:
            shape, dtype = ctx.bias_meta
            dbias = _sum_to(dx, shape).to(dtype)
        return (dx if ctx.needs_input_grad[0] else None), dbias, None

    _softmax_fwd.autograd(_backward, _setup_context)


def _sum_to(g: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum g (float32 accumulation) over the dims along which a tensor of `shape` was broadcast to it."""
    lead = g.dim() - len(shape)
    dims = list(range(lead)) + [lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1]
    if not dims:
        return g
    return g.sum(dim=dims, keepdim=True, dtype=torch.float32).reshape(shape)
