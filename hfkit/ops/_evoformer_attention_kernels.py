"""Triton kernels of `hfkit.ops.evoformer_attention`: the flash-style forward and the backward passes.

Layout shared by all of them: q, k, v, o and their gradients are [B, S, H, N, D] with strides of their
own (unit along D); a program of the forward, dq and dk/dv passes owns one (b, s, h) slice and one block
of queries or keys, so their grid's second axis is B*S*H (the dbias and the fused dk/dv + dbias passes
walk the rows a bias is broadcast over instead; see `_evo_bwd_kernel`). The logits never reach
memory: every pass recomputes its [BLOCK_M, BLOCK_N] tiles from q, k, the bias, the key bias and the
saved float32 row statistics (max and log2 of the sum, [B*S*H, Q]), working in base 2 (natural logits
times log2(e)). `EVEN` drops every bound mask when all tiles are full; `EVEN_MN` drops those of the
[BLOCK_M, BLOCK_N] tiles (bias, probabilities, row statistics) when only the head dim is padded (D = 8
in 16), so that the masks stay on the D-wide tiles alone. The launchers, tile tables and autograd are
in `hfkit.ops.evoformer_attention`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hfkit.ops._triton import dot


@triton.jit
def _ld(ptrs, mask, EVEN: tl.constexpr):
    # EVEN: the tile is full (callers pass EVEN, or EVEN_MN for tiles without a head dim): no mask.
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _st(ptrs, value, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptrs, value)
    else:
        tl.store(ptrs, value, mask=mask)


@triton.jit
def _split_bsh(bsh, S, H):
    # (b, s, h) of the flat (b, s, h) index bsh = (b S + s) H + h; s and h as int64 (s * stride passes
    # 2**31 once N > 4096: q of triangle attention is [1, N, H, N, D]).
    return bsh // (H * S), ((bsh // H) % S).to(tl.int64), (bsh % H).to(tl.int64)


@triton.jit
def _program_tile(pid_x, pid_y, n_mb, n_bsh, group_rows, H):
    # (query block, flat (b, s, h) index) of the forward's program (pid_x, pid_y) in a grid of
    # (n_mb query blocks, n_bsh = B*S*H): programs are taken in (row r = b*S + s, query block, head)
    # order, rows fastest in groups of `group_rows` (the Gluon forward orders its programs alike).
    pid = pid_y * n_mb + pid_x
    per_group = group_rows * n_mb * H
    g = pid // per_group
    local = pid - g * per_group
    rows_here = tl.minimum(group_rows, n_bsh // H - g * group_rows)
    rest = local // rows_here
    return rest % n_mb, (g * group_rows + local % rows_here) * H + rest // n_mb


@triton.jit
def _bias_tile(Bias, b_off, offs_m, offs_n, n_q, n_k, sbq, sbk, EVEN: tl.constexpr):
    ok = (offs_m < n_q)[:, None] & (offs_n < n_k)[None, :]
    return _ld(Bias + b_off + offs_m[:, None] * sbq + offs_n[None, :] * sbk, ok, EVEN).to(tl.float32)


@triton.jit
def _logits(
    q, k_ptrs, Bias, KeyBias, offs_m, offs_n, n_q, n_k, qk_scale,
    k_ok_d, b_off, kb_off, sbq, sbk, skb_k, btile, shift,
    HAS_BIAS: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, DOT: tl.constexpr, EVEN: tl.constexpr,
    EVEN_MN: tl.constexpr,
    BIAS_PRELOADED: tl.constexpr, SHIFTED: tl.constexpr = False,
):  # fmt: skip
    # One [BLOCK_M, BLOCK_N] tile of logits in float32, in base-2 units (natural logits times
    # log2(e): qk_scale includes it, so the softmax is a bare exp2); keys past n_k are -inf.
    # BIAS_PRELOADED: `btile` holds this tile's bias already (float32), else it is loaded here.
    # Two fused multiply-adds per logit, the key bias joining the scaling and the bias the next one
    # (the softmax is issue-bound at small head dims: one instruction of ~15 per logit less than a
    # multiply and two adds). SHIFTED (the bounded forward without a key bias): the scaling's fused
    # multiply-add also subtracts `shift`, the rows' reference, one add a logit less. The forward, dq
    # and dbias passes take their logits from here; the dk/dv pass (`_dkdv_tile`) adds the same terms
    # in the same order, its bias term (bias times log2(e), shared by the rows it walks) rounded once
    # more.
    k_ok = offs_n < n_k
    kt = _ld(k_ptrs, k_ok[None, :] & k_ok_d, EVEN)
    s = dot(q, kt, DOT)
    if HAS_KEY_BIAS:
        kb = _ld(KeyBias + kb_off + offs_n * skb_k, k_ok, EVEN_MN) * 1.4426950408889634  # LOG2E
        s = tl.fma(s, qk_scale, kb[None, :])
    elif SHIFTED:
        s = tl.fma(s, qk_scale, -shift[:, None])
    else:
        s = s * qk_scale
    if HAS_BIAS:
        if BIAS_PRELOADED:  # noqa: SIM108  (a constexpr branch, resolved at compile time)
            t = btile
        else:
            t = _bias_tile(Bias, b_off, offs_m, offs_n, n_q, n_k, sbq, sbk, EVEN_MN)
        s = tl.fma(t, 1.4426950408889634, s)
    if not EVEN_MN:
        s = tl.where(k_ok[None, :], s, float("-inf"))
    return s


@triton.jit
def _softmax_rows(
    q, k_base, v_base, Bias, KeyBias, offs_m, offs_d, d_ok, n_q, n_k, qk_scale, b_off, kb_off, sbq, sbk,
    skb_k, skn, svn, bound,
    HAS_BIAS: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, DOT: tl.constexpr, EVEN: tl.constexpr,
    EVEN_MN: tl.constexpr, BOUNDED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # The softmax over every key block: (reference m, sum l relative to it, unnormalized o). BOUNDED:
    # against the fixed reference `bound` per row (base 2): no max, no shuffles, no rescaling of the
    # sum and the output; else the online softmax's running max (bound unused).
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start in range(0, n_k, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[None, :] * skn + offs_d[:, None]
        s = _logits(
            q, k_ptrs, Bias, KeyBias, offs_m, offs_n, n_q, n_k, qk_scale,
            d_ok[:, None], b_off, kb_off, sbq, sbk, skb_k, 0, bound, HAS_BIAS, HAS_KEY_BIAS, DOT, EVEN,
            EVEN_MN, False, BOUNDED and not HAS_KEY_BIAS,
        )  # fmt: skip
        vt = _ld(
            v_base + offs_n[:, None] * svn + offs_d[None, :],
            (offs_n < n_k)[:, None] & d_ok[None, :],
            EVEN,
        )
        if BOUNDED:
            if HAS_KEY_BIAS:  # else `_logits` subtracted the reference already (SHIFTED)
                s -= bound[:, None]
            p = tl.exp2(s)
            l_i += tl.sum(p, axis=1)
            acc += dot(p.to(vt.dtype), vt, DOT)
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + dot(p.to(vt.dtype), vt, DOT)
            m_i = m_new
    if BOUNDED:
        m_i = bound
    return m_i, l_i, acc


@triton.jit
def _evo_fwd_kernel(
    Q, K, V, Bias, KeyBias, O, Mx, Lg, KNorm, KBMax, BMax,
    S, H, n_q, n_k, d, qk_scale, group_rows,
    sqb, sqs, sqh, sqn, skb, sks, skh, skn, svb, svs, svh, svn, sob, sos, soh, son,
    sbb, sbs, sbh, sbq, sbk, skb_b, skb_s, skb_k, sbm_b, sbm_s, sbm_h, sbm_q,
    HAS_BIAS: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, DOT: tl.constexpr, EVEN: tl.constexpr,
    EVEN_MN: tl.constexpr, BOUNDED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # Float arguments in float32 (torch.compile passes Python floats as float64 scalars).
    qk_scale = tl.cast(qk_scale, tl.float32)
    # Grid (query blocks, B*S*H). Traffic: q and o once; k, v (and the bias rows) once per query
    # block. Registers hold the q tile, the [BLOCK_M, BLOCK_D] float32 accumulator and one logits
    # tile; o has its own strides (the host lays it out like q), the statistics are [B*S*H, Q].
    # Program order: the GPU starts programs in launch order, so programs that run at the same time
    # are neighbours in (row r = b*S + s, query block, head) order below, rows fastest in groups of
    # `group_rows`. A bias shared by every row (triangle attention's [H, N, N] is 128 MB at N = 4096,
    # more than L2) is then read from memory about once per group instead of once per row.
    pid_m, bsh = _program_tile(
        tl.program_id(0), tl.program_id(1), tl.num_programs(0), tl.num_programs(1), group_rows, H
    )
    b, s_, h = _split_bsh(bsh, S, H)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < d
    m_ok = offs_m < n_q
    q_base = Q + b.to(tl.int64) * sqb + s_ * sqs + h * sqh
    q = _ld(q_base + offs_m[:, None] * sqn + offs_d[None, :], m_ok[:, None] & d_ok[None, :], EVEN)
    k_base = K + b.to(tl.int64) * skb + s_ * sks + h * skh
    v_base = V + b.to(tl.int64) * svb + s_ * svs + h * svh
    b_off = b.to(tl.int64) * sbb + s_ * sbs + h * sbh
    kb_off = b.to(tl.int64) * skb_b + s_ * skb_s
    bound = tl.zeros([BLOCK_M], dtype=tl.float32)
    if BOUNDED:
        # A reference at or above each row's largest logit (base 2): |q_i| max_j |k_j| scale (Cauchy-
        # Schwarz) + max_j bias_ij + max_j key_bias_j, from the host's maxima (`launch_fwd`). Rows
        # whose sum against it comes out outside [2**-60, 2**60] (the reference far above the logits,
        # an all-masked row, non-finite input) are redone with the online softmax, the whole program.
        qf = q.to(tl.float32)
        bound = tl.sqrt(tl.sum(qf * qf, axis=1)) * (tl.load(KNorm + bsh) * qk_scale)
        if HAS_BIAS:
            bm_off = b.to(tl.int64) * sbm_b + s_ * sbm_s + h * sbm_h
            bound += _ld(BMax + bm_off + offs_m * sbm_q, m_ok, EVEN_MN) * 1.4426950408889634
        if HAS_KEY_BIAS:
            bound += tl.load(KBMax + bsh // H) * 1.4426950408889634
    m_i, l_i, acc = _softmax_rows(
        q, k_base, v_base, Bias, KeyBias, offs_m, offs_d, d_ok, n_q, n_k, qk_scale, b_off, kb_off,
        sbq, sbk, skb_k, skn, svn, bound, HAS_BIAS, HAS_KEY_BIAS, DOT, EVEN, EVEN_MN, BOUNDED, BLOCK_M,
        BLOCK_N, BLOCK_D,
    )  # fmt: skip
    if BOUNDED:
        sums_ok = (l_i >= 8.673617379884035e-19) & (l_i <= 1.152921504606847e18)  # 2**-60, 2**60
        if tl.min(tl.where(m_ok & ~sums_ok, 0, 1), axis=0) == 0:
            m_i, l_i, acc = _softmax_rows(
                q, k_base, v_base, Bias, KeyBias, offs_m, offs_d, d_ok, n_q, n_k, qk_scale, b_off, kb_off,
                sbq, sbk, skb_k, skn, svn, bound, HAS_BIAS, HAS_KEY_BIAS, DOT, EVEN, EVEN_MN, False, BLOCK_M,
                BLOCK_N, BLOCK_D,
            )  # fmt: skip
    o = acc / l_i[:, None]
    o_ptrs = O + b.to(tl.int64) * sob + s_ * sos + h * soh + offs_m[:, None] * son + offs_d[None, :]
    _st(o_ptrs, o.to(O.dtype.element_ty), m_ok[:, None] & d_ok[None, :], EVEN)
    # Max and log-sum apart, not their sum: with every key masked both are about -1e9 and log(l)
    # would vanish in the float32 sum, turning p = 1/K into p = 1 in the backward.
    tl.store(Mx + bsh.to(tl.int64) * n_q + offs_m, m_i, mask=m_ok)
    tl.store(Lg + bsh.to(tl.int64) * n_q + offs_m, tl.log2(l_i), mask=m_ok)


@triton.jit
def _key_norm_kernel(
    K, Out, S, H, n_k, d, skb, sks, skh, skn,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # max_j |k_j| (float32) of one (b, s, h) slice per program: the bounded forward's Cauchy-Schwarz
    # term, one read of k (torch's vector_norm of k in float32 took 20 ms at N = 4096, H200).
    bsh = tl.program_id(0)
    b, s_, h = _split_bsh(bsh, S, H)
    base = K + b.to(tl.int64) * skb + s_ * sks + h * skh
    offs_d = tl.arange(0, BLOCK_D)
    best = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, n_k, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        ok = (offs_n < n_k)[:, None] & (offs_d < d)[None, :]
        # 64-bit: k may be a slice of a projection whose rows span more than 2**31 elements.
        kt = tl.load(base + offs_n[:, None].to(tl.int64) * skn + offs_d[None, :], mask=ok, other=0.0)
        kt = kt.to(tl.float32)
        best = tl.maximum(best, tl.sum(kt * kt, axis=1))
    tl.store(Out + bsh, tl.sqrt(tl.max(best, axis=0)))


@triton.jit
def _probs_and_dlogits(
    q, do, k_ptrs, vt_ptrs, Bias, KeyBias, offs_m, offs_n, n_q, n_k, qk_scale,
    k_ok_d, b_off, kb_off, sbq, sbk, skb_k, mx, lg, delta, btile,
    HAS_BIAS: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, DOT: tl.constexpr, EVEN: tl.constexpr,
    EVEN_MN: tl.constexpr,
    BIAS_PRELOADED: tl.constexpr,
):  # fmt: skip
    # p = softmax probabilities of one tile (0 outside the valid rows/keys) and ds = dL/dlogits
    # (of the natural logits; mx and lg are base-2 like the logits `_logits` returns).
    s = _logits(
        q, k_ptrs, Bias, KeyBias, offs_m, offs_n, n_q, n_k, qk_scale,
        k_ok_d, b_off, kb_off, sbq, sbk, skb_k, btile, 0, HAS_BIAS, HAS_KEY_BIAS, DOT, EVEN, EVEN_MN,
        BIAS_PRELOADED,
    )  # fmt: skip
    p = tl.exp2((s - mx[:, None]) - lg[:, None])
    if not EVEN_MN:
        p = tl.where((offs_m < n_q)[:, None] & (offs_n < n_k)[None, :], p, 0.0)
    vt = _ld(vt_ptrs, (offs_n < n_k)[None, :] & k_ok_d, EVEN)
    dp = dot(do, vt, DOT)
    ds = p * (dp - delta[:, None])
    return p, ds


@triton.jit
def _broadcast_row(r, tile_a, S, H, nb_s, nb_h):
    # (b, s, h, b*S*H + s*H + h) of the r-th row that bias row `tile_a` ([nb_b, nb_s, nb_h] order) is
    # broadcast over: the bias row covers every (b, s, h) equal to it where the bias is not
    # broadcast; r counts through the broadcast ones, h fastest.
    rh = H // nb_h
    rs = S // nb_s
    h = (tile_a % nb_h + r % rh).to(tl.int64)
    s_ = ((tile_a // nb_h) % nb_s + (r // rh) % rs).to(tl.int64)
    b = (tile_a // (nb_h * nb_s) + r // (rh * rs)).to(tl.int64)
    return b, s_, h, (b * S + s_) * H + h


@triton.jit
def _dkdv_tile(
    k, v, kbias, b_ptrs, bt, q_base, do_base, row0, Mx, Lg, Delta, offs_m, m_ok, n_ok, offs_d, d_ok,
    qk_scale, sqn, sdon,
    HAS_BIAS: tl.constexpr, BIAS_PRELOADED: tl.constexpr, DOT: tl.constexpr, EVEN: tl.constexpr,
    EVEN_MN: tl.constexpr,
):  # fmt: skip
    # pᵀ and dsᵀ of one (key block, query block) tile of one row, transposed ([keys, queries]) so
    # that they come out of the softmax in the layout the dv and dk products take (no register
    # transposes), with the q and do tiles those products read and the bias tile (float32, base-2
    # units; `bt` when BIAS_PRELOADED, else loaded from b_ptrs). kbias: the key bias, base 2.
    qt = _ld(q_base + offs_m[None, :] * sqn + offs_d[:, None], d_ok[:, None] & m_ok[None, :], EVEN)
    do = _ld(do_base + offs_m[:, None] * sdon + offs_d[None, :], m_ok[:, None] & d_ok[None, :], EVEN)
    mx = _ld(Mx + row0 + offs_m, m_ok, EVEN_MN)
    lg = _ld(Lg + row0 + offs_m, m_ok, EVEN_MN)
    delta = _ld(Delta + row0 + offs_m, m_ok, EVEN_MN)
    st = dot(k, qt, DOT) * qk_scale + kbias[:, None]
    if HAS_BIAS:
        if not BIAS_PRELOADED:
            bt = _ld(b_ptrs, n_ok[:, None] & m_ok[None, :], EVEN_MN).to(tl.float32) * 1.4426950408889634
        st += bt
    pt = tl.exp2((st - mx[None, :]) - lg[None, :])
    if not EVEN_MN:
        pt = tl.where(n_ok[:, None] & m_ok[None, :], pt, 0.0)
    dpt = dot(v, tl.trans(do), DOT)
    dst = pt * (dpt - delta[None, :])
    return pt, dst, qt, do, bt


@triton.jit
def _evo_bwd_kernel(
    Q, K, V, Bias, KeyBias, O, DO, Mx, Lg, Delta, DQ, DK, DV, DB,
    B, S, H, n_q, n_k, d, qk_scale, sm_scale, reps_per_split,
    sqb, sqs, sqh, sqn, skb, sks, skh, skn, svb, svs, svh, svn,
    sob, sos, soh, son, sdob, sdos, sdoh, sdon,
    sdqb, sdqs, sdqh, sdqn, sdkb, sdks, sdkh, sdkn, sdvb, sdvs, sdvh, sdvn,
    sbb, sbs, sbh, sbq, sbk, skb_b, skb_s, skb_k,
    nb_b, nb_s, nb_h,
    MODE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, DOT: tl.constexpr,
    EVEN: tl.constexpr, EVEN_MN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    # Float arguments in float32 (torch.compile passes Python floats as float64 scalars).
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    # MODE 1 (dq):     grid (query blocks, B*S*H); walks the key blocks. Runs first: it also writes
    #                  delta = rowsum(do * o), which the other passes read.
    # MODE 0 (dk, dv): grid (key blocks, B*S*H); walks the query blocks.
    # MODE 2 (dbias):  grid (query blocks * key blocks, bias B*S*H, splits); each program walks
    #                  `reps_per_split` of the B, S, H rows the bias was broadcast over, sums their
    #                  dlogits in float32 registers and writes one partial sum per split (the host
    #                  adds the splits in a fixed order: deterministic). Its bias tile is loaded once.
    # MODE 3 (dk, dv and dbias): grid (splits * key blocks * bias B*S*H,), splits fastest; a program
    #                  owns one key block of one bias row and walks `reps_per_split` of the rows the
    #                  bias was broadcast over: for each it runs MODE 0's dk/dv walk and adds the
    #                  dlogits tiles it makes anyway into its own [Q, BLOCK_N] slice of the split's
    #                  float32 partial sum (the first row stores, the others load, add and store: no
    #                  other program touches the slice, so no atomics; the host adds the splits).
    #                  ROWS = 2 walks two rows side by side (two dk/dv accumulators): one bias tile
    #                  load and one partial-sum load and store per two rows' dlogits.
    # Traffic: dq reads q, do, o once and k, v once per query block; dk/dv reads k, v once and q, do
    # once per key block; dbias reads q, k, v, do once per bias tile and writes float32 partials;
    # MODE 3 adds a load and a store of float32 partials per logit to MODE 0 (from L2 while the
    # programs' slices fit in it), with no recomputation of the logits.
    # Each tile recomputes its logits from q, k, bias, mask and the saved row statistics; o, do,
    # dq, dk, dv have strides of their own (unit along D), the statistics and
    # delta = rowsum(do * o) are [B*S*H, Q].
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < d
    n_mb = tl.cdiv(n_q, BLOCK_M)
    tile_a = tl.program_id(1)
    btile = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MODE == 2:
        pid_m = tl.program_id(0) % n_mb
        pid_n = tl.program_id(0) // n_mb
        r_lo = tl.program_id(2) * reps_per_split
        r_hi = tl.minimum(r_lo + reps_per_split, (B // nb_b) * (S // nb_s) * (H // nb_h))
        if HAS_BIAS:
            # Along its broadcast dims the bias strides are 0: one tile serves every row walked.
            b0 = (tile_a // (nb_h * nb_s)).to(tl.int64) * sbb + ((tile_a // nb_h) % nb_s).to(tl.int64) * sbs
            b0 += (tile_a % nb_h).to(tl.int64) * sbh
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            btile = _bias_tile(Bias, b0, offs_m, offs_n, n_q, n_k, sbq, sbk, EVEN_MN)
    elif MODE == 3:
        reps = (B // nb_b) * (S // nb_s) * (H // nb_h)
        splits = tl.cdiv(reps, reps_per_split)
        split = tl.program_id(0) % splits
        rest = tl.program_id(0) // splits
        n_nb = tl.cdiv(n_k, BLOCK_N)
        pid_m = 0
        pid_n = rest % n_nb
        tile_a = rest // n_nb
        r_lo = split * reps_per_split
        r_hi = tl.minimum(r_lo + reps_per_split, reps)
        # dbias partials are contiguous [splits, nb_b * nb_s * nb_h, Q, K] in float32.
        db_base = DB + (split * nb_b * nb_s * nb_h + tile_a).to(tl.int64) * n_q * n_k
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(0)
        r_lo = 0
        r_hi = 1
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r in range(r_lo, r_hi, ROWS):
        if MODE == 2 or MODE == 3:
            b, s_, h, bsh = _broadcast_row(r, tile_a, S, H, nb_s, nb_h)
        else:
            bsh = tile_a
            b, s_, h = _split_bsh(bsh, S, H)
        q_base = Q + b.to(tl.int64) * sqb + s_ * sqs + h * sqh
        k_base = K + b.to(tl.int64) * skb + s_ * sks + h * skh
        v_base = V + b.to(tl.int64) * svb + s_ * svs + h * svh
        do_base = DO + b.to(tl.int64) * sdob + s_ * sdos + h * sdoh
        b_off = b.to(tl.int64) * sbb + s_ * sbs + h * sbh
        kb_off = b.to(tl.int64) * skb_b + s_ * skb_s
        row0 = bsh.to(tl.int64) * n_q
        if MODE == 0 or MODE == 3:
            if MODE == 3:
                # The previous row's partial-sum stores, made by other threads of this program, are
                # visible to this row's loads after a barrier.
                tl.debug_barrier()
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = offs_n < n_k
            nd = n_ok[:, None] & d_ok[None, :]
            k = _ld(k_base + offs_n[:, None] * skn + offs_d[None, :], nd, EVEN)
            v = _ld(v_base + offs_n[:, None] * svn + offs_d[None, :], nd, EVEN)
            kbias = tl.zeros([BLOCK_N], dtype=tl.float32)
            if HAS_KEY_BIAS:
                kbias = _ld(KeyBias + kb_off + offs_n * skb_k, n_ok, EVEN_MN) * 1.4426950408889634
            dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            if ROWS == 2:
                # The second row; past the split's end it repeats the first, its dlogits weighted 0
                # and its dk, dv not stored.
                has1 = (tl.zeros([BLOCK_N], dtype=tl.int32) + r + 1) < r_hi
                b1, s1, h1, bsh1 = _broadcast_row(tl.minimum(r + 1, r_hi - 1), tile_a, S, H, nb_s, nb_h)
                q_base1 = Q + b1 * sqb + s1 * sqs + h1 * sqh
                do_base1 = DO + b1 * sdob + s1 * sdos + h1 * sdoh
                k1 = _ld(
                    K + b1 * skb + s1 * sks + h1 * skh + offs_n[:, None] * skn + offs_d[None, :], nd, EVEN
                )
                v1 = _ld(
                    V + b1 * svb + s1 * svs + h1 * svh + offs_n[:, None] * svn + offs_d[None, :], nd, EVEN
                )
                kbias1 = tl.zeros([BLOCK_N], dtype=tl.float32)
                if HAS_KEY_BIAS:
                    kb_ptrs1 = KeyBias + b1 * skb_b + s1 * skb_s + offs_n * skb_k
                    kbias1 = _ld(kb_ptrs1, n_ok, EVEN_MN) * 1.4426950408889634
                w1 = tl.where(has1, 1.0, 0.0)[:, None]
                dk1 = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
                dv1 = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            for start in range(0, n_q, BLOCK_M):
                offs_m = start + tl.arange(0, BLOCK_M)
                m_ok = offs_m < n_q
                b_ptrs = Bias
                if HAS_BIAS:
                    b_ptrs = Bias + b_off + offs_n[:, None] * sbk + offs_m[None, :] * sbq
                pt, dst, qt, do, bt = _dkdv_tile(
                    k, v, kbias, b_ptrs, 0.0, q_base, do_base, row0, Mx, Lg, Delta, offs_m, m_ok, n_ok,
                    offs_d, d_ok, qk_scale, sqn, sdon, HAS_BIAS, False, DOT, EVEN, EVEN_MN,
                )  # fmt: skip
                dv += dot(pt.to(do.dtype), do, DOT)
                dk += dot(dst.to(do.dtype), tl.trans(qt), DOT)
                if ROWS == 2:
                    # Every row a MODE 3 program walks shares the bias tile (the bias strides are 0
                    # along the dims it is broadcast over).
                    pt1, dst1, qt1, do1, _ = _dkdv_tile(
                        k1, v1, kbias1, b_ptrs, bt, q_base1, do_base1, bsh1 * n_q, Mx, Lg, Delta, offs_m,
                        m_ok, n_ok, offs_d, d_ok, qk_scale, sqn, sdon, HAS_BIAS, True, DOT, EVEN, EVEN_MN,
                    )  # fmt: skip
                    dv1 += dot(pt1.to(do1.dtype), do1, DOT)
                    dk1 += dot(dst1.to(do1.dtype), tl.trans(qt1), DOT)
                    dst += dst1 * w1
                if MODE == 3:
                    db_ptrs = db_base + offs_m[None, :] * n_k + offs_n[:, None]
                    # The split's first row stores (its load is masked off: the slice starts unset).
                    later = (tl.zeros([BLOCK_M], dtype=tl.int32) + r) > r_lo
                    if EVEN_MN:
                        prev = tl.load(db_ptrs, mask=later[None, :], other=0.0)
                        tl.store(db_ptrs, prev + dst)
                    else:
                        ok = n_ok[:, None] & m_ok[None, :]
                        prev = tl.load(db_ptrs, mask=ok & later[None, :], other=0.0)
                        tl.store(db_ptrs, prev + dst, mask=ok)
            dk_ptrs = DK + b.to(tl.int64) * sdkb + s_ * sdks + h * sdkh + offs_n[:, None] * sdkn
            dv_ptrs = DV + b.to(tl.int64) * sdvb + s_ * sdvs + h * sdvh + offs_n[:, None] * sdvn
            _st(dk_ptrs + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty), nd, EVEN)
            _st(dv_ptrs + offs_d[None, :], dv.to(DV.dtype.element_ty), nd, EVEN)
            if ROWS == 2:
                nd1 = nd & has1[:, None]
                dk_ptrs1 = DK + b1 * sdkb + s1 * sdks + h1 * sdkh + offs_n[:, None] * sdkn + offs_d[None, :]
                dv_ptrs1 = DV + b1 * sdvb + s1 * sdvs + h1 * sdvh + offs_n[:, None] * sdvn + offs_d[None, :]
                tl.store(dk_ptrs1, (dk1 * sm_scale).to(DK.dtype.element_ty), mask=nd1)
                tl.store(dv_ptrs1, dv1.to(DV.dtype.element_ty), mask=nd1)
        else:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            m_ok = offs_m < n_q
            md = m_ok[:, None] & d_ok[None, :]
            q = _ld(q_base + offs_m[:, None] * sqn + offs_d[None, :], md, EVEN)
            do = _ld(do_base + offs_m[:, None] * sdon + offs_d[None, :], md, EVEN)
            mx = _ld(Mx + row0 + offs_m, m_ok, EVEN_MN)
            lg = _ld(Lg + row0 + offs_m, m_ok, EVEN_MN)
            if MODE == 1:
                o_base = O + b.to(tl.int64) * sob + s_ * sos + h * soh
                o = _ld(o_base + offs_m[:, None] * son + offs_d[None, :], md, EVEN)
                delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
                _st(Delta + row0 + offs_m, delta, m_ok, EVEN_MN)
            else:
                delta = _ld(Delta + row0 + offs_m, m_ok, EVEN_MN)
            if MODE == 1:
                dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
                for start in range(0, n_k, BLOCK_N):
                    offs_n = start + tl.arange(0, BLOCK_N)
                    k_ptrs = k_base + offs_n[None, :] * skn + offs_d[:, None]
                    vt_ptrs = v_base + offs_n[None, :] * svn + offs_d[:, None]
                    p, ds = _probs_and_dlogits(
                        q, do, k_ptrs, vt_ptrs, Bias, KeyBias, offs_m, offs_n, n_q, n_k, qk_scale,
                        d_ok[:, None], b_off, kb_off, sbq, sbk, skb_k, mx, lg, delta, 0,
                        HAS_BIAS, HAS_KEY_BIAS, DOT, EVEN, EVEN_MN, False,
                    )  # fmt: skip
                    kt = _ld(k_ptrs, (offs_n < n_k)[None, :] & d_ok[:, None], EVEN)
                    dq += dot(ds.to(kt.dtype), tl.trans(kt), DOT)
                dq_base = DQ + b.to(tl.int64) * sdqb + s_ * sdqs + h * sdqh
                dq_ptrs = dq_base + offs_m[:, None] * sdqn + offs_d[None, :]
                _st(dq_ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), md, EVEN)
            else:
                offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                k_ptrs = k_base + offs_n[None, :] * skn + offs_d[:, None]
                vt_ptrs = v_base + offs_n[None, :] * svn + offs_d[:, None]
                p, ds = _probs_and_dlogits(
                    q, do, k_ptrs, vt_ptrs, Bias, KeyBias, offs_m, offs_n, n_q, n_k, qk_scale,
                    d_ok[:, None], b_off, kb_off, sbq, sbk, skb_k, mx, lg, delta, btile,
                    HAS_BIAS, HAS_KEY_BIAS, DOT, EVEN, EVEN_MN, True,
                )  # fmt: skip
                acc += ds
    if MODE == 2:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = (offs_m < n_q)[:, None] & (offs_n < n_k)[None, :]
        # dbias partials are contiguous [splits, nb_b * nb_s * nb_h, Q, K] in float32.
        db_base = DB + (tl.program_id(2) * tl.num_programs(1) + tile_a).to(tl.int64) * n_q * n_k
        _st(db_base + offs_m[:, None] * n_k + offs_n[None, :], acc, ok, EVEN_MN)
