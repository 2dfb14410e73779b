"""Synthetic but well-formed AlphaFold training inputs: sequences, a3m MSAs, mmCIF structures, datasets.

These generators make inputs of any size (AlphaFold training scale: chains of hundreds of residues,
MSAs of thousands of rows) for measuring the data pipeline where real databases are not at hand.
They are deterministic for a given `np.random.Generator` state (or int seed) and vectorized with
numpy, so that making the inputs costs little next to parsing them.

The data are not biology: sequences follow UniProt's amino-acid frequencies, "homologs" are random
mutations of the query, and the structure is a random CA walk with 3.8 Å steps whose turning and
torsion angles mimic helix/strand/coil segments, dressed with ideal peptide-plane N, C, O and a CB.
Every file written here says "synthetic" in its header comment or description, and any timing or
result obtained from them must be labelled synthetic wherever it is reported.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hfkit.data.residue_constants import RESTYPE_1TO3, RESTYPES

__all__ = [
    "SYNTHETIC_NOTE",
    "synthetic_a3m",
    "synthetic_ca_trace",
    "synthetic_mmcif",
    "synthetic_sequence",
    "write_synthetic_dataset",
]

SYNTHETIC_NOTE = "hfkit synthetic data: not a real protein; label any result from it as synthetic"

# UniProtKB/Swiss-Prot amino-acid composition (%), in RESTYPES order ARNDCQEGHILKMFPSTWYV.
_AA_FREQ = np.array(
    [8.25, 5.53, 4.06, 5.45, 1.37, 3.93, 6.75, 7.07, 2.27, 5.96,
     9.66, 5.84, 2.42, 3.86, 4.70, 6.56, 5.34, 1.08, 2.92, 6.87]
)  # fmt: skip
_AA_FREQ = _AA_FREQ / _AA_FREQ.sum()
_AA_BYTES = np.frombuffer("".join(RESTYPES).encode(), dtype=np.uint8)
# Sampling by table lookup (a uniform index into letters repeated by frequency) is ~10x faster than
# `rng.choice(p=...)` for the millions of letters a deep MSA needs; 4096 slots round each frequency
# to within 0.025%.
_AA_TABLE = np.repeat(_AA_BYTES, np.round(_AA_FREQ * 4096).astype(int))
_GAP = ord("-")
_LOWER = 32  # ASCII offset from upper to lower case: a3m writes insertions in lower case

# One string each reads like the mmCIF loop header it makes.
_POLY_SEQ_SCHEME_FIELDS = (  # noqa: SIM905
    "asym_id entity_id seq_id mon_id ndb_seq_num pdb_seq_num auth_seq_num pdb_mon_id auth_mon_id "
    "pdb_strand_id pdb_ins_code hetero"
).split()
_ATOM_SITE_FIELDS = (  # noqa: SIM905
    "group_PDB id type_symbol label_atom_id label_alt_id label_comp_id label_asym_id label_entity_id "
    "label_seq_id pdbx_PDB_ins_code Cartn_x Cartn_y Cartn_z occupancy B_iso_or_equiv pdbx_formal_charge "
    "auth_seq_id auth_comp_id auth_asym_id auth_atom_id pdbx_PDB_model_num"
).split()

CA_CA = 3.80  # Å, trans peptide CA-CA distance


def _rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)


def synthetic_sequence(length: int, rng: np.random.Generator | int | None = None) -> str:
    """A random protein sequence of `length` residues with UniProt's amino-acid frequencies.

    `rng` is a numpy Generator (advanced by the call) or an int seed.
    """
    if not isinstance(length, int | np.integer) or length < 1:
        raise ValueError(f"length: expected an int >= 1, got {length!r}")
    return _random_letters(_rng(rng), int(length)).tobytes().decode("ascii")


def _random_letters(rng: np.random.Generator, shape: int | tuple[int, ...]) -> np.ndarray:
    """uint8 ASCII codes of random residues with UniProt's frequencies."""
    return _AA_TABLE[rng.integers(0, len(_AA_TABLE), size=shape)]


def synthetic_a3m(
    query: str,
    depth: int,
    rng: np.random.Generator | int | None = None,
    insertion_rate: float = 0.02,
    gap_rate: float = 0.05,
    identity: float = 0.4,
    max_insertion: int = 4,
) -> str:
    """An a3m MSA of `depth` rows (the query first) aligned to `query`, as HHblits writes them.

    Each hit keeps a query residue with probability ≈ `identity` (varied per row, so that the MSA has
    near and far homologs) and otherwise takes a random residue; aligned columns are upper case or `-`
    (internal gaps at `gap_rate`, plus random N/C-terminal truncation as local hits have); between
    columns, with probability `insertion_rate`, 1..`max_insertion` lower-case inserted residues. Every
    row therefore has exactly `len(query)` aligned (non-lower-case) characters. Headers are
    `>synthetic_hit_<i> ...` and the query's `>query ...`, each saying "synthetic".
    """
    if depth < 1:
        raise ValueError(f"depth: expected >= 1 (the query counts), got {depth}")
    for name, rate in (("insertion_rate", insertion_rate), ("gap_rate", gap_rate), ("identity", identity)):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"{name}: expected a probability in [0, 1], got {rate}")
    if not query or not query.isalpha() or not query.isupper():
        raise ValueError(f"query: expected upper-case one-letter residues, got {query[:20]!r}...")
    rng = _rng(rng)
    length, hits = len(query), depth - 1
    q = np.frombuffer(query.encode("ascii"), dtype=np.uint8)

    row_identity = np.clip(rng.normal(identity, 0.15, size=(hits, 1)), 0.05, 1.0)
    keep = rng.random((hits, length)) < row_identity
    aligned = np.where(keep, q, _random_letters(rng, (hits, length))).astype(np.uint8)
    aligned[rng.random((hits, length)) < gap_rate] = _GAP
    # Local alignments: hits often cover only part of the query.
    cols = np.arange(length)
    start = (rng.random(hits) * 0.3 * length).astype(int) * (rng.random(hits) < 0.5)
    stop = length - (rng.random(hits) * 0.3 * length).astype(int) * (rng.random(hits) < 0.5)
    aligned[(cols < start[:, None]) | (cols >= stop[:, None])] = _GAP

    # Slot 0 of each column holds the aligned letter, slots 1.. the insertion after it (0 = empty);
    # joining the rows and dropping the zero bytes gives every line in one vectorized pass.
    slots = np.zeros((hits, length, 1 + max_insertion), dtype=np.uint8)
    slots[:, :, 0] = aligned
    if max_insertion > 0 and insertion_rate > 0:
        n_ins = np.where(
            rng.random((hits, length)) < insertion_rate, rng.integers(1, max_insertion + 1, (hits, length)), 0
        )
        n_ins[:, -1] = 0  # HHblits writes no insertion after the last aligned column
        letters = _random_letters(rng, (hits, length, max_insertion)) + _LOWER
        slots[:, :, 1:] = np.where(np.arange(max_insertion) < n_ins[..., None], letters, 0)
    lines = slots.reshape(hits, -1)
    body = np.concatenate([lines, np.full((hits, 1), ord("\n"), dtype=np.uint8)], axis=1)
    flat = body.reshape(-1)
    rows = flat[flat != 0].tobytes().decode("ascii").splitlines()

    pct = np.rint(100 * (aligned == q).mean(axis=1)).astype(int)
    out = [f">query {SYNTHETIC_NOTE}", query]
    for i, (row, p) in enumerate(zip(rows, pct, strict=True)):
        out += [f">synthetic_hit_{i + 1} synthetic homolog, identity {p}%", row]
    return "\n".join(out) + "\n"


def _prefix_products(mats: np.ndarray) -> np.ndarray:
    """Inclusive prefix products M_0 M_1 ... M_i of [n, 3, 3] matrices (Hillis-Steele scan, log2 n steps)."""
    out = mats.copy()
    k = 1
    while k < len(out):
        out[k:] = out[:-k] @ out[k:]  # the right side is evaluated from the previous round's values
        k *= 2
    return out


def synthetic_ca_trace(length: int, rng: np.random.Generator | int | None = None) -> np.ndarray:
    """CA coordinates [length, 3] (Å) of a random walk with 3.8 Å steps and protein-like angles.

    The walk is a discrete Frenet chain: each step turns by an angle and twists by a torsion drawn per
    segment of helix (CA-CA-CA ≈ 91°, torsion ≈ 50°), strand (≈ 120°, ≈ -170°) or coil (≈ 110°,
    uniform torsion), segments of 4-14 residues. The frames are accumulated with a parallel prefix
    product, so the whole trace is computed without a Python loop over residues.
    """
    rng = _rng(rng)
    n = int(length)
    if n < 1:
        raise ValueError(f"length: expected >= 1, got {length}")
    # Secondary-structure state per step (0 helix, 1 strand, 2 coil) from random-length segments.
    seg_len = rng.integers(4, 15, size=n // 4 + 2)
    state = np.repeat(rng.choice(3, size=seg_len.size, p=[0.4, 0.25, 0.35]), seg_len)[:n]
    bend = np.deg2rad(np.array([91.0, 120.0, 110.0]))[state] + rng.normal(0, np.deg2rad(5), n)
    torsion_mean = np.deg2rad(np.array([50.0, -170.0, 0.0]))[state]
    torsion = np.where(
        state == 2,
        rng.uniform(-np.pi, np.pi, n),
        torsion_mean + rng.normal(0, np.deg2rad(10), n),
    )
    turn = np.pi - bend  # the angle between successive step directions
    ct, st, cb, sb = np.cos(torsion), np.sin(torsion), np.cos(turn), np.sin(turn)
    # R_i = Rx(torsion_i) @ Rz(turn_i): twist about the current direction (x), then turn.
    rot = np.zeros((n, 3, 3))
    rot[:, 0, 0], rot[:, 0, 1] = cb, -sb
    rot[:, 1, 0], rot[:, 1, 1], rot[:, 1, 2] = ct * sb, ct * cb, -st
    rot[:, 2, 0], rot[:, 2, 1], rot[:, 2, 2] = st * sb, st * cb, ct
    frames = _prefix_products(rot)
    steps = CA_CA * frames[:, :, 0]  # each frame's x axis is that step's direction
    ca = np.concatenate([np.zeros((1, 3)), np.cumsum(steps[:-1], axis=0)])
    # A random orientation and offset, so that structures differ beyond their internal shape.
    q, _ = np.linalg.qr(rng.normal(size=(3, 3)))
    return (ca - ca.mean(axis=0)) @ q.T + rng.normal(0, 10, 3)


def _peptide_plane() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions of C, N, O of a trans peptide in (axial, in-plane) coordinates of the CA_i → CA_i+1 axis.

    Built in the plane from ideal lengths/angles (Engh & Huber): CA-C 1.525, C-N 1.329, N-CA 1.458,
    C=O 1.231 Å; CA-C-N 116.2°, C-N-CA 121.7°, CA-C-O 120.8°. CA_i sits at the origin.
    """
    deg = np.deg2rad
    c = np.zeros(2)
    n = np.array([1.329, 0.0])
    ca1 = 1.525 * np.array([np.cos(deg(116.2)), np.sin(deg(116.2))])
    ca2 = n + 1.458 * np.array([np.cos(deg(-58.3)), np.sin(deg(-58.3))])  # trans: opposite side
    o = 1.231 * np.array([np.cos(deg(116.2 + 120.8)), np.sin(deg(116.2 + 120.8))])
    axis = (ca2 - ca1) / np.linalg.norm(ca2 - ca1)
    perp = np.array([-axis[1], axis[0]])
    to_local = lambda p: np.array([(p - ca1) @ axis, (p - ca1) @ perp])  # noqa: E731
    return to_local(c), to_local(n), to_local(o)


_PEP_C, _PEP_N, _PEP_O = _peptide_plane()


def _backbone(ca_ext: np.ndarray) -> dict[str, np.ndarray]:
    """N, CA, C, O, CB [L, 3] of residues 1..L of a trace ca_ext [L + 2, 3] (one extra CA at each end)."""
    axis = np.diff(ca_ext, axis=0)
    axis /= np.linalg.norm(axis, axis=1, keepdims=True)
    # In-plane direction of each peptide: perpendicular to its axis, towards the chain's local bend.
    ref = np.roll(axis, -1, axis=0) - np.roll(axis, 1, axis=0)
    ref[0], ref[-1] = ref[1], ref[-2]
    perp = ref - (ref * axis).sum(1, keepdims=True) * axis
    norm = np.linalg.norm(perp, axis=1, keepdims=True)
    fallback = np.cross(axis, [0.0, 0.0, 1.0]) + np.cross(axis, [0.0, 1.0, 0.0])  # straight segments
    perp = np.where(norm > 1e-6, perp / np.maximum(norm, 1e-12), fallback)
    perp /= np.linalg.norm(perp, axis=1, keepdims=True)
    start = ca_ext[:-1]
    place = lambda p: start + p[0] * axis + p[1] * perp  # noqa: E731
    pep_c, pep_n, pep_o = place(_PEP_C), place(_PEP_N), place(_PEP_O)
    n, ca, c, o = pep_n[:-1], ca_ext[1:-1], pep_c[1:], pep_o[1:]
    # CB from N, CA, C with ideal tetrahedral geometry (the constants used by trRosetta/ProteinMPNN).
    b, cc = ca - n, c - ca
    a = np.cross(b, cc)
    cb = -0.58273431 * a + 0.56802827 * b - 0.54067466 * cc + ca
    return {"N": n, "CA": ca, "C": c, "O": o, "CB": cb}


def _cif_quote(text: str) -> str:
    return f"'{text}'" if any(ch in text for ch in " \t'\"#$_;[]") else text


def synthetic_mmcif(
    length: int,
    rng: np.random.Generator | int | None = None,
    pdb_id: str = "SYN1",
    chain_id: str = "A",
    sequence: str | None = None,
    resolution: float = 2.0,
    release_date: str = "2020-01-01",
) -> str:
    """An mmCIF file (text) of one protein chain of `length` residues on a synthetic CA trace.

    Holds what AlphaFold's and hfkit's parsers read: `_entity_poly` / `_entity_poly_seq` (the SEQRES),
    `_pdbx_poly_seq_scheme`, `_chem_comp`, `_exptl.method`, `_refine.ls_d_res_high` (`resolution`),
    `_pdbx_audit_revision_history.revision_date` (`release_date`) and `_atom_site` with N, CA, C, O
    and (except for glycine) CB of every residue, label and author chain both `chain_id`. The first
    line is a comment and `_struct.title` says it is synthetic. `sequence` defaults to
    `synthetic_sequence(length, rng)`.
    """
    rng = _rng(rng)
    seq = synthetic_sequence(length, rng) if sequence is None else sequence
    if len(seq) != length:
        raise ValueError(f"sequence: expected {length} residues, got {len(seq)}")
    if any(ch not in RESTYPE_1TO3 for ch in seq):
        raise ValueError(f"sequence: only the 20 standard residues are supported, got {seq[:20]!r}...")
    atoms = _backbone(synthetic_ca_trace(length + 2, rng))
    names3 = [RESTYPE_1TO3[ch] for ch in seq]
    pid = pdb_id.upper()

    lines = [
        f"# {SYNTHETIC_NOTE}",
        f"# generated by hfkit.data.synthetic.synthetic_mmcif (length {length}, chain {chain_id})",
        f"data_{pid}",
        "#",
        f"_entry.id {pid}",
        "#",
        f"_struct.entry_id {pid}",
        "_struct.title 'hfkit synthetic structure (random CA walk, not a real protein)'",
        "#",
        f"_exptl.entry_id {pid}",
        "_exptl.method 'X-RAY DIFFRACTION'",
        "#",
        f"_refine.entry_id {pid}",
        "_refine.pdbx_refine_id 'X-RAY DIFFRACTION'",
        f"_refine.ls_d_res_high {resolution:.2f}",
        "#",
        f"_pdbx_database_status.entry_id {pid}",
        f"_pdbx_database_status.recvd_initial_deposition_date {release_date}",
        "#",
        "loop_",
        "_pdbx_audit_revision_history.ordinal",
        "_pdbx_audit_revision_history.data_content_type",
        "_pdbx_audit_revision_history.major_revision",
        "_pdbx_audit_revision_history.minor_revision",
        "_pdbx_audit_revision_history.revision_date",
        f"1 'Structure model' 1 0 {release_date}",
        "#",
        "loop_",
        "_entity.id",
        "_entity.type",
        "_entity.pdbx_description",
        "1 polymer 'synthetic protein'",
        "#",
        "loop_",
        "_entity_poly.entity_id",
        "_entity_poly.type",
        "_entity_poly.pdbx_seq_one_letter_code",
        "_entity_poly.pdbx_seq_one_letter_code_can",
        "_entity_poly.pdbx_strand_id",
        "1 'polypeptide(L)'",
        ";" + seq,
        ";",
        ";" + seq,
        ";",
        chain_id,
        "#",
        "loop_",
        "_entity_poly_seq.entity_id",
        "_entity_poly_seq.num",
        "_entity_poly_seq.mon_id",
        "_entity_poly_seq.hetero",
        *(f"1 {i + 1} {m} n" for i, m in enumerate(names3)),
        "#",
        "loop_",
        "_struct_asym.id",
        "_struct_asym.entity_id",
        f"{chain_id} 1",
        "#",
        "loop_",
        "_chem_comp.id",
        "_chem_comp.type",
        "_chem_comp.name",
        *(
            f"{m} {_cif_quote('peptide linking' if m == 'GLY' else 'L-peptide linking')} {m}"
            for m in sorted(set(names3))
        ),
        "#",
        "loop_",
        *(f"_pdbx_poly_seq_scheme.{k}" for k in _POLY_SEQ_SCHEME_FIELDS),
        *(
            f"{chain_id} 1 {i + 1} {m} {i + 1} {i + 1} {i + 1} {m} {m} {chain_id} . n"
            for i, m in enumerate(names3)
        ),
        "#",
        "loop_",
        *(f"_atom_site.{k}" for k in _ATOM_SITE_FIELDS),
    ]
    # Atoms in residue order, N CA C O CB within a residue (as in PDB files); glycine has no CB.
    order = ("N", "CA", "C", "O", "CB")
    xyz = np.stack([atoms[a] for a in order], axis=1)  # [L, 5, 3]
    present = np.ones((length, 5), dtype=bool)
    present[:, 4] = np.array([m != "GLY" for m in names3])
    res_idx, atom_idx = np.nonzero(present)
    for serial, (r, a, (x, y, z)) in enumerate(
        zip(res_idx, atom_idx, xyz[res_idx, atom_idx], strict=True), 1
    ):
        name, m, seq_id = order[a], names3[r], r + 1
        lines.append(
            f"ATOM {serial} {name[0]} {name} . {m} {chain_id} 1 {seq_id} ? {x:.3f} {y:.3f} {z:.3f} "
            f"1.00 30.00 ? {seq_id} {m} {chain_id} {name} 1"
        )
    lines.append("#")
    return "\n".join(lines) + "\n"


def write_synthetic_dataset(
    out_dir: str | os.PathLike[str],
    n_chains: int,
    length: int | Sequence[int],
    depth: int,
    seed: int = 0,
    **a3m_options: float,
) -> list[str]:
    """Write `n_chains` synthetic entries in OpenFold's layout and return their chain ids (`<id>_A`).

    Layout: `out_dir/mmcifs/<id>.cif` (one chain A each) and
    `out_dir/alignments/<id>_A/bfd_uniclust_hits.a3m` (`depth` rows), plus `out_dir/SYNTHETIC.md`
    saying what the files are. `length` is a residue count, or `(low, high)` for lengths drawn
    uniformly in [low, high]. Entry `i` uses the generator seeded with `(seed, i)`, so each file is
    reproducible on its own. `a3m_options` go to `synthetic_a3m` (`insertion_rate`, `gap_rate`,
    `identity`). Results measured on these files must be labelled synthetic.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir: {out} is a file, expected a folder")
    if n_chains < 0:
        raise ValueError(f"n_chains: expected >= 0, got {n_chains}")
    (out / "mmcifs").mkdir(parents=True, exist_ok=True)
    (out / "alignments").mkdir(parents=True, exist_ok=True)
    (out / "SYNTHETIC.md").write_text(
        f"# {SYNTHETIC_NOTE}\n\nWritten by `hfkit.data.synthetic.write_synthetic_dataset("
        f"n_chains={n_chains}, length={length!r}, depth={depth}, seed={seed})`.\n"
        "Random sequences, random-walk structures and mutated-copy MSAs: useful for timing the data "
        "pipeline, meaningless for accuracy.\n"
    )
    ids = []
    for i in range(n_chains):
        rng = np.random.default_rng([seed, i])
        if isinstance(length, int | np.integer):
            n = int(length)
        else:
            low, high = length
            n = int(rng.integers(low, high + 1))
        pdb_id = f"syn{i:05d}"
        seq = synthetic_sequence(n, rng)
        (out / "mmcifs" / f"{pdb_id}.cif").write_text(synthetic_mmcif(n, rng, pdb_id=pdb_id, sequence=seq))
        aln = out / "alignments" / f"{pdb_id}_A"
        aln.mkdir(exist_ok=True)
        (aln / "bfd_uniclust_hits.a3m").write_text(synthetic_a3m(seq, depth, rng, **a3m_options))
        ids.append(f"{pdb_id}_A")
    return ids
