"""Figures and the interactive panel of notebook 01 (data cost): stage costs, per-sample time
distributions, synchronous-DDP waiting, and an explorer for crop size, MSA depth, workers and ranks;
and what the notebook runs for its profile (`real_sample_times`, `run_data_cost_here`,
`committed_data_cost`, `sample_time_mix`, `sync_wait_here`).

plotly and ipywidgets are imported inside the functions (they are the `notebooks` extra).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hfkit.bench.data_cost import data_cost_table
from hfkit.viz.notebook import render_into, show_static_then_widget

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

# `data_cost_table` is re-exported for notebook 01, which imports from viz only.
__all__ = [
    "DataCostExplorer",
    "committed_data_cost",
    "data_cost_explorer",
    "data_cost_table",
    "run_data_cost_here",
    "sample_time_mix",
    "sync_wait_here",
    "missing_real_inputs_note",
    "real_sample_times",
    "stage_bars",
    "sync_wait_figure",
    "time_histogram",
]

STAGE_ORDER = ("parse_mmcif", "read_msas", "features", "read", "decode", "process_features")


def stage_bars(frame: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Stacked bars of per-stage median time (ms) for each (kind, depth, provider) of data-cost rows."""
    import plotly.express as px

    f = frame[frame["mode"].isin(STAGE_ORDER)].copy()
    f["depth"] = f["shape"].map(lambda s: s[1])
    f["length"] = f["shape"].map(lambda s: s[0])
    f["input"] = f.apply(lambda r: f"{r['dtype']} L={r['length']} depth={r['depth']}", axis=1)
    f = f.groupby(["input", "provider", "mode"], as_index=False, sort=False)["p50_ms"].median()
    fig = px.bar(
        f,
        x="provider",
        y="p50_ms",
        color="mode",
        facet_col="input",
        category_orders={"mode": [s for s in STAGE_ORDER if s in set(f["mode"])]},
        labels={"p50_ms": "ms per sample (median)", "mode": "stage"},
        title=title or "Cost of one training sample, per stage (one CPU thread)",
        log_y=False,
    )
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=", 1)[-1]))
    fig.update_layout(height=420)
    return fig


def time_histogram(times: dict[str, pd.DataFrame], title: str | None = None) -> go.Figure:
    """Overlaid histograms of per-sample total time (ms), one trace per named DataFrame of `sample_times`."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, df in times.items():
        fig.add_trace(go.Histogram(x=df["total"], name=name, opacity=0.6, nbinsx=30))
    fig.update_layout(
        barmode="overlay",
        title=title or "Per-sample time: on the fly vs preprocessed",
        xaxis_title="ms per sample",
        yaxis_title="samples",
        height=380,
    )
    return fig


def sync_wait_figure(table: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Wasted fraction of rank-time against the number of ranks, per policy (and crop size)."""
    import plotly.express as px

    t = table.copy()
    t["series"] = t.apply(
        lambda r: r["policy"] if r["policy"] == "no crop" else f"{r['policy']} {r['crop']}", axis=1
    )
    fig = px.line(
        t.drop_duplicates(["series", "ranks"]),
        x="ranks",
        y="wasted_fraction",
        color="series",
        markers=True,
        log_x=True,
        labels={"wasted_fraction": "share of rank-time spent waiting", "ranks": "ranks P"},
        title=title or "Synchronous DDP: every step waits for the slowest rank",
    )
    fig.update_layout(height=380, yaxis_tickformat=".0%")
    return fig


@dataclass
class DataCostExplorer:
    """A panel that reruns the data-cost measurements for a chosen crop size, MSA depth, workers, ranks.

    `run(crop, depth, workers, ranks)` makes (once per depth) a synthetic chain of `length` residues
    with a `depth`-row MSA, preprocesses it into a record, times `process_features` at that crop size
    from the record, measures DataLoader throughput with `workers` processes, and evaluates the
    synchronous-DDP waste at `ranks` ranks; it returns a one-row DataFrame (and shows it, with the
    widget); `show(...)` displays one run's table, then the widget. Inputs are synthetic and labelled so.
    """

    length: int = 384
    depths: tuple[int, ...] = (1000, 5000, 20000)
    crops: tuple[int, ...] = (64, 128, 256, 384)
    max_workers: int = 4
    loader_samples: int = 6
    _dirs: dict[int, Path] = field(default_factory=dict)
    _tmp: Any = None

    def _records(self, depth: int) -> Path:
        from hfkit.bench.data_cost import synthetic_inputs

        if depth not in self._dirs:
            if self._tmp is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="hfkit-data-cost-")
            inputs = synthetic_inputs(Path(self._tmp.name) / f"d{depth}", 2, self.length, depth, seed=depth)
            self._dirs[depth] = inputs.records
        return self._dirs[depth]

    def run(self, crop: int, depth: int, workers: int, ranks: int) -> pd.DataFrame:
        import pandas as pd
        import torch

        from hfkit.bench.data_cost import loader_throughput, sample_times
        from hfkit.data.dataset import PreprocessedDataset
        from hfkit.data.msa_sampling import FeatureConfig
        from hfkit.viz.sync_wait import lognormal_lengths, sync_wait_table

        base = FeatureConfig.af2_initial()
        config = replace(base, crop_size=int(crop))
        dataset = PreprocessedDataset(self._records(int(depth)), config, seed=0)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            times = sample_times(dataset, indices=[0], repeats=3)
        finally:
            torch.set_num_threads(threads)
        rate = loader_throughput(dataset, int(workers), self.loader_samples)
        lengths = lognormal_lengths(4000, np.random.default_rng(0))
        wait = sync_wait_table(lengths, [int(crop)], [int(ranks)], steps=500)
        waste = wait.set_index("policy")["wasted_fraction"]
        return pd.DataFrame(
            [
                {
                    "input": f"synthetic L={self.length} depth={depth}",
                    "crop": crop,
                    "load + sample + crop, ms (1 thread)": round(float(times["total"].iloc[0]), 2),
                    f"loader samples/s ({workers} workers)": round(rate, 1),
                    f"DDP waste at P={ranks}, no crop": f"{waste['no crop']:.0%}",
                    f"DDP waste at P={ranks}, crop": f"{waste['crop']:.0%}",
                }
            ]
        )

    def show(self, crop: int, depth: int, workers: int, ranks: int) -> pd.DataFrame:
        """Run once for these settings and display the result as a static table (readable in an HTML
        report), then the interactive panel; returns the table."""
        table = self.run(crop, depth, workers, ranks)
        show_static_then_widget(self.widget(), table)
        return table

    def widget(self) -> Any:
        """The ipywidgets panel: sliders/dropdowns and a run button writing into an Output area."""
        import ipywidgets as w

        crop = w.SelectionSlider(
            options=list(self.crops), value=self.crops[min(2, len(self.crops) - 1)], description="crop"
        )
        depth = w.Dropdown(options=list(self.depths), value=self.depths[0], description="MSA depth")
        workers = w.IntSlider(value=0, min=0, max=self.max_workers, description="workers")
        ranks = w.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128, 256], value=8, description="ranks P")
        button = w.Button(description="run", button_style="primary")
        out = w.Output()

        def on_click(_: Any) -> None:
            render_into(out, "measuring (synthetic inputs) ...")
            render_into(out, self.run(crop.value, depth.value, workers.value, ranks.value))

        button.on_click(on_click)
        self._run_button = on_click
        return w.VBox([w.HBox([crop, depth]), w.HBox([workers, ranks, button]), out])


def data_cost_explorer(smoke: bool = False) -> DataCostExplorer:
    """The explorer with full sizes (L=384, depths 1k/5k/20k) or, with `smoke`, small ones for a CPU check."""
    if smoke:
        return DataCostExplorer(length=64, depths=(100, 400), crops=(32, 64), max_workers=2, loader_samples=3)
    return DataCostExplorer()


def missing_real_inputs_note() -> str:
    """What to do where the real inputs are absent: where `openfold_test_data_dir` looks, and where
    the files come from."""
    return (
        "The real inputs were not found, so this section is skipped. They are OpenFold's test data "
        "(the folder tests/test_data/ of github.com/aqlaboratory/openfold: 2q2k's mmCIF under mmcifs/ "
        "and its chains' MSAs under alignments/) and are not part of this repository. Point "
        "HFKIT_OPENFOLD_TEST_DATA at a copy of that folder before starting Jupyter, or place it at "
        "shared/data/openfold_test_data beside the repository."
    )


def real_sample_times(
    real_dir: str | Path, work_dir: str | Path, config: Any, repeats: int = 3
) -> tuple[pd.DataFrame, dict[str, tuple[int, ...]]]:
    """Per-sample stage times (ms) of the real inputs under `real_dir` made both ways, on the fly and
    from preprocessed records (written under `work_dir`) with `config` (a `FeatureConfig`): one row per
    sample and path ("on the fly", "preprocessed"). Also the shapes of the main features of the first
    preprocessed sample (msa_feat, extra_msa, target_feat, seq_mask)."""
    import pandas as pd

    from hfkit.bench.data_cost import real_inputs, sample_times

    fly, pre = real_inputs(real_dir, Path(work_dir) / "real").datasets(config)
    times = []
    for path, dataset in (("on the fly", fly), ("preprocessed", pre)):
        table = sample_times(dataset, repeats=repeats)
        table.insert(0, "path", path)
        times.append(table)
    shown = ("msa_feat", "extra_msa", "target_feat", "seq_mask")
    shapes = {k: tuple(v.shape) for k, v in pre[0].items() if k in shown}
    return pd.concat(times, ignore_index=True), shapes


def run_data_cost_here(smoke: bool) -> pd.DataFrame:
    """Per-stage data cost on synthetic inputs, measured now (`run_data_cost_benchmark`): `smoke`: one
    96-residue chain at MSA depths 200 and 1000, 2 repeats; otherwise 2 chains of 384 residues at
    the benchmark's depths (1k, 5k, 20k), 3 repeats. Rows as a frame."""
    from hfkit.bench.data_cost import run_data_cost_benchmark
    from hfkit.bench.results import rows_to_frame

    if smoke:
        rows = run_data_cost_benchmark(depths=(200, 1000), length=96, n_chains=1, repeats=2, progress=False)
    else:
        rows = run_data_cost_benchmark(length=384, n_chains=2, repeats=3, progress=False)
    return rows_to_frame(rows)


def committed_data_cost(root: str | Path | None = None) -> pd.DataFrame | None:
    """The committed CPU data-cost results (`cpu/data_cost.json` under `root`, default `results_dir()`),
    or None when there are none."""
    from hfkit.bench.results import load_results, results_dir

    path = Path(root or results_dir()) / "cpu" / "data_cost.json"
    return load_results(path) if path.exists() else None


def sample_time_mix(work_dir: str | Path, smoke: bool, config: Any) -> dict[str, pd.DataFrame]:
    """Per-sample times of a small synthetic set with lengths drawn uniformly, made on the fly and
    from preprocessed records (under `work_dir`), by path name. `smoke`: 6 chains of 48-128 residues,
    MSA depth 300, `FeatureConfig.tiny()`; otherwise 24 chains of 64-512 residues, depth 3000, `config`."""
    from hfkit.bench.data_cost import sample_times, synthetic_inputs
    from hfkit.data.msa_sampling import FeatureConfig

    n, lengths, depth = (6, (48, 128), 300) if smoke else (24, (64, 512), 3000)
    inputs = synthetic_inputs(Path(work_dir) / "mix", n, lengths, depth, seed=1)
    fly, pre = inputs.datasets(FeatureConfig.tiny() if smoke else config)
    return {"on the fly": sample_times(fly), "preprocessed": sample_times(pre)}


def sync_wait_here(crops: tuple[int, ...] = (256, 384), smoke: bool = False) -> pd.DataFrame:
    """`sync_wait_table` for 20000 chain lengths from the log-normal model (seed 0) at 1 to 256 ranks
    and the given crop sizes; `smoke` simulates 500 steps instead of 4000."""
    from hfkit.viz.sync_wait import lognormal_lengths, sync_wait_table

    lengths = lognormal_lengths(20000, np.random.default_rng(0))
    ranks = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    return sync_wait_table(lengths, list(crops), ranks, steps=500 if smoke else 4000)
