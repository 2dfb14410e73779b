"""Residue and atom vocabularies of AlphaFold 2, as used by OpenFold's features.

Amino acids are indexed in AlphaFold's order (`RESTYPES`, 20 standard residues), then 20 = unknown
(`X`) and, in MSA encodings, 21 = gap (`-`) and 22 = the masked-MSA token. Atoms use the 37-slot
`atom37` layout (`ATOM_TYPES`). Values follow the AlphaFold 2 supplement (section 1.2) and OpenFold's
`residue_constants.py`; this file holds only what hfkit's data pipeline needs.
"""

from __future__ import annotations

import numpy as np

RESTYPES: tuple[str, ...] = tuple("ARNDCQEGHILKMFPSTWYV")
RESTYPE_NUM = len(RESTYPES)  # 20
UNK_ID = 20  # 'X' and any non-standard residue
GAP_ID = 21  # '-' in an MSA
MASK_ID = 22  # the masked-MSA (BERT) token
MSA_NUM_CLASSES = 23  # 20 residues + X + gap + mask: the width of msa_feat's one-hot blocks

RESTYPE_ORDER: dict[str, int] = {r: i for i, r in enumerate(RESTYPES)}

# Three-letter codes of the standard residues, and modified residues AlphaFold maps to a parent.
RESTYPE_1TO3: dict[str, str] = {
    "A": "ALA", "R": "ARG", "N": "ASN", "D": "ASP", "C": "CYS", "Q": "GLN", "E": "GLU", "G": "GLY",
    "H": "HIS", "I": "ILE", "L": "LEU", "K": "LYS", "M": "MET", "F": "PHE", "P": "PRO", "S": "SER",
    "T": "THR", "W": "TRP", "Y": "TYR", "V": "VAL",
}  # fmt: skip
RESTYPE_3TO1: dict[str, str] = {v: k for k, v in RESTYPE_1TO3.items()}
# Selenomethionine is read as methionine (its SE atom takes SD's slot), as AlphaFold does.
MODIFIED_TO_PARENT: dict[str, str] = {"MSE": "MET"}

ATOM_TYPES: tuple[str, ...] = (
    "N", "CA", "C", "CB", "O", "CG", "CG1", "CG2", "OG", "OG1", "SG", "CD", "CD1", "CD2", "ND1",
    "ND2", "OD1", "OD2", "SD", "CE", "CE1", "CE2", "CE3", "NE", "NE1", "NE2", "OE1", "OE2", "CH2",
    "NH1", "NH2", "OH", "CZ", "CZ2", "CZ3", "NZ", "OXT",
)  # fmt: skip
ATOM_ORDER: dict[str, int] = {a: i for i, a in enumerate(ATOM_TYPES)}
ATOM_TYPE_NUM = len(ATOM_TYPES)  # 37

# HHblits' alphabet (a3m/Stockholm letters) to AlphaFold ids: ambiguous codes go to a plausible
# parent (B->D, Z->E, U->C), unknown and rare ones (J, O, X) to X, gaps to GAP_ID.
HHBLITS_TO_ID: dict[str, int] = {
    **RESTYPE_ORDER,
    "B": RESTYPE_ORDER["D"],
    "Z": RESTYPE_ORDER["E"],
    "U": RESTYPE_ORDER["C"],
    "J": UNK_ID,
    "O": UNK_ID,
    "X": UNK_ID,
    "-": GAP_ID,
}

# A 256-entry lookup table from ASCII code to MSA id, for vectorized encoding of whole alignments.
_MSA_LUT = np.full(256, UNK_ID, dtype=np.int8)
for _letter, _id in HHBLITS_TO_ID.items():
    _MSA_LUT[ord(_letter)] = _id
    _MSA_LUT[ord(_letter.lower())] = _id


def sequence_to_aatype(sequence: str) -> np.ndarray:
    """One-letter sequence -> int64 ids [L] in AlphaFold's order; anything non-standard -> 20 (X)."""
    return np.array([RESTYPE_ORDER.get(c, UNK_ID) for c in sequence.upper()], dtype=np.int64)


def encode_msa(sequences: list[str]) -> np.ndarray:
    """Aligned sequences of one length -> int8 ids [N, L] with HHblits' letters mapped (gap = 21).

    Vectorized: the sequences are joined into one byte buffer and mapped through a lookup table.
    Raises ValueError if the rows differ in length (insertions must already be removed).
    """
    if not sequences:
        return np.zeros((0, 0), dtype=np.int8)
    length = len(sequences[0])
    if any(len(s) != length for s in sequences):
        raise ValueError("sequences: aligned rows must all have the query's length")
    buf = np.frombuffer("".join(sequences).encode("ascii", "replace"), dtype=np.uint8)
    return _MSA_LUT[buf].reshape(len(sequences), length)
