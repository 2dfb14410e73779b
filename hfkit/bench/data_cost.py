"""Data-pipeline cost: on-the-fly featurization against preprocessed records, per stage, on one core.

For each MSA depth, synthetic inputs at AlphaFold training size are written (labelled synthetic in
every row), preprocessed into record files, and one sample is then made both ways with
`hfkit.data.dataset.profile_sample`: on the fly (parse the mmCIF and MSAs, build raw features, sample,
cluster, crop and pad) and preprocessed (read and decode a record, then sample, cluster, crop, pad).
The real OpenFold test inputs are measured the same way when their folder is given. Times are
wall-clock seconds on one CPU thread (`torch.set_num_threads(1)`), with the malloc settings of a
DataLoader worker (`hfkit.data.dataset.tune_malloc`; rows record it as `extra["malloc"]`).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hfkit.bench.results import ResultRow, make_row, row_environment
from hfkit.bench.timing import Timing

__all__ = [
    "DEFAULT_DEPTHS",
    "Inputs",
    "data_cost_table",
    "real_inputs",
    "run_data_cost_benchmark",
    "synthetic_inputs",
]

DEFAULT_DEPTHS: tuple[int, ...] = (1000, 5000, 20000)


@dataclass(frozen=True)
class Inputs:
    """mmCIF and alignment folders in OpenFold's layout, and the record folder preprocessed from them."""

    mmcifs: Path
    alignments: Path
    records: Path
    preprocess_s: float  # wall time `hfkit preprocess` took for them (one process)

    def datasets(self, config: Any, seed: int = 0) -> tuple[Any, Any]:
        """(OnTheFlyDataset, PreprocessedDataset) over these inputs with `config`."""
        from hfkit.data.dataset import OnTheFlyDataset, PreprocessedDataset

        return (
            OnTheFlyDataset(self.mmcifs, self.alignments, config, seed=seed),
            PreprocessedDataset(self.records, config, seed=seed),
        )


def _preprocessed(mmcifs: Path, alignments: Path, records: Path, progress: bool) -> Inputs:
    from hfkit.data.preprocess import preprocess

    t0 = time.perf_counter()
    summary = preprocess(mmcifs, alignments, records, workers=0, progress=progress)
    if not summary.ok:
        raise RuntimeError(f"preprocess failed on {mmcifs}:\n{summary.table()}")
    return Inputs(mmcifs, alignments, records, time.perf_counter() - t0)


def synthetic_inputs(
    root: str | Path,
    n_chains: int,
    length: int | tuple[int, int],
    depth: int,
    seed: int = 0,
    progress: bool = False,
) -> Inputs:
    """Write `n_chains` synthetic chains (`length` residues, or a (low, high) range; `depth` MSA rows)
    under `root` and preprocess them into `root/records`. Results from them are labelled synthetic."""
    from hfkit.data.synthetic import write_synthetic_dataset

    root = Path(root)
    write_synthetic_dataset(root, n_chains, length, depth, seed=seed)
    return _preprocessed(root / "mmcifs", root / "alignments", root / "records", progress)


def real_inputs(real_dir: str | Path, root: str | Path, progress: bool = False) -> Inputs:
    """The OpenFold test data's entries that have alignments (2q2k), linked under `root` and preprocessed."""
    real, root = Path(real_dir), Path(root)
    mmcifs = root / "mmcifs"
    mmcifs.mkdir(parents=True)
    aligned = {p.name.split("_")[0].lower() for p in (real / "alignments").iterdir() if p.is_dir()}
    for cif in (real / "mmcifs").glob("*.cif"):
        if cif.stem.lower() in aligned:
            (mmcifs / cif.name).symlink_to(cif.resolve())
    return _preprocessed(mmcifs, real / "alignments", root / "records", progress)


def _rows_for(
    timings: Sequence[dict[str, float]],
    provider: str,
    shape: list[int],
    kind: str,
    env: dict[str, Any],
    extra: dict[str, Any],
) -> list[ResultRow]:
    return [
        make_row(
            env,
            Timing.from_samples([run[stage] * 1e3 for run in timings], "wall"),
            op="data_pipeline",
            provider=provider,
            mode=stage,
            shape=shape,
            dtype=kind,
            extra=extra,
        )  # fmt: skip
        for stage in timings[0]
    ]


def _profile(dataset: Any, repeats: int) -> list[dict[str, float]]:
    from hfkit.data.dataset import profile_sample

    return [profile_sample(dataset, i, repeats=repeats) for i in range(len(dataset))]


def run_data_cost_benchmark(
    depths: Sequence[int] = DEFAULT_DEPTHS,
    length: int = 384,
    n_chains: int = 2,
    config: Any = None,
    repeats: int = 3,
    real_dir: str | Path | None = None,
    workdir: str | Path | None = None,
    command: str | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> list[ResultRow]:
    """Per-stage cost (ms) of making one training sample on the fly and from records, on one core.

    depths: synthetic MSA depths; length: synthetic chain length (residues); config: a
    `FeatureConfig` (default `af2_initial`: crop 256, 128 clusters, 1024 extra rows). Each stage is
    a row (`provider` "on_the_fly" | "preprocessed" | "preprocess", or "preprocessed_kept_extra":
    only the kept extra rows vote into the cluster profiles; `mode` the stage,
    `shape` [length, depth], `dtype` "synthetic" or "real"); per-sample medians over `repeats` are
    summarised across the chains as p20/p50/p80. `real_dir` (OpenFold test data layout) adds rows
    for the real chains with alignments.
    """
    from hfkit.data.dataset import tune_malloc
    from hfkit.data.msa_sampling import FeatureConfig

    config = config or FeatureConfig.af2_initial()
    env = row_environment("cpu", command)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # Measure what a DataLoader worker does: one thread, and its malloc settings (freed sample
    # buffers reused rather than faulted in afresh; see tune_malloc). Permanent for this process.
    malloc = "tuned" if tune_malloc() else "default"
    rows: list[ResultRow] = []
    common = {
        "crop_size": config.crop_size,
        "max_msa_clusters": config.max_msa_clusters,
        "max_extra_msa": config.max_extra_msa,
        "threads": 1,
        "malloc": malloc,
    }
    try:
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            for depth in depths:
                log(f"depth {depth}: writing {n_chains} synthetic chains of {length} residues")
                inputs = synthetic_inputs(Path(tmp) / f"d{depth}", n_chains, length, depth, depth, progress)
                extra = {**common, "synthetic": True, "note": "synthetic inputs (hfkit.data.synthetic)"}
                per_chain = [{"preprocess_per_chain": inputs.preprocess_s / max(1, n_chains)}]
                rows += _rows_for(per_chain, "preprocess", [length, depth], "synthetic", env, extra)
                fly, pre = inputs.datasets(config)
                # The last: only the kept extra rows vote into the cluster profiles (not OpenFold's
                # semantics, cheaper for deep MSAs): what the faithful clustering costs.
                _, kept = inputs.datasets(replace(config, cluster_all_extra=False))
                for provider, dataset in (
                    ("on_the_fly", fly),
                    ("preprocessed", pre),
                    ("preprocessed_kept_extra", kept),
                ):
                    timings = _profile(dataset, repeats)
                    rows += _rows_for(timings, provider, [length, depth], "synthetic", env, extra)
                log(f"depth {depth}: done")
            if real_dir is not None and Path(real_dir).is_dir():
                rows += _real_rows(Path(real_dir), Path(tmp), config, repeats, env, common, progress)
    finally:
        torch.set_num_threads(threads)
    return rows


def _real_rows(
    real: Path,
    tmp: Path,
    config: Any,
    repeats: int,
    env: dict[str, Any],
    common: dict[str, Any],
    progress: bool,
) -> list[ResultRow]:
    fly, pre = real_inputs(real, tmp / "real", progress).datasets(config)
    rows: list[ResultRow] = []
    for i in range(len(pre)):
        raw = pre.raw_features(i)
        shape = [int(raw["aatype"].shape[0]), int(raw["msa"].shape[0])]
        extra = {**common, "synthetic": False, "sample_index": i}
        rows += _rows_for([_one(fly, i, repeats)], "on_the_fly", shape, "real", env, extra)
        rows += _rows_for([_one(pre, i, repeats)], "preprocessed", shape, "real", env, extra)
    return rows


def _one(dataset: Any, index: int, repeats: int) -> dict[str, float]:
    from hfkit.data.dataset import profile_sample

    return profile_sample(dataset, index, repeats=repeats)


def data_cost_table(frame: Any) -> Any:
    """Pivot data-cost rows to one line per (kind, length, depth, provider) with a column per stage (ms)."""
    frame = frame.copy()
    frame["length"] = frame["shape"].map(lambda s: s[0])
    frame["depth"] = frame["shape"].map(lambda s: s[1])
    table = frame.pivot_table(
        index=["dtype", "length", "depth", "provider"], columns="mode", values="p50_ms", aggfunc="median"
    )
    return table.round(2)


def sample_times(dataset: Any, indices: Sequence[int] | None = None, repeats: int = 1) -> Any:
    """Per-sample stage times (ms) of `dataset` as a DataFrame: one row per sample, with its length and depth.

    Uses `profile_sample` (one process, one thread as set by the caller). Columns: `index`, `length`,
    `depth`, one column per stage, `total`.
    """
    import pandas as pd

    from hfkit.data.dataset import profile_sample

    records = []
    for i in indices if indices is not None else range(len(dataset)):
        raw = dataset.raw_features(i)
        t = profile_sample(dataset, i, repeats=repeats)
        records.append(
            {
                "index": i,
                "length": int(raw["aatype"].shape[0]),
                "depth": int(raw["msa"].shape[0]),
                **{k: v * 1e3 for k, v in t.items()},
            }
        )
    return pd.DataFrame.from_records(records)


def loader_throughput(dataset: Any, workers: int, samples: int) -> float:
    """Samples per second that a `make_dataloader(dataset, workers=workers)` delivers over `samples` samples.

    The first sample (worker start-up) is excluded from the timing.
    """
    from hfkit.data.dataset import make_dataloader

    if samples < 2:
        raise ValueError(f"samples: expected at least 2, got {samples}")
    loader = make_dataloader(dataset, batch_size=1, workers=workers)
    it = iter(loader)
    got = 0
    start = None
    while got < samples:
        try:
            next(it)
        except StopIteration:
            it = iter(loader)
            continue
        got += 1
        if got == 1:
            start = time.perf_counter()
    assert start is not None
    return (samples - 1) / (time.perf_counter() - start)
