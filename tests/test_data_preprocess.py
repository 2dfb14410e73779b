"""Tests of `hfkit preprocess`, the datasets and the synthetic input generators (CPU, small inputs)."""

from __future__ import annotations

import fcntl
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import gemmi
import numpy as np
import pytest
import torch
from conftest import OPENFOLD_TEST_DATA, REAL_DATA_REASON, real_data

from hfkit.cli import main
from hfkit.data import preprocess as preprocess_module
from hfkit.data.dataset import (
    OnTheFlyDataset,
    PreprocessedDataset,
    collate_fixed,
    make_dataloader,
    profile_sample,
    tune_malloc,
)
from hfkit.data.mmcif import parse_mmcif
from hfkit.data.msa_sampling import FeatureConfig, feature_shapes
from hfkit.data.parsers import read_msa
from hfkit.data.preprocess import INDEX_NAME, SUMMARY_NAME, load_index, preprocess
from hfkit.data.records import RecordReader, RecordWriter, validate, validate_dir
from hfkit.data.synthetic import (
    synthetic_a3m,
    synthetic_mmcif,
    synthetic_sequence,
    write_synthetic_dataset,
)

# The real inputs' folder (None where absent: every test that reads it is skipped then).
DATA = OPENFOLD_TEST_DATA
needs_data = pytest.mark.skipif(
    OPENFOLD_TEST_DATA is None or not (OPENFOLD_TEST_DATA / "mmcifs" / "2q2k.cif").exists(),
    reason=REAL_DATA_REASON,
)


def _run(mmcif_dir: Path, alignment_dir: Path, out: Path, *extra: str) -> int:
    return main(
        [
            "preprocess",
            "--mmcif-dir",
            str(mmcif_dir),
            "--alignment-dir",
            str(alignment_dir),
            "--out",
            str(out),
            "--no-progress",
            *extra,
        ]
    )


def _summary(out: Path) -> dict:
    return json.loads((out / SUMMARY_NAME).read_text())


def _no_temp_files(folder: Path) -> bool:
    return not any(".tmp-" in p.name for p in folder.iterdir())


@pytest.fixture
def small_inputs(tmp_path: Path) -> tuple[Path, Path]:
    """2q2k (two chains with alignments) and 3zee (one chain without), linked into tmp_path."""
    mmcifs, alignments = tmp_path / "mmcifs", tmp_path / "alignments"
    mmcifs.mkdir()
    alignments.mkdir()
    for name in ("2q2k.cif", "3zee.cif"):
        (mmcifs / name).symlink_to(DATA / "mmcifs" / name)
    for chain in ("2q2k_A", "2q2k_B"):
        folder = alignments / chain
        folder.mkdir()
        for src in sorted((DATA / "alignments" / chain).iterdir()):
            (folder / src.name).symlink_to(src)
    return mmcifs, alignments


# --------------------------------------------------------------------------------------------------
# preprocess on real inputs
# --------------------------------------------------------------------------------------------------


@needs_data
@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_real_inputs(tmp_path: Path, workers: int, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / f"out{workers}"
    rc = _run(DATA / "mmcifs", DATA / "alignments", out, "--workers", str(workers), "--chains-per-file", "3")
    assert rc == 0
    reports = validate_dir(out)
    assert reports and all(r.ok for r in reports)
    index = load_index(out)
    assert set(index["chains"]) >= {"2q2k_A", "2q2k_B"}
    for chain_id in ("2q2k_A", "2q2k_B"):
        entry = index["chains"][chain_id]
        assert entry["seq_length"] == 70 and entry["msa_depth"] > 1 and entry["resolution"] == 3.0
        assert len(entry["alignments"]) == 4  # 1 a3m + 3 sto
        record = RecordReader(out / entry["file"])[entry["index"]]
        assert str(record["chain_id"]) == chain_id
        assert record["msa"].shape == (entry["msa_depth"], 70)
        assert record["all_atom_positions"].shape == (70, 37, 3)
    # Chains without an alignment folder are featurized from their sequence alone, and reported.
    summary = _summary(out)
    assert summary["ok"] and not summary["failed"]
    no_msa = {w["chain_id"] for w in summary["warnings"]}
    assert "3zee_A" in no_msa and "2q2k_A" not in no_msa
    assert index["chains"]["3zee_A"]["msa_depth"] == 1
    assert all(index["files"][f]["num_samples"] <= 3 for f in index["files"])
    assert "chains written" in capsys.readouterr().out


@needs_data
def test_preprocess_same_output_for_any_worker_count(tmp_path: Path) -> None:
    for workers in (0, 2):
        assert (
            _run(DATA / "mmcifs", DATA / "alignments", tmp_path / f"w{workers}", "--workers", str(workers))
            == 0
        )
    placement = [
        {c: (e["file"], e["index"]) for c, e in load_index(tmp_path / f"w{w}")["chains"].items()}
        for w in (0, 2)
    ]
    assert placement[0] == placement[1]


@needs_data
def test_rerun_skips_done_chains(small_inputs: tuple[Path, Path], tmp_path: Path) -> None:
    mmcifs, alignments = small_inputs
    out = tmp_path / "out"
    assert _run(mmcifs, alignments, out, "--workers", "1") == 0
    first = _summary(out)
    assert sorted(first["written"]) == ["2q2k_A", "2q2k_B", "3zee_A"]
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("*.ffr")}

    assert _run(mmcifs, alignments, out, "--workers", "1") == 0
    second = _summary(out)
    assert second["written"] == [] and sorted(second["skipped"]) == ["2q2k_A", "2q2k_B", "3zee_A"]
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.ffr")} == stamps

    # A changed source makes its chain stale: only that chain is redone.
    (alignments / "2q2k_B" / "uniprot_hits.sto").unlink()
    assert _run(mmcifs, alignments, out, "--workers", "1") == 0
    third = _summary(out)
    assert third["written"] == ["2q2k_B"] and sorted(third["skipped"]) == ["2q2k_A", "3zee_A"]
    assert len(load_index(out)["chains"]["2q2k_B"]["alignments"]) == 3


@needs_data
def test_broken_inputs_are_reported_and_the_rest_processed(
    small_inputs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mmcifs, alignments = small_inputs
    # A truncated mmCIF (cut before its atoms) and a garbage Stockholm file next to real ones.
    text = (DATA / "mmcifs" / "4i6p.cif").read_text()
    (mmcifs / "4i6p.cif").write_text(text[: text.index("_atom_site.")])
    garbage = alignments / "2q2k_A" / "zzz_hits.sto"
    garbage.write_text("# STOCKHOLM 1.0\nthis is not an alignment\n//\n")
    out = tmp_path / "out"
    assert _run(mmcifs, alignments, out, "--workers", "2") == 1

    summary = _summary(out)
    assert not summary["ok"]
    failed = {f["input"]: f for f in summary["failed"]}
    assert str((mmcifs / "4i6p.cif").resolve()) in failed
    assert failed[str(garbage)]["chain_id"] == "2q2k_A"
    assert "ParseError" in failed[str(garbage)]["error"]
    assert sorted(summary["written"]) == ["2q2k_B", "3zee_A"]
    printed = capsys.readouterr().out
    assert "FAILED" in printed and "zzz_hits.sto" in printed and "4i6p.cif" in printed
    assert all(r.ok for r in validate_dir(out))
    assert set(load_index(out)["chains"]) == {"2q2k_B", "3zee_A"}

    # Fixing the input and rerunning does the failed chain only.
    garbage.unlink()
    assert _run(mmcifs, alignments, out, "--workers", "2") == 1  # 4i6p.cif is still broken
    summary = _summary(out)
    assert summary["written"] == ["2q2k_A"] and sorted(summary["skipped"]) == ["2q2k_B", "3zee_A"]


class _Interrupt(KeyboardInterrupt):
    pass


@needs_data
def test_interrupted_run_leaves_no_partial_file_and_resumes(
    small_inputs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mmcifs, alignments = small_inputs
    out = tmp_path / "out"
    calls = {"n": 0}
    original = RecordWriter.write_bytes

    def write_then_interrupt(self: RecordWriter, payload: bytes) -> int:
        calls["n"] += 1
        if calls["n"] == 3:  # the first chain of the second record file
            raise _Interrupt()
        return original(self, payload)

    monkeypatch.setattr(RecordWriter, "write_bytes", write_then_interrupt)
    with pytest.raises(_Interrupt):
        preprocess(mmcifs, alignments, out, workers=0, chains_per_file=2, progress=False)
    assert _no_temp_files(out)
    assert sorted(p.name for p in out.glob("*.ffr")) == ["records-00000.ffr"]  # the complete one
    index = load_index(out)
    assert set(index["chains"]) == {"2q2k_A", "2q2k_B"} and validate(out / "records-00000.ffr").ok
    assert _summary(out)["interrupted"]

    monkeypatch.setattr(RecordWriter, "write_bytes", original)
    summary = preprocess(mmcifs, alignments, out, workers=0, chains_per_file=2, progress=False)
    assert summary.ok and summary.written == ["3zee_A"] and sorted(summary.skipped) == ["2q2k_A", "2q2k_B"]
    assert set(load_index(out)["chains"]) == {"2q2k_A", "2q2k_B", "3zee_A"}


def test_cli_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        ["preprocess", "--mmcif-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "o"), "--workers", "0"]
    )
    assert rc == 2 and "nope" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_concurrent_run_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "m").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    argv = ["preprocess", "--mmcif-dir", str(tmp_path / "m"), "--out", str(out), "--no-progress"]
    with open(out / ".preprocess.lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # as a running preprocess holds it
        assert main(argv) == 2
    assert "another hfkit preprocess" in capsys.readouterr().err
    assert main(argv) == 0


# --------------------------------------------------------------------------------------------------
# datasets
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def preprocessed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = real_data("mmcifs", "2q2k.cif").parents[1]
    out = tmp_path_factory.mktemp("records")
    preprocess(data / "mmcifs", data / "alignments", out, workers=0, chains_per_file=3, progress=False)
    return out


def _check_batch(batch: dict[str, torch.Tensor], config: FeatureConfig, batch_size: int) -> None:
    for key, shape in feature_shapes(config).items():
        assert tuple(batch[key].shape) == (batch_size, *shape), key


@needs_data
@pytest.mark.parametrize("workers", [0, 2])
def test_datasets_through_dataloader(preprocessed: Path, workers: int) -> None:
    config = FeatureConfig.tiny()
    on_the_fly = OnTheFlyDataset(DATA / "mmcifs", DATA / "alignments", config, seed=1)
    assert on_the_fly.chain_ids == ["2q2k_A", "2q2k_B"]  # the chains with alignment folders
    from_records = PreprocessedDataset(preprocessed, config, seed=1)
    assert len(from_records) == len(load_index(preprocessed)["chains"])
    for ds in (on_the_fly, from_records):
        loader = make_dataloader(ds, batch_size=2, workers=workers, drop_last=True)
        batches = list(loader)
        assert len(batches) == len(ds) // 2
        for batch in batches:
            _check_batch(batch, config, 2)


@needs_data
def test_preprocessed_equals_on_the_fly(preprocessed: Path) -> None:
    """A record holds exactly what on-the-fly featurization builds, so the samples are identical."""
    config = FeatureConfig.tiny()
    on_the_fly = OnTheFlyDataset(DATA / "mmcifs", DATA / "alignments", config, seed=7)
    from_records = PreprocessedDataset(preprocessed, config, seed=7)
    assert from_records.chain_ids is not None
    for i, chain_id in enumerate(on_the_fly.chain_ids):
        j = from_records.chain_ids.index(chain_id)
        assert i == j  # both list 2q2k_A, 2q2k_B first
        a, b = on_the_fly[i], from_records[j]
        assert set(a) == set(b)
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


@needs_data
def test_epoch_changes_samples_in_persistent_workers(preprocessed: Path) -> None:
    ds = PreprocessedDataset(preprocessed, FeatureConfig.tiny(), seed=0)
    loader = make_dataloader(ds, batch_size=1, workers=2, persistent_workers=True)
    ds.set_epoch(0)
    epoch0 = [b["msa_feat"] for b in loader]
    ds.set_epoch(1)
    epoch1 = [b["msa_feat"] for b in loader]
    ds.set_epoch(0)
    again = [b["msa_feat"] for b in loader]
    assert all(torch.equal(a, b) for a, b in zip(epoch0, again, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(epoch0, epoch1, strict=True))


@needs_data
def test_timings_and_profile(preprocessed: Path) -> None:
    config = FeatureConfig.tiny()
    ds = PreprocessedDataset(preprocessed, config, timings=True)
    sample = ds[0]
    assert {"time.read", "time.decode", "time.process_features"} <= set(sample)
    batch = collate_fixed([ds[0], ds[1]])
    assert batch["time.read"].shape == (2,)
    stages = profile_sample(ds, 0, repeats=2)
    assert {"read", "decode", "crop", "process_features", "total"} <= set(stages)
    stages = profile_sample(OnTheFlyDataset(DATA / "mmcifs", DATA / "alignments", config), 0, repeats=1)
    assert {"parse_mmcif", "read_msas", "features", "crop", "process_features"} <= set(stages)
    assert all(v >= 0 for v in stages.values())


class _MallocProbe(torch.utils.data.Dataset):
    """Calls tune_malloc where the sample is made (in a loader worker) and returns what it said."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"applied": torch.tensor(tune_malloc())}


def test_tune_malloc_arguments_and_in_a_worker() -> None:
    """Bad thresholds raise naming the argument; in a loader worker it applies (glibc) or says not."""
    with pytest.raises(ValueError, match="mmap_threshold"):
        tune_malloc(mmap_threshold=64 * 2**20)
    with pytest.raises(ValueError, match="trim_threshold"):
        tune_malloc(trim_threshold=-1)
    batch = next(iter(make_dataloader(_MallocProbe(), workers=1)))
    applied = bool(batch["applied"][0])
    assert applied == (platform.libc_ver()[0] == "glibc")


def test_collate_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="'x'"):
        collate_fixed([{"x": torch.zeros(3)}, {"x": torch.zeros(4)}])
    with pytest.raises(ValueError, match="keys"):
        collate_fixed([{"x": torch.zeros(3)}, {"y": torch.zeros(3)}])


# --------------------------------------------------------------------------------------------------
# synthetic inputs
# --------------------------------------------------------------------------------------------------


def test_synthetic_a3m_parses_with_requested_size(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    query = synthetic_sequence(120, rng)
    assert len(query) == 120 and query.isupper()
    text = synthetic_a3m(query, 300, rng, insertion_rate=0.05, gap_rate=0.1, identity=0.5)
    path = tmp_path / "hits.a3m"
    path.write_text(text)
    msa = read_msa(path)
    assert msa.depth == 300 and msa.length == 120
    assert msa.sequences[0] == query
    assert msa.deletion_matrix.sum() > 0  # lower-case insertions were counted
    assert all("synthetic" in d for d in msa.descriptions)
    assert any(ch.islower() for ch in text) and "-" in text


def test_synthetic_mmcif_parses_with_gemmi_and_hfkit(tmp_path: Path) -> None:
    text = synthetic_mmcif(150, np.random.default_rng(3), pdb_id="syn7", chain_id="B")
    assert text.startswith("#") and "synthetic" in text.splitlines()[0]
    path = tmp_path / "syn7.cif"
    path.write_text(text)
    structure = gemmi.read_structure(str(path))
    assert len(structure[0]["B"]) == 150
    parsed = parse_mmcif(path)
    chain = parsed.chains["B"]
    assert len(chain.sequence) == 150 and parsed.resolution == 2.0
    ca = chain.atom_positions[:, 1]
    steps = np.linalg.norm(np.diff(ca, axis=0), axis=1)
    np.testing.assert_allclose(steps, 3.8, atol=0.01)  # CA-CA of a trans peptide
    # Backbone atoms all present; CB for all but glycine.
    assert (chain.atom_mask[:, [0, 1, 2, 4]] == 1).all()
    assert (chain.atom_mask[:, 3] == np.array([c != "G" for c in chain.sequence])).all()


def test_synthetic_generators_are_deterministic() -> None:
    def make(seed: int) -> tuple[str, str]:
        rng = np.random.default_rng(seed)
        q = synthetic_sequence(50, rng)
        return synthetic_a3m(q, 20, rng), synthetic_mmcif(50, rng, sequence=q)

    assert make(5) == make(5)
    assert make(5) != make(6)
    assert synthetic_sequence(30, 11) == synthetic_sequence(30, 11)


def test_synthetic_dataset_preprocesses(tmp_path: Path) -> None:
    src = tmp_path / "synthetic"
    ids = write_synthetic_dataset(src, n_chains=3, length=(40, 70), depth=30, seed=2)
    assert ids == ["syn00000_A", "syn00001_A", "syn00002_A"]
    assert "synthetic" in (src / "SYNTHETIC.md").read_text()
    again = tmp_path / "again"
    write_synthetic_dataset(again, n_chains=3, length=(40, 70), depth=30, seed=2)
    for rel in ("mmcifs/syn00001.cif", "alignments/syn00001_A/bfd_uniclust_hits.a3m"):
        assert (src / rel).read_bytes() == (again / rel).read_bytes()

    out = tmp_path / "out"
    summary = preprocess(src / "mmcifs", src / "alignments", out, workers=0, progress=False)
    assert summary.ok and sorted(summary.written) == ids and not summary.warnings
    index = load_index(out)
    for chain_id in ids:
        entry = index["chains"][chain_id]
        assert 40 <= entry["seq_length"] <= 70 and entry["msa_depth"] <= 30
    config = FeatureConfig.tiny()
    batch = next(iter(make_dataloader(PreprocessedDataset(out, config), batch_size=3)))
    _check_batch(batch, config, 3)


def test_preprocess_empty_folder(tmp_path: Path) -> None:
    """An empty mmCIF folder gives an empty, valid index; no temp files."""
    (tmp_path / "m").mkdir()
    summary = preprocess(tmp_path / "m", None, tmp_path / "out", progress=False)
    assert summary.ok and summary.written == []
    assert (tmp_path / "out" / INDEX_NAME).exists() and _no_temp_files(tmp_path / "out")
    assert preprocess_module.mmcif_entry_id("X/2Q2K.cif.gz") == "2q2k"


def test_progress_bar_counts_agree_with_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every failure (an unparsable mmCIF as much as a bad chain) is counted on the bar as in the summary;
    a finished run leaves only its outputs behind (no lock file, no temp files)."""
    src = tmp_path / "synthetic"
    write_synthetic_dataset(src, n_chains=2, length=30, depth=5, seed=4)
    for name in ("zz0.cif", "zz1.cif", "zz2.cif"):  # sorted last: failures end the run
        (src / "mmcifs" / name).write_text("data_broken\n_this.is not an mmCIF\n")
    (src / "alignments" / "syn00001_A" / "zzz_hits.sto").write_text("# STOCKHOLM 1.0\nnot an alignment\n//\n")
    out = tmp_path / "out"
    summary = preprocess(src / "mmcifs", src / "alignments", out, workers=0, progress=True)
    assert len(summary.failed) == 4 and summary.written == ["syn00000_A"]
    bar = capsys.readouterr().err
    assert "failed=4" in bar and "written=1" in bar
    assert sorted(p.name for p in out.iterdir()) == [INDEX_NAME, "records-00000.ffr", SUMMARY_NAME]


def _child_pids(pid: int) -> list[int]:
    """The pids whose parent is `pid` (from /proc)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (a dead process not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process state from Linux /proc")
def test_killed_run_takes_its_workers_and_lock_along(tmp_path: Path) -> None:
    """SIGKILL to `hfkit preprocess --workers 2` mid-file: its workers die too, the folder is not left
    locked, and the rerun takes over at once, deletes the killed run's temp files and completes."""
    src = tmp_path / "synthetic"
    ids = write_synthetic_dataset(src, n_chains=60, length=(180, 220), depth=300, seed=9)
    out = tmp_path / "out"
    args = ["preprocess", "--mmcif-dir", str(src / "mmcifs"), "--alignment-dir", str(src / "alignments")]
    args += ["--out", str(out), "--workers", "2", "--chains-per-file", "8", "--no-progress"]
    repo = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.Popen([sys.executable, "-m", "hfkit", *args], env=env, stdout=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        # Mid-run: a record file is open (its temp file exists) and the workers are busy.
        while not (out.is_dir() and any(".tmp-" in p.name for p in out.iterdir())):
            assert run.poll() is None and time.monotonic() < deadline, "the run ended before it was killed"
            time.sleep(0.02)
        workers = _child_pids(run.pid)
        assert len(workers) == 2
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_running(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_running(w) for w in workers), "pool workers outlived their killed parent"
        assert any(".tmp-" in p.name for p in out.iterdir())  # what the rerun must clean up

        summary = preprocess(
            src / "mmcifs", src / "alignments", out, workers=2, chains_per_file=8, progress=False
        )
        assert summary.ok and sorted(summary.written + summary.skipped) == ids
        assert any(f"pid {run.pid}" in n for n in summary.notices)  # the dead run's lock, taken over
        assert any("temp files" in n for n in summary.notices)
        assert _no_temp_files(out) and not (out / ".preprocess.lock").exists()
        assert all(r.ok for r in validate_dir(out))
        assert set(load_index(out)["chains"]) == set(ids)
    finally:
        for pid in [run.pid, *workers]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_wrong_kinds_of_path_name_the_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file where a folder is expected (and a missing folder) is an argument error naming the argument,
    not a traceback or a silently empty result."""
    src = tmp_path / "synthetic"
    write_synthetic_dataset(src, n_chains=1, length=20, depth=3)
    a_file = src / "SYNTHETIC.md"
    argv = ["preprocess", "--mmcif-dir", str(src / "mmcifs"), "--out", str(a_file), "--no-progress"]
    assert main(argv) == 2 and "out_dir" in capsys.readouterr().err
    with pytest.raises(ValueError, match="out_dir: .* is a file"):
        load_index(a_file)
    with pytest.raises(FileNotFoundError, match="out_dir: .* does not exist"):
        load_index(tmp_path / "nope")
    with pytest.raises(ValueError, match="out_dir: .* is a file"):
        write_synthetic_dataset(a_file, n_chains=1, length=20, depth=3)
    out = tmp_path / "out"
    preprocess(src / "mmcifs", src / "alignments", out, workers=0, progress=False)
    with pytest.raises(ValueError, match="records: .*index.json is not a record file"):
        PreprocessedDataset(out / INDEX_NAME, FeatureConfig.tiny())
    assert len(PreprocessedDataset(out / "records-00000.ffr", FeatureConfig.tiny())) == 1
    with pytest.raises(FileNotFoundError, match="alignment_dir: .* is not a directory"):
        OnTheFlyDataset(src / "mmcifs", a_file, FeatureConfig.tiny(), chain_ids=["syn00000_A"])
