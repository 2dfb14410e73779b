"""Pieces of the small hand-written mmCIF entries the data tests parse."""

from __future__ import annotations

from collections.abc import Sequence

ATOM_SITE_COLUMNS = (
    "group_PDB",
    "id",
    "label_atom_id",
    "label_alt_id",
    "label_comp_id",
    "label_asym_id",
    "label_entity_id",
    "label_seq_id",
    "Cartn_x",
    "Cartn_y",
    "Cartn_z",
    "occupancy",
    "auth_asym_id",
    "pdbx_PDB_model_num",
)
"""The `_atom_site` columns an entry lists, in order (what AlphaFold's parser reads)."""


def atom_site_loop(rows: str, columns: Sequence[str] = ATOM_SITE_COLUMNS) -> str:
    """An `_atom_site` loop: `loop_`, a `_atom_site.<column>` line a column, then `rows` (lines of
    values, one an atom, in the order of `columns`)."""
    return "".join(f"{line}\n" for line in ["loop_", *(f"_atom_site.{c}" for c in columns)]) + rows
