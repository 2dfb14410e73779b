"""One LSTM layer in one direction: the op behind `hfkit.nn.LSTM`, and its plain-torch reference.

`lstm_layer` takes a time-major input x [T, B, I], the initial state (h0, c0) [B, H] and one layer's
weights in torch's layout (gates i, f, g, o along the 4H rows) and returns y [T, B, H], h_n and c_n,
as one layer and direction of `torch.nn.LSTM`. Its forward is the input projection of every step as
one matmul up front, then the recurrence in Triton (each step's h_{t-1} @ w_hh^T, the gate
activations and the cell update, cell state always float32). The backward runs the recurrence from
t = T-1 down to 0 (the gate gradients of each step, the carried dh and dc), then the weight, input
and initial-state gradients as a few matmuls over every step at once.

The recurrence runs one of two ways (`_persistent_tiles` picks):
- sequence kernels (`lstm_seq_fwd_kernel`, `lstm_seq_bwd_kernel`), when the grid fits on the GPU at
  once (B <= 64, at most one program per SM): on CUDA ONE launch runs the whole sequence, the
  programs meeting at a grid-wide barrier between steps, each keeping its slice of w_hh on chip
  where it fits (hfai's H = 985, B = 4 on 132 SMs: 124 programs of 8 units each way). Under the
  interpreter, whose programs run one after another, the same kernels run one step per launch.
- step kernels (`lstm_step_fwd_kernel`, `lstm_step_bwd_kernel`) otherwise: one launch per step, on
  CUDA captured once as a CUDA graph and replayed (see `_StepGraphs`), except while the caller is
  capturing a graph itself, where the launches land in the caller's graph.
`lstm_reference` is the specification: the plain-torch step loop.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812

from hfkit.ops._checks import check_float, check_matmul_dtype, check_optional, check_same_device
from hfkit.ops._triton import (
    HAS_TRITON,
    cdiv,
    dot_mode,
    hfkit_op,
    interpreting,
    launch,
    next_power_of_2,
    num_sms,
    triton_can_run,
    wraps_launches,
)

if HAS_TRITON:
    from hfkit.ops._lstm_kernels import (
        lstm_seq_bwd_kernel,
        lstm_seq_fwd_kernel,
        lstm_step_bwd_kernel,
        lstm_step_fwd_kernel,
    )

__all__ = ["lstm_layer", "lstm_reference", "uses_triton"]

Tensor = torch.Tensor

# Tiles of the step kernels: BLOCK_H hidden units (x 4 gates) by BLOCK_B batch rows per program, the
# reduction over BLOCK_K columns at a time. 16 is tl.dot's smallest tile side; a small BLOCK_H gives
# more programs per step (H = 985: 62 hidden tiles).
BLOCK_H = 16
BLOCK_K = 64
MAX_BLOCK_B = 64
NUM_WARPS = 4

# Sequence kernels. The forward keeps its w_hh slice [4*BLOCK_U, next_pow2(H)] on
# chip for the whole sequence where the slice and the h_{t-1} tile [next_pow2(H), BLOCK_B] (both staged
# in shared memory as the dot's operands; the slice twice for float32's three-TF32 products) take at
# most SEQ_RESIDENT_BYTES (H200: 227 KB a block) and, as they pass through registers into the dot, at
# most MAX_RESIDENT_SLICE and MAX_RESIDENT_H elements; otherwise it reads the slice from L2 at every
# step, SEQ_FWD_BLOCK_K columns at a time. The backward keeps its column slice of w_hh, in the same
# [4*BLOCK_U, next_pow2(H)] layout, on chip by the same rule, its dgates operand [next_pow2(H), NB]
# (NB = 4*BLOCK_B, twice that with SPLIT's head and tail) in the h tile's place and held to
# MAX_RESIDENT_SLICE elements like the slice; otherwise it reads the slice from L2 at every step, at
# most SEQ_BWD_BLOCK_K rows and MAX_STREAMED_DGATES dgates elements at a time. SEQ_BWD_PREFETCH: the
# backward loads a step's inputs from the forward one step ahead (see `lstm_seq_bwd_kernel`).
# SEQ_BWD_SPLIT: the backward of 16-bit weights carries dgates into the product as a 16-bit head and
# tail (about float32: two products, twice the dgates traffic a step) rather than rounded to w_hh's
# dtype once a step, as cuDNN does in bfloat16. Off, because the rounding does not compound over the
# sequence: at hfai's size (T = 1000, B = 4, H = 985, torch's init, bfloat16 values) the backward
# recurrence in float64 with dgates rounded to bfloat16 a step is within 2.5e-4 (relative L2) of the
# exact one in dgates, dx and dw_hh, where torch's own bfloat16 nn.LSTM is 3.7e-3 from float64. The
# kernels end to end (T = 200, H = 64, interpreter) are 2.6e-3 from float64 in dx either way (torch
# bfloat16: 3.7e-3), 4.4e-3 in dw_hh (split 4.2e-3, torch 3.8e-3: the forward's rounding of h).
# At hfai's H = 985, B = 4 on sm_90: bfloat16 both on chip, float32 forward on chip with one TF32
# product (as float16 operands, `half`) and streamed with three, the backward on chip with one TF32
# product and streamed with three. The float16 operands took the float32 forward's kernel from 4.63
# to 4.08 ms (torch.profiler, H200; bfloat16's: 3.82 ms). With 8 warps (ptxas, PREFETCH) the forward
# took 181 registers and the backward 200 (198 with SPLIT), none spilling. The backward runs 4 warps
# a program (a few bytes of spills in bfloat16): at that size on the H200 (sweeps of the backward's
# tiles, not committed) fwd+bwd took 10.1 ms in bfloat16 and 47.3 ms in float32 (three products)
# with 4, 11.2 and 53.4 ms with 8; later, with the 4-warp forward and one TF32 product, 8.99 and
# 11.5 ms with 4 and 19.0 and 27.7 ms with 2; the same gradients bit for bit. `hfkit bench lstm`
# (data/results/h200/lstm.json) has the 4-warp kernels.
# The forward runs 4 warps a program too: at that size on the H200 (a sweep of its warps, not
# committed) the forward took 4.39 ms in bfloat16 and 5.44 ms in float32 (one TF32 product) with 4,
# 5.51 and 7.43 ms with 8, 7.59 and 11.60 ms with 16, the same outputs bit for bit (a step's work is
# a small dot and the gate update: fewer warps meet sooner at the barrier's CTA syncs). With 4 warps
# the forward takes 255 registers and spills at most 92 bytes (ptxas), which the sweep's times include
# (56 bytes with float16 operands in float32).
SEQ_NUM_WARPS = 4
SEQ_BWD_NUM_WARPS = 4
SEQ_RESIDENT_BYTES = 192 * 1024
MAX_RESIDENT_SLICE = 32768
MAX_RESIDENT_H = 16384
SEQ_FWD_BLOCK_K = 64
SEQ_BWD_BLOCK_K = 64
MAX_STREAMED_DGATES = 4096
SEQ_BWD_SPLIT = False
SEQ_BWD_PREFETCH = True
MIN_SEQ_FWD_BLOCK_U = 4
MAX_SEQ_FWD_BLOCK_U = 32
MIN_SEQ_BWD_BLOCK_U = 4
MAX_SEQ_BWD_BLOCK_U = 32


def lstm_reference(
    x: Tensor,
    h0: Tensor | None,
    c0: Tensor | None,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None = None,
    b_hh: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Plain-torch LSTM layer, one direction: the specification `lstm_layer` is tested against.

    Takes the arguments of `lstm_layer` with the same shapes; computes every step in x's dtype as
    `torch.nn.LSTM` defines it: gates = x_t @ w_ih^T + b_ih + h @ w_hh^T + b_hh split into i, f, g, o;
    c = sigmoid(f)*c + sigmoid(i)*tanh(g); h = sigmoid(o)*tanh(c). Returns y [T, B, H], h_n, c_n [B, H].
    """
    _check_inputs(x, h0, c0, w_ih, w_hh, b_ih, b_hh)
    t_len, batch, _ = x.shape
    hidden = w_hh.shape[1]
    h = h0 if h0 is not None else x.new_zeros(batch, hidden)
    c = c0 if c0 is not None else x.new_zeros(batch, hidden)
    outputs = []
    for t in range(t_len):
        gates = F.linear(x[t], w_ih, b_ih) + F.linear(h, w_hh, b_hh)
        i, f, g, o = gates.chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outputs.append(h)
    y = torch.stack(outputs) if outputs else x.new_zeros(0, batch, hidden)
    return y, h, c


def uses_triton(x: Tensor) -> bool:
    """Whether `lstm_layer` takes the Triton path for x [T, B, I]: on CUDA, and on CPU under
    `TRITON_INTERPRET=1` (outside `torch.compile` tracing and `reference_on_cpu()`), for float32,
    bfloat16 and float16, with at least one step and one batch row. float64 and empty inputs run the
    reference."""
    return x.shape[0] > 0 and x.shape[1] > 0 and triton_can_run(x)


def lstm_layer(
    x: Tensor,
    h0: Tensor | None,
    c0: Tensor | None,
    w_ih: Tensor,
    w_hh: Tensor,
    b_ih: Tensor | None = None,
    b_hh: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One LSTM layer in one direction, as one layer of `torch.nn.LSTM`, with a Triton recurrence.

    x: [T, B, I] (time-major) in float32, bfloat16 or float16 (float64 runs the reference); h0, c0:
    [B, H] or None (zeros); w_ih: [4H, I], w_hh: [4H, H], b_ih, b_hh: [4H] or None, in x's dtype
    (gates in torch's order i, f, g, o). Any H and B. The cell state and every gate are float32 inside;
    h is rounded to x's dtype at each step, as it feeds the next step's matmul, and so are, in the
    backward on the sequence kernels (B <= 64), the gates' gradients as they feed the previous step's,
    as cuDNN does (`SEQ_BWD_SPLIT`: within 2.5e-4 of exact at hfai's size, a tenth of bfloat16's own
    error). Returns y [T, B, H] (every step's h), h_n and c_n [B, H], in x's dtype; differentiable in
    every tensor argument. Raises ValueError naming the argument on a wrong shape, dtype or device.
    """
    _check_inputs(x, h0, c0, w_ih, w_hh, b_ih, b_hh)
    if not uses_triton(x):
        return lstm_reference(x, h0, c0, w_ih, w_hh, b_ih, b_hh)
    batch, hidden = x.shape[1], w_hh.shape[1]
    # Under autocast (which check_matmul_dtype lets through) the weights run in x's dtype.
    w_ih, w_hh, b_ih, b_hh = (t.to(x.dtype) if t is not None else None for t in (w_ih, w_hh, b_ih, b_hh))
    h0 = h0 if h0 is not None else x.new_zeros(batch, hidden)
    c0 = c0 if c0 is not None else x.new_zeros(batch, hidden)
    y, h_n, c_n, _, _ = _lstm_fwd(x, h0, c0, w_ih, w_hh, b_ih, b_hh)
    return y, h_n, c_n


def _check_inputs(
    x: object,
    h0: Tensor | None,
    c0: Tensor | None,
    w_ih: object,
    w_hh: object,
    b_ih: Tensor | None,
    b_hh: Tensor | None,
) -> None:
    check_float("x", x, 3)
    assert isinstance(x, Tensor)
    check_float("w_hh", w_hh, 2)
    assert isinstance(w_hh, Tensor)
    check_same_device("w_hh", w_hh, "x", x)
    hidden = w_hh.shape[1]
    if w_hh.shape[0] != 4 * hidden or hidden == 0:
        raise ValueError(f"w_hh: expected shape [4H, H] with H > 0, got {list(w_hh.shape)}")
    check_float("w_ih", w_ih, 2)
    assert isinstance(w_ih, Tensor)
    check_same_device("w_ih", w_ih, "x", x)
    if tuple(w_ih.shape) != (4 * hidden, x.shape[2]):
        raise ValueError(
            f"w_ih: expected shape {[4 * hidden, x.shape[2]]} ([4H, I] for x of shape {list(x.shape)} "
            f"and w_hh of shape {list(w_hh.shape)}), got {list(w_ih.shape)}"
        )
    for name, t in (("w_ih", w_ih), ("w_hh", w_hh), ("b_ih", b_ih), ("b_hh", b_hh)):
        check_optional(name, t, (4 * hidden,) if name.startswith("b") else None, "x", x)
        check_matmul_dtype(name, t, x.dtype, x.device.type)
    for name, t in (("h0", h0), ("c0", c0)):
        check_optional(name, t, (x.shape[1], hidden), "x", x)
        if t is not None and t.dtype != x.dtype:
            raise ValueError(f"{name}: expected dtype {x.dtype} (x's), got {t.dtype}")


class _Tiles(NamedTuple):
    """Grid and tiles of both step kernels for one (B, H, dtype, device)."""

    grid: tuple[int, int]
    block_b: int
    dot: int


def recurrence_dot(w_hh: Tensor) -> int:
    """The `dot` mode (`hfkit.ops._triton.dot_mode`) of the recurrence's products h @ w_hh^T and
    dgates @ w_hh. As `dot_mode`, except for float32 on CUDA, which follows the flag that
    `torch.nn.LSTM` obeys there, `torch.backends.cudnn.allow_tf32` (True by default: cuDNN's float32
    LSTM then multiplies in TF32), rather than the float32 matmul precision: one TF32 product (4) where
    it is set, three (3, about float32) where it is not. The input projection and the gradients' matmuls
    (torch's) follow the same flag inside the op (`_products_like_cudnn`), as cuDNN's do."""
    if w_hh.dtype == torch.float32 and w_hh.is_cuda:
        return 4 if torch.backends.cudnn.allow_tf32 else 3
    return dot_mode(w_hh)


@contextlib.contextmanager
def _products_like_cudnn(w_hh: Tensor) -> Iterator[None]:
    """Inside, torch's float32 matmuls take TF32 where the recurrence does (`recurrence_dot` 4: float32
    on CUDA under `torch.backends.cudnn.allow_tf32`), as cuDNN's LSTM takes it for all of its
    products; the matmul setting is restored on exit (it is process-wide: another thread's matmuls
    meanwhile take it too). Elsewhere, or where torch's matmuls already take TF32, nothing changes."""
    if recurrence_dot(w_hh) != 4 or torch.backends.cuda.matmul.allow_tf32:
        yield
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def _tiles(x: Tensor, w_hh: Tensor) -> _Tiles:
    batch, hidden = x.shape[1], w_hh.shape[1]
    block_b = min(MAX_BLOCK_B, max(16, next_power_of_2(batch)))
    return _Tiles((cdiv(hidden, BLOCK_H), cdiv(batch, block_b)), block_b, recurrence_dot(w_hh))


class _SeqTiles(NamedTuple):
    """Grids and tiles of the sequence kernels for one (B, H, dtype, SM count). The forward: one batch
    tile of block_b rows, programs of fwd_block_u units, their slice of w_hh on chip for the whole
    sequence when `resident` (fwd_block_k = next_pow2(H)) or read fwd_block_k columns at a time at
    every step. The backward: one batch tile of bwd_block_b rows, programs of bwd_block_u units, their
    column slice on chip when `bwd_resident` (bwd_block_k = next_pow2(H)) or read bwd_block_k rows at
    a time, dgates carried as a 16-bit head and tail when `bwd_split`, a step's inputs from the forward
    loaded one step ahead when `bwd_prefetch`, bwd_num_warps warps a program. Both kernels' products
    take `dot` (`recurrence_dot`), the mode the tiles were chosen for, except the forward's with `half`
    (float32 weights, one TF32 product, on chip): float16 operands, scaled (see the kernel).
    A sweep may `_replace` the backward's fields (with a grid of cdiv(H, bwd_block_u) programs, at most
    one per SM) as long as `bwd_split` only with 16-bit weights and bwd_block_k = next_pow2(H) with
    `bwd_resident`."""

    fwd_grid: tuple[int, int]
    bwd_grid: tuple[int, int]
    block_b: int
    fwd_block_u: int
    fwd_block_k: int
    resident: bool
    bwd_block_u: int
    bwd_block_k: int
    bwd_resident: bool
    bwd_block_b: int
    bwd_split: bool
    bwd_prefetch: bool
    bwd_num_warps: int
    dot: int
    half: bool


def _smallest_block_u(hidden: int, smallest: int, sms: int) -> int:
    """The smallest power of two >= `smallest` whose unit tiles over `hidden` number at most `sms`."""
    block_u = smallest
    while cdiv(hidden, block_u) > sms:
        block_u *= 2
    return block_u


def _persistent_tiles(
    batch: int,
    hidden: int,
    element_size: int,
    dot: int,
    sms: int,
    resident_bytes: int = SEQ_RESIDENT_BYTES,
    bwd_split: bool | None = None,
) -> _SeqTiles | None:
    """Tiles of the sequence kernels for batch B, hidden H, weights and h of `element_size` bytes and
    the `dot` mode (`recurrence_dot`) on a device of `sms` SMs, or None where the step kernels run instead.

    Each kernel takes the smallest BLOCK_U (a power of two, >= 4: the dots' M = 4*BLOCK_U >= 16) whose
    grid has at most `sms` programs, so that every program is resident at once (what makes the grid
    barrier safe) and the grid is as wide as that allows. None when B > MAX_BLOCK_B (one batch tile)
    or that BLOCK_U passes MAX_SEQ_FWD_BLOCK_U / MAX_SEQ_BWD_BLOCK_U. The forward keeps its w_hh slice
    on chip (`resident`) when the slice (twice for dot mode 3) and the h tile take at most
    `resident_bytes` (in float16 for dot mode 4: `half`), the slice at most MAX_RESIDENT_SLICE elements
    and the h tile MAX_RESIDENT_H; the backward its column slice when the slice (twice for dot mode 3)
    and the dgates operand take at most `resident_bytes` and each at most MAX_RESIDENT_SLICE elements.
    `bwd_split` (16-bit weights only; None: SEQ_BWD_SPLIT for 16-bit weights) carries the backward's
    dgates as a head and a tail."""
    if batch > MAX_BLOCK_B:
        return None
    block_b = max(16, next_power_of_2(batch))
    fwd_u = _smallest_block_u(hidden, MIN_SEQ_FWD_BLOCK_U, sms)
    bwd_u = _smallest_block_u(hidden, MIN_SEQ_BWD_BLOCK_U, sms)
    if fwd_u > MAX_SEQ_FWD_BLOCK_U or bwd_u > MAX_SEQ_BWD_BLOCK_U:
        return None
    if bwd_split is None:
        bwd_split = SEQ_BWD_SPLIT and element_size == 2
    elif bwd_split and element_size != 2:
        raise ValueError(f"bwd_split: expected False for {element_size}-byte weights (16-bit only), got True")
    full_k = next_power_of_2(hidden)
    slice_copies = 2 if dot == 3 else 1
    # One TF32 product (float32 weights): the forward's operands on chip are float16 (HALF).
    fwd_size = 2 if dot == 4 else element_size
    resident = (
        (4 * fwd_u * slice_copies + block_b) * full_k * fwd_size <= resident_bytes
        and 4 * fwd_u * full_k <= MAX_RESIDENT_SLICE
        and block_b * full_k <= MAX_RESIDENT_H
    )
    # The backward's batch tile: the dgates operand's NB = 4*bwd_block_b columns (8* with the split) >= 16.
    bwd_block_b = max(4, next_power_of_2(batch))
    dgates_cols = (2 if bwd_split else 1) * 4 * bwd_block_b
    bwd_bytes = (4 * bwd_u * slice_copies + dgates_cols) * full_k * element_size
    bwd_resident = bwd_bytes <= resident_bytes and max(4 * bwd_u, dgates_cols) * full_k <= MAX_RESIDENT_SLICE
    streamed_k = min(SEQ_BWD_BLOCK_K, max(16, MAX_STREAMED_DGATES // dgates_cols))
    return _SeqTiles(
        fwd_grid=(cdiv(hidden, fwd_u), 1),
        bwd_grid=(cdiv(hidden, bwd_u), 1),
        block_b=block_b,
        fwd_block_u=fwd_u,
        fwd_block_k=full_k if resident else SEQ_FWD_BLOCK_K,
        resident=resident,
        bwd_block_u=bwd_u,
        bwd_block_k=full_k if bwd_resident else streamed_k,
        bwd_resident=bwd_resident,
        bwd_block_b=bwd_block_b,
        bwd_split=bwd_split,
        bwd_prefetch=SEQ_BWD_PREFETCH,
        bwd_num_warps=SEQ_BWD_NUM_WARPS,
        dot=dot,
        half=dot == 4 and resident,
    )


def _seq_tiles(x: Tensor, w_hh: Tensor) -> _SeqTiles | None:
    """`_persistent_tiles` for x [T, B, I] and w_hh [4H, H] (in x's dtype) on x's device."""
    return _persistent_tiles(
        x.shape[1], w_hh.shape[1], w_hh.element_size(), recurrence_dot(w_hh), num_sms(x.device)
    )


def _one_launch(x: Tensor) -> bool:
    """Whether the sequence kernels run the whole sequence in one launch (compiled kernels on CUDA,
    all programs resident) rather than one step a launch (the interpreter runs programs one after
    another: a grid barrier would wait forever)."""
    return x.is_cuda and not interpreting()


def _pow2_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [R, K] float32 with each row scaled by a power of two that brings its largest |value| into
    [2^14, 2^15), float16's top binade (below its largest, 65504), and the [R] float32 factors that
    undo it: both exact. The sequence forward's HALF operands (see the kernel): rounded to float16,
    the rows keep 11 significant bits down to 2^-28 of their largest value, as TF32 does. A row of
    zeros gets 2^15; the exponents stay within [-126, 126], so that both factors are normal floats."""
    _, exponent = torch.frexp(x.abs().amax(dim=1))  # largest |value| = m * 2^exponent, m in [0.5, 1)
    scale = ((142 - exponent).clamp(1, 253).to(torch.int32) << 23).view(torch.float32)  # 2^(15 - exponent)
    return x * scale[:, None], scale.reciprocal()


def _fwd_seq(
    xp: Tensor,
    bias: Tensor | None,
    h0: Tensor,
    w_hh: Tensor,
    cs: Tensor,
    y: Tensor,
    gates: Tensor,
    tiles: _SeqTiles,
    persistent: bool,
) -> None:
    """The forward recurrence with the sequence kernel over the preallocated buffers (see the kernel):
    one launch for every step when `persistent`, else one launch a step."""
    t_len, batch, hidden = y.shape
    counter = torch.zeros(1, device=y.device, dtype=torch.int32)
    w_unscale = h0_unscale = h_ring = None
    if tiles.half:  # float16 operands, scaled (see the kernel)
        (w_hh, w_unscale), (h0, h0_unscale) = _pow2_rows(w_hh), _pow2_rows(h0)
        w_hh, h0 = w_hh.to(torch.float16), h0.to(torch.float16)
        h_ring = torch.empty(2, batch, hidden, device=y.device, dtype=torch.float16)
    spans = [(0, t_len)] if persistent else [(t, 1) for t in range(t_len)]
    for t_first, n_steps in spans:
        launch(lstm_seq_fwd_kernel, tiles.fwd_grid,
            xp, bias, h0, w_hh, cs, y, gates, counter, w_unscale, h0_unscale, h_ring,
            t_first, n_steps, batch, hidden,
            HAS_BIAS=bias is not None, PERSISTENT=persistent, RESIDENT=tiles.resident, DOT=tiles.dot,
            HALF=tiles.half, BLOCK_B=tiles.block_b, BLOCK_U=tiles.fwd_block_u, BLOCK_K=tiles.fwd_block_k,
            num_warps=SEQ_NUM_WARPS,
        )  # fmt: skip


def _bwd_seq(
    dy: Tensor,
    dh_n: Tensor,
    w_hh: Tensor,
    gates: Tensor,
    cs: Tensor,
    dc: Tensor,
    dg: Tensor,
    tiles: _SeqTiles,
    persistent: bool,
) -> None:
    """The backward recurrence with the sequence kernel, t = T-1 down to 0 (see the kernel): one launch
    when `persistent`, else one a step; dc holds dc_n on entry and dc0 on exit."""
    t_len, batch, hidden = dy.shape
    counter = torch.zeros(1, device=dy.device, dtype=torch.int32)
    # dgates of the last two steps in the dot's operand layout, in w_hh's dtype (see the kernel); zeros,
    # which the kernel's unmasked loads read past H and B, and step T-1 as its dgates_T.
    rows = cdiv(hidden, tiles.bwd_block_k) * tiles.bwd_block_k
    cols = (2 if tiles.bwd_split else 1) * 4 * tiles.bwd_block_b
    dgates = w_hh.new_zeros(2, rows, cols)
    spans = [(t_len - 1, t_len)] if persistent else [(t, 1) for t in range(t_len - 1, -1, -1)]
    for t_first, n_steps in spans:
        launch(lstm_seq_bwd_kernel, tiles.bwd_grid,
            dy, dh_n, w_hh, gates, cs, dc, dg, dgates, counter, t_first, n_steps, t_len, batch, hidden,
            PERSISTENT=persistent, RESIDENT=tiles.bwd_resident, SPLIT=tiles.bwd_split,
            PREFETCH=tiles.bwd_prefetch, DOT=tiles.dot,
            BLOCK_B=tiles.bwd_block_b, BLOCK_U=tiles.bwd_block_u, BLOCK_K=tiles.bwd_block_k, KS=rows,
            num_warps=tiles.bwd_num_warps,
        )  # fmt: skip


def _fwd_steps(
    xp: Tensor,
    bias: Tensor | None,
    h0: Tensor,
    w_hh: Tensor,
    cs: Tensor,
    y: Tensor,
    gates: Tensor,
    tiles: _Tiles,
) -> None:
    """The forward recurrence: one launch per step over the preallocated buffers (see the kernel)."""
    t_len, batch, hidden = y.shape
    for t in range(t_len):
        launch(lstm_step_fwd_kernel, tiles.grid,
            xp, bias, h0 if t == 0 else y[t - 1], w_hh, cs, y, gates, t, batch, hidden,
            HAS_BIAS=bias is not None, DOT=tiles.dot,
            BLOCK_B=tiles.block_b, BLOCK_H=BLOCK_H, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
        )  # fmt: skip


def _bwd_steps(
    dy: Tensor, dh_n: Tensor, w_hh: Tensor, gates: Tensor, cs: Tensor, dc: Tensor, dg: Tensor, tiles: _Tiles
) -> None:
    """The backward recurrence: one launch per step, t = T-1 down to 0 (see the kernel); dc holds dc_n
    on entry and dc0 on exit."""
    t_len, batch, hidden = dy.shape
    for t in range(t_len - 1, -1, -1):
        last = t == t_len - 1
        launch(lstm_step_bwd_kernel, tiles.grid,
            dy, dh_n, dg[t + 1] if not last else dg[t], w_hh, gates, cs, dc, dg, t, batch, hidden,
            LAST=last, SPLIT=w_hh.dtype != torch.float32, DOT=tiles.dot,
            BLOCK_B=tiles.block_b, BLOCK_H=BLOCK_H, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
        )  # fmt: skip


class _StepGraphs:
    """CUDA graphs of the per-step launch loops, by (direction, shape, dtype, device, stream), least
    recently used first out.

    A loop of T launches from Python costs ~5 µs of host time each (T = 1000: ~5 ms, as long as the
    whole forward on the GPU), so each loop is captured once and replayed. A graph reads and writes
    its own static buffers (`buffers`): a call copies its inputs in, replays, and copies out what it
    keeps. The stream is part of the key, so calls on one entry are ordered by their stream and a
    replay never overwrites buffers another call still reads. At most `capacity` graphs (and their
    buffers, about T·B·4H·8 bytes each) are held.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, dict[str, Tensor]]] = OrderedDict()

    def get(
        self,
        key: tuple,
        device: torch.device,
        make: Callable[[], dict[str, Tensor]],
        run: Callable[[dict[str, Tensor]], None],
    ) -> tuple[torch.cuda.CUDAGraph, dict[str, Tensor]]:
        """The graph of `key` on `device` and its buffers; on a miss, `make()` allocates the buffers and
        `run(buffers)` launches the loop once (compiling and binding every kernel outside the
        capture) and then under the capture. The caller fills the inputs and replays (with `device`
        current: a graph replays on the current device's stream)."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry
        with torch.cuda.device(device):
            buffers = make()
            run(buffers)
            graph = torch.cuda.CUDAGraph()
            # Captured on a side stream of its own. thread_local: the backward captures on autograd's
            # device thread, and only this thread's CUDA calls can break the capture (it allocates nothing).
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                run(buffers)
        self._entries[key] = entry = (graph, buffers)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return entry

    def clear(self) -> None:
        """Drop every graph and its buffers."""
        self._entries.clear()


# Forward and backward graphs of the most recent shapes: a model with a few LSTM layer shapes (layers,
# directions) trains without re-capturing, and the buffers held stay bounded.
_GRAPHS = _StepGraphs(capacity=8)


def _use_graphs(x: Tensor) -> bool:
    """Whether the step loops replay a CUDA graph: on CUDA with compiled kernels, while nothing traces
    the call (torch.compile, the custom op's dispatch) and the caller is not capturing a graph itself
    (then the launches go into the caller's graph)."""
    return (
        x.is_cuda
        and not interpreting()
        and not wraps_launches()
        and not torch.cuda.is_current_stream_capturing()
    )


def _graph_key(direction: str, x: Tensor, w_hh: Tensor, has_bias: bool) -> tuple:
    t_len, batch, _ = x.shape
    stream = torch.cuda.current_stream(x.device).stream_id
    dot = recurrence_dot(w_hh)  # a changed TF32 setting needs a new graph
    return (direction, t_len, batch, w_hh.shape[1], x.dtype, x.device, stream, has_bias, dot)


if HAS_TRITON:

    @hfkit_op("lstm_layer_fwd")
    def _lstm_fwd(
        x: Tensor,
        h0: Tensor,
        c0: Tensor,
        w_ih: Tensor,
        w_hh: Tensor,
        b_ih: Tensor | None,
        b_hh: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """y, h_n, c_n and, for the backward, every step's cell state cs [T+1, B, H] (cs[0] = c0) and
        activated gates [T, B, 4H], both float32."""
        t_len, batch, n_in = x.shape
        hidden = w_hh.shape[1]
        w_hh = w_hh.contiguous()
        tiles = _tiles(x, w_hh)
        bias = None
        if b_ih is not None or b_hh is not None:
            # Added in float32 inside the kernel (a bf16 sum would round the bias twice).
            bias = sum(b.float() for b in (b_ih, b_hh) if b is not None)

        def project(out: Tensor) -> None:
            rows = t_len * batch
            with _products_like_cudnn(w_hh):
                torch.matmul(x.reshape(rows, n_in), w_ih.t(), out=out.view(rows, 4 * hidden))

        seq_tiles = _seq_tiles(x, w_hh)
        if seq_tiles is not None or not _use_graphs(x):
            xp = x.new_empty(t_len, batch, 4 * hidden)
            project(xp)
            y = x.new_empty(t_len, batch, hidden)
            cs = torch.empty(t_len + 1, batch, hidden, device=x.device, dtype=torch.float32)
            cs[0] = c0
            gates = torch.empty(t_len, batch, 4 * hidden, device=x.device, dtype=torch.float32)
            if seq_tiles is not None:
                _fwd_seq(xp, bias, h0.contiguous(), w_hh, cs, y, gates, seq_tiles, _one_launch(x))
            else:
                _fwd_steps(xp, bias, h0.contiguous(), w_hh, cs, y, gates, tiles)
            return y, y[-1].clone(), cs[-1].to(x.dtype, copy=True), cs, gates

        def make() -> dict[str, Tensor]:
            f32 = {"device": x.device, "dtype": torch.float32}
            return {
                "xp": x.new_empty(t_len, batch, 4 * hidden),
                "bias": torch.zeros(4 * hidden, **f32) if bias is not None else None,
                "h0": x.new_zeros(batch, hidden),
                "w_hh": torch.zeros_like(w_hh),
                "cs": torch.zeros(t_len + 1, batch, hidden, **f32),
                "y": x.new_empty(t_len, batch, hidden),
                "gates": torch.empty(t_len, batch, 4 * hidden, **f32),
            }

        def run(s: dict[str, Tensor]) -> None:
            _fwd_steps(s["xp"], s["bias"], s["h0"], s["w_hh"], s["cs"], s["y"], s["gates"], tiles)

        graph, s = _GRAPHS.get(_graph_key("fwd", x, w_hh, bias is not None), x.device, make, run)
        project(s["xp"])
        if bias is not None:
            s["bias"].copy_(bias)
        s["h0"].copy_(h0)
        s["w_hh"].copy_(w_hh)
        s["cs"][0].copy_(c0)
        with torch.cuda.device(x.device):
            graph.replay()
        y = s["y"].clone()
        cs = s["cs"].clone()
        return y, y[-1].clone(), cs[-1].to(x.dtype, copy=True), cs, s["gates"].clone()

    @hfkit_op("lstm_layer_bwd")
    def _lstm_bwd(
        dy: Tensor,
        dh_n: Tensor,
        dc_n: Tensor,
        x: Tensor,
        h0: Tensor,
        w_ih: Tensor,
        w_hh: Tensor,
        y: Tensor,
        cs: Tensor,
        gates: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """dx, dh0, dc0, dw_ih, dw_hh and the bias gradient db [4H] (float32; the same for b_ih and b_hh)."""
        t_len, batch, n_in = x.shape
        hidden = w_hh.shape[1]
        w_hh = w_hh.contiguous()
        tiles = _tiles(x, w_hh)
        f32 = {"device": x.device, "dtype": torch.float32}
        seq_tiles = _seq_tiles(x, w_hh)
        if seq_tiles is not None or not _use_graphs(x):
            dg = torch.empty(t_len, batch, 4 * hidden, **f32)
            dc = dc_n.to(torch.float32, copy=True)  # the kernels update it in place
            dy, dh_n = dy.contiguous(), dh_n.contiguous()
            if seq_tiles is not None:
                _bwd_seq(dy, dh_n, w_hh, gates, cs, dc, dg, seq_tiles, _one_launch(x))
            else:
                _bwd_steps(dy, dh_n, w_hh, gates, cs, dc, dg, tiles)
        else:

            def make() -> dict[str, Tensor]:
                return {
                    "dy": x.new_zeros(t_len, batch, hidden),
                    "dh_n": x.new_zeros(batch, hidden),
                    "w_hh": torch.zeros_like(w_hh),
                    "gates": torch.zeros(t_len, batch, 4 * hidden, **f32),
                    "cs": torch.zeros(t_len + 1, batch, hidden, **f32),
                    "dc": torch.zeros(batch, hidden, **f32),
                    "dg": torch.empty(t_len, batch, 4 * hidden, **f32),
                }

            def run(s: dict[str, Tensor]) -> None:
                _bwd_steps(s["dy"], s["dh_n"], s["w_hh"], s["gates"], s["cs"], s["dc"], s["dg"], tiles)

            graph, s = _GRAPHS.get(_graph_key("bwd", x, w_hh, False), x.device, make, run)
            for name, t in (("dy", dy), ("dh_n", dh_n), ("w_hh", w_hh), ("gates", gates), ("cs", cs)):
                s[name].copy_(t)
            s["dc"].copy_(dc_n)
            with torch.cuda.device(x.device):
                graph.replay()
            # Read below on this stream before any later replay of this graph (same stream: the key).
            dg, dc = s["dg"], s["dc"].clone()
        # The matmuls over every step at once, in x's dtype (float32 accumulation).
        dg_x = dg.to(x.dtype).view(t_len * batch, 4 * hidden)
        h_prev = torch.cat([h0.unsqueeze(0), y[:-1]]).view(t_len * batch, hidden)
        with _products_like_cudnn(w_hh):
            dx = (dg_x @ w_ih).view(t_len, batch, n_in)
            # float32: dh0 sums over the whole sequence's recurrence, like dc0 (small: [B, 4H] @ [4H, H]).
            dh0 = (dg[0] @ w_hh.float()).to(x.dtype)
            dw_ih = dg_x.t() @ x.reshape(t_len * batch, n_in)
            dw_hh = dg_x.t() @ h_prev
        db = dg.view(t_len * batch, 4 * hidden).sum(dim=0)
        return dx, dh0, dc.to(x.dtype), dw_ih, dw_hh, db

    def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        x, h0, _c0, w_ih, w_hh, b_ih, b_hh = inputs
        y, _h_n, _c_n, cs, gates = output
        ctx.mark_non_differentiable(cs, gates)
        # No zero-filled gradients for cs and gates ([T, B, 4 H] each); the outputs' are made below.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, h0, w_ih, w_hh, y, cs, gates)
        ctx.bias_dtypes = (
            b_ih.dtype if b_ih is not None else None,
            b_hh.dtype if b_hh is not None else None,
        )

    def _backward(ctx: Any, dy: Tensor | None, dh_n: Tensor | None, dc_n: Tensor | None, _dcs: Any, _dg: Any):
        x, h0, w_ih, w_hh, y, cs, gates = ctx.saved_tensors
        dy = dy if dy is not None else torch.zeros_like(y)
        dh_n = dh_n if dh_n is not None else torch.zeros_like(h0)
        dc_n = dc_n if dc_n is not None else torch.zeros_like(h0)
        dx, dh0, dc0, dw_ih, dw_hh, db = _lstm_bwd(dy, dh_n, dc_n, x, h0, w_ih, w_hh, y, cs, gates)
        db_ih, db_hh = (db.to(dtype) if dtype is not None else None for dtype in ctx.bias_dtypes)
        return dx, dh0, dc0, dw_ih, dw_hh, db_ih, db_hh

    _lstm_fwd.autograd(_backward, _setup_context)
