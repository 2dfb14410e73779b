"""Raw per-chain features: the un-sampled, un-cropped numpy arrays that records store for one chain.

`make_raw_features` combines the sequence features, the MSA features (all source alignments merged
and deduplicated, query first) and, for training chains, the structure features, as OpenFold's
`data_pipeline.make_sequence_features` / `make_msa_features` / `make_protein_features` do. Values are
numpy arrays with fixed dtypes so a record round-trips them exactly; the training-time transforms
(MSA sampling, masking, clustering, cropping, padding) live in `msa_sampling.py` and `crop.py`.

Unlike OpenFold, `aatype` is stored as ids [L] (not one-hot [L, 21]) and `msa` as int8 ids in
AlphaFold's residue order already (OpenFold stores HHblits order and remaps later), to keep records
small; `hhblits_profile` is precomputed here because it is a per-chain constant.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from hfkit.data.residue_constants import (
    ATOM_TYPE_NUM,
    GAP_ID,
    UNK_ID,
    encode_msa,
    sequence_to_aatype,
)

__all__ = [
    "HHBLITS_PROFILE_CLASSES",
    "RAW_FEATURE_DTYPES",
    "ChainLike",
    "MsaLike",
    "deletion_dtype",
    "hhblits_profile",
    "make_msa_features",
    "make_raw_features",
    "make_sequence_features",
    "make_structure_features",
]

# The profile covers the 20 residues, X and gap; the mask token never occurs in a raw MSA.
HHBLITS_PROFILE_CLASSES = GAP_ID + 1  # 22

# The dtype of every raw feature (`domain_name` is a 0-d numpy str array).
RAW_FEATURE_DTYPES: dict[str, np.dtype] = {
    "aatype": np.dtype(np.int8),
    "between_segment_residues": np.dtype(np.int8),
    "residue_index": np.dtype(np.int32),
    "seq_length": np.dtype(np.int32),
    "msa": np.dtype(np.int8),
    # Counts, not floats, in one byte a cell (records are mostly this matrix: smaller ones read and
    # checksum faster) -- or uint16 (`deletion_dtype`) when a count exceeds 255; a run of over 65535
    # deleted residues cannot occur in a protein alignment, and is clipped.
    "deletion_matrix": np.dtype(np.uint8),
    "num_alignments": np.dtype(np.int32),
    "hhblits_profile": np.dtype(np.float32),
    "all_atom_positions": np.dtype(np.float32),
    "all_atom_mask": np.dtype(np.float32),
    "resolution": np.dtype(np.float32),
}


class MsaLike(Protocol):
    """What the MSA features read from an alignment (`hfkit.data.parsers.Msa` has it)."""

    sequences: Sequence[str]  # aligned rows of the query's length, row 0 = query
    deletion_matrix: np.ndarray  # int [N, L]: residues deleted (a3m lower case) before each column


class ChainLike(Protocol):
    """What the structure features read from a chain (`hfkit.data.mmcif.Chain` has it)."""

    aatype: np.ndarray  # [L]
    atom_positions: np.ndarray  # float [L, 37, 3]
    atom_mask: np.ndarray  # float [L, 37]


def make_sequence_features(sequence: str, description: str = "") -> dict[str, np.ndarray]:
    """Per-residue features of one chain: `aatype` int8 ids [L] (20 = X), `residue_index` int32 [L].

    Also `between_segment_residues` int8 zeros [L] (no domain breaks within a chain), `seq_length`
    int32 [] and `domain_name` (0-d str array holding `description`). OpenFold one-hot encodes
    `aatype` here; ids keep records 21x smaller and `process_features` builds the one-hot.
    """
    if not sequence:
        raise ValueError("sequence: expected at least one residue, got an empty string")
    length = len(sequence)
    return {
        "aatype": sequence_to_aatype(sequence).astype(np.int8),
        "between_segment_residues": np.zeros(length, dtype=np.int8),
        "residue_index": np.arange(length, dtype=np.int32),
        "seq_length": np.array(length, dtype=np.int32),
        "domain_name": np.array(description),
    }


def hhblits_profile(msa: np.ndarray) -> np.ndarray:
    """Column frequencies of an MSA: msa ids [N, L] -> float32 [L, 22] (20 residues, X, gap).

    The HHblits profile of OpenFold's `make_hhblits_profile` (mean of the 22-class one-hot over rows),
    computed with one `bincount` over `column * 22 + id` instead of an [N, L, 22] one-hot.
    """
    if msa.ndim != 2 or msa.shape[0] == 0:
        raise ValueError(f"msa: expected ids [N >= 1, L], got shape {msa.shape}")
    num_seq, length = msa.shape
    if msa.max(initial=0) >= HHBLITS_PROFILE_CLASSES:
        raise ValueError(f"msa: expected ids < {HHBLITS_PROFILE_CLASSES}, got max {msa.max()}")
    keys = np.arange(length, dtype=np.intp) * HHBLITS_PROFILE_CLASSES + msa
    counts = np.bincount(keys.ravel(), minlength=length * HHBLITS_PROFILE_CLASSES)
    return (counts.reshape(length, HHBLITS_PROFILE_CLASSES) / num_seq).astype(np.float32)


def deletion_dtype(counts: np.ndarray) -> np.dtype:
    """The dtype raw deletion counts are kept in: uint8 when every count is at most 255, else uint16."""
    small = counts.size == 0 or int(counts.max()) <= np.iinfo(np.uint8).max
    return np.dtype(np.uint8) if small else np.dtype(np.uint16)


def make_msa_features(msas: Sequence[MsaLike]) -> dict[str, np.ndarray]:
    """Merge alignments into `msa` int8 ids [N, L] and `deletion_matrix` counts [N, L] (`deletion_dtype`).

    Rows identical (as aligned strings) to an earlier row, of this or an earlier alignment, are
    dropped, so the first alignment's query stays row 0 (OpenFold's `make_msa_features`). The
    deduplication is one `np.unique` over the rows' bytes, not a Python set. Also returns
    `num_alignments` int32 [] (N after deduplication) and `hhblits_profile` float32 [L, 22].
    """
    if not msas:
        raise ValueError("msas: expected at least one alignment (the query alone counts), got none")
    width = None
    for i, msa in enumerate(msas):
        if len(msa.sequences) == 0:
            raise ValueError(f"msas[{i}]: must contain at least one sequence")
        if width is None:
            width = len(msa.sequences[0])
        shape = np.shape(msa.deletion_matrix)
        if shape != (len(msa.sequences), width):
            raise ValueError(
                f"msas[{i}].deletion_matrix: expected shape {(len(msa.sequences), width)}, got {shape}"
            )
    assert width is not None
    if width == 0:
        raise ValueError("msas[0]: the query row is empty")

    rows = list(itertools.chain.from_iterable(m.sequences for m in msas))
    ids = encode_msa(rows)  # also checks that every row has the query's width
    raw = np.frombuffer("".join(rows).encode("ascii", "replace"), dtype=np.uint8).reshape(len(rows), width)
    # np.unique's return_index is the first occurrence of each distinct row; sorting those keeps
    # the original order (query first, earlier sources first).
    _, first = np.unique(raw.view(np.dtype((np.void, width))).ravel(), return_index=True)
    keep = np.sort(first)
    deletions = np.concatenate([np.asarray(m.deletion_matrix) for m in msas], axis=0)[keep]
    np.clip(deletions, 0, np.iinfo(np.uint16).max, out=deletions)
    msa = np.ascontiguousarray(ids[keep], dtype=np.int8)
    return {
        "msa": msa,
        "deletion_matrix": deletions.astype(deletion_dtype(deletions), copy=False),
        "num_alignments": np.array(len(keep), dtype=np.int32),
        "hhblits_profile": hhblits_profile(msa),
    }


def make_structure_features(chain: ChainLike, resolution: float = 0.0) -> dict[str, np.ndarray]:
    """Ground truth of one chain: `all_atom_positions` float32 [L, 37, 3], `all_atom_mask` [L, 37].

    Also `resolution` float32 [] (Å; 0 where unknown). Atoms follow the atom37 layout of
    `residue_constants.ATOM_TYPES`; the mask is 1 where the atom was resolved.
    """
    positions = np.asarray(chain.atom_positions, dtype=np.float32)
    mask = np.asarray(chain.atom_mask, dtype=np.float32)
    length = len(chain.aatype)
    if positions.shape != (length, ATOM_TYPE_NUM, 3):
        raise ValueError(
            f"chain.atom_positions: expected shape {(length, ATOM_TYPE_NUM, 3)}, got {positions.shape}"
        )
    if mask.shape != (length, ATOM_TYPE_NUM):
        raise ValueError(f"chain.atom_mask: expected shape {(length, ATOM_TYPE_NUM)}, got {mask.shape}")
    return {
        "all_atom_positions": positions,
        "all_atom_mask": mask,
        "resolution": np.array(resolution, dtype=np.float32),
    }


def make_raw_features(
    sequence: str,
    msas: Sequence[MsaLike],
    chain: ChainLike | None = None,
    resolution: float = 0.0,
    description: str = "",
) -> dict[str, np.ndarray]:
    """All raw features of one chain of L residues: sequence, MSA [N, L] and (if `chain`) structure.

    `msas` are the chain's alignments (e.g. UniRef90, MGnify, BFD/Uniclust, UniProt), each with the
    query as row 0 and rows of width L; with none, the query alone is the MSA. `chain`, when given,
    must have L residues. See `make_sequence_features`, `make_msa_features` and
    `make_structure_features` for the keys; dtypes are `RAW_FEATURE_DTYPES`.
    """
    features = make_sequence_features(sequence, description)
    if not msas:
        msas = [_QueryOnly(sequence)]
    msa_features = make_msa_features(msas)
    width = msa_features["msa"].shape[1]
    if width != len(sequence):
        raise ValueError(f"msas: expected rows of the sequence's length {len(sequence)}, got {width}")
    # Every alignment's query must be this sequence; X and non-standard letters match anything, as
    # the MSA tools and mmCIF SEQRES disagree on those (e.g. U, MSE).
    queries = encode_msa([m.sequences[0] for m in msas]).astype(np.int64)
    aatype = features["aatype"].astype(np.int64)
    clash = (queries != aatype) & (queries < UNK_ID) & (aatype < UNK_ID)
    if clash.any():
        i, col = (int(v[0]) for v in np.nonzero(clash))
        raise ValueError(
            f"msas[{i}]: query row differs from the sequence at residue {col}: "
            f"expected {sequence[col]!r}, got {msas[i].sequences[0][col]!r}"
        )
    features.update(msa_features)
    if chain is not None:
        if len(chain.aatype) != len(sequence):
            raise ValueError(f"chain: expected {len(sequence)} residues, got {len(chain.aatype)}")
        features.update(make_structure_features(chain, resolution))
    return features


class _QueryOnly:
    """A one-row alignment holding just the query, for chains without MSAs."""

    def __init__(self, sequence: str) -> None:
        self.sequences = [sequence]
        self.deletion_matrix = np.zeros((1, len(sequence)), dtype=np.int32)
