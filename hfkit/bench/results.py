"""Benchmark results: the row schema, the environment stamp, and JSON save/load under data/results/.

A results file is one JSON document `{"meta": {...}, "rows": [...]}`: `meta` holds the environment
(device, versions, git commit, command, timestamp) and the ceilings measured in the same run; each row
holds one measurement (op, provider, mode, shape, dtype, percentiles, bytes, GB/s, % of ceiling) and
repeats the environment fields, so rows from several files can be concatenated into one DataFrame and
still say where each number came from. Files are written atomically (temp file, then `os.replace`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hfkit.bench.ceilings import device_name

if TYPE_CHECKING:
    import pandas as pd

    from hfkit.bench.ceilings import Ceilings
    from hfkit.bench.timing import Timing

__all__ = [
    "ENV_KEYS",
    "ResultFile",
    "ResultRow",
    "SCHEMA_VERSION",
    "check_choice",
    "environment_info",
    "git_commit",
    "gpu_slug",
    "load_results",
    "make_row",
    "merge_rows",
    "repo_root",
    "results_dir",
    "row_environment",
    "rows_to_frame",
    "save_results",
    "summary_table",
    "with_speedup",
]

SCHEMA_VERSION = 1


@dataclass
class ResultRow:
    """One benchmark measurement plus the environment that produced it.

    Times are per op call in milliseconds; `bytes` is the minimum device-memory traffic counted for the
    op (`gbps = bytes / p50`); `pct_copy` is `gbps` as a percentage of the copy bandwidth measured in
    the same run. FLOP fields are None for memory-bound ops. `extra` holds op-specific notes.
    """

    gpu: str
    torch: str
    triton: str | None
    python: str
    commit: str | None
    command: str
    timestamp: str
    op: str
    provider: str
    mode: str
    shape: list[int]
    dtype: str
    p20_ms: float
    p50_ms: float
    p80_ms: float
    method: str
    n_reps: int
    bytes: int
    gbps: float
    pct_copy: float | None
    flops: int | None = None
    tflops: float | None = None
    pct_matmul: float | None = None
    peak_mem_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


ROW_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(ResultRow))


def make_row(
    env: Mapping[str, Any],
    timing: Timing | None,
    *,
    op: str,
    provider: str,
    mode: str,
    shape: Sequence[int],
    dtype: str,
    nbytes: int = 0,
    flops: int | None = None,
    ceilings: Ceilings | None = None,
    peak_mem_bytes: int | None = None,
    extra: Mapping[str, Any] | None = None,
    gbps: float | None = None,
) -> ResultRow:
    """One row from the `Timing` of one call and the `ENV_KEYS` fields in `env`. GB/s of `nbytes` (or
    `gbps` as given) and TFLOP/s of `flops` at the median, each as a percentage of `ceilings` when
    given. `timing` None gives the error row: NaN times, method "error" (the error goes in `extra`)."""
    base = dict(env, op=op, provider=provider, mode=mode, shape=[int(d) for d in shape], dtype=dtype)
    extra = dict(extra or {})
    if timing is None:
        nan = math.nan
        return ResultRow(
            **base, p20_ms=nan, p50_ms=nan, p80_ms=nan, method="error", n_reps=0, bytes=int(nbytes),
            gbps=nan, pct_copy=None, flops=flops, peak_mem_bytes=peak_mem_bytes, extra=extra,
        )  # fmt: skip
    seconds = timing.p50 * 1e-3
    gbps = nbytes / seconds / 1e9 if gbps is None else gbps
    tflops = flops / seconds / 1e12 if flops else None
    copy_ok = ceilings is not None and ceilings.copy_gbps > 0 and nbytes > 0
    matmul_ok = ceilings is not None and ceilings.matmul_tflops > 0 and tflops is not None
    return ResultRow(
        **base, p20_ms=timing.p20, p50_ms=timing.p50, p80_ms=timing.p80, method=timing.method,
        n_reps=timing.n, bytes=int(nbytes), gbps=gbps,
        pct_copy=100.0 * gbps / ceilings.copy_gbps if copy_ok else None, flops=flops, tflops=tflops,
        pct_matmul=100.0 * tflops / ceilings.matmul_tflops if matmul_ok else None,
        peak_mem_bytes=peak_mem_bytes, extra=extra,
    )  # fmt: skip


def repo_root() -> Path:
    """The checkout holding this package (the folder with pyproject.toml), else the working directory.

    Results are committed to the repository, so they are found from the package's location, not from
    wherever a notebook or the CLI happens to run.
    """
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").exists() else Path.cwd()


def results_dir() -> Path:
    """`<repo>/data/results`: one sub-folder per GPU slug."""
    return repo_root() / "data" / "results"


def gpu_slug(name: str) -> str:
    """A folder name for a device: 'NVIDIA H200' -> 'h200', 'NVIDIA A100-SXM4-80GB' -> 'a100-sxm4-80gb'.

    Any CPU name ('cpu', 'CPU (x86_64)') gives 'cpu'. Vendor words are dropped; the rest is lower case
    with runs of other characters turned into single dashes.
    """
    text = name.strip().lower()
    if not text or text.startswith("cpu"):
        return "cpu"
    text = re.sub(r"\b(nvidia|geforce|tesla|amd|radeon|instinct)\b", " ", text)
    slug = re.sub(r"[^a-z0-9]+", "-", text).strip("-")
    return slug or "unknown"


@cache
def git_commit(path: str | None = None) -> str | None:
    """`git rev-parse HEAD` of the repository at `path` (default: this package's), '-dirty' appended
    when tracked files differ from HEAD; None outside a git repository. The `HFKIT_GIT_COMMIT`
    environment variable, when set, is the answer instead: the commit of a copy of the tree sent to a
    GPU machine, whose own `.git` may be missing or from an earlier commit."""
    fallback = os.environ.get("HFKIT_GIT_COMMIT") or None
    if fallback is not None:
        return fallback
    cwd = path or str(repo_root())
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return fallback
    return f"{head}-dirty" if status else head


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)


def default_command() -> str:
    """The command line of this process, exactly as the interpreter received it."""
    return " ".join(sys.argv)


# The environment fields every `ResultRow` repeats.
ENV_KEYS = ("gpu", "torch", "triton", "python", "commit", "command", "timestamp")


def environment_info(device: torch.device | str | None = None, command: str | None = None) -> dict[str, Any]:
    """Where and how a measurement was taken: device, versions, CUDA, git commit, command, UTC time.

    The keys `gpu`, `torch`, `triton`, `python`, `commit`, `command` and `timestamp` are the ones every
    `ResultRow` repeats; the rest (`cuda`, `cuda_available`, `platform`) go to the file's `meta`.
    """
    return {
        "gpu": device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "platform": platform.platform(),
        "commit": git_commit(),
        "command": command if command is not None else default_command(),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def row_environment(device: torch.device | str | None, command: str | None) -> dict[str, Any]:
    """The `ENV_KEYS` fields of `environment_info`, taken once per run and repeated in every row."""
    env = environment_info(device, command)
    return {k: env[k] for k in ENV_KEYS}


def _row_dict(row: ResultRow | Mapping[str, Any]) -> dict[str, Any]:
    data = row.as_dict() if isinstance(row, ResultRow) else dict(row)
    missing = [name for name in ROW_FIELDS if name not in data]
    if missing:
        raise ValueError(f"rows: a row lacks the schema fields {missing}")
    return data


def save_results(
    rows: Sequence[ResultRow | Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    ceilings: Ceilings | None = None,
    meta: Mapping[str, Any] | None = None,
) -> Path:
    """Write `{"meta": ..., "rows": [...]}` to `path` atomically and return the path.

    `meta` defaults to `environment_info()` taken from the first row's fields where present; the
    ceilings, when given, are stored under `meta["ceilings"]`. The document is written to a temporary
    file beside `path` and moved over it with `os.replace`, so a reader never sees a half-written file
    and an interrupted run leaves the previous results intact.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data_rows = [_row_dict(r) for r in rows]
    doc_meta: dict[str, Any] = dict(meta) if meta is not None else environment_info()
    if data_rows and meta is None:
        # The rows carry the command and time of the run that made them; the file says the same.
        for key in ("gpu", "commit", "command", "timestamp"):
            doc_meta[key] = data_rows[0][key]
    doc_meta["schema_version"] = SCHEMA_VERSION
    if ceilings is not None:
        doc_meta["ceilings"] = ceilings.as_dict()
    text = json.dumps({"meta": doc_meta, "rows": data_rows}, indent=1, allow_nan=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_choice(name: str, values: Sequence[str], allowed: Sequence[str]) -> list[str]:
    """`values` as a list if it is a non-empty subset of `allowed`, else ValueError naming `name`
    (a benchmark's providers, modes, dtypes ...)."""
    values = list(values)
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ValueError(f"{name}: expected a non-empty subset of {list(allowed)}, got {values}")
    return values


def row_key(row: Mapping[str, Any], default_launch: str | None = None) -> tuple:
    """What identifies a measurement: op, provider, mode, shape, dtype and how the calls were launched
    (`extra["launch"]`; `default_launch` for a row without one: what its benchmark did before rows
    said). A later run of the same configuration replaces it (`merge_rows`)."""
    launch = (row.get("extra") or {}).get("launch", default_launch)
    return (row["op"], row["provider"], row["mode"], tuple(row["shape"]), row["dtype"], launch)


def merge_rows(
    earlier: Sequence[ResultRow | Mapping[str, Any]],
    later: Sequence[ResultRow | Mapping[str, Any]],
    key: Callable[[Mapping[str, Any]], tuple] = row_key,
) -> list[dict[str, Any]]:
    """`earlier` rows that `later` does not measure again (same `key`), then `later`: how a run that
    completes a results file (`--append`) keeps what it did not repeat. A later row that was only
    skipped (its `extra["error"]` starts with "skipped", e.g. a spent time budget) does not replace an
    earlier measurement. Rows stay as they were measured, each with its own command, commit and
    timestamp."""
    earlier_rows = [_row_dict(r) for r in earlier]
    measured = {key(r) for r in earlier_rows if not _skipped(r)}
    new = [r for r in map(_row_dict, later) if not (_skipped(r) and key(r) in measured)]
    replaced = {key(r) for r in new}
    return [r for r in earlier_rows if key(r) not in replaced] + new


def _skipped(row: Mapping[str, Any]) -> bool:
    return str((row.get("extra") or {}).get("error") or "").startswith("skipped")


class ResultFile:
    """Where a run's rows go: `path`, saved whole after every row (`partial=True`) and at the end.

    With `append`, the rows already in `path` stay unless this run measures the same configuration
    again (`key`, default `row_key`), and the earlier file's commands (`earlier_commands`), hand-written
    `note` and `scripts` are kept in the new `meta`, so that appending never silently drops how the
    earlier rows were made. `meta` is this run's environment (`environment_info`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        meta: Mapping[str, Any],
        *,
        append: bool = False,
        key: Callable[[Mapping[str, Any]], tuple] = row_key,
    ) -> None:
        self.path = Path(path)
        self.key = key
        self.earlier: list[dict[str, Any]] = []
        self.meta = dict(meta)
        if append and self.path.exists():
            doc = json.loads(self.path.read_text())
            self.earlier = doc.get("rows", [])
            before = doc.get("meta") or {}
            commands = list(before.get("earlier_commands") or [])
            if before.get("command") and before["command"] not in commands:
                commands.append(before["command"])
            if commands:
                self.meta["earlier_commands"] = commands
            for name in ("note", "scripts"):
                if name in before and name not in self.meta:
                    self.meta[name] = before[name]

    def save(
        self,
        rows: Sequence[ResultRow | Mapping[str, Any]],
        *,
        ceilings: Ceilings | None = None,
        partial: bool = False,
        **meta: Any,
    ) -> Path:
        """Write the earlier rows this run does not repeat, then `rows`; `partial` marks a run still in
        progress (a run cut short keeps what it measured); `meta` adds to this run's meta."""
        doc_meta = {**self.meta, **meta, **({"partial": True} if partial else {})}
        return save_results(
            merge_rows(self.earlier, rows, self.key), self.path, ceilings=ceilings, meta=doc_meta
        )


def _resolve_source(source: str | os.PathLike[str]) -> list[Path]:
    path = Path(source)
    if not path.exists() and isinstance(source, str) and "/" not in source and os.sep not in source:
        # A bare name is a GPU: 'h200' or 'NVIDIA H200' both mean data/results/h200/.
        path = results_dir() / gpu_slug(source)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.json") if not p.name.startswith("."))
        if not files:
            raise FileNotFoundError(f"load_results: no *.json results in {path}")
        return files
    if path.is_file():
        return [path]
    raise FileNotFoundError(f"load_results: {source!r} is neither a results file, a folder, nor a GPU slug")


def rows_to_frame(rows: Iterable[ResultRow | Mapping[str, Any]]) -> pd.DataFrame:
    """Rows as a DataFrame with the schema's columns plus `shape_str` ('1x256x256x128') and `p50_us`."""
    import pandas as pd

    frame = pd.DataFrame([_row_dict(r) for r in rows], columns=list(ROW_FIELDS))
    frame["shape_str"] = ["x".join(str(d) for d in s) for s in frame["shape"]]
    frame["p50_us"] = frame["p50_ms"] * 1e3
    return frame


def _is_results_doc(doc: Any) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("rows"), list) and isinstance(doc.get("meta"), dict)


def load_results(source: str | os.PathLike[str], op: str | None = None) -> pd.DataFrame:
    """Load results into one DataFrame from a JSON file, a folder of them, or a GPU slug ('h200').

    A slug resolves to `<repo>/data/results/<slug>/`. In a folder, JSON files that are not results
    documents (other tools' output) are skipped with a warning; a file named directly must be one.
    `op` keeps only that op's rows. Columns: the `ResultRow` fields, `shape_str`, `p50_us`, `file` (the
    source file name) and `ceiling_copy_gbps` / `ceiling_matmul_tflops` from each file's meta. Raises
    FileNotFoundError when no rows match.
    """
    import pandas as pd

    files = _resolve_source(source)
    frames = []
    for file in files:
        doc = json.loads(file.read_text())
        if not _is_results_doc(doc):
            if len(files) == 1 and Path(source).is_file():
                raise ValueError(f"load_results: {file} is not a results document (no 'meta' and 'rows')")
            warnings.warn(f"load_results: skipping {file.name}: not a results document", stacklevel=2)
            continue
        rows = [r for r in doc["rows"] if op is None or r.get("op") == op]
        if not rows:
            continue
        frame = rows_to_frame(rows)
        ceilings = doc.get("meta", {}).get("ceilings") or {}
        frame["ceiling_copy_gbps"] = ceilings.get("copy_gbps")
        frame["ceiling_matmul_tflops"] = ceilings.get("matmul_tflops")
        frame["file"] = file.name
        frames.append(frame)
    if not frames:
        what = f"{op!r} rows" if op else "results documents"
        raise FileNotFoundError(f"load_results: no {what} in {source}")
    return pd.concat(frames, ignore_index=True)


def with_speedup(frame: pd.DataFrame, baseline: str = "eager") -> pd.DataFrame:
    """Add `speedup`: the baseline provider's p50 over each row's p50 for the same op/shape/dtype/mode.

    Rows without a matching baseline row get NaN. Returns a new DataFrame.
    """
    keys = ["op", "shape_str", "dtype", "mode", "gpu"]
    base = (
        frame[frame["provider"] == baseline][keys + ["p50_ms"]]
        .drop_duplicates(subset=keys, keep="last")
        .rename(columns={"p50_ms": "_base_p50_ms"})
    )
    out = frame.merge(base, on=keys, how="left")
    out["speedup"] = out["_base_p50_ms"] / out["p50_ms"]
    return out.drop(columns="_base_p50_ms")


def summary_table(results: pd.DataFrame | Sequence[ResultRow], baseline: str = "eager") -> pd.DataFrame:
    """A readable table: shape, dtype, mode, provider, p50 µs, GB/s, % copy, speed-up vs `baseline`."""
    frame = results if not isinstance(results, Sequence) else rows_to_frame(results)
    if "shape_str" not in frame:
        frame = rows_to_frame(frame.to_dict("records"))
    frame = with_speedup(frame, baseline)
    table = frame[["shape_str", "dtype", "mode", "provider", "p50_us", "gbps", "pct_copy", "speedup"]]
    speedup = f"speed-up vs {baseline}"
    table = table.rename(
        columns={
            "shape_str": "shape",
            "p50_us": "p50 µs",
            "gbps": "GB/s",
            "pct_copy": "% copy",
            "speedup": speedup,
        }
    )
    return table.round({"p50 µs": 1, "GB/s": 1, "% copy": 1, speedup: 2})
