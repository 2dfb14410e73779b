"""Evoformer attention: the reference, checks, launchers and autograd of its flash-style Triton kernels.

`evoformer_attention(q, k, v, bias, mask)` computes `softmax(q·kᵀ/√D + bias + (mask - 1)·1e9)·v` for
q: [B, S, H, Q, D], k/v: [B, S, H, K, D], a pair bias broadcast over MSA rows ([B, 1, H, Q, K]) and a
key mask ([B, S, 1, 1, K] or [B, S, K]): MSA row attention with pair bias, and with S = 1 or no bias
the other Evoformer attentions. The forward keeps no [Q, K] logits: it walks key blocks with an online
softmax and saves two float32 numbers per query row (the running max and the log of the sum); from
`BOUNDED_MIN_KEYS` keys it takes a fixed reference per row instead of the running max (see
`_evo_fwd_kernel`), and saves that reference in the max's place. The
backward recomputes the probabilities block by block from them: one kernel for dq (a program per
query block) and one for dk/dv (a program per key block) that, when the bias needs a gradient, also
sums the logits' gradient over the rows the bias was broadcast over: a program walks a range of those
rows (a split) and adds into a float32 partial sum of its own, and the host adds the splits
(deterministic, no atomics). The three-pass backward, with a separate dbias kernel (a program per bias
tile that recomputes the probabilities of every row), stays selectable (`backward_passes`); on CUDA it
runs for broadcast biases past the sizes the fused pass was measured to win at (`fuses_dbias`). The
kernels are in `hfkit.ops._evoformer_attention_kernels`. Registered as the custom ops
`hfkit::evoformer_attention_fwd` / `_bwd`; on CPU without `TRITON_INTERPRET=1` it runs
`evoformer_attention_reference`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from hfkit.ops._checks import broadcasts_to, check_float, check_optional, check_same_device
from hfkit.ops._triton import (
    HAS_TRITON,
    cdiv,
    dot_mode,
    hfkit_op,
    launch,
    next_power_of_2,
    num_sms,
    triton_can_run,
)
from hfkit.ops.softmax import MASK_INF

if HAS_TRITON:
    from hfkit.ops import _evoformer_attention_gluon as _gluon
    from hfkit.ops._evoformer_attention_kernels import _evo_bwd_kernel, _evo_fwd_kernel, _key_norm_kernel

__all__ = ["MAX_HEAD_DIM", "evoformer_attention", "evoformer_attention_reference", "uses_triton"]

LOG2E = 1.4426950408889634  # the kernels work in base 2: exp2(x * log2(e)) = exp(x)

# Head dims up to this are padded to a power of two (at least 16, the smallest tl.dot size).
MAX_HEAD_DIM = 128
# Rows the forward kernel runs side by side when they share one bias (see `_group_rows`).
GROUP_ROWS = 16
# Keys from which the forward runs bounded (`BOUNDED` in `_evo_fwd_kernel`): each row's softmax
# against a fixed reference at or above its largest logit, from maxima the host takes first (three
# small reductions), instead of a running max. Forward alone, bf16, H200 (triangle attention, H 4,
# D 32, through `_evo_fwd`, maxima included): 2.63 against 2.99 ms at N = 1024, 20.7 against 23.7 at
# 2048, 162 against 190 at 4096; even at 512 (0.39 against 0.40), behind at 384 (0.19 against 0.18:
# the maxima's launches).
BOUNDED_MIN_KEYS = 1024
# Registers a thread of the bounded forward may hold on CUDA (None: the compiler's choice).
BOUNDED_MAXNREG: int | None = 128
# The bounded forward through the Gluon kernel (TMA and wgmma) where it applies (sm_90, bfloat16, head
# dim 32, a shared pair bias and no key bias: `hfkit.ops._evoformer_attention_gluon.applies`) from
# GLUON_MIN_KEYS keys, the Triton kernel elsewhere and for calls whose row sums leave [2**-60, 2**60]
# there. Triangle attention, H200 (forward alone, starting / ending node): 138.5 / 140.7 against 152.1 /
# 157.9 ms at N = 4096, 18.1 / 18.7 against 19.7 / 20.2 at 2048, but 2.81 against 2.51-2.78 at 1024
# (the check of the sums waits for the device).
GLUON_FWD = True
GLUON_MIN_KEYS = 2048
# Float32 dbias partial sums that the fused dk/dv + dbias pass may keep in flight (each program adds into
# its own [Q, BLOCK_N] slice once per row it walks): about two thirds of an H100/H200's 50 MB L2, so
# that those loads and stores stay in L2: the pass runs fewer programs at once rather than pass it
# (`dkdv_dbias_splits`).
DBIAS_PARTIALS_L2_BYTES = 32 * 2**20
# The largest Q x K a broadcast bias's rows may have for the fused dk/dv + dbias pass on CUDA (see
# `fuses_dbias`): the largest measured, N = 512.
FUSED_DBIAS_MAX_LOGITS = 512 * 512
# Programs per SM the fused pass aims for when it splits the rows a bias was broadcast over.
DKDV_DBIAS_PROGRAMS_PER_SM = 2
# CUDA's limit on a grid's y dimension: calls with more (batch, row, head) programs than this are
# launched in row blocks (MSA column attention has N x heads of them: 98,304 at N = 12,288).
MAX_GRID_Y = 65535


class Config(NamedTuple):
    """Tiles of one kernel pass: rows of queries and keys per tile, padded head dim, warps, stages;
    rows: the broadcast rows the fused dk/dv + dbias pass walks side by side (1 or 2)."""

    block_m: int
    block_n: int
    block_d: int
    warps: int
    stages: int
    rows: int = 1


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per pass on CUDA, for padded head dims <= 32 and above;
# from `hfkit bench evoformer_attention --tiles` on an H200 (data/results/h200/tuning/attention.json).
# "dkdv_dbias" (the fused pass) is the largest tile that compiles for sm_90 without spills at D = 32
# (8 warps) and D = 64; at D <= 32 it runs 4 warps and two broadcast rows side by side (`Config.rows`),
# the fastest of seven tilings whose backward alone was timed as CUDA graphs on the H200 (a sweep, not
# committed): 12% below the three-pass backward at N = 256 and 384, 29% in the extra-MSA stack (S 1024,
# D 8), 4% at N = 512. Forward+backward, `hfkit bench evoformer_attention --providers
# hfkit,hfkit_three_pass` (data/results/h200/evoformer_attention.json): 0.330 against 0.362 ms at
# N = 256. (BLOCK_M, BLOCK_N, warps, stages[, rows]).
# The forward at N = 4096 (triangle attention, [1, 4096, 4, 4096, 32], bf16, H200; probes of the
# kernel before its logits took two fused multiply-adds, not committed): no tiling of 14 beat
# (128, 32, 4, 3) by more than 1.5% (128 x 128 tiles were 30% slower) and no group size beat
# GROUP_ROWS = 16. Nsight Compute (N = 1024): 73% of issue slots busy, 127 registers, 4 warps per
# scheduler, ~15 instructions per logit in the loop (14.4 now): bound by instruction issue, the pair
# bias's load and conversion about a quarter of the time (195 ms against 142 ms without it at
# N = 4096). exp2 of packed 16-bit pairs (`ex2.approx.f16x2` / `.bf16x2`) compiles to two MUFU.EX2
# on sm_90: no saving there. Read again at N = 1024 (2.9 ms): no eligible warp 26% of cycles, L2 hit
# rate 88% and DRAM 8.5% busy (the bias comes from L2), the integer/logic pipe the busiest (39%: the
# bias's bf16 -> f32 conversion and addresses). A variant taking the bias as the first dot's accumulator
# (q scaled by 1/sqrt(D) in bf16, natural units, one fused multiply-add into exp2) runs 13.2 instead
# of 14.4 SASS instructions a logit but 25% slower (236 against 188 ms at N = 4096): the bias is then
# loaded straight into the accumulator layout, outside the cp.async pipeline, and issue slots drop to
# 53% busy (no eligible warp 46%). Slower still on top of it (265, 240, 388 ms): rescaling only when
# some row's max grew by more than 8 (a block-wide test a tile), the key bias through a second dot, a
# float32 bias; other tiles of it 215-282 ms (probes not committed; SASS counted on the sm_90 cubin).
# The bounded forward (`BOUNDED_MIN_KEYS`: a fixed reference per row, no running max, no rescaling)
# keeps the loads as they are and runs 11.2 SASS instructions a logit at 128 registers (maxnreg; 162
# without, for its fallback loop): 15% below the running max at N = 4096 (timings at
# `BOUNDED_MIN_KEYS`; 5% slower without maxnreg). Not faster on top of it (probes, not committed): the
# row sum through the tensor cores (p times a ones tile: 10.0 instructions a logit, 165 ms, spills at
# 128 registers); two rows a program sharing each bias tile through a batched [2, M, N] dot (Triton
# lowers it to mma.sync, not wgmma: 5-40x slower at N = 1024 and 2048, every tile tried). Nor (probes
# of 2026-12-04, N = 4096, forward alone; the tile above 162-171 ms over four runs): two rows a program
# with their own 2D dots sharing each bias tile, which halves the bias's loads and conversions (9.6
# instructions a logit at 4 warps and 248 registers, half the resident warps: 171-173 ms; 8 warps or
# caps of 128-192 registers: 175-210); (256, 32, 8, 3), halving k and v's loads: 176-178 ms;
# (128, 64, 8, 3) 170-172; (64, 32, 4, 3) at 96 registers (13.9 a logit) 188; 2 or 4 stages 175 / 167;
# groups of 32 rows 174; the loads through tensor descriptors (TMA): 12.2 instructions a logit (the
# barriers of the asynchronous copies), not timed; `warp_specialize` on the loop: ignored for this
# kernel on sm_90 (the same SASS). A float32 bias, no conversion (10.9 instructions a logit, 10.5 at
# 2 stages) but twice the bias's bytes: 257-276 ms, so the bias's loads do cost time, and two rows a
# program lost by the warps it could not keep resident, not by its loads.
# What bounds it (Nsight Compute at N = 2048, this tile, 2026-12-04, clocks locked at 1.36 GHz): 64% of
# issue slots busy, the MUFU pipe (exp2) 53% busy, L2 at 34% of its peak throughput (5.2 TB/s of bias,
# k and v from L2, hit rate 88%), 4 warps per scheduler; warps wait on barriers (11%), fixed-latency
# results (14%) and MUFU or shared-memory results (13%). Neither memory nor one pipe is saturated; a
# Triton program runs its loads, dots and softmax in the same warps, one after the other, and no
# tiling above changed that. Not faster either (probes, not committed): a persistent kernel whose
# programs on one SM (`%smid`) walk consecutive rows of one (head, query block) so that the shared
# bias could come from L1 (`.ca`): 235 against 153 ms at N = 4096 (the bias of every head and query
# block live at once: L2 hit rate 32%, DRAM 48% busy, L1 hits unchanged at 8%); the row sums kept
# per thread and reduced once after the loop (9.1 instead of 9.6 instructions a logit, no spills at
# 128 registers): 161-164 against 162-164 ms. Triton 3.6's automatic warp specialization for sm_90
# (`tl.range(..., warp_specialize=True)` over tensor-descriptor loads, compiled for sm_90 offline) does
# not take this loop: at 4 warps its data-partition pass aborts ("Unexpected op", even for a bare
# q k^T -> exp2 -> p v loop), at 8 warps it leaves the loop as it is; a plain TMA matmul loop is
# specialized. The kernel written by hand in Gluon instead (TMA loads into an mbarrier ring, wgmma,
# three programs an SM) is `hfkit.ops._evoformer_attention_gluon` (`GLUON_FWD`).
CONFIGS_SMALL_D: dict[str, tuple[int, ...]] = {
    "fwd": (128, 32, 4, 3),
    "dkdv": (32, 128, 4, 3),
    "dq": (64, 32, 4, 3),
    "dbias": (128, 64, 4, 2),
    "dkdv_dbias": (32, 64, 4, 2, 2),
}
CONFIGS_LARGE_D: dict[str, tuple[int, ...]] = {
    "fwd": (64, 64, 4, 2),
    "dkdv": (32, 32, 4, 2),
    "dq": (32, 32, 4, 2),
    "dbias": (32, 32, 4, 2),
    "dkdv_dbias": (32, 32, 8, 2),
}


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
    check_float("q", q, dims=5)
    for name, t in (("k", k), ("v", v)):  # q against itself would always pass
        check_float(name, t, dims=5)
        check_same_device(name, t, "q", q)
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected q's dtype {q.dtype}, got {t.dtype}")
    b, s, h, n_q, d = q.shape
    n_k = k.shape[3]
    if tuple(k.shape) != (b, s, h, n_k, d):
        raise ValueError(f"k: expected shape [{b}, {s}, {h}, K, {d}] to match q, got {list(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v: expected k's shape {list(k.shape)}, got {list(v.shape)}")
    logits = (b, s, h, n_q, n_k)
    check_optional("bias", bias, None, "q", q)
    if bias is not None and (bias.dim() != 5 or not broadcasts_to(bias.shape, logits)):
        raise ValueError(
            f"bias: expected shape [B|1, S|1, H|1, Q|1, K|1] broadcastable to {list(logits)}, "
            f"got {list(bias.shape)}"
        )
    check_optional("mask", mask, None, "q", q, floating=False)
    if mask is not None:
        ok = (mask.dim() == 3 and broadcasts_to(mask.shape, (b, s, n_k))) or (
            mask.dim() == 5 and mask.shape[2:4] == (1, 1) and broadcasts_to(mask.shape, (b, s, 1, 1, n_k))
        )
        if not ok:
            raise ValueError(
                f"mask: expected shape [B, S, K] or [B, S, 1, 1, K] (B, S may be 1) with B={b}, S={s}, "
                f"K={n_k}, got {list(mask.shape)}"
            )


def uses_triton(q: torch.Tensor, head_dim: int | None = None) -> bool:
    """Whether `evoformer_attention` takes the Triton path for q, or for queries of q's device and
    dtype with `head_dim` channels (CUDA, or CPU under TRITON_INTERPRET=1 outside torch.compile;
    float32/bfloat16/float16; head dim ≤ `MAX_HEAD_DIM`; default q's last dim)."""
    return (q.shape[-1] if head_dim is None else head_dim) <= MAX_HEAD_DIM and triton_can_run(q)


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
    add = _drop_zero_key_bias(add, q, k)
    # A unit key stride lets the kernels load bias rows as vectors (Triton specializes a stride of 1);
    # a pair bias that is a permuted view of the pair projection (key stride H, as in the Evoformer)
    # would be gathered element by element on every one of its S re-reads. One copy is cheap beside
    # that.
    bias, add = _unit_key_stride(bias), _unit_key_stride(add)
    o, _, _ = _evo_fwd(q, k, v, bias, add)
    return o


def _drop_zero_key_bias(add: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """None in place of a key bias that is zero throughout (a mask keeping every key: single-chain
    inference) where the forward runs bounded (from `BOUNDED_MIN_KEYS` keys): without one, its loop
    subtracts the reference in the scaling's fused multiply-add (9.6 instead of 11.2 SASS instructions
    a logit; 154 against 162 ms at N = 4096, H200). The same result up to float32 rounding. The check
    waits for the device once, so it is skipped while a CUDA graph is captured or torch.compile
    traces."""
    if add is None or k.shape[3] < BOUNDED_MIN_KEYS or torch.compiler.is_compiling():
        return add
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return add
    return None if not bool(add.any()) else add


def _unit_key_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None or t.shape[-1] == 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()


def _check_key_bias(key_bias: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> None:
    check_optional("key_bias", key_bias, None, "q", q)
    if key_bias is None:
        return
    b, s, _, _, _ = q.shape
    if key_bias.dim() != 3 or not broadcasts_to(key_bias.shape, (b, s, k.shape[3])):
        raise ValueError(
            f"key_bias: expected shape [B|1, S|1, K] with B={b}, S={s}, K={k.shape[3]}, "
            f"got {list(key_bias.shape)}"
        )
    if key_bias.requires_grad:
        raise ValueError("key_bias: gets no gradient from evoformer_attention, but requires grad; detach it")


def _broadcast_strides(t: torch.Tensor) -> list[int]:
    # Strides of t, 0 along its dims of size 1.
    return [st if sz != 1 else 0 for st, sz in zip(t.stride(), t.shape, strict=True)]


def _bias_strides(bias: torch.Tensor | None) -> list[int]:
    # Strides over [B, S, H, Q, K], 0 along broadcast dims.
    return [0] * 5 if bias is None else _broadcast_strides(bias)


def _key_bias_strides(key_bias: torch.Tensor | None) -> list[int]:
    # Strides over [B, S, K], 0 along broadcast dims.
    return [0] * 3 if key_bias is None else _broadcast_strides(key_bias)


if HAS_TRITON:

    def _config(pass_: str, d: int, device: torch.device) -> Config:
        """Tile configuration of one kernel pass ('fwd', 'dkdv', 'dq', 'dbias', 'dkdv_dbias') for head
        dim d."""
        block_d = max(16, next_power_of_2(d))
        if device.type != "cuda":
            return Config(32, 32, block_d, 4, 1)  # small tiles so that tests cross block edges cheaply
        table = CONFIGS_SMALL_D if block_d <= 32 else CONFIGS_LARGE_D
        bm, bn, warps, stages, *rows = table[pass_]
        return Config(bm, bn, block_d, warps, stages, *rows)

    def _qkv_strides(t: torch.Tensor) -> list[int]:
        return list(t.stride()[:4])

    def _unit_last(t: torch.Tensor) -> torch.Tensor:
        return t if t.stride(-1) == 1 else t.contiguous()

    def _even_mn(n_q: int, n_k: int, cfg: Config) -> bool:
        return n_q % cfg.block_m == 0 and n_k % cfg.block_n == 0

    def _even(n_q: int, n_k: int, d: int, cfg: Config) -> bool:
        return _even_mn(n_q, n_k, cfg) and d == cfg.block_d

    def _split_rows(*tensors: torch.Tensor | None) -> list[tuple[torch.Tensor | None, ...]] | None:
        """The (B, S) row blocks of one call whose B*S*H programs fit CUDA's grid y limit, as views of
        `tensors` (the first is q; each tensor laid out [B|1, S|1, ...]; None stays None); None when
        the call fits as it is. Blocks take one B row at a time, so the float32 statistics ([B, S, H,
        Q], dense) stay dense in each block; dims of size 1 are broadcast and never sliced."""
        b, s, h = tensors[0].shape[:3]
        if b * s * h <= MAX_GRID_Y:
            return None
        if h > MAX_GRID_Y:
            raise ValueError(f"q: expected at most {MAX_GRID_Y} heads, got {h}")
        step = min(s, MAX_GRID_Y // h)

        def part(t: torch.Tensor | None, i: int, lo: int) -> torch.Tensor | None:
            if t is None:
                return None
            if t.shape[0] > 1:
                t = t[i : i + 1]
            return t[:, lo : lo + step] if t.shape[1] > 1 else t

        return [tuple(part(t, i, lo) for t in tensors) for i in range(b) for lo in range(0, s, step)]

    def _group_rows(rows: int, bias: torch.Tensor | None) -> int:
        """Rows (b, s) the forward kernel runs side by side per query block and head (see its program
        order): GROUP_ROWS when the bias is shared along S (a pair bias), else 1 (row after row)."""
        if bias is None or bias.shape[1] > 1:
            return 1
        return max(1, min(rows, GROUP_ROWS))

    def _row_maxima(k, bias, key_bias):
        """What the bounded forward's reference is made of: max_j |k_j| per (b, s, h) as [B*S*H], the
        key bias's max per (b, s) as [B*S] (None without one), the bias's max per query row as
        [B|1, S|1, H|1, Q|1] (None without one); float32. Approximate maxima would do as well: the
        kernel redoes any row whose sum lands far from 1."""
        b, s, h, n_k, d = k.shape
        knorm = torch.empty(b * s * h, device=k.device, dtype=torch.float32)
        launch(_key_norm_kernel, (b * s * h,), k, knorm, s, h, n_k, d, *_qkv_strides(k),
               BLOCK_N=128, BLOCK_D=next_power_of_2(d), num_warps=4)  # fmt: skip
        kbmax = None if key_bias is None else key_bias.amax(-1).float().expand(b, s).reshape(-1)
        bmax = None if bias is None else bias.amax(-1).float()
        return knorm, kbmax, bmax

    def _sums_ok(lg: torch.Tensor) -> bool:
        """Whether every row's log2 sum against its reference lies in [-60, 60], where the bounded
        forward's sums are trusted (the Triton kernel redoes other rows with the online softmax);
        waits for the device."""
        return bool(((lg >= -60.0) & (lg <= 60.0)).all())

    def launch_fwd(q, k, v, bias, key_bias, o, mx, lg, cfg: Config) -> None:
        """Run the forward kernel with tiles `cfg` (q, k, v with unit-stride rows; o, mx, lg outputs);
        bounded from `BOUNDED_MIN_KEYS` keys."""
        blocks = _split_rows(q, k, v, bias, key_bias, o, mx, lg)
        if blocks is not None:
            for args in blocks:
                launch_fwd(*args, cfg)
            return
        b, s, h, n_q, d = q.shape
        n_k = k.shape[3]
        bounded = n_k >= BOUNDED_MIN_KEYS
        knorm, kbmax, bmax = _row_maxima(k, bias, key_bias) if bounded else (None, None, None)
        if bounded and GLUON_FWD and n_k >= GLUON_MIN_KEYS and _gluon.applies(q, k, v, bias, key_bias):
            scale, group = LOG2E / math.sqrt(d), _group_rows(b * s, bias)
            ran = _gluon.forward(q, k, v, bias, o, mx, lg, knorm, bmax.contiguous(), scale, group)
            if ran and _sums_ok(lg):
                return
        if not _int32_slices(q, k, v, o, bias):
            # The Triton kernels index within a (b, s, h) slice in 32 bits: run them on dense copies.
            dense = torch.empty(q.shape, dtype=o.dtype, device=o.device)
            bias = bias.contiguous() if bias is not None else None
            args = (q.contiguous(), k.contiguous(), v.contiguous(), bias, key_bias, dense, mx, lg)
            _launch_fwd_triton(*args, cfg, knorm, kbmax, bmax)
            o.copy_(dense)
            return
        _launch_fwd_triton(q, k, v, bias, key_bias, o, mx, lg, cfg, knorm, kbmax, bmax)

    def _int32_slices(*tensors: torch.Tensor | None) -> bool:
        """Whether every element of each [B, S, H, N, D] tensor's (b, s, h) slices (a bias's [Q, K]) lies
        within 2**31 - 1 elements of the slice's start (the Triton kernels' 32-bit offsets), e.g. not the
        ending node's q [N, S, H, D] beyond N = 4096 at H D = 128. None counts as fitting."""
        spans = (
            (t.shape[3] - 1) * t.stride(3) + (t.shape[4] - 1) * t.stride(4) for t in tensors if t is not None
        )
        return all(span < 2**31 for span in spans)

    def _launch_fwd_triton(q, k, v, bias, key_bias, o, mx, lg, cfg: Config, knorm, kbmax, bmax) -> None:
        b, s, h, n_q, d = q.shape
        n_k = k.shape[3]
        bounded = knorm is not None
        bm_strides = [0] * 4 if bmax is None else _broadcast_strides(bmax)
        # Bounded on CUDA: at most 128 registers, the running-max kernel's count, so that as many
        # programs stay resident (the fallback loop would take it to 162; it spills outside the loops).
        regs = {"maxnreg": BOUNDED_MAXNREG} if bounded and q.is_cuda and BOUNDED_MAXNREG else {}
        launch(_evo_fwd_kernel, (cdiv(n_q, cfg.block_m), b * s * h),
            q, k, v, bias, key_bias, o, mx, lg, knorm, kbmax, bmax,
            s, h, n_q, n_k, d, LOG2E / math.sqrt(d), _group_rows(b * s, bias),
            *_qkv_strides(q), *_qkv_strides(k), *_qkv_strides(v), *_qkv_strides(o),
            *_bias_strides(bias), *_key_bias_strides(key_bias), *bm_strides,
            HAS_BIAS=bias is not None, HAS_KEY_BIAS=key_bias is not None, DOT=dot_mode(q),
            EVEN=_even(n_q, n_k, d, cfg), EVEN_MN=_even_mn(n_q, n_k, cfg), BOUNDED=bounded,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d,
            num_warps=cfg.warps, num_stages=cfg.stages, **regs,
        )  # fmt: skip

    _MODES = {"dkdv": 0, "dq": 1, "dbias": 2, "dkdv_dbias": 3}

    def launch_bwd(pass_, q, k, v, bias, key_bias, o, do, mx, lg, delta, dq, dk, dv, db, cfg: Config) -> None:
        """Run one backward pass ('dq' first, then 'dkdv' and 'dbias', or 'dkdv_dbias') with tiles
        `cfg`; db: float32 [splits, nb_b, nb_s, nb_h, Q, K] partial sums over the rows the bias
        [nb_b, nb_s, nb_h, Q|1, K|1] was broadcast over (or a dummy when there is no bias gradient).
        'dkdv_dbias' needs every split to hold at least one row (see `dkdv_dbias_splits`)."""
        args = (q, k, v, bias, key_bias, o, do, mx, lg, delta, dq, dk, dv)
        # dbias and dkdv_dbias: one program per bias row (x grid, no y limit).
        blocks = None if pass_ in ("dbias", "dkdv_dbias") else _split_rows(*args)
        if blocks is not None:
            for part in blocks:
                launch_bwd(pass_, *part, db, cfg)
            return
        b, s, h, n_q, d = q.shape
        n_k = k.shape[3]
        n_mb, n_nb = cdiv(n_q, cfg.block_m), cdiv(n_k, cfg.block_n)
        nb = list(db.shape[1:4]) if db.dim() == 6 else [1, 1, 1]
        splits = db.shape[0] if db.dim() == 6 else 1
        reps = (b // nb[0]) * (s // nb[1]) * (h // nb[2])
        if pass_ == "dkdv_dbias" and cdiv(reps, cdiv(reps, splits)) != splits:
            raise ValueError(
                f"db: expected a split count that leaves no split empty for {reps} rows, got {splits}"
            )
        grid = {
            "dkdv": (n_nb, b * s * h, 1),
            "dq": (n_mb, b * s * h, 1),
            "dbias": (n_mb * n_nb, nb[0] * nb[1] * nb[2], splits),
            "dkdv_dbias": (splits * n_nb * nb[0] * nb[1] * nb[2], 1, 1),
        }[pass_]
        launch(_evo_bwd_kernel, grid,
            q, k, v, bias, key_bias, o, do, mx, lg, delta, dq, dk, dv, db,
            b, s, h, n_q, n_k, d, LOG2E / math.sqrt(d), 1.0 / math.sqrt(d), cdiv(reps, splits),
            *_qkv_strides(q), *_qkv_strides(k), *_qkv_strides(v),
            *_qkv_strides(o), *_qkv_strides(do),
            *_qkv_strides(dq), *_qkv_strides(dk), *_qkv_strides(dv),
            *_bias_strides(bias), *_key_bias_strides(key_bias),
            *nb,
            MODE=_MODES[pass_], HAS_BIAS=bias is not None, HAS_KEY_BIAS=key_bias is not None,
            DOT=dot_mode(q), EVEN=_even(n_q, n_k, d, cfg), EVEN_MN=_even_mn(n_q, n_k, cfg),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d,
            ROWS=cfg.rows if pass_ == "dkdv_dbias" else 1, num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip

    def dbias_splits(reps: int, tiles: int, device: torch.device) -> int:
        """How many programs share the walk over the `reps` broadcast rows of each of `tiles` dbias
        tiles: enough for about four programs per SM, each walking at least 16 rows."""
        if device.type != "cuda":
            return min(reps, 2)  # the interpreter: exercise the partial sums cheaply
        want = cdiv(4 * num_sms(device), max(1, tiles))
        per = max(16, cdiv(reps, want))
        return cdiv(reps, per)

    def dkdv_dbias_splits(reps: int, programs_per_split: int, slice_bytes: int, device: torch.device) -> int:
        """How many programs of the fused dk/dv + dbias pass share the walk over the `reps` rows a bias
        was broadcast over, when one split has `programs_per_split` programs (key blocks x bias rows),
        each adding into a float32 partial-sum slice of `slice_bytes`: about
        DKDV_DBIAS_PROGRAMS_PER_SM programs per SM, fewer where their slices would pass
        DBIAS_PARTIALS_L2_BYTES; never a split without rows."""
        if device.type != "cuda":
            want = 3  # the interpreter: several splits, a ragged last one at 5 or 7 rows
        else:
            programs = min(
                DKDV_DBIAS_PROGRAMS_PER_SM * num_sms(device), DBIAS_PARTIALS_L2_BYTES // slice_bytes
            )
            want = max(1, programs // max(1, programs_per_split))
        return _nonempty_splits(reps, want)

    def _nonempty_splits(reps: int, splits: int) -> int:
        """The split count nearest `splits` (1..reps) whose splits of cdiv(reps, count) rows each
        leave none empty, as the fused pass needs."""
        return cdiv(reps, cdiv(reps, max(1, min(reps, splits))))

    def fuses_dbias(reps: int, n_q: int, n_k: int, d: int, device: torch.device) -> bool:
        """Whether the backward sums dbias inside the dk/dv pass for a bias broadcast over `reps` rows
        (B x S x H over the bias's rows) with n_q x n_k logits and head dim d: yes under the
        interpreter and for an unbroadcast bias (each program stores its slice once, no partial sums).
        On CUDA yes for head dims up to 32 and at most FUSED_DBIAS_MAX_LOGITS logits a row, where the
        H200 measured it faster than the three-pass backward (the fused pass adds a float32 load and
        store of its partial sums per logit and row, the dbias pass recomputes the probabilities; the
        gain shrinks with N: 12% at 256 and 384, 4% at 512); beyond them the three-pass backward.
        `backward_passes(fuse_dbias=...)` overrides it."""
        if device.type != "cuda" or reps == 1:
            return True
        return next_power_of_2(d) <= 32 and n_q * n_k <= FUSED_DBIAS_MAX_LOGITS

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

    def backward_passes(
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
        fuse_dbias: bool | None = None,
        configs: dict[str, Config] | None = None,
        splits: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The backward's kernels: dq (which also writes delta = rowsum(do * o)), then dk/dv with the
        bias gradient summed in the same pass (fuse_dbias True) or dk/dv and a separate dbias pass
        (False); None picks by `fuses_dbias`. configs: tiles per pass name, `_config`'s where absent;
        splits: how many programs share each bias tile's rows, `dkdv_dbias_splits` / `dbias_splits`
        where None (the fused pass takes the nearest count that leaves no split empty).
        do, q, o: [B, S, H, Q, D], k, v: [B, S, H, K, D], bias: [B|1, S|1, H|1, Q|1, K|1], mx, lg:
        the forward's float32 row statistics [B, S, H, Q]. Returns dq, dk, dv (q's dtype) and dbias
        in float32, [nb_b, nb_s, nb_h, Q, K] with the bias's B, S, H ([0] if not needed)."""
        q, k, v, do = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(do)
        if not _int32_slices(q, k, v, do, o, bias):  # the kernels' 32-bit offsets: dense copies
            q, k, v, do, o = (t.contiguous() for t in (q, k, v, do, o))
            bias = bias.contiguous() if bias is not None else None
        b, s, h, n_q, d = q.shape
        n_k = k.shape[3]
        configs = configs or {}

        def cfg(pass_: str) -> Config:
            return configs.get(pass_) or _config(pass_, d, q.device)

        delta = torch.empty((b, s, h, n_q), dtype=torch.float32, device=q.device)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        args = (q, k, v, bias, key_bias, o, do, mx, lg, delta, dq, dk, dv)
        dummy = torch.empty((0,), dtype=torch.float32, device=q.device)
        launch_bwd("dq", *args, dummy, cfg("dq"))
        if not (need_dbias and bias is not None):
            launch_bwd("dkdv", *args, dummy, cfg("dkdv"))
            return dq, dk, dv, dummy
        nb = list(bias.shape[:3])
        reps = (b // nb[0]) * (s // nb[1]) * (h // nb[2])
        if fuse_dbias is None:
            fuse_dbias = fuses_dbias(reps, n_q, n_k, d, q.device)
        if fuse_dbias:
            pass_, c = "dkdv_dbias", cfg("dkdv_dbias")
            per_split = cdiv(n_k, c.block_n) * nb[0] * nb[1] * nb[2]
            if splits is None:
                splits = dkdv_dbias_splits(reps, per_split, n_q * c.block_n * 4, q.device)
            else:
                splits = _nonempty_splits(reps, splits)
        else:
            launch_bwd("dkdv", *args, dummy, cfg("dkdv"))
            pass_, c = "dbias", cfg("dbias")
            tiles = cdiv(n_q, c.block_m) * cdiv(n_k, c.block_n) * nb[0] * nb[1] * nb[2]
            if splits is None:
                splits = dbias_splits(reps, tiles, q.device)
        parts = torch.empty((splits, *nb, n_q, n_k), dtype=torch.float32, device=q.device)
        launch_bwd(pass_, *args, parts, c)
        db = parts[0] if splits == 1 else parts.sum(0)
        return dq, dk, dv, db

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
        return backward_passes(do, q, k, v, bias, key_bias, o, mx, lg, need_dbias)

    def _setup_context(ctx, inputs, output) -> None:
        q, k, v, bias, key_bias = inputs
        o, mx, lg = output
        ctx.mark_non_differentiable(mx, lg)
        ctx.set_materialize_grads(False)  # no zero-filled gradients for mx and lg
        ctx.save_for_backward(q, k, v, bias, key_bias, o, mx, lg)
        ctx.bias_meta = (bias.shape, bias.dtype) if bias is not None else None

    def _backward(ctx, do, _dmx, _dlg):
        if do is None:
            return None, None, None, None, None
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
