"""Triton kernels of `hfkit.ops.lstm`: one LSTM time step forward, one time step backward.

Both run once per time step over a grid of (hidden tiles, batch tiles): a program owns BLOCK_H hidden
units (all four gates of those units) for BLOCK_B batch rows. Everything a step needs from the other
programs (h_{t-1} forward, the previous step's gate gradients backward) was written by the previous
launch, so the launches themselves order the steps; what a program carries from step to step (c,
and dc backward) lives in float32 buffers that only it reads and writes. Gates are in torch's order
i, f, g, o along the 4H rows of the weights. The launchers, the time loop and autograd are in
`hfkit.ops.lstm`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hfkit.ops._triton import dot


@triton.jit
def _tanh(x):
    # tanh through the sigmoid (tl has no tanh): exact to float32 rounding away from 0, and to ~1e-7
    # absolute near 0.
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _gate_preactivation(
    acc, XP, Bias, HPrev, W, t, q, rows, units, b_ok, u_ok, B, H,
    HAS_BIAS: tl.constexpr, DOT: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # acc + xp[t, rows, q*H + units] + bias[q*H + units] + h_{t-1}[rows, :] @ w_hh[q*H + units, :]^T
    rows64 = rows.to(tl.int64)
    gate_cols = q * H + units
    ok = b_ok[:, None] & u_ok[None, :]
    xp_ptrs = XP + (t * B + rows64)[:, None] * (4 * H) + gate_cols[None, :]
    acc += tl.load(xp_ptrs, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(Bias + gate_cols, mask=u_ok, other=0.0).to(tl.float32)[None, :]
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        h = tl.load(HPrev + rows64[:, None] * H + ks[None, :], mask=b_ok[:, None] & k_ok[None, :], other=0.0)
        # [BLOCK_K, BLOCK_H] tile of w_hh^T: element (k, u) is w_hh[q*H + u, k].
        w = tl.load(
            W + gate_cols.to(tl.int64)[None, :] * H + ks[:, None],
            mask=k_ok[:, None] & u_ok[None, :],
            other=0.0,
        )
        acc += dot(h.to(w.dtype), w, DOT)
    return acc


# do_not_specialize: the step index takes every value; one compiled kernel serves them all.
@triton.jit(do_not_specialize=["t"])
def lstm_step_fwd_kernel(
    XP, Bias, HPrev, W, CS, Y, G,
    t, B, H,
    HAS_BIAS: tl.constexpr, DOT: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Step t: gates = xp[t] + bias + h_{t-1} @ w_hh^T for this program's units; c_t = f*c_{t-1} + i*g
    # (float32, CS[t] -> CS[t+1]), h_t = o*tanh(c_t) -> Y[t]; the activated gates -> G[t] for the
    # backward. Traffic per step: all of w_hh once over the grid (from L2 after the first step), h_{t-1}
    # once per program, and xp[t], c, h_t, the gates once each.
    # XP: [T, B, 4H] (input projection without bias); HPrev: [B, H] (h0 or Y[t-1]); W: w_hh [4H, H];
    # CS: [T+1, B, H] float32 with CS[0] = c0; Y: [T, B, H]; G: [T, B, 4H] float32.
    units = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    u_ok = units < H
    b_ok = rows < B
    ok = b_ok[:, None] & u_ok[None, :]
    zero = tl.zeros([BLOCK_B, BLOCK_H], dtype=tl.float32)
    a_i = _gate_preactivation(
        zero, XP, Bias, HPrev, W, t, 0, rows, units, b_ok, u_ok, B, H, HAS_BIAS, DOT, BLOCK_K
    )
    a_f = _gate_preactivation(
        zero, XP, Bias, HPrev, W, t, 1, rows, units, b_ok, u_ok, B, H, HAS_BIAS, DOT, BLOCK_K
    )
    a_g = _gate_preactivation(
        zero, XP, Bias, HPrev, W, t, 2, rows, units, b_ok, u_ok, B, H, HAS_BIAS, DOT, BLOCK_K
    )
    a_o = _gate_preactivation(
        zero, XP, Bias, HPrev, W, t, 3, rows, units, b_ok, u_ok, B, H, HAS_BIAS, DOT, BLOCK_K
    )
    i = tl.sigmoid(a_i)
    f = tl.sigmoid(a_f)
    g = _tanh(a_g)
    o = tl.sigmoid(a_o)
    rows64 = rows.to(tl.int64)
    # [t, rows, units] of a [*, B, H] tensor is at (t*B + rows)*H + units (64-bit: T*B*H may pass 2^31).
    at_t = (t * B + rows64)[:, None] * H + units[None, :]
    at_next = at_t + B * H
    c_prev = tl.load(CS + at_t, mask=ok, other=0.0)
    c = f * c_prev + i * g
    h = o * _tanh(c)
    tl.store(CS + at_next, c, mask=ok)
    tl.store(Y + at_t, h.to(Y.dtype.element_ty), mask=ok)
    gates = G + (t * B + rows64)[:, None] * (4 * H) + units[None, :]
    tl.store(gates, i, mask=ok)
    tl.store(gates + H, f, mask=ok)
    tl.store(gates + 2 * H, g, mask=ok)
    tl.store(gates + 3 * H, o, mask=ok)


# do_not_specialize: the step index takes every value; one compiled kernel serves them all.
@triton.jit(do_not_specialize=["t"])
def lstm_step_bwd_kernel(
    DY, DHN, DGNext, W, G, CS, DC, DG,
    t, B, H,
    LAST: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Step t going backward: dh_t = dy[t] + dgates_{t+1} @ w_hh (over all 4H rows; dh_n instead of the
    # product at the last step), dc_t = dc carried + dh_t*o*(1 - tanh(c_t)^2); the gate gradients
    # (before activation) -> DG[t], and dc_t*f_t carried to step t-1 in DC. Traffic per step: all of
    # w_hh once over the grid, dgates_{t+1} once per program, dy[t], the gates and c once each.
    # DY: [T, B, H]; DHN: [B, H]; DGNext: DG[t+1] [B, 4H] float32 (unused at the LAST step); W: w_hh
    # [4H, H]; G: [T, B, 4H] activated gates float32; CS: [T+1, B, H] float32; DC: [B, H] float32
    # (dc_n on entry to the last step, dc_{t}*f_{t} on exit of step t); DG: [T, B, 4H] float32.
    # SPLIT: w_hh is 16-bit (see the product below).
    units = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    u_ok = units < H
    b_ok = rows < B
    ok = b_ok[:, None] & u_ok[None, :]
    rows64 = rows.to(tl.int64)
    state = rows64[:, None] * H + units[None, :]
    at_t = (t * B + rows64)[:, None] * H + units[None, :]
    dh = tl.load(DY + at_t, mask=ok, other=0.0).to(tl.float32)
    if LAST:
        dh += tl.load(DHN + state, mask=ok, other=0.0).to(tl.float32)
    else:
        for k0 in range(0, 4 * H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < 4 * H
            dg = tl.load(
                DGNext + rows64[:, None] * (4 * H) + ks[None, :],
                mask=b_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                W + ks.to(tl.int64)[:, None] * H + units[None, :],
                mask=k_ok[:, None] & u_ok[None, :],
                other=0.0,
            )
            if SPLIT:
                # 16-bit weights: dgates (float32) as a 16-bit head plus a 16-bit tail, two 16-bit
                # products (w is exact in its dtype): about float32 accuracy where rounding dgates
                # to 16 bits at every step would compound over the sequence.
                head = dg.to(w.dtype)
                tail = (dg - head.to(tl.float32)).to(w.dtype)
                dh += dot(head, w, DOT) + dot(tail, w, DOT)
            else:
                dh += dot(dg, w, DOT)
    gates = G + (t * B + rows64)[:, None] * (4 * H) + units[None, :]
    i = tl.load(gates, mask=ok, other=0.0)
    f = tl.load(gates + H, mask=ok, other=0.0)
    g = tl.load(gates + 2 * H, mask=ok, other=0.0)
    o = tl.load(gates + 3 * H, mask=ok, other=0.0)
    c = tl.load(CS + at_t + B * H, mask=ok, other=0.0)
    c_prev = tl.load(CS + at_t, mask=ok, other=0.0)
    tanh_c = _tanh(c)
    dc = tl.load(DC + state, mask=ok, other=0.0) + dh * o * (1.0 - tanh_c * tanh_c)
    d_i = dc * g * i * (1.0 - i)
    d_f = dc * c_prev * f * (1.0 - f)
    d_g = dc * i * (1.0 - g * g)
    d_o = dh * tanh_c * o * (1.0 - o)
    tl.store(DC + state, dc * f, mask=ok)
    dgates = DG + (t * B + rows64)[:, None] * (4 * H) + units[None, :]
    tl.store(dgates, d_i, mask=ok)
    tl.store(dgates + H, d_f, mask=ok)
    tl.store(dgates + 2 * H, d_g, mask=ok)
    tl.store(dgates + 3 * H, d_o, mask=ok)
