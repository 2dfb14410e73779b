"""Triangle multiplicative update (AF2 Algorithms 11 and 12): the reference, checks, launchers, autograd.

`triangle_multiplication(z, mask, ...)` is the whole update of OpenFold's
`TriangleMultiplicationOutgoing/Incoming` as one function of the pair representation and the module's
parameters, with the five input projections given as one concatenated weight:

    zn = LN_in(z);  [a_p, a_g, b_p, b_g, g] = zn @ proj_weight.T + proj_bias
    a = mask * sigmoid(a_g) * a_p;  b = mask * sigmoid(b_g) * b_p
    x_ij = sum_k a_ik b_jk (outgoing) or sum_k a_ki b_kj (incoming), per channel
    out = (LN_out(x) @ out_weight.T + out_bias) * sigmoid(g)

The fast path (CUDA, or CPU under `TRITON_INTERPRET=1`) keeps the big matmuls in cuBLAS and fuses what
lies between them (its kernels are in `hfkit.ops._triangle_multiplication_kernels`), so the pair
tensor is read and written as few times as possible (M = pairs):

- LayerNorm in: `hfkit.ops.layer_norm`'s kernels, reading z in its own dtype (float32 under autocast)
  and writing zn in the compute dtype.
- `proj_gate`: a = mask * sigmoid(a_g) * a_p and b likewise, the four a/b projections computed by
  tl.dot inside the gating kernel and written channel-first [*, C_h, N, N], so that the triangular
  contraction is one strided-batched cuBLAS matmul with the transposes folded into its flags. With
  `fuse_projection=False` one cuBLAS matmul writes all five projections [M, 4 C_h + C_z] and
  `gate_ab` reads them back.
- `out` (C_h and C_z at most `FUSED_OUT_MAX`): out = (LN_out(x) @ W_z.T + b_z) * sigmoid(zn @ W_g.T
  + b_g) in one kernel: x read channel-first, y, o and g kept in registers. Otherwise (or with
  `fuse_projection=False`) in steps: `ln_out_t` (LayerNorm over the channels of x read channel-first
  and written row-major [*, N, N, C_h]), linear_z and linear_g (cuBLAS), `out_gate`.

The backward (a `torch.autograd.Function`) mirrors it: the output kernel recomputes y, o and g and
writes d(o), dg and y (or the output-gate kernel does, after LN_out and the two linears), the
transposed LayerNorm backward writes dx channel-first, two batched matmuls give da and db, the gate
kernel recomputes the a/b projections from zn and writes their gradients into the same
[M, 4 C_h + C_z] buffer as dg, so one matmul gives d(zn) and one the projection weight's gradient.
Bias and LayerNorm-weight gradients are summed from per-program float32 partials that every kernel
writes into one buffer, summed by one reduction at the end (deterministic, no atomics). Saved for
backward, in the compute dtype: a, b and x (three [M, 128] tensors at AlphaFold's sizes) besides z;
the backward recomputes zn, g, LN_out(x) and o rather than keeping four more. Each kernel is a
`torch.library.triton_op`, so `torch.compile` traces the function without graph breaks. Elsewhere
(CPU, float64, more than `MAX_HIDDEN` hidden channels) `triangle_multiplication_reference` runs.
Under `torch.autocast` the fast path computes in the autocast dtype, as the plain module does.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F  # noqa: N812

from hfkit.ops._checks import (
    broadcasts_to,
    check_eps,
    check_float,
    check_no_autograd,
    check_optional,
    check_same_device,
)
from hfkit.ops._linear import column_sums
from hfkit.ops._triton import (
    HAS_TRITON,
    TRITON_DTYPES,
    cdiv,
    dot_mode,
    hfkit_op,
    launch,
    next_power_of_2,
    num_sms,
    rows_view,
    triton_can_run,
)
from hfkit.ops.layer_norm import (
    MAX_FUSED_SIZE,
    _bwd_config,
    _bwd_programs,
    _fwd_config,
    _launch_bwd,
    _launch_fwd,
)

if HAS_TRITON:
    from hfkit.ops._triangle_multiplication_kernels import (
        _gate_ab_bwd_kernel,
        _gate_ab_fwd_kernel,
        _ln_out_t_bwd_kernel,
        _ln_out_t_fwd_kernel,
        _out_gate_bwd_kernel,
        _out_gate_fwd_kernel,
        _out_kernel,
        _proj_gate_bwd_kernel,
        _proj_gate_fwd_kernel,
    )

__all__ = [
    "MAX_HIDDEN",
    "Contraction",
    "PROJ_TILES",
    "triangle_multiplication",
    "triangle_multiplication_reference",
    "uses_triton",
]

# The transposed LayerNorm-out kernels hold all hidden channels of a block of pairs in registers.
MAX_HIDDEN = 1024
# (BLOCK_P, BLOCK_C, BLOCK_K, num_warps, num_stages) of the fused projection kernels: four float32
# accumulators of BLOCK_P x BLOCK_C. Each program re-reads the [4 BLOCK_C, C_z] weight slices from
# L2, so the weight traffic is 4 C_h C_z x (pairs / BLOCK_P). From a sweep of the module's bf16
# forward+backward at N = 256 and 384 on an H200, with `_ln_out_config` and `_elementwise_config`
# below: 0.54 ms at N = 256 and 1.01 ms at 384, against 0.61 and 1.15 ms with (128, 32, 64, 8),
# 8K-element LayerNorm tiles on 8 warps and 4K-element gate tiles on 8 warps.
# num_stages (the K loop's pipelining, 74 KB of shared memory a program at 3) from a later sweep
# (module fwd+bwd, CUDA-graph timed, outgoing and incoming): 1 stage was 4% slower at N = 256 and
# 384, 2 within 1% of 3, 4 stages with BLOCK_K 32 1% slower; 128-pair or 64-channel tiles 3-12%
# slower.
# Two restructurings of the backward measured no faster (module fwd+bwd, bf16, CUDA-graph timed, H200):
# recomputing only the two gate projections, the saved a and b standing in for the other two (d(a_g)
# = da a (1 - sigmoid(a_g))): 0.462 against 0.458 ms at N = 256, 0.956 against 0.951 at 384 (two more
# reads cost what two dots saved; with 64-channel tiles then 1-2% faster); d(o) @ W_z computed inside
# the transposed LayerNorm backward instead of a cuBLAS matmul: 0.5% faster. cuEquivariance at N =
# 256 (torch.profiler, same run): 377 us in 13 kernels against 442 us in ~30 here, and its graph
# replays in 329 us, below its kernels' sum (they overlap), where hfkit's takes 458 us.
PROJ_TILES = (64, 32, 64, 4, 3)
# The forward's tiles from `PROJ_LARGE_MIN_PAIRS` pairs a batch (N = 1024) on: 128 pairs with 32-wide K
# steps over 4 stages. The forward alone on an H200 (bf16, C_z = C_h = 128, `.gpu/proj_sweep.py`): 9.4
# against 11.6 ms at N = 4096, 2.42 against 2.91 at 2048, 0.655 against 0.77 at 1024; 3 stages within
# 3%, 5 stages, 8 warps, 64 channels, 16- or 64-wide K steps and 64 or 256 pairs 10-50% slower.
# Training sizes keep `PROJ_TILES` (swept with the backward there, which shares them).
PROJ_TILES_LARGE = (128, 32, 32, 4, 4)
PROJ_LARGE_MIN_PAIRS = 1 << 20
# The output half (LayerNorm-out, linear_z, linear_g and the gate) runs as one kernel each way where a
# block of pairs with all C_h and all C_z channels fits in registers: C_h and C_z at most this.
FUSED_OUT_MAX = 128
# (BLOCK_P, num_warps, programs per SM) of that kernel, forward and backward: a persistent grid of
# BLOCK_P-pair tiles, all C_z output channels at once. From a sweep on an H200 (bf16, CUDA-graph timed,
# .gpu/out_probe.py): at N = 256 the forward takes 34.4 us and the backward 69.2 us against 39.4 and
# 75.2 us for the previous kernel (one program a tile, 32 output channels at a time), at N = 384 71.0
# and 145.8 us against 85.5 and 164.5; one program per SM or software pipelining was 30-50% slower,
# 8 warps or 128 pairs a tile 20-40% slower.
# The backward spills at these tiles (Nsight Compute at N = 256: 255 registers, 273K local-memory
# requests, 12.5% occupancy), yet every tiling without spills was slower in a later sweep of the
# module's fwd+bwd: 32 pairs 4-9%, 8 warps 4-5%, 16 pairs 15%. A pipelined-GEMM forward, LayerNorm-out
# folded into the weight (o = rstd (x @ (gamma * W_z).T - mean * rowsum(gamma * W_z)) + W_z beta + b_z,
# x read channel-first in K chunks, mean and variance merged chunk by chunk), was slower at all 16
# tilings tried (64/128 pairs, K 32/64, 4/8 warps, 2/3 stages): at best 40.8 against 33.9 us at
# N = 256 and 82.9 against 71.3 at 384 (H200, bf16, CUDA graphs). cuEquivariance 0.13's SM90 kernels
# do this half in 26 us forward at N = 256 (its kernel "F2T").
# The forward adding into z (`add_to_z`, inference) at N = 4096 (H200, .gpu probe): 8.4 ms at these
# tiles against 11.9-16.2 for (32 pairs, 4 warps, 3-4 programs an SM), (32, 2, 6), (16, 4, 6),
# (32, 8, 2), (64, 8, 1) and (128, 8, 1); in the lean block it took 19.0 ms for the two updates
# against 16.0 writing the update, whose two adds (5.8 ms) it saves.
OUT_TILES = {"fwd": (64, 4, 2), "bwd": (64, 4, 2)}


def triangle_multiplication_reference(
    z: torch.Tensor,
    mask: torch.Tensor | None,
    ln_in_weight: torch.Tensor | None,
    ln_in_bias: torch.Tensor | None,
    proj_weight: torch.Tensor,
    proj_bias: torch.Tensor | None,
    ln_out_weight: torch.Tensor | None,
    ln_out_bias: torch.Tensor | None,
    out_weight: torch.Tensor,
    out_bias: torch.Tensor | None,
    outgoing: bool = True,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Plain-torch triangle multiplicative update: the specification the fast path is tested against.

    The math of `hfkit.model.TriangleMultiplicativeUpdate.forward`, op for op (so it also behaves
    like it under `torch.autocast`), with the projections `[a_p, a_g, b_p, b_g, g]` as one linear.
    Shapes as in `triangle_multiplication`.
    """
    c_h = out_weight.shape[1]
    if mask is None:
        mask = z.new_ones(z.shape[:-1])
    mask = mask.to(z.dtype)[..., None]
    # LayerNorm parameters may have any float dtype (as on the fast path).
    ln_in_weight, ln_in_bias = _ln_param(ln_in_weight, z.dtype), _ln_param(ln_in_bias, z.dtype)
    zn = F.layer_norm(z, z.shape[-1:], ln_in_weight, ln_in_bias, eps)
    a_p, a_g, b_p, b_g, g = F.linear(zn, proj_weight, proj_bias).split([c_h] * 4 + [z.shape[-1]], -1)
    a = (mask * torch.sigmoid(a_g) * a_p).movedim(-1, -3)
    b = (mask * torch.sigmoid(b_g) * b_p).movedim(-1, -3)
    x = torch.matmul(a, b.transpose(-1, -2)) if outgoing else torch.matmul(a.transpose(-1, -2), b)
    ln_out_weight, ln_out_bias = _ln_param(ln_out_weight, x.dtype), _ln_param(ln_out_bias, x.dtype)
    x = F.layer_norm(x.movedim(-3, -1), (c_h,), ln_out_weight, ln_out_bias, eps)
    return F.linear(x, out_weight, out_bias) * torch.sigmoid(g)


def _ln_param(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A LayerNorm parameter as `F.layer_norm` takes it beside input of `dtype`: as it is where the
    dtypes match or torch mixes them (float32 parameters of half input), else cast to `dtype`."""
    if (
        t is None
        or t.dtype == dtype
        or (t.dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16))
    ):
        return t
    return t.to(dtype)


def _check_inputs(
    z, mask, ln_in_w, ln_in_b, proj_w, proj_b, ln_out_w, ln_out_b, out_w, out_b, eps, rows=False
):
    """`rows`: z may be a block of rows of the pair grid [*, R, N, C_z] (a sharded contraction's)."""
    check_float("z", z)
    if z.dim() < 3 or (z.shape[-2] != z.shape[-3] and not rows):
        raise ValueError(f"z: expected a pair tensor [*, N, N, C_z], got shape {list(z.shape)}")
    c_z = z.shape[-1]
    for name, w in (("proj_weight", proj_w), ("out_weight", out_w)):
        check_float(name, w, dims=2)
        check_same_device(name, w, "z", z)
    if out_w.shape[0] != c_z:
        raise ValueError(
            f"out_weight: expected shape [{c_z}, C_hidden] (C_z = {c_z}), got {list(out_w.shape)}"
        )
    c_h = out_w.shape[1]
    if tuple(proj_w.shape) != (4 * c_h + c_z, c_z):
        raise ValueError(
            f"proj_weight: expected shape [4 * C_hidden + C_z, C_z] = [{4 * c_h + c_z}, {c_z}] "
            f"(rows a_p, a_g, b_p, b_g, g), got {list(proj_w.shape)}"
        )
    check_optional("ln_in_weight", ln_in_w, (c_z,), "z", z)
    check_optional("ln_in_bias", ln_in_b, (c_z,), "z", z)
    check_optional("proj_bias", proj_b, (4 * c_h + c_z,), "z", z)
    check_optional("ln_out_weight", ln_out_w, (c_h,), "z", z)
    check_optional("ln_out_bias", ln_out_b, (c_h,), "z", z)
    check_optional("out_bias", out_b, (c_z,), "z", z)
    check_optional("mask", mask, None, "z", z, floating=False)
    if mask is not None and not broadcasts_to(mask.shape, z.shape[:-1]):
        raise ValueError(
            f"mask: shape {list(mask.shape)} does not broadcast to z's pair shape {list(z.shape[:-1])}"
        )
    check_eps(eps)


def uses_triton(z: torch.Tensor, c_hidden: int) -> bool:
    """Whether `triangle_multiplication` takes the fused path for z with `c_hidden` hidden channels.

    True on CUDA, and on CPU under `TRITON_INTERPRET=1` outside `torch.compile` tracing, for
    float32/bfloat16/float16 z (computing in an active autocast's dtype), at most `MAX_HIDDEN` hidden
    channels and `layer_norm`'s `MAX_FUSED_SIZE` pair channels.
    """
    return _fused_dtype(z, c_hidden) is not None


def _fused_dtype(z: torch.Tensor, c_hidden: int) -> torch.dtype | None:
    """The compute dtype of the fused path for z, or None where `uses_triton` is False (one look at
    autocast for both questions)."""
    if c_hidden > MAX_HIDDEN or z.shape[-1] > MAX_FUSED_SIZE or not triton_can_run(z):
        return None
    dtype = _compute_dtype(z)
    return dtype if dtype in TRITON_DTYPES else None


def _compute_dtype(z: torch.Tensor) -> torch.dtype:
    """The autocast dtype when autocast is on for z's device and would cast z (the plain module's
    matmul dtype), else z's dtype."""
    kind = z.device.type
    if z.dtype in TRITON_DTYPES and kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return z.dtype


def triangle_multiplication(
    z: torch.Tensor,
    mask: torch.Tensor | None,
    ln_in_weight: torch.Tensor | None,
    ln_in_bias: torch.Tensor | None,
    proj_weight: torch.Tensor,
    proj_bias: torch.Tensor | None,
    ln_out_weight: torch.Tensor | None,
    ln_out_bias: torch.Tensor | None,
    out_weight: torch.Tensor,
    out_bias: torch.Tensor | None,
    outgoing: bool = True,
    eps: float = 1e-5,
    *,
    fuse_projection: bool = True,
    residual: bool = False,
    contraction: Contraction | None = None,
    add_to_z: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused triangle multiplicative update of the pair representation, with autograd.

    z: [*, N, N, C_z] (float32, bfloat16 or float16; float64 runs the reference); mask: [*, N, N] or
    anything broadcastable to it (bool or float, 1 = keep; no gradient) or None; ln_in_weight /
    ln_in_bias: [C_z] (layer_norm_in); proj_weight: [4 * C_h + C_z, C_z] and proj_bias [4 * C_h + C_z],
    the rows of linear_a_p, linear_a_g, linear_b_p, linear_b_g, linear_g stacked in that order;
    ln_out_weight / ln_out_bias: [C_h] (layer_norm_out; LayerNorm parameters may have any float dtype);
    out_weight: [C_z, C_h] and out_bias [C_z] (linear_z); `outgoing` picks Algorithm 11 (x_ij = sum_k a_ik
    b_jk) or 12 (x_ij = sum_k a_ki b_kj); `eps` of both LayerNorms. Returns the update [*, N, N, C_z] in
    z's dtype, or under `torch.autocast` in the autocast dtype (as the plain module). LayerNorm statistics
    and sums of gradients are float32; intermediates are stored in the compute dtype. `fuse_projection`
    computes the a/b projections inside the gating kernel (tl.dot from zn, recomputed in backward) rather
    than as one cuBLAS matmul whose [M, 4 C_h + C_z] output the gate kernels read back: fused saves
    writing and reading 4 C_h channels per pair in forward and reading them again in backward. With
    `residual`, returns (update, r): r holds z's values, z passed through for the residual add around
    the update (`r + dropout(update)`), whose gradient the LayerNorm-in backward kernel adds into dz as
    it writes it (as `hfkit.ops.layer_norm_with_residual`); r is z itself where nothing fuses.
    `contraction` (a `Contraction`; default one process's) runs the triangular contraction: given, z may
    be a block of rows of the pair grid, [*, R, N, C_z], and the fused path must apply (`uses_triton`).
    With `add_to_z` (inference: no autograd, no `residual` or `contraction`), z += update in place and
    z is returned; where the output half is one kernel and z is contiguous in the compute dtype, that
    kernel adds into z as it writes (one pass over z instead of the update's write and an add's three).
    Raises ValueError naming the argument on a bad shape, dtype or device.
    """
    args = (
        ln_in_weight,
        ln_in_bias,
        proj_weight,
        proj_bias,
        ln_out_weight,
        ln_out_bias,
        out_weight,
        out_bias,
    )
    _check_inputs(z, mask, *args, eps, rows=contraction is not None)
    c_h = out_weight.shape[1]
    dtype = _fused_dtype(z, c_h)
    if contraction is not None and dtype is None:
        raise ValueError("contraction: only on the fused path (uses_triton(z, C_hidden) is False here)")
    if add_to_z:
        if residual or contraction is not None:
            raise ValueError("add_to_z: not with residual or contraction")
        check_no_autograd("triangle_multiplication(add_to_z=True)", z, *args)
    if dtype is None or z.numel() == 0:
        out = triangle_multiplication_reference(z, mask, *args, outgoing=outgoing, eps=eps)
        return z.add_(out) if add_to_z else (out, z) if residual else out
    # The matmul operands in the compute dtype (autograd casts their gradients back) and contiguous: the
    # kernels read W_z, W_g and the biases by row and column. LayerNorm weights of any float dtype are
    # read by the kernels as they are, by column: unit stride.
    ln_in_weight, ln_in_bias, ln_out_weight, ln_out_bias = (
        t.contiguous() if t is not None else None
        for t in (ln_in_weight, ln_in_bias, ln_out_weight, ln_out_bias)
    )
    proj_weight, out_weight = proj_weight.to(dtype).contiguous(), out_weight.to(dtype).contiguous()
    proj_bias = proj_bias.to(dtype).contiguous() if proj_bias is not None else None
    out_bias = out_bias.to(dtype).contiguous() if out_bias is not None else None
    if mask is not None:
        mask = mask.detach().to(dtype).expand(z.shape[:-1]).contiguous()
    if add_to_z:  # no autograd: the forward itself, adding into z where it can (`_update_forward`)
        into = z.view(-1, z.shape[-1]) if z.is_contiguous() and z.dtype == dtype else None
        out, *_ = _update_forward(z, mask, ln_in_weight, ln_in_bias, proj_weight, proj_bias, ln_out_weight,
            ln_out_bias, out_weight, out_bias, bool(outgoing), float(eps), bool(fuse_projection), None, into,
        )  # fmt: skip
        return z if out is into else z.add_(out.view(z.shape))
    out, passthrough = _TriangleMultiplication.apply(
        z, mask, ln_in_weight, ln_in_bias, proj_weight, proj_bias,
        ln_out_weight, ln_out_bias, out_weight, out_bias, bool(outgoing), float(eps), bool(fuse_projection),
        contraction,
    )  # fmt: skip
    return (out, passthrough) if residual else out


def _update_forward(
    z, mask, w_in, b_in, w_proj, b_proj, w_out_ln, b_out_ln, w_z, b_z, outgoing, eps, fuse, contract,
    into=None,
):  # fmt: skip
    """The update's forward (`_TriangleMultiplication`'s, and `add_to_z`'s without autograd): (out [M, C_z],
    x, what the contraction saved, the gate's column offset in its source, whether the output half was
    one kernel). With `into` ([M, C_z]), where the output half is one kernel (`fuse` and `_fuses_out`)
    that kernel adds the update into it and out is `into` (z may be `into`: z is read only by the first
    LayerNorm); elsewhere out is a new tensor and `into` is left alone."""
    # Intermediates are dropped as soon as they are used (`del`): the peak is that of the live
    # [M, C] tensors, not of all of them.
    *lead, rows, cols, c_z = z.shape
    pairs, c_h = rows * cols, w_z.shape[1]
    batch = math.prod(lead)
    zn, _, _ = _ln_in_fwd(z, w_in, b_in, eps, w_proj.dtype)
    w_ab, b_ab, w_g, b_g = _split_projection(w_proj, b_proj, c_h)
    fused_out = fuse and _fuses_out(c_h, c_z)
    if fuse:  # a, b straight from zn; the output gate's projection is one matmul or inside `_out_fwd`
        a, b = _proj_gate_fwd(zn, w_ab, b_ab, mask, batch, pairs, c_h)
        g_src, g_off = None if fused_out else F.linear(zn, w_g, b_g), 0  # [M, C_z]
    else:
        g_src, g_off = F.linear(zn, w_proj, b_proj), 4 * c_h  # [M, 4 C_h + C_z]
        a, b = _gate_ab_fwd(g_src, mask, batch, pairs, c_h)
    grid = (batch, c_h, rows, cols)  # a and b channel-first; contract None: one process's (_LOCAL)
    x, saved = (contract or _LOCAL).forward(a.view(grid), b.view(grid), outgoing)
    del a, b
    if fused_out:
        out = torch.empty_like(zn) if into is None else into
        _out_fwd(x, zn, w_out_ln, b_out_ln, w_z, b_z, w_g, b_g, out, batch, c_h, eps, into is not None)
    else:
        del zn
        y, _, _ = _ln_out_t_fwd(x, w_out_ln, b_out_ln, batch, c_h, eps)
        o = F.linear(y, w_z, b_z)  # [M, C_z]
        del y
        out = _out_gate_fwd(o, g_src, g_off)
    return out, x, saved, g_off, fused_out


def _split_projection(w_proj: torch.Tensor, b_proj: torch.Tensor | None, c_h: int) -> tuple:
    """(w_ab, b_ab, w_g, b_g): the a/b rows [4 C_h, C_z] and the output gate's rows of the projection."""
    w_ab, w_g = w_proj[: 4 * c_h], w_proj[4 * c_h :]
    b_ab, b_g = (b_proj[: 4 * c_h], b_proj[4 * c_h :]) if b_proj is not None else (None, None)
    return w_ab, b_ab, w_g, b_g


def _fuses_out(c_h: int, c_z: int) -> bool:
    """Whether the output half runs as `_out_fwd` / `_out_bwd` (one kernel each way) for these widths."""
    return c_h <= FUSED_OUT_MAX and c_z <= FUSED_OUT_MAX


def _part_widths(c_z: int, c_h: int) -> dict[str, int]:
    """The column blocks of the backward's shared buffer of float32 partial sums, in order: LayerNorm-in's
    weight and bias (first: its kernel takes no column offset), d(o) and dg (b_z and linear_g's bias),
    LayerNorm-out's weight and bias, the a/b projection biases."""
    return {"ln_in": 2 * c_z, "out": 2 * c_z, "ln_out": 2 * c_h, "proj": 4 * c_h}


class Contraction:
    """The triangular contraction inside the fused `triangle_multiplication`, between its projections
    and its output half, on channel-first operands: a, b [batch, C_h, R, N] -> x [batch, C_h, R, N]
    (R = N here: one process holds the whole pair grid). `forward(a, b, outgoing)` returns (x, saved),
    saved being the tensors `backward(dx, outgoing, *saved)` needs for (da, db); the op saves them for
    backward. This class is one process's: x = a @ b^T (outgoing) or a^T @ b (incoming), one batched
    cuBLAS matmul each way with the transposes as flags. `hfkit.parallel.dap` passes one whose rows
    are a DAP group's shard and whose collectives run inside (`triangle_multiplication(...,
    contraction=...)`)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor, outgoing: bool) -> tuple[torch.Tensor, tuple]:
        a3, b3 = a.flatten(0, 1), b.flatten(0, 1)
        x = torch.bmm(a3, b3.transpose(1, 2)) if outgoing else torch.bmm(a3.transpose(1, 2), b3)
        return x.view(a.shape), (a, b)

    def backward(
        self, dx: torch.Tensor, outgoing: bool, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dx3, a3, b3 = dx.flatten(0, 1), a.flatten(0, 1), b.flatten(0, 1)
        if outgoing:  # x = a b^T
            da, db = torch.bmm(dx3, b3), torch.bmm(dx3.transpose(1, 2), a3)
        else:  # x = a^T b
            da, db = torch.bmm(b3, dx3.transpose(1, 2)), torch.bmm(a3, dx3)
        return da.view(a.shape), db.view(b.shape)


_LOCAL = Contraction()


class _TriangleMultiplication(torch.autograd.Function):
    """Forward and backward of the fused path. z keeps its dtype; the matmul weights and the mask come
    in the compute dtype, which is also the output's.

    Saved for backward: the inputs, x (the contraction's result) and what the contraction keeps (one
    process: its operands a and b; `Contraction`). zn, the
    gate source, y and o ([M, C] each, the projection, LayerNorm-out and output linear) are recomputed
    by the backward from z and x: two LayerNorm kernels and two matmuls, against ~64 MB per module
    at N = 256, C = 128 in bfloat16 kept alive from the forward to the backward."""

    @staticmethod
    def forward(
        ctx, z, mask, w_in, b_in, w_proj, b_proj, w_out_ln, b_out_ln, w_z, b_z, outgoing, eps, fuse, contract
    ):  # fmt: skip
        out, x, saved, g_off, fused_out = _update_forward(
            z, mask, w_in, b_in, w_proj, b_proj, w_out_ln, b_out_ln, w_z, b_z, outgoing, eps, fuse, contract
        )
        *lead, rows, cols, _ = z.shape
        batch, c_h = math.prod(lead), w_z.shape[1]
        ctx.save_for_backward(z, mask, w_in, b_in, w_proj, b_proj, w_out_ln, b_out_ln, w_z, b_z, x, *saved)
        ctx.meta = (outgoing, fuse, fused_out, g_off, batch, rows * cols, c_h, eps, contract)
        # z passed through as a second output, for the residual add (`residual`); its gradient, where
        # it is used, is added into dz by the LayerNorm-in backward kernel.
        ctx.set_materialize_grads(False)
        return out.view(z.shape), z.view_as(z)

    @staticmethod
    def backward(ctx, dout, dres):
        if dout is None:  # only the pass-through was used
            return (dres, *([None] * 13))
        z, mask, w_in, b_in, w_proj, b_proj, w_out_ln, b_out_ln, w_z, b_z, x, *saved = ctx.saved_tensors
        outgoing, fuse, fused_out, g_off, batch, pairs, c_h, eps, contract = ctx.meta
        c_z = z.shape[-1]
        needs = ctx.needs_input_grad
        # Recompute what the forward did not keep (the same kernels on the same inputs: the same values).
        # Each [M, C] intermediate is dropped (`del`) right after its last use.
        zn, mean_in, rstd_in = _ln_in_fwd(z, w_in, b_in, eps, w_proj.dtype)
        w_ab, b_ab, w_g, b_g = _split_projection(w_proj, b_proj, c_h)
        dout = dout.reshape(-1, c_z)
        g_src = None  # the gate's source, kept for the unfused gate backward
        # The float32 partial sums of every bias and LayerNorm-weight gradient, one row a program of
        # each kernel, in one buffer (`_part_widths`): one reduction at the end sums them all.
        widths = _part_widths(c_z, c_h)
        cols = dict(zip(widths, itertools.accumulate(widths.values(), initial=0), strict=False))
        part = torch.zeros(
            (_partial_rows(z, batch, pairs, c_h, fuse, fused_out), sum(widths.values())),
            dtype=torch.float32,
            device=z.device,
        )
        # d(out) -> d(o) and dg (into columns 4 C_h: of d_proj).
        if fused_out:
            do, d_proj, y, mean_out, rstd_out = _out_bwd(
                dout, x, zn, w_out_ln, b_out_ln, w_z, b_z, w_g, b_g, batch, c_h, eps, 4 * c_h + c_z,
                part, cols["out"],
            )  # fmt: skip
        else:
            g_src = F.linear(zn, w_g, b_g) if fuse else F.linear(zn, w_proj, b_proj)
            y, mean_out, rstd_out = _ln_out_t_fwd(x, w_out_ln, b_out_ln, batch, c_h, eps)
            o = F.linear(y, w_z, b_z)
            do, d_proj = _out_gate_bwd(dout, o, g_src, g_off, 4 * c_h + c_z, part, cols["out"])
            del o
            if fuse:  # the unfused gate backward reads the projections again
                g_src = None
        grad_w_z = do.t().mm(y) if needs[8] else None
        del y
        dy = do.mm(w_z)  # [M, C_h]
        del do
        need_ln_out = (w_out_ln is not None and needs[6]) or (b_out_ln is not None and needs[7])
        dx = _ln_out_t_bwd(dy, x, w_out_ln, mean_out, rstd_out, batch, c_h, need_ln_out, part, cols["ln_out"])
        del dy
        da, db = (contract or _LOCAL).backward(dx.view(x.shape), outgoing, *saved)
        del dx, saved
        if fuse:
            _proj_gate_bwd(da, db, zn, w_ab, b_ab, mask, d_proj, part, cols["proj"], batch, pairs, c_h)
        else:
            _gate_ab_bwd(da, db, g_src, mask, d_proj, part, cols["proj"], batch, pairs, c_h)
            del g_src
        del da, db
        grad_w_proj = d_proj.t().mm(zn) if needs[4] else None
        del zn
        dzn = d_proj.mm(w_proj)  # [M, C_z]
        del d_proj
        need_ln_in = (w_in is not None and needs[2]) or (b_in is not None and needs[3])
        dz = _ln_in_bwd(dzn, z, w_in, mean_in, rstd_in, need_ln_in, part, dres)
        del dzn
        grad = dict(zip(widths, column_sums(part).split(list(widths.values())), strict=True))
        grad_w_in = grad["ln_in"][:c_z].to(w_in.dtype) if w_in is not None and needs[2] else None
        grad_b_in = grad["ln_in"][c_z:].to(b_in.dtype) if b_in is not None and needs[3] else None
        grad_b_z = grad["out"][:c_z].to(b_z.dtype) if b_z is not None and needs[9] else None
        grad_w_out_ln = grad["ln_out"][:c_h].to(w_out_ln.dtype) if w_out_ln is not None and needs[6] else None
        grad_b_out_ln = grad["ln_out"][c_h:].to(b_out_ln.dtype) if b_out_ln is not None and needs[7] else None
        grad_b_proj = None
        if b_proj is not None and needs[5]:  # the a/b rows, then the output gate's
            grad_b_proj = torch.cat([grad["proj"], grad["out"][c_z:]]).to(b_proj.dtype)
        return (
            dz if needs[0] else None, None, grad_w_in, grad_b_in, grad_w_proj, grad_b_proj,
            grad_w_out_ln, grad_b_out_ln, grad_w_z, grad_b_z, None, None, None, None,
        )  # fmt: skip


if HAS_TRITON:

    def _gate_config(c_h: int) -> tuple[int, int, int]:
        """(BLOCK_P, BLOCK_C, num_warps) of the gate kernels: 64 pairs x up to 64 channels (untuned)."""
        block_c = min(64, max(16, next_power_of_2(c_h)))
        return 64, block_c, 8 if block_c >= 64 else 4

    def _ln_out_config(c_h: int) -> tuple[int, int, int]:
        """(BLOCK_P, BLOCK_C, num_warps) of the transposed LayerNorm: all channels, ~4K elements, 2 warps
        (the sweep of `PROJ_TILES`: 32 pairs x 128 channels)."""
        block_c = max(16, next_power_of_2(c_h))
        block_p = max(16, min(128, 4096 // block_c))
        return block_p, block_c, 2

    def _elementwise_config(c_z: int) -> tuple[int, int, int]:
        """(BLOCK_M, BLOCK_C, num_warps) of the output-gate kernels: ~2K elements a program, 2 warps (the
        sweep of `PROJ_TILES`: 16 rows x 128 channels)."""
        block_c = min(128, max(16, next_power_of_2(c_z)))
        return max(1, 2048 // block_c), block_c, 2

    @hfkit_op("tri_mul_ln_in_fwd")
    def _ln_in_fwd(
        z: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """LayerNorm-in with `layer_norm`'s kernel, reading z in its dtype (float32 under autocast) and
        writing zn [M, C_z] in the compute dtype: no separate cast pass over z."""
        c_z = z.shape[-1]
        z2 = rows_view(z, c_z)
        m = z2.shape[0]
        zn = torch.empty((m, c_z), dtype=dtype, device=z.device)
        mean = torch.empty(m, dtype=torch.float32, device=z.device)
        rstd = torch.empty(m, dtype=torch.float32, device=z.device)
        _launch_fwd(z2, zn, weight, bias, mean, rstd, eps, _fwd_config(c_z, z.element_size()))
        return zn, mean, rstd

    def _partial_rows(z: torch.Tensor, batch: int, pairs: int, c_h: int, fuse: bool, fused_out: bool) -> int:
        """Rows of the backward's shared buffer of partial sums: the most rows any kernel writes (a row
        for each of its programs, or for each tile of the persistent `_out_kernel`; `_part_widths`)."""
        c_z, nn_ = z.shape[-1], pairs
        m = batch * nn_
        out = cdiv(nn_, OUT_TILES["bwd"][0]) * batch if fused_out else cdiv(m, _elementwise_config(c_z)[0])
        gate = (PROJ_TILES if fuse else _gate_config(c_h))[0]
        ln_in = _bwd_programs(m, _bwd_config(c_z, z.element_size()), z.device)
        return max(out, cdiv(nn_, _ln_out_config(c_h)[0]) * batch, cdiv(nn_, gate) * batch, ln_in)

    @hfkit_op("tri_mul_ln_in_bwd", mutates_args={"part"})
    def _ln_in_bwd(
        dzn: torch.Tensor,
        z: torch.Tensor,
        weight: torch.Tensor | None,
        mean: torch.Tensor,
        rstd: torch.Tensor,
        need_dwb: bool,
        part: torch.Tensor,
        dres: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """dz in z's dtype from dzn [M, C_z] in the compute dtype, plus dres (the gradient of z's residual
        pass-through) where given; with `need_dwb` the float32 partial sums of the weight and bias
        gradients go to columns [0, 2 C_z) of part's first rows (a row for each program of LayerNorm's
        persistent backward, `_bwd_programs`)."""
        c_z = z.shape[-1]
        z2 = rows_view(z, c_z)
        m = z2.shape[0]
        dz = torch.empty(z.shape, dtype=z.dtype, device=z.device)
        cfg = _bwd_config(c_z, z.element_size())
        dres2 = rows_view(dres, c_z) if dres is not None else None
        programs = _bwd_programs(m, cfg, z.device)
        _launch_bwd(z2, dzn, dz.view(m, c_z), weight, mean, rstd, part, need_dwb, programs, cfg, dres2=dres2)
        return dz

    @hfkit_op("tri_mul_gate_ab_fwd")
    def _gate_ab_fwd(
        proj: torch.Tensor, mask: torch.Tensor | None, batch: int, pairs: int, c_h: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        a = proj.new_empty((batch, c_h, pairs))
        b = proj.new_empty((batch, c_h, pairs))
        block_p, block_c, warps = _gate_config(c_h)
        grid = (cdiv(pairs, block_p), cdiv(c_h, block_c), batch)
        launch(_gate_ab_fwd_kernel, grid,
            proj, mask, a, b, pairs, c_h, proj.stride(0),
            HAS_MASK=mask is not None, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=warps,
        )  # fmt: skip
        return a, b

    @hfkit_op("tri_mul_gate_ab_bwd", mutates_args={"d_proj", "part"})
    def _gate_ab_bwd(
        da: torch.Tensor,
        db: torch.Tensor,
        proj: torch.Tensor,
        mask: torch.Tensor | None,
        d_proj: torch.Tensor,
        part: torch.Tensor,
        part_off: int,
        batch: int,
        pairs: int,
        c_h: int,
    ) -> None:
        """Writes columns [0, 4 C_h) of d_proj, and their float32 partial sums over each program's pairs
        to columns [part_off, part_off + 4 C_h) of its row of part."""
        block_p, block_c, warps = _gate_config(c_h)
        num_p_blocks = cdiv(pairs, block_p)
        launch(_gate_ab_bwd_kernel, (num_p_blocks, cdiv(c_h, block_c), batch),
            da.contiguous(), db.contiguous(), proj, mask, d_proj, part,
            pairs, c_h, proj.stride(0), d_proj.stride(0), num_p_blocks, part_off, part.stride(0),
            HAS_MASK=mask is not None, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=warps,
        )  # fmt: skip

    def _proj_config(
        c_h: int, c_z: int, zn: torch.Tensor, tiles: tuple = PROJ_TILES
    ) -> tuple[int, int, int, tuple[int, int], int]:
        """(BLOCK_P, BLOCK_C, BLOCK_K, (num_warps, num_stages), DOT) of the fused projection kernels, from
        `tiles` (channel and K blocks shrunk to the problem, at least 16 for tl.dot); DOT as `_dot`
        takes it."""
        block_p, block_c, block_k, warps, stages = tiles
        block_c = min(block_c, max(16, next_power_of_2(c_h)))
        block_k = min(block_k, max(16, next_power_of_2(c_z)))
        return block_p, block_c, block_k, (warps, stages), dot_mode(zn)

    @hfkit_op("tri_mul_proj_gate_fwd")
    def _proj_gate_fwd(
        zn: torch.Tensor,
        w_ab: torch.Tensor,
        b_ab: torch.Tensor | None,
        mask: torch.Tensor | None,
        batch: int,
        pairs: int,
        c_h: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """a, b [batch, C_h, pairs] from zn [M, C_z] and the a/b rows w_ab [4 C_h, C_z] (bias b_ab)."""
        c_z = zn.shape[1]
        a = zn.new_empty((batch, c_h, pairs))
        b = zn.new_empty((batch, c_h, pairs))
        tiles = PROJ_TILES_LARGE if pairs >= PROJ_LARGE_MIN_PAIRS else PROJ_TILES
        block_p, block_c, block_k, (warps, stages), dot = _proj_config(c_h, c_z, zn, tiles)
        grid = (cdiv(pairs, block_p) * cdiv(c_h, block_c), batch)
        launch(_proj_gate_fwd_kernel, grid,
            zn, w_ab, b_ab, mask, a, b, pairs, c_h, c_z,
            HAS_BIAS=b_ab is not None, HAS_MASK=mask is not None, DOT=dot,
            BLOCK_P=block_p, BLOCK_C=block_c, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return a, b

    @hfkit_op("tri_mul_proj_gate_bwd", mutates_args={"d_proj", "part"})
    def _proj_gate_bwd(
        da: torch.Tensor,
        db: torch.Tensor,
        zn: torch.Tensor,
        w_ab: torch.Tensor,
        b_ab: torch.Tensor | None,
        mask: torch.Tensor | None,
        d_proj: torch.Tensor,
        part: torch.Tensor,
        part_off: int,
        batch: int,
        pairs: int,
        c_h: int,
    ) -> None:
        """Writes columns [0, 4 C_h) of d_proj, and their float32 partial sums over each program's pairs
        to columns [part_off, part_off + 4 C_h) of its row of part."""
        c_z = zn.shape[1]
        block_p, block_c, block_k, (warps, stages), dot = _proj_config(c_h, c_z, zn)
        num_p_blocks = cdiv(pairs, block_p)
        launch(_proj_gate_bwd_kernel, (num_p_blocks * cdiv(c_h, block_c), batch),
            da.contiguous(), db.contiguous(), zn, w_ab, b_ab, mask, d_proj, part,
            pairs, c_h, c_z, d_proj.stride(0), num_p_blocks, part_off, part.stride(0),
            HAS_BIAS=b_ab is not None, HAS_MASK=mask is not None, DOT=dot,
            BLOCK_P=block_p, BLOCK_C=block_c, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )  # fmt: skip

    @hfkit_op("tri_mul_ln_out_t_fwd")
    def _ln_out_t_fwd(
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        batch: int,
        c_h: int,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        nn_ = x.numel() // (batch * c_h)
        y = x.new_empty((batch * nn_, c_h))
        mean = torch.empty(batch * nn_, dtype=torch.float32, device=x.device)
        rstd = torch.empty(batch * nn_, dtype=torch.float32, device=x.device)
        block_p, block_c, warps = _ln_out_config(c_h)
        launch(_ln_out_t_fwd_kernel, (cdiv(nn_, block_p), batch),
            x, y, weight, bias, mean, rstd, nn_, c_h, eps,
            HAS_W=weight is not None, HAS_B=bias is not None,
            BLOCK_P=block_p, BLOCK_C=block_c, num_warps=warps,
        )  # fmt: skip
        return y, mean, rstd

    @hfkit_op("tri_mul_ln_out_t_bwd", mutates_args={"part"})
    def _ln_out_t_bwd(
        dy: torch.Tensor,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        mean: torch.Tensor,
        rstd: torch.Tensor,
        batch: int,
        c_h: int,
        need_dwb: bool,
        part: torch.Tensor,
        part_off: int,
    ) -> torch.Tensor:
        """Returns dx channel-first (x's shape); with `need_dwb` the float32 partial sums of the weight
        and bias gradients go to columns [part_off, part_off + 2 C_h) of part, a row a program."""
        nn_ = x.numel() // (batch * c_h)
        dx = torch.empty_like(x)
        block_p, block_c, warps = _ln_out_config(c_h)
        num_p_blocks = cdiv(nn_, block_p)
        launch(_ln_out_t_bwd_kernel, (num_p_blocks, batch),
            dy.contiguous(), x, weight, mean, rstd, dx, part,
            nn_, c_h, num_p_blocks, part_off, part.stride(0),
            HAS_W=weight is not None, HAS_DW=need_dwb, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=warps,
        )  # fmt: skip
        return dx

    @hfkit_op("tri_mul_out_gate_fwd")
    def _out_gate_fwd(o: torch.Tensor, proj: torch.Tensor, g_off: int) -> torch.Tensor:
        m, c_z = o.shape
        out = torch.empty_like(o)
        block_m, block_c, warps = _elementwise_config(c_z)
        launch(
            _out_gate_fwd_kernel,
            (cdiv(m, block_m), cdiv(c_z, block_c)),
            o,
            proj,
            out,
            m,
            c_z,
            proj.stride(0),
            g_off,
            BLOCK_M=block_m,
            BLOCK_C=block_c,
            num_warps=warps,
        )
        return out

    @hfkit_op("tri_mul_out_gate_bwd", mutates_args={"part"})
    def _out_gate_bwd(
        dout: torch.Tensor,
        o: torch.Tensor,
        g_src: torch.Tensor,
        g_off: int,
        d_proj_width: int,
        part: torch.Tensor,
        part_off: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns d(o) and d_proj [M, d_proj_width] with dg written to its last C_z columns (the rest is
        left for the gate kernel); the float32 partial sums of d(o) and dg go to columns [part_off,
        part_off + 2 C_z) of part, a row a program. g is read from columns [g_off, g_off + C_z) of
        g_src."""
        m, c_z = o.shape
        if dout.stride(1) != 1:
            dout = dout.contiguous()
        do = torch.empty_like(o)
        d_proj = o.new_empty((m, d_proj_width))
        block_m, block_c, warps = _elementwise_config(c_z)
        launch(_out_gate_bwd_kernel, (cdiv(m, block_m), cdiv(c_z, block_c)),
            dout, o, g_src, do, d_proj, part, m, c_z, dout.stride(0), g_src.stride(0), d_proj.stride(0),
            g_off, d_proj_width - c_z, part_off, part.stride(0),
            BLOCK_M=block_m, BLOCK_C=block_c, num_warps=warps,
        )  # fmt: skip
        return do, d_proj

    def _out_config(c_h: int, c_z: int, way: str) -> dict:
        """The tiles of `_out_kernel` (`way` "fwd" or "bwd") from `OUT_TILES[way]`: BLOCK_P pairs with all
        C_h and C_z channels (at least 16 for tl.dot); the programs per SM are the launcher's."""
        block_p, warps, _ = OUT_TILES[way]
        return {
            "BLOCK_P": block_p, "BLOCK_H": max(16, next_power_of_2(c_h)),
            "BLOCK_Z": max(16, next_power_of_2(c_z)), "num_warps": warps,
        }  # fmt: skip

    def _launch_out(
        x, zn, w_ln, b_ln, w_z, b_z, w_g, b_g, out, batch, c_h, eps, grads=None, accumulate=False
    ) -> None:
        """`_out_kernel` over zn's [M, C_z] pairs into `out`: the forward (with `accumulate`, added to
        out), or with `grads` = (d(out), d_proj, y, mean, rstd, part, part_off) the backward (a row of
        part for each tile)."""
        m, c_z = zn.shape
        nn_ = m // batch
        dout, d_proj, y, mean, rstd, part, part_off = grads or (None,) * 7
        bwd = grads is not None
        way = "bwd" if bwd else "fwd"
        tiles = _out_config(c_h, c_z, way)
        tiles_per_batch = cdiv(nn_, tiles["BLOCK_P"])
        num_tiles = tiles_per_batch * batch
        programs = min(num_tiles, OUT_TILES[way][2] * num_sms(zn.device))
        launch(_out_kernel, (programs,),
            x, zn, w_ln, b_ln, w_z, b_z, w_g, b_g, out, dout, d_proj, y, mean, rstd, part,
            nn_, c_h, c_z, eps, dout.stride(0) if bwd else 0, d_proj.stride(0) if bwd else 0,
            d_proj.shape[1] - c_z if bwd else 0, part_off if bwd else 0, part.stride(0) if bwd else 0,
            num_tiles, tiles_per_batch,
            HAS_W=w_ln is not None, HAS_B=b_ln is not None, HAS_BZ=b_z is not None, HAS_BG=b_g is not None,
            BWD=bwd, DOT=dot_mode(zn), ACCUMULATE=accumulate, **tiles,
        )  # fmt: skip

    @hfkit_op("tri_mul_out_fwd", mutates_args={"out"})
    def _out_fwd(
        x: torch.Tensor,
        zn: torch.Tensor,
        w_ln: torch.Tensor | None,
        b_ln: torch.Tensor | None,
        w_z: torch.Tensor,
        b_z: torch.Tensor | None,
        w_g: torch.Tensor,
        b_g: torch.Tensor | None,
        out: torch.Tensor,
        batch: int,
        c_h: int,
        eps: float,
        accumulate: bool,
    ) -> None:
        """out [M, C_z] = (LN_out(x) @ w_z.T + b_z) * sigmoid(zn @ w_g.T + b_g), x channel-first; with
        `accumulate`, out += that in the same pass (out is not zn)."""
        _launch_out(x, zn, w_ln, b_ln, w_z, b_z, w_g, b_g, out, batch, c_h, eps, accumulate=accumulate)

    @hfkit_op("tri_mul_out_bwd", mutates_args={"part"})
    def _out_bwd(
        dout: torch.Tensor,
        x: torch.Tensor,
        zn: torch.Tensor,
        w_ln: torch.Tensor | None,
        b_ln: torch.Tensor | None,
        w_z: torch.Tensor,
        b_z: torch.Tensor | None,
        w_g: torch.Tensor,
        b_g: torch.Tensor | None,
        batch: int,
        c_h: int,
        eps: float,
        d_proj_width: int,
        part: torch.Tensor,
        part_off: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """For d(out) [M, C_z], recomputing `_out_fwd`'s intermediates: d(o) [M, C_z], d_proj [M,
        d_proj_width] with dg in its last C_z columns (the rest is left for the gate kernel), y [M, C_h]
        and LN_out's float32 mean and rstd [M]; the float32 partial sums of d(o) and dg go to columns
        [part_off, part_off + 2 C_z) of part, a row a program."""
        m, c_z = zn.shape
        if dout.stride(1) != 1:
            dout = dout.contiguous()
        do = torch.empty_like(zn)
        d_proj = zn.new_empty((m, d_proj_width))
        y = zn.new_empty((m, c_h))
        mean = torch.empty(m, dtype=torch.float32, device=zn.device)
        rstd = torch.empty(m, dtype=torch.float32, device=zn.device)
        grads = (dout, d_proj, y, mean, rstd, part, part_off)
        _launch_out(x, zn, w_ln, b_ln, w_z, b_z, w_g, b_g, do, batch, c_h, eps, grads)
        return do, d_proj, y, mean, rstd
