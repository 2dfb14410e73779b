"""Offline preprocessing: mmCIFs + alignments → raw feature records (`records-NNNNN.ffr`) + an index.

This is the "feature preprocessing" of High-Flyer's AlphaFold work: parsing and featurizing once, ahead
of training, so that a training step reads one checksummed record instead of parsing an mmCIF and
several MSA files. `preprocess` walks OpenFold's layout (`mmcif_dir/<pdbid>.cif`,
`alignment_dir/<pdbid>_<chain>/*.{a3m,sto}`), featurizes every protein chain with `make_raw_features`
in a process pool, and writes `chains_per_file` chains per record file.

Output folder:
- `records-00000.ffr`, ... : record files (see `hfkit.data.records`), one raw feature dict per chain,
  plus `chain_id`, `pdb_id`, `release_date` and `method` as 0-d string arrays.
- `index.json`: chain id → record file and index, sequence length, MSA depth, resolution, and the
  sizes/mtimes of its source files; per mmCIF, its size/mtime and chains. Written atomically after
  each completed record file, so it only ever names complete files.
- `summary.json`: the last run's outcome: chains written, skipped (already done), failed (with the
  input and the error), warnings (e.g. a chain without alignments, featurized with its sequence as
  the only MSA row), notices (a dead run's lock taken over, its temp files removed), per-chain
  timings (seconds).
- `.preprocess.lock`, while a run writes there: an flock naming the run's pid, deleted at its end.

Rerunning skips mmCIFs whose chains are all in the index with unchanged source files, so an
interrupted run resumes where it stopped; a record file being written when the run is interrupted is
deleted (the writer's temp-file semantics) and its chains are redone. A run killed outright
(SIGKILL) takes its pool workers with it and leaves an unlocked lock file and its temp files: the
next run takes the lock over and deletes the temp files, with a notice.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hfkit.data.records import RECORD_SUFFIX, RecordWriter, encode_sample

__all__ = [
    "ALIGNMENT_SUFFIXES",
    "INDEX_NAME",
    "MMCIF_SUFFIXES",
    "SUMMARY_NAME",
    "ChainResult",
    "MmcifResult",
    "PreprocessSummary",
    "chain_raw_features",
    "featurize_chain",
    "featurize_mmcif",
    "find_alignments",
    "find_mmcifs",
    "mmcif_entry_id",
    "load_index",
    "preprocess",
    "write_json_atomic",
]

INDEX_NAME = "index.json"
SUMMARY_NAME = "summary.json"
LOCK_NAME = ".preprocess.lock"
INDEX_FORMAT = "hfkit-preprocess-index/1"
MMCIF_SUFFIXES = (".cif", ".cif.gz", ".mmcif")
ALIGNMENT_SUFFIXES = (".a3m", ".sto")


def _file_stat(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """Write `obj` as JSON to `path` through a temp file, fsync and `os.replace`: never half-written."""
    path = Path(path)
    tmp = Path(f"{path}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def find_mmcifs(mmcif_dir: str | os.PathLike[str]) -> list[Path]:
    """The mmCIF files (`*.cif`, `*.cif.gz`, `*.mmcif`) directly in `mmcif_dir`, sorted by name."""
    d = Path(mmcif_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"mmcif_dir: {d} is not a directory")
    return sorted(p for p in d.iterdir() if p.is_file() and p.name.lower().endswith(MMCIF_SUFFIXES))


def mmcif_entry_id(path: str | os.PathLike[str]) -> str:
    """`2q2k` from `2Q2K.cif` / `2q2k.cif.gz`: OpenFold names chains after the file, lower-cased."""
    path = Path(path)
    name = path.name
    for suffix in MMCIF_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)].lower()
    return path.stem.lower()


def find_alignments(
    alignment_dir: str | os.PathLike[str] | None, chain_id: str
) -> tuple[Path | None, list[Path]]:
    """The folder `alignment_dir/<chain_id>` and its `.a3m`/`.sto` files (sorted), or (None, []).

    Files are read in name order, so the first a3m/sto by name supplies the query row kept first
    after deduplication; OpenFold's file names (bfd_uniclust_hits.a3m, mgnify_hits.sto,
    uniref90_hits.sto, ...) all hold the same query.
    """
    if alignment_dir is None:
        return None, []
    folder = Path(alignment_dir) / chain_id
    if not folder.is_dir():
        return None, []
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in ALIGNMENT_SUFFIXES)
    return folder, files


@dataclass
class ChainResult:
    """One chain's outcome: its encoded record (`payload`) and index metadata, an `error`, or `skipped`."""

    chain_id: str
    payload: bytes | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    failed_input: str | None = None
    skipped: bool = False
    warnings: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class MmcifResult:
    """One mmCIF's outcome: its chains, or an `error` (unparsable file) that fails them all."""

    mmcif_path: str
    entry_id: str
    stat: dict[str, int]
    chains: list[ChainResult] = field(default_factory=list)
    error: str | None = None


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def chain_raw_features(
    structure: Any,
    chain_name: str,
    chain_id: str,
    alignment_dir: str | os.PathLike[str] | None,
    max_msa_depth: int | None = None,
    timings: dict[str, float] | None = None,
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Raw features of chain `chain_name` of `structure`, with its alignments; returns (features, warnings).

    `structure` is an `hfkit.data.mmcif.Structure`; its alignments are every `.a3m`/`.sto` in
    `alignment_dir/<chain_id>/` (each cut to its first `max_msa_depth` rows when given). A chain
    without that folder or files gets its sequence as the only MSA row and a warning. The features are
    `make_raw_features`' arrays plus `chain_id`, `pdb_id`, `release_date` and `method` as 0-d str
    arrays. Raises `ParseError`/`OSError` for a bad alignment file (naming it) and `ValueError` when
    an alignment does not match the chain. `timings`, if given, receives `read_msas` and `features`
    (seconds).
    """
    from hfkit.data.features import make_raw_features
    from hfkit.data.parsers import read_msa

    chain = structure.chains.get(chain_name)
    if chain is None:
        raise ValueError(
            f"{chain_id}: no protein chain {chain_name!r} in {structure.pdb_id} "
            f"(chains: {', '.join(structure.chains) or 'none'})"
        )
    warnings: list[str] = []
    t0 = time.perf_counter()
    folder, files = find_alignments(alignment_dir, chain_id)
    if folder is None:
        where = Path(alignment_dir) / chain_id if alignment_dir is not None else "(no alignment dir)"
        warnings.append(f"no alignment folder {where}: single-sequence MSA")
    elif not files:
        warnings.append(f"no .a3m/.sto files in {folder}: single-sequence MSA")
    msas = [read_msa(path) for path in files]
    if max_msa_depth is not None:
        msas = [msa.truncate(max_msa_depth) for msa in msas]
    t1 = time.perf_counter()
    try:
        features = make_raw_features(
            chain.sequence,
            msas,
            chain=chain,
            resolution=float(structure.resolution or 0.0),
            description=chain_id,
        )
    except ValueError as err:  # name the inputs: the error itself only knows shapes
        raise ValueError(f"{folder or chain_id}: {err}") from err
    features["chain_id"] = np.array(chain_id)
    features["pdb_id"] = np.array(str(structure.pdb_id))
    features["release_date"] = np.array(str(structure.release_date or ""))
    features["method"] = np.array(str(structure.method or ""))
    if timings is not None:
        timings["read_msas"] = t1 - t0
        timings["features"] = time.perf_counter() - t1
    return features, warnings


def featurize_chain(
    structure: Any,
    chain_name: str,
    chain_id: str,
    alignment_dir: str | os.PathLike[str] | None,
    max_msa_depth: int | None = None,
) -> ChainResult:
    """`chain_raw_features` encoded as a record payload, with index metadata; errors are returned.

    Any failure (a malformed or unreadable alignment, an MSA that does not match the chain) comes
    back as `error` with `failed_input` naming the file where known, instead of being raised, so
    that one bad input does not stop a preprocessing run. A bad alignment fails the whole chain
    rather than letting it train on a partial MSA.
    """
    result = ChainResult(chain_id=chain_id)
    timings: dict[str, float] = {}
    try:
        features, result.warnings = chain_raw_features(
            structure, chain_name, chain_id, alignment_dir, max_msa_depth, timings
        )
    except Exception as err:  # ParseError, OSError, ValueError: report, go on with other chains
        path = getattr(err, "path", None) or getattr(err, "filename", None)
        result.error = _describe(err)
        result.failed_input = str(path) if path else chain_id
        return result
    t0 = time.perf_counter()
    result.payload = encode_sample(features)
    result.timings = {**timings, "encode": time.perf_counter() - t0}
    _, files = find_alignments(alignment_dir, chain_id)
    resolution = float(features["resolution"]) if "resolution" in features else 0.0
    result.meta = {
        "seq_length": int(features["seq_length"]),
        "msa_depth": int(features["num_alignments"]),
        "resolution": resolution,
        "release_date": str(features["release_date"]),
        "nbytes": len(result.payload),
        "alignments": {str(p): _file_stat(p) for p in files},
    }
    return result


def featurize_mmcif(
    mmcif_path: str | os.PathLike[str],
    alignment_dir: str | os.PathLike[str] | None,
    max_msa_depth: int | None = None,
    skip: frozenset[str] = frozenset(),
) -> MmcifResult:
    """Parse one mmCIF and featurize each of its protein chains (named `<entry id>_<author chain>`).

    The entry id is the file name's stem in lower case, as OpenFold names alignment folders. Chains
    in `skip` (already done) come back with `skipped` set. Runs in a pool worker, so nothing is
    raised for bad inputs: an unparsable mmCIF comes back with `error` set, a chain with bad
    alignments with that chain's `error` set.
    """
    from hfkit.data.mmcif import parse_mmcif

    path = Path(mmcif_path)
    entry = mmcif_entry_id(path)
    try:
        stat = _file_stat(path)
    except OSError as err:
        return MmcifResult(str(path), entry, {}, error=_describe(err))
    result = MmcifResult(str(path), entry, stat)
    t0 = time.perf_counter()
    try:
        structure = parse_mmcif(path)
    except Exception as err:  # ParseError, OSError, anything a broken file provokes
        result.error = _describe(err)
        return result
    parse_s = (time.perf_counter() - t0) / max(len(structure.chains), 1)
    for chain_name in structure.chains:
        chain_id = f"{entry}_{chain_name}"
        if chain_id in skip:
            result.chains.append(ChainResult(chain_id, skipped=True))
            continue
        chain_result = featurize_chain(structure, chain_name, chain_id, alignment_dir, max_msa_depth)
        chain_result.timings["parse_mmcif"] = parse_s
        chain_result.meta.update(mmcif=str(path), mmcif_stat=stat)
        result.chains.append(chain_result)
    return result


def load_index(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The index of a preprocessed folder (`index.json`), or an empty one when there is none yet.

    Raises `FileNotFoundError`/`ValueError` naming `out_dir` when it is missing or a file.

    Keys: `files` (record file name → num_samples, nbytes), `chains` (chain id → file, index,
    seq_length, msa_depth, resolution, release_date, nbytes, mmcif, mmcif_stat, alignments
    {path: {size, mtime_ns}}), `mmcifs` (path → stat and the chain ids found in it).
    """
    folder = Path(out_dir)
    if not folder.is_dir():
        if folder.exists():
            raise ValueError(f"out_dir: {folder} is a file, expected a preprocessed folder")
        raise FileNotFoundError(f"out_dir: {folder} does not exist, expected a preprocessed folder")
    path = folder / INDEX_NAME
    if not path.exists():
        return {"format": INDEX_FORMAT, "files": {}, "chains": {}, "mmcifs": {}}
    with open(path) as f:
        index = json.load(f)
    if index.get("format") != INDEX_FORMAT:
        raise ValueError(f"{path}: format {index.get('format')!r}, expected {INDEX_FORMAT!r}")
    return index


def _chain_done(index: dict[str, Any], out: Path, chain_id: str, alignment_dir: str | None) -> bool:
    """True when `chain_id` is in a record file of the index and none of its sources changed."""
    entry = index["chains"].get(chain_id)
    if entry is None or entry["file"] not in index["files"] or not (out / entry["file"]).exists():
        return False
    mmcif = Path(entry["mmcif"])
    if not mmcif.exists() or _file_stat(mmcif) != entry["mmcif_stat"]:
        return False
    _, files = find_alignments(alignment_dir, chain_id)
    try:
        return {str(p): _file_stat(p) for p in files} == entry["alignments"]
    except OSError:
        return False


@dataclass
class PreprocessSummary:
    """What a `preprocess` run did; `ok` is False when any input failed."""

    out_dir: str
    written: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failed: list[dict[str, str]] = field(default_factory=list)
    warnings: list[dict[str, str]] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    elapsed_s: float = 0.0
    workers: int = 0
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return not self.failed and not self.interrupted

    def table(self) -> str:
        """A printable table: counts, then one line per failure and warning."""
        rows = [
            ("chains written", str(len(self.written))),
            ("chains skipped (already done)", str(len(self.skipped))),
            ("inputs failed", str(len(self.failed))),
            ("warnings", str(len(self.warnings))),
            ("record files written", str(len(self.files))),
            ("elapsed", f"{self.elapsed_s:.2f} s ({self.workers} workers)"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}}  {v}" for k, v in rows]
        if self.interrupted:
            lines.append("INTERRUPTED: rerun the same command to resume")
        lines.extend(f"note     {n}" for n in self.notices)
        for f in self.failed:
            lines.append(f"FAILED   {f['chain_id'] or '-'}  {f['input']}\n         {f['error']}")
        for w in self.warnings:
            lines.append(f"warning  {w['chain_id']}  {w['warning']}")
        return "\n".join(lines)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>: signal this process when its parent dies


@dataclass(frozen=True)
class _HeldLock:
    """The output folder's lock as this run holds it: the open file's descriptor and identity (device,
    inode), and the pid that a previous run left in it when it died holding it (None after a clean run)."""

    fd: int
    dev: int
    ino: int
    previous_holder: str | None


def _init_worker(parent_pid: int, lock: _HeldLock | None) -> None:
    """Set up a pool worker: ignore Ctrl-C, let go of the parent's output lock, die with the parent.

    Ctrl-C reaches the whole process group; only the parent acts on it (aborts the open record file,
    cancels queued work) while workers finish their current mmCIF quietly. A forked worker inherits
    the parent's open files, the locked one among them, and an flock lasts while any process has its
    file open: the worker closes its copy, so that a killed parent's lock dies with the parent. A
    worker blocked on the task queue would outlive a killed parent (its siblings keep the queue
    open), so the kernel is asked to SIGKILL it when the parent dies (Linux), and a watchdog thread
    exits it once its parent pid changes (everywhere, and for a parent that died before the prctl).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if lock is not None:
        with contextlib.suppress(OSError):
            st = os.fstat(lock.fd)
            if (st.st_dev, st.st_ino) == (lock.dev, lock.ino):  # the lock file, not a reused number
                os.close(lock.fd)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    threading.Thread(
        target=_exit_when_orphaned, args=(parent_pid,), name="hfkit-parent-watchdog", daemon=True
    ).start()


def _exit_when_orphaned(parent_pid: int, interval_s: float = 0.5) -> None:
    """Exit this process (without cleanup: it only computes) as soon as its parent is not `parent_pid`."""
    while os.getppid() == parent_pid:
        time.sleep(interval_s)
    os._exit(1)


def _results(
    fn: Callable[..., MmcifResult], tasks: list[tuple[Any, ...]], workers: int, lock: _HeldLock | None = None
) -> Iterator[MmcifResult]:
    """`fn(*task)` for each task, in order; in a pool of `workers` processes when > 1.

    Workers close their inherited copy of `lock` and die with this process (see `_init_worker`).
    A bounded window of submitted tasks keeps results in input order (so the record files do not
    depend on the worker count) without holding every finished result in memory.
    """
    if workers <= 1:
        for task in tasks:
            yield fn(*task)
        return
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(os.getpid(), lock)) as pool:
        window: collections.deque[Future[MmcifResult]] = collections.deque()
        try:
            for task in tasks:
                window.append(pool.submit(fn, *task))
                if len(window) >= 4 * workers:
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()
        finally:  # interrupted (or the consumer stopped): start no more work
            pool.shutdown(wait=True, cancel_futures=True)


def preprocess(
    mmcif_dir: str | os.PathLike[str],
    alignment_dir: str | os.PathLike[str] | None,
    out_dir: str | os.PathLike[str],
    workers: int = 0,
    chains_per_file: int = 64,
    max_msa_depth: int | None = None,
    progress: bool = True,
) -> PreprocessSummary:
    """Featurize every protein chain of the mmCIFs in `mmcif_dir` into record files in `out_dir`.

    Chains are written `chains_per_file` to a record file (`records-NNNNN.ffr`, numbered after any
    already there); `index.json` is rewritten atomically after each completed file and
    `summary.json` at the end, also after an interrupt. `workers` > 1 featurizes in that many
    processes (0 or 1: in this process). Inputs that fail (an unparsable mmCIF, an unreadable or
    malformed alignment, an MSA that does not match its chain) are reported in the summary and the
    others still processed. Chains already in the index with unchanged sources are skipped (an
    mmCIF all of whose chains are done is not even parsed), so rerunning resumes an interrupted run.
    Raises `RuntimeError` when another run holds `out_dir` (an flock on `out_dir/.preprocess.lock`,
    deleted when the run ends; a killed run's is taken over, and its temp files are deleted).
    """
    if chains_per_file < 1:
        raise ValueError(f"chains_per_file: expected >= 1, got {chains_per_file}")
    if max_msa_depth is not None and max_msa_depth < 1:
        raise ValueError(f"max_msa_depth: expected None or >= 1, got {max_msa_depth}")
    if not Path(mmcif_dir).is_dir():
        raise FileNotFoundError(f"mmcif_dir: {mmcif_dir} is not a directory")
    if alignment_dir is not None and not Path(alignment_dir).is_dir():
        raise FileNotFoundError(f"alignment_dir: {alignment_dir} is not a directory")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir: {out} is a file, expected a folder for the records")
    out.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(out / LOCK_NAME) as lock:
        return _preprocess_locked(
            mmcif_dir, alignment_dir, out, workers, chains_per_file, max_msa_depth, progress, lock
        )


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[_HeldLock]:
    """Hold an exclusive flock on `path` (two runs writing one folder would number files alike).

    The file holds the holder's pid and is deleted when the holder is done. An flock dies with the
    processes that have its file open (the pool workers close theirs), so a killed run leaves the
    file unlocked, with its pid: the next run takes it over and reports that pid. The file is deleted
    while still locked; a run that opened it just before then finds, once it holds the lock, that
    `path` is no longer the file it locked, and locks the new one.
    """
    while True:
        f = open(path, "a+")  # noqa: SIM115 (closed below, or in the finally after the yield)
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            f.close()
            by = f" (pid {holder})" if holder else ""
            raise RuntimeError(
                f"{path.parent}: another hfkit preprocess{by} is writing there ({path} is locked)"
            ) from None
        held = os.fstat(f.fileno())
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is not None and (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
            break
        f.close()
    try:
        f.seek(0)
        previous = f.read().strip() or None
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield _HeldLock(f.fileno(), held.st_dev, held.st_ino, previous)
    finally:
        path.unlink(missing_ok=True)
        f.close()


# What `RecordWriter` and `write_json_atomic` write before renaming: `<name>.tmp-<pid>[.payloads]`.
_TEMP_NAME = re.compile(
    rf"(records-\d{{5}}{re.escape(RECORD_SUFFIX)}|{re.escape(INDEX_NAME)}|{re.escape(SUMMARY_NAME)})"
    r"\.tmp-\d+(\.payloads)?"
)


def _remove_temp_files(out: Path) -> tuple[int, int]:
    """Delete the temp files of runs that were killed in `out`; return (files, bytes) removed.

    Called with the folder's lock held, so no other run is writing any of them.
    """
    count = nbytes = 0
    for path in out.iterdir():
        if _TEMP_NAME.fullmatch(path.name) and path.is_file():
            with contextlib.suppress(FileNotFoundError):
                size = path.stat().st_size
                path.unlink()
                count, nbytes = count + 1, nbytes + size
    return count, nbytes


def _preprocess_locked(
    mmcif_dir: str | os.PathLike[str],
    alignment_dir: str | os.PathLike[str] | None,
    out: Path,
    workers: int,
    chains_per_file: int,
    max_msa_depth: int | None,
    progress: bool,
    lock: _HeldLock,
) -> PreprocessSummary:
    start = time.perf_counter()
    notices = []
    if lock.previous_holder is not None:
        notices.append(
            f"{out / LOCK_NAME}: took over from hfkit preprocess pid {lock.previous_holder}, "
            "which ended without releasing it (killed?)"
        )
    removed, removed_bytes = _remove_temp_files(out)
    if removed:
        notices.append(f"{out}: removed {removed} temp files ({removed_bytes:,} bytes) of an unfinished run")
    if progress:
        for notice in notices:
            print(f"hfkit preprocess: {notice}", file=sys.stderr)
    aln = None if alignment_dir is None else str(Path(alignment_dir).resolve())
    index = load_index(out)
    if index.get("max_msa_depth", max_msa_depth) != max_msa_depth:
        raise ValueError(
            f"max_msa_depth: {out} was made with {index['max_msa_depth']}, got {max_msa_depth}; "
            "use a new --out folder"
        )
    index.update(mmcif_dir=str(Path(mmcif_dir).resolve()), alignment_dir=aln, max_msa_depth=max_msa_depth)
    summary = PreprocessSummary(out_dir=str(out), workers=workers, notices=notices)

    tasks = []
    for mmcif in (m.resolve() for m in find_mmcifs(mmcif_dir)):
        known = index["mmcifs"].get(str(mmcif), {}).get("chains", [])
        done = frozenset(c for c in known if _chain_done(index, out, c, aln))
        if known and done == set(known):
            summary.skipped.extend(sorted(done))  # every chain done: not even parsed
        else:
            tasks.append((str(mmcif), aln, max_msa_depth, done))

    # Never overwrite a record file, not even an orphan that a crash left outside the index.
    numbers = [int(p.name[8:13]) for p in out.glob(f"records-[0-9][0-9][0-9][0-9][0-9]{RECORD_SUFFIX}")]
    next_number = max([*numbers, -1]) + 1
    writer: RecordWriter | None = None
    pending: list[ChainResult] = []  # the chains in the open writer

    def commit() -> None:
        """Close the open record file, then record it and its chains in the index (atomically)."""
        nonlocal writer
        if writer is None:
            return
        path = writer.close()
        index["files"][path.name] = {"num_samples": len(pending), "nbytes": path.stat().st_size}
        for i, chain in enumerate(pending):
            index["chains"][chain.chain_id] = {"file": path.name, "index": i, **chain.meta}
        summary.files.append(path.name)
        writer, pending[:] = None, []
        write_json_atomic(out / INDEX_NAME, index)

    def take(result: MmcifResult) -> None:
        """Record one mmCIF's chains: failures and warnings in the summary, payloads in the open file."""
        nonlocal writer, next_number
        if result.error is not None:
            summary.failed.append({"chain_id": "", "input": result.mmcif_path, "error": result.error})
            return
        index["mmcifs"][result.mmcif_path] = {
            "stat": result.stat,
            "chains": [c.chain_id for c in result.chains],
        }
        for chain in result.chains:
            summary.warnings.extend({"chain_id": chain.chain_id, "warning": w} for w in chain.warnings)
            if chain.skipped:
                summary.skipped.append(chain.chain_id)
                continue
            if chain.error is not None:
                summary.failed.append(
                    {"chain_id": chain.chain_id, "input": chain.failed_input or "", "error": chain.error}
                )
                continue
            if writer is None:
                writer = RecordWriter(out / f"records-{next_number:05d}{RECORD_SUFFIX}")
                next_number += 1
            assert chain.payload is not None
            writer.write_bytes(chain.payload)
            chain.payload = None  # on disk now: keep the parent's memory flat
            pending.append(chain)
            summary.written.append(chain.chain_id)
            summary.timings[chain.chain_id] = chain.timings
            if len(pending) >= chains_per_file:
                commit()

    bar = _progress_bar(len(tasks), progress)
    # Closed explicitly in `finally`: on an interrupt the pool stops now, not when the traceback dies.
    results = _results(featurize_mmcif, tasks, workers, lock)
    try:
        for result in results:
            take(result)
            # After the whole result: the bar's counts are the summary's at every step.
            bar.set_postfix(written=len(summary.written), failed=len(summary.failed), refresh=False)
            bar.update(1)
        commit()
        write_json_atomic(out / INDEX_NAME, index)
    except BaseException:
        # Interrupted or crashed: drop the half-filled record file; its chains are not in the index.
        summary.interrupted = True
        if writer is not None:
            writer.abort()
            dropped = {c.chain_id for c in pending}
            summary.written = [c for c in summary.written if c not in dropped]
        raise
    finally:
        results.close()
        bar.close()
        summary.elapsed_s = time.perf_counter() - start
        write_json_atomic(out / SUMMARY_NAME, {**asdict(summary), "ok": summary.ok})
    return summary


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_postfix(self, **kwargs: Any) -> None: ...
    def close(self) -> None: ...


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="preprocess", unit="mmcif", file=sys.stderr, dynamic_ncols=True)
