"""Fused elementwise ops of the Evoformer: the attention output gate and bias + shared dropout + residual.

`sigmoid_gate(g, o, bias)` is `sigmoid(g + bias) * o`, the gate of every gated attention (AF2
supplement Algorithm 7 line 6 and the ones that copy it). `bias_dropout_add(x, residual, bias, p, ...)`
is `residual + dropout(x + bias)`, the residual update after each Evoformer sub-layer, with the dropout
mask shared along one dim (row-wise or column-wise dropout, supplement 1.11.6). `row_scale(x, s)` is
`x * s` (or `x / s`) for a factor per row s [*, 1], the transitions' masks and the outer product mean's
normalization (`row_scale_add_` adds the result into a tensor in place, for inference): torch broadcasts
such a factor through its strided (unvectorized) kernel, 1.5-2x the time of a plain elementwise pass at
AlphaFold's sizes on an H200. Eager PyTorch runs each of these as two or three kernels with a full-size
temporary between them; here each is one pass forward and one backward. The dropout keep/drop decisions
come from Philox (`tl.rand`) keyed by a seed and the position in the shared mask, so no mask is stored:
the backward draws the same numbers again. On CUDA (and on CPU under `TRITON_INTERPRET=1`) the ops run
the kernels below, registered as `hfkit::*` custom ops through `torch.library.triton_op`; everywhere
else they run the references, which are the plain-torch code the Evoformer runs without hfkit.
Arithmetic is float32 in the kernels.
"""

from __future__ import annotations

import math

import torch

from hfkit.ops._checks import check_float, check_no_autograd, check_optional, check_same_device
from hfkit.ops._triton import HAS_TRITON, cdiv, hfkit_op, launch, next_power_of_2, rows_view, triton_can_run

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "bias_dropout_add",
    "bias_dropout_add_reference",
    "dropout_keep_mask",
    "row_scale",
    "row_scale_add_",
    "row_scale_reference",
    "sigmoid_gate",
    "sigmoid_gate_backward",
    "sigmoid_gate_forward",
    "sigmoid_gate_reference",
    "uses_triton",
]

_TILE = 2048  # elements a program: 16 a thread with 4 warps (untuned)
_INT32_MAX = 2**31 - 1


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types (as the kernels compute), the dtype itself otherwise: no CPU slowdown."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# ----------------------------------------------------------------------------- references


def sigmoid_gate_reference(
    g: torch.Tensor, o: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain-torch gate: `sigmoid(g + bias) * o`, the specification the kernels are tested against.

    g, o: same shape [*, N]; bias: g's trailing dims (e.g. [N]) or None. Computed in float32 for half
    inputs (in the inputs' dtype otherwise) and returned in the promoted dtype of g and o.
    """
    out = torch.promote_types(g.dtype, o.dtype)
    compute = _compute_dtype(out)
    a = g.to(compute)
    if bias is not None:
        a = a + bias.to(compute)
    return (torch.sigmoid(a) * o.to(compute)).to(out)


def bias_dropout_add_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    bias: torch.Tensor | None = None,
    p: float = 0.0,
    training: bool = True,
    shared_dim: int | None = None,
    generator: torch.Generator | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch `residual + dropout(x + bias)` with the dropout mask shared along `shared_dim`.

    x, residual: same shape; bias: x's last dim [C] or None. In training with p > 0 each element of a
    keep mask of x's shape with size 1 at `shared_dim` (the full shape when None) is 1 with probability
    1 - p (drawn with `bernoulli_` from `generator`, or given as `keep`), and `x + bias` is multiplied by
    `keep / (1 - p)`; otherwise this is `residual + x + bias`. Half inputs are computed in float32; the
    result has the promoted dtype of x and residual. This is the Evoformer's own code
    (`SharedDropout`), so on CPU the fallback costs what the model cost before.
    """
    out = torch.promote_types(x.dtype, residual.dtype)
    compute = _compute_dtype(out)
    a = x.to(compute)
    if bias is not None:
        a = a + bias.to(compute)
    if training and p > 0.0:
        if keep is None:
            keep = torch.empty(_mask_shape(x.shape, shared_dim), dtype=compute, device=x.device)
            keep.bernoulli_(1.0 - p, generator=generator)
        a = a * keep.to(compute) / (1.0 - p)
    return (residual.to(compute) + a).to(out)


def row_scale_reference(x: torch.Tensor, scale: torch.Tensor, divide: bool = False) -> torch.Tensor:
    """Plain torch: `x / scale` with `divide`, else `x * scale`."""
    return x / scale if divide else x * scale


def _mask_shape(shape: torch.Size | tuple[int, ...], shared_dim: int | None) -> list[int]:
    mask = list(shape)
    if shared_dim is not None:
        mask[shared_dim] = 1
    return mask


# ----------------------------------------------------------------------------- checks and dispatch


def _check_pair(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    check_float(a_name, a)
    check_float(b_name, b)
    if a.shape != b.shape:
        raise ValueError(f"{b_name}: expected {a_name}'s shape {list(a.shape)}, got {list(b.shape)}")
    check_same_device(b_name, b, a_name, a)


def _check_bias(bias: torch.Tensor | None, x: torch.Tensor, x_name: str, trailing_only: bool) -> None:
    check_optional("bias", bias, None, x_name, x)
    if bias is None:
        return
    k = bias.dim()
    ok = 1 <= k <= x.dim() and tuple(bias.shape) == tuple(x.shape[x.dim() - k :])
    if trailing_only and k != 1:
        ok = False
    if not ok:
        want = f"[{x.shape[-1]}]" if trailing_only else f"trailing dims of {list(x.shape)}"
        raise ValueError(f"bias: expected shape {want} (broadcast over {x_name}), got {list(bias.shape)}")


def uses_triton(*tensors: torch.Tensor) -> bool:
    """Whether the elementwise ops take the Triton path for these tensors (CUDA, or CPU under
    TRITON_INTERPRET=1 outside torch.compile; float32/bfloat16/float16 each)."""
    return all(triton_can_run(t) for t in tensors)


def sigmoid_gate(g: torch.Tensor, o: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fused `sigmoid(g + bias) * o` with autograd: one kernel forward, one backward.

    g: [*, N] gate pre-activations (a linear's output, e.g. `linear_g(q_x)` viewed as [*, Q, H, C]);
    o: g's shape, the gated values; bias: g's trailing dims (e.g. [H, C]) or None, for a gate linear
    run without its bias (its gradient is summed over the leading dims). float32, bfloat16 and float16,
    any leading shape, contiguous or not; the output has the promoted dtype of g and o, gradients keep
    each input's dtype. Raises ValueError naming the argument on bad shapes, dtypes or devices.
    """
    _check_pair("g", g, "o", o)
    _check_bias(bias, g, "g", trailing_only=False)
    if not uses_triton(g, o) or g.numel() == 0 or (bias is not None and not triton_can_run(bias)):
        return sigmoid_gate_reference(g, o, bias)
    # The kernels index the bias by column: unit stride (a copy of its few elements at most).
    return _sigmoid_gate_fwd(g, o, bias.contiguous() if bias is not None else None)


def sigmoid_gate_forward(g: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """`sigmoid_gate(g, o)` by the forward kernel, without its checks: for callers on the Triton path
    (`uses_triton`, non-empty) that checked g and o already and run the gate inside their own
    autograd (`hfkit.ops.gated_linear`)."""
    return _sigmoid_gate_fwd(g, o, None)


def sigmoid_gate_backward(
    dy: torch.Tensor, g: torch.Tensor, o: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients (dg, do) of `sigmoid_gate(g, o, bias)` for its output gradient dy, by the backward
    kernel (dg, do keep g's and o's dtypes): for callers on the Triton path (`uses_triton`) that run the
    gate inside their own autograd (`hfkit.ops.gated_linear`)."""
    return _sigmoid_gate_bwd(dy, g, o, bias)


def row_scale(x: torch.Tensor, scale: torch.Tensor, divide: bool = False) -> torch.Tensor:
    """`x * scale` (`x / scale` with `divide`) for a factor per row, scale [*, 1] with x [*, C]: one
    vectorized pass forward and one backward (dx = dy * scale, or dy / scale).

    The result has torch's promoted dtype of x and scale; the factor gets no gradient (masks and the
    counts made from them): a scale that requires grad, or one of another shape (broadcast along the
    leading dims), runs `row_scale_reference`, as do the other places `uses_triton` excludes. Raises
    ValueError naming the argument on bad shapes, dtypes or devices.
    """
    check_float("x", x)
    check_float("scale", scale)
    check_same_device("scale", scale, "x", x)
    if x.dim() == 0 or scale.dim() != x.dim() or scale.shape[-1] != 1:
        raise ValueError(f"scale: expected [*, 1] for x {list(x.shape)}, got {list(scale.shape)}")
    if scale.shape[:-1] != x.shape[:-1] or scale.requires_grad or not uses_triton(x, scale) or x.numel() == 0:
        return row_scale_reference(x, scale, divide)
    return _row_scale(x, scale, divide)


def row_scale_add_(
    z: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, divide: bool = False
) -> torch.Tensor:
    """`z += row_scale(x, scale, divide)` in place, without autograd (inference: the outer product
    mean's normalized update added to the pair representation in one pass); returns z. z: x's shape,
    contiguous, in x's dtype for the kernel (otherwise, and where `row_scale` runs its reference, the
    scaled x is added by torch). Raises RuntimeError where autograd would need a graph."""
    check_no_autograd("row_scale_add_", z, x, scale)
    if z.shape != x.shape:
        raise ValueError(f"z: expected x's shape {list(x.shape)}, got {list(z.shape)}")
    fused = z.is_contiguous() and z.dtype == torch.promote_types(x.dtype, scale.dtype)
    if not fused or scale.shape[:-1] != x.shape[:-1] or not uses_triton(z, x, scale) or x.numel() == 0:
        return z.add_(row_scale(x, scale, divide))
    _row_scale_add(z, x, scale, divide)
    return z


def bias_dropout_add(
    x: torch.Tensor,
    residual: torch.Tensor,
    bias: torch.Tensor | None = None,
    p: float = 0.0,
    training: bool = True,
    shared_dim: int | None = None,
    *,
    seed: int | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Fused `residual + dropout(x + bias)`, the dropout mask shared along `shared_dim`, with autograd.

    x, residual: same shape [*, C] (e.g. an update and the pair representation z [*, N, N, C]); bias:
    [C] or None; p in [0, 1): drop probability (kept values are scaled by 1 / (1 - p)); training: False
    (or p = 0) makes it `residual + x + bias`; shared_dim: the dim along which one keep/drop decision
    is shared (-3: row-wise, -2: column-wise dropout of [*, N_i, N_j, C], as `DropoutRowwise` /
    `DropoutColumnwise`) or None for ordinary dropout. The decisions come from Philox keyed by `seed`
    (an int or a one-element int64 tensor on x's device) and the mask position: deterministic given the
    seed, and regenerated in backward, so no mask is stored. Without a seed one is drawn from
    `generator` (default: the device's default generator, so `torch.manual_seed` and activation
    checkpointing's RNG replay reproduce it). The kernel and the CPU reference (`bernoulli_`) draw
    different masks from the same seed, with the same distribution. Output: the promoted dtype of x
    and residual; gradients keep each input's dtype. Raises ValueError naming the argument.
    """
    _check_pair("x", x, "residual", residual)
    _check_bias(bias, x, "x", trailing_only=True)
    if x.dim() == 0:
        raise ValueError("x: expected at least one dim (the channel dim), got a 0-d tensor")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"p: expected a probability in [0, 1), got {p!r}")
    if shared_dim is not None:
        if isinstance(shared_dim, bool) or not isinstance(shared_dim, int):
            raise ValueError(f"shared_dim: expected an int or None, got {shared_dim!r}")
        if not -x.dim() <= shared_dim < x.dim():
            raise ValueError(f"shared_dim: expected a dim of x in [{-x.dim()}, {x.dim()}), got {shared_dim}")
        shared_dim %= x.dim()
    _check_seed(seed, x.device)
    dropout = bool(training) and p > 0.0
    fused = uses_triton(x, residual) and x.numel() > 0 and (bias is None or triton_can_run(bias))
    if not fused:
        if dropout and seed is not None and generator is None:
            generator = torch.Generator(x.device).manual_seed(int(seed))
        return bias_dropout_add_reference(x, residual, bias, p, training, shared_dim, generator)
    if not dropout and bias is None:
        return residual + x  # one kernel already
    seed_t = _seed_tensor(seed, generator, x.device) if dropout else None
    bias = bias.contiguous() if bias is not None else None  # indexed by channel: unit stride
    return _bias_dropout_add_fwd(
        x, residual, bias, seed_t, float(p) if dropout else 0.0, -1 if shared_dim is None else shared_dim
    )


def _seed_tensor(
    seed: int | torch.Tensor | None, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """A one-element int64 seed on `device`: the given one, or drawn from `generator` on the device
    (no host sync, and capturable in a CUDA graph)."""
    if seed is None:
        return torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64, generator=generator)
    _check_seed(seed, device)
    if isinstance(seed, torch.Tensor):
        return seed.reshape(1)
    return torch.tensor([seed], dtype=torch.int64, device=device)


def _check_seed(seed: object, device: torch.device) -> None:
    if seed is None:
        return
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.dtype != torch.int64 or seed.device != device:
            raise ValueError(
                f"seed: expected a one-element int64 tensor on {device}, got {seed.dtype} "
                f"{list(seed.shape)} on {seed.device}"
            )
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed: expected an int in [0, 2**63), a tensor or None, got {seed!r}")


def dropout_keep_mask(
    shape: tuple[int, ...] | torch.Size,
    p: float,
    shared_dim: int | None,
    seed: int | torch.Tensor,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The keep mask (float32 0/1, x's shape with size 1 at `shared_dim`) that `bias_dropout_add`'s
    kernel realises for this seed: for tests and for checking the statistics. Needs the Triton path
    (CUDA, or CPU under TRITON_INTERPRET=1)."""
    device = torch.device(device)
    probe = torch.empty(0, device=device)
    if not triton_can_run(probe):
        raise ValueError(
            f"device: the Triton kernels cannot run on {device} here (CPU needs TRITON_INTERPRET=1)"
        )
    if shared_dim is not None:
        shared_dim %= len(shape)
    mask = torch.empty(_mask_shape(tuple(shape), shared_dim), dtype=torch.float32, device=device)
    n = mask.numel()
    if n:
        seed_t = _seed_tensor(seed, None, device)
        _keep_mask_kernel[(cdiv(n, _TILE),)](seed_t, mask, n, float(p), MASK64=n > _INT32_MAX, BLOCK=_TILE)
    return mask


# ----------------------------------------------------------------------------- layouts


def _gate_layout(g: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int]:
    """(M, N): g viewed as [M, N] rows, N = bias.numel() (or g's last dim), bias indexed by column."""
    n = bias.numel() if bias is not None else (g.shape[-1] if g.dim() else 1)
    return g.numel() // n, n


def _dropout_layout(shape: torch.Size, shared_dim: int) -> tuple[int, int, int, int, int, int]:
    """(R, B, S, MB, MC, C) of x viewed as [R, B] rows for the kernel.

    Element (r, b) has mask index `(r // S) * MB + b * MC` and channel `b % C`: with a shared dim d
    (not the last) the view is [prod(shape[:d+1]), prod(shape[d+1:])] and S = shape[d] rows share a
    mask row; with d the last dim the view is [prod(shape[:-1]), C] and a row shares one decision;
    without a shared dim (d = -1) it is [numel / C, C] with one decision per element.
    """
    c = shape[-1]
    numel = math.prod(shape)
    ndim = len(shape)
    if shared_dim < 0:
        return numel // c, c, 1, c, 1, c
    if shared_dim == ndim - 1:
        return numel // c, c, 1, 1, 0, c
    b = math.prod(shape[shared_dim + 1 :])
    return numel // b, b, shape[shared_dim], b, 1, c


def _tile(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a [M, n] elementwise pass: about `_TILE` elements a program."""
    block_n = min(next_power_of_2(max(n, 1)), _TILE)
    return _TILE // block_n, block_n, 4


def _dropout_tile(b: int, s: int) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, ROW_SHARED) for the dropout kernels on a [R, b] view whose runs of
    s rows share a mask row: where s has a power-of-two factor >= 4, tiles of up to 16 rows that never
    straddle two mask rows, so each program draws its keep flags once per column."""
    rows = min(16, s & -s)  # the largest power of two dividing s
    if s > 1 and rows >= 4:
        block_n = min(next_power_of_2(max(b, 1)), _TILE // rows)
        return rows, block_n, 4, True
    return (*_tile(b), False)


# ----------------------------------------------------------------------------- kernels

if HAS_TRITON:

    @triton.jit
    def _tile_indices(n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # Row and column indices of this program's [BLOCK_M, BLOCK_N] tile of an [M, n_cols] view. The
        # grid is 1-D (row block major), since CUDA caps the second grid dim at 65535 blocks.
        col_blocks = tl.cdiv(n_cols, BLOCK_N)
        pid = tl.program_id(0)
        rows = ((pid // col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        return rows, cols

    @triton.jit
    def _gate_fwd_kernel(
        G, O, Bias, Y, M, N, stride_g, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        # Traffic: read g and o, write y (3 passes; eager: sigmoid, then the product = 5). g's rows may
        # lie stride_g apart (a column slice of a wider projection).
        rows, cols = _tile_indices(N, BLOCK_M, BLOCK_N)
        ok = (rows < M)[:, None] & (cols < N)[None, :]
        offs = rows[:, None] * N + cols[None, :]
        g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            g += tl.load(Bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        o = tl.load(O + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + offs, (tl.sigmoid(g) * o).to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _gate_bwd_kernel(
        G, O, Bias, DY, DG, DO, M, N,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # Traffic: read g, o, dy; write dg (= d/d(g + bias)) and do. s is recomputed, not stored.
        rows, cols = _tile_indices(N, BLOCK_M, BLOCK_N)
        ok = (rows < M)[:, None] & (cols < N)[None, :]
        offs = rows[:, None] * N + cols[None, :]
        g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            g += tl.load(Bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        o = tl.load(O + offs, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        tl.store(DO + offs, (dy * s).to(DO.dtype.element_ty), mask=ok)
        tl.store(DG + offs, (dy * o * s * (1.0 - s)).to(DG.dtype.element_ty), mask=ok)

    @triton.jit
    def _row_scale_kernel(
        X, Scale, Y, M, N,
        DIVIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACCUMULATE: tl.constexpr,
    ):  # fmt: skip
        # Traffic: read x, write y (2 passes; the factors are one value a row); with ACCUMULATE
        # y += x * s (`row_scale_add_`: 3 passes where the scale and an add take 5).
        rows, cols = _tile_indices(N, BLOCK_M, BLOCK_N)
        row_ok = rows < M
        ok = row_ok[:, None] & (cols < N)[None, :]
        offs = rows[:, None] * N + cols[None, :]
        x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(Scale + rows, mask=row_ok, other=1.0).to(tl.float32)[:, None]
        y = x / s if DIVIDE else x * s
        if ACCUMULATE:
            y += tl.load(Y + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _keep(Seed, rows, cols, S, MB, MC, p, MASK64: tl.constexpr, ROW_SHARED: tl.constexpr):
        # Keep flags of a [BLOCK_M, BLOCK_N] tile from Philox(seed, mask index); rows with the same
        # r // S share a mask row. Philox is ~100 integer ops a draw, more than the memory time of an
        # element, so with ROW_SHARED (every row of the tile in one mask row) it draws once per column.
        if ROW_SHARED:
            idx = (tl.min(rows) // S) * MB + cols * MC
        else:
            idx = ((rows // S) * MB)[:, None] + (cols * MC)[None, :]
        idx = idx.to(tl.int64) if MASK64 else idx.to(tl.int32)
        keep = tl.rand(tl.load(Seed), idx) >= p
        if ROW_SHARED:
            keep = keep[None, :]
        return keep

    @triton.jit
    def _bias_dropout_add_kernel(
        X, Res, Bias, Seed, Y, R, B, S, MB, MC, C, p, scale,
        HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, MASK64: tl.constexpr, ROW_SHARED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # Float arguments in float32 (torch.compile passes Python floats as float64 scalars).
        p = tl.cast(p, tl.float32)
        scale = tl.cast(scale, tl.float32)
        # Traffic: read x and residual, write y (3 passes; eager: bernoulli mask, x * mask, / (1 - p),
        # + residual, + bias = 4-5 kernels and a mask tensor kept for backward). x viewed as [R, B].
        rows, cols = _tile_indices(B, BLOCK_M, BLOCK_N)
        ok = (rows < R)[:, None] & (cols < B)[None, :]
        offs = rows[:, None] * B + cols[None, :]
        a = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            a += tl.load(Bias + cols % C, mask=cols < B, other=0.0).to(tl.float32)[None, :]
        if DROPOUT:
            a = tl.where(_keep(Seed, rows, cols, S, MB, MC, p, MASK64, ROW_SHARED), a * scale, 0.0)
        r = tl.load(Res + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(Y + offs, (r + a).to(Y.dtype.element_ty), mask=ok)

    @triton.jit
    def _dropout_bwd_kernel(
        DY, DX, Seed, R, B, S, MB, MC, p, scale,
        MASK64: tl.constexpr, ROW_SHARED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # Float arguments in float32 (torch.compile passes Python floats as float64 scalars).
        p = tl.cast(p, tl.float32)
        scale = tl.cast(scale, tl.float32)
        # Traffic: read dy, write dx = dy * keep / (1 - p); keep is drawn again from the seed.
        rows, cols = _tile_indices(B, BLOCK_M, BLOCK_N)
        ok = (rows < R)[:, None] & (cols < B)[None, :]
        offs = rows[:, None] * B + cols[None, :]
        dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
        dx = tl.where(_keep(Seed, rows, cols, S, MB, MC, p, MASK64, ROW_SHARED), dy * scale, 0.0)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=ok)

    @triton.jit
    def _keep_mask_kernel(Seed, Mask, n, p, MASK64: tl.constexpr, BLOCK: tl.constexpr):
        # Float arguments in float32 (torch.compile passes Python floats as float64 scalars).
        p = tl.cast(p, tl.float32)
        # The keep mask itself, in mask order: the same draws `_keep` makes (for tests/statistics).
        pid = tl.program_id(0).to(tl.int64) if MASK64 else tl.program_id(0)
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        keep = tl.rand(tl.load(Seed), idx) >= p
        tl.store(Mask + idx, keep.to(tl.float32), mask=idx < n)

    # ------------------------------------------------------------------------- custom ops

    @hfkit_op("sigmoid_gate_fwd")
    def _sigmoid_gate_fwd(g: torch.Tensor, o: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m, n = _gate_layout(g, bias)
        g2, oc = rows_view(g, n), o.contiguous()  # g read in place where its rows are equally spaced
        y = torch.empty(g.shape, dtype=torch.promote_types(g.dtype, o.dtype), device=g.device)
        bm, bn, warps = _tile(n)
        launch(
            _gate_fwd_kernel,
            (cdiv(m, bm) * cdiv(n, bn),),
            g2,
            oc,
            bias,
            y,
            m,
            n,
            g2.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=bm,
            BLOCK_N=bn,
            num_warps=warps,
        )
        return y

    @hfkit_op("sigmoid_gate_bwd")
    def _sigmoid_gate_bwd(
        dy: torch.Tensor, g: torch.Tensor, o: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        gc, oc, dyc = g.contiguous(), o.contiguous(), dy.contiguous()
        dg = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        do = torch.empty(o.shape, dtype=o.dtype, device=o.device)
        m, n = _gate_layout(g, bias)
        bm, bn, warps = _tile(n)
        launch(_gate_bwd_kernel, (cdiv(m, bm) * cdiv(n, bn),),
            gc, oc, bias, dyc, dg, do, m, n,
            HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
        )  # fmt: skip
        return dg, do

    def _gate_setup_context(ctx, inputs, output) -> None:
        g, o, bias = inputs
        ctx.save_for_backward(g, o, bias)

    def _gate_backward(ctx, dy):
        g, o, bias = ctx.saved_tensors
        dg, do = _sigmoid_gate_bwd(dy, g, o, bias)
        dbias = None
        if bias is not None and ctx.needs_input_grad[2]:
            dbias = (
                dg.reshape(-1, bias.numel()).sum(0, dtype=torch.float32).reshape(bias.shape).to(bias.dtype)
            )
        return dg, do, dbias

    _sigmoid_gate_fwd.autograd(_gate_backward, _gate_setup_context)

    def _launch_row_scale(x, scale, y, divide: bool, accumulate: bool) -> None:
        """y = x * scale (x / scale), or y += that with `accumulate`; y contiguous, x's shape."""
        n = x.shape[-1]
        m = x.numel() // n
        bm, bn, warps = _tile(n)
        launch(_row_scale_kernel, (cdiv(m, bm) * cdiv(n, bn),),
            x.contiguous(), scale.contiguous(), y, m, n,
            DIVIDE=divide, BLOCK_M=bm, BLOCK_N=bn, ACCUMULATE=accumulate, num_warps=warps,
        )  # fmt: skip

    @hfkit_op("row_scale")
    def _row_scale(x: torch.Tensor, scale: torch.Tensor, divide: bool) -> torch.Tensor:
        y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, scale.dtype), device=x.device)
        _launch_row_scale(x, scale, y, divide, False)
        return y

    @hfkit_op("row_scale_add", mutates_args={"z"})
    def _row_scale_add(z: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, divide: bool) -> None:
        _launch_row_scale(x, scale, z, divide, True)

    def _row_scale_setup_context(ctx, inputs, output) -> None:
        x, scale, divide = inputs
        ctx.save_for_backward(scale)
        ctx.divide = divide
        ctx.x_dtype = x.dtype

    def _row_scale_backward(ctx, dy):
        (scale,) = ctx.saved_tensors
        # d(x * s)/dx = s and d(x / s)/dx = 1 / s: the same pass over dy, in x's dtype.
        return _row_scale(dy, scale, ctx.divide).to(ctx.x_dtype), None, None

    _row_scale.autograd(_row_scale_backward, _row_scale_setup_context)

    @hfkit_op("bias_dropout_add_fwd")
    def _bias_dropout_add_fwd(
        x: torch.Tensor,
        residual: torch.Tensor,
        bias: torch.Tensor | None,
        seed: torch.Tensor | None,
        p: float,
        shared_dim: int,
    ) -> torch.Tensor:
        xc, rc = x.contiguous(), residual.contiguous()
        y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        r, b, s, mb, mc, c = _dropout_layout(x.shape, shared_dim)
        bm, bn, warps, row_shared = _dropout_tile(b, s)
        dropout = seed is not None
        launch(_bias_dropout_add_kernel, (cdiv(r, bm) * cdiv(b, bn),),
            xc, rc, bias, seed, y, r, b, s, mb, mc, c, p, 1.0 / (1.0 - p),
            HAS_BIAS=bias is not None, DROPOUT=dropout, MASK64=dropout and x.numel() // s > _INT32_MAX,
            ROW_SHARED=row_shared, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
        )  # fmt: skip
        return y

    @hfkit_op("dropout_bwd")
    def _dropout_bwd(dy: torch.Tensor, seed: torch.Tensor, p: float, shared_dim: int) -> torch.Tensor:
        """dx = dy * keep / (1 - p) with the keep mask of `_bias_dropout_add_fwd` for this seed."""
        dyc = dy.contiguous()
        dx = torch.empty_like(dyc)
        r, b, s, mb, mc, _ = _dropout_layout(dy.shape, shared_dim)
        bm, bn, warps, row_shared = _dropout_tile(b, s)
        launch(_dropout_bwd_kernel, (cdiv(r, bm) * cdiv(b, bn),),
            dyc, dx, seed, r, b, s, mb, mc, p, 1.0 / (1.0 - p),
            MASK64=dy.numel() // s > _INT32_MAX, ROW_SHARED=row_shared,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
        )  # fmt: skip
        return dx

    def _bda_setup_context(ctx, inputs, output) -> None:
        x, residual, bias, seed, p, shared_dim = inputs
        ctx.save_for_backward(seed)
        ctx.p, ctx.shared_dim = p, shared_dim
        ctx.x_dtype, ctx.res_dtype = x.dtype, residual.dtype
        ctx.bias_meta = (bias.shape, bias.dtype) if bias is not None else None

    def _bda_backward(ctx, dy):
        (seed,) = ctx.saved_tensors
        dx = _dropout_bwd(dy, seed, ctx.p, ctx.shared_dim) if seed is not None else dy
        dbias = None
        if ctx.bias_meta is not None and ctx.needs_input_grad[2]:
            shape, dtype = ctx.bias_meta
            dbias = dx.reshape(-1, shape[0]).sum(0, dtype=torch.float32).to(dtype)
        return dx.to(ctx.x_dtype), dy.to(ctx.res_dtype), dbias, None, None, None

    _bias_dropout_add_fwd.autograd(_bda_backward, _bda_setup_context)
