"""The bounded attention forward of `hfkit.ops.evoformer_attention` as a Gluon kernel for sm_90 (H100,
H200), where it takes the long-sequence case: a pair bias shared by every row, no key bias, head dim 32,
bfloat16.

A program is one warpgroup (4 warps, 128 queries). It brings the k, v and bias tiles into a ring of
`STAGES` shared-memory slots with the tensor-memory accelerator (TMA), each slot's arrival counted by an
mbarrier, runs q kᵀ and p v as asynchronous wgmma, reads the bias tile with ldmatrix, and refills a slot
once every warp is done with it (a CTA barrier). Tile j's p v is left in flight while tile j + 1's q kᵀ
is issued, and waited for before its slot's refill. At 168 registers and 2 slots (58 KB of shared
memory) three programs share an SM: 12 warps where a warp-specialized version (a producer warp, padded
to a warpgroup) fitted two programs of 4 computing warps. A triangle attention at N = 4096 on an H200
took 133-136 ms around the starting node and 136-138 around the ending node, against 135-136 and 140
when each p v was waited for at once (same run), and 141-145 for the warp-specialized version.

What bounds it: one exp2 a logit on the MUFU unit (16 a clock an SM) and about 8 instructions a logit
for 4 issue slots a clock an SM need the same time, about 66 ms for a triangle attention at N = 4096
at 1.98 GHz; Nsight Compute at N = 2048 measured 59% of the MUFU's peak and 61% issue, with about one
eligible warp a scheduler. Its warp-state samples (before p v was left in flight): selected 21%, a fixed-
latency dependency 17%, not selected 17%, waits on wgmma 8%, the exp2 unit's queue and results 15%, the
slot refill (CTA barrier, fence, TMA issue) about 7%.

The math is the Triton kernel's bounded loop (`_evo_fwd_kernel` with BOUNDED, SHIFTED): logits in base
2 against the same per-row reference, written to the same outputs (o, the reference as the row max, and
log2 of the sum), so the backward is unchanged. The caller redoes a call whose sums fall outside
[2**-60, 2**60] with the Triton kernel (which walks such rows again with the online softmax).

q, k and v are read through 2D views [rows, columns] that TMA descriptors can describe, for tensors laid
out as a projection [S, N, H, D] (rows s N + n, columns h D + d: MSA rows, triangle attention around the
starting node) or its transpose [N, S, H, D] (rows n, columns s H D + h D + d: around the ending node),
also as column slices of a wider projection (q, k, v and the gate from one GEMM, as inference makes them);
`applies` checks that, the sizes and everything else, and the caller takes the Triton kernel otherwise.
Gluon kernels run only on a GPU (no interpreter): the tests run on CUDA, and `tests/compile_sm90.py`
compiles this one for sm_90 without a GPU (a Triton whose Gluon API moved fails there).
"""

from __future__ import annotations

import warnings

import torch

from hfkit.ops._evoformer_attention_kernels import _program_tile

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
except ImportError:  # no Triton, or one without Gluon's Hopper API
    HAS_GLUON = False

__all__ = ["HAS_GLUON", "applies", "forward"]

# Tiles: queries a program (its 4 warps), keys a tile, the head dim, ring slots, the registers a thread
# is launched with (152 used, no spills; 128 spill 184 bytes). Measured on an H200 at N = 4096 (starting
# / ending node, `.gpu` probes, not committed), this kernel against the earlier warp-specialized one
# (a producer warp, 4 slots, 2 programs an SM) in the same runs: 136.1-136.8 / 139.8-140.6 ms against
# 140.9-141.3 / 144.6-144.8; 3 slots (2 programs an SM by shared memory) 153-155; 152 registers as 168;
# 64 queries a program (more programs an SM: 4-6 by registers at 80-128) 140-157, slower.
# Row sums by a wgmma of p against a column of ones (one instruction a logit fewer, 7.2 instead of 8.3)
# measured the same time: the exp2 unit binds as much as the issue slots. Earlier probes of the warp-
# specialized kernel: 32-key tiles 160-166 ms, two consumer warpgroups on 256 queries 180-377, q kᵀ of
# tile j issued with p v of tile j - 1 (FlashAttention-3's intra-warpgroup pipelining) no gain there
# (2% here), two rows a program sharing each bias tile (half the bias traffic from L2) no gain; exp2 as
# ex2.approx.f16x2 or bf16x2 runs two MUFU.EX2 (a throughput probe on the H200: 3.98 and 4.05 against
# 3.93 T exp2 a second for f32). Reading the bias tile before waiting for p v spilled (144-149 ms).
BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, MAX_REGS = 128, 64, 32, 2, 168
# Set when a launch failed to compile (a Triton whose Gluon API differs): the Triton kernel from then on.
_BROKEN: list[str] = []

if HAS_GLUON:
    _LOG2E = gl.constexpr(1.4426950408889634)
    # Triton 3.6 names the TMA load `async_copy_global_to_shared`, later ones `async_load`.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # Triton 3.6 names the CTA barrier `thread_barrier`, later ones `barrier`.
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

    @gluon.jit
    def _issue(k_desc, v_desc, b_desc, bar, k_buf, v_buf, b_buf, k_row, k_col, b_row, start):
        nbytes: gl.constexpr = 2 * k_desc.block_type.nbytes + b_desc.block_type.nbytes
        mbarrier.expect(bar, nbytes)
        _tma_load(k_desc, [k_row + start, k_col], bar, k_buf)
        _tma_load(v_desc, [k_row + start, k_col], bar, v_buf)
        _tma_load(b_desc, [b_row, start], bar, b_buf)

    @gluon.jit
    def _probabilities(b_buf, s_tok, qk_scale, shift, s_layout: gl.constexpr, p_layout: gl.constexpr):
        """(p as the p v wgmma's bfloat16 operand, its row sums) of a tile: the bias tile read with
        ldmatrix, then q kᵀ waited for."""
        t = b_buf.load(s_layout).to(gl.float32)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        p = gl.exp2(gl.fma(t, _LOG2E, gl.fma(s, qk_scale, shift)))
        return gl.convert_layout(p.to(gl.bfloat16), p_layout), gl.sum(p, axis=1)

    @gluon.jit
    def _fwd_kernel(
        q_desc, k_desc, v_desc, b_desc, O, Mx, Lg, KNorm, BMax,
        H, n_q, n_k, qk_scale, group_rows, q_rs, q_cs, k_rs, k_cs, sos, soh, son,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        # Grid (query blocks, S*H), programs ordered as `_evo_fwd_kernel`'s: rows fastest in groups of
        # `group_rows`, so that programs running together share the bias tiles in L2.
        pid_m, bsh = _program_tile(
            gl.program_id(0), gl.program_id(1), gl.num_programs(0), gl.num_programs(1), group_rows, H
        )
        s_ = bsh // H
        h = bsh % H
        m0 = pid_m * BLOCK_M
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], v_desc.layout)
        b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_N], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        mbarrier.init(q_bar, count=1)
        n_tiles = n_k // BLOCK_N
        k_row = s_ * k_rs
        k_col = s_ * k_cs + h * D
        b_row = h * n_q + m0
        for i in gl.static_range(STAGES):
            _issue(k_desc, v_desc, b_desc, ready.index(i), k_smem.index(i), v_smem.index(i), b_smem.index(i),
                   k_row, k_col, b_row, i * BLOCK_N)  # fmt: skip
        nw: gl.constexpr = gl.num_warps()
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[nw, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[nw, 1], instr_shape=[16, D, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        q_rows: gl.constexpr = gl.BlockedLayout([1, D], [32, 1], [nw, 1], [1, 0])
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        _tma_load(q_desc, [s_ * q_rs + m0, s_ * q_cs + h * D], q_bar, q_smem)
        mbarrier.wait(q_bar, 0)
        # The row's reference, as the Triton kernel takes it: |q_i| max_j |k_j| scale + max_j bias_ij.
        qf = q_smem.load(q_rows).to(gl.float32)
        q_norm = gl.convert_layout(gl.sqrt(gl.sum(qf * qf, axis=1)), row_s)
        offs_m = m0 + gl.arange(0, BLOCK_M, layout=row_s)
        bound = q_norm * (gl.load(KNorm + bsh) * qk_scale) + gl.load(BMax + h * n_q + offs_m) * _LOG2E
        shift = -gl.expand_dims(bound, 1)
        acc = gl.zeros([BLOCK_M, D], gl.float32, o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        # Tile j's p v stays in flight while tile j + 1's q kᵀ is issued; it is waited for (one wgmma
        # left outstanding) before its slot is refilled.
        mbarrier.wait(ready.index(0), 0)
        kt = k_smem.index(0).permute((1, 0))
        s_tok = warpgroup_mma(q_smem, kt, s_zero, use_acc=False, is_async=True)
        p16, l_i = _probabilities(b_smem.index(0), s_tok, qk_scale, shift, s_layout, p_layout)
        for j in range(1, n_tiles):
            prv = (j - 1) % STAGES
            acc_tok = warpgroup_mma(p16, v_smem.index(prv), acc, is_async=True)
            slot = j % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            kt = k_smem.index(slot).permute((1, 0))
            s_tok = warpgroup_mma(q_smem, kt, s_zero, use_acc=False, is_async=True)
            acc, p16 = warpgroup_mma_wait(num_outstanding=1, deps=(acc_tok, p16))
            _cta_barrier()  # every warp is done with tile j - 1's slot: refill it
            nxt = j - 1 + STAGES
            if nxt < n_tiles:
                _issue(k_desc, v_desc, b_desc, ready.index(prv), k_smem.index(prv), v_smem.index(prv),
                       b_smem.index(prv), k_row, k_col, b_row, nxt * BLOCK_N)  # fmt: skip
            p16, l_j = _probabilities(b_smem.index(slot), s_tok, qk_scale, shift, s_layout, p_layout)
            l_i += l_j
        acc_tok = warpgroup_mma(p16, v_smem.index((n_tiles - 1) % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
        o = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
        offs_mo = m0 + gl.arange(0, BLOCK_M, layout=row_o)
        offs_d = gl.arange(0, D, layout=col_o)
        o_base = O + s_.to(gl.int64) * sos + h * soh
        # 64-bit row offsets: the ending node's o [N, S, H, D] spans more than 2**31 elements beyond N = 4096.
        rows_o = gl.expand_dims(offs_mo.to(gl.int64), 1) * son
        gl.store(o_base + rows_o + gl.expand_dims(offs_d, 0), o.to(gl.bfloat16))
        gl.store(Mx + bsh.to(gl.int64) * n_q + offs_m, bound)
        gl.store(Lg + bsh.to(gl.int64) * n_q + offs_m, gl.log2(l_i))


def _tma_view(t: torch.Tensor) -> tuple[int, int, list[int], list[int]] | None:
    """For t [1, S, H, N, D] (unit stride along D): (rows a step of S, columns a step of S, shape,
    strides) of the 2D view [rows, columns] that a TMA descriptor reads it through, row (s, n) and
    column (s, h, d) at `s * rows + n` and `s * columns + h D + d`; None for other layouts. t may be
    the head columns of a wider projection (q, k or v beside the other projections of one GEMM): the
    rows are then further apart than H D (a multiple of 16 bytes, as TMA needs)."""
    _, s, h, n, d = t.shape
    _, ss, sh, sn, sd = t.stride()
    if sd != 1 or sh != d:
        return None
    if sn >= h * d and sn % 8 == 0 and (ss == n * sn or s == 1):  # a projection [S, N, >= H D]
        return n, 0, [s * n, h * d], [sn, 1]
    if ss >= h * d and ss % 8 == 0 and (sn == s * ss or n == 1):  # its transpose [N, S, >= H D]
        return 0, ss, [n, s * ss], [s * ss, 1]
    return None


def applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias, key_bias) -> bool:
    """Whether `forward` takes this bounded forward call (CUDA sm_90, bfloat16, one batch, head dim 32, a
    bfloat16 pair bias [1, 1, H, Q, K] dense along Q and K, no key bias, Q a multiple of `BLOCK_M`, K of
    `BLOCK_N` and at least `STAGES` tiles, q, k, v laid out as `_tma_view` reads them, 16-byte aligned,
    and no torch.compile trace or CUDA graph capture: the caller then checks the sums, which waits for
    the device)."""
    if not HAS_GLUON or _BROKEN or not q.is_cuda or key_bias is not None or bias is None:
        return False
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return False
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return False
    b, s, h, n_q, d = q.shape
    n_k = k.shape[3]
    if b != 1 or d != HEAD_DIM or n_q % BLOCK_M or n_k % BLOCK_N or n_k < STAGES * BLOCK_N:
        return False
    if any(t.dtype != torch.bfloat16 for t in (q, k, v, bias)):
        return False
    if tuple(bias.shape) != (1, 1, h, n_q, n_k) or bias.stride()[2:] != (n_q * n_k, n_k, 1):
        return False
    if any(t.data_ptr() % 16 for t in (q, k, v, bias)):
        return False
    views = [_tma_view(t) for t in (q, k, v)]
    return all(views) and views[1][:2] == views[2][:2]


def _desc(t: torch.Tensor, shape: list[int], strides: list[int], block: list[int]):
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
    return TensorDescriptor(t, shape, strides, block, layout)


def forward(q, k, v, bias, o, mx, lg, knorm, bmax, qk_scale: float, group_rows: int) -> bool:
    """Run the kernel on a call `applies` took (o, mx, lg: outputs laid out as the Triton forward's;
    knorm, bmax: `_row_maxima`'s key norms and bias row maxima; qk_scale: log2(e) / sqrt(D)). Returns
    False, having warned once, when this Triton's Gluon cannot compile it; the caller then runs the
    Triton kernel."""
    _, s, h, n_q, d = q.shape
    n_k = k.shape[3]
    q_rs, q_cs, *q_2d = _tma_view(q)
    k_rs, k_cs, *k_2d = _tma_view(k)
    descs = (
        _desc(q, *q_2d, [BLOCK_M, d]),
        _desc(k, *k_2d, [BLOCK_N, d]),
        _desc(v, *k_2d, [BLOCK_N, d]),
        _desc(bias, [h * n_q, n_k], [n_k, 1], [BLOCK_M, BLOCK_N]),
    )
    try:
        _fwd_kernel[(n_q // BLOCK_M, s * h)](
            *descs, o, mx, lg, knorm, bmax, h, n_q, n_k, qk_scale, group_rows,
            q_rs, q_cs, k_rs, k_cs, o.stride(1), o.stride(2), o.stride(3),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D=d, STAGES=STAGES, num_warps=4, maxnreg=MAX_REGS,
        )  # fmt: skip
    except Exception as err:  # noqa: BLE001 - a Gluon API this code does not know: fall back, once
        _BROKEN.append(repr(err))
        warnings.warn(
            f"hfkit: the Gluon attention forward did not compile ({err!r}); using the Triton kernel",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True
