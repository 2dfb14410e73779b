"""Memory-lean inference for long sequences: `lean_forward` runs an `EvoformerBlock`, `EvoformerStack`
or `ExtraMSAStack` (AF2 supplement Algorithms 6 and 18) without autograd, with every residual update
in place and every op chunked, so that the working set beyond m and z is a few chunks and at most one
stored [*, C, N, N] tensor at a time.

It calls the module's own submodules (LayerNorms, `Attention`s, the transitions' and outer product
mean's `_transition` / `_outer`, the triangle updates' projections), so parameters are shared, no copy
of the model is made, and the fused modules `hfkit.to_hfkit` swaps in run inside it (on CPU they run
their references). What each op keeps while it runs, with c the chunk size:

- MSA row attention with pair bias: the pair bias [*, H, N, N] (computed as many pair rows at a time as
  the c MSA rows' temporaries hold), then c MSA rows at a time; column attention (or the extra-MSA
  stack's global column attention): c residues.
- Transitions, MSA (c MSA rows) and pair (c pair rows): the [c, N, n C] hidden layer.
- Outer product mean: the two projections [*, S, N, C_opm], then c rows of the [c, N, C_z] update.
- Triangle multiplication: the update of row i needs the whole of one projection, so that one is
  stored once in the compute dtype, channel-first [*, C_h, N, N] (b for "outgoing", a for "incoming");
  the other projection, the output gate and the update are computed for c output rows (outgoing) or
  columns (incoming) at a time from rows (columns) of z that no earlier chunk has updated. A chunk of
  the whole axis runs the module itself (hfkit's fused kernels where they are swapped in).
- Triangle attention: the triangle bias [*, H, N, N], then c rows (starting node) or columns (ending
  node) at a time; a chunk of the whole axis runs the module itself.

Each residual update goes through the module's own in-place method (`add_update_` of the triangle
updates and attentions, `add_transition_`, `add_normalized_`): `z.add_(update)` in the model's modules;
hfkit's fused ones add inside the kernel that writes the update (`hfkit.ops.gated_linear_add_`, the
triangle update's output kernel, `hfkit.ops.row_scale_add_`), one pass over z instead of writing the
update and adding it.

With `offload_msa`, the MSA representation is copied to pinned host memory once the outer product mean
has read it and its device memory is released while the pair ops run; it is copied back before the
next block's MSA ops (and before returning). `chunk_size="auto"` picks, per op, the largest power of two
whose estimate `lean_working_set_bytes` fits in free device memory (`choose_chunk_size`), counting
the attention logits only where the attention holds them (not hfkit's fused attention on a GPU): the
attention's chunks may then be small while the triangle updates keep large, efficient matmuls.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hfkit.model.config import ModelConfig
from hfkit.model.evoformer import EvoformerBlock, EvoformerStack, ExtraMSAStack
from hfkit.model.msa import MSAColumnGlobalAttention
from hfkit.model.pair_transition import Transition
from hfkit.model.primitives import mask_bias
from hfkit.model.triangular_attention import TriangleAttention
from hfkit.model.triangular_multiplicative_update import TriangleMultiplicativeUpdate

__all__ = [
    "AUTO_MEMORY_FRACTION",
    "DEFAULT_CHUNK_SIZE",
    "LEAN_OPS",
    "BlockWidths",
    "choose_chunk_size",
    "free_device_memory",
    "lean_forward",
    "lean_working_set_bytes",
    "resolve_chunk_sizes",
]

# The ops of a block as `lean_forward` chunks them, in the order it runs them.
LEAN_OPS = (
    "msa_row_attention",
    "msa_column_attention",
    "msa_transition",
    "outer_product_mean",
    "triangle_multiplication",
    "triangle_attention",
    "pair_transition",
)
# Ops chunked along the S MSA rows (the others along the N residues or pair rows).
_MSA_ROW_OPS = frozenset({"msa_row_attention", "msa_transition"})
# The chunk `chunk_size="auto"` uses where free memory cannot be queried (any device but CUDA).
DEFAULT_CHUNK_SIZE = 64
# The share of free memory the estimated working set may take: the estimate leaves out allocator
# fragmentation and small temporaries.
AUTO_MEMORY_FRACTION = 0.9


@dataclass(frozen=True)
class BlockWidths:
    """The channel and head counts of an Evoformer block that its working set depends on."""

    c_m: int
    c_z: int
    heads_msa: int
    c_hidden_msa: int
    heads_pair: int
    c_hidden_pair: int
    c_hidden_mul: int
    c_hidden_opm: int
    transition_n: int

    @classmethod
    def from_config(cls, config: ModelConfig) -> BlockWidths:
        """The widths of an Evoformer block of `config` (what `from_block` reads from a built block),
        without building one."""
        return cls(
            c_m=config.c_m,
            c_z=config.c_z,
            heads_msa=config.no_heads_msa,
            c_hidden_msa=config.c_hidden_msa_att,
            heads_pair=config.no_heads_pair,
            c_hidden_pair=config.c_hidden_pair_att,
            c_hidden_mul=config.c_hidden_mul,
            c_hidden_opm=config.c_hidden_opm,
            transition_n=config.transition_n,
        )

    @classmethod
    def from_block(cls, block: EvoformerBlock) -> BlockWidths:
        """The widths of `block` (read from its submodules)."""
        core = block.core
        row_mha = block.msa_att_row.mha
        c_m = block.msa_att_row.layer_norm_m.normalized_shape[0]
        return cls(
            c_m=c_m,
            c_z=core.tri_mul_out.linear_g.out_features,
            heads_msa=row_mha.no_heads,
            c_hidden_msa=row_mha.c_hidden,
            heads_pair=core.tri_att_start.mha.no_heads,
            c_hidden_pair=core.tri_att_start.mha.c_hidden,
            c_hidden_mul=core.tri_mul_out.linear_a_p.out_features,
            c_hidden_opm=core.outer_product_mean.linear_1.out_features,
            transition_n=core.msa_transition.linear_1.out_features // c_m,
        )


def _attention_rows(rows: int, length: int, c: int, heads: int, c_hidden: int) -> int:
    """Elements a chunk of `rows` attention rows of `length` holds besides its logits: the normalised
    input and the output (c each) and q, k, v, the gate and o (heads x c_hidden each)."""
    return rows * length * (2 * c + 5 * heads * c_hidden)


def lean_working_set_bytes(
    widths: BlockWidths,
    n_seq: int,
    n_res: int,
    chunk_size: int,
    itemsize: int,
    batch: int = 1,
    logits: bool = True,
) -> dict[str, int]:
    """Estimated peak bytes each op of `lean_forward` allocates beyond m [B, S, N, C_m] and
    z [B, N, N, C_z] with chunks of `chunk_size`: the tensor the op stores whole plus the temporaries
    of one chunk, in elements of `itemsize` bytes times `batch`. With c the chunk along the op's axis
    (at most S for MSA rows, N for residues or pair rows; H_m, d_m, H_z, d_z: heads and head widths of
    the MSA and pair attention; C_h, C_o: triangle and outer-product hidden widths; n: transition
    factor):

        msa_row_attention       H_m N² + c N (2 C_m + 5 H_m d_m) + 2 c H_m N²  (pair bias, LN'd
                                input and output, q k v g o, logits and their softmax)
        msa_column_attention    c S (2 C_m + 5 H_m d_m) + 2 c H_m S²
        msa_transition          c N C_m (2 + 2 n)
        outer_product_mean      2 S N C_o + c N (C_o² + 2 C_z)
        triangle_multiplication C_h N² + c N (4 C_z + 6 C_h)
        triangle_attention      H_z N² + c N (2 C_z + 5 H_z d_z) + 2 c H_z N²
        pair_transition         c N C_z (2 + 2 n)

    `logits`: the attention terms count plain-torch logits and their softmax (2 c H L² for c rows of
    L keys); without, they are left out, as hfkit's fused attention never holds them. Returns
    {op: bytes} in the order above (`LEAN_OPS`).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected >= 1, got {chunk_size}")
    w, s, n = widths, n_seq, n_res
    r, k = min(chunk_size, s), min(chunk_size, n)
    held = 2 * logits  # logits and their softmax, per attention row
    elements = (
        w.heads_msa * n * n
        + _attention_rows(r, n, w.c_m, w.heads_msa, w.c_hidden_msa)
        + held * r * w.heads_msa * n * n,
        _attention_rows(k, s, w.c_m, w.heads_msa, w.c_hidden_msa) + held * k * w.heads_msa * s * s,
        r * n * w.c_m * (2 + 2 * w.transition_n),
        2 * s * n * w.c_hidden_opm + k * n * (w.c_hidden_opm**2 + 2 * w.c_z),
        w.c_hidden_mul * n * n + k * n * (4 * w.c_z + 6 * w.c_hidden_mul),
        w.heads_pair * n * n
        + _attention_rows(k, n, w.c_z, w.heads_pair, w.c_hidden_pair)
        + held * k * w.heads_pair * n * n,
        k * n * w.c_z * (2 + 2 * w.transition_n),
    )
    return {op: int(e * itemsize * batch) for op, e in zip(LEAN_OPS, elements, strict=True)}


def choose_chunk_size(
    widths: BlockWidths,
    n_seq: int,
    n_res: int,
    itemsize: int,
    free_bytes: int,
    batch: int = 1,
    fraction: float = AUTO_MEMORY_FRACTION,
    logits: bool = True,
) -> dict[str, int]:
    """Per op of `LEAN_OPS`, the largest power of two c (from 1 up to the first power of two >= the
    op's chunked axis, S or N: one chunk) whose `lean_working_set_bytes` (with `logits`) fits in
    `fraction * free_bytes`. Raises `torch.OutOfMemoryError` naming the op when not even c = 1 fits."""
    if free_bytes < 0:
        raise ValueError(f"free_bytes: expected >= 0, got {free_bytes}")
    budget = fraction * free_bytes

    def sizes(chunk: int) -> dict[str, int]:
        return lean_working_set_bytes(widths, n_seq, n_res, chunk, itemsize, batch, logits)

    chosen: dict[str, int] = {}
    for op in LEAN_OPS:
        axis = n_seq if op in _MSA_ROW_OPS else n_res
        chunk = 1 << max(0, math.ceil(math.log2(max(axis, 1))))
        while chunk >= 1 and sizes(chunk)[op] > budget:
            chunk //= 2
        if chunk < 1:
            need = sizes(1)[op]
            raise torch.OutOfMemoryError(
                f"chunk_size='auto': expected a chunk of {op} to fit in {fraction:.0%} of "
                f"{free_bytes / 2**30:.2f} GiB free, but even chunk 1 needs an estimated "
                f"{need / 2**30:.2f} GiB (S={n_seq}, N={n_res})"
            )
        chosen[op] = chunk
    return chosen


def free_device_memory(device: torch.device) -> int | None:
    """Bytes a new allocation on `device` can use: on CUDA the driver's free memory plus what torch's
    caching allocator holds unused; None on other devices (no query)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + cached)


def lean_forward(
    module: EvoformerBlock | EvoformerStack | ExtraMSAStack,
    m: torch.Tensor,
    z: torch.Tensor,
    msa_mask: torch.Tensor | None,
    pair_mask: torch.Tensor | None,
    chunk_size: int | str | None = None,
    offload_msa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor] | torch.Tensor:
    """`module(m, z, msa_mask, pair_mask)` in eval mode under `torch.no_grad()`, memory-lean (see the
    module docstring); returns what the module's forward returns: (m, z) for a block, (m, z, s) for an
    `EvoformerStack`, z for an `ExtraMSAStack`.

    m: [*, S, N, C_m], z: [*, N, N, C_z], msa_mask: [*, S, N], pair_mask: [*, N, N] (None: all kept).
    m and z are updated in place and returned (pass clones to keep the inputs). `chunk_size`: rows
    (MSA rows, residues or pair rows, per op) a chunk; None runs each op in one chunk; "auto" chooses
    each op's chunk with `choose_chunk_size` from `free_device_memory` (`DEFAULT_CHUNK_SIZE` off CUDA;
    `resolve_chunk_sizes` says what a call will use). `offload_msa` keeps m in host memory (pinned)
    while the pair ops run, its device memory released; it needs m to own its storage (a contiguous
    tensor, not a view of a larger one).
    """
    if isinstance(module, EvoformerBlock):
        blocks = [module]
    elif isinstance(module, (EvoformerStack, ExtraMSAStack)):
        blocks = list(module.blocks)
    else:
        raise ValueError(
            "module: expected an EvoformerBlock, EvoformerStack or ExtraMSAStack, "
            f"got {type(module).__name__}"
        )
    if module.training:
        raise ValueError("module: expected eval mode (lean_forward is inference: dropout off), got training")
    if m.dim() < 3 or z.dim() < 3 or m.shape[-2] != z.shape[-2] or z.shape[-2] != z.shape[-3]:
        raise ValueError(
            f"m, z: expected [*, S, N, C_m] and [*, N, N, C_z], got {tuple(m.shape)} and {tuple(z.shape)}"
        )
    if msa_mask is None:
        msa_mask = m.new_ones(m.shape[:-1])
    if pair_mask is None:
        pair_mask = z.new_ones(z.shape[:-1])
    chunks = resolve_chunk_sizes(module, m, z, chunk_size)
    offload = _MSAOffload(m) if offload_msa else None
    with torch.no_grad():
        try:
            for block in blocks:
                _lean_block_(block, m, z, msa_mask, pair_mask, chunks, offload)
        finally:  # m holds its values again, even when a block failed (e.g. out of memory)
            if offload is not None:
                offload.restore()
        if isinstance(module, EvoformerStack):
            return m, z, module.linear(m[..., 0, :, :])
    return z if isinstance(module, ExtraMSAStack) else (m, z)


def holds_attention_logits(block: EvoformerBlock, m: torch.Tensor, z: torch.Tensor) -> bool:
    """Whether any attention of `block` (MSA row and column, both triangle attentions) holds its
    logits on inputs like m (MSA) and z (pair): `Attention.holds_logits` of each."""
    core = block.core
    msa_col = block.msa_att_col
    column = [] if isinstance(msa_col, MSAColumnGlobalAttention) else [msa_col._msa_att.mha]
    return (
        block.msa_att_row.mha.holds_logits(m)
        or any(a.holds_logits(m) for a in column)
        or any(a.mha.holds_logits(z) for a in (core.tri_att_start, core.tri_att_end))
    )


def resolve_chunk_sizes(
    module: EvoformerBlock | EvoformerStack | ExtraMSAStack,
    m: torch.Tensor,
    z: torch.Tensor,
    chunk_size: int | str | None,
) -> dict[str, int]:
    """The chunk of each op of `LEAN_OPS` that `lean_forward(module, m, z, ..., chunk_size)` uses: an
    int for every op; None: each op's whole axis (S or N) in one chunk; "auto": `choose_chunk_size`
    from `free_device_memory(z.device)`, counting attention logits only where the block's attention
    holds them (`Attention.holds_logits`: not hfkit's fused attention on a GPU) (off CUDA:
    `DEFAULT_CHUNK_SIZE` for every op)."""
    n_seq, n_res = m.shape[-3], m.shape[-2]
    if chunk_size is None:
        return {op: max(n_seq if op in _MSA_ROW_OPS else n_res, 1) for op in LEAN_OPS}
    if chunk_size == "auto":
        free = free_device_memory(z.device)
        if free is None:
            return dict.fromkeys(LEAN_OPS, DEFAULT_CHUNK_SIZE)
        block = module if isinstance(module, EvoformerBlock) else module.blocks[0]
        batch = math.prod(z.shape[:-3])
        logits = holds_attention_logits(block, m, z)
        widths = BlockWidths.from_block(block)
        return choose_chunk_size(widths, n_seq, n_res, z.element_size(), free, batch, logits=logits)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, None or 'auto', got {chunk_size!r}")
    return dict.fromkeys(LEAN_OPS, chunk_size)


class _MSAOffload:
    """m's storage released to its device's allocator while a host copy (pinned for a CUDA m) holds its
    values. The copies run on the current stream, so the allocator's reuse of the released memory is
    ordered after the device-to-host copy, and the copy back after it. A CPU m goes through the same
    steps (into a second host buffer), which is where they are tested."""

    def __init__(self, m: torch.Tensor) -> None:
        self.m = m
        self.host: torch.Tensor | None = None
        self.offloaded = False
        self.nbytes = m.numel() * m.element_size()
        if not m.is_contiguous() or m.storage_offset() != 0 or m.untyped_storage().nbytes() != self.nbytes:
            raise ValueError(
                f"m: offload_msa needs m to own its storage (contiguous, not a view), got shape "
                f"{tuple(m.shape)}, strides {m.stride()}, storage of {m.untyped_storage().nbytes()} bytes"
            )

    def offload(self) -> None:
        if self.offloaded:
            return
        if self.host is None:
            self.host = torch.empty(self.m.shape, dtype=self.m.dtype, pin_memory=self.m.is_cuda)
        self.host.copy_(self.m, non_blocking=self.m.is_cuda)
        self.m.untyped_storage().resize_(0)
        self.offloaded = True

    def restore(self) -> None:
        if not self.offloaded:
            return
        self.m.untyped_storage().resize_(self.nbytes)
        self.m.copy_(self.host, non_blocking=self.m.is_cuda)
        self.offloaded = False


def _spans(total: int, chunk: int) -> Iterator[tuple[int, int]]:
    """(start, length) of consecutive chunks covering range(total)."""
    for start in range(0, total, chunk):
        yield start, min(chunk, total - start)


def _lean_block_(
    block: EvoformerBlock,
    m: torch.Tensor,
    z: torch.Tensor,
    msa_mask: torch.Tensor,
    pair_mask: torch.Tensor,
    chunks: dict[str, int],
    offload: _MSAOffload | None,
) -> None:
    """One block, in the order of `EvoformerBlock.forward`, updating m and z in place."""
    if offload is not None:
        offload.restore()
    core = block.core
    c = chunks
    _msa_row_attention_(block.msa_att_row, m, z, msa_mask, c["msa_row_attention"])
    _msa_column_attention_(block.msa_att_col, m, msa_mask, c["msa_column_attention"])
    msa_transition_mask = msa_mask if core.mask_msa_transition else None
    _transition_(core.msa_transition, m, msa_transition_mask, c["msa_transition"])
    _outer_product_mean_(core.outer_product_mean, m, z, msa_mask, c["outer_product_mean"])
    if offload is not None:
        offload.offload()
    _triangle_multiplication_(core.tri_mul_out, z, pair_mask, c["triangle_multiplication"])
    _triangle_multiplication_(core.tri_mul_in, z, pair_mask, c["triangle_multiplication"])
    _triangle_attention_(core.tri_att_start, z, pair_mask, c["triangle_attention"])
    _triangle_attention_(core.tri_att_end, z, pair_mask, c["triangle_attention"])
    pair_transition_mask = pair_mask if core.mask_pair_transition else None
    _transition_(core.pair_transition, z, pair_transition_mask, c["pair_transition"])


def _chunked_bias(layer_norm, linear, z: torch.Tensor, no_heads: int, budget: int) -> torch.Tensor:
    """linear(layer_norm(z)) of z [*, N, N, c_z] as an attention bias [*, 1, H, N, N] (H = `no_heads`),
    made as many rows at a time as fit `budget` elements a batch entry (a row's normalised copy and its
    bias: N (c_z + H); at least one row). The callers pass the elements their own chunk of rows holds
    afterwards (`lean_working_set_bytes`), so the normalised [*, N, N, c_z] copy is never whole and the
    op's peak is the estimate's. (Chunks of the attention's own rows made the bias in up to N / 4 pairs
    of tiny kernels, bound by their launches: at N = 4096, 32 chunks left the GPU idle 12 ms a block.)"""
    n, c_z = z.shape[-2], z.shape[-1]
    bias = z.new_empty((*z.shape[:-3], no_heads, n, n))
    for start, size in _spans(n, max(1, budget // (n * (c_z + no_heads)))):
        rows = linear(layer_norm(z.narrow(-3, start, size)))  # [*, size, N, H]
        bias.narrow(-2, start, size).copy_(rows.movedim(-1, -3))
        del rows
    return bias.unsqueeze(-4)


def _msa_row_attention_(att, m: torch.Tensor, z: torch.Tensor, mask: torch.Tensor, chunk: int) -> None:
    """m += MSARowAttentionWithPairBias(m, z): the pair bias [*, H, N, N] once, then MSA rows."""
    s, n, mha = m.shape[-3], m.shape[-2], att.mha
    held = _attention_rows(min(chunk, s), n, m.shape[-1], mha.no_heads, mha.c_hidden)
    pair_bias = _chunked_bias(att.layer_norm_z, att.linear_z, z, mha.no_heads, held)  # all MSA rows
    for start, size in _spans(m.shape[-3], chunk):
        rows = m.narrow(-3, start, size)
        x = att.layer_norm_m(rows)
        key = mask_bias(mask.narrow(-2, start, size).to(x.dtype), att.inf)
        rows.add_(att.mha(x, x, [key, pair_bias]))
        del x, key


def _msa_column_attention_(att, m: torch.Tensor, mask: torch.Tensor, chunk: int) -> None:
    """m += the column attention's update (gated, or global for extra-MSA blocks), residues at a time."""
    mt = m.transpose(-2, -3)  # [*, N, S, C]: a view, so updates land in m
    mask_t = mask.transpose(-1, -2)
    for start, size in _spans(mt.shape[-3], chunk):
        cols = mt.narrow(-3, start, size)
        mask_c = mask_t.narrow(-2, start, size)
        if isinstance(att, MSAColumnGlobalAttention):
            x = att.layer_norm_m(cols)
            cols.add_(att.global_attention(x, mask_c.to(x.dtype)))
        else:
            inner = att._msa_att
            x = inner.layer_norm_m(cols)
            key = mask_bias(mask_c.to(x.dtype), inner.inf)
            cols.add_(inner.mha(x, x, [key]))
        del x


def _transition_(transition: Transition, x: torch.Tensor, mask: torch.Tensor | None, chunk: int) -> None:
    """x += transition(x, mask), rows (dim -3) at a time; mask None: unmasked."""
    for start, size in _spans(x.shape[-3], chunk):
        rows = x.narrow(-3, start, size)
        mask_r = rows.new_ones(rows.shape[:-1]) if mask is None else mask.narrow(-2, start, size)
        normed = transition.layer_norm(rows)
        transition.add_transition_(rows, normed, mask_r.to(normed.dtype)[..., None])
        del normed


def _outer_product_mean_(opm, m: torch.Tensor, z: torch.Tensor, mask: torch.Tensor, chunk: int) -> None:
    """z += OuterProductMean(m): the projections a, b [*, S, N, C_o] once, then pair rows i."""
    mask = mask.to(m.dtype)[..., None]  # [*, S, N, 1]
    c_o = opm.linear_1.out_features
    a = m.new_empty((*m.shape[:-1], c_o))
    b = m.new_empty((*m.shape[:-1], c_o))
    for start, size in _spans(m.shape[-3], chunk):
        ln = opm.layer_norm(m.narrow(-3, start, size))
        mask_r = mask.narrow(-3, start, size)
        a.narrow(-3, start, size).copy_(opm.linear_1(ln) * mask_r)
        b.narrow(-3, start, size).copy_(opm.linear_2(ln) * mask_r)
        del ln
    for start, size in _spans(z.shape[-3], chunk):
        mask_i = mask.narrow(-2, start, size)
        norm = torch.einsum("...sia,...sja->...ija", mask_i, mask)  # [*, size, N, 1]
        outer = opm._outer(a.narrow(-2, start, size), b)  # [*, size, N, C_z]
        opm.add_normalized_(z.narrow(-3, start, size), outer, opm.eps + norm)
        del norm, outer


def _gated_projection(lin_p, lin_g, zn: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mask * sigmoid(lin_g(zn)) * lin_p(zn), channel-first [*, C_h, rows, cols], contiguous."""
    return (mask * torch.sigmoid(lin_g(zn)) * lin_p(zn)).movedim(-1, -3).contiguous()


def _triangle_multiplication_(
    tri: TriangleMultiplicativeUpdate, z: torch.Tensor, mask: torch.Tensor, chunk: int
) -> None:
    """z += the triangle multiplicative update. Outgoing, x_ij = sum_k a_ik b_jk: b stored whole, then
    output rows i. Incoming, x_ij = sum_k a_ki b_kj: the same on the transposed view of z (output
    columns j: b from columns j, a stored whole); each chunk reads only rows (columns) of z that no
    earlier chunk has updated, besides the stored projection."""
    n = z.shape[-2]
    if chunk >= n:
        # One chunk: the module itself, whose update (hfkit's fused kernels where swapped in) holds
        # less than the chunked path's whole stored projection and rows; hfkit's adds it into z as
        # its output kernel writes it (`add_update_`).
        tri.add_update_(z, mask)
        return
    zv = z if tri.outgoing else z.transpose(-2, -3)  # zv[p, q]: p is the output axis that is chunked
    mask_v = (mask if tri.outgoing else mask.transpose(-1, -2)).to(z.dtype)[..., None]
    # The projection contracted against every chunk: b for outgoing, a for incoming, computed from
    # the rows of zv (contiguous rows of z for outgoing; columns, a strided view, for incoming).
    lin_p, lin_g = (tri.linear_b_p, tri.linear_b_g) if tri.outgoing else (tri.linear_a_p, tri.linear_a_g)
    stored = z.new_empty((*z.shape[:-3], lin_p.out_features, n, n))  # [*, C_h, N(p), N(k)]
    for start, size in _spans(n, chunk):
        zn = tri.layer_norm_in(zv.narrow(-3, start, size))
        stored.narrow(-2, start, size).copy_(
            _gated_projection(lin_p, lin_g, zn, mask_v.narrow(-3, start, size))
        )
        del zn
    lin_p, lin_g = (tri.linear_a_p, tri.linear_a_g) if tri.outgoing else (tri.linear_b_p, tri.linear_b_g)
    for start, size in _spans(n, chunk):
        rows = zv.narrow(-3, start, size)
        zn = tri.layer_norm_in(rows)
        own = _gated_projection(lin_p, lin_g, zn, mask_v.narrow(-3, start, size))  # [*, C_h, size, N(k)]
        # Outgoing: x[c, i, j] = sum_k own[c, i, k] stored[c, j, k]; incoming (zv = z^T, p = j):
        # x[c, j, i] = sum_k b[c, j, k] a[c, i, k] with own = b from column j, stored = a.
        x = torch.matmul(own, stored.transpose(-1, -2))  # [*, C_h, size, N]
        del own
        x = tri.linear_z(tri.layer_norm_out(x.movedim(-3, -1)))  # [*, size, N, C_z]
        rows.add_(x * torch.sigmoid(tri.linear_g(zn)))
        del zn, x
    del stored


def _triangle_attention_(att: TriangleAttention, z: torch.Tensor, mask: torch.Tensor, chunk: int) -> None:
    """z += the triangle attention's update: the triangle bias [*, H, N, N] once, then rows (starting
    node) or columns (ending node, on the transposed view) at a time."""
    if chunk >= z.shape[-2]:
        # One chunk: the module itself, which normalizes z once (the chunks below normalize it for the
        # bias and again for the rows) and, where hfkit's attention is swapped in, attends along
        # columns without copying the transposed view or updating it strided, and adds its output
        # projection into z in the same pass (`add_update_`).
        att.add_update_(z, mask)
        return
    zv = z if att.starting else z.transpose(-2, -3)
    mask_v = mask if att.starting else mask.transpose(-1, -2)
    n = z.shape[-2]
    mha = att.mha
    held = _attention_rows(chunk, n, z.shape[-1], mha.no_heads, mha.c_hidden)
    triangle_bias = _chunked_bias(att.layer_norm, att.linear, zv, mha.no_heads, held)  # all rows
    for start, size in _spans(n, chunk):
        rows = zv.narrow(-3, start, size)
        x = att.layer_norm(rows)
        key = mask_bias(mask_v.narrow(-2, start, size).to(x.dtype), att.inf)
        rows.add_(att.mha(x, x, [key, triangle_bias]))
        del x, key
