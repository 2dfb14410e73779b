"""Figures and the interactive panel of notebook 01 (data cost): stage costs, per-sample time
distributions, synchronous-DDP waiting, and an explorer for crop size, MSA depth, workers and ranks.

plotly and ipywidgets are imported inside the functions (they are the `notebooks` extra).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

__all__ = ["stage_bars", "time_histogram", "sync_wait_figure", "DataCostExplorer", "data_cost_explorer"]

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
    widget). Inputs are synthetic and labelled so.
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

        from hfkit.bench.data_cost import loader_throughput, sample_times, sync_wait_table
        from hfkit.bench.sync_wait import lognormal_lengths
        from hfkit.data.dataset import PreprocessedDataset
        from hfkit.data.msa_sampling import FeatureConfig

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

    def widget(self) -> Any:
        """The ipywidgets panel: sliders/dropdowns and a run button writing into an Output area."""
        import ipywidgets as w
        from IPython.display import display

        crop = w.SelectionSlider(
            options=list(self.crops), value=self.crops[min(2, len(self.crops) - 1)], description="crop"
        )
        depth = w.Dropdown(options=list(self.depths), value=self.depths[0], description="MSA depth")
        workers = w.IntSlider(value=0, min=0, max=self.max_workers, description="workers")
        ranks = w.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128, 256], value=8, description="ranks P")
        button = w.Button(description="run", button_style="primary")
        out = w.Output()

        def on_click(_: Any) -> None:
            out.clear_output()
            with out:
                print("measuring (synthetic inputs) ...")
                table = self.run(crop.value, depth.value, workers.value, ranks.value)
                out.clear_output()
                display(table)

        button.on_click(on_click)
        self._run_button = on_click
        return w.VBox([w.HBox([crop, depth]), w.HBox([workers, ranks, button]), out])


def data_cost_explorer(smoke: bool = False) -> DataCostExplorer:
    """The explorer with full sizes (L=384, depths 1k/5k/20k) or, with `smoke`, small ones for a CPU check."""
    if smoke:
        return DataCostExplorer(length=64, depths=(100, 400), crops=(32, 64), max_workers=2, loader_samples=3)
    return DataCostExplorer()
