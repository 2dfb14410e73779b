"""mmCIF structures to per-chain sequences and atom37 coordinates, with AlphaFold's semantics.

`parse_mmcif` reads a PDBx/mmCIF file through gemmi's C++ CIF reader and returns a `Structure`: its
release date, resolution and method, and for every protein chain (by author chain id) the SEQRES
sequence with the observed atoms placed in AlphaFold's 37-slot atom layout. It follows AlphaFold's
`data/mmcif_parsing.py` as OpenFold has it:

- protein chains are the polymer entities of `_entity_poly_seq` with at least one monomer whose
  `_chem_comp.type` contains "peptide"; sequences come from `_entity_poly_seq` (SEQRES), one letter
  per monomer: standard residues, MSE -> M, other modified residues -> their parent (gemmi's table,
  like Biopython's SCOP table in AlphaFold), anything else -> X;
- coordinates come from the first model only; an atom is placed by `label_seq_id` (its index in
  SEQRES), so SEQRES residues without coordinates keep an all-zero mask;
- of alternate locations (and duplicated atoms) the highest-occupancy one is kept, the first on ties
  (Biopython's choice); MSE's SE goes to SD's slot; atoms outside atom37 (hydrogens, OXT aside) drop;
- arginines whose NH1 lies farther from CD than NH2 get the two swapped (OpenFold's fix of naming
  errors in deposited arginines; `fix_arginine_naming=False` keeps the file's names);
- release date: the earliest `_pdbx_audit_revision_history.revision_date`; resolution: the first
  finite number of `_refine.ls_d_res_high`, `_em_3d_reconstruction.resolution`,
  `_reflns.d_resolution_high`, in that order (OpenFold's `_get_header` stops at the first key that
  parses), else 0.0.

Deviations, where AlphaFold would crash or guess: a protein chain without any atom in the first model
is left out; at a position modelled with two residue types (microheterogeneity) the atoms of the
SEQRES type are used; a duplicated `_entity_poly_seq` number keeps its first monomer; chem_comp types
are matched case-insensitively and a monomer missing from `_chem_comp` is looked up in gemmi's table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
from pathlib import Path

import gemmi
import numpy as np

from hfkit.data.parsers import ParseError, read_text
from hfkit.data.residue_constants import (
    ATOM_ORDER,
    ATOM_TYPE_NUM,
    MODIFIED_TO_PARENT,
    RESTYPE_3TO1,
    RESTYPE_ORDER,
    sequence_to_aatype,
)

__all__ = ["Chain", "Structure", "parse_mmcif"]


@dataclasses.dataclass(eq=False)
class Chain:
    """One protein chain: SEQRES sequence and atom37 coordinates, L = SEQRES length.

    aatype: int64 [L] (AlphaFold's order, 20 = X); residue_index: int32 [L] (0..L-1 in SEQRES
    order); atom_positions: float32 [L, 37, 3] in Å (zeros where unobserved); atom_mask: float32
    [L, 37] (1 where the atom was observed; all zero for residues without coordinates).
    """

    chain_id: str
    sequence: str
    aatype: np.ndarray
    residue_index: np.ndarray
    atom_positions: np.ndarray
    atom_mask: np.ndarray

    def __len__(self) -> int:
        return len(self.sequence)


@dataclasses.dataclass(eq=False)
class Structure:
    """A parsed mmCIF entry: protein chains by author chain id, and header fields.

    release_date: 'YYYY-MM-DD' or None; resolution: Å, 0.0 when the file gives none; method: the
    `_exptl.method` values, lower case, comma-joined (e.g. 'x-ray diffraction'), or None.
    """

    pdb_id: str
    chains: dict[str, Chain]
    resolution: float
    release_date: str | None
    method: str | None


# The categories read from the file; everything else is ignored.
_CATEGORIES = (
    "_atom_site.",
    "_entity_poly_seq.",
    "_chem_comp.",
    "_struct_asym.",
    "_exptl.",
    "_refine.",
    "_em_3d_reconstruction.",
    "_reflns.",
    "_pdbx_audit_revision_history.",
    "_pdbx_database_status.",
    "_entry.",
)
_RESOLUTION_KEYS = (
    ("_refine.", "ls_d_res_high"),
    ("_em_3d_reconstruction.", "resolution"),
    ("_reflns.", "d_resolution_high"),
)
_GEMMI_LOCATION = re.compile(r"^string:(\d+)(?::\d+\(\d+\))?(?: in [^:]*)?:\s*(.*)$", re.DOTALL)
_INTEGER = re.compile(r"[+-]?\d{1,12}", re.ASCII)
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}", re.ASCII)
_SD = ATOM_ORDER["SD"]
_CD, _NH1, _NH2 = ATOM_ORDER["CD"], ATOM_ORDER["NH1"], ATOM_ORDER["NH2"]

Category = dict[str, list]


def _read_categories(text: str, name: str) -> dict[str, Category]:
    """The categories of the first data block, as gemmi gives them: tag -> list of str | None | False.

    gemmi turns '?' into None and '.' into False. Any gemmi error becomes a ParseError with the line
    gemmi reports.
    """
    try:
        doc = gemmi.cif.read_string(text)
        if len(doc) == 0:
            raise ParseError("no data block ('data_...') in the file", name, 1)
        block = doc[0]
        return {cat: block.get_mmcif_category(cat) for cat in _CATEGORIES}
    except ParseError:
        raise
    except Exception as e:  # gemmi raises RuntimeError/ValueError; text conversion may raise others
        message = str(e)
        match = _GEMMI_LOCATION.match(message)
        if match is not None:
            raise ParseError(match.group(2), name, int(match.group(1))) from None
        raise ParseError(f"not a valid CIF file: {message}", name) from None


def _column(category: Category, tag: str, n: int, default: str | None = None) -> list[str | None]:
    """A category's column as strings (unset values -> `default`); `default`s if the tag is absent."""
    values = category.get(tag)
    if values is None:
        return [default] * n
    if len(values) != n:
        raise ValueError(f"{tag}: {len(values)} values, expected {n}")
    return [v if isinstance(v, str) else default for v in values]


def _rows(category: Category) -> int:
    return max((len(v) for v in category.values()), default=0)


@functools.lru_cache(maxsize=4096)
def _one_letter(residue_name: str) -> str:
    """One-letter code of a SEQRES monomer: standard, MSE -> M, modified -> parent, else X."""
    letter = RESTYPE_3TO1.get(MODIFIED_TO_PARENT.get(residue_name, residue_name))
    if letter is not None:
        return letter
    info = gemmi.find_tabulated_residue(residue_name)
    if info is not None and info.is_amino_acid() and info.one_letter_code.upper() in RESTYPE_ORDER:
        return info.one_letter_code.upper()
    return "X"


@functools.lru_cache(maxsize=4096)
def _tabulated_amino_acid(residue_name: str) -> bool:
    info = gemmi.find_tabulated_residue(residue_name)
    return info is not None and info.is_amino_acid()


def _protein_chains(cats: dict[str, Category], name: str) -> dict[str, tuple[list[str], list[int]]]:
    """label_asym_id -> (SEQRES monomers, their `_entity_poly_seq.num`s, ascending) of protein chains."""
    eps = cats["_entity_poly_seq."]
    n = _rows(eps)
    entities = _column(eps, "entity_id", n)
    nums = _column(eps, "num", n)
    monomers = _column(eps, "mon_id", n)
    polymers: dict[str, dict[int, str]] = {}
    for entity, num, mon in zip(entities, nums, monomers, strict=True):
        if entity is None or mon is None or num is None or not _INTEGER.fullmatch(num):
            raise ParseError(f"_entity_poly_seq: bad row (entity {entity}, num {num}, mon_id {mon})", name)
        polymers.setdefault(entity, {}).setdefault(int(num), mon)  # a duplicated num keeps its first

    chem = cats["_chem_comp."]
    m = _rows(chem)
    chem_types = {
        cid: (ctype or "").lower()
        for cid, ctype in zip(_column(chem, "id", m), _column(chem, "type", m), strict=True)
        if cid is not None
    }

    def is_peptide(mon: str) -> bool:
        ctype = chem_types.get(mon)
        return _tabulated_amino_acid(mon) if ctype is None else "peptide" in ctype

    # Chains of each entity; without _struct_asym, the atom records say which entity a chain holds.
    asym = cats["_struct_asym."]
    if _rows(asym):
        k = _rows(asym)
        pairs = zip(_column(asym, "id", k), _column(asym, "entity_id", k), strict=True)
    else:
        atoms = cats["_atom_site."]
        k = _rows(atoms)
        pairs = zip(_column(atoms, "label_asym_id", k), _column(atoms, "label_entity_id", k), strict=True)
    chains: dict[str, tuple[list[str], list[int]]] = {}
    for asym_id, entity in pairs:
        if asym_id is None or asym_id in chains or entity not in polymers:
            continue
        seq = polymers[entity]
        if any(is_peptide(mon) for mon in seq.values()):
            nums_sorted = sorted(seq)
            chains[asym_id] = ([seq[num] for num in nums_sorted], nums_sorted)
    return chains


def _floats(values: list[str | None], what: str, name: str) -> np.ndarray:
    """float64 array of CIF numbers; ParseError naming the first value that is not a finite number."""
    try:
        out = np.array(["nan" if v is None else v for v in values], dtype=np.float64)
    except ValueError:
        out = np.full(len(values), np.nan)
    bad = ~np.isfinite(out)
    if bad.any():
        value = values[int(np.argmax(bad))]
        shown = "an unset value ('?' or '.')" if value is None else repr(value)
        raise ParseError(f"{what}: {shown} is not a finite number", name)
    return out


def _header(cats: dict[str, Category]) -> tuple[float, str | None, str | None]:
    """(resolution, release date, method) with OpenFold's rules (see the module docstring)."""
    resolution = 0.0
    for category, tag in _RESOLUTION_KEYS:
        values = cats[category].get(tag) or []
        if values and isinstance(values[0], str):
            try:
                value = float(values[0])
            except ValueError:
                continue
            if np.isfinite(value):
                resolution = value
                break

    def dates(category: str, tag: str) -> list[str]:
        return [v for v in cats[category].get(tag) or [] if isinstance(v, str) and _DATE.fullmatch(v)]

    revisions = dates("_pdbx_audit_revision_history.", "revision_date")
    deposited = dates("_pdbx_database_status.", "recvd_initial_deposition_date")
    release_date = min(revisions) if revisions else (min(deposited) if deposited else None)

    methods = [v.lower() for v in cats["_exptl."].get("method") or [] if isinstance(v, str)]
    return resolution, release_date, ",".join(methods) if methods else None


def _chain_atoms(
    monomers: list[str],
    nums: list[int],
    seq_ids: np.ndarray,
    comps: np.ndarray,
    atom_names: np.ndarray,
    occupancy: np.ndarray,
    xyz: tuple[list, list, list],
    rows: np.ndarray,
    name: str,
    fix_arginine_naming: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """atom37 (positions [L, 37, 3], mask [L, 37]) of one chain from its atom records `rows`.

    Vectorized over atoms: each record gets a SEQRES position (by label_seq_id) and an atom37 slot;
    records of the wrong residue type (microheterogeneity) drop; of the records left for one
    (position, slot) the highest-occupancy one wins, the first in the file on ties. With
    `fix_arginine_naming`, arginines' NH1/NH2 are swapped where NH1 is the farther from CD.
    """
    length = len(monomers)
    positions = np.zeros((length, ATOM_TYPE_NUM, 3), dtype=np.float32)
    mask = np.zeros((length, ATOM_TYPE_NUM), dtype=np.float32)
    nums_arr = np.asarray(nums, dtype=np.int64)
    seq = seq_ids[rows]
    pos = np.clip(np.searchsorted(nums_arr, seq), 0, length - 1)
    comp = comps[rows]
    atom = atom_names[rows]
    slot = np.array([ATOM_ORDER.get(a, -1) for a in atom.tolist()], dtype=np.int64).reshape(-1)
    slot[(atom == "SE") & (comp == "MSE")] = _SD  # selenomethionine's Se sits where Met's S would
    keep = (nums_arr[pos] == seq) & (slot >= 0)

    seqres_comp = np.asarray(monomers, dtype=object)[pos]
    matches = keep & (comp == seqres_comp)
    has_match = np.zeros(length, dtype=bool)
    has_match[pos[matches]] = True
    # Positions whose atoms never match SEQRES (a naming mismatch): use the first residue type seen.
    first_comp = np.empty(length, dtype=object)
    kept = np.flatnonzero(keep)
    order = kept[::-1]  # assigning in reverse file order leaves the first record's value
    first_comp[pos[order]] = comp[order]
    keep &= matches | (~has_match[pos] & (comp == first_comp[pos]))

    kept = np.flatnonzero(keep)
    if kept.size == 0:
        return positions, mask
    occ = occupancy[rows[kept]]
    order = np.lexsort((kept, -occ, slot[kept], pos[kept]))  # by position, slot, occupancy desc, file
    chosen = kept[order]
    key = pos[chosen] * ATOM_TYPE_NUM + slot[chosen]
    first = np.ones(chosen.size, dtype=bool)
    first[1:] = key[1:] != key[:-1]
    chosen = chosen[first]
    records = rows[chosen].tolist()
    coords = np.stack([_floats([axis[i] for i in records], "_atom_site.Cartn", name) for axis in xyz], -1)
    with np.errstate(over="ignore"):  # checked just below
        coords32 = coords.astype(np.float32)
    if not np.isfinite(coords32).all():
        raise ParseError("_atom_site.Cartn: a coordinate overflows float32", name)
    positions[pos[chosen], slot[chosen]] = coords32
    mask[pos[chosen], slot[chosen]] = 1.0
    if fix_arginine_naming:
        residue_comp = np.empty(length, dtype=object)
        residue_comp[pos[chosen]] = comp[chosen]  # one residue type per position (kept above)
        _fix_arginine_naming(positions, mask, residue_comp == "ARG")
    return positions, mask


def _fix_arginine_naming(positions: np.ndarray, mask: np.ndarray, is_arginine: np.ndarray) -> None:
    """Swap NH1 and NH2 in place where an arginine's NH1 is farther from CD than its NH2.

    positions float32 [L, 37, 3], mask [L, 37], is_arginine bool [L]. Only residues with CD, NH1 and
    NH2 all observed are looked at; the distances are float32, as OpenFold's `get_atom_coords`
    computes them, so the same residues swap.
    """
    observed = (mask[:, [_CD, _NH1, _NH2]] > 0).all(axis=1)
    nh1_far = np.linalg.norm(positions[:, _NH1] - positions[:, _CD], axis=-1) > np.linalg.norm(
        positions[:, _NH2] - positions[:, _CD], axis=-1
    )
    swap = np.flatnonzero(is_arginine & observed & nh1_far)
    positions[swap, _NH1], positions[swap, _NH2] = positions[swap, _NH2], positions[swap, _NH1]


def parse_mmcif(
    source: str | os.PathLike, *, text: str | None = None, fix_arginine_naming: bool = True
) -> Structure:
    """Parse an mmCIF file (or `text`, with `source` naming it) into a `Structure` of protein chains.

    Semantics are OpenFold's (module docstring): SEQRES sequences with MSE -> M and unknown -> X,
    first model only, atoms aligned to SEQRES by label_seq_id, highest-occupancy alternate location,
    arginine NH1/NH2 named by distance to CD (`fix_arginine_naming=False`: as the file names them),
    author chain ids as keys, earliest revision date, the first resolution key that parses, 0.0
    when absent. `pdb_id` is
    `_entry.id` in lower case, else the file name's stem. A `.gz` path is decompressed. Raises
    ParseError with the file name (and the line, where gemmi gives one) for an unreadable or invalid
    CIF, missing atom records, bad numbers, or a file without protein chains that have coordinates.
    """
    name = os.fsdecode(source)
    if text is None:
        text = read_text(source)
    cats = _read_categories(text, name)
    try:
        return _build_structure(cats, name, fix_arginine_naming)
    except ValueError as e:
        if isinstance(e, ParseError):
            raise
        raise ParseError(str(e), name) from None


def _build_structure(cats: dict[str, Category], name: str, fix_arginine_naming: bool) -> Structure:
    chains_seqres = _protein_chains(cats, name)
    if not chains_seqres:
        raise ParseError("no protein chains in the file", name)

    atoms = cats["_atom_site."]
    n = _rows(atoms)
    for tag in ("label_atom_id", "label_comp_id", "label_asym_id", "label_seq_id", "Cartn_x"):
        if tag not in atoms:
            raise ParseError(f"no _atom_site.{tag} column (no coordinates)", name)
    models = _column(atoms, "pdbx_PDB_model_num", n, "1")
    label_asym = np.array(_column(atoms, "label_asym_id", n, ""), dtype=object)
    auth_asym = _column(atoms, "auth_asym_id", n)
    in_first_model = np.array([m == models[0] for m in models], dtype=bool)
    seq_ids = np.array(
        [
            int(s) if s is not None and _INTEGER.fullmatch(s) else -(2**62)
            for s in _column(atoms, "label_seq_id", n)
        ],
        dtype=np.int64,
    ).reshape(-1)
    comps = np.array(_column(atoms, "label_comp_id", n, ""), dtype=object)
    atom_names = np.array(_column(atoms, "label_atom_id", n, ""), dtype=object)
    occupancy = _numbers(_column(atoms, "occupancy", n, "1"), default=0.0)
    xyz = tuple(_column(atoms, f"Cartn_{axis}", n) for axis in "xyz")

    chains: dict[str, Chain] = {}
    for asym_id, (monomers, nums) in chains_seqres.items():
        rows = np.flatnonzero(in_first_model & (label_asym == asym_id))
        if rows.size == 0:
            continue  # no coordinates in the first model: nothing to learn from
        chain_id = auth_asym[rows[0]] or asym_id
        if chain_id in chains:
            raise ParseError(f"author chain id {chain_id!r} is used by two protein chains", name)
        positions, mask = _chain_atoms(
            monomers, nums, seq_ids, comps, atom_names, occupancy, xyz, rows, name, fix_arginine_naming
        )
        sequence = "".join(_one_letter(mon) for mon in monomers)
        chains[chain_id] = Chain(
            chain_id=chain_id,
            sequence=sequence,
            aatype=sequence_to_aatype(sequence),
            residue_index=np.arange(len(sequence), dtype=np.int32),
            atom_positions=positions,
            atom_mask=mask,
        )
    if not chains:
        raise ParseError("no protein chain has atoms in the first model", name)

    resolution, release_date, method = _header(cats)
    entry = cats["_entry."].get("id") or []
    if entry and isinstance(entry[0], str) and entry[0].strip():
        pdb_id = entry[0].strip().lower()
    else:
        pdb_id = Path(name).name.split(".")[0]
    return Structure(
        pdb_id=pdb_id, chains=chains, resolution=resolution, release_date=release_date, method=method
    )


def _numbers(values: list[str | None], default: float) -> np.ndarray:
    """float64 array of CIF numbers, `default` where a value is unset or not a number."""
    try:  # the common case, parsed in one call
        return np.array([default if v is None else v for v in values], dtype=np.float64).reshape(-1)
    except ValueError:
        out = np.full(len(values), default)
        for i, v in enumerate(values):
            with contextlib.suppress(TypeError, ValueError):
                out[i] = float(v)
        return out
