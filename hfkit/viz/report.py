"""Markdown tables of the committed benchmark results: `docs/results.md` and the README's headline table.

`results_markdown(results)` turns every results file `<results>/<gpu>/*.json` into tables, one per op a
file holds: providers pivoted into columns (the median time of each, hfkit's speed-up over the eager
and `torch.compile` baselines), one row per configuration, each table with the GPU, versions, commits
and commands that produced it. `headline_markdown(results)` is the small table of key numbers that
`hfkit report` writes into README.md between `HEADLINE_START` and `HEADLINE_END`. Both are plain
functions of the files' contents (no clock, sorted inputs), so `hfkit report --check` can tell when
the committed documents no longer match data/results.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfkit.bench.results import rows_to_frame

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "HEADLINE_END",
    "HEADLINE_START",
    "Table",
    "headline_markdown",
    "op_tables",
    "report_documents",
    "results_markdown",
    "with_headline",
]

HEADLINE_START = "<!-- results:headline:start -->"
HEADLINE_END = "<!-- results:headline:end -->"

# Display order of providers; others follow alphabetically. Some files name the eager baseline `torch`.
PROVIDER_ORDER = (
    "hfkit",
    "compile_hfkit",
    "trifast",
    "cuequivariance",
    "compile",
    "sdpa",
    "eager",
    "openfold_hfkit",
    "openfold_compile",
    "openfold",
)
PROVIDER_ALIASES = {"torch": "eager"}
BASELINES = ("eager", "compile")
ERROR_METHODS = ("error", "failed")
# A pivot with more providers than this, or with fewer than a third of its cells filled, is shown
# one measurement per line instead (a waterfall's stages, a file of diagnostics). Seven: the model
# benchmark's four variants and OpenFold's three.
MAX_PIVOT_PROVIDERS = 7
MIN_PIVOT_FILL = 1 / 3
# Peak memory is shown beside the time when the providers of one configuration differ by this factor.
MEMORY_SPREAD = 2.0
KEY_COLUMNS = ("mode", "shape", "dtype")


@dataclass
class Table:
    """One markdown table: a title, lines of context above it, a header and rows of cell text."""

    title: str
    header: list[str]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> list[str]:
        """The table as markdown lines: `#### title`, the notes, then the pipe table."""
        lines = [f"#### {self.title}", ""]
        if self.notes:
            lines += [*self.notes, ""]
        lines.append("| " + " | ".join(self.header) + " |")
        lines.append("|" + "|".join("---" for _ in self.header) + "|")
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in self.rows]
        return lines


def _number(value: float) -> str:
    """Three significant digits, no exponent, thousands separated: 0.0691, 2.48, 17.7, 142, 1,646."""
    if not math.isfinite(value):
        return "nan"
    if value == 0:
        return "0"
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))
    return f"{value:,.{min(decimals, 4)}f}"


def _bytes_text(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{_number(n / size)} {unit}"
    return f"{int(n)} B"


def _time_unit(p50_ms: Sequence[float]) -> tuple[str, float]:
    """The unit (name, factor from ms) that puts the median of `p50_ms` between 1 and 1000."""
    finite = sorted(v for v in p50_ms if math.isfinite(v))
    median = finite[len(finite) // 2] if finite else 1.0
    if median < 1.0:
        return "µs", 1e3
    if median >= 1e3:
        return "s", 1e-3
    return "ms", 1.0


def _is_error(row: Mapping[str, Any]) -> bool:
    p50 = row["p50_ms"]
    failed = p50 is None or not math.isfinite(float(p50))
    return failed or row["method"] in ERROR_METHODS or "error" in (row["extra"] or {})


def _is_profile(row: Mapping[str, Any]) -> bool:
    # Profiler rows name an operator (`aten::mm`) where other rows name a provider.
    return "::" in str(row["provider"])


def _cell_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _shape_text(row: Mapping[str, Any]) -> str:
    if row["op"] == "allreduce" and len(row["shape"]) == 1:
        return _bytes_text(row["shape"][0])  # an allreduce's shape is its message size in bytes
    return "×".join(str(d) for d in row["shape"])


def _key_value(row: Mapping[str, Any], column: str) -> Any:
    if column == "shape":
        return tuple(row["shape"])
    if column in ("mode", "dtype", "method"):
        return row[column]
    return (row["extra"] or {}).get(column)


def _sorter(values: Sequence[Any]) -> Callable[[Any], tuple]:
    """A sort key for one key column: numbers and shapes ascending, None first; text in the order the
    file first lists it (a pipeline's stages, a benchmark's cases), since that order means something."""
    first_seen = {v: i for i, v in reversed(list(enumerate(values)))}

    def key(value: Any) -> tuple:
        if value is None:
            return (0, 0.0, ())
        if isinstance(value, bool | int | float):
            return (1, float(value), ())
        if isinstance(value, tuple):
            return (2, 0.0, value)
        return (3, float(first_seen[value]), ())

    return key


def _case_candidates(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Extra fields that can name a configuration: text, flags and integers (never measured floats)."""
    kinds: dict[str, bool] = {}
    for row in rows:
        for key, value in (row["extra"] or {}).items():
            kinds[key] = kinds.get(key, True) and (value is None or isinstance(value, str | bool | int))
    return sorted(key for key, ok in kinds.items() if ok and key != "error") + ["method"]


def _duplicates(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> int:
    keys = {(row["provider"], *(_key_value(row, c) for c in columns)) for row in rows}
    return len(rows) - len(keys)


def _case_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """`KEY_COLUMNS` plus the fewest extra fields that tell a provider's measurements apart.

    Fields are added greedily, the one that separates most rows first, until no field separates more:
    a stack's `checkpointing` and `launch`, a diagnostics file's `call`, a data run's `sample_index`.
    """
    columns = list(KEY_COLUMNS)
    base = len(columns)
    candidates = _case_candidates(rows)
    while candidates:
        current = _duplicates(rows, columns)
        best = min(candidates, key=lambda c: (_duplicates(rows, [*columns, c]), candidates.index(c)))
        if current == 0 or _duplicates(rows, [*columns, best]) >= current:
            break
        columns.insert(base - 2, best)  # after mode, before shape and dtype
        base += 1
        candidates.remove(best)
    return columns


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    rows = []
    for row in frame.to_dict("records"):
        row["provider"] = PROVIDER_ALIASES.get(row["provider"], row["provider"])
        row["extra"] = row["extra"] if isinstance(row["extra"], dict) else {}
        rows.append(row)
    return rows


def _speedup(baseline: Mapping[str, Any], ours: Mapping[str, Any]) -> str:
    return f"{_number(baseline['p50_ms'] / ours['p50_ms'])}×"


def _provider_order(providers: Sequence[str]) -> list[str]:
    known = [p for p in PROVIDER_ORDER if p in providers]
    return known + sorted(p for p in set(providers) if p not in PROVIDER_ORDER)


def _memory_matters(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> bool:
    peaks: dict[tuple, list[float]] = {}
    for row in rows:
        peak = row["peak_mem_bytes"]
        if peak is not None and math.isfinite(peak) and peak > 0 and not _is_error(row):
            peaks.setdefault(tuple(_key_value(row, c) for c in columns), []).append(float(peak))
    return any(max(v) >= MEMORY_SPREAD * min(v) for v in peaks.values())


def _measurement(row: Mapping[str, Any], factor: float, memory: bool) -> str:
    if _is_error(row):
        return "error"
    text = _number(row["p50_ms"] * factor)
    busbw = (row["extra"] or {}).get("busbw_gbps")
    if memory and row["peak_mem_bytes"] is not None and math.isfinite(row["peak_mem_bytes"]):
        text += f" ({_bytes_text(row['peak_mem_bytes'])})"
    elif isinstance(busbw, int | float) and math.isfinite(busbw):
        text += f" ({_number(busbw)} GB/s)"
    return text


def _present(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _provenance(rows: Sequence[Mapping[str, Any]], gpu_folder: str) -> list[str]:
    """Lines naming the device, versions, commits and commands of `rows`, in order of appearance."""

    def distinct(key: str, short: Callable[[Any], str] = str) -> list[str]:
        return list(dict.fromkeys(short(r[key]) for r in rows if _present(r[key])))

    def one_line(command: str) -> str:
        first, *rest = command.strip().splitlines() or [""]
        return first + (f" … ({len(rest)} more lines)" if rest else "")

    versions = [f"torch {v}" for v in distinct("torch")] + [f"Triton {v}" for v in distinct("triton")]
    commits = distinct("commit", lambda c: str(c)[:7])
    where = [
        f"{', '.join(distinct('gpu')) or 'device not recorded'} (`{gpu_folder}`)",
        *([", ".join(versions)] if versions else []),
        f"commit {', '.join(commits)}" if commits else "commit not recorded",
        "timed by " + ", ".join(dict.fromkeys(str(r["method"]) for r in rows if not _is_error(r))),
    ]
    commands = [one_line(c) for c in distinct("command") if str(c).strip()]
    return ["; ".join(where) + ".", *(["", "```bash", *commands, "```"] if commands else [])]


def _with_remarks(lines: list[str], remarks: list[str]) -> list[str]:
    return [*lines, "", " ".join(remarks)] if remarks else lines


def _constant_columns(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> list[str]:
    return [c for c in columns if len({repr(_key_value(r, c)) for r in rows}) == 1]


def _column_text(row: Mapping[str, Any], column: str) -> str:
    return _shape_text(row) if column == "shape" else _cell_value(_key_value(row, column))


def _extra_number(value: int | float) -> str:
    return f"{value:,}" if isinstance(value, int) else _number(value)


def _fixed_text(row: Mapping[str, Any], column: str) -> str:
    value = _key_value(row, column)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _extra_number(value)
    return _column_text(row, column) or "none"


def _profile_table(title: str, rows: Sequence[Mapping[str, Any]], notes: list[str]) -> Table:
    """Profiler rows, one operator a line, with the numeric extras every row has (calls, shares)."""
    numeric = [
        key
        for key in sorted(set.intersection(*(set(r["extra"]) for r in rows)))
        if all(
            isinstance(r["extra"][key], int | float)
            and not isinstance(r["extra"][key], bool)
            and math.isfinite(r["extra"][key])
            for r in rows
        )
    ]
    constant = _constant_columns(rows, [*KEY_COLUMNS, *numeric])
    columns = [c for c in KEY_COLUMNS if c not in constant]
    numeric = [k for k in numeric if k not in constant]
    unit, factor = _time_unit([r["p50_ms"] for r in rows])
    header = ["operator", *columns, f"time ({unit})", *numeric]
    body = [
        [
            str(r["provider"]),
            *(_column_text(r, c) for c in columns),
            "error" if _is_error(r) else _number(r["p50_ms"] * factor),
            *(_extra_number(r["extra"][k]) for k in numeric),
        ]
        for r in rows
    ]
    fixed = ", ".join(f"{c} {_fixed_text(rows[0], c)}" for c in constant)
    return Table(title, header, body, _with_remarks(notes, [f"All rows: {fixed}."] if fixed else []))


def op_tables(frame: pd.DataFrame, gpu_folder: str = "", title: str = "") -> list[Table]:
    """The tables of one op's rows (`frame`: `rows_to_frame` / `load_results` output of a single op).

    Configurations (mode, shape, dtype and the extra fields that tell measurements apart) are rows;
    providers are columns holding the median time, "error" for a failed measurement and nothing where
    a provider has no row; `hfkit vs <baseline>` columns give the speed-up over `eager` (`torch` is
    read as `eager`) and `compile` where both exist. A configuration measured more than once keeps its
    last row. Profiler rows (provider `aten::...`) get a table of their own; many providers or a sparse
    pivot give one measurement per line instead.
    """
    rows = _records(frame)
    title = title or str(rows[0]["op"])
    tables = []
    profile = [r for r in rows if _is_profile(r)]
    rows = [r for r in rows if not _is_profile(r)]
    if profile:
        notes = _provenance(profile, gpu_folder)
        tables.append(_profile_table(f"{title}: profiled operators", profile, notes))
    if not rows:
        return tables
    notes = _provenance(rows, gpu_folder)
    columns = _case_columns(rows)
    # The last measurement of a configuration is the current one (files are extended with --append).
    latest: dict[tuple, dict[str, Any]] = {}
    for row in rows:
        latest[(row["provider"], *(_key_value(row, c) for c in columns))] = row
    superseded = len(rows) - len(latest)
    kept = list(latest.values())
    constant = _constant_columns(kept, columns)
    shown = [c for c in columns if c not in constant]
    sorters = [_sorter([_key_value(r, c) for r in kept]) for c in columns]
    cases = sorted(
        {tuple(_key_value(r, c) for c in columns): r for r in kept}.items(),
        key=lambda item: tuple(sort(v) for sort, v in zip(sorters, item[0], strict=True)),
    )
    providers = _provider_order([r["provider"] for r in kept])
    unit, factor = _time_unit([r["p50_ms"] for r in kept if not _is_error(r)])
    memory = _memory_matters(kept, columns)
    fixed = ", ".join(f"{c} {_fixed_text(kept[0], c)}" for c in constant)
    remarks = [f"All rows: {fixed}."] if fixed else []
    if memory:
        remarks.append("Peak memory in brackets.")
    if superseded:
        remarks.append(f"{superseded} earlier measurements of configurations measured again are not shown.")
    notes = _with_remarks(notes, remarks)
    fill = len(kept) / (len(cases) * len(providers))
    if len(providers) > MAX_PIVOT_PROVIDERS or fill < MIN_PIVOT_FILL:
        header = [*shown, "provider", f"time ({unit})"]
        body = [
            [*(_column_text(r, c) for c in shown), str(r["provider"]), _measurement(r, factor, memory)]
            for r in kept
        ]
        return [*tables, Table(title, header, body, notes)]
    speedups = [b for b in BASELINES if "hfkit" in providers and b in providers]
    header = [*shown, *(f"{p} ({unit})" for p in providers), *(f"hfkit vs {b}" for b in speedups)]
    body = []
    for key, example in cases:
        cells = {p: latest.get((p, *key)) for p in providers}
        line = [_column_text(example, c) for c in shown]
        line += ["" if cells[p] is None else _measurement(cells[p], factor, memory) for p in providers]
        for base in speedups:
            ours, theirs = cells["hfkit"], cells[base]
            ok = ours is not None and theirs is not None and not _is_error(ours) and not _is_error(theirs)
            line.append(_speedup(theirs, ours) if ok else "")
        body.append(line)
    return [*tables, Table(title, header, body, notes)]


def _results_files(results: Path) -> list[Path]:
    return sorted(p for p in results.glob("*/*.json") if not p.name.startswith("."))


def _read(path: Path) -> tuple[dict[str, Any] | None, pd.DataFrame | None]:
    """(meta, frame) of a results document; (None, None) for any other JSON, or rows off the schema."""
    doc = json.loads(path.read_text())
    if not (
        isinstance(doc, dict) and isinstance(doc.get("meta"), dict) and isinstance(doc.get("rows"), list)
    ):
        return None, None
    try:
        return doc["meta"], rows_to_frame(doc["rows"]) if doc["rows"] else None
    except ValueError:  # a row lacks a schema field
        return None, None


def results_markdown(results: str | Path) -> str:
    """The whole of docs/results.md for the results folder `results` (`<results>/<gpu>/*.json`).

    One section per GPU folder, one sub-section per file (titled by its stem), one table per op in the
    file (see `op_tables`); a file's hand-written `meta.note` is quoted under its title. Sub-folders of
    a GPU folder (tile sweeps under `tuning/`) are listed, not tabulated. Raises FileNotFoundError when
    `results` holds no results file.
    """
    results = Path(results)
    files = _results_files(results)
    if not files:
        raise FileNotFoundError(f"results: no <gpu>/*.json files under {results}")
    lines = [
        "# Benchmark results",
        "",
        "<!-- Generated by `hfkit report` from data/results/; never edit by hand. -->",
        "",
        "Generated by `hfkit report` from the committed results files in `data/results/<gpu>/*.json`;",
        "do not edit by hand: rerun `hfkit report` after adding results. Times are medians (p50) under",
        "the timing method each table names; `hfkit vs X` columns are X's time over hfkit's; an empty",
        "cell is a configuration that provider was not run on. `data/README.md` describes the rows.",
    ]
    for folder in sorted({p.parent for p in files}):
        lines += ["", f"## {folder.name}"]
        for path in (p for p in files if p.parent == folder):
            meta, frame = _read(path)
            lines += ["", f"### {folder.name} / {path.stem}", "", f"`data/results/{folder.name}/{path.name}`"]
            if meta is None or frame is None:
                lines += ["", "Not a results document with schema rows; not tabulated."]
                continue
            if meta.get("note"):
                lines += ["", *(f"> {line}" for line in str(meta["note"]).splitlines())]
            for op in dict.fromkeys(frame["op"]):
                op_frame = frame[frame["op"] == op]
                title = path.stem if op == path.stem else f"{path.stem}: {op}"
                for table in op_tables(op_frame, folder.name, title):
                    lines += ["", *table.markdown()]
        extra = sorted(p.relative_to(folder).as_posix() for p in folder.glob("*/*.json"))
        if extra:
            lines += ["", f"Not tabulated here (tile sweeps and other sub-folders of `{folder.name}`):", ""]
            lines += [f"- `{name}`" for name in extra]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Headline:
    """One line of the README's headline table: a label and which forward+backward rows it reads (an op
    and a filter on the rows)."""

    label: str
    op: str
    where: Callable[[Mapping[str, Any]], bool]
    # Which row provider fills each column (default: the column's own name), e.g. "hfkit" from the
    # "hfkit_graphed" rows, or OpenFold's variants in the eager/hfkit columns.
    providers: Mapping[str, str] = field(default_factory=dict)

    def provider(self, column: str) -> str:
        return self.providers.get(column, column)


def _extra_is(**wanted: Any) -> Callable[[Mapping[str, Any]], bool]:
    return lambda row: all((row["extra"] or {}).get(k) == v for k, v in wanted.items())


HEADLINES = (
    Headline(
        "48-block Evoformer stack, bf16, one CUDA graph",
        "evoformer_stack",
        lambda r: r["dtype"] == "bf16" and _extra_is(launch="graph", checkpointing=False)(r),
    ),
    Headline(
        "Evoformer block, (S, N) = (128, 256), bf16",
        "evoformer_block",
        # Rows without a launch are CUDA-graph timed blocks.
        lambda r: (
            r["dtype"] == "bf16"
            and list(r["shape"]) == [128, 256]
            and (r["extra"] or {}).get("launch", "graph") == "graph"
        ),
    ),
    Headline(
        "Evoformer block, (S, N) = (128, 256), bf16, launched from Python (hfkit: + graph_modules)",
        "evoformer_block",
        lambda r: (
            r["dtype"] == "bf16"
            and list(r["shape"]) == [128, 256]
            and _extra_is(launch="eager")(r)
            and ((r["extra"] or {}).get("compile") or {}).get("mode") is None  # not reduce-overhead
        ),
        {"hfkit": "hfkit_graphed"},
    ),
    Headline(
        "OpenFold's 48-block stack, bf16: as it is, launched from Python; swapped, one CUDA graph",
        "evoformer_stack",
        lambda r: (
            r["dtype"] == "bf16"
            and _extra_is(checkpointing=False)(r)
            and (r["provider"], (r["extra"] or {}).get("launch"))
            in {("openfold", "eager"), ("openfold_hfkit", "graph")}
        ),
        {"eager": "openfold", "hfkit": "openfold_hfkit", "compile": "-", "compile_hfkit": "-"},
    ),
    Headline(
        "Training step, af2_initial, checkpointed, launched from Python",
        "train_step",
        # Rows without a launch are `train_step` from a Python loop.
        lambda r: _extra_is(checkpointing=True)(r) and (r["extra"] or {}).get("launch", "eager") == "eager",
    ),
    Headline(
        "Training step, af2_initial, checkpointed, hfkit.train.graphed_step",
        "train_step",
        _extra_is(checkpointing=True, launch="graph"),
    ),
    Headline(
        "Training step, af2_initial, not checkpointed, hfkit.train.graphed_step",
        "train_step",
        _extra_is(checkpointing=False, launch="graph"),
    ),
    Headline(
        "Triangle attention, N = 1024, bf16",
        "triangle_attention",
        lambda r: r["dtype"] == "bf16" and list(r["shape"][-2:-1]) == [1024],
    ),
    Headline(
        "Triangle multiplication, N = 1024, bf16 autocast",
        "triangle_multiplication",
        lambda r: list(r["shape"][1:3]) == [1024, 1024] and _extra_is(direction="outgoing")(r),
    ),
    Headline(
        "LayerNorm, 1×256×256×128, fp32",
        "layer_norm",
        lambda r: r["dtype"] == "fp32" and list(r["shape"]) == [1, 256, 256, 128],
    ),
)
HEADLINE_PROVIDERS = ("eager", "compile", "hfkit", "compile_hfkit")
HEADLINE_GPU = "h200"


def headline_markdown(results: str | Path, gpu: str = HEADLINE_GPU) -> str:
    """The README's headline table: `HEADLINES` measured on `<results>/<gpu>/`, eager vs compile vs hfkit.

    Each line reads the rows of its op from whichever file holds them (files may be renamed), the
    last row of each provider when a configuration was measured more than once; a line whose rows are
    missing is left out. Cells hold the median time with the peak memory in brackets.
    """
    folder = Path(results) / gpu
    rows: list[dict[str, Any]] = []
    for path in sorted(folder.glob("*.json")):
        _, frame = _read(path)
        if frame is not None:
            rows += _records(frame)
    header = ["forward + backward: median time (peak memory)", "eager", "torch.compile", "hfkit"]
    header += ["compile + hfkit", "hfkit vs eager", "hfkit vs compile"]
    body = []
    for line in HEADLINES:
        measured = {
            r["provider"]: r for r in rows if r["op"] == line.op and r["mode"] == "fwd+bwd" and line.where(r)
        }
        picked = {p: measured[line.provider(p)] for p in HEADLINE_PROVIDERS if line.provider(p) in measured}
        if "hfkit" not in picked:
            continue
        unit, factor = _time_unit([r["p50_ms"] for r in picked.values() if not _is_error(r)])
        cells = [f"{line.label} ({unit})"]
        cells += [_measurement(picked[p], factor, True) if p in picked else "" for p in HEADLINE_PROVIDERS]
        for base in ("eager", "compile"):
            theirs, ours = picked.get(base), picked["hfkit"]
            ok = theirs is not None and not _is_error(theirs) and not _is_error(ours)
            cells.append(_speedup(theirs, ours) if ok else "")
        body.append(cells)
    if not body:
        raise FileNotFoundError(f"headline: no rows of {[h.op for h in HEADLINES]} in {folder}")
    gpus = ", ".join(sorted({str(r["gpu"]) for r in rows}))
    lines = [
        HEADLINE_START,
        "<!-- Generated by `hfkit report` from data/results/; never edit by hand. -->",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(cells) + " |" for cells in body),
        "",
        f"{gpus} (`data/results/{gpu}/`); every table, with its commits and commands: "
        "[docs/results.md](docs/results.md).",
        HEADLINE_END,
    ]
    return "\n".join(lines)


def with_headline(readme: str, block: str) -> str:
    """`readme` with the text from `HEADLINE_START` to `HEADLINE_END` (inclusive) replaced by `block`.

    Raises ValueError naming the markers when `readme` does not hold them once each, in that order.
    """
    start, end = readme.find(HEADLINE_START), readme.find(HEADLINE_END)
    if start < 0 or end < start or readme.count(HEADLINE_START) != 1 or readme.count(HEADLINE_END) != 1:
        raise ValueError(
            f"readme: expected one {HEADLINE_START!r} followed by one {HEADLINE_END!r}, "
            f"found {readme.count(HEADLINE_START)} and {readme.count(HEADLINE_END)}"
        )
    return readme[:start] + block + readme[end + len(HEADLINE_END) :]


def report_documents(results: str | Path, out: str | Path, readme: str | Path) -> dict[Path, str]:
    """What `hfkit report` writes: {`out`: `results_markdown(results)`, `readme`: the README with its
    headline block from `headline_markdown(results)`}. Reads `readme`; writes nothing."""
    readme = Path(readme)
    return {
        Path(out): results_markdown(results),
        readme: with_headline(readme.read_text(), headline_markdown(results)),
    }
