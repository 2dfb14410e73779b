"""LayerNorm: Triton forward and backward kernels, a torch custom op with autograd, and the reference.

`layer_norm` has the signature and semantics of `torch.nn.functional.layer_norm`. On CUDA tensors (and
on CPU tensors under `TRITON_INTERPRET=1`) it runs the Triton kernels below, registered as the custom
ops `hfkit::layer_norm_fwd` / `hfkit::layer_norm_bwd` through `torch.library.triton_op`, so
`torch.compile` traces through them without a graph break. Everywhere else (CPU, float64, normalized
sizes above `MAX_FUSED_SIZE`, or no Triton installed) it runs `layer_norm_reference`, the plain-torch
definition of the op. Statistics are always computed in float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.autograd.function import once_differentiable

from hfkit.ops._checks import check_eps, check_float, check_optional
from hfkit.ops._linear import column_sums
from hfkit.ops._triton import (
    HAS_TRITON,
    cdiv,
    hfkit_op,
    launch,
    next_power_of_2,
    num_sms,
    rows_view,
    triton_can_run,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["layer_norm", "layer_norm_reference", "layer_norm_with_residual", "MAX_FUSED_SIZE", "uses_triton"]

# One row lives in registers; past this many elements per row the backward kernel spills.
MAX_FUSED_SIZE = 16384

ShapeLike = int | Sequence[int] | torch.Size


def _as_shape(normalized_shape: ShapeLike) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    try:
        if isinstance(normalized_shape, str):
            raise TypeError
        shape = tuple(int(d) for d in normalized_shape)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"normalized_shape: expected an int or a sequence of ints, got {normalized_shape!r}"
        ) from err
    if not shape or any(d <= 0 for d in shape):
        raise ValueError(f"normalized_shape: expected positive sizes, got {shape}")
    return shape


def layer_norm_reference(
    x: torch.Tensor,
    normalized_shape: ShapeLike,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Plain-torch LayerNorm: the specification every fast path is tested against.

    x: [*, *normalized_shape]. Mean and biased variance over the trailing `normalized_shape` dims,
    computed in float32 (float64 for float64 input); `y = (x - mean) / sqrt(var + eps) * weight + bias`
    with the affine part also in that precision, returned in `x.dtype`.
    """
    shape = _as_shape(normalized_shape)
    dims = tuple(range(-len(shape), 0))
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    mean = xf.mean(dim=dims, keepdim=True)
    xc = xf - mean
    var = (xc * xc).mean(dim=dims, keepdim=True)
    y = xc * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype)


def _check_inputs(
    x: torch.Tensor,
    shape: tuple[int, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> None:
    check_float("x", x)
    if tuple(x.shape[x.dim() - len(shape) :]) != shape or x.dim() < len(shape):
        raise ValueError(
            f"normalized_shape: {list(shape)} does not match the trailing dims of x with shape "
            f"{list(x.shape)}"
        )
    check_optional("weight", weight, shape, "x", x)
    check_optional("bias", bias, shape, "x", x)
    check_eps(eps)


def uses_triton(x: torch.Tensor, normalized_size: int) -> bool:
    """Whether `layer_norm` takes the Triton path for `x` with this many normalized elements.

    True on CUDA, and on CPU when `TRITON_INTERPRET=1` (except while `torch.compile` traces, where the
    reference is what Inductor compiles on CPU), for float32/bfloat16/float16 and rows of at most
    `MAX_FUSED_SIZE` elements.
    """
    return normalized_size <= MAX_FUSED_SIZE and triton_can_run(x)


def layer_norm(
    x: torch.Tensor,
    normalized_shape: ShapeLike,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Fused LayerNorm over the trailing `normalized_shape` dims of x, a drop-in for `F.layer_norm`.

    x: [*, *normalized_shape] in float32, bfloat16 or float16 (float64 runs the reference), any leading
    shape, contiguous or not; weight, bias: `normalized_shape` or None, any floating dtype and strides
    (their gradients keep their dtypes). The output is in `out_dtype` (default x's dtype: a float32 x
    normalized for a bfloat16 matmul can be written in bfloat16 directly, the values the matmul's cast
    would give; x's gradient stays in x's dtype). Statistics and gradient sums are in float32.
    Raises ValueError naming the argument on a wrong shape, dtype or device.
    """
    shape = _as_shape(normalized_shape)
    _check_inputs(x, shape, weight, bias, eps)
    out_dtype = _check_out_dtype(x, out_dtype)
    n = math.prod(shape)
    if not uses_triton(x, n):
        return layer_norm_reference(x, shape, weight, bias, eps).to(out_dtype)
    y, _, _ = _layer_norm_fwd(x, _by_column(weight), _by_column(bias), n, float(eps), out_dtype)
    return y


def _check_out_dtype(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    """`out_dtype`, x's dtype for None; ValueError unless a floating dtype the kernels write."""
    if out_dtype is None:
        return x.dtype
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise ValueError(f"out_dtype: expected a floating torch.dtype or None, got {out_dtype!r}")
    return out_dtype


def _by_column(t: torch.Tensor | None) -> torch.Tensor | None:
    """A LayerNorm weight or bias as the kernels index it, by column: unit stride (a copy of n elements
    at most)."""
    return t.contiguous() if t is not None else None


def layer_norm_with_residual(
    x: torch.Tensor,
    normalized_shape: ShapeLike,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`layer_norm(x, ..., out_dtype=out_dtype)`, r), where r holds x's values: x passed through for
    the residual connection around the LayerNorm's block (`r + block(y)` in place of `x + block(y)`).

    x then has one consumer instead of two, so autograd never adds its two gradients: the LayerNorm
    backward kernel adds r's gradient into dx as it writes it (one read more in that kernel, against
    an add's three passes). r is a view of x. Where `layer_norm` would not run Triton, or x needs no
    gradient, or `torch.compile` traces, r is x itself. Arguments and errors as `layer_norm`.
    """
    shape = _as_shape(normalized_shape)
    _check_inputs(x, shape, weight, bias, eps)
    out_dtype = _check_out_dtype(x, out_dtype)
    n = math.prod(shape)
    if (
        not uses_triton(x, n)
        or not (torch.is_grad_enabled() and x.requires_grad)
        or torch.compiler.is_compiling()
    ):
        return layer_norm(x, shape, weight, bias, eps, out_dtype=out_dtype), x
    return _LayerNormResidual.apply(x, _by_column(weight), _by_column(bias), n, float(eps), out_dtype)


class _LayerNormResidual(torch.autograd.Function):
    """LayerNorm with x's residual pass-through as a second output (`layer_norm_with_residual`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, n, eps, out_dtype):
        y, mean, rstd = _layer_norm_fwd(x, weight, bias, n, eps, out_dtype)
        _save_for_backward(ctx, x, weight, bias, n, mean, rstd)
        ctx.set_materialize_grads(False)
        return y, x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy, dres):
        if dy is None:  # only the pass-through was used
            return dres, None, None, None, None, None
        return *_input_grads(ctx, dy, dres), None, None, None


if HAS_TRITON:

    @triton.jit
    def _layer_norm_fwd_kernel(
        X, Y, W, B, Mean, Rstd,
        stride_x, stride_y, M, N, eps,
        HAS_W: tl.constexpr, HAS_B: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # Float arguments in float32 (torch.compile passes Python floats as float64 scalars).
        eps = tl.cast(eps, tl.float32)
        # Traffic: read x once, write y once, plus 8 bytes of statistics per row. Each program owns
        # BLOCK_M whole rows held in registers, so the two reductions need no second pass over memory.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        tl.store(Mean + rows, mean, mask=row_ok)
        tl.store(Rstd + rows, rstd, mask=row_ok)

    @triton.jit
    def _bwd_load(
        X, DY, DRES, Mean, Rstd, block, stride_x, stride_dy, stride_dres, M, N,
        HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # One row block of x, dy (and dres) and its statistics; a block past the end loads nothing.
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        row_ok = rows < M
        mask = row_ok[:, None] & (cols < N)[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        dres = 0.0
        if HAS_RES:
            dres = tl.load(DRES + rows64[:, None] * stride_dres + cols[None, :], mask=mask, other=0.0)
        mean = tl.load(Mean + rows, mask=row_ok, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
        return x, dy, dres, mean, rstd

    @triton.jit
    def _bwd_block(
        x, dy, dres, mean, rstd, w, DX, DWB, block, stride_dx, M, N, dw_acc, db_acc,
        HAS_W: tl.constexpr, HAS_DW: tl.constexpr, HAS_RES: tl.constexpr, ACC2D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        x = x.to(tl.float32)
        dy = dy.to(tl.float32)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:  # noqa: SIM108  (a constexpr branch, resolved at compile time)
            wdy = dy * w[None, :]
        else:
            wdy = dy
        c1 = tl.sum(xhat * wdy, axis=1) / N
        c2 = tl.sum(wdy, axis=1) / N
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if HAS_RES:  # the gradient of x's residual pass-through, added as dx is written
            dx += dres.to(tl.float32)
        dx_ptrs = DX + rows.to(tl.int64)[:, None] * stride_dx + cols[None, :]
        tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_DW:
            if ACC2D:  # elementwise per (row slot, column): no cross-thread reduction per block
                dw_acc += dy * xhat
                db_acc += dy
            else:
                dw_acc += tl.sum(dy * xhat, axis=0)
                db_acc += tl.sum(dy, axis=0)
        return dw_acc, db_acc

    @triton.jit
    def _layer_norm_bwd_kernel(
        X, DY, DX, W, Mean, Rstd, DWB, DRES,
        stride_x, stride_dy, stride_dx, stride_dwb, stride_dres, M, N,
        HAS_W: tl.constexpr, HAS_DW: tl.constexpr, HAS_RES: tl.constexpr, PREFETCH: tl.constexpr,
        ACC2D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # Traffic: read x and dy, write dx (3 passes of the tensor; statistics are 8 bytes a row);
        # with HAS_RES also read dres, the gradient of x's residual pass-through, added into dx.
        # Persistent grid: program p walks row blocks p, p + G, ... and keeps its share of
        # dweight/dbias in float32 registers, writing them as row `pid` of DWB [G, 2 N] (dweight, then
        # dbias; rows stride_dwb apart) at the end; the host sums the G rows. That avoids atomics
        # (deterministic) and a second pass over x and dy.
        # With PREFETCH the loads of the next block are issued before the current block's
        # reductions, so each program keeps two blocks of loads in flight.
        pid = tl.program_id(0)
        num_programs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) if HAS_W else None
        if ACC2D:
            dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        else:
            dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        num_blocks = tl.cdiv(M, BLOCK_M)
        if PREFETCH:
            x, dy, dres, mean, rstd = _bwd_load(
                X, DY, DRES, Mean, Rstd, pid, stride_x, stride_dy, stride_dres, M, N,
                HAS_RES, BLOCK_M, BLOCK_N,
            )  # fmt: skip
            for block in range(pid, num_blocks, num_programs):
                nx, ndy, ndres, nmean, nrstd = _bwd_load(
                    X, DY, DRES, Mean, Rstd, block + num_programs, stride_x, stride_dy, stride_dres, M, N,
                    HAS_RES, BLOCK_M, BLOCK_N,
                )  # fmt: skip
                dw_acc, db_acc = _bwd_block(
                    x, dy, dres, mean, rstd, w, DX, DWB, block, stride_dx, M, N, dw_acc, db_acc,
                    HAS_W, HAS_DW, HAS_RES, ACC2D, BLOCK_M, BLOCK_N,
                )  # fmt: skip
                x, dy, dres, mean, rstd = nx, ndy, ndres, nmean, nrstd
        else:
            for block in range(pid, num_blocks, num_programs):
                x, dy, dres, mean, rstd = _bwd_load(
                    X, DY, DRES, Mean, Rstd, block, stride_x, stride_dy, stride_dres, M, N,
                    HAS_RES, BLOCK_M, BLOCK_N,
                )  # fmt: skip
                dw_acc, db_acc = _bwd_block(
                    x, dy, dres, mean, rstd, w, DX, DWB, block, stride_dx, M, N, dw_acc, db_acc,
                    HAS_W, HAS_DW, HAS_RES, ACC2D, BLOCK_M, BLOCK_N,
                )  # fmt: skip
        if HAS_DW:
            if ACC2D:
                dw_acc = tl.sum(dw_acc, axis=0)
                db_acc = tl.sum(db_acc, axis=0)
            tl.store(DWB + pid * stride_dwb + cols, dw_acc, mask=col_ok)
            tl.store(DWB + pid * stride_dwb + N + cols, db_acc, mask=col_ok)


def _fwd_config(n: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the forward kernel.

    From the H200 sweep (`hfkit bench layer_norm --tiles`, data/results/h200/tuning/):
    about 1024 elements per program and 16 per thread was best or within 5% of best at every census
    size (64-1024), for fp32 and bf16 alike. `elem_bytes` is kept for dtype-specific tuning.
    """
    block_n = next_power_of_2(n)
    block_m = max(1, 1024 // block_n)
    return block_m, block_n, _warps_for(block_m * block_n)


def _bwd_config(n: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the backward kernel: about 512 elements per program.

    The sweep favoured small tiles with many resident programs (16 single-warp programs per SM at
    N = 64-256): more independent loads in flight per SM than a few wide programs give.
    """
    block_n = next_power_of_2(n)
    block_m = max(1, 512 // block_n)
    return block_m, block_n, _warps_for(block_m * block_n)


def _warps_for(tile: int) -> int:
    # 16 elements a thread: wide enough for 16-byte loads, small enough to stay in registers.
    return max(1, min(16, tile // 512))


def _launch_fwd(x2, y2, weight, bias, mean, rstd, eps: float, cfg: tuple[int, int, int]) -> None:
    block_m, block_n, num_warps = cfg
    m, n = x2.shape
    launch(_layer_norm_fwd_kernel, (cdiv(m, block_m),),
        x2, y2, weight, bias, mean, rstd,
        x2.stride(0), y2.stride(0), m, n, eps,
        HAS_W=weight is not None, HAS_B=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip


def _launch_bwd(
    x2, dy2, dx2, weight, mean, rstd, dwb, need_dwb: bool, programs: int, cfg,
    prefetch: bool | None = None, acc2d: bool = True, dres2: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """The backward kernel's variants: `prefetch` issues the next row block's loads before the current
    block's reductions (None: by dtype), `acc2d` keeps dweight/dbias partials per row slot until the end;
    `dres2` ([M, N] rows of unit column stride, or None) is added into dx as it is written."""
    block_m, block_n, num_warps = cfg
    if prefetch is None:
        # The H200 sweep: 3-9% faster for 2-byte dtypes, neutral to slightly worse for float32.
        prefetch = x2.element_size() < 4
    m, n = x2.shape
    if need_dwb and (dwb.dim() != 2 or dwb.shape[0] < programs or dwb.shape[1] < 2 * n):
        # The kernel writes row `pid` of dwb, 2 n values: anything smaller would be written past.
        raise ValueError(
            f"dwb: expected at least [{programs}, {2 * n}] (a row a program), got {list(dwb.shape)}"
        )
    if dres2 is not None and (dres2.shape != (m, n) or (n > 1 and dres2.stride(1) != 1)):
        raise ValueError(f"dres: expected [{m}, {n}] rows of unit column stride, got {list(dres2.shape)}")
    launch(_layer_norm_bwd_kernel, (programs,),
        x2, dy2, dx2, weight, mean, rstd, dwb, dres2,
        x2.stride(0), dy2.stride(0), dx2.stride(0), dwb.stride(0) if need_dwb else 0,
        dres2.stride(0) if dres2 is not None else 0, m, n,
        HAS_W=weight is not None, HAS_DW=need_dwb, HAS_RES=dres2 is not None, PREFETCH=prefetch,
        ACC2D=acc2d, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip


def _bwd_programs(m: int, cfg: tuple[int, int, int], device: torch.device, per_sm: int | None = None) -> int:
    """Persistent grid size: enough resident programs to fill every SM, never more than row blocks."""
    block_m, _, num_warps = cfg
    num_blocks = cdiv(m, block_m) if m else 0
    if per_sm is None:
        per_sm = max(1, 16 // num_warps)  # 16 resident warps an SM: the sweep's best
    return max(1, min(num_blocks, num_sms(device) * per_sm))


if HAS_TRITON:

    @hfkit_op("layer_norm_fwd")
    def _layer_norm_fwd(
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        n: int,
        eps: float,
        out_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(y in out_dtype, float32 mean and rstd a row)."""
        x2 = rows_view(x, n)
        m = x2.shape[0]
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        mean = torch.empty(m, dtype=torch.float32, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        if m == 0:
            return y, mean, rstd
        y2 = y.view(m, n)
        _launch_fwd(x2, y2, weight, bias, mean, rstd, eps, _fwd_config(n, x.element_size()))
        return y, mean, rstd

    @hfkit_op("layer_norm_bwd")
    def _layer_norm_bwd(
        dy: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        mean: torch.Tensor,
        rstd: torch.Tensor,
        n: int,
        need_dwb: bool,
        dres: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns dx (plus dres, x's residual gradient, where given) and the float32 sums
        [dweight, dbias] as one [2, n] tensor ([0, n] if not needed)."""
        x2 = rows_view(x, n)
        dy2 = rows_view(dy, n)
        dres2 = rows_view(dres, n) if dres is not None else None
        m = x2.shape[0]
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dx2 = dx.view(m, n)
        cfg = _bwd_config(n, x.element_size())
        programs = _bwd_programs(m, cfg, x.device)
        dwb = torch.empty((programs, 2 * n) if need_dwb else (0,), dtype=torch.float32, device=x.device)
        if m > 0:
            _launch_bwd(x2, dy2, dx2, weight, mean, rstd, dwb, need_dwb, programs, cfg, dres2=dres2)
        if not need_dwb:
            return dx, x.new_empty((0, n), dtype=torch.float32)
        if m == 0:
            return dx, torch.zeros((2, n), dtype=torch.float32, device=x.device)
        return dx, column_sums(dwb).view(2, n)

    def _save_for_backward(ctx, x, weight, bias, n, mean, rstd) -> None:
        """What the backward of `layer_norm` and of `layer_norm_with_residual` reads (`_input_grads`)."""
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.n = n
        ctx.bias_meta = (bias.shape, bias.dtype) if bias is not None else None

    def _input_grads(ctx, dy, dres=None):
        """(dx, dweight, dbias) for the output gradient dy (dx plus dres, the residual's, where given);
        dweight, dbias None where not needed."""
        x, weight, mean, rstd = ctx.saved_tensors
        need_w = weight is not None and ctx.needs_input_grad[1]
        need_b = ctx.bias_meta is not None and ctx.needs_input_grad[2]
        dx, dwb = _layer_norm_bwd(dy, x, weight, mean, rstd, ctx.n, need_w or need_b, dres)
        if need_w and need_b and ctx.bias_meta == (weight.shape, weight.dtype):
            # Both sums in one cast (none for float32 parameters) and one split: fewer calls.
            grad_w, grad_b = dwb.to(weight.dtype).view(2, *weight.shape).unbind(0)
            return dx, grad_w, grad_b
        grad_w = dwb[0].to(weight.dtype).view(weight.shape) if need_w else None
        grad_b = dwb[1].to(ctx.bias_meta[1]).view(ctx.bias_meta[0]) if need_b else None
        return dx, grad_w, grad_b

    def _setup_context(ctx, inputs, output) -> None:
        x, weight, bias, n, _eps, _out_dtype = inputs
        _y, mean, rstd = output
        ctx.mark_non_differentiable(mean, rstd)
        # No zero-filled gradients for mean and rstd (two allocations and fills a backward).
        ctx.set_materialize_grads(False)
        _save_for_backward(ctx, x, weight, bias, n, mean, rstd)

    def _backward(ctx, dy, _dmean, _drstd):
        if dy is None:
            return None, None, None, None, None, None
        dx, grad_w, grad_b = _input_grads(ctx, dy)
        return dx if ctx.needs_input_grad[0] else None, grad_w, grad_b, None, None, None

    _layer_norm_fwd.autograd(_backward, _setup_context)
