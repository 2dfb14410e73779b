"""Triton kernels of `hfkit.ops.lstm`: the LSTM recurrence forward and backward, two ways.

Step kernels (`lstm_step_fwd_kernel`, `lstm_step_bwd_kernel`) run once per time step over a grid of
(hidden tiles, batch tiles): a program owns BLOCK_H hidden units (all four gates of those units) for
BLOCK_B batch rows. Everything a step needs from the other programs (h_{t-1} forward, the previous
step's gate gradients backward) was written by the previous launch, so the launches themselves order
the steps; what a program carries from step to step (c, and dc backward) lives in float32 buffers
that only it reads and writes.

Sequence kernels (`lstm_seq_fwd_kernel`, `lstm_seq_bwd_kernel`) run many steps in one launch: on
CUDA the whole sequence, every program resident at once (grid <= SM count) and meeting the others at
a grid-wide barrier (`_grid_barrier`: an int32 counter, release/acquire atomics) after each step, so
that h_t (dgates_t backward), read through L2, is complete before the next step. A program keeps its
slice of w_hh on chip across the steps where it fits (RESIDENT) and c (dc) in registers. With
PERSISTENT off (the interpreter, whose programs run one after another) the same code runs one step a
launch. Both write the same buffers in the same layouts as the step kernels.

Gates are in torch's order i, f, g, o along the 4H rows of the weights. The launchers, the time loop
and autograd are in `hfkit.ops.lstm`.
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
def _cell_fwd(a_i, a_f, a_g, a_o, c_prev):
    # One step of the cell from the gates' pre-activations (float32): i, f, o sigmoid, g tanh;
    # c = f*c_prev + i*g, h = o*tanh(c). Returns i, f, g, o, c, h.
    i = tl.sigmoid(a_i)
    f = tl.sigmoid(a_f)
    g = _tanh(a_g)
    o = tl.sigmoid(a_o)
    c = f * c_prev + i * g
    return i, f, g, o, c, o * _tanh(c)


@triton.jit
def _cell_bwd(dh, dc, i, f, g, o, c, c_prev):
    # One step of the cell backward from dh_t and the dc carried from step t+1: dc_t = dc +
    # dh*o*(1 - tanh(c_t)^2); returns the gates' gradients before activation (d_i, d_f, d_g, d_o) and
    # dc_t*f_t, what step t-1 carries.
    tanh_c = _tanh(c)
    dc = dc + dh * o * (1.0 - tanh_c * tanh_c)
    d_i = dc * g * i * (1.0 - i)
    d_f = dc * c_prev * f * (1.0 - f)
    d_g = dc * i * (1.0 - g * g)
    d_o = dh * tanh_c * o * (1.0 - o)
    return d_i, d_f, d_g, d_o, dc * f


@triton.jit
def _store_gates(ptrs, i, f, g, o, H, ok):
    # Four per-gate tiles into a [*, 4H] row layout: gate q at ptrs + q*H (torch's order i, f, g, o).
    tl.store(ptrs, i, mask=ok)
    tl.store(ptrs + H, f, mask=ok)
    tl.store(ptrs + 2 * H, g, mask=ok)
    tl.store(ptrs + 3 * H, o, mask=ok)


@triton.jit
def _load_gates(ptrs, H, ok):
    # The four per-gate tiles that `_store_gates` wrote.
    i = tl.load(ptrs, mask=ok, other=0.0)
    f = tl.load(ptrs + H, mask=ok, other=0.0)
    g = tl.load(ptrs + 2 * H, mask=ok, other=0.0)
    o = tl.load(ptrs + 3 * H, mask=ok, other=0.0)
    return i, f, g, o


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
    rows64 = rows.to(tl.int64)
    # [t, rows, units] of a [*, B, H] tensor is at (t*B + rows)*H + units (64-bit: T*B*H may pass 2^31).
    at_t = (t * B + rows64)[:, None] * H + units[None, :]
    at_next = at_t + B * H
    c_prev = tl.load(CS + at_t, mask=ok, other=0.0)
    i, f, g, o, c, h = _cell_fwd(a_i, a_f, a_g, a_o, c_prev)
    tl.store(CS + at_next, c, mask=ok)
    tl.store(Y + at_t, h.to(Y.dtype.element_ty), mask=ok)
    _store_gates(G + (t * B + rows64)[:, None] * (4 * H) + units[None, :], i, f, g, o, H, ok)


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
                # products (w is exact in its dtype): about float32 accuracy (the sequence kernel
                # rounds dgates once by default instead: SEQ_BWD_SPLIT in `hfkit.ops.lstm`).
                head = dg.to(w.dtype)
                tail = (dg - head.to(tl.float32)).to(w.dtype)
                dh += dot(head, w, DOT) + dot(tail, w, DOT)
            else:
                dh += dot(dg, w, DOT)
    i, f, g, o = _load_gates(G + (t * B + rows64)[:, None] * (4 * H) + units[None, :], H, ok)
    c = tl.load(CS + at_t + B * H, mask=ok, other=0.0)
    c_prev = tl.load(CS + at_t, mask=ok, other=0.0)
    dc = tl.load(DC + state, mask=ok, other=0.0)
    d_i, d_f, d_g, d_o, dc_carried = _cell_bwd(dh, dc, i, f, g, o, c, c_prev)
    tl.store(DC + state, dc_carried, mask=ok)
    _store_gates(DG + (t * B + rows64)[:, None] * (4 * H) + units[None, :], d_i, d_f, d_g, d_o, H, ok)


@triton.jit
def _grid_barrier(Counter, target):
    # Every program of the grid waits here until `target` arrivals were counted (step s of a launch:
    # (s+1) * programs). The CTA barrier orders this program's stores of the step before thread 0's
    # release-increment (gpu scope, cumulative), the acquiring spin and the second CTA barrier order
    # the next step's loads after every program's stores. Safe only while every program is resident
    # (grid <= SM count, one CTA per SM). Scalar atomics run on one thread of the program.
    tl.debug_barrier()
    count = tl.atomic_add(Counter, 1, sem="acq_rel", scope="gpu") + 1
    while count < target:
        count = tl.atomic_add(Counter, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _split_gates(acc, BLOCK_U: tl.constexpr, BLOCK_B: tl.constexpr):
    # acc [4*BLOCK_U, BLOCK_B] with row u*4 + q holding gate q of unit u -> the four [BLOCK_U, BLOCK_B]
    # gates i, f, g, o: [U, 4, B] -> [U, B, 4] -> [U, B, 2, 2] (q = 2a + b); split b: q in {0, 2} and
    # {1, 3}; split a: i, g and f, o.
    by_gate = tl.permute(tl.reshape(acc, [BLOCK_U, 4, BLOCK_B]), 0, 2, 1)
    even, odd = tl.split(tl.reshape(by_gate, [BLOCK_U, BLOCK_B, 2, 2]))
    i, g = tl.split(even)
    f, o = tl.split(odd)
    return i, f, g, o


# do_not_specialize: the first step and the step count take every value; one compiled kernel serves them.
@triton.jit(do_not_specialize=["t_first", "n_steps"])
def lstm_seq_fwd_kernel(
    XP, Bias, H0, W, CS, Y, G, Counter, WUnscale, H0Unscale, HRing,
    t_first, n_steps, B, H,
    HAS_BIAS: tl.constexpr, PERSISTENT: tl.constexpr, RESIDENT: tl.constexpr, DOT: tl.constexpr,
    HALF: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Steps t_first .. t_first + n_steps - 1 of the forward recurrence over a grid of (unit tiles, batch
    # tiles): a program owns BLOCK_U hidden units (4*BLOCK_U rows of w_hh) for BLOCK_B batch rows. Its
    # w_hh slice is [4*BLOCK_U, H] with row u*4 + q = gate q of unit u, so one product gives all four
    # gates: gates^T = slice @ h_{t-1}^T. RESIDENT (BLOCK_K >= H): the slice is loaded once and stays
    # on chip (the compiler keeps it in shared memory, as the dot's operand) for every step, one dot a
    # step; otherwise it is read from L2 at every step, BLOCK_K columns at a time. c stays in float32
    # registers from step to step (read from CS[t_first] on entry). PERSISTENT: the programs meet at
    # the grid barrier after each step (h_t = Y[t] is read by every program, through L2: .cg);
    # otherwise a launch runs one step and the launches order the steps. Traffic per step: h_{t-1}
    # once per program (from L2), xp[t], c, h_t and the gates once each; w_hh once per launch
    # (RESIDENT) or once per step over the grid.
    # HALF (float32 layers in place of one TF32 product, RESIDENT): the product's operands are
    # float16, which has TF32's 11-bit significand, at half the on-chip bytes and shared-memory
    # traffic a step. W is then w_hh in float16 with each row scaled by a power of two into float16's
    # range, WUnscale [4H] float32 the factors that undo it; H0 is h0 in float16, scaled the same way
    # per batch row, H0Unscale [B] its factors (`_pow2_rows` in `hfkit.ops.lstm`). h_t = o*tanh(c_t),
    # in (-1, 1), needs no scaling: each step also writes it in float16 to HRing [2 (step parity), B,
    # H], which the next step reads (half the bytes of Y's float32; slot t % 2 is written again at
    # step t + 2, past the barrier every program reaches after reading it). Otherwise all three are
    # unused.
    # XP: [T, B, 4H] (input projection without bias); Bias: [4H] float32; H0: [B, H]; W: w_hh [4H, H];
    # CS: [T+1, B, H] float32 with CS[0] = c0; Y: [T, B, H]; G: [T, B, 4H] float32 (activated gates);
    # Counter: int32, zero on entry to a PERSISTENT launch.
    rows_w = tl.arange(0, 4 * BLOCK_U)
    unit_of_row = tl.program_id(0) * BLOCK_U + rows_w // 4
    gate_col = (rows_w % 4) * H + unit_of_row  # row of w_hh, column of xp and bias
    row_ok = unit_of_row < H
    w_rows = W + gate_col.to(tl.int64)[:, None] * H
    ks = tl.arange(0, BLOCK_K)
    if RESIDENT:
        w = tl.load(w_rows + ks[None, :], mask=row_ok[:, None] & (ks < H)[None, :], other=0.0)
    if HAS_BIAS:
        bias = tl.load(Bias + gate_col, mask=row_ok, other=0.0)
    units = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    rows = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    rows64 = rows.to(tl.int64)
    u_ok = units < H
    b_ok = rows < B
    if HALF:
        w_unscale = tl.load(WUnscale + gate_col, mask=row_ok, other=1.0)
        h0_unscale = tl.load(H0Unscale + rows, mask=b_ok, other=1.0)
    ok = u_ok[:, None] & b_ok[None, :]  # [BLOCK_U, BLOCK_B]
    xp_ok = row_ok[:, None] & b_ok[None, :]  # [4*BLOCK_U, BLOCK_B]
    # Everything below is transposed (units along dim 0): [t, rows, units] of a [*, B, H] tensor is at
    # (t*B + rows)*H + units (64-bit: T*B*4H may pass 2^31).
    c = tl.load(CS + (t_first * B + rows64)[None, :] * H + units[:, None], mask=ok, other=0.0)
    programs = tl.num_programs(0) * tl.num_programs(1)
    for t in range(t_first, t_first + n_steps):
        # h_{t-1}: Y[t-1] (HRing's slot with HALF), or H0 at t = 0 (one load a tile: a single trip
        # through shared memory into the dot).
        if HALF:
            h_prev = HRing + (((t - 1) % 2) * B + rows64)[None, :] * H
        else:
            h_prev = Y + ((t - 1) * B + rows64)[None, :] * H
        h_rows = tl.where(t > 0, h_prev, H0 + rows64[None, :] * H)
        if RESIDENT:
            h_ok = (ks < H)[:, None] & b_ok[None, :]
            h = tl.load(h_rows + ks[:, None], mask=h_ok, other=0.0, cache_modifier=".cg")
            if HALF:
                acc = dot(w, h.to(w.dtype), 0) * w_unscale[:, None]
                acc = acc * tl.where(t == 0, h0_unscale, 1.0)[None, :]
            else:
                acc = dot(w, h.to(w.dtype), DOT)
        else:
            acc = tl.zeros([4 * BLOCK_U, BLOCK_B], dtype=tl.float32)
            for k0 in range(0, H, BLOCK_K):
                k_ok = k0 + ks < H
                w_k = tl.load(w_rows + k0 + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                h_ok = k_ok[:, None] & b_ok[None, :]
                h = tl.load(h_rows + k0 + ks[:, None], mask=h_ok, other=0.0, cache_modifier=".cg")
                acc += dot(w_k, h.to(w_k.dtype), DOT)
        xp = tl.load(XP + (t * B + rows64)[None, :] * (4 * H) + gate_col[:, None], mask=xp_ok, other=0.0)
        acc += xp.to(tl.float32)
        if HAS_BIAS:
            acc += bias[:, None]
        a_i, a_f, a_g, a_o = _split_gates(acc, BLOCK_U, BLOCK_B)
        i, f, g, o, c, h = _cell_fwd(a_i, a_f, a_g, a_o, c)
        at_t = (t * B + rows64)[None, :] * H + units[:, None]
        tl.store(CS + at_t + B * H, c, mask=ok)
        tl.store(Y + at_t, h.to(Y.dtype.element_ty), mask=ok)
        if HALF:
            tl.store(HRing + ((t % 2) * B + rows64)[None, :] * H + units[:, None], h.to(tl.float16), mask=ok)
        _store_gates(G + (t * B + rows64)[None, :] * (4 * H) + units[:, None], i, f, g, o, H, ok)
        if PERSISTENT:
            _grid_barrier(Counter, (t - t_first + 1) * programs)


@triton.jit
def _gate_diagonal(product, BLOCK_U: tl.constexpr, BLOCK_B: tl.constexpr, PARTS: tl.constexpr):
    # product [4*BLOCK_U, PARTS*4*BLOCK_B], row u*4 + q (gate q of unit u's column of w_hh), column
    # (p*4 + q')*BLOCK_B + b (part p of gate q' of batch row b's dgates) -> [BLOCK_U, BLOCK_B]: the sum
    # over q and p of the blocks where q' = q (the others pair one gate's weights with another gate's
    # gradients).
    rows = tl.arange(0, 4 * BLOCK_U)
    cols = tl.arange(0, PARTS * 4 * BLOCK_B)
    same_gate = (rows % 4)[:, None] == ((cols // BLOCK_B) % 4)[None, :]
    by_gate = tl.reshape(tl.where(same_gate, product, 0.0), [BLOCK_U, 4, PARTS * 4 * BLOCK_B])
    return tl.sum(tl.reshape(tl.sum(by_gate, axis=1), [BLOCK_U, PARTS * 4, BLOCK_B]), axis=1)


@triton.jit
def _store_dgates(DGS, units, rows, ok, d_i, d_f, d_g, d_o, NB: tl.constexpr, BLOCK_B: tl.constexpr):
    # The four gate gradients [BLOCK_U, BLOCK_B] (units along dim 0), rounded to DGS's dtype, into
    # rows `units` of a DGS slot [KS, NB] at columns q*BLOCK_B + rows (from DGS on).
    ptrs = DGS + units[:, None] * NB + rows[None, :]
    tl.store(ptrs, d_i.to(DGS.dtype.element_ty), mask=ok)
    tl.store(ptrs + BLOCK_B, d_f.to(DGS.dtype.element_ty), mask=ok)
    tl.store(ptrs + 2 * BLOCK_B, d_g.to(DGS.dtype.element_ty), mask=ok)
    tl.store(ptrs + 3 * BLOCK_B, d_o.to(DGS.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_step_inputs(DY, G, CS, t, units, rows64, B, H, ok):
    # What step t of the backward reads that the forward wrote, [BLOCK_U, BLOCK_B] tiles (units along
    # dim 0): dy[t] (float32), the activated gates i, f, g, o of step t, c_t and c_{t-1}.
    at_t = (t * B + rows64)[None, :] * H + units[:, None]
    dy = tl.load(DY + at_t, mask=ok, other=0.0).to(tl.float32)
    i, f, g, o = _load_gates(G + (t * B + rows64)[None, :] * (4 * H) + units[:, None], H, ok)
    c = tl.load(CS + at_t + B * H, mask=ok, other=0.0)
    c_prev = tl.load(CS + at_t, mask=ok, other=0.0)
    return dy, i, f, g, o, c, c_prev


@triton.jit
def _rounding_left(x, dtype: tl.constexpr):
    # What rounding x (float32) to `dtype` leaves: SPLIT's tail.
    return x - x.to(dtype).to(tl.float32)


# do_not_specialize: the first step and the step count take every value; one compiled kernel serves them.
@triton.jit(do_not_specialize=["t_first", "n_steps"])
def lstm_seq_bwd_kernel(
    DY, DHN, W, G, CS, DC, DG, DGS, Counter,
    t_first, n_steps, T, B, H,
    PERSISTENT: tl.constexpr, RESIDENT: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
    DOT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_K: tl.constexpr, KS: tl.constexpr,
):  # fmt: skip
    # Steps t_first, t_first - 1, .., t_first - n_steps + 1 of the backward recurrence over a grid of
    # unit tiles: a program owns BLOCK_U units j for the whole batch (BLOCK_B >= B rows). dh_t = dy[t] +
    # dgates_{t+1} @ w_hh[:, j] (the product over all 4H rows; dh_n instead at t = T-1), dc_t = dc
    # carried + dh_t*o*(1 - tanh(c_t)^2); the gate gradients (before activation) -> DG[t]. dc*f is
    # carried in float32 registers (read from DC on entry, written back on exit).
    # The product is one dot a step (a BLOCK_K chunk of it without RESIDENT): the program's columns of
    # w_hh as a [4*BLOCK_U, H] slice (row u*4 + q, element k: w_hh[q*H + k, j_u]; the forward's slice
    # layout) times dgates_{t+1} as [H, NB] (column (p*4 + q)*BLOCK_B + b, element k: part p of
    # dgates[b, q*H + k]); of the [4*BLOCK_U, NB] result the blocks where the two gates agree sum to
    # the [BLOCK_U, BLOCK_B] product (`_gate_diagonal`). The dot's dims are >= 16 from BLOCK_U = 4 and
    # BLOCK_B = 4, and at B = 4 the dgates operand holds no padding. Each step writes its dgates to DGS
    # in that operand layout (read by every program the step after, through L2: .cg), in w_hh's dtype:
    # with SPLIT (16-bit w_hh) as a head and a tail side by side (NB = 8*BLOCK_B: w is exact in its
    # dtype, so the product is about float32-accurate), otherwise rounded to w_hh's dtype once (NB =
    # 4*BLOCK_B; the default, SEQ_BWD_SPLIT in `hfkit.ops.lstm` says why). RESIDENT (BLOCK_K = KS):
    # the slice is loaded once and stays on chip for every step; otherwise it is read from L2 at
    # every step, BLOCK_K columns at a time. PERSISTENT: the grid barrier after each step; otherwise
    # one step a launch. PREFETCH: what a step reads that the forward wrote (dy, the gates, c) is
    # loaded one step ahead, before the barrier, whose wait hides the latency (otherwise at the top of
    # the step, beside the dgates). Traffic per step: dgates_{t+1} once per program, dy[t], the gates
    # and c once each; w_hh once per launch (RESIDENT) or once per step over the grid.
    # DY: [T, B, H]; DHN: [B, H]; W: w_hh [4H, H]; G: [T, B, 4H] activated gates float32; CS: [T+1, B,
    # H] float32; DC: [B, H] float32 (dc carried into step t_first; dc_t*f_t of the last step run on
    # exit); DG: [T, B, 4H] float32; DGS: [2 (step parity), KS, NB] in w_hh's dtype (KS: H rounded up
    # to BLOCK_K), zeros on entry to a sequence's first launch (step T-1 reads zeros: no dgates_T);
    # Counter: int32, zero on entry to a PERSISTENT launch.
    NB: tl.constexpr = (1 + SPLIT) * 4 * BLOCK_B
    rows_w = tl.arange(0, 4 * BLOCK_U)
    unit_of_row = tl.program_id(0) * BLOCK_U + rows_w // 4
    row_ok = unit_of_row < H
    # Element (row, k) of the slice at w_cols + k*H (64-bit: 4H*H may pass 2^31). tl.cast, not H.to:
    # torch.compile's analysis of the kernel passes H as a Python int.
    w_cols = W + ((rows_w % 4) * tl.cast(H, tl.int64) * H + unit_of_row)[:, None]
    ks = tl.arange(0, BLOCK_K)
    if RESIDENT:
        w = tl.load(
            w_cols + ks[None, :].to(tl.int64) * H, mask=row_ok[:, None] & (ks < H)[None, :], other=0.0
        )
    cols = tl.arange(0, NB)
    units = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    rows = tl.arange(0, BLOCK_B)
    rows64 = rows.to(tl.int64)
    u_ok = units < H
    b_ok = rows < B
    ok = u_ok[:, None] & b_ok[None, :]  # [BLOCK_U, BLOCK_B]
    # Everything below is transposed (units along dim 0), as in the forward.
    state = rows64[None, :] * H + units[:, None]
    dc = tl.load(DC + state, mask=ok, other=0.0)
    dh_n = tl.load(DHN + state, mask=ok, other=0.0).to(tl.float32)
    programs = tl.num_programs(0)
    if PREFETCH:
        dy, i, f, g, o, c, c_prev = _bwd_step_inputs(DY, G, CS, t_first, units, rows64, B, H, ok)
    for s in range(n_steps):
        t = t_first - s
        if not PREFETCH:
            dy, i, f, g, o, c, c_prev = _bwd_step_inputs(DY, G, CS, t, units, rows64, B, H, ok)
        dh = dy + tl.where(t == T - 1, dh_n, 0.0)
        # dgates_{t+1}: slot (t+1) % 2, unmasked (its rows past H and columns past B are zeros).
        dgs_next = DGS + ((t + 1) % 2) * KS * NB + cols[None, :]
        if RESIDENT:
            dgs = tl.load(dgs_next + ks[:, None] * NB, cache_modifier=".cg")
            product = dot(w, dgs, DOT)
        else:
            product = tl.zeros([4 * BLOCK_U, NB], dtype=tl.float32)
            for k0 in range(0, KS, BLOCK_K):
                k_ok = k0 + ks < H
                w_k = tl.load(
                    w_cols + (k0 + ks)[None, :].to(tl.int64) * H,
                    mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0,
                )
                dgs = tl.load(dgs_next + (k0 + ks)[:, None] * NB, cache_modifier=".cg")
                product += dot(w_k, dgs, DOT)
        dh += _gate_diagonal(product, BLOCK_U, BLOCK_B, 1 + SPLIT)
        d_i, d_f, d_g, d_o, dc = _cell_bwd(dh, dc, i, f, g, o, c, c_prev)
        _store_gates(DG + (t * B + rows64)[None, :] * (4 * H) + units[:, None], d_i, d_f, d_g, d_o, H, ok)
        # Slot t % 2: the one step t-1 reads while no program writes it (a program writes it again at
        # step t-2, past the barrier that every program reaches after reading it).
        dgs_t = DGS + (t % 2) * KS * NB
        _store_dgates(dgs_t, units, rows, ok, d_i, d_f, d_g, d_o, NB, BLOCK_B)
        if SPLIT:
            w_dtype: tl.constexpr = DGS.dtype.element_ty
            _store_dgates(dgs_t + 4 * BLOCK_B, units, rows, ok,
                _rounding_left(d_i, w_dtype), _rounding_left(d_f, w_dtype),
                _rounding_left(d_g, w_dtype), _rounding_left(d_o, w_dtype), NB, BLOCK_B,
            )  # fmt: skip
        if PREFETCH:
            # Past the launch's last step, a row bound of 0 masks the loads off.
            next_ok = u_ok[:, None] & (rows < tl.where(s + 1 < n_steps, B, 0))[None, :]
            dy, i, f, g, o, c, c_prev = _bwd_step_inputs(DY, G, CS, t - 1, units, rows64, B, H, next_ok)
        if PERSISTENT:
            _grid_barrier(Counter, (s + 1) * programs)
    tl.store(DC + state, dc, mask=ok)
