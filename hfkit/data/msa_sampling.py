"""Training-time feature transforms: raw per-chain arrays -> one fixed-size sample of model inputs.

`process_features` reproduces the semantics of OpenFold's ensembled transforms
(`input_pipeline.ensembled_transform_fns`, `data_transforms.py`) for one sample: block deletion of
MSA rows in training (`block_delete_rows`), MSA sampling with the query kept first (AF2 supplement
section 1.2.7), masked-MSA (BERT) corruption of the sampled rows (1.2.7; the loss is 1.9.9),
nearest-neighbour assignment of the extra MSA to cluster centres and per-cluster profiles (1.2.7),
the `msa_feat` / `target_feat` / `extra_msa_*` inputs of Table 1 (1.2.9), residue cropping (1.2.8,
`crop.py`) and zero padding to the sizes in `FeatureConfig`. `FEATURE_SHAPES` is the output schema.
`process_features_recycling` makes OpenFold's `max_recycling_iters + 1` samples of one example (one
crop, the MSA drawn afresh for each), stacked.

Cost. Everything runs on int8/int32 ids; no [N, L, 23] one-hot of the full MSA is ever built.
Residues are cropped *first*, so every MSA-wide step touches crop_size columns, not L (see
`process_features` for the one consequence). The dominant step is clustering: an agreement matrix
[N_extra, N_clust] computed as an `embedding_bag` gather-sum of fp16 rows of a per-(column, residue)
table -- N_extra * crop_size * N_clust adds, ~3 ms for 4,900 extra rows, crop 256 and 128 clusters
on one CPU core, where OpenFold's dense one-hot matmul does 23x the work in float32 (~130 ms) --
and its argmax, a plain float32 max of agreement * C + (C - 1 - c) (ties to the first centre).
The cluster profiles are one flat `index_add_` of N_extra * crop_size ones into [C, crop, 23]
counts (~1.3 ms there), indexed by the same int32 keys as the agreement table plus each row's
cluster offset, then divided straight into msa_feat's profile channels. The [N, crop]
intermediates live in per-thread buffers reused across calls (up to 128 MiB each; ~75 MiB in all
for a 20,000-row MSA at crop 256): on a VM each fresh 4 KiB page costs a ~1.5 us fault, which for
those intermediates cost as much as the arithmetic. Outputs are always fresh tensors; msa_feat is
written once per entry (no zero fill of the channels that are overwritten).
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

from hfkit.data.crop import choose_crop
from hfkit.data.features import hhblits_profile
from hfkit.data.residue_constants import ATOM_TYPE_NUM, GAP_ID, MASK_ID, MSA_NUM_CLASSES, UNK_ID

__all__ = [
    "FEATURE_SHAPES",
    "MSA_FEAT_DIM",
    "NUM_EXTRA_SEQ",
    "NUM_MSA_SEQ",
    "NUM_RES",
    "STRUCTURE_FEATURES",
    "TARGET_FEAT_DIM",
    "FeatureConfig",
    "assign_clusters",
    "block_delete_rows",
    "deletion_value",
    "feature_shapes",
    "mask_msa",
    "process_features",
    "process_features_recycling",
]

# Symbolic dimensions of FEATURE_SHAPES (the names OpenFold's config uses).
NUM_RES = "num residues placeholder"
NUM_MSA_SEQ = "msa placeholder"
NUM_EXTRA_SEQ = "extra msa placeholder"

# msa_feat channels: one-hot(23) | has_deletion | deletion_value | cluster_profile(23) | deletion_mean
MSA_FEAT_DIM = 2 * MSA_NUM_CLASSES + 3  # 49
# target_feat channels: between_segment_residues | one-hot(aatype, 21)
TARGET_FEAT_DIM = 1 + UNK_ID + 1  # 22
_PROFILE_CLASSES = GAP_ID + 1  # the HHblits profile has no mask class: 22
_PROFILE_CHANNELS = slice(MSA_NUM_CLASSES + 2, 2 * MSA_NUM_CLASSES + 2)  # cluster_profile in msa_feat

FEATURE_SHAPES: dict[str, tuple[str | int, ...]] = {
    "aatype": (NUM_RES,),
    "residue_index": (NUM_RES,),
    "seq_mask": (NUM_RES,),
    "seq_length": (),
    "target_feat": (NUM_RES, TARGET_FEAT_DIM),
    "msa_feat": (NUM_MSA_SEQ, NUM_RES, MSA_FEAT_DIM),
    "msa_mask": (NUM_MSA_SEQ, NUM_RES),
    "true_msa": (NUM_MSA_SEQ, NUM_RES),
    "bert_mask": (NUM_MSA_SEQ, NUM_RES),
    "extra_msa": (NUM_EXTRA_SEQ, NUM_RES),
    "extra_msa_mask": (NUM_EXTRA_SEQ, NUM_RES),
    "extra_has_deletion": (NUM_EXTRA_SEQ, NUM_RES),
    "extra_deletion_value": (NUM_EXTRA_SEQ, NUM_RES),
    "all_atom_positions": (NUM_RES, ATOM_TYPE_NUM, 3),
    "all_atom_mask": (NUM_RES, ATOM_TYPE_NUM),
    "resolution": (),
}
# Present only when the raw features hold a structure.
STRUCTURE_FEATURES = frozenset({"all_atom_positions", "all_atom_mask", "resolution"})


@dataclass(frozen=True)
class FeatureConfig:
    """Sizes and probabilities of the training-time transforms (OpenFold's `config.py` names).

    `crop_size` residues, `max_msa_clusters` sampled rows (cluster centres, query included) and
    `max_extra_msa` extra rows are also the padded sizes of every output. The masked-MSA
    probabilities are those of a replaced position taking a uniform residue, a residue drawn from the
    MSA profile, its own residue, or (the rest) the mask token. `cluster_all_extra=True` lets every
    non-sampled row vote into the cluster profiles as OpenFold does; False clusters only the
    `max_extra_msa` rows that are kept, which caps the cost for very deep MSAs (not OpenFold's).

    The defaults are OpenFold's monomer training (`initial_training`): contiguous crops only
    (`spatial_crop_prob` 0; OpenFold's monomer crop has no spatial mode, 0.5 is AlphaFold-Multimer's
    mix), whose start is drawn in OpenFold's two steps (`uniform_crop_start=True`: uniform, as
    DeepMind's AlphaFold draws it), and block deletion of MSA rows before sampling
    (`block_delete_msa`: `num_blocks` blocks of `msa_fraction_per_block` of the rows, or a uniform
    0..`num_blocks` of them with `randomize_num_blocks`; see `block_delete_rows`).
    """

    crop_size: int = 256
    max_msa_clusters: int = 128
    max_extra_msa: int = 1024
    masked_msa_uniform_prob: float = 0.1
    masked_msa_profile_prob: float = 0.1
    masked_msa_same_prob: float = 0.1
    masked_msa_replace_fraction: float = 0.15
    spatial_crop_prob: float = 0.0
    interface_threshold: float = 10.0
    cluster_all_extra: bool = True
    uniform_crop_start: bool = False
    block_delete_msa: bool = True
    msa_fraction_per_block: float = 0.3
    num_blocks: int = 5
    randomize_num_blocks: bool = False

    def __post_init__(self) -> None:
        for name in ("crop_size", "max_msa_clusters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.max_extra_msa < 0:
            raise ValueError(f"max_extra_msa: expected >= 0, got {self.max_extra_msa}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks: expected >= 0, got {self.num_blocks}")
        for name in (
            "masked_msa_uniform_prob",
            "masked_msa_profile_prob",
            "masked_msa_same_prob",
            "masked_msa_replace_fraction",
            "spatial_crop_prob",
            "msa_fraction_per_block",
        ):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: expected a probability in [0, 1], got {getattr(self, name)}")
        total = self.masked_msa_uniform_prob + self.masked_msa_profile_prob + self.masked_msa_same_prob
        if total > 1.0 + 1e-9:
            raise ValueError(f"masked_msa_*_prob: expected uniform + profile + same <= 1, got {total}")

    @property
    def masked_msa_mask_prob(self) -> float:
        """Probability that a replaced position becomes the mask token."""
        return max(
            0.0,
            1.0 - self.masked_msa_uniform_prob - self.masked_msa_profile_prob - self.masked_msa_same_prob,
        )

    @classmethod
    def af2_initial(cls) -> FeatureConfig:
        """AlphaFold 2 initial training (OpenFold's `initial_training`): crop 256, 128 clusters, 1024
        extra rows; contiguous crops, block deletion of 5 blocks of 30% of the MSA rows."""
        return cls(crop_size=256, max_msa_clusters=128, max_extra_msa=1024)

    @classmethod
    def af2_finetune(cls) -> FeatureConfig:
        """AlphaFold 2 fine-tuning: crop 384, 512 clusters, 5120 extra rows."""
        return cls(crop_size=384, max_msa_clusters=512, max_extra_msa=5120)

    @classmethod
    def tiny(cls) -> FeatureConfig:
        """Small sizes for CPU tests: crop 32, 8 clusters, 16 extra rows."""
        return cls(crop_size=32, max_msa_clusters=8, max_extra_msa=16)


def feature_shapes(config: FeatureConfig, num_res: int | None = None) -> dict[str, tuple[int, ...]]:
    """`FEATURE_SHAPES` with the symbols resolved: residues -> `num_res` (default `crop_size`)."""
    sizes = {
        NUM_RES: config.crop_size if num_res is None else num_res,
        NUM_MSA_SEQ: config.max_msa_clusters,
        NUM_EXTRA_SEQ: config.max_extra_msa,
    }
    return {k: tuple(sizes.get(d, d) for d in shape) for k, shape in FEATURE_SHAPES.items()}


def deletion_value(deletions: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Deletion counts [*] -> (2/π)·arctan(d/3) in [0, 1) [*], the scaling of AF2 supplement Table 1.

    Written into `out` (a float32 view of the same shape) when given. On CPU it runs numpy's arctan,
    whose SIMD kernel is ~10x faster than torch's here.
    """
    if out is None:
        out = torch.empty(deletions.shape, dtype=torch.float32, device=deletions.device)
    if deletions.device.type != "cpu" or deletions.requires_grad:
        return out.copy_(torch.atan(deletions / 3.0) * (2.0 / math.pi))
    # In place in `out` (or a reused buffer for a strided `out`): no fresh temporaries.
    direct = out.dtype == torch.float32 and out.is_contiguous() and not out.requires_grad
    buffer = out if direct else _scratch("deletion_value", tuple(deletions.shape), torch.float32)
    values = buffer.numpy()
    # d / 3 in float32, cast from d's dtype on the way (exact for counts below 2**24).
    np.divide(deletions.detach().numpy(), np.float32(3.0), out=values, dtype=np.float32, casting="unsafe")
    np.arctan(values, out=values)
    buffer.mul_(2.0 / math.pi)
    return out if direct else out.copy_(buffer)


def block_delete_rows(num_seq: int, config: FeatureConfig, generator: torch.Generator) -> torch.Tensor:
    """The rows of an MSA of `num_seq` rows that OpenFold's `block_delete_msa` keeps: sorted int64 [K].

    Blocks of floor(num_seq * `msa_fraction_per_block`) consecutive rows (computed in float32, as
    OpenFold does) start at `num_blocks` rows drawn uniformly from 1..num_seq-1 (with
    `randomize_num_blocks`, first a uniform number of blocks in 0..num_blocks); blocks are clipped
    to the MSA, may overlap, and never hold the query (row 0 is always kept). When a block would be
    empty every row is kept and nothing is drawn. The draws are OpenFold's calls, made on
    `generator`, so a generator seeded as OpenFold's global one deletes the same rows.
    """
    if num_seq < 1:
        raise ValueError(f"num_seq: expected >= 1, got {num_seq}")
    block_size = int(torch.floor(torch.tensor(num_seq, dtype=torch.float32) * config.msa_fraction_per_block))
    if block_size == 0 or num_seq == 1:
        return torch.arange(num_seq)
    if config.randomize_num_blocks:
        num_blocks = int(torch.randint(0, config.num_blocks + 1, (1,), generator=generator)[0])
    else:
        num_blocks = config.num_blocks
    starts = torch.randint(1, num_seq, (num_blocks,), generator=generator)
    deleted = (starts[:, None] + torch.arange(block_size)).clamp_(1, num_seq - 1)
    keep = torch.ones(num_seq, dtype=torch.bool)
    keep[deleted.view(-1)] = False
    return keep.nonzero().view(-1)


def mask_msa(
    msa: torch.Tensor,
    profile: torch.Tensor,
    config: FeatureConfig,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked-MSA (BERT) corruption: msa ids [N, L] -> (corrupted ids int64 [N, L], bert_mask bool).

    Each position is replaced with probability `masked_msa_replace_fraction`; a replaced one takes a
    uniform residue (of 20), a residue drawn from `profile` [L, 22] (the HHblits profile), its own
    id, or the mask token 22, with the config's probabilities (OpenFold's `make_masked_msa`).
    Categories are drawn only at the ~15% replaced positions, by inverse CDF.
    """
    num_seq, num_res = msa.shape
    if profile.shape != (num_res, _PROFILE_CLASSES):
        raise ValueError(f"profile: expected [{num_res}, {_PROFILE_CLASSES}], got {tuple(profile.shape)}")
    msa = msa.long()
    bert_mask = torch.rand((num_seq, num_res), generator=generator) < config.masked_msa_replace_fraction
    corrupted = msa.clone(memory_format=torch.contiguous_format)
    flat = bert_mask.view(-1).nonzero().view(-1)
    count = flat.numel()
    if count == 0:
        return corrupted, bert_mask
    cols = flat % num_res
    own = corrupted.view(-1)[flat]
    # Class probabilities of a replaced position: per column, then its own class; the same float32
    # operations in the same order as a row-by-row build, on [L, 23] instead of [count, 23].
    per_column = torch.zeros(num_res, MSA_NUM_CLASSES)
    per_column[:, :UNK_ID] = config.masked_msa_uniform_prob / UNK_ID  # uniform over the 20 residues
    per_column[:, :_PROFILE_CLASSES] += config.masked_msa_profile_prob * profile.float()
    probs = per_column.index_select(0, cols)
    probs[torch.arange(count), own] += config.masked_msa_same_prob
    probs[:, MASK_ID] = config.masked_msa_mask_prob
    cdf = probs.cumsum(dim=1)
    u = torch.rand((count, 1), generator=generator) * cdf[:, -1:]
    # The first class whose CDF exceeds u (the number of CDF entries <= u: the CDF never decreases);
    # zero-probability classes can never be it.
    drawn = torch.searchsorted(cdf, u, right=True).view(-1).clamp_(max=MSA_NUM_CLASSES - 1)
    corrupted.view(-1)[flat] = drawn
    return corrupted, bert_mask


# Agreement tables and cluster-profile counts share one layout: the key of (column l, class a) is
# l * 23 + a, and that of (cluster c, column l, class a) is c * L * 23 + l * 23 + a. One int32 key
# matrix then indexes the agreement table's rows and, offset by each row's cluster, the profile
# counts ([C, L, 23], filled by one flat `index_add_`).
_KEY_STRIDE = MSA_NUM_CLASSES


def _key_offsets(num_res: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """[num_res] l * 23: the key of (column l, class 0); class a's is a further + a."""
    return torch.arange(0, num_res * _KEY_STRIDE, _KEY_STRIDE, dtype=dtype)


def _column_keys(ids: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """ids [N, L] -> `dtype` keys l * 23 + id: one per (column, class)."""
    return torch.empty(ids.shape, dtype=dtype).copy_(ids).add_(_key_offsets(ids.shape[1], dtype))


def _assign_from_keys(keys: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Nearest centre of each extra row; keys: `_column_keys(extra)` [E, L], centres ids [C, L]."""
    num_centres, num_res = centres.shape
    # Two centres share one float32 lane: centre 2j counts in units of 1, centre 2j + 1 in units of
    # `base` (a power of two above any count, which is at most L). Sums of integers below 2**24 are
    # exact in float32 in any order, so the lane splits back into the two counts exactly; the
    # gather-sum, bound by its arithmetic (8 lanes an AVX2 add), then does half the adds of one
    # count per lane. Past L ~ 4000 a lane holds one centre.
    base = 1 << num_res.bit_length()
    packed = num_res * (base + 1) < 2**24
    lanes = (num_centres + 1) // 2 if packed else num_centres
    centre = torch.arange(num_centres)
    lane = centre // 2 if packed else centre
    # table[key(l, a), lane] holds the weight of each centre of that lane with residue (or X) a at
    # column l. Gaps and the mask token weigh 0, as OpenFold's weights [1]*21 + [gap_agreement_weight
    # = 0, 0] do.
    table = _scratch("table", (num_res * _KEY_STRIDE, lanes), torch.float32).zero_()
    centre_ids = centres.long()
    cells = table.view(-1)
    flat = (centre_ids + _key_offsets(num_res)).mul_(lanes).add_(lane[:, None])
    counted = (centre_ids < GAP_ID).float()
    # Within the even centres (and within the odd ones) every cell is written at most once: a plain
    # flat index_put_ each (several times faster than an accumulating one); the odd centres add to
    # the cells they share with their lane's even centre.
    cells[flat[0::2].reshape(-1)] = counted[0::2].reshape(-1)
    if num_centres > 1:
        odd_cells = flat[1::2].reshape(-1)
        cells[odd_cells] = cells[odd_cells] + counted[1::2].reshape(-1) * (float(base) if packed else 1.0)
    # sums[e, lane] = sum_l table[keys[e, l], lane]: the weighted Hamming agreements, one bag a row.
    sums = F.embedding_bag(keys, table, mode="sum")
    # argmax with ties to the first centre, as OpenFold's: the largest of agreement * C + (C - 1 - c),
    # integers exact in float32 below 2**24 (a plain float32 max: 15x faster than argmax).
    exact = torch.float32 if (num_res + 1) * num_centres < 2**24 else torch.float64
    if packed:
        high = sums.mul(1.0 / base).floor_()  # the odd centres' counts (exact: base is a power of 2)
        low = sums.sub(high, alpha=base)  # the even centres'
        even = torch.arange(num_centres - 1, -1, -2, dtype=exact)  # C - 1 - c for c = 0, 2, 4, ...
        best = torch.add(even, low.to(exact), alpha=num_centres).amax(dim=1)
        if num_centres > 1:
            odd = torch.arange(num_centres - 2, -1, -2, dtype=exact)  # c = 1, 3, ...
            odd_ranked = torch.add(odd, high[:, : odd.numel()].to(exact), alpha=num_centres)
            best = torch.maximum(best, odd_ranked.amax(dim=1))
    else:
        ranked = torch.add(
            torch.arange(num_centres - 1, -1, -1, dtype=exact), sums.to(exact), alpha=num_centres
        )
        best = ranked.amax(dim=1)
    return best.long().remainder_(num_centres).neg_().add_(num_centres - 1)


def assign_clusters(centres: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """Nearest cluster centre of each extra row: centres ids [C, L], extra ids [E, L] -> int64 [E].

    The agreement of a row and a centre is the number of columns where both hold the same residue
    (or X); gaps and the mask token never count (OpenFold's `nearest_neighbor_clusters` with
    gap_agreement_weight 0). Each row goes to its highest-agreement centre, ties to the lowest index.
    Cost: E * L * C / 2 adds (an `embedding_bag` over a float32 [L*23, C/2] table, two centres a
    lane), no one-hot of the MSA.
    """
    if centres.dim() != 2 or extra.dim() != 2 or centres.shape[1] != extra.shape[1]:
        raise ValueError(
            f"centres, extra: expected [C, L] and [E, L], got {tuple(centres.shape)} and {tuple(extra.shape)}"
        )
    if extra.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int64)
    return _assign_from_keys(_column_keys(extra), centres)


def _as_tensor(value: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Zero-copy tensor view of a raw array; read-only arrays (mmapped records) are never written."""
    if isinstance(value, torch.Tensor):
        return value
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.as_tensor(np.asarray(value))


_MAX_RUNS = 32  # more runs of consecutive columns than this: numpy's column gather instead


def _column_runs(cols: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """Sorted `cols` as runs of consecutive indices (source start, output start, length).

    None when there are more than `_MAX_RUNS` (a spatial crop has a few; a window one).
    """
    n = cols.numel()
    if n == 0:
        return []
    breaks = (cols[1:] != cols[:-1] + 1).nonzero().view(-1).add_(1).tolist()
    if len(breaks) >= _MAX_RUNS:
        return None
    bounds = [0, *breaks, n]
    values = cols.tolist()
    return [(values[lo], lo, hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]


# Scratch buffers, kept per thread across calls. Fresh memory costs one page fault per 4 KiB page
# (~1.5 us each on a VM), which for the [N, crop] intermediates of a deep MSA cost as much as all
# the arithmetic; reused buffers are already mapped. Nothing returned ever aliases them.
_SCRATCH = threading.local()
_SCRATCH_MAX_BYTES = 128 * 2**20  # larger intermediates are allocated per call


def _scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised `dtype` tensor of `shape` in this thread's reusable buffer `name`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > _SCRATCH_MAX_BYTES:
        return torch.empty(shape, dtype=dtype)
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None:
        buffers = _SCRATCH.buffers = {}
    buffer = buffers.get(name)
    if buffer is None or buffer.numel() < nbytes:
        buffer = buffers[name] = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    return buffer[:nbytes].view(dtype).view(shape)


def _take(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    cols: torch.Tensor,
    runs: list[tuple[int, int, int]] | None,
    name: str,
    dtype: torch.dtype | None = None,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """x[rows][:, cols] (+ `add` [len(cols)] per column) of a 2-D x, as `dtype`, into scratch `name`.

    Every row when `rows` is None, and only the rows asked for otherwise. `runs` is
    `_column_runs(cols)`. One window of columns is copied (or gathered row by row) from a view; a
    few runs are copied run by run, from x or from the gathered full rows (5x faster than a column
    gather), converted to `dtype` (default x's) and offset by `add` on the way; more, by numpy's
    `take` (4x faster than torch's int8 column gather).
    """
    dtype = x.dtype if dtype is None else dtype
    shape = (x.shape[0] if rows is None else rows.numel(), cols.numel())
    out = _scratch(name, shape, dtype)

    def put(target: torch.Tensor, source: torch.Tensor, at: slice) -> None:
        if add is None:
            target.copy_(source)
        elif torch.promote_types(source.dtype, add.dtype) == target.dtype:
            torch.add(source, add[at], out=target)  # one pass: convert and offset
        else:
            target.copy_(source).add_(add[at])

    if runs is not None and len(runs) == 1 and rows is None:
        put(out, x.narrow(1, runs[0][0], runs[0][2]), slice(None))
        return out
    raw = out if dtype == x.dtype and add is None else _scratch(name + "_raw", shape, x.dtype)
    if runs is not None and len(runs) == 1:
        assert rows is not None
        torch.index_select(x.narrow(1, runs[0][0], runs[0][2]), 0, rows, out=raw)
    else:
        if rows is None:
            block = x
        else:
            block = torch.index_select(x, 0, rows, out=_scratch("take_rows", (shape[0], x.shape[1]), x.dtype))
        if runs is not None:
            for source, target, length in runs:
                put(
                    out[:, target : target + length],
                    block[:, source : source + length],
                    slice(target, target + length),
                )
            return out
        np.take(block.numpy(), cols.numpy(), axis=1, out=raw.numpy())
    if raw is not out:
        put(out, raw, slice(None))
    return out


def _padded(shape: tuple[int, int], real: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised [R, C] buffer whose padding (outside [:real[0], :real[1]]) is zero.

    The caller fills the real block; zeroing only the rest saves a full pass over large buffers.
    """
    out = torch.empty(shape, dtype=dtype)
    out[real[0] :].zero_()
    out[: real[0], real[1] :].zero_()
    return out


def _deletion_sums(
    deletions: torch.Tensor,
    vote_del: torch.Tensor,
    vote_rows: torch.Tensor,
    assignment: torch.Tensor,
    num_clust: int,
    cols: torch.Tensor,
    runs: list[tuple[int, int, int]] | None = None,
) -> torch.Tensor:
    """Per-cluster deletion sums [C, res] of the voting rows (`vote_del`: their float deletions).

    Unsigned integer counts sum exactly in float32 while every sum stays below 2**24, whatever the
    order, so the gathered rows are summed as they come. Otherwise (float or signed counts, or huge
    sums) they are summed in the raw row order (`_row_order_deletion_sums`), which fixes the rounding.
    """
    if deletions.dtype in (torch.uint8, torch.uint16):
        sums = torch.zeros(num_clust, vote_del.shape[1]).index_add_(0, assignment, vote_del)
        if float(sums.max()) < 2**24:
            return sums
    # Every row of the MSA gets a target cluster, rows that do not vote go to a dummy one.
    target = torch.full((deletions.shape[0],), num_clust, dtype=torch.int64)
    target[vote_rows] = assignment
    return _row_order_deletion_sums(deletions, target, num_clust + 1, cols, runs)[:num_clust]


_DELETION_BLOCK_ROWS = 512  # raw rows converted at a time by `_row_order_deletion_sums`
_DELETION_MAX_RUNS = 1  # crops of more runs of columns: full rows converted, cropped after


def _row_order_deletion_sums(
    deletions: torch.Tensor,
    cluster: torch.Tensor,
    num_clust: int,
    cols: torch.Tensor,
    runs: list[tuple[int, int, int]] | None,
) -> torch.Tensor:
    """float32 sums [C, len(cols)] of `deletions[r, cols]` ([N, L]) into cluster `cluster[r]` ([N]).

    The same float32 additions in the same order (raw row order) as an `index_add_` of the whole
    cropped float32 matrix, so the same result bit for bit whatever the deletions' dtype. The rows
    are converted a block at a time into a small reused buffer (cache-resident) instead of a full
    [N, crop] float32 copy: as one window of columns when the crop is one run (at most
    `_DELETION_MAX_RUNS`), else as full rows whose sums are cropped after (columns are summed
    independently; copying many short runs costs more than the extra columns).
    """
    cropped = runs is not None and len(runs) <= _DELETION_MAX_RUNS
    num_seq = deletions.shape[0]
    width = cols.numel() if cropped else deletions.shape[1]
    sums = torch.zeros(num_clust, width)
    for start in range(0, num_seq, _DELETION_BLOCK_ROWS):
        stop = min(start + _DELETION_BLOCK_ROWS, num_seq)
        if cropped:
            block = _take(deletions[start:stop], None, cols, runs, "deletion_block", torch.float32)
        else:
            block = _scratch("deletion_block", (stop - start, width), torch.float32)
            block.copy_(deletions[start:stop])
        sums.index_add_(0, cluster[start:stop], block)
    return sums if cropped else sums.index_select(1, cols)


def process_features(
    raw: Mapping[str, np.ndarray | torch.Tensor],
    config: FeatureConfig,
    seed: int,
    train: bool = True,
) -> dict[str, torch.Tensor]:
    """One training sample from a chain's raw features: fixed-size tensors named as `FEATURE_SHAPES`.

    raw: `make_raw_features` output (`aatype` [L], `msa` [N, L], `deletion_matrix` [N, L], optional
    `hhblits_profile` [L, 22] and structure). Steps, all drawn from one `torch.Generator` seeded with
    `seed`: crop residues (train only: spatial with `spatial_crop_prob` when a structure is present,
    else contiguous, its start drawn as `uniform_crop_start` says); delete blocks of rows (train
    only, with `block_delete_msa`: OpenFold's `block_delete_msa`, see `block_delete_rows`); sample
    rows (query first, the others shuffled; the first `max_msa_clusters` are cluster centres, the
    rest the extra MSA); BERT-corrupt the centres; assign extra rows to their nearest centre; build
    `msa_feat` [N_clust, N_res, 49] (centre one-hot, deletions, cluster profile and mean deletion),
    `target_feat` [N_res, 22], `extra_msa*` [N_extra, N_res] (the first `max_extra_msa` extra
    rows), masks, and pad everything with zeros to (crop_size, max_msa_clusters, max_extra_msa).
    With `train=False` nothing is cropped or deleted and N_res = L. The masking profile is the
    HHblits profile of the whole MSA (before block deletion), as in OpenFold.
    Ids (`aatype`, `residue_index`, `true_msa`, `extra_msa`, `seq_length` = real residues) are
    int64, everything else float32; masks are 1 on real entries and 0 on padding.
    Cropping before clustering (OpenFold crops last) means the agreement of a row with a centre is
    counted over the cropped residues only; everything else is per column and unchanged by order.
    Cluster deletion sums are exact (integer counts below 2**24 per cluster and column); past that,
    or for fractional deletions, they round as float32 sums in raw row order.
    `process_features_recycling` makes OpenFold's per-recycling-iteration samples.
    """
    generator = torch.Generator().manual_seed(int(seed))
    inputs = _SampleInputs.from_raw(raw)
    cols = _crop_columns(inputs, config, generator, train)
    return _sample(raw, inputs, config, generator, cols, _cropped_profile(raw, inputs, cols), train)


def process_features_recycling(
    raw: Mapping[str, np.ndarray | torch.Tensor],
    config: FeatureConfig,
    seed: int,
    max_recycling_iters: int = 3,
    train: bool = True,
) -> dict[str, torch.Tensor]:
    """OpenFold's recycling samples: `max_recycling_iters + 1` samples stacked on a leading axis R.

    Every tensor of `process_features` gets a leading axis: e.g. `msa_feat` [R, N_clust, N_res, 49],
    `seq_length` [R]. As in OpenFold's `process_tensors_from_config` (with
    `resample_msa_in_recycling`), all R samples share one residue crop, while block deletion, MSA
    sampling, masking and clustering are drawn independently for each. Sample 0 equals
    `process_features(raw, config, seed, train)`; the others continue the same generator. OpenFold
    stacks the recycling axis last; hfkit's model takes no recycling axis, so this is opt-in (index
    `[r]` gives the input of recycling iteration r).
    """
    if max_recycling_iters < 0:
        raise ValueError(f"max_recycling_iters: expected >= 0, got {max_recycling_iters}")
    generator = torch.Generator().manual_seed(int(seed))
    inputs = _SampleInputs.from_raw(raw)
    cols = _crop_columns(inputs, config, generator, train)
    profile = _cropped_profile(raw, inputs, cols)  # the whole MSA's: the same for every sample
    samples = [
        _sample(raw, inputs, config, generator, cols, profile, train) for _ in range(max_recycling_iters + 1)
    ]
    return {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}


@dataclass(frozen=True)
class _SampleInputs:
    """The raw arrays `process_features` reads, as tensors (zero-copy views), checked for shape."""

    aatype: torch.Tensor  # [L]
    msa: torch.Tensor  # [N, L]
    deletions: torch.Tensor  # [N, L]
    positions: torch.Tensor | None  # [L, 37, 3]
    atom_mask: torch.Tensor | None  # [L, 37]

    @classmethod
    def from_raw(cls, raw: Mapping[str, np.ndarray | torch.Tensor]) -> _SampleInputs:
        aatype = _as_tensor(raw["aatype"])
        msa = _as_tensor(raw["msa"])
        deletions = _as_tensor(raw["deletion_matrix"])
        num_res = aatype.shape[0]
        if msa.dim() != 2 or msa.shape[1] != num_res or msa.shape[0] < 1:
            raise ValueError(f"raw['msa']: expected [N >= 1, {num_res}], got {tuple(msa.shape)}")
        if deletions.shape != msa.shape:
            raise ValueError(
                f"raw['deletion_matrix']: expected {tuple(msa.shape)}, got {tuple(deletions.shape)}"
            )
        has_structure = "all_atom_positions" in raw
        return cls(
            aatype=aatype,
            msa=msa,
            deletions=deletions,
            positions=_as_tensor(raw["all_atom_positions"]) if has_structure else None,
            atom_mask=_as_tensor(raw["all_atom_mask"]) if has_structure else None,
        )


def _crop_columns(
    inputs: _SampleInputs, config: FeatureConfig, generator: torch.Generator, train: bool
) -> torch.Tensor:
    """The residues a sample keeps, sorted int64 [N_res]: a training crop, or all of them."""
    num_res = inputs.aatype.shape[0]
    if not train:
        return torch.arange(num_res)
    # Residue crop (AF2 1.2.8), first so that everything after touches crop_size columns only.
    return choose_crop(
        num_res,
        config.crop_size,
        generator,
        config.spatial_crop_prob,
        inputs.positions,
        inputs.atom_mask,
        config.interface_threshold,
        uniform_start=config.uniform_crop_start,
    )


def _cropped_profile(
    raw: Mapping[str, np.ndarray | torch.Tensor], inputs: _SampleInputs, cols: torch.Tensor
) -> torch.Tensor:
    """The masking profile float32 [N_res, 22] of the residues `cols`: `raw["hhblits_profile"]`, else
    computed from the whole MSA (before block deletion, as in OpenFold)."""
    if "hhblits_profile" in raw:
        return _as_tensor(raw["hhblits_profile"]).index_select(0, cols).float()
    return torch.from_numpy(hhblits_profile(inputs.msa.numpy())).index_select(0, cols)


def _sample(
    raw: Mapping[str, np.ndarray | torch.Tensor],
    inputs: _SampleInputs,
    config: FeatureConfig,
    generator: torch.Generator,
    cols: torch.Tensor,
    profile: torch.Tensor,
    train: bool,
) -> dict[str, torch.Tensor]:
    """`process_features` after the crop: the sample of the residues `cols` (`profile`: their
    `_cropped_profile`), drawn from `generator`."""
    aatype, msa, deletions = inputs.aatype, inputs.msa, inputs.deletions
    positions, atom_mask = inputs.positions, inputs.atom_mask
    has_structure = positions is not None
    num_res = aatype.shape[0]
    pad_res = config.crop_size if train else num_res
    res = cols.numel()
    runs = _column_runs(cols)
    # 2. Block deletion (OpenFold's block_delete_msa, training only): whole runs of rows go, before
    # sampling; the kept rows stay in raw order, so the steps below see a shallower MSA.
    if train and config.block_delete_msa:
        keep = block_delete_rows(msa.shape[0], config, generator)
        if keep.numel() < msa.shape[0]:
            msa, deletions = msa.index_select(0, keep), deletions.index_select(0, keep)

    # 3. MSA sampling (OpenFold's sample_msa): the query stays row 0, the others are shuffled.
    num_seq = msa.shape[0]
    order = torch.cat(
        [torch.zeros(1, dtype=torch.int64), torch.randperm(num_seq - 1, generator=generator) + 1]
    )
    num_clust = min(config.max_msa_clusters, num_seq)
    extra_rows = order[num_clust:]
    num_extra = min(config.max_extra_msa, extra_rows.numel())
    # OpenFold's crop_extra_msa keeps a random subset (the first num_extra extra rows: they are
    # already in random order); with cluster_all_extra all extra rows vote, else only those.
    vote_rows = extra_rows if config.cluster_all_extra else extra_rows[:num_extra]

    # 4. Masked MSA on the centres, before clustering so profiles do not leak the hidden residues.
    # The rows go straight into the int32 buffer that becomes the clustering keys. When every
    # non-centre row votes (OpenFold's semantics), that is every row of the MSA in its raw order:
    # who votes, not in which order, decides the clusters, and sequential rows read 2x faster than
    # shuffled ones. Otherwise the centres, then the voting rows (the kept extra rows first).
    num_vote = vote_rows.numel()
    every_row = num_vote == num_seq - num_clust
    rows = None if every_row else order[: num_clust + num_vote]
    # keys[r, l] = l * 23 + id: the row of the agreement table, and once c * res * 23 is added for
    # the row's cluster c, the bin of its (cluster, column, class) profile count.
    offsets = _key_offsets(res, torch.int32)
    keys = _take(msa, rows, cols, runs, "keys", torch.int32, add=offsets)
    if every_row:
        centre_rows, kept_rows = order[:num_clust], order[num_clust : num_clust + num_extra]
        # Only the centres' and the kept rows' deletions are outputs: those rows alone are cropped
        # and converted here; the cluster sums stream through the raw rows (_row_order_deletion_sums).
        row_del = _take(deletions, order[: num_clust + num_extra], cols, runs, "deletions", torch.float32)
        centre_del, extra_del = row_del[:num_clust], row_del[num_clust:]
    else:
        centre_rows, kept_rows = torch.arange(num_clust), torch.arange(num_clust, num_clust + num_extra)
        row_del = _take(deletions, rows, cols, runs, "deletions", torch.float32)
        centre_del, extra_del = row_del.index_select(0, centre_rows), row_del.index_select(0, kept_rows)
    out_msa, out_extra = config.max_msa_clusters, config.max_extra_msa
    real_extra = (num_extra, res)
    extra_msa = _padded((out_extra, pad_res), real_extra, torch.int64)
    kept = torch.index_select(keys, 0, kept_rows, out=_scratch("kept", (num_extra, res), torch.int32))
    torch.sub(kept, offsets, out=extra_msa[:num_extra, :res])
    true_msa = keys.index_select(0, centre_rows).sub_(offsets).long()
    centres, bert_mask = mask_msa(true_msa, profile, config, generator)

    # 5. Nearest-neighbour clustering and cluster summaries (OpenFold's nearest_neighbor_clusters,
    # summarize_clusters): profile and mean deletion over each centre and its assigned rows.
    # The centres' rows of keys hold their corrupted ids.
    keys.index_copy_(0, centre_rows, (centres + offsets).to(torch.int32))
    if every_row:
        # Centre rows are assigned too (2.6% more agreement work than gathering the others out),
        # then set to their own cluster; deletions are summed over all rows in raw row order.
        cluster = (
            _assign_from_keys(keys, centres) if num_vote > 0 else torch.zeros(num_seq, dtype=torch.int64)
        )
        cluster[centre_rows] = torch.arange(num_clust)
        del_sum = _row_order_deletion_sums(deletions, cluster, num_clust, cols, runs)
    else:
        vote_del = row_del[num_clust:]
        assignment = _assign_from_keys(keys[num_clust:], centres) if num_vote > 0 else vote_rows
        cluster = torch.cat([torch.arange(num_clust), assignment])
        del_sum = centre_del.clone()
        if num_vote > 0:
            del_sum += _deletion_sums(deletions, vote_del, vote_rows, assignment, num_clust, cols, runs)
    sizes = torch.bincount(cluster, minlength=num_clust).float()
    cluster = cluster.to(torch.int32)
    keys.add_(cluster.mul_(res * _KEY_STRIDE)[:, None])
    # Profile counts, each centre in its own cluster: one flat index_add_ of ones over all keys.
    counts = _scratch("counts", (num_clust * res * _KEY_STRIDE,), torch.float32).zero_()
    counts.index_add_(0, keys.view(-1), torch.ones(1).expand(keys.numel()))

    # 6. msa_feat, every real entry written once into an uninitialised buffer: the centres' one-hot
    # (channels 0..22: zeroed, then a flat index_put_ of ones), has_deletion, deletion_value, the
    # cluster profile (counts / cluster size) and the deletion mean.
    msa_feat = torch.empty(out_msa, pad_res, MSA_FEAT_DIM)
    msa_feat[num_clust:].zero_()
    msa_feat[:num_clust, res:].zero_()
    feat = msa_feat[:num_clust, :res]
    feat[..., :MSA_NUM_CLASSES].zero_()
    one_hot = centres + torch.arange(0, res * MSA_FEAT_DIM, MSA_FEAT_DIM)
    one_hot += torch.arange(0, num_clust * pad_res * MSA_FEAT_DIM, pad_res * MSA_FEAT_DIM)[:, None]
    msa_feat.view(-1)[one_hot.view(-1)] = 1.0
    torch.clamp(centre_del, 0.0, 1.0, out=feat[..., MSA_NUM_CLASSES])
    deletion_value(centre_del, out=feat[..., MSA_NUM_CLASSES + 1])
    profile_counts = counts.view(num_clust, res, _KEY_STRIDE)
    torch.div(profile_counts, sizes[:, None, None], out=feat[..., _PROFILE_CHANNELS])
    deletion_value(del_sum / sizes[:, None], out=feat[..., MSA_FEAT_DIM - 1])

    # 7. The other outputs, written straight into zero-padded buffers.
    out: dict[str, torch.Tensor] = {}
    out["aatype"] = torch.zeros(pad_res, dtype=torch.int64)
    out["aatype"][:res] = aatype.index_select(0, cols)
    residue_index = _as_tensor(raw["residue_index"]) if "residue_index" in raw else torch.arange(num_res)
    out["residue_index"] = torch.zeros(pad_res, dtype=torch.int64)
    out["residue_index"][:res] = residue_index.index_select(0, cols)
    out["seq_mask"] = torch.zeros(pad_res)
    out["seq_mask"][:res] = 1.0
    out["seq_length"] = torch.tensor(res, dtype=torch.int64)

    target_feat = torch.zeros(pad_res, TARGET_FEAT_DIM)
    if "between_segment_residues" in raw:
        breaks = _as_tensor(raw["between_segment_residues"]).index_select(0, cols)
        target_feat[:res, 0] = breaks.float().clamp(0.0, 1.0)
    target_feat[:res, 1:].scatter_(-1, out["aatype"][:res, None].clamp(max=UNK_ID), 1.0)
    out["target_feat"] = target_feat
    out["msa_feat"] = msa_feat

    out["msa_mask"] = torch.zeros(out_msa, pad_res)
    out["msa_mask"][:num_clust, :res] = 1.0
    out["true_msa"] = torch.zeros(out_msa, pad_res, dtype=torch.int64)
    out["true_msa"][:num_clust, :res] = true_msa
    out["bert_mask"] = torch.zeros(out_msa, pad_res)
    out["bert_mask"][:num_clust, :res] = bert_mask

    out["extra_msa"] = extra_msa
    out["extra_msa_mask"] = _padded((out_extra, pad_res), real_extra, torch.float32)
    out["extra_msa_mask"][:num_extra, :res] = 1.0
    out["extra_has_deletion"] = _padded((out_extra, pad_res), real_extra, torch.float32)
    torch.clamp(extra_del, 0.0, 1.0, out=out["extra_has_deletion"][:num_extra, :res])
    out["extra_deletion_value"] = _padded((out_extra, pad_res), real_extra, torch.float32)
    deletion_value(extra_del, out=out["extra_deletion_value"][:num_extra, :res])

    if has_structure:
        assert positions is not None and atom_mask is not None
        out["all_atom_positions"] = torch.zeros(pad_res, ATOM_TYPE_NUM, 3)
        out["all_atom_positions"][:res] = positions.index_select(0, cols)
        out["all_atom_mask"] = torch.zeros(pad_res, ATOM_TYPE_NUM)
        out["all_atom_mask"][:res] = atom_mask.index_select(0, cols)
        resolution = raw.get("resolution")
        out["resolution"] = torch.tensor(0.0 if resolution is None else float(resolution))
    return out
