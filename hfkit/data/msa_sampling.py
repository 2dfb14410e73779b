"""Training-time feature transforms: raw per-chain arrays -> one fixed-size sample of model inputs.

`process_features` reproduces the semantics of OpenFold's ensembled transforms
(`input_pipeline.ensembled_transform_fns`, `data_transforms.py`) for one sample: MSA sampling with
the query kept first (AF2 supplement section 1.2.7), masked-MSA (BERT) corruption of the sampled
rows (1.2.7; the loss is 1.9.9), nearest-neighbour assignment of the extra MSA to cluster centres
and per-cluster profiles (1.2.7), the `msa_feat` / `target_feat` / `extra_msa_*` inputs of Table 1
(1.2.9), residue cropping (1.2.8, `crop.py`) and zero padding to the sizes in `FeatureConfig`.
`FEATURE_SHAPES` is the output schema.

Cost. Everything runs on int8/int32 ids; no [N, L, 23] one-hot of the full MSA is ever built.
Residues are cropped *first*, so every MSA-wide step touches crop_size columns, not L (see
`process_features` for the one consequence). The dominant step is clustering: an agreement matrix
[N_extra, N_clust] computed as an `embedding_bag` gather-sum of fp16 rows of a per-(column, residue)
table -- N_extra * crop_size * N_clust adds, ~3 ms for 4,900 extra rows, crop 256 and 128 clusters
on one CPU core, where OpenFold's dense one-hot matmul does 23x the work in float32 (~130 ms).
The cluster profiles are one `index_add_` of N_extra * crop_size ones (~1.5 ms there).
"""

from __future__ import annotations

import math
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
    "deletion_value",
    "feature_shapes",
    "mask_msa",
    "process_features",
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
    """

    crop_size: int = 256
    max_msa_clusters: int = 128
    max_extra_msa: int = 1024
    masked_msa_uniform_prob: float = 0.1
    masked_msa_profile_prob: float = 0.1
    masked_msa_same_prob: float = 0.1
    masked_msa_replace_fraction: float = 0.15
    spatial_crop_prob: float = 0.5
    interface_threshold: float = 10.0
    cluster_all_extra: bool = True

    def __post_init__(self) -> None:
        for name in ("crop_size", "max_msa_clusters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.max_extra_msa < 0:
            raise ValueError(f"max_extra_msa: expected >= 0, got {self.max_extra_msa}")
        for name in (
            "masked_msa_uniform_prob",
            "masked_msa_profile_prob",
            "masked_msa_same_prob",
            "masked_msa_replace_fraction",
            "spatial_crop_prob",
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
        """AlphaFold 2 initial training: crop 256, 128 clusters, 1024 extra rows."""
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
    values = np.arctan(deletions.detach().numpy().astype(np.float32, copy=False) / np.float32(3.0))
    out.copy_(torch.from_numpy(np.asarray(values)).mul_(2.0 / math.pi))
    return out


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
    rows, cols = bert_mask.nonzero().unbind(1)
    count = rows.numel()
    if count == 0:
        return msa.clone(), bert_mask
    own = msa[rows, cols]
    probs = torch.zeros(count, MSA_NUM_CLASSES)
    probs[:, :UNK_ID] = config.masked_msa_uniform_prob / UNK_ID  # uniform over the 20 residues
    probs[:, :_PROFILE_CLASSES] += config.masked_msa_profile_prob * profile[cols].float()
    probs[torch.arange(count), own] += config.masked_msa_same_prob
    probs[:, MASK_ID] = config.masked_msa_mask_prob
    cdf = probs.cumsum(dim=1)
    u = torch.rand((count, 1), generator=generator) * cdf[:, -1:]
    # The first class whose CDF exceeds u; zero-probability classes can never be it.
    drawn = (cdf <= u).sum(dim=1).clamp_(max=MSA_NUM_CLASSES - 1)
    corrupted = msa.clone()
    corrupted[rows, cols] = drawn
    return corrupted, bert_mask


def _column_keys(ids: torch.Tensor, num_classes: int) -> torch.Tensor:
    """ids [N, L] -> int32 column * num_classes + id: one flat slot per (column, class)."""
    offsets = torch.arange(0, ids.shape[1] * num_classes, num_classes, dtype=torch.int32)
    return ids.to(torch.int32) + offsets


def _assign_from_keys(keys: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Nearest centre of each extra row; keys: `_column_keys(extra, 23)` [E, L], centres ids [C, L]."""
    num_centres, num_res = centres.shape
    # Counts never exceed num_res; fp16 holds integers exactly up to 2048 and halves the table
    # traffic of the gather-sum, which is memory bound.
    dtype = torch.float16 if num_res <= 2048 else torch.float32
    # table[l * 23 + a, c] = 1 where centre c has residue (or X) a at column l. Gaps and the mask
    # token weigh 0, as OpenFold's weights [1]*21 + [gap_agreement_weight = 0, 0] do.
    table = torch.zeros(num_res * MSA_NUM_CLASSES, num_centres, dtype=dtype)
    centre_ids = centres.T.long()
    slots = centre_ids + torch.arange(0, num_res * MSA_NUM_CLASSES, MSA_NUM_CLASSES)[:, None]
    table.scatter_(0, slots, (centre_ids < GAP_ID).to(dtype))
    # agreement[e, c] = sum_l table[keys[e, l], c]: the weighted Hamming agreement, one bag per row.
    agreement = F.embedding_bag(keys, table, mode="sum")
    # max(dim).indices: ties go to the first centre, like OpenFold's argmax, and unlike argmax it
    # has a vectorized fp16 kernel on CPU (4x faster here).
    return agreement.max(dim=1).indices


def assign_clusters(centres: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """Nearest cluster centre of each extra row: centres ids [C, L], extra ids [E, L] -> int64 [E].

    The agreement of a row and a centre is the number of columns where both hold the same residue
    (or X); gaps and the mask token never count (OpenFold's `nearest_neighbor_clusters` with
    gap_agreement_weight 0). Each row goes to its highest-agreement centre, ties to the lowest index.
    Cost: E * L * C adds (an `embedding_bag` over an fp16 [L*23, C] table), no one-hot of the MSA.
    """
    if centres.dim() != 2 or extra.dim() != 2 or centres.shape[1] != extra.shape[1]:
        raise ValueError(
            f"centres, extra: expected [C, L] and [E, L], got {tuple(centres.shape)} and {tuple(extra.shape)}"
        )
    if extra.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int64)
    return _assign_from_keys(_column_keys(extra, MSA_NUM_CLASSES), centres)


def _as_tensor(value: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Zero-copy tensor view of a raw array; read-only arrays (mmapped records) are never written."""
    if isinstance(value, torch.Tensor):
        return value
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.as_tensor(np.asarray(value))


def _window_start(cols: torch.Tensor) -> int | None:
    """The first index when sorted `cols` form one contiguous window, else None."""
    n = cols.numel()
    if n > 0 and int(cols[-1]) - int(cols[0]) + 1 == n:
        return int(cols[0])
    return None


def _take(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, start: int | None) -> torch.Tensor:
    """x[rows][:, cols] of a 2-D x, touching only the rows asked for.

    Rows are gathered first (contiguous copies), then the columns: a view of the window starting at
    `start`, or numpy's `take` for scattered columns (4x faster than torch's int8 column gather).
    """
    block = x.index_select(0, rows)
    if start is not None:
        return block.narrow(1, start, cols.numel())
    return torch.from_numpy(np.take(block.numpy(), cols.numpy(), axis=1))


def _padded(shape: tuple[int, int], real: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised [R, C] buffer whose padding (outside [:real[0], :real[1]]) is zero.

    The caller fills the real block; zeroing only the rest saves a full pass over large buffers.
    """
    out = torch.empty(shape, dtype=dtype)
    out[real[0] :].zero_()
    out[: real[0], real[1] :].zero_()
    return out


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
    else contiguous); sample rows (query first, the others shuffled; the first `max_msa_clusters`
    are cluster centres, the rest the extra MSA); BERT-corrupt the centres; assign extra rows to
    their nearest centre; build `msa_feat` [N_clust, N_res, 49] (centre one-hot, deletions, cluster
    profile and mean deletion), `target_feat` [N_res, 22], `extra_msa*` [N_extra, N_res] (the first
    `max_extra_msa` extra rows), masks, and pad everything with zeros to (crop_size,
    max_msa_clusters, max_extra_msa). With `train=False` nothing is cropped and N_res = L.
    Ids (`aatype`, `residue_index`, `true_msa`, `extra_msa`, `seq_length` = real residues) are
    int64, everything else float32; masks are 1 on real entries and 0 on padding.
    Cropping before clustering (OpenFold crops last) means the agreement of a row with a centre is
    counted over the cropped residues only; everything else is per column and unchanged by order.
    """
    generator = torch.Generator().manual_seed(int(seed))
    aatype = _as_tensor(raw["aatype"])
    msa = _as_tensor(raw["msa"])
    deletions = _as_tensor(raw["deletion_matrix"])
    num_res = aatype.shape[0]
    if msa.dim() != 2 or msa.shape[1] != num_res or msa.shape[0] < 1:
        raise ValueError(f"raw['msa']: expected [N >= 1, {num_res}], got {tuple(msa.shape)}")
    if deletions.shape != msa.shape:
        raise ValueError(f"raw['deletion_matrix']: expected {tuple(msa.shape)}, got {tuple(deletions.shape)}")
    has_structure = "all_atom_positions" in raw
    positions = _as_tensor(raw["all_atom_positions"]) if has_structure else None
    atom_mask = _as_tensor(raw["all_atom_mask"]) if has_structure else None

    # 1. Residue crop (AF2 1.2.8), first so that everything below touches crop_size columns only.
    if train:
        cols = choose_crop(
            num_res,
            config.crop_size,
            generator,
            config.spatial_crop_prob,
            positions,
            atom_mask,
            config.interface_threshold,
        )
        pad_res = config.crop_size
    else:
        cols = torch.arange(num_res)
        pad_res = num_res
    res = cols.numel()
    start = _window_start(cols)
    if "hhblits_profile" in raw:
        profile = _as_tensor(raw["hhblits_profile"]).index_select(0, cols).float()
    else:
        profile = torch.from_numpy(hhblits_profile(msa.numpy())).index_select(0, cols)

    # 2. MSA sampling (OpenFold's sample_msa): the query stays row 0, the others are shuffled.
    num_seq = msa.shape[0]
    order = torch.cat(
        [torch.zeros(1, dtype=torch.int64), torch.randperm(num_seq - 1, generator=generator) + 1]
    )
    num_clust = min(config.max_msa_clusters, num_seq)
    centre_rows, extra_rows = order[:num_clust], order[num_clust:]
    num_extra = min(config.max_extra_msa, extra_rows.numel())
    # OpenFold's crop_extra_msa keeps a random subset; the extra rows are already in random order.
    kept_rows = extra_rows[:num_extra]
    vote_rows = extra_rows if config.cluster_all_extra else kept_rows

    # 3. Masked MSA on the centres, before clustering so profiles do not leak the hidden residues.
    true_msa = _take(msa, centre_rows, cols, start).long()
    centres, bert_mask = mask_msa(true_msa, profile, config, generator)
    centre_del = _take(deletions, centre_rows, cols, start).float()

    # 4. Nearest-neighbour clustering and cluster summaries (OpenFold's nearest_neighbor_clusters,
    # summarize_clusters): profile and mean deletion over each centre and its assigned rows. The
    # profile counts are accumulated straight into msa_feat's cluster_profile channels.
    out_msa, out_extra = config.max_msa_clusters, config.max_extra_msa
    msa_feat = torch.zeros(out_msa, pad_res, MSA_FEAT_DIM)
    feat = msa_feat[:num_clust, :res]
    profile_out = feat[..., _PROFILE_CHANNELS]
    sizes = torch.ones(num_clust)
    del_sum = centre_del.clone()
    vote_ids = _take(msa, vote_rows, cols, start)  # kept_rows are its first num_extra rows
    if vote_rows.numel() > 0:
        keys = _column_keys(vote_ids, MSA_NUM_CLASSES)
        assignment = _assign_from_keys(keys, centres)
        sizes += torch.bincount(assignment, minlength=num_clust)
        # Flat msa_feat index of (cluster c, column l, class a): (c * pad_res + l) * 49 + 25 + a
        # = keys + c * pad_res * 49 + l * 26 + 25, as keys = l * 23 + a.
        index_dtype = torch.int32 if msa_feat.numel() < 2**31 else torch.int64
        slots = keys.to(index_dtype)  # keys is not needed any more: reuse its memory
        slots += (assignment.to(index_dtype) * (pad_res * MSA_FEAT_DIM))[:, None]
        slots += torch.arange(
            _PROFILE_CHANNELS.start,
            _PROFILE_CHANNELS.start + res * (MSA_FEAT_DIM - MSA_NUM_CLASSES),
            MSA_FEAT_DIM - MSA_NUM_CLASSES,
            dtype=index_dtype,
        )
        msa_feat.view(-1).index_add_(0, slots.view(-1), torch.ones(1).expand(slots.numel()))
        # Deletion sums in the raw row order: every row of the MSA gets a target cluster, rows
        # that do not vote go to a dummy one, so the [N, L] float matrix is never gathered.
        target = torch.full((num_seq,), num_clust, dtype=torch.int64)
        target[vote_rows] = assignment
        # Summed over full rows and cropped after: index_add_ of contiguous rows is 10x faster.
        sums = torch.zeros(num_clust + 1, num_res).index_add_(0, target, deletions.float())
        del_sum += sums[:num_clust].index_select(1, cols)

    # 5. Outputs, written straight into zero-padded buffers.
    one_hot = feat[..., :MSA_NUM_CLASSES]
    one_hot.scatter_(-1, centres.unsqueeze(-1), 1.0)
    feat[..., MSA_NUM_CLASSES] = centre_del.clamp(0.0, 1.0)
    deletion_value(centre_del, out=feat[..., MSA_NUM_CLASSES + 1])
    denom = sizes[:, None, None]
    profile_out.add_(one_hot).div_(denom)  # the centre counts in its own cluster
    deletion_value(del_sum / denom[..., 0], out=feat[..., MSA_FEAT_DIM - 1])

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

    extra_del = _take(deletions, kept_rows, cols, start).float()
    real_extra = (num_extra, res)
    out["extra_msa"] = _padded((out_extra, pad_res), real_extra, torch.int64)
    out["extra_msa"][:num_extra, :res] = vote_ids[:num_extra]
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
