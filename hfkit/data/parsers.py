"""Parsers for AlphaFold's sequence and alignment files: FASTA, a3m, Stockholm and HHsearch `.hhr`.

The semantics follow AlphaFold's (and OpenFold's) `data/parsers.py`: an MSA is a list of rows aligned
to the query (row 0), with insertions relative to the query removed and counted in a deletion matrix
(`deletion_matrix[i, j]` = residues of row i deleted just before query column j). Every parser here
raises `ParseError` (a `ValueError`) naming the file and line for malformed input, and no other
exception on any string input, so a data loader can skip a bad file with one `except`.

Accepted alphabets, and what is an error:
- FASTA: `>` header lines, `#`/`;` comment lines and blank lines are skipped; sequence lines may hold
  letters, `-`, `.` and `*` (whitespace inside a line is dropped). Sequence data before the first
  header or any other character is an error.
- a3m (and aligned FASTA): upper-case letters and `-` are aligned columns, lower-case letters are
  insertions and `.` is a gap in an insertion column (removed, not counted). Every row must have the
  query's number of aligned columns; an input without sequences or whose query has no aligned
  column is an error.
- Stockholm: `<name> <aligned sequence>` lines (letters, `-`, `.`), a name seen again in a later
  block continues its row; `#=GS <name> DE <text>` gives descriptions, other `#` lines are ignored and
  the first `//` ends the alignment. Rows of unequal total length, a line that is not two fields, or
  a query without residues is an error.
- hhr: the `No <n>` hit blocks with their `Q`/`T` alignment lines, as AlphaFold reads them.

Where this departs from AlphaFold (which would crash or return ragged rows): `.` is a gap everywhere
(AlphaFold keeps it as a residue), Stockholm rows are upper-cased, a Stockholm description is the
name plus its `#=GS DE` text (AlphaFold: the name alone; identifiers still parse from its start), and
`TemplateHit.name` is the hit's first word (`1HF9_B`), the rest of its `>` line in `.description`.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import re
import string
import zlib
from pathlib import Path

import numpy as np

__all__ = [
    "Msa",
    "ParseError",
    "TemplateHit",
    "parse_a3m",
    "parse_fasta",
    "parse_hhr",
    "parse_stockholm",
    "read_msa",
    "read_text",
]

PathLike = str | os.PathLike


class ParseError(ValueError):
    """A file (or string) that cannot be parsed; `str()` reads `path:line: message`."""

    def __init__(self, message: str, path: PathLike | None = None, line: int | None = None) -> None:
        self.message = message
        self.path = None if path is None else os.fsdecode(path)
        self.line = line
        super().__init__(str(self))

    def __str__(self) -> str:
        if self.path is not None and self.line is not None:
            return f"{self.path}:{self.line}: {self.message}"
        if self.path is not None:
            return f"{self.path}: {self.message}"
        if self.line is not None:
            return f"line {self.line}: {self.message}"
        return self.message

    def __reduce__(self):  # DataLoader workers pickle exceptions: keep path and line across the trip
        return (type(self), (self.message, self.path, self.line))


@dataclasses.dataclass(eq=False)
class Msa:
    """An alignment to a query: `sequences[0]` is the query, every row has the query's length L.

    `deletion_matrix`: int32 [N, L], residues of row i deleted (insertions w.r.t. the query) just
    before aligned column j; `descriptions`: one header per row.
    """

    sequences: list[str]
    deletion_matrix: np.ndarray
    descriptions: list[str]

    def __post_init__(self) -> None:
        self.sequences = list(self.sequences)
        self.descriptions = list(self.descriptions)
        matrix = np.asarray(self.deletion_matrix, dtype=np.int32)
        if matrix.size == 0 and matrix.ndim == 1:  # an empty MSA given as []
            matrix = matrix.reshape(0, 0)
        n = len(self.sequences)
        if matrix.ndim != 2 or matrix.shape[0] != n or len(self.descriptions) != n:
            raise ValueError(
                f"Msa: expected {n} descriptions and a deletion_matrix of {n} rows, got "
                f"{len(self.descriptions)} descriptions and shape {matrix.shape}"
            )
        if any(len(s) != matrix.shape[1] for s in self.sequences):
            raise ValueError(f"Msa: every sequence must have the deletion matrix's width {matrix.shape[1]}")
        self.deletion_matrix = matrix

    def __len__(self) -> int:
        return len(self.sequences)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Msa):
            return NotImplemented
        return (
            self.sequences == other.sequences
            and self.descriptions == other.descriptions
            and np.array_equal(self.deletion_matrix, other.deletion_matrix)
        )

    @property
    def depth(self) -> int:
        """Number of rows N, the query included."""
        return len(self.sequences)

    @property
    def length(self) -> int:
        """Number of aligned columns L (the query's length)."""
        return int(self.deletion_matrix.shape[1])

    def truncate(self, n: int) -> Msa:
        """The first `n` rows (the query first), as a new Msa; `n` must be >= 0."""
        if n < 0:
            raise ValueError(f"truncate: n must be >= 0, got {n}")
        return Msa(self.sequences[:n], self.deletion_matrix[:n], self.descriptions[:n])


@dataclasses.dataclass
class TemplateHit:
    """One HHsearch hit: the query/hit alignment strings and, per column, residue indices (-1: gap).

    `name` is the template's id, the first word of the hit's `>` line (e.g. `1HF9_B`).

    `indices_query[k]` / `indices_hit[k]` are 0-based positions in the full query / hit sequence of
    column k of `query` / `hit_sequence`, or -1 where that string has a gap.
    """

    index: int
    name: str
    aligned_cols: int
    sum_probs: float | None
    query: str
    hit_sequence: str
    indices_query: list[int]
    indices_hit: list[int]
    description: str = ""  # the rest of the hit's '>' line (AlphaFold keeps it inside `name`)


# --------------------------------------------------------------------------------------------------
# Files


def read_text(path: PathLike) -> str:
    """Read a text file (UTF-8, a BOM tolerated; `.gz` files are decompressed) into one string.

    Raises ParseError naming the file when it cannot be read or decompressed, and the line of the first
    byte that is not UTF-8.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
        if path.suffix == ".gz":
            data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as e:
        raise ParseError(f"cannot read: {e.strerror or e}" if isinstance(e, OSError) else str(e), path) from e
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ParseError(f"not UTF-8 text (byte {e.start}: {e.reason})", path, line) from e


_MSA_READERS = {".a3m": "a3m", ".fasta": "a3m", ".fa": "a3m", ".fas": "a3m", ".afa": "a3m"}
_MSA_READERS |= {".sto": "stockholm", ".stockholm": "stockholm"}


def read_msa(path: PathLike) -> Msa:
    """Read an MSA file, choosing the parser by suffix: `.a3m`, `.sto`/`.stockholm`, `.fasta`/`.fa`.

    Aligned FASTA is read as a3m (its superset: a3m adds lower-case insertions). A trailing `.gz` is
    decompressed. Raises ParseError for an unknown suffix or a malformed file.
    """
    p = Path(path)
    suffix = Path(p.stem).suffix if p.suffix == ".gz" else p.suffix
    kind = _MSA_READERS.get(suffix.lower())
    if kind is None:
        raise ParseError(f"unknown MSA format {suffix!r}; expected one of {sorted(_MSA_READERS)}", path)
    text = read_text(p)
    return parse_a3m(text, path) if kind == "a3m" else parse_stockholm(text, path)


# --------------------------------------------------------------------------------------------------
# FASTA and a3m

_WHITESPACE = re.compile(r"\s+")
_NOT_FASTA = re.compile(r"[^A-Za-z.*\-]")
_NOT_MSA = re.compile(r"[^A-Za-z.\-]")
# Deletes what is not an aligned column of an a3m row: insertions (lower case) and insertion gaps.
_DROP_INSERTIONS = str.maketrans("", "", string.ascii_lowercase + ".")
_ROWS_PER_CHUNK = 4096  # bounds the temporary arrays of the vectorized deletion counts


def _clean_sequence_line(line: str, invalid: re.Pattern, path: PathLike | None, lineno: int) -> str:
    """A stripped sequence line with inner whitespace removed; ParseError on a character not allowed."""
    bad = invalid.search(line)
    if bad is not None:
        line = _WHITESPACE.sub("", line)
        bad = invalid.search(line)
        if bad is not None:
            raise ParseError(f"unexpected character {bad.group()!r} in a sequence", path, lineno)
    return line


def _fasta_records(
    text: str, path: PathLike | None, invalid: re.Pattern
) -> tuple[list[str], list[str], list[int]]:
    """(sequences, descriptions, header line numbers) of a FASTA-like text; one pass over the lines."""
    sequences: list[str] = []
    descriptions: list[str] = []
    header_lines: list[int] = []
    parts: list[str] | None = None
    for lineno, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line[0] == ">":
            if parts is not None:
                sequences.append("".join(parts))
            parts = []
            descriptions.append(line[1:])
            header_lines.append(lineno)
            continue
        if parts is None:
            raise ParseError("sequence data before the first '>' header", path, lineno)
        parts.append(_clean_sequence_line(line, invalid, path, lineno))
    if parts is not None:
        sequences.append("".join(parts))
    return sequences, descriptions, header_lines


def parse_fasta(text: str, path: PathLike | None = None) -> tuple[list[str], list[str]]:
    """Parse FASTA text into (sequences, descriptions), in file order, as AlphaFold's `parse_fasta`.

    A description is its header line without the `>`; a sequence is its lines joined, whitespace
    removed, letters kept as written (gaps `-`/`.` and a `*` terminator are allowed). Blank, `#` and `;`
    lines are skipped. An empty text gives two empty lists. Raises ParseError (with `path` and the line)
    for sequence data before the first header or a character outside that alphabet.
    """
    sequences, descriptions, _ = _fasta_records(text, path, _NOT_FASTA)
    return sequences, descriptions


def _a3m_deletion_matrix(rows: list[str], length: int) -> np.ndarray:
    """int32 [N, length]: per row, the lower-case letters just before each aligned column.

    Vectorized per chunk of rows: the rows are joined (with a leading '\\n' each) into one byte buffer;
    a running count of lower-case letters is read at every aligned column and at every row start, and
    the difference between successive reads is the insertion count before that column. Lower-case
    letters after a row's last aligned column are dropped, as in AlphaFold.
    """
    out = np.empty((len(rows), length), dtype=np.int32)
    for start in range(0, len(rows), _ROWS_PER_CHUNK):
        chunk = rows[start : start + _ROWS_PER_CHUNK]
        buf = np.frombuffer(("\n" + "\n".join(chunk)).encode("ascii"), dtype=np.uint8)
        lower = (buf >= ord("a")) & (buf <= ord("z"))
        anchors = np.flatnonzero(~lower & (buf != ord(".")))  # aligned columns and row starts
        counts = np.cumsum(lower, dtype=np.int32)[anchors]
        deletions = np.diff(counts, prepend=np.int32(0))
        out[start : start + len(chunk)] = deletions[buf[anchors] != ord("\n")].reshape(len(chunk), length)
    return out


def parse_a3m(text: str, path: PathLike | None = None) -> Msa:
    """Parse an a3m alignment (the query first) into an `Msa`, with AlphaFold's semantics.

    Lower-case letters are insertions relative to the query: each row's deletion_matrix[i, j] counts
    those just before its aligned column j, and they are removed from the row; `.` (a gap in an insert
    column) is removed without being counted. Aligned FASTA (no lower case) parses the same way. Raises
    ParseError (file, line) for no sequences, a query without aligned columns, a row whose number of
    aligned columns differs from the query's, or a character outside the a3m alphabet.
    """
    rows, descriptions, header_lines = _fasta_records(text, path, _NOT_MSA)
    if not rows:
        raise ParseError("no sequences in the alignment", path, text.count("\n") + 1)
    aligned = [row.translate(_DROP_INSERTIONS) for row in rows]
    length = len(aligned[0])
    if length == 0:
        raise ParseError("the query (first sequence) has no aligned columns", path, header_lines[0])
    for i, seq in enumerate(aligned):
        if len(seq) != length:
            raise ParseError(
                f"row {i} has {len(seq)} aligned columns (upper case and '-'), the query has {length}",
                path,
                header_lines[i],
            )
    return Msa(aligned, _a3m_deletion_matrix(rows, length), descriptions)


# --------------------------------------------------------------------------------------------------
# Stockholm

# Aligned Stockholm rows are returned in the a3m/HHblits convention: upper case, '-' for every gap.
_STO_OUT = np.arange(256, dtype=np.uint8)
_STO_OUT[ord("a") : ord("z") + 1] -= ord("a") - ord("A")
_STO_OUT[ord(".")] = ord("-")


def _stockholm_deletions(matrix: np.ndarray, query_gap: np.ndarray, gap: np.ndarray) -> np.ndarray:
    """int32 [N, L]: residues of each row in the query-gap columns just before each query column.

    matrix: uint8 [N, W]; query_gap: bool [W]; gap: bool [N, W]. Computed with a running count along
    each row, in chunks of rows to bound memory.
    """
    keep = np.flatnonzero(~query_gap)
    out = np.empty((matrix.shape[0], keep.size), dtype=np.int32)
    for start in range(0, matrix.shape[0], _ROWS_PER_CHUNK):
        stop = start + _ROWS_PER_CHUNK
        inserted = query_gap[None, :] & ~gap[start:stop]
        running = np.cumsum(inserted, axis=1, dtype=np.int32)[:, keep]
        out[start:stop] = np.diff(running, axis=1, prepend=np.int32(0))
    return out


def parse_stockholm(text: str, path: PathLike | None = None) -> Msa:
    """Parse a Stockholm alignment (the query first, as jackhmmer writes it) into an `Msa`.

    Rows of one name are concatenated across blocks. As in AlphaFold, the columns where the query has
    a gap (`-` or `.`) are removed from every row, and a residue of a row in such a column counts as a
    deletion before the next query column. Rows come back upper case with `-` for gaps. A row's
    description is its name, followed by its `#=GS <name> DE` text when present (so that identifiers
    are parsed from the name, as AlphaFold does). Parsing stops at the first `//`. Raises ParseError
    (file, line) for a sequence line that is not `<name> <sequence>`, an unexpected character, rows
    of different total length, no sequences, or a query without residues.
    """
    segments: dict[str, list[str]] = {}
    last_line: dict[str, int] = {}
    gs_descriptions: dict[str, str] = {}
    lineno = 0
    for lineno, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("//"):
            break
        if line[0] == "#":
            if line.startswith("#=GS"):
                fields = line.split(maxsplit=3)
                if len(fields) >= 3 and fields[2] == "DE":
                    gs_descriptions[fields[1]] = fields[3] if len(fields) == 4 else ""
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ParseError(
                f"expected '<name> <aligned sequence>', got {len(fields)} field(s)", path, lineno
            )
        name, seq = fields
        bad = _NOT_MSA.search(seq)
        if bad is not None:
            raise ParseError(f"unexpected character {bad.group()!r} in the row of {name!r}", path, lineno)
        segments.setdefault(name, []).append(seq)
        last_line[name] = lineno
    if not segments:
        raise ParseError("no sequences in the alignment", path, lineno)

    names = list(segments)
    rows = ["".join(segments[name]) for name in names]
    width = len(rows[0])
    for name, row in zip(names, rows, strict=True):
        if len(row) != width:
            raise ParseError(
                f"row {name!r} has {len(row)} columns, the query has {width}", path, last_line[name]
            )
    matrix = np.frombuffer("".join(rows).encode("ascii"), dtype=np.uint8).reshape(len(rows), width)
    gap = (matrix == ord("-")) | (matrix == ord("."))
    query_gap = gap[0]
    if query_gap.all():
        raise ParseError("the query (first sequence) has no residues", path, last_line[names[0]])

    aligned = _STO_OUT[matrix[:, ~query_gap]]
    length = aligned.shape[1]
    flat = aligned.tobytes().decode("ascii")
    sequences = [flat[i * length : (i + 1) * length] for i in range(len(rows))]
    descriptions = [f"{n} {gs_descriptions[n]}".rstrip() if n in gs_descriptions else n for n in names]
    return Msa(sequences, _stockholm_deletions(matrix, query_gap, gap), descriptions)


# --------------------------------------------------------------------------------------------------
# HHsearch / HHblits .hhr

_HHR_SUMMARY = re.compile(
    r"Probab=\s*(\S+)\s+E-value=\s*(\S+)\s+Score=\s*(\S+)\s+Aligned_cols=\s*(\d{1,9})\s+"
    r"Identities=\s*(\S+)%\s+Similarity=\s*(\S+)\s+Sum_probs=\s*(\S+)",
    re.ASCII,
)
# The tail of a Q/T alignment line: start, aligned residues, end, (sequence length). Matched from the
# line's end, so that the name field before it (truncated by HHsuite to a fixed width) may hold anything.
# Numbers are capped at 9 digits: int() refuses very long digit strings, and no real file has them.
_HHR_ALIGNMENT = re.compile(r"\s(\d{1,9})\s+([A-Za-z-]+)\s+(\d{1,9})\s+\((\d{1,9})\)\s*$", re.ASCII)
_HHR_HIT_NUMBER = re.compile(r"^No\s+(\d{1,9})\s*$", re.ASCII)
_HHR_SKIPPED = ("ss_dssp", "ss_pred", "ss_conf", "Consensus")


def _residue_indices(segment: str, start: int) -> np.ndarray:
    """0-based residue index of each column of an alignment segment, -1 at gaps."""
    residue = np.frombuffer(segment.encode("ascii"), dtype=np.uint8) != ord("-")
    indices = start + np.cumsum(residue) - 1
    return np.where(residue, indices, -1)


def _parse_hhr_hit(lines: list[str], first: int, stop: int, path: PathLike | None) -> TemplateHit:
    """Parse lines[first:stop], one 'No <n>' block; line numbers in errors are 1-based."""
    number = _HHR_HIT_NUMBER.match(lines[first])
    if number is None:
        raise ParseError(f"expected 'No <hit number>', got {lines[first][:40]!r}", path, first + 1)
    if first + 2 >= stop or not lines[first + 1].startswith(">"):
        raise ParseError("a hit block must start with 'No <n>', '>name' and a summary line", path, first + 1)
    summary = _HHR_SUMMARY.search(lines[first + 2])
    if summary is None:
        raise ParseError("expected the hit's summary line (Probab=... Sum_probs=...)", path, first + 3)
    try:
        sum_probs = float(summary.group(7))
    except ValueError:
        raise ParseError(f"Sum_probs {summary.group(7)!r} is not a number", path, first + 3) from None

    query, hit, indices_query, indices_hit = [], [], [], []
    block_length: int | None = None  # columns of the current Q line, which its T line must match
    query_line = 0
    for i in range(first + 3, stop):
        line = lines[i]
        if not line.startswith(("Q ", "T ")):
            continue
        fields = line.split(maxsplit=2)
        if len(fields) < 2 or fields[1] in _HHR_SKIPPED:
            continue
        match = _HHR_ALIGNMENT.search(line)
        if match is None:
            raise ParseError("expected '<name> <start> <sequence> <end> (<length>)'", path, i + 1)
        start, segment, end = int(match.group(1)) - 1, match.group(2), int(match.group(3))
        if line[0] == "Q":
            if block_length is not None:
                raise ParseError("a query alignment line has no template line", path, query_line)
            residues = len(segment) - segment.count("-")
            if end - start != residues:
                raise ParseError(
                    f"query residues {start + 1}-{end} do not fit the {residues} residues shown", path, i + 1
                )
            block_length, query_line = len(segment), i + 1
            query.append(segment)
            indices_query.append(_residue_indices(segment, start))
        else:
            if block_length is None:
                raise ParseError("a template alignment line without a query line before it", path, i + 1)
            if block_length != len(segment):
                raise ParseError(
                    f"template segment has {len(segment)} columns, its query line {block_length}", path, i + 1
                )
            block_length = None
            hit.append(segment)
            indices_hit.append(_residue_indices(segment, start))
    if block_length is not None:
        raise ParseError("a query alignment line has no template line", path, query_line)

    def _join(parts: list[np.ndarray]) -> list[int]:
        return np.concatenate(parts).tolist() if parts else []

    name, description = ([*lines[first + 1][1:].split(maxsplit=1), "", ""])[:2]
    return TemplateHit(
        index=int(number.group(1)),
        name=name,
        aligned_cols=int(summary.group(4)),
        sum_probs=sum_probs,
        query="".join(query),
        hit_sequence="".join(hit),
        indices_query=_join(indices_query),
        indices_hit=_join(indices_hit),
        description=description,
    )


def parse_hhr(text: str, path: PathLike | None = None) -> list[TemplateHit]:
    """Parse an HHsearch/HHblits `.hhr` file into its hits, in file order, as AlphaFold does.

    Each `No <n>` block gives a hit: its name (the `>` line), `Aligned_cols` and `Sum_probs` from the
    summary line, and the query/template alignment concatenated over its `Q`/`T` lines (consensus and
    secondary-structure lines skipped) with 0-based residue indices per column (-1 at gaps). A text
    without hit blocks gives []. Raises ParseError (file, line) for a malformed block: a bad summary
    line, an alignment line that does not parse, residue numbers that disagree with the segment, or a
    template segment whose length differs from its query segment's.
    """
    lines = [line.rstrip() for line in text.split("\n")]
    starts = [i for i, line in enumerate(lines) if line.startswith("No ")]
    return [
        _parse_hhr_hit(lines, first, stop, path)
        for first, stop in zip(starts, [*starts[1:], len(lines)], strict=False)
    ]
