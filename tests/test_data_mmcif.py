"""Tests of hfkit.data.mmcif: OpenFold's 2q2k cache entry and four more real entries, a small
hand-written mmCIF for AlphaFold's rules (models, altlocs, MSE, unobserved residues), error reporting,
and fuzzing (parse_mmcif returns or raises ParseError, nothing else)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import gemmi
import numpy as np
import pytest
from conftest import real_data
from fuzz_edits import EDIT_OPS, edit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mmcif_cases import atom_site_loop

from hfkit.data.mmcif import Structure, parse_mmcif
from hfkit.data.parsers import ParseError, parse_fasta, parse_hhr
from hfkit.data.residue_constants import ATOM_ORDER, sequence_to_aatype

CA, SD = ATOM_ORDER["CA"], ATOM_ORDER["SD"]


@pytest.fixture(scope="module")
def openfold_data() -> Path:
    """OpenFold's test data, shared beside the repository (never copied into it)."""
    return real_data("mmcifs").parent


def check_chain_arrays(structure: Structure) -> None:
    for chain_id, chain in structure.chains.items():
        n = len(chain.sequence)
        assert chain.chain_id == chain_id
        assert chain.aatype.shape == (n,) and chain.aatype.dtype == np.int64
        np.testing.assert_array_equal(chain.aatype, sequence_to_aatype(chain.sequence))
        np.testing.assert_array_equal(chain.residue_index, np.arange(n, dtype=np.int32))
        assert chain.residue_index.dtype == np.int32
        assert chain.atom_positions.shape == (n, 37, 3) and chain.atom_positions.dtype == np.float32
        assert chain.atom_mask.shape == (n, 37) and chain.atom_mask.dtype == np.float32
        assert set(np.unique(chain.atom_mask)) <= {0.0, 1.0}
        observed = chain.atom_mask.astype(bool)
        assert np.isfinite(chain.atom_positions[observed]).all()
        assert (chain.atom_positions[~observed] == 0).all()


# --------------------------------------------------------------------------------------------------
# Real entries


def test_2q2k_matches_openfold_cache(openfold_data: Path) -> None:
    cache = json.loads((openfold_data / "train_mmcifs_cache.json").read_text())["2q2k"]
    structure = parse_mmcif(openfold_data / "mmcifs" / "2q2k.cif")
    assert structure.pdb_id == "2q2k"
    assert list(structure.chains) == cache["chain_ids"] == ["A", "B"]
    assert [c.sequence for c in structure.chains.values()] == cache["seqs"]
    assert structure.resolution == cache["resolution"] == 3.0
    assert structure.release_date == cache["release_date"] == "2008-02-05"
    assert structure.method == "x-ray diffraction"
    check_chain_arrays(structure)


def test_2q2k_unobserved_residues_have_zero_mask(openfold_data: Path) -> None:
    path = openfold_data / "mmcifs" / "2q2k.cif"
    structure = parse_mmcif(path)
    # An independent account of what was observed: _pdbx_poly_seq_scheme marks unmodelled residues
    # with pdb_mon_id '?' (the His-tag and linker, and a few C-terminal residues, in 2q2k).
    scheme = gemmi.cif.read(str(path)).sole_block().get_mmcif_category("_pdbx_poly_seq_scheme.")
    for chain_id, chain in structure.chains.items():
        rows = [i for i, strand in enumerate(scheme["pdb_strand_id"]) if strand == chain_id]
        assert len(rows) == len(chain.sequence) == 70  # every SEQRES residue, observed or not
        observed = np.array([scheme["pdb_mon_id"][i] is not None for i in rows])
        assert not observed[:19].any()  # MGSSHHHHHHSSGLVPGSH: the expression tag is disordered
        assert observed.sum() > 40
        np.testing.assert_array_equal(chain.atom_mask[:, CA] == 1, observed)
        assert (chain.atom_mask[~observed] == 0).all()
        assert (chain.atom_mask[observed].sum(axis=1) >= 4).all()  # N, CA, C, O at least


@pytest.mark.parametrize("pdb_id", ["3zee", "4i6p", "4zey", "3u8v"])
def test_other_entries_parse(openfold_data: Path, pdb_id: str) -> None:
    path = openfold_data / "mmcifs" / f"{pdb_id}.cif"
    structure = parse_mmcif(path)
    assert structure.pdb_id == pdb_id and structure.chains
    assert structure.release_date is not None and structure.resolution > 0
    check_chain_arrays(structure)
    for chain in structure.chains.values():
        assert chain.atom_mask[:, CA].sum() > 0.8 * len(chain.sequence)
    # The same text given directly parses the same.
    again = parse_mmcif("x.cif", text=path.read_text())
    assert list(again.chains) == list(structure.chains)


def test_real_header_fields(openfold_data: Path) -> None:
    em = parse_mmcif(openfold_data / "mmcifs" / "3zee.cif")
    assert em.method == "electron microscopy" and em.resolution == pytest.approx(6.1)
    assert parse_mmcif(openfold_data / "mmcifs" / "4zey.cif").resolution == pytest.approx(1.5)


def test_selenomethionine_in_4zey(openfold_data: Path) -> None:
    chain = parse_mmcif(openfold_data / "mmcifs" / "4zey.cif").chains["A"]
    # MSE (label_seq_id 2): SEQRES letter M, its SE at 9.630 24.320 9.473 in SD's slot.
    assert chain.sequence[1] == "M"
    assert chain.atom_mask[1, SD] == 1
    np.testing.assert_allclose(chain.atom_positions[1, SD], [9.630, 24.320, 9.473], atol=1e-4)


def test_alternate_locations_in_3u8v(openfold_data: Path) -> None:
    chain = parse_mmcif(openfold_data / "mmcifs" / "3u8v.cif").chains["A"]
    # GLN 28 has CG in conformers A and B at occupancy 0.50 each: the first (A) is kept.
    np.testing.assert_allclose(
        chain.atom_positions[27, ATOM_ORDER["CG"]], [-8.117, -8.878, -1.336], atol=1e-4
    )


def test_template_hits_agree_with_mmcif_sequences(openfold_data: Path) -> None:
    """HHsearch hits against PDB70 index SEQRES: their residues must be the mmCIF chain's."""
    hits = parse_hhr((openfold_data / "alignments" / "pdb70_hits.hhr").read_text())
    checked = 0
    for hit in hits:
        pdb_id, chain_id = hit.name.split("_")
        path = openfold_data / "mmcifs" / f"{pdb_id.lower()}.cif"
        if path.exists():
            sequence = parse_mmcif(path).chains[chain_id].sequence
            pairs = [(i, c) for i, c in zip(hit.indices_hit, hit.hit_sequence, strict=True) if i >= 0]
            assert all(sequence[i] == c for i, c in pairs), hit.name
            checked += 1
    assert checked == 5
    assert parse_fasta((openfold_data / "short.fasta").read_text())[1] == ["query"]


# --------------------------------------------------------------------------------------------------
# A small hand-written entry for AlphaFold's rules

SMALL_CIF = """data_TEST
_entry.id TEST
_exptl.method 'X-RAY DIFFRACTION'
_refine.ls_d_res_high 2.10
_reflns.d_resolution_high 2.05
loop_
_pdbx_audit_revision_history.ordinal
_pdbx_audit_revision_history.revision_date
1 2010-05-02
2 2009-01-01
_pdbx_database_status.recvd_initial_deposition_date 2008-01-01
loop_
_entity_poly_seq.entity_id
_entity_poly_seq.num
_entity_poly_seq.mon_id
_entity_poly_seq.hetero
1 1 MET n
1 2 MSE n
1 3 GLY n
1 4 SEP n
1 5 ALA n
2 1 DA n
2 2 DG n
loop_
_chem_comp.id
_chem_comp.type
ALA 'L-peptide linking'
GLY 'peptide linking'
MET 'L-peptide linking'
MSE 'L-peptide linking'
SEP 'L-PEPTIDE LINKING'
DA 'DNA linking'
DG 'DNA linking'
HOH non-polymer
loop_
_struct_asym.id
_struct_asym.entity_id
A 1
B 2
C 3
""" + atom_site_loop(
    """\
HETATM 1 N . MSE A 1 2 1.0 0.0 0.0 1.0 X 1
HETATM 2 CA . MSE A 1 2 2.0 0.0 0.0 1.0 X 1
HETATM 3 SE . MSE A 1 2 3.0 0.0 0.0 0.8 X 1
HETATM 4 HA . MSE A 1 2 9.0 9.0 9.0 1.0 X 1
ATOM 5 N . GLY A 1 3 4.0 0.0 0.0 1.0 X 1
ATOM 6 CA A GLY A 1 3 5.0 0.0 0.0 0.4 X 1
ATOM 7 CA B GLY A 1 3 5.5 0.5 0.0 0.6 X 1
ATOM 8 C . GLY A 1 3 6.0 0.0 0.0 1.0 X 1
HETATM 9 CA . SEP A 1 4 7.0 0.0 0.0 1.0 X 1
HETATM 10 OG . SEP A 1 4 7.5 1.0 0.0 1.0 X 1
HETATM 11 P . SEP A 1 4 8.0 2.0 0.0 1.0 X 1
ATOM 12 CA . ALA A 1 5 9.0 0.0 0.0 1.0 X 1
ATOM 13 OXT . ALA A 1 5 9.5 0.5 0.0 1.0 X 1
ATOM 14 P . DA B 2 1 0.0 5.0 0.0 1.0 Y 1
HETATM 15 O . HOH C 3 . 0.0 0.0 5.0 1.0 X 1
ATOM 16 CA . MET A 1 1 -1.0 0.0 0.0 1.0 X 2
ATOM 17 CA . GLY A 1 3 -5.0 0.0 0.0 1.0 X 2
"""
)


def test_small_entry_follows_alphafold_rules() -> None:
    structure = parse_mmcif("small.cif", text=SMALL_CIF)
    assert structure.pdb_id == "test"
    assert list(structure.chains) == ["X"]  # author chain id; DNA (Y) and water are not protein
    chain = structure.chains["X"]
    assert chain.sequence == "MMGSA"  # MSE -> M, SEP -> its parent S
    assert structure.release_date == "2009-01-01"  # earliest revision, not the first listed
    assert structure.resolution == pytest.approx(2.10)  # OpenFold: the first key that parses
    assert structure.method == "x-ray diffraction"
    check_chain_arrays(structure)
    mask, pos = chain.atom_mask, chain.atom_positions
    assert mask[0].sum() == 0  # MET 1 is observed only in model 2, which is ignored
    assert {i for i in np.flatnonzero(mask[1])} == {ATOM_ORDER["N"], CA, SD}  # SE -> SD, H dropped
    np.testing.assert_allclose(pos[1, SD], [3.0, 0.0, 0.0])
    np.testing.assert_allclose(pos[2, CA], [5.5, 0.5, 0.0])  # altloc B: the higher occupancy
    assert {i for i in np.flatnonzero(mask[3])} == {CA, ATOM_ORDER["OG"]}  # P is not an atom37 atom
    assert mask[4, ATOM_ORDER["OXT"]] == 1


def test_small_entry_header_fallbacks() -> None:
    text = SMALL_CIF.replace("1 2010-05-02\n2 2009-01-01\n", "1 ?\n2 .\n").replace("2.05", "?")
    structure = parse_mmcif("small.cif", text=text)
    assert structure.release_date == "2008-01-01"  # no revision date: the deposition date
    assert structure.resolution == pytest.approx(2.10)
    bare = "\n".join(
        line
        for line in SMALL_CIF.splitlines()
        if not line.startswith(("_refine", "_reflns", "_exptl", "_pdbx_database_status", "_entry"))
    )
    structure = parse_mmcif("dir/bare.cif", text=bare)
    assert (structure.resolution, structure.method, structure.pdb_id) == (0.0, None, "bare")


def test_file_paths_and_gzip(tmp_path: Path) -> None:
    (tmp_path / "small.cif").write_text(SMALL_CIF)
    (tmp_path / "small.cif.gz").write_bytes(gzip.compress(SMALL_CIF.encode()))
    plain, packed = parse_mmcif(tmp_path / "small.cif"), parse_mmcif(str(tmp_path / "small.cif.gz"))
    np.testing.assert_array_equal(plain.chains["X"].atom_positions, packed.chains["X"].atom_positions)


# --------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    ("text", "line", "match"),
    [
        ("data_x\nloop_\n_a.b\n_a.c\n1 2 3\n", 2, "Wrong number of values"),  # gemmi: the loop_ line
        ("data_x\n_a.b 1\n_a.b 2\n", 3, "duplicate tag"),
        ("junk\n", 1, "data_"),
        ("", 1, "no data block"),
        ("data_x\n_a.b 'unterminated\n", 2, "unterminated"),
    ],
)
def test_cif_syntax_errors_carry_path_and_line(text: str, line: int, match: str) -> None:
    with pytest.raises(ParseError, match=match) as info:
        parse_mmcif("bad/entry.cif", text=text)
    assert (info.value.path, info.value.line) == ("bad/entry.cif", line)
    assert str(info.value).startswith(f"bad/entry.cif:{line}: ")


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda t: (
                t.replace("'L-peptide linking'", "other")
                .replace("'peptide linking'", "other")
                .replace("'L-PEPTIDE LINKING'", "other")
            ),
            "no protein chains",
        ),  # fmt: skip
        (
            lambda t: "\n".join(x for x in t.split("\n") if not (x[:4] in ("ATOM", "HETA") and " A 1 " in x)),
            "no protein chain has atoms",
        ),  # fmt: skip
        (lambda t: t.replace("_atom_site.Cartn_x", "_atom_site.Cartn_q"), "Cartn_x"),
        (lambda t: t.replace("5.5 0.5 0.0 0.6", "5.5 ? 0.0 0.6"), "not a finite number"),
        (lambda t: t.replace("1 3 GLY n", "1 x GLY n"), "_entity_poly_seq"),
        (
            lambda t: t.replace(" Y 1\n", " X 1\n").replace("DA 'DNA linking'", "DA 'L-peptide linking'"),
            "two",
        ),
    ],
)
def test_content_errors_carry_path(edit, match: str) -> None:
    with pytest.raises(ParseError, match=match) as info:
        parse_mmcif("entry.cif", text=edit(SMALL_CIF))
    assert info.value.path == "entry.cif"


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ParseError, match="cannot read") as info:
        parse_mmcif(tmp_path / "missing.cif")
    assert info.value.path == str(tmp_path / "missing.cif")


# --------------------------------------------------------------------------------------------------
# Fuzzing

CIF_SPECIAL = "_.?'\";# \n\tloop_data_1-xA"
# Values that keep the CIF well-formed but probe the semantics: unset, odd numbers, other names.
CIF_TOKENS = [
    "?",
    ".",
    "0",
    "-7",
    "99",
    "1e40",
    "nan",
    "x",
    "A",
    "B",
    "X",
    "MSE",
    "SE",
    "CA",
    "HOH",
    "2",
    "'a b'",
]


@st.composite
def mutated_cif(draw) -> str:
    """SMALL_CIF after a few random edits: replaced values, deleted/duplicated lines, swaps, cuts."""
    text = SMALL_CIF
    rnd = draw(st.randoms(use_true_random=True))  # uniform positions; integers() favours the start
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from([*EDIT_OPS, *["token"] * len(EDIT_OPS)]))  # half keep the CIF well-formed
        lines = text.split("\n")
        rows = [
            k for k, x in enumerate(lines) if x and x[0] not in "_#;'" and "'" not in x and x[:5] != "loop_"
        ]
        if op == "token" and rows:  # replace one value of a loop row, keeping the row's number of values
            k = rnd.choice(rows)
            words = lines[k].split(" ")
            words[rnd.randrange(len(words))] = draw(st.sampled_from(CIF_TOKENS))
            lines[k] = " ".join(words)
            text = "\n".join(lines)
        else:
            text = edit(text, op, draw, rnd, CIF_SPECIAL)
    return text


@given(st.one_of(mutated_cif(), st.text(max_size=60), st.text(alphabet="data_x\n loop'._?#", max_size=80)))
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
def test_fuzz_mmcif(text: str) -> None:
    try:
        structure = parse_mmcif("fuzz.cif", text=text)
    except ParseError as e:
        assert e.path == "fuzz.cif"
    else:
        assert structure.chains
        check_chain_arrays(structure)
