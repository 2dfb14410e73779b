"""Tests of hfkit.data.parsers: real OpenFold alignments, hand-written cases, a per-character
reference of AlphaFold's semantics, and fuzzing (a parser returns or raises ParseError, nothing else)."""

from __future__ import annotations

import gzip
import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import real_data
from fuzz_edits import EDIT_OPS, edit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hfkit.data.parsers import (
    Msa,
    ParseError,
    TemplateHit,
    parse_a3m,
    parse_fasta,
    parse_hhr,
    parse_stockholm,
    read_msa,
    read_text,
)

FUZZ = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


@pytest.fixture(scope="module")
def openfold_data() -> Path:
    """OpenFold's test data, shared beside the repository (never copied into it)."""
    return real_data("alignments").parent


def cached_2q2k_sequence(data: Path, chain: str) -> str:
    cache = json.loads((data / "train_mmcifs_cache.json").read_text())["2q2k"]
    return cache["seqs"][cache["chain_ids"].index(chain)]


# --------------------------------------------------------------------------------------------------
# A per-character transcription of AlphaFold's parse_a3m / parse_stockholm: slow, obviously right.


def reference_a3m(text: str) -> tuple[list[str], list[list[int]]]:
    rows, matrix = [], []
    for seq in parse_fasta(text)[0]:
        row, deletions, count = [], [], 0
        for ch in seq:
            if ch.islower():
                count += 1
            elif ch != ".":
                row.append(ch)
                deletions.append(count)
                count = 0
        rows.append("".join(row))
        matrix.append(deletions)
    return rows, matrix


def reference_stockholm(rows: list[str]) -> tuple[list[str], list[list[int]]]:
    query = rows[0]
    aligned, matrix = [], []
    for seq in rows:
        out, deletions, count = [], [], 0
        for res, q in zip(seq, query, strict=True):
            if q in "-.":
                count += res not in "-."
            else:
                out.append("-" if res == "." else res.upper())
                deletions.append(count)
                count = 0
        aligned.append("".join(out))
        matrix.append(deletions)
    return aligned, matrix


# --------------------------------------------------------------------------------------------------
# Real OpenFold alignments


def test_2q2k_a3m_depth_query_and_deletions(openfold_data: Path) -> None:
    path = openfold_data / "alignments" / "2q2k_A" / "bfd_uniclust_hits.a3m"
    text = path.read_text()
    msa = read_msa(path)
    assert msa.depth == len(msa) == text.count("\n>") + text.startswith(">") == 4
    assert msa.sequences[0] == cached_2q2k_sequence(openfold_data, "A")
    assert all(len(s) == msa.length == 70 for s in msa.sequences)
    assert msa.deletion_matrix.shape == (4, 70) and msa.deletion_matrix.dtype == np.int32
    # The last hit ends '...GDTpP': one insertion ('p') before the last aligned column.
    assert msa.deletion_matrix[:3].sum() == 0
    assert msa.deletion_matrix[3, 69] == 1 and msa.deletion_matrix[3].sum() == 1
    assert msa.descriptions[0] == "query"


@pytest.mark.parametrize(
    "relpath",
    [
        "2q2k_A/mgnify_hits.sto",
        "2q2k_A/uniprot_hits.sto",
        "2q2k_A/uniref90_hits.sto",
        "mgnify_hits.sto",
        "uniref90_hits.sto",
    ],
)
def test_stockholm_depth_and_lengths(openfold_data: Path, relpath: str) -> None:
    path = openfold_data / "alignments" / relpath
    text = path.read_text()
    names = [
        line.split()[0] for line in text.splitlines() if line.strip() and not line.startswith(("#", "//"))
    ]
    msa = read_msa(path)
    assert msa.depth == len(dict.fromkeys(names))
    assert [d.split()[0] for d in msa.descriptions] == list(dict.fromkeys(names))
    assert all(len(s) == msa.length for s in msa.sequences)
    # Against the per-character reference of AlphaFold's semantics (these files have gapped queries).
    rows = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith(("#", "//")):
            name, seq = line.split()
            rows[name] = rows.get(name, "") + seq
    expected_rows, expected_matrix = reference_stockholm(list(rows.values()))
    assert msa.sequences == expected_rows
    np.testing.assert_array_equal(msa.deletion_matrix, np.array(expected_matrix, dtype=np.int32))
    if relpath.startswith("2q2k_A"):
        # jackhmmer's query row for 2q2k chain A is its full SEQRES sequence, without gaps.
        assert msa.sequences[0] == cached_2q2k_sequence(openfold_data, "A")
    else:
        short = parse_fasta((openfold_data / "short.fasta").read_text())[0][0]
        assert msa.sequences[0] == short


def test_stockholm_descriptions_come_from_gs_lines(openfold_data: Path) -> None:
    msa = read_msa(openfold_data / "alignments" / "2q2k_A" / "mgnify_hits.sto")
    assert msa.descriptions[0] == "query"  # no #=GS line for the query
    assert msa.descriptions[1] == "MGYP000048211747/1-51 [subseq from] PL=00 UP=0 BIOMES=0000000011000"
    assert msa.deletion_matrix.sum() == 0  # the query row has no gaps in this file


def test_bfd_a3m_1024_rows(openfold_data: Path) -> None:
    path = openfold_data / "alignments" / "bfd_uniclust_hits.a3m"
    text = path.read_text()
    msa = parse_a3m(text, path)
    raw_rows = parse_fasta(text)[0]
    assert msa.depth == 1024 == len(raw_rows)
    assert all(len(s) == msa.length == 73 for s in msa.sequences)
    # Every insertion counts, except lower case after a row's last aligned column (none in this file).
    trailing = [len(re.search(r"[a-z.]*$", row).group()) for row in raw_rows]
    assert sum(trailing) == 0
    lower = np.array([sum(c.islower() for c in row) for row in raw_rows])
    np.testing.assert_array_equal(msa.deletion_matrix.sum(axis=1), lower)
    assert lower.sum() > 0
    expected_rows, expected_matrix = reference_a3m(text)
    assert msa.sequences == expected_rows
    np.testing.assert_array_equal(msa.deletion_matrix, np.array(expected_matrix))


def test_pdb70_hhr(openfold_data: Path) -> None:
    hits = parse_hhr((openfold_data / "alignments" / "pdb70_hits.hhr").read_text())
    query = parse_fasta((openfold_data / "short.fasta").read_text())[0][0]
    assert len(hits) == 10
    assert [h.index for h in hits] == list(range(1, 11))
    first = hits[0]
    assert first.name == "1HF9_B" and first.description.startswith("ATPASE INHIBITOR")
    assert first.aligned_cols == 22 and first.sum_probs == pytest.approx(13.1)
    assert first.query == "AEHHHKAAEHHEQAAKHHHAAA" and first.hit_sequence == "ISHHAKEIERLQKEIERHKQSI"
    assert first.indices_query == list(range(6, 28)) and first.indices_hit == list(range(9, 31))
    assert hits[-1].name == "2Q2K_A"
    for hit in hits:
        assert len(hit.query) == len(hit.hit_sequence) == len(hit.indices_query) == len(hit.indices_hit)
        for seq, indices in ((hit.query, hit.indices_query), (hit.hit_sequence, hit.indices_hit)):
            gaps = np.array([c == "-" for c in seq])
            idx = np.array(indices)
            assert np.all((idx == -1) == gaps)
            assert np.all(np.diff(idx[~gaps]) == 1)  # consecutive residues between gaps
        # The query residues are short.fasta's residues at the reported indices.
        assert all(query[i] == c for i, c in zip(hit.indices_query, hit.query, strict=True) if i >= 0)


def test_short_fasta(openfold_data: Path) -> None:
    sequences, descriptions = parse_fasta((openfold_data / "short.fasta").read_text())
    assert descriptions == ["query"] and len(sequences[0]) == 73


# --------------------------------------------------------------------------------------------------
# Hand-written cases


def test_parse_fasta_basics() -> None:
    text = "# comment\n>one first\nACD\nEF G*\n\n>two\n>three\nmk-.\n"
    assert parse_fasta(text) == (["ACDEFG*", "", "mk-."], ["one first", "two", "three"])
    assert parse_fasta("") == ([], [])
    assert parse_fasta("\r\n>x\r\nAC\r\n") == (["AC"], ["x"])


def test_a3m_deletions_hand_written() -> None:
    text = ">q desc\nABCDE\n>s1\nAbcB-DeEx\n>s2\n..A.BC..D-\n"
    msa = parse_a3m(text)
    assert msa.sequences == ["ABCDE", "AB-DE", "ABCD-"]
    assert msa.descriptions == ["q desc", "s1", "s2"]
    # 'bc' before B, 'e' before E; the trailing 'x' is dropped; '.' is removed, not counted.
    np.testing.assert_array_equal(msa.deletion_matrix, [[0, 0, 0, 0, 0], [0, 2, 0, 0, 1], [0, 0, 0, 0, 0]])


def test_a3m_matches_reference_on_multiline_sequences() -> None:
    text = ">q\nMK\nLV\n>h\nmMkK\nlL\nVv\n"
    msa = parse_a3m(text)
    rows, matrix = reference_a3m(text)
    assert msa.sequences == rows == ["MKLV", "MKLV"]
    np.testing.assert_array_equal(msa.deletion_matrix, matrix)
    np.testing.assert_array_equal(msa.deletion_matrix, [[0, 0, 0, 0], [1, 1, 1, 0]])  # trailing v dropped


STOCKHOLM = """# STOCKHOLM 1.0
#=GF ID example
#=GS s1/1-7 DE first hit
#=GS s2/3-9 DE
#=GS other DE not in the alignment

q       AB-C
s1/1-7  ABXC
s2/3-9  A--C
#=GR s1/1-7 PP 9999

q       D.-E-
s1/1-7  DyZEw
s2/3-9  D--e-
#=GC RF xx.x
//
ignored after the end
"""


def test_stockholm_multiblock_gaps_and_deletions() -> None:
    msa = parse_stockholm(STOCKHOLM)
    assert msa.sequences == ["ABCDE", "ABCDE", "A-CDE"]
    assert msa.descriptions == ["q", "s1/1-7 first hit", "s2/3-9"]
    # s1: X (query gap) before C, then y and Z (query '.' and '-') before E; the trailing w is dropped.
    np.testing.assert_array_equal(msa.deletion_matrix, [[0, 0, 0, 0, 0], [0, 0, 1, 0, 2], [0, 0, 0, 0, 0]])
    rows = ["AB-CD.-E-", "ABXCDyZEw", "A--CD--e-"]
    expected_rows, expected_matrix = reference_stockholm(rows)
    assert msa.sequences == expected_rows
    np.testing.assert_array_equal(msa.deletion_matrix, expected_matrix)


def test_msa_dataclass() -> None:
    msa = parse_a3m(">q\nAC\n>a\nA-\n>b\nC-\n")
    assert msa.depth == 3 and msa.length == 2
    top = msa.truncate(2)
    assert (
        top.sequences == ["AC", "A-"]
        and top.deletion_matrix.shape == (2, 2)
        and top.descriptions == ["q", "a"]
    )
    assert msa.truncate(10) == msa and msa.truncate(0).depth == 0
    with pytest.raises(ValueError, match="n must be"):
        msa.truncate(-1)
    with pytest.raises(ValueError, match="deletion_matrix"):
        Msa(["AC"], np.zeros((2, 2)), ["q"])
    with pytest.raises(ValueError, match="width"):
        Msa(["ACD"], np.zeros((1, 2)), ["q"])


def test_hhr_hand_written_multiline_with_gaps() -> None:
    summary = (
        "Probab=9.90  E-value=1  Score=10.00  Aligned_cols=6  Identities=50%  Similarity=0.5  "
        "Sum_probs=4.5  Template_Neff=1.0"
    )
    text = f"""Query         q
 No Hit                             Prob E-value P-value  Score    SS Cols Query HMM  Template HMM
  1 1ABC_A some protein             9.9 1.0E+00  0.01   10.0   0.0    6    2-7       5-9  (20)

No 1
>1ABC_A some protein; more words
{summary}

Q ss_pred             CCCC
Q q               2 AC-D   4 (10)
Q Consensus       2 ac~d   4 (10)
                    || |
T Consensus       5 AcEd   8 (20)
T 1ABC_A          5 ACED   8 (20)
T ss_dssp           HHHH

Q q               5 EFG   7 (10)
T 1ABC_A          9 E--   9 (20)
"""
    (hit,) = parse_hhr(text)
    assert hit == TemplateHit(
        index=1,
        name="1ABC_A",
        aligned_cols=6,
        sum_probs=4.5,
        query="AC-DEFG",
        hit_sequence="ACEDE--",
        indices_query=[1, 2, -1, 3, 4, 5, 6],
        indices_hit=[4, 5, 6, 7, 8, -1, -1],
        description="some protein; more words",
    )
    assert parse_hhr("Query q\nno hits here\n") == []


# --------------------------------------------------------------------------------------------------
# Errors: file name and line number


def test_parse_error_format_and_pickle() -> None:
    assert str(ParseError("bad", "x/f.sto", 12)) == "x/f.sto:12: bad"
    assert str(ParseError("bad", Path("f.a3m"))) == "f.a3m: bad"
    assert str(ParseError("bad", line=3)) == "line 3: bad"
    assert str(ParseError("bad")) == "bad"
    err = pickle.loads(pickle.dumps(ParseError("bad", "f.sto", 7)))
    assert (err.message, err.path, err.line, str(err)) == ("bad", "f.sto", 7, "f.sto:7: bad")
    assert isinstance(err, ValueError)


@pytest.mark.parametrize(
    ("parser", "text", "line", "match"),
    [
        (parse_fasta, "ACD\n>x\nAC\n", 1, "before the first"),
        (parse_fasta, ">x\nAC\nA1C\n", 3, "unexpected character '1'"),
        (parse_a3m, "", 1, "no sequences"),
        (parse_a3m, "# only a comment\n\n", 3, "no sequences"),
        (parse_a3m, ">q\nACDE\n>a\nAC\n>b\nACd\n", 3, "row 1 has 2 aligned columns"),
        (parse_a3m, ">q\nacde\n>a\nA\n", 1, "no aligned columns"),
        (parse_a3m, ">q\nAC\n>a\nA*\n", 4, "unexpected character"),
        (parse_stockholm, "# STOCKHOLM 1.0\nq ACD\nACD\n", 3, "got 1 field"),
        (parse_stockholm, "q ACD\na A C D\n", 2, "got 4 field"),
        (parse_stockholm, "q ACD\na AC\n\nq EF\na EF\n//\n", 5, "row 'a' has 4 columns, the query has 5"),
        (parse_stockholm, "q AC\na A1\n", 2, "unexpected character '1'"),
        (parse_stockholm, "# STOCKHOLM 1.0\n\n//\n", 3, "no sequences"),
        (parse_stockholm, "q --.\na ACD\n", 1, "no residues"),
        (parse_hhr, "No x\n>a\n", 1, "hit number"),
        (parse_hhr, "\nNo 1\n>a\nProbab=1\n", 4, "summary"),
        (parse_hhr, "No 1\n", 1, "must start"),
    ],
)
def test_errors_carry_path_and_line(parser, text: str, line: int, match: str) -> None:
    with pytest.raises(ParseError, match=match) as info:
        parser(text, "dir/input.txt")
    assert info.value.path == "dir/input.txt"
    assert info.value.line == line
    assert str(info.value).startswith(f"dir/input.txt:{line}: ")


HHR_HIT = """No 1
>1ABC_A x
Probab=9.90  E-value=1  Score=10.00  Aligned_cols=3  Identities=50%  Similarity=0.5  Sum_probs=4.5
"""


@pytest.mark.parametrize(
    ("alignment", "line", "match"),
    [
        ("Q q               2 ACD   4 (10)\nT 1ABC_A          5 AC   6 (20)\n", 5, "template segment has 2"),
        ("Q q               2 ACD   5 (10)\nT 1ABC_A          5 ACD   7 (20)\n", 4, "do not fit"),
        ("T 1ABC_A          5 ACD   7 (20)\n", 4, "without a query line"),
        ("Q q               2 ACD   4 (10)\n", 4, "no template line"),
        ("Q q               2 ACD   4 (10)\nQ q               2 ACD   4 (10)\n", 4, "no template line"),
        ("Q q               2 AC1D   4 (10)\n", 4, "expected '<name>"),
    ],
)
def test_hhr_alignment_errors(alignment: str, line: int, match: str) -> None:
    with pytest.raises(ParseError, match=match) as info:
        parse_hhr(HHR_HIT + alignment, "hits.hhr")
    assert (info.value.path, info.value.line) == ("hits.hhr", line)


def test_read_text_and_read_msa(tmp_path: Path) -> None:
    (tmp_path / "a.a3m").write_text(">q\nAC\n>h\naAC\n")
    (tmp_path / "a.fasta").write_text(">q\nAC\n>h\nA-\n")
    (tmp_path / "a.sto").write_text("q AC\nh A-\n//\n")
    (tmp_path / "a.stockholm.gz").write_bytes(gzip.compress(b"q AC\nh A-\n//\n"))
    assert read_msa(tmp_path / "a.a3m").deletion_matrix.tolist() == [[0, 0], [1, 0]]
    assert read_msa(tmp_path / "a.fasta").sequences == ["AC", "A-"]
    assert read_msa(str(tmp_path / "a.sto")) == read_msa(tmp_path / "a.stockholm.gz")

    (tmp_path / "a.txt").write_text(">q\nAC\n")
    with pytest.raises(ParseError, match="unknown MSA format") as info:
        read_msa(tmp_path / "a.txt")
    assert info.value.path == str(tmp_path / "a.txt")
    with pytest.raises(ParseError, match="cannot read") as info:
        read_text(tmp_path / "missing.a3m")
    assert info.value.path == str(tmp_path / "missing.a3m")
    (tmp_path / "dir.a3m").mkdir()
    with pytest.raises(ParseError, match="cannot read"):
        read_msa(tmp_path / "dir.a3m")
    (tmp_path / "bad.a3m").write_bytes(b">q\nAC\n>h\n\xff\xfe\n")
    with pytest.raises(ParseError, match="not UTF-8") as info:
        read_msa(tmp_path / "bad.a3m")
    assert info.value.line == 4
    (tmp_path / "bad.sto.gz").write_bytes(b"not gzip")
    with pytest.raises(ParseError, match=r"bad\.sto\.gz"):
        read_msa(tmp_path / "bad.sto.gz")
    (tmp_path / "rows.sto").write_text("q ACD\nh AC\n")
    with pytest.raises(ParseError) as info:
        read_msa(tmp_path / "rows.sto")
    assert (info.value.path, info.value.line) == (str(tmp_path / "rows.sto"), 2)


def test_large_alignments_are_fast() -> None:
    import time

    rng = np.random.default_rng(0)
    letters = np.array(list("ACDEFGHIKLMNPQRSTVWY-"))
    rows = ["".join(rng.choice(letters, 300)) for _ in range(20000)]
    a3m = "".join(f">s{i}\n{row[:100]}ac{row[100:]}\n" for i, row in enumerate(rows))
    sto = "".join(f"s{i} {row}\n" for i, row in enumerate(rows))
    start = time.perf_counter()
    msa = parse_a3m(a3m)
    sto_msa = parse_stockholm(sto)
    elapsed = time.perf_counter() - start
    assert msa.depth == sto_msa.depth == 20000 and msa.deletion_matrix[:, 100].sum() == 2 * 20000
    assert elapsed < 3.0  # typically ~0.2 s; generous for shared CI machines


# --------------------------------------------------------------------------------------------------
# Property tests against the reference, and fuzzing

ALIGNED = "ACDEFGHIKLMNPQRSTVWYXBZ-"


@st.composite
def a3m_texts(draw) -> str:
    length = draw(st.integers(1, 8))
    rows = []
    for _ in range(draw(st.integers(1, 5))):
        parts = []
        for _ in range(length):
            parts.append(draw(st.text(alphabet="acdxy.", max_size=3)))
            parts.append(draw(st.sampled_from(ALIGNED)))
        parts.append(draw(st.text(alphabet="kw.", max_size=2)))
        rows.append("".join(parts))
    return "".join(f">row{i}\n{row}\n" for i, row in enumerate(rows))


@given(a3m_texts())
@settings(max_examples=200, deadline=None, database=None)
def test_a3m_matches_reference(text: str) -> None:
    msa = parse_a3m(text)
    rows, matrix = reference_a3m(text)
    assert msa.sequences == rows
    np.testing.assert_array_equal(msa.deletion_matrix, np.array(matrix, dtype=np.int32))


@st.composite
def stockholm_rows(draw) -> list[str]:
    width = draw(st.integers(1, 12))
    query = draw(st.text(alphabet="AC-.", min_size=width, max_size=width).filter(lambda q: q.strip("-.")))
    others = draw(st.lists(st.text(alphabet="ACDacd-.", min_size=width, max_size=width), max_size=5))
    return [query, *others]


@given(stockholm_rows(), st.data())
@settings(max_examples=200, deadline=None, database=None)
def test_stockholm_matches_reference(rows: list[str], data) -> None:
    width = len(rows[0])
    cuts = sorted(data.draw(st.lists(st.integers(1, width), max_size=3)))
    blocks = []
    for lo, hi in zip([0, *cuts], [*cuts, width], strict=True):
        if hi > lo:
            blocks.append("".join(f"seq{i} {row[lo:hi]}\n" for i, row in enumerate(rows)))
    msa = parse_stockholm("# STOCKHOLM 1.0\n\n" + "\n".join(blocks) + "//\n")
    expected_rows, expected_matrix = reference_stockholm(rows)
    assert msa.sequences == expected_rows
    np.testing.assert_array_equal(msa.deletion_matrix, np.array(expected_matrix, dtype=np.int32))


SPECIAL = ">#=/ -.\n\t\r*aZ09|;()%" + "\x00é\u2028"


@st.composite
def mutated(draw, samples: list[str]) -> str:
    """A valid sample after a few random edits: deleted/duplicated lines, swaps, replacements, cuts."""
    text = draw(st.sampled_from(samples))
    rnd = draw(st.randoms(use_true_random=True))  # uniform positions; integers() favours the start
    for _ in range(draw(st.integers(1, 4))):
        text = edit(text, draw(st.sampled_from(EDIT_OPS)), draw, rnd, SPECIAL)
    return text


A3M_SAMPLES = [">q d\nMKVLA\n>h1\nMkKV-A\n>h2\n--vLAa\n", ">q\nAC\nDE\n>x\nA.cCD-\n# c\n"]
STO_SAMPLES = [STOCKHOLM, "# STOCKHOLM 1.0\nq AC-D\nh1 ACeD\n//\n"]
HHR_SAMPLES = [
    HHR_HIT + "\nQ q               2 ACD   4 (10)\nQ Consensus       2 acd   4 (10)\n"
    "T Consensus       5 acd   7 (20)\nT 1ABC_A          5 A-D   6 (20)\nT ss_pred           HHH\n\n"
    "No 2\n>2XYZ_B y\nProbab=1.0  E-value=2  Score=3  Aligned_cols=2  Identities=1%  Similarity=0.1  "
    "Sum_probs=1.5  Template_Neff=2\n\nQ q   1 MK   2 (10)\nT 2XYZ_B   7 MR   8 (9)\n"
]


def fuzz_inputs(samples: list[str], alphabet: str) -> st.SearchStrategy[str]:
    return st.one_of(mutated(samples), st.text(alphabet=alphabet, max_size=80), st.text(max_size=40))


def check_msa(msa: Msa) -> None:
    assert msa.depth >= 1 and msa.deletion_matrix.shape == (msa.depth, msa.length)
    assert all(len(s) == msa.length for s in msa.sequences)


@given(fuzz_inputs(A3M_SAMPLES, ">#\nACac-.* \t1"))
@FUZZ
def test_fuzz_fasta(text: str) -> None:
    try:
        sequences, descriptions = parse_fasta(text, "fuzz.fasta")
    except ParseError as e:
        assert e.path == "fuzz.fasta" and e.line is not None
    else:
        assert len(sequences) == len(descriptions)


@given(fuzz_inputs(A3M_SAMPLES, ">#\nACac-.* \t1"))
@FUZZ
def test_fuzz_a3m(text: str) -> None:
    try:
        check_msa(parse_a3m(text, "fuzz.a3m"))
    except ParseError as e:
        assert e.path == "fuzz.a3m" and e.line is not None


@given(fuzz_inputs(STO_SAMPLES, "#=GS DE/\nqACac-. \t1"))
@FUZZ
def test_fuzz_stockholm(text: str) -> None:
    try:
        check_msa(parse_stockholm(text, "fuzz.sto"))
    except ParseError as e:
        assert e.path == "fuzz.sto" and e.line is not None


@given(fuzz_inputs(HHR_SAMPLES, "No 1>\nQT q AC-2 (3)=Probab"))
@FUZZ
def test_fuzz_hhr(text: str) -> None:
    try:
        hits = parse_hhr(text, "fuzz.hhr")
    except ParseError as e:
        assert e.path == "fuzz.hhr" and e.line is not None
    else:
        for hit in hits:
            assert len(hit.query) == len(hit.hit_sequence) == len(hit.indices_query) == len(hit.indices_hit)
