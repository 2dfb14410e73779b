"""`linear`: `torch.nn.functional.linear` with float32 matmuls on the tensor cores at full precision.

torch runs float32 matmuls at its default precision ("highest") as IEEE float32 cuBLAS GEMMs, off the
tensor cores (~50 TFLOP/s on the H200). `linear` runs them as one Triton GEMM kernel whose products
are three TF32 products each (`dot` with `DOT` 3: each operand split into a TF32 head and a TF32 tail),
on the tensor cores, accurate to about 1e-6 relative. The kernel computes C = A @ B for any strides of
A and B, so the forward (y = x Wᵀ, with the bias added in its epilogue) and both backward products
(dx = dy W, dW = dyᵀ x) read their operands laid out along the reduction dim (copied so).

The kernel runs on float32 CUDA tensors while torch's float32 matmul precision is "highest", and on
float32 CPU tensors under `TRITON_INTERPRET=1` (IEEE products there). Everything else calls `F.linear`:
bfloat16 and float16 (cuBLAS on the tensor cores already), precision "high"/"medium" (torch then uses
TF32 itself), float64, CPU without the interpreter, autocast, `torch.compile` tracing, and shapes or
dtypes `F.linear` would refuse (its own errors); where the bias needs a gradient (outside torch.compile)
through a function whose bias gradient is a gemv with ones (`column_sums`), faster on a GPU than
autograd's column sum.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812
from torch.autograd.function import once_differentiable

from hfkit.ops._linear import autocast_operands, column_sums
from hfkit.ops._triton import (
    HAS_TRITON,
    cdiv,
    dot_mode,
    hfkit_op,
    interpreting,
    launch,
    num_sms,
    triton_can_run,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from hfkit.ops._triton import dot

__all__ = ["CONFIGS", "MatmulConfig", "linear", "linear_reference", "uses_triton"]


class MatmulConfig(NamedTuple):
    """One tiling of the GEMM kernel: tile sizes, programs per group along M (the grouped program order
    that keeps a group's A rows and B columns in L2), warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# The CUDA default: 128 x 128 float32 tiles, K steps of 32 (3 stages of A and B tiles: 96 KiB of
# shared memory).
CUDA_CONFIG = MatmulConfig(128, 128, 32, 8, 8, 3)
# Products with few output tiles (weight gradients: [1536, 512] over 320000 rows is 48 tiles of 128 x
# 128 for 132 SMs, split along K): narrower tiles, 4 stages. On an H200 (MHA's shapes, float32) 8.3 ms
# against 11.5 with CUDA_CONFIG for that one, and within 2% elsewhere (linear_sweep).
SMALL_OUTPUT_CONFIG = MatmulConfig(128, 64, 32, 8, 4, 4)
# The interpreter runs programs one after another in Python: small tiles keep odd sizes cheap.
INTERPRETER_CONFIG = MatmulConfig(32, 32, 32, 4, 4, 1)
# The transposing copies' square tile (float32: 16 KiB through shared memory a program).
TRANSPOSE_TILE = 64
# Candidates for a sweep on the GPU (`_matmul(..., config)` with each).
CONFIGS: tuple[MatmulConfig, ...] = (
    CUDA_CONFIG,
    SMALL_OUTPUT_CONFIG,
    MatmulConfig(128, 128, 32, 8, 4, 3),
    MatmulConfig(128, 256, 32, 8, 8, 3),
    MatmulConfig(256, 128, 32, 8, 8, 3),
    MatmulConfig(128, 128, 64, 8, 8, 2),
    MatmulConfig(64, 128, 32, 8, 4, 4),
)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed in float64 and returned in x's dtype: what `linear` is tested
    against. x [*, K], weight [N, K], bias [N] or None -> [*, N]."""
    y = F.linear(x.double(), weight.double(), bias.double() if bias is not None else None)
    return y.to(x.dtype)


def uses_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether `linear(x, weight, bias)` runs the GEMM kernel: float32 x, weight and bias of the shapes
    [*, K], [N, K] and [N] with K, N and the rows of x nonzero, on one device where a kernel runs
    (`triton_can_run`) with full-precision products (`dot_mode` 3 on CUDA, 1 under the interpreter),
    autocast off, and not while torch.compile traces (Inductor compiles `F.linear` at torch's precision;
    the precision setting `dot_mode` reads is no value dynamo can trace)."""
    if torch.compiler.is_compiling():
        return False
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or dot_mode(x) not in (1, 3):
        return False
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1] or x.numel() == 0:
        return False
    if weight.shape[0] == 0 or weight.device != x.device:
        return False
    if bias is not None and (
        bias.dtype != torch.float32 or tuple(bias.shape) != (weight.shape[0],) or bias.device != x.device
    ):
        return False
    return triton_can_run(x) and not torch.is_autocast_enabled(x.device.type)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with autograd, float32 products on the tensor cores.

    x: [*, K], weight: [N, K], bias: [N] or None; returns [*, N] = x Wᵀ + b. Any strides. Where
    `uses_triton` says so it runs the GEMM kernel (three TF32 products per float32 product on CUDA, about
    1e-6 relative error; IEEE under the interpreter) for the output and the gradients of x, weight and
    bias; elsewhere it is `F.linear` itself, with its errors for wrong shapes or dtypes.
    """
    if not uses_triton(x, weight, bias):
        if bias is not None and bias.requires_grad and not torch.compiler.is_compiling():
            return _LinearColumnSums.apply(*autocast_operands(x.device.type, x, weight, bias))
        return F.linear(x, weight, bias)
    return _linear_fwd(x, weight, bias)


class _LinearColumnSums(torch.autograd.Function):
    """`F.linear` whose bias gradient is `column_sums` (a gemv) instead of autograd's `sum(0)`: torch's
    column sum of a [65536, 128] bfloat16 gradient took 65 us on an H200, the gemv 9 us; the other two
    products are the matmuls autograd runs. Operands arrive in the autocast dtype (`autocast_operands`)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        n, k = weight.shape
        dy2 = dy.reshape(-1, n)
        grad_x = dy2.mm(weight).view(x.shape) if needs[0] else None
        grad_w = dy2.t().mm(x.reshape(-1, k)) if needs[1] else None
        return grad_x, grad_w, column_sums(dy2) if needs[2] else None


if HAS_TRITON:

    @triton.jit
    def _matmul_kernel(
        A, B, C, Bias,
        M, N, K, k_per_split,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cs, stride_cm, stride_cn, stride_bias,
        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        # C[split] = A[:, ks] @ B[ks, :] (+ bias along N) over the split's K range ks, accumulated in
        # float32. Programs along axis 0 walk the output tiles in groups of GROUP_M tile rows, column by
        # column within a group, so that consecutive programs share B columns and a group's A rows stay
        # in L2. Rows and columns past the end load wrapped (valid) rows and columns and are not stored.
        pid = tl.program_id(0)
        split = tl.program_id(1)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K).to(tl.int64)
        # int64 offsets: a row stride times a row index passes 2**31 past 2**31 elements.
        am = (rm % M).to(tl.int64)
        bn = (rn % N).to(tl.int64)
        k_start = split * k_per_split
        k_end = min(K, k_start + k_per_split)
        a_ptrs = A + am[:, None] * stride_am + (k_start + rk)[None, :] * stride_ak
        b_ptrs = B + (k_start + rk)[:, None] * stride_bk + bn[None, :] * stride_bn
        step_a = tl.full([], BLOCK_K, tl.int64) * stride_ak
        step_b = tl.full([], BLOCK_K, tl.int64) * stride_bk
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = rk < k_end - k
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            acc += dot(a, b, DOT)
            a_ptrs += step_a
            b_ptrs += step_b
        if HAS_BIAS:
            bias = tl.load(Bias + rn.to(tl.int64) * stride_bias, mask=rn < N, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        c_ptrs = (
            C
            + split.to(tl.int64) * stride_cs
            + rm.to(tl.int64)[:, None] * stride_cm
            + rn.to(tl.int64)[None, :] * stride_cn
        )
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])

    @triton.jit
    def _transpose_kernel(
        Src, Dst, M, N, stride_sm, stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # Dst [N, M] (contiguous) = Src [M, N]ᵀ, one [BLOCK_M, BLOCK_N] tile a program: loaded along
        # Src's rows and stored along Dst's, the transpose between them through shared memory.
        rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        tile = tl.load(Src + rm[:, None] * stride_sm + rn[None, :] * stride_sn, mask=mask)
        tl.store(Dst + rn[:, None] * M + rm[None, :], tl.trans(tile), mask=tl.trans(mask))


def default_config(device: torch.device, m: int, n: int) -> MatmulConfig:
    """The tiling `linear` uses on `device` for an [m, n] output: on CUDA `SMALL_OUTPUT_CONFIG` when the
    output has fewer 128 x 128 tiles than two per SM, else `CUDA_CONFIG`; `INTERPRETER_CONFIG` under the
    interpreter."""
    if device.type != "cuda" or interpreting():
        return INTERPRETER_CONFIG
    if cdiv(m, 128) * cdiv(n, 128) < 2 * num_sms(device):
        return SMALL_OUTPUT_CONFIG
    return CUDA_CONFIG


def _split_k(m: int, n: int, k: int, config: MatmulConfig, device: torch.device) -> int:
    """How many K ranges the programs of one output tile share: 1 while the output tiles fill the SMs;
    for a small output with a long K (the weight gradient over many rows: [512, 512] over 320000 rows is
    16 tiles for 132 SMs) enough ranges to fill them, each at least 16 K steps long."""
    tiles = cdiv(m, config.block_m) * cdiv(n, config.block_n)
    sms = num_sms(device)
    if tiles >= sms:
        return 1
    return max(1, min(cdiv(sms, tiles), k // (16 * config.block_k)))


def _matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    config: MatmulConfig,
    split_k: int | None = None,
) -> None:
    """out [M, N] = a [M, K] @ b [K, N] (+ bias [N]) with the GEMM kernel at `config`, float32
    accumulation, any strides of a, b and out. `split_k` K ranges (None: `_split_k`) are summed in
    float32 partials when more than one. M, N > 0."""
    m, k = a.shape
    n = b.shape[1]
    if split_k is None:
        split_k = _split_k(m, n, k, config, a.device)
    k_per_split = cdiv(cdiv(k, split_k), config.block_k) * config.block_k if k else config.block_k
    split_k = max(1, cdiv(k, k_per_split))
    target = out if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=a.device)
    stride_cs = 0 if split_k == 1 else target.stride(0)
    stride_cm, stride_cn = out.stride() if split_k == 1 else target.stride()[1:]
    kernel_bias = bias if split_k == 1 else None
    grid = (cdiv(m, config.block_m) * cdiv(n, config.block_n), split_k)
    launch(_matmul_kernel, grid,
        a, b, target, kernel_bias,
        m, n, k, k_per_split,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), stride_cs, stride_cm, stride_cn,
        kernel_bias.stride(0) if kernel_bias is not None else 0,
        HAS_BIAS=kernel_bias is not None, EVEN_K=k % config.block_k == 0, DOT=dot_mode(a),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if split_k > 1:
        out.copy_(target.sum(dim=0))
        if bias is not None:
            out.add_(bias)


if HAS_TRITON:

    @hfkit_op("linear_fwd")
    def _linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        n, k = weight.shape
        y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
        x2 = x.reshape(-1, k)
        _matmul(x2, weight.t(), y.view(-1, n), bias, default_config(x.device, x2.shape[0], n))
        return y

    @hfkit_op("linear_mm")
    def _linear_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a [M, K] @ b [K, N] with the GEMM kernel (the backward's products)."""
        out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
        if out.numel() > 0:
            _matmul(a, b, out, None, default_config(a.device, a.shape[0], b.shape[1]))
        return out

    @hfkit_op("linear_transpose")
    def _transposed(a: torch.Tensor) -> torch.Tensor:
        """a [M, N] (any strides) -> aᵀ as a new contiguous [N, M] tensor: the transposing copies the
        backward's products read. torch's `a.t().contiguous()` runs a strided elementwise copy: of a
        row-major float32 [320000, 1536] matrix 6.2 ms on the H200 (0.64 TB/s read + written), where
        this tiled transpose, reading and writing whole rows, took 1.0 ms (3.9 TB/s)."""
        m, n = a.shape
        out = torch.empty((n, m), dtype=a.dtype, device=a.device)
        if out.numel() > 0:
            tile = TRANSPOSE_TILE
            launch(_transpose_kernel, (cdiv(m, tile), cdiv(n, tile)),
                a, out, m, n, a.stride(0), a.stride(1), BLOCK_M=tile, BLOCK_N=tile, num_warps=4,
            )  # fmt: skip
        return out

    def _along_rows(a: torch.Tensor) -> torch.Tensor:
        """aᵀ [N, M] contiguous for a [M, N]: a view where a is column-major already, else a tiled
        transposed copy (`_transposed` returns a new tensor: a custom op may not alias its input)."""
        t = a.t()
        return t if t.is_contiguous() else _transposed(a)

    def _setup_context(ctx, inputs, output) -> None:
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None

    def _backward(ctx, dy):
        x, weight = ctx.saved_tensors
        n, k = weight.shape
        needs = ctx.needs_input_grad
        dy2 = dy.reshape(-1, n)
        grad_x = grad_w = grad_b = None
        # Operands laid out along the reduction dim (copies where they are not): Hopper's TF32
        # tensor-core instruction reads both operands that way, and other layouts fall back to slower
        # ones (the backward measured 2-3x slower than the forward per FLOP). The copies cost one pass
        # over dy, x and the weight each (dy and x by the tiled transpose: they have a row per token).
        if needs[0]:
            grad_x = _linear_mm(dy2, weight.t().contiguous().t()).view(x.shape)
        if needs[1]:
            grad_w = _linear_mm(_along_rows(dy2), _along_rows(x.reshape(-1, k)).t())
        if ctx.has_bias and needs[2]:
            grad_b = column_sums(dy2)
        return grad_x, grad_w, grad_b

    _linear_fwd.autograd(_backward, _setup_context)
