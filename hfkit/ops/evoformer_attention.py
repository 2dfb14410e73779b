"""Evoformer attention: flash-style Triton kernels (forward and backward), a torch custom op, the reference.

`evoformer_attention(q, k, v, bias, mask)` computes `softmax(q·kᵀ/√D + bias + (mask - 1)·1e9)·v` for
q: [B, S, H, Q, D], k/v: [B, S, H, K, D], a pair bias broadcast over MSA rows ([B, 1, H, Q, K]) and a
key mask ([B, S, 1, 1, K] or [B, S, K]): MSA row attention with pair bias, and with S = 1 or no bias
the other Evoformer attentions. The forward keeps no [Q, K] logits: it walks key blocks with an online
softmax and saves two float32 numbers per query row (the running max and the log of the sum). The
backward recomputes the probabilities block by block from them: one kernel for dk/dv (a program per
key block), one for dq (a program per query block) and one for dbias (a program per bias tile, which
loops over the S rows the bias was broadcast over: deterministic, no atomics). Registered as the custom
ops `hfkit::evoformer_attention_fwd` / `_bwd`; on CPU without `TRITON_INTERPRET=1` it runs
`evoformer_attention_reference`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from hfkit.ops._triton import HAS_TRITON, dot_mode, hfkit_op, num_sms, triton_can_run
from hfkit.ops.softmax import MASK_INF

if HAS_TRITON:
    import triton
    import triton.language as tl
    from torch.library import wrap_triton

    from hfkit.ops._triton import dot

__all__ = ["MAX_HEAD_DIM", "evoformer_attention", "evoformer_attention_reference", "uses_triton"]

LOG2E = 1.4426950408889634  # the kernels work in base 2: exp2(x * log2(e)) = exp(x)

# Head dims up to this are padded to a power of two (at least 16, the smallest tl.dot size).
MAX_HEAD_DIM = 128


class Config(NamedTuple):
    """Tiles of one kernel pass: rows of queries and keys per tile, padded head dim, warps, stages."""

    block_m: int
    block_n: int
    block_d: int
    warps: int
    stages: int


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per pass on CUDA, for padded head dims <= 32 and above;
# from `python -m hfkit.bench.tune_attention` on an H200 (data/results/h200/tuning/attention.json).
CONFIGS_SMALL_D: dict[str, tuple[int, int, int, int]] = {
    "fwd": (128, 32, 4, 3),
    "dkdv": (32, 128, 4, 3),
    "dq": (64, 32, 4, 3),
    "dbias": (128, 64, 4, 2),
}
CONFIGS_LARGE_D: dict[str, tuple[int, int, int, int]] = {
    "fwd": (64, 64, 4, 2),
    "dkdv": (32, 32, 4, 2),
    "dq": (32, 32, 4, 2),
    "dbias": (32, 32, 4, 2),
}
# Set by the tuning sweep only: pass -> (BLOCK_M, BLOCK_N, num_warps, num_stages) for every head dim.
CONFIG_OVERRIDE: dict[str, tuple[int, int, int, int]] = {}


def evoformer_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch Evoformer attention: the specification every fast path is tested against.

    q: [B, S, H, Q, D], k, v: [B, S, H, K, D]; bias: broadcastable to [B, S, H, Q, K]; mask:
    [B, S, K] or broadcastable to [B, S, 1, 1, K], bool or 0/1 (1 = keep). Computes
    `softmax(q·kᵀ/√D + bias + (mask - 1)·1e9)·v` in float32 (float64 for float64 input), returned in
    q's dtype. The mask bias is OpenFold's finite `inf = 1e9`, so a query row whose keys are all masked
    gets (nearly) uniform weights in float32, the mean of v, never NaN. key_bias: [B|1, S|1, K], an
    additive bias per key (e.g. OpenFold's mask bias `1e9 * (mask - 1)`), added last.
    """
    compute = torch.promote_types(q.dtype, torch.float32)
    scale = 1.0 / math.sqrt(q.shape[-1])
    a = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * scale
    if bias is not None:
        a = a + bias.to(compute)
    if mask is not None:
        a = a + (_mask_5d(mask, q).to(compute) - 1.0) * MASK_INF
    if key_bias is not None:
        a = a + key_bias[:, :, None, None, :].to(compute)
    return torch.matmul(torch.softmax(a, dim=-1), v.to(compute)).to(q.dtype)


def _mask_5d(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return mask[:, :, None, None, :] if mask.dim() == 3 and q.dim() == 5 else mask


def _check_inputs(q, k, v, bias, mask) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 5:
            raise ValueError(f"{name}: expected 5 dims [B, S, H, N, D], got shape {list(t.shape)}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name}: expected a floating-point dtype, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, but q is on {q.device}; put them on one device")
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
    b, s, h, n_q, d = q.shape
    n_k = k.shape[3]
    if tuple(k.shape) != (b, s, h, n_k, d):
        raise ValueError(f"k: expected shape [{b}, {s}, {h}, K, {d}] to match q, got {list(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: expected k's shape {list(k.shape)}, got {list(v.shape)}")
    logits = (b, s, h, n_q, n_k)
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise ValueError(f"bias: expected a torch.Tensor or None, got {type(bias).__name__}")
        if not bias.dtype.is_floating_point:
            raise ValueError(f"bias: expected a floating-point dtype, got {bias.dtype}")
        if bias.device != q.device:
            raise ValueError(f"bias: on {bias.device}, but q is on {q.device}; put them on one device")
        if bias.dim() != 5 or any(x not in (1, y) for x, y in zip(bias.shape, logits, strict=True)):
            raise ValueError(
                f"bias: expected shape [B|1, S|1, H|1, Q|1, K|1] broadcastable to {list(logits)}, "
                f"got {list(bias.shape)}"
            )
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise ValueError(f"mask: expected a torch.Tensor or None, got {type(mask).__name__}")
        if mask.device != q.device:
            raise ValueError(f"mask: on {mask.device}, but q is on {q.device}; put them on one device")
        ok = (mask.dim() == 3 and _bcast(mask.shape, (b, s, n_k))) or (
            mask.dim() == 5 and mask.shape[2:4] == (1, 1) and _bcast(mask.shape, (b, s, 1, 1, n_k))
        )
        if not ok:
            raise ValueError(
                f"mask: expected shape [B, S, K] or [B, S, 1, 1, K] (B, S may be 1) with B={b}, S={s}, "
                f"K={n_k}, got {list(mask.shape)}"
            )


def _bcast(shape, target) -> bool:
    return all(x in (1, y) for x, y in zip(shape, target, strict=True))


def uses_triton(q: torch.Tensor) -> bool:
    """Whether `evoformer_attention` takes the Triton path for q (CUDA, or CPU under
    TRITON_INTERPRET=1 outside torch.compile; float32/bfloat16/float16; head dim ≤ `MAX_HEAD_DIM`)."""
    return q.shape[-1] <= MAX_HEAD_DIM and triton_can_run(q)


def evoformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused, memory-efficient `softmax(q·kᵀ/√D + bias + (mask - 1)·1e9)·v`, with autograd.

    q: [B, S, H, Q, D], k, v: [B, S, H, K, D] (float32, bfloat16 or float16, one dtype; any strides),
    D ≤ 128 (16, 32, 64, 128 need no padding); bias: [B|1, S|1, H|1, Q|1, K|1], e.g. a pair bias
    [B, 1, H, Q, K], any floating dtype, its gradient summed over broadcast dims; mask: [B, S, K] or
    [B, S, 1, 1, K] (B, S may be 1), bool or 0/1, 1 = keep, no gradient; key_bias: [B|1, S|1, K], an
    additive float bias per key such as OpenFold's mask bias `1e9 * (mask - 1)` (no gradient: one
    that requires grad raises ValueError). Scale 1/√D applied inside; softmax statistics and
    accumulation in float32; output [B, S, H, Q, D] in q's dtype. Raises ValueError naming the
    argument on bad shapes, dtypes or devices.
    """
    _check_inputs(q, k, v, bias, mask)
    _check_key_bias(key_bias, q, k)
    if not uses_triton(q) or q.numel() == 0 or k.shape[3] == 0:
        return evoformer_attention_reference(q, k, v, bias, mask, key_bias=key_bias)
    # The kernels take one additive float32 key bias [B|1, S|1, K]: the mask's and key_bias's sum.
    add = None
    if mask is not None:
        if mask.dim() == 5:
            mask = mask[:, :, 0, 0, :]
        add = (mask.detach().to(torch.float32) - 1.0) * MASK_INF
    if key_bias is not None:
        add = key_bias.to(torch.float32) if add is None else add + key_bias.to(torch.float32)
    # A unit key stride lets the kernels load bias rows as vectors (Triton specializes a stride of 1);
    # a pair bias that is a permuted view of the pair projection (key stride H, as in the Evoformer)
    # would be gathered element by element on every one of its S re-reads. One copy is cheap beside
    # that. (Expected from the kernels' code; not yet timed in the model on a GPU.)
    bias, add = _unit_key_stride(bias), _unit_key_stride(add)
    o, _, _ = _evo_fwd(q, k, v, bias, add)
    return o


def _unit_key_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or t.shape[-1] == 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


def _check_key_bias(key_bias: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> None:
    if key_bias is None:
        return
    if not isinstance(key_bias, torch.Tensor):
        raise ValueError(f"key_bias: expected a torch.Tensor or None, got {type(key_bias).__name__}")
    if not key_bias.dtype.is_floating_point:
        raise ValueError(f"key_bias: expected a floating-point dtype, got {key_bias.dtype}")
    if key_bias.device != q.device:
        raise ValueError(f"key_bias: on {key_bias.device}, but q is on {q.device}; put them on one device")
    b, s, _, _, _ = q.shape
    if key_bias.dim() != 3 or not _bcast(key_bias.shape, (b, s, k.shape[3])):
        raise ValueError(
            f"key_bias: expected shape [B|1, S|1, K] with B={b}, S={s}, K={k.shape[3]}, "
            f"got {list(key_bias.shape)}"
        )
    if key_bias.requires_grad:
        raise ValueError("key_bias: gets no gradient from evoformer_attention, but requires grad; detach it")


def _bias_strides(bias: torch.Tensor | None) -> list[int]:
    # Strides over [B, S, H, Q, K], 0 along broadcast dims.
    if bias is None:
        return [0] * 5
    return [st if sz != 1 else 0 for st, sz in zip(bias.stride(), bias.shape, strict=True)]


def _key_bias_strides(key_bias: torch.Tensor | None) -> list[int]:
    # Strides over [B, S, K], 0 along broadcast dims.
    if key_bias is None:
        return [0] * 3
    return [st if sz != 1 else 0 for st, sz in zip(key_bias.stride(), key_bias.shape, strict=True)]


if HAS_TRITON:

    @triton.jit
    def _ld(ptrs, mask, EVEN: tl.constexpr):
        # EVEN: every tile is full (no ragged rows, keys or head dims), so no load needs a mask.
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
    def _bias_tile(Bias, b_off, offs_m, offs_n, n_q, n_k, sbq, sbk, EVEN: tl.constexpr):
        ok = (offs_m < n_q)[:, None] & (offs_n < n_k)[None, :]
        return _ld(Bias + b_off + offs_m[:, None] * sbq + offs_n[None, :] * sbk, ok, EVEN).to(tl.float32)

    @triton.jit
    def _logits(
        q, k_ptrs, Bias, KeyBias, offs_m, offs_n, n_q, n_k, qk_scale,
        k_ok_d, b_off, kb_off, sbq, sbk, skb_k, btile,
        HAS_BIAS: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, DOT: tl.constexpr, EVEN: tl.constexpr,
        BIAS_PRELOADED: tl.constexpr,
    ):  # fmt: skip
        # One [BLOCK_M, BLOCK_N] tile of logits in float32, in base-2 units (natural logits times
        # log2(e): qk_scale includes it, so the softmax is a bare exp2); keys past n_k are -inf.
        # BIAS_PRELOADED: `btile` holds this tile's bias already (float32), else it is loaded here.
        k_ok = offs_n < n_k
        kt = _ld(k_ptrs, k_ok[None, :] & k_ok_d, EVEN)
        # (float32 explicitly: under torch.compile, Inductor may pass the scale as a float64 scalar.)
        s = (dot(q, kt, DOT) * qk_scale).to(tl.float32)
        if HAS_BIAS or HAS_KEY_BIAS:
            t = tl.zeros_like(s)
            if HAS_BIAS:
                if BIAS_PRELOADED:
                    t = btile
                else:
                    t = _bias_tile(Bias, b_off, offs_m, offs_n, n_q, n_k, sbq, sbk, EVEN)
            if HAS_KEY_BIAS:
                t += _ld(KeyBias + kb_off + offs_n * skb_k, k_ok, EVEN)[None, :]
            s += t * 1.4426950408889634  # LOG2E
        if not EVEN:
            s = tl.where(k_ok[None, :], s, float("-inf"))
        return s

    @triton.jit
    def _evo_fwd_kernel(
        Q, K, V, Bias, KeyBias, O, Mx, Lg,
        S, H, n_q, n_k, d, qk_scale,
        sqb, sqs, sqh, sqn, skb, sks, skh, skn, svb, svs, svh, svn, sob, sos, soh, son,
        sbb, sbs, sbh, sbq, sbk, skb_b, skb_s, skb_k,
        HAS_BIAS: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, DOT: tl.constexpr, EVEN: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # Grid (query blocks, B*S*H). Traffic: q and o once; k, v (and the bias rows) once per query
        # block. Registers hold the q tile, the [BLOCK_M, BLOCK_D] float32 accumulator and one logits
        # tile; o has its own strides (the host lays it out like q), the statistics are [B*S*H, Q].
        pid_m = tl.program_id(0)
        bsh = tl.program_id(1)
        h = bsh % H
        s_ = (bsh // H) % S
        b = bsh // (H * S)
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
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for start in range(0, n_k, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k_ptrs = k_base + offs_n[None, :] * skn + offs_d[:, None]
            s = _logits(
                q, k_ptrs, Bias, KeyBias, offs_m, offs_n, n_q, n_k, qk_scale,
                d_ok[:, None], b_off, kb_off, sbq, sbk, skb_k, 0, HAS_BIAS, HAS_KEY_BIAS, DOT, EVEN, False,
            )  # fmt: skip
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = _ld(
                v_base + offs_n[:, None] * svn + offs_d[None, :],
                (offs_n < n_k)[:, None] & d_ok[None, :],
                EVEN,
            )
            acc = acc * alpha[:, None] + dot(p.to(vt.dtype), vt, DOT)
            m_i = m_new
        o = acc / l_i[:, None]
        o_ptrs = O + b.to(tl.int64) * sob + s_ * sos + h * soh + offs_m[:, None] * son + offs_d[None, :]
        _st(o_ptrs, o.to(O.dtype.element_ty), m_ok[:, None] & d_ok[None, :], EVEN)
        # Max and log-sum apart, not their sum: with every key masked both are about -1e9 and log(l)
        # would vanish in the float32 sum, turning p = 1/K into p = 1 in the backward.
        tl.store(Mx + bsh.to(tl.int64) * n_q + offs_m, m_i, mask=m_ok)
        tl.store(Lg + bsh.to(tl.int64) * n_q + offs_m, tl.log2(l_i), mask=m_ok)

    @triton.jit
    def _probs_and_dlogits(
        q, do, k_ptrs, vt_ptrs, Bias, KeyBias, offs_m, offs_n, n_q, n_k, qk_scale,
        k_ok_d, b_off, kb_off, sbq, sbk, skb_k, mx, lg, delta, btile,
        HAS_BIAS: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, DOT: tl.constexpr, EVEN: tl.constexpr,
        BIAS_PRELOADED: tl.constexpr,
    ):  # fmt: skip
        # p = softmax probabilities of one tile (0 outside the valid rows/keys) and ds = dL/dlogits
        # (of the natural logits; mx and lg are base-2 like the logits `_logits` returns).
        s = _logits(
            q, k_ptrs, Bias, KeyBias, offs_m, offs_n, n_q, n_k, qk_scale,
            k_ok_d, b_off, kb_off, sbq, sbk, skb_k, btile, HAS_BIAS, HAS_KEY_BIAS, DOT, EVEN, BIAS_PRELOADED,
        )  # fmt: skip
        p = tl.exp2((s - mx[:, None]) - lg[:, None])
        if not EVEN:
            p = tl.where((offs_m < n_q)[:, None] & (offs_n < n_k)[None, :], p, 0.0)
        vt = _ld(vt_ptrs, (offs_n < n_k)[None, :] & k_ok_d, EVEN)
        dp = dot(do, vt, DOT)
        ds = p * (dp - delta[:, None])
        return p, ds

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
        EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        # MODE 1 (dq):     grid (query blocks, B*S*H); walks the key blocks. Runs first: it also writes
        #                  delta = rowsum(do * o), which the other two passes read.
        # MODE 0 (dk, dv): grid (key blocks, B*S*H); walks the query blocks.
        # MODE 2 (dbias):  grid (query blocks * key blocks, bias B*S*H, splits); each program walks
        #                  `reps_per_split` of the B, S, H rows the bias was broadcast over, sums their
        #                  dlogits in float32 registers and writes one partial sum per split (the host
        #                  adds the splits in a fixed order: deterministic). Its bias tile is loaded once.
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
                b0 = (tile_a // (nb_h * nb_s)).to(tl.int64) * sbb + ((tile_a // nb_h) % nb_s) * sbs
                b0 += (tile_a % nb_h) * sbh
                offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
                offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                btile = _bias_tile(Bias, b0, offs_m, offs_n, n_q, n_k, sbq, sbk, EVEN)
        else:
            pid_m = tl.program_id(0)
            pid_n = tl.program_id(0)
            r_lo = 0
            r_hi = 1
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for r in range(r_lo, r_hi):
            if MODE == 2:
                # Bias row (bb, sb, hb) covers every (b, s, h) equal to it where the bias is not
                # broadcast; r counts through the broadcast ones.
                hb = tile_a % nb_h
                sb = (tile_a // nb_h) % nb_s
                bb = tile_a // (nb_h * nb_s)
                rh = H // nb_h
                rs = S // nb_s
                h = hb + r % rh
                s_ = sb + (r // rh) % rs
                b = bb + r // (rh * rs)
                bsh = (b * S + s_) * H + h
            else:
                bsh = tile_a
                h = bsh % H
                s_ = (bsh // H) % S
                b = bsh // (H * S)
            q_base = Q + b.to(tl.int64) * sqb + s_ * sqs + h * sqh
            k_base = K + b.to(tl.int64) * skb + s_ * sks + h * skh
            v_base = V + b.to(tl.int64) * svb + s_ * svs + h * svh
            do_base = DO + b.to(tl.int64) * sdob + s_ * sdos + h * sdoh
            b_off = b.to(tl.int64) * sbb + s_ * sbs + h * sbh
            kb_off = b.to(tl.int64) * skb_b + s_ * skb_s
            row0 = bsh.to(tl.int64) * n_q
            if MODE == 0:
                offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                n_ok = offs_n < n_k
                dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
                dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
                # Transposed tiles [keys, queries] throughout, so that pᵀ and dsᵀ come out of the
                # softmax in the layout the dv and dk products take (no register transposes).
                nd = n_ok[:, None] & d_ok[None, :]
                k = _ld(k_base + offs_n[:, None] * skn + offs_d[None, :], nd, EVEN)
                v = _ld(v_base + offs_n[:, None] * svn + offs_d[None, :], nd, EVEN)
                kbias = tl.zeros([BLOCK_N], dtype=tl.float32)
                if HAS_KEY_BIAS:
                    kbias = _ld(KeyBias + kb_off + offs_n * skb_k, n_ok, EVEN) * 1.4426950408889634
                for start in range(0, n_q, BLOCK_M):
                    offs_m = start + tl.arange(0, BLOCK_M)
                    m_ok = offs_m < n_q
                    qt = _ld(
                        q_base + offs_m[None, :] * sqn + offs_d[:, None], d_ok[:, None] & m_ok[None, :], EVEN
                    )
                    do = _ld(
                        do_base + offs_m[:, None] * sdon + offs_d[None, :],
                        m_ok[:, None] & d_ok[None, :],
                        EVEN,
                    )
                    mx = _ld(Mx + row0 + offs_m, m_ok, EVEN)
                    lg = _ld(Lg + row0 + offs_m, m_ok, EVEN)
                    delta = _ld(Delta + row0 + offs_m, m_ok, EVEN)
                    st = (dot(k, qt, DOT) * qk_scale).to(tl.float32) + kbias[:, None]
                    if HAS_BIAS:
                        ok = n_ok[:, None] & m_ok[None, :]
                        b_ptrs = Bias + b_off + offs_n[:, None] * sbk + offs_m[None, :] * sbq
                        st += _ld(b_ptrs, ok, EVEN).to(tl.float32) * 1.4426950408889634
                    pt = tl.exp2((st - mx[None, :]) - lg[None, :])
                    if not EVEN:
                        pt = tl.where(n_ok[:, None] & m_ok[None, :], pt, 0.0)
                    dpt = dot(v, tl.trans(do), DOT)
                    dst = pt * (dpt - delta[None, :])
                    dv += dot(pt.to(do.dtype), do, DOT)
                    dk += dot(dst.to(do.dtype), tl.trans(qt), DOT)
                dk_ptrs = DK + b.to(tl.int64) * sdkb + s_ * sdks + h * sdkh + offs_n[:, None] * sdkn
                dv_ptrs = DV + b.to(tl.int64) * sdvb + s_ * sdvs + h * sdvh + offs_n[:, None] * sdvn
                _st(dk_ptrs + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty), nd, EVEN)
                _st(dv_ptrs + offs_d[None, :], dv.to(DV.dtype.element_ty), nd, EVEN)
            else:
                offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
                m_ok = offs_m < n_q
                md = m_ok[:, None] & d_ok[None, :]
                q = _ld(q_base + offs_m[:, None] * sqn + offs_d[None, :], md, EVEN)
                do = _ld(do_base + offs_m[:, None] * sdon + offs_d[None, :], md, EVEN)
                mx = _ld(Mx + row0 + offs_m, m_ok, EVEN)
                lg = _ld(Lg + row0 + offs_m, m_ok, EVEN)
                if MODE == 1:
                    o_base = O + b.to(tl.int64) * sob + s_ * sos + h * soh
                    o = _ld(o_base + offs_m[:, None] * son + offs_d[None, :], md, EVEN)
                    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
                    _st(Delta + row0 + offs_m, delta, m_ok, EVEN)
                else:
                    delta = _ld(Delta + row0 + offs_m, m_ok, EVEN)
                if MODE == 1:
                    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
                    for start in range(0, n_k, BLOCK_N):
                        offs_n = start + tl.arange(0, BLOCK_N)
                        k_ptrs = k_base + offs_n[None, :] * skn + offs_d[:, None]
                        vt_ptrs = v_base + offs_n[None, :] * svn + offs_d[:, None]
                        p, ds = _probs_and_dlogits(
                            q, do, k_ptrs, vt_ptrs, Bias, KeyBias, offs_m, offs_n, n_q, n_k, qk_scale,
                            d_ok[:, None], b_off, kb_off, sbq, sbk, skb_k, mx, lg, delta, 0,
                            HAS_BIAS, HAS_KEY_BIAS, DOT, EVEN, False,
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
                        HAS_BIAS, HAS_KEY_BIAS, DOT, EVEN, True,
                    )  # fmt: skip
                    acc += ds
        if MODE == 2:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = (offs_m < n_q)[:, None] & (offs_n < n_k)[None, :]
            # dbias partials are contiguous [splits, nb_b * nb_s * nb_h, Q, K] in float32.
            db_base = DB + (tl.program_id(2) * tl.num_programs(1) + tile_a).to(tl.int64) * n_q * n_k
            _st(db_base + offs_m[:, None] * n_k + offs_n[None, :], acc, ok, EVEN)

    def _config(pass_: str, d: int, device: torch.device) -> Config:
        """Tile configuration of one kernel pass ('fwd', 'dkdv', 'dq', 'dbias') for head dim d."""
        block_d = max(16, triton.next_power_of_2(d))
        if device.type != "cuda":
            return Config(32, 32, block_d, 4, 1)  # small tiles so that tests cross block edges cheaply
        if pass_ in CONFIG_OVERRIDE:
            bm, bn, warps, stages = CONFIG_OVERRIDE[pass_]
            return Config(bm, bn, block_d, warps, stages)
        table = CONFIGS_SMALL_D if block_d <= 32 else CONFIGS_LARGE_D
        bm, bn, warps, stages = table[pass_]
        return Config(bm, bn, block_d, warps, stages)

    def _qkv_strides(t: torch.Tensor) -> list[int]:
        return list(t.stride()[:4])

    def _unit_last(t: torch.Tensor) -> torch.Tensor:
        return t if t.stride(-1) == 1 else t.contiguous()

    def _even(n_q: int, n_k: int, d: int, cfg: Config) -> bool:
        return n_q % cfg.block_m == 0 and n_k % cfg.block_n == 0 and d == cfg.block_d

    def launch_fwd(q, k, v, bias, key_bias, o, mx, lg, cfg: Config) -> None:
        """Run the forward kernel with tiles `cfg` (q, k, v with unit-stride rows; o, mx, lg outputs)."""
        b, s, h, n_q, d = q.shape
        n_k = k.shape[3]
        wrap_triton(_evo_fwd_kernel)[(triton.cdiv(n_q, cfg.block_m), b * s * h)](
            q, k, v, bias, key_bias, o, mx, lg,
            s, h, n_q, n_k, d, LOG2E / math.sqrt(d),
            *_qkv_strides(q), *_qkv_strides(k), *_qkv_strides(v), *_qkv_strides(o),
            *_bias_strides(bias), *_key_bias_strides(key_bias),
            HAS_BIAS=bias is not None, HAS_KEY_BIAS=key_bias is not None, DOT=dot_mode(q),
            EVEN=_even(n_q, n_k, d, cfg), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip

    _MODES = {"dkdv": 0, "dq": 1, "dbias": 2}

    def launch_bwd(pass_, q, k, v, bias, key_bias, o, do, mx, lg, delta, dq, dk, dv, db, cfg: Config) -> None:
        """Run one backward pass ('dq', then 'dkdv' and 'dbias') with tiles `cfg`; db: float32
        [splits, nb_b, nb_s, nb_h, Q, K] partial sums (or a dummy when there is no bias gradient)."""
        b, s, h, n_q, d = q.shape
        n_k = k.shape[3]
        n_mb, n_nb = triton.cdiv(n_q, cfg.block_m), triton.cdiv(n_k, cfg.block_n)
        nb = list(db.shape[1:4]) if db.dim() == 6 else [1, 1, 1]
        splits = db.shape[0] if db.dim() == 6 else 1
        reps = (b // nb[0]) * (s // nb[1]) * (h // nb[2])
        grid = {
            "dkdv": (n_nb, b * s * h, 1),
            "dq": (n_mb, b * s * h, 1),
            "dbias": (n_mb * n_nb, nb[0] * nb[1] * nb[2], splits),
        }[pass_]
        wrap_triton(_evo_bwd_kernel)[grid](
            q, k, v, bias, key_bias, o, do, mx, lg, delta, dq, dk, dv, db,
            b, s, h, n_q, n_k, d, LOG2E / math.sqrt(d), 1.0 / math.sqrt(d), triton.cdiv(reps, splits),
            *_qkv_strides(q), *_qkv_strides(k), *_qkv_strides(v),
            *_qkv_strides(o), *_qkv_strides(do),
            *_qkv_strides(dq), *_qkv_strides(dk), *_qkv_strides(dv),
            *_bias_strides(bias), *_key_bias_strides(key_bias),
            *nb,
            MODE=_MODES[pass_], HAS_BIAS=bias is not None, HAS_KEY_BIAS=key_bias is not None,
            DOT=dot_mode(q), EVEN=_even(n_q, n_k, d, cfg),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip

    def dbias_splits(reps: int, tiles: int, device: torch.device) -> int:
        """How many programs share the walk over the `reps` broadcast rows of each of `tiles` dbias
        tiles: enough for about four programs per SM, each walking at least 16 rows."""
        if device.type != "cuda":
            return min(reps, 2)  # the interpreter: exercise the partial sums cheaply
        want = triton.cdiv(4 * num_sms(device), max(1, tiles))
        per = max(16, triton.cdiv(reps, want))
        return triton.cdiv(reps, per)

    @hfkit_op("evoformer_attention_fwd")
    def _evo_fwd(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        key_bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
        b, s, h, n_q, d = q.shape
        # o, dq, dk, dv are laid out like q, k, v (empty_like keeps a dense tensor's strides): a model
        # that made q as a [B, S, Q, H, D] projection viewed as [B, S, H, Q, D] gets o back in that
        # memory order, so flattening the heads after the op needs no copy; gradients likewise.
        o = torch.empty_like(q)
        mx = torch.empty((b, s, h, n_q), dtype=torch.float32, device=q.device)
        lg = torch.empty_like(mx)
        launch_fwd(q, k, v, bias, key_bias, o, mx, lg, _config("fwd", d, q.device))
        return o, mx, lg

    @hfkit_op("evoformer_attention_bwd")
    def _evo_bwd(
        do: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        key_bias: torch.Tensor | None,
        o: torch.Tensor,
        mx: torch.Tensor,
        lg: torch.Tensor,
        need_dbias: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns dq, dk, dv (q's dtype) and dbias in float32 with bias's shape ([0] if not needed)."""
        q, k, v, do = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(do)
        b, s, h, n_q, d = q.shape
        n_k = k.shape[3]
        delta = torch.empty((b, s, h, n_q), dtype=torch.float32, device=q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        args = (q, k, v, bias, key_bias, o, do, mx, lg, delta, dq, dk, dv)
        dummy = torch.empty((0,), dtype=torch.float32, device=q.device)
        launch_bwd("dq", *args, dummy, _config("dq", d, q.device))
        launch_bwd("dkdv", *args, dummy, _config("dkdv", d, q.device))
        if not (need_dbias and bias is not None):
            return dq, dk, dv, dummy
        nb = list(bias.shape[:3])
        cfg = _config("dbias", d, q.device)
        tiles = triton.cdiv(n_q, cfg.block_m) * triton.cdiv(n_k, cfg.block_n) * nb[0] * nb[1] * nb[2]
        splits = dbias_splits((b // nb[0]) * (s // nb[1]) * (h // nb[2]), tiles, q.device)
        parts = torch.empty((splits, *nb, n_q, n_k), dtype=torch.float32, device=q.device)
        launch_bwd("dbias", *args, parts, cfg)
        db = parts[0] if splits == 1 else parts.sum(0)
        return dq, dk, dv, db

    def _setup_context(ctx, inputs, output) -> None:
        q, k, v, bias, key_bias = inputs
        o, mx, lg = output
        ctx.mark_non_differentiable(mx, lg)
        ctx.save_for_backward(q, k, v, bias, key_bias, o, mx, lg)
        ctx.bias_meta = (bias.shape, bias.dtype) if bias is not None else None

    def _backward(ctx, do, _dmx, _dlg):
        q, k, v, bias, key_bias, o, mx, lg = ctx.saved_tensors
        need_db = ctx.bias_meta is not None and ctx.needs_input_grad[3]
        dq, dk, dv, db = _evo_bwd(do, q, k, v, bias, key_bias, o, mx, lg, need_db)
        dbias = None
        if need_db:
            shape, dtype = ctx.bias_meta
            # Q or K broadcast in the bias: sum those (the kernel covers B, S and H).
            dims = [i for i in (3, 4) if shape[i] == 1 and db.shape[i] != 1]
            dbias = (db.sum(dim=dims, keepdim=True) if dims else db).to(dtype)
        needs = ctx.needs_input_grad
        return (dq if needs[0] else None), (dk if needs[1] else None), (dv if needs[2] else None), dbias, None

    _evo_fwd.autograd(_backward, _setup_context)
