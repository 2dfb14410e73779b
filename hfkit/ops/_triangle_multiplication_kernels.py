"""Triton kernels of `hfkit.ops.triangle_multiplication`: everything between its cuBLAS matmuls.

The pair tensor is [batch, N*N pairs, C] row-major ("M = pairs" rows of C channels) or, for the
contraction's operands and result, channel-first [batch, C_h, N*N]. A program owns a block of pairs
(BLOCK_P) by a block of channels (BLOCK_C), or all channels of a block of pairs where it reduces over
channels (the transposed LayerNorm); the grid's last axis is the batch. Gradients of biases and
LayerNorm weights leave each program as float32 partial sums in its row of `Part`, at column `part_off`
(the backward's kernels share one buffer, so that one reduction sums them all); the host adds the rows
in a fixed order: deterministic, no atomics. 1-D parameters (biases, LayerNorm weights) are read
with unit stride. The launchers, tile choices and autograd are in `hfkit.ops.triangle_multiplication`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hfkit.ops._triton import dot


@triton.jit
def _store_gated(
    A, B, Mask, a_p, a_g, b_p, b_g, rows, p, c, ok, bat, NN, CH, HAS_MASK: tl.constexpr
):  # fmt: skip
    # a, b = mask * sigmoid(gate) * proj of a [BLOCK_P, BLOCK_C] tile, stored channel-first
    # [batch, C_h, N*N]: the tile is computed along channels and stored along pairs (Triton
    # transposes it through shared memory).
    a = tl.sigmoid(a_g) * a_p
    b = tl.sigmoid(b_g) * b_p
    if HAS_MASK:
        m = tl.load(Mask + rows, mask=p < NN, other=0.0).to(tl.float32)[:, None]
        a = a * m
        b = b * m
    dst = (tl.cast(bat, tl.int64) * CH + c)[None, :] * NN + p[:, None]
    tl.store(A + dst, a.to(A.dtype.element_ty), mask=ok)
    tl.store(B + dst, b.to(B.dtype.element_ty), mask=ok)


@triton.jit
def _store_gate_grads(
    DA, DB, Mask, DP, Part, a_p, a_g, b_p, b_g, rows, p, c, ok, c_ok, bat, pid_p,
    NN, CH, stride_dp, num_p_blocks, part_off, stride_part, HAS_MASK: tl.constexpr,
):  # fmt: skip
    # Gradients of the four a/b projections from da, db (channel-first), written into columns
    # [0, 4 C_h) of d_proj (row-major); their float32 column sums over this program's pairs go to
    # its own row of Part (the projection-bias gradient; the host sums the rows).
    cf = (tl.cast(bat, tl.int64) * CH + c)[None, :] * NN + p[:, None]
    da = tl.load(DA + cf, mask=ok, other=0.0).to(tl.float32)
    db = tl.load(DB + cf, mask=ok, other=0.0).to(tl.float32)
    if HAS_MASK:
        m = tl.load(Mask + rows, mask=p < NN, other=0.0).to(tl.float32)[:, None]
        da = da * m
        db = db * m
    s_a = tl.sigmoid(a_g)
    s_b = tl.sigmoid(b_g)
    d_ap = da * s_a
    d_ag = da * a_p * s_a * (1.0 - s_a)
    d_bp = db * s_b
    d_bg = db * b_p * s_b * (1.0 - s_b)
    dst = DP + rows[:, None] * stride_dp + c[None, :]
    ty = DP.dtype.element_ty
    tl.store(dst, d_ap.to(ty), mask=ok)
    tl.store(dst + CH, d_ag.to(ty), mask=ok)
    tl.store(dst + 2 * CH, d_bp.to(ty), mask=ok)
    tl.store(dst + 3 * CH, d_bg.to(ty), mask=ok)
    part = Part + part_off + tl.cast(bat * num_p_blocks + pid_p, tl.int64) * stride_part + c
    tl.store(part, tl.sum(d_ap, axis=0), mask=c_ok)
    tl.store(part + CH, tl.sum(d_ag, axis=0), mask=c_ok)
    tl.store(part + 2 * CH, tl.sum(d_bp, axis=0), mask=c_ok)
    tl.store(part + 3 * CH, tl.sum(d_bg, axis=0), mask=c_ok)


@triton.jit
def _load_projections(P, rows, c, ok, stride_p, CH):
    # The four a/b projection tiles [BLOCK_P, BLOCK_C] of a materialized projection [M, stride_p].
    src = P + rows[:, None] * stride_p + c[None, :]
    a_p = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    a_g = tl.load(src + CH, mask=ok, other=0.0).to(tl.float32)
    b_p = tl.load(src + 2 * CH, mask=ok, other=0.0).to(tl.float32)
    b_g = tl.load(src + 3 * CH, mask=ok, other=0.0).to(tl.float32)
    return a_p, a_g, b_p, b_g


@triton.jit
def _project(
    ZN, W, Bias, rows, p_ok, c, c_ok, CZ, CH,
    HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # The four a/b projection tiles zn @ W[s * C_h + c].T (+ bias), s = a_p, a_g, b_p, b_g, in
    # float32 accumulators: the zn rows are loaded once per K step for all four weight slices.
    acc_ap = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    acc_ag = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    acc_bp = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    acc_bg = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    w_rows = c.to(tl.int64)[None, :] * CZ
    for k0 in range(0, CZ, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < CZ
        zn = tl.load(ZN + rows[:, None] * CZ + k[None, :], mask=p_ok[:, None] & k_ok[None, :], other=0.0)
        w_ptr = W + w_rows + k[:, None]  # [BLOCK_K, BLOCK_C]: W.T of the channel block
        w_ok = k_ok[:, None] & c_ok[None, :]
        acc_ap += dot(zn, tl.load(w_ptr, mask=w_ok, other=0.0), DOT)
        w_ag = tl.load(w_ptr + CH * CZ, mask=w_ok, other=0.0)
        acc_ag += dot(zn, w_ag, DOT)
        w_bp = tl.load(w_ptr + 2 * CH * CZ, mask=w_ok, other=0.0)
        acc_bp += dot(zn, w_bp, DOT)
        w_bg = tl.load(w_ptr + 3 * CH * CZ, mask=w_ok, other=0.0)
        acc_bg += dot(zn, w_bg, DOT)
    if HAS_BIAS:
        acc_ap += tl.load(Bias + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        acc_ag += tl.load(Bias + CH + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        acc_bp += tl.load(Bias + 2 * CH + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        acc_bg += tl.load(Bias + 3 * CH + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    return acc_ap, acc_ag, acc_bp, acc_bg


@triton.jit
def _gate_ab_fwd_kernel(
    P, Mask, A, B, NN, CH, stride_p,
    HAS_MASK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # Unfused projection: read the four a/b projections once (row-major [M, stride_p]), write a
    # and b once, channel-first. A program owns BLOCK_P pairs x BLOCK_C channels.
    pid_p, pid_c, bat = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (p < NN)[:, None] & (c < CH)[None, :]
    rows = tl.cast(bat, tl.int64) * NN + p
    a_p, a_g, b_p, b_g = _load_projections(P, rows, c, ok, stride_p, CH)
    _store_gated(A, B, Mask, a_p, a_g, b_p, b_g, rows, p, c, ok, bat, NN, CH, HAS_MASK)


@triton.jit
def _gate_ab_bwd_kernel(
    DA, DB, P, Mask, DP, Part, NN, CH, stride_p, stride_dp, num_p_blocks, part_off, stride_part,
    HAS_MASK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # Unfused projection: read da, db and the four projections, write their gradients (into d_proj)
    # and one row of float32 partial sums. Grid (pair blocks, channel blocks, batch), as the forward.
    pid_p, pid_c, bat = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < CH
    ok = (p < NN)[:, None] & c_ok[None, :]
    rows = tl.cast(bat, tl.int64) * NN + p
    a_p, a_g, b_p, b_g = _load_projections(P, rows, c, ok, stride_p, CH)
    _store_gate_grads(
        DA, DB, Mask, DP, Part, a_p, a_g, b_p, b_g, rows, p, c, ok, c_ok, bat, pid_p,
        NN, CH, stride_dp, num_p_blocks, part_off, stride_part, HAS_MASK,
    )  # fmt: skip


@triton.jit
def _tile_indices(NN, CH, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    # This program's BLOCK_P pairs x BLOCK_C channels (pair blocks major: the channel blocks of one
    # pair block are launch neighbours, so zn is read from HBM once and re-read from L2). It takes
    # no pointers on purpose: Inductor's mutation analysis counts every argument of a call whose
    # results feed a store address as written, so indices must not come from a call that also
    # takes zn or the weights (that made torch.compile copy stale values back into them).
    num_c_blocks = tl.cdiv(CH, BLOCK_C)
    pid_p, pid_c = tl.program_id(0) // num_c_blocks, tl.program_id(0) % num_c_blocks
    bat = tl.program_id(1)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    p_ok = p < NN
    c_ok = c < CH
    ok = p_ok[:, None] & c_ok[None, :]
    rows = tl.cast(bat, tl.int64) * NN + p
    return rows, p, c, p_ok, c_ok, ok, bat, pid_p


@triton.jit
def _proj_gate_fwd_kernel(
    ZN, W, Bias, Mask, A, B, NN, CH, CZ,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, DOT: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Fused projection: the a/b projections of BLOCK_P pairs x BLOCK_C channels are computed from
    # zn [M, C_z] (tl.dot, float32 accumulators) and gated in registers; only a and b (channel-
    # first) are written. Traffic: read zn once per channel block, write a and b once; the
    # [M, 4 C_h] projection never exists in memory. Grid (pair blocks x channel blocks, batch).
    rows, p, c, p_ok, c_ok, ok, bat, pid_p = _tile_indices(NN, CH, BLOCK_P, BLOCK_C)
    a_p, a_g, b_p, b_g = _project(
        ZN, W, Bias, rows, p_ok, c, c_ok, CZ, CH, HAS_BIAS, DOT, BLOCK_P, BLOCK_C, BLOCK_K
    )
    _store_gated(A, B, Mask, a_p, a_g, b_p, b_g, rows, p, c, ok, bat, NN, CH, HAS_MASK)


@triton.jit
def _proj_gate_bwd_kernel(
    DA, DB, ZN, W, Bias, Mask, DP, Part, NN, CH, CZ, stride_dp, num_p_blocks, part_off, stride_part,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, DOT: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Fused projection, backward: recompute the four projection tiles from zn (cheaper than
    # saving and re-reading [M, 4 C_h]), then write their gradients from da and db. Traffic: read zn
    # (once per channel block), da and db; write 4 C_h columns of d_proj. Grid as the forward.
    rows, p, c, p_ok, c_ok, ok, bat, pid_p = _tile_indices(NN, CH, BLOCK_P, BLOCK_C)
    a_p, a_g, b_p, b_g = _project(
        ZN, W, Bias, rows, p_ok, c, c_ok, CZ, CH, HAS_BIAS, DOT, BLOCK_P, BLOCK_C, BLOCK_K
    )
    _store_gate_grads(
        DA, DB, Mask, DP, Part, a_p, a_g, b_p, b_g, rows, p, c, ok, c_ok, bat, pid_p,
        NN, CH, stride_dp, num_p_blocks, part_off, stride_part, HAS_MASK,
    )  # fmt: skip


@triton.jit
def _ln_out_t_fwd_kernel(
    X, Y, W, Bias, Mean, Rstd, NN, CH, eps,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # Float arguments in float32 (torch.compile passes Python floats as float64 scalars).
    eps = tl.cast(eps, tl.float32)
    # Traffic: read x channel-first [batch, C_h, N*N] once, write y row-major [batch * N*N, C_h]
    # once, plus 8 bytes of statistics per pair. A program owns BLOCK_P pairs with all channels,
    # so the reductions over channels stay in registers; the tile is transposed on the way out.
    pid_p, bat = tl.program_id(0), tl.program_id(1)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < CH
    ok = c_ok[:, None] & (p < NN)[None, :]
    x = tl.load(X + (tl.cast(bat, tl.int64) * CH + c)[:, None] * NN + p[None, :], mask=ok, other=0.0)
    x = x.to(tl.float32)
    mean = tl.sum(x, axis=0) / CH
    xc = tl.where(ok, x - mean[None, :], 0.0)
    var = tl.sum(xc * xc, axis=0) / CH
    rstd = 1.0 / tl.sqrt(var + eps)
    y = xc * rstd[None, :]
    if HAS_W:
        y = y * tl.load(W + c, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_B:
        y = y + tl.load(Bias + c, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    rows = tl.cast(bat, tl.int64) * NN + p
    tl.store(Y + rows[None, :] * CH + c[:, None], y.to(Y.dtype.element_ty), mask=ok)
    tl.store(Mean + rows, mean, mask=p < NN)
    tl.store(Rstd + rows, rstd, mask=p < NN)


@triton.jit
def _ln_out_t_bwd_kernel(
    DY, X, W, Mean, Rstd, DX, Part, NN, CH, num_p_blocks, part_off, stride_part,
    HAS_W: tl.constexpr, HAS_DW: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # Traffic: read dy row-major and x channel-first, write dx channel-first: the transpose of the
    # forward. The float32 sums of dy * xhat and dy over this program's pairs go to its own row of
    # Part (the LayerNorm weight and bias gradients; host sums rows). Grid (pair blocks, batch): a
    # program owns BLOCK_P pairs with all channels, as the forward.
    pid_p, bat = tl.program_id(0), tl.program_id(1)
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < CH
    p_ok = p < NN
    ok = c_ok[:, None] & p_ok[None, :]
    rows = tl.cast(bat, tl.int64) * NN + p
    cf = (tl.cast(bat, tl.int64) * CH + c)[:, None] * NN + p[None, :]
    x = tl.load(X + cf, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[None, :] * CH + c[:, None], mask=ok, other=0.0).to(tl.float32)
    mean = tl.load(Mean + rows, mask=p_ok, other=0.0)
    rstd = tl.load(Rstd + rows, mask=p_ok, other=0.0)
    xhat = tl.where(ok, (x - mean[None, :]) * rstd[None, :], 0.0)
    if HAS_W:  # noqa: SIM108  (a constexpr branch, resolved at compile time)
        wdy = dy * tl.load(W + c, mask=c_ok, other=0.0).to(tl.float32)[:, None]
    else:
        wdy = dy
    c1 = tl.sum(xhat * wdy, axis=0) / CH
    c2 = tl.sum(wdy, axis=0) / CH
    dx = (wdy - (xhat * c1[None, :] + c2[None, :])) * rstd[None, :]
    tl.store(DX + cf, dx.to(DX.dtype.element_ty), mask=ok)
    if HAS_DW:
        part = Part + part_off + tl.cast(bat * num_p_blocks + pid_p, tl.int64) * stride_part + c
        tl.store(part, tl.sum(dy * xhat, axis=1), mask=c_ok)
        tl.store(part + CH, tl.sum(dy, axis=1), mask=c_ok)


@triton.jit
def _out_gate_fwd_kernel(O, P, OUT, M, CZ, stride_p, g_off, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    # Traffic: read o [M, C_z] and the gate columns of the projection, write out once. Grid (row
    # blocks, channel blocks).
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (rows < M)[:, None] & (c < CZ)[None, :]
    o = tl.load(O + rows[:, None] * CZ + c[None, :], mask=ok, other=0.0).to(tl.float32)
    g = tl.load(P + rows[:, None] * stride_p + g_off + c[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + rows[:, None] * CZ + c[None, :], (o * tl.sigmoid(g)).to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _out_gate_bwd_kernel(
    DOUT, O, P, DO, DP, Part, M, CZ, stride_dout, stride_p, stride_dp, g_off, dg_off, part_off, stride_part,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # Traffic: read d(out), o and g, write d(o) and dg (into the gate columns of d_proj); the
    # float32 column sums of both (the linear_z and linear_g bias gradients) go to Part's row.
    # Grid (row blocks, channel blocks).
    pid_m = tl.program_id(0)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < CZ
    ok = (rows < M)[:, None] & c_ok[None, :]
    dout = tl.load(DOUT + rows[:, None] * stride_dout + c[None, :], mask=ok, other=0.0).to(tl.float32)
    o = tl.load(O + rows[:, None] * CZ + c[None, :], mask=ok, other=0.0).to(tl.float32)
    g = tl.load(P + rows[:, None] * stride_p + g_off + c[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    do = dout * s
    dg = dout * o * s * (1.0 - s)
    tl.store(DO + rows[:, None] * CZ + c[None, :], do.to(DO.dtype.element_ty), mask=ok)
    tl.store(DP + rows[:, None] * stride_dp + dg_off + c[None, :], dg.to(DP.dtype.element_ty), mask=ok)
    part = Part + part_off + pid_m.to(tl.int64) * stride_part + c
    tl.store(part, tl.sum(do, axis=0), mask=c_ok)
    tl.store(part + CZ, tl.sum(dg, axis=0), mask=c_ok)


@triton.jit
def _ln_out_rows(X, W, Bias, bat, p, p_ok, h, h_ok, NN, CH, eps, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    # LayerNorm-out of BLOCK_P pairs: x read channel-first [batch, C_h, N*N], all C_h channels in
    # registers. Returns y [BLOCK_P, BLOCK_H] (float32) and the float32 mean and rstd per pair.
    ok_h = p_ok[:, None] & h_ok[None, :]
    x = tl.load(X + (tl.cast(bat, tl.int64) * CH + h)[None, :] * NN + p[:, None], mask=ok_h, other=0.0)
    x = x.to(tl.float32)
    mean = tl.sum(x, axis=1) / CH
    xc = tl.where(ok_h, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / CH + eps)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + h, mask=h_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = tl.where(ok_h, y + tl.load(Bias + h, mask=h_ok, other=0.0).to(tl.float32)[None, :], 0.0)
    return y, mean, rstd


@triton.jit
def _out_kernel(
    X, ZN, W, Bias, WZ, BZ, WG, BG, OUT, DOUT, DP, Y, Mean, Rstd, Part,
    NN, CH, CZ, eps, stride_dout, stride_dp, dg_off, part_off, stride_part, num_tiles, tiles_per_batch,
    HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_BZ: tl.constexpr, HAS_BG: tl.constexpr,
    BWD: tl.constexpr, DOT: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Z: tl.constexpr, ACCUMULATE: tl.constexpr = False,
):  # fmt: skip
    # Float arguments in float32 (torch.compile passes Python floats as float64 scalars).
    eps = tl.cast(eps, tl.float32)
    # The output half of the update, BLOCK_P pairs (a tile) at a time: y = LN_out(x), o = y @ W_z.T +
    # b_z and g = zn @ W_g.T + b_g over all C_z output channels at once (K spans all of C_h for o and
    # of C_z for g: one tl.dot each). Persistent: a program loads W_z, W_g and the biases once and
    # walks the tiles tile = program, program + programs, ... (tile = batch * tiles_per_batch + pair
    # block). Forward: OUT = o * sigmoid(g); y, o and g never reach memory (traffic: read x and zn,
    # write out; with ACCUMULATE, OUT += o * sigmoid(g), the residual add of inference in the same pass).
    # Backward (BWD), recomputing them for d(out): OUT = d(o) = d(out) * s and dg = d(out)
    # * o * s (1 - s) into columns [dg_off, dg_off + C_z) of d_proj (s = sigmoid(g)), with y, LN_out's
    # statistics and the tile's row of float32 sums of d(o) and dg in Part (the b_z and b_g
    # gradients; the host sums the rows) for the rest of the backward.
    h = tl.arange(0, BLOCK_H)
    h_ok = h < CH
    k = tl.arange(0, BLOCK_Z)
    k_ok = k < CZ
    wz_t = tl.load(WZ + k[None, :] * CH + h[:, None], mask=h_ok[:, None] & k_ok[None, :], other=0.0)
    wg_t = tl.load(WG + k[None, :] * CZ + k[:, None], mask=k_ok[:, None] & k_ok[None, :], other=0.0)
    if HAS_BZ:
        bz = tl.load(BZ + k, mask=k_ok, other=0.0).to(tl.float32)
    if HAS_BG:
        bg = tl.load(BG + k, mask=k_ok, other=0.0).to(tl.float32)
    # num_stages=1: software pipelining of this loop (Triton's default, 3 stages) was 30-60% slower.
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), num_stages=1):
        bat = tile // tiles_per_batch
        p = (tile % tiles_per_batch) * BLOCK_P + tl.arange(0, BLOCK_P)
        p_ok = p < NN
        rows = tl.cast(bat, tl.int64) * NN + p
        y, mean, rstd = _ln_out_rows(X, W, Bias, bat, p, p_ok, h, h_ok, NN, CH, eps, HAS_W, HAS_B)
        y = y.to(WZ.dtype.element_ty)
        if BWD:
            tl.store(Y + rows[:, None] * CH + h[None, :], y, mask=p_ok[:, None] & h_ok[None, :])
            tl.store(Mean + rows, mean, mask=p_ok)
            tl.store(Rstd + rows, rstd, mask=p_ok)
        ok = p_ok[:, None] & k_ok[None, :]
        zn = tl.load(ZN + rows[:, None] * CZ + k[None, :], mask=ok, other=0.0)
        o = dot(y, wz_t, DOT)
        g = dot(zn, wg_t, DOT)
        if HAS_BZ:
            o += bz[None, :]
        if HAS_BG:
            g += bg[None, :]
        s = tl.sigmoid(g)
        if BWD:
            dout = tl.load(DOUT + rows[:, None] * stride_dout + k[None, :], mask=ok, other=0.0)
            dout = dout.to(tl.float32)
            do = dout * s
            dg = dout * o * s * (1.0 - s)
            tl.store(OUT + rows[:, None] * CZ + k[None, :], do.to(OUT.dtype.element_ty), mask=ok)
            tl.store(
                DP + rows[:, None] * stride_dp + dg_off + k[None, :], dg.to(DP.dtype.element_ty), mask=ok
            )
            part = Part + part_off + tl.cast(tile, tl.int64) * stride_part + k
            tl.store(part, tl.sum(do, axis=0), mask=k_ok)
            tl.store(part + CZ, tl.sum(dg, axis=0), mask=k_ok)
        else:
            val = o * s
            if ACCUMULATE:
                val += tl.load(OUT + rows[:, None] * CZ + k[None, :], mask=ok, other=0.0).to(tl.float32)
            tl.store(OUT + rows[:, None] * CZ + k[None, :], val.to(OUT.dtype.element_ty), mask=ok)
