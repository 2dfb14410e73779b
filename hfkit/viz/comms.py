"""Figures, tables and the interactive cost-model panel of notebook 02 (communication).

`busbw_figure` draws nccl-tests' bus bandwidth against message size per backend (and per source when
rows from several result files are combined); `ddp_table`/`ddp_figure` show the seed's DDP step
decomposition (backward alone, concurrent, + synchronization with overlap on and off); `CostModelPanel`
is an ipywidgets panel over `hfkit.parallel.cost_model` (GPUs per node, nodes, bandwidths, parameters),
with a preset fitted to each committed H200 result (`fitted_presets`). What the notebook runs:
`run_comms_here` (the measurement for its profile), `committed_comms`, `calibration_table` and
`fit_committed_h200` (the cost model against the committed H200 runs, `model_fit_figure`).
plotly and ipywidgets are imported inside the functions (they are the `notebooks` extra).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hfkit.parallel.cost_model import (
    AF2_PARAMS,
    ClusterSpec,
    a100_pcie_fireflyer,
    busbw,
    calibrate_backends,
    fit_cluster,
    h200_nvlink,
    model_comparison,
    predict,
)
from hfkit.viz.notebook import render_into, show_static_then_widget

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

__all__ = [
    "FITTED_KEYS",
    "ClusterFit",
    "allreduce_frame",
    "calibration_table",
    "committed_comms",
    "fit_committed_h200",
    "model_fit_figure",
    "panel_figure",
    "run_comms_here",
    "busbw_figure",
    "ddp_table",
    "ddp_figure",
    "CostModelPanel",
    "default_presets",
    "fitted_presets",
    "model_table",
]

DDP_MODES = (
    "backward_alone",
    "backward_concurrent",
    "backward+sync_overlap",
    "backward+sync_no_overlap",
    "sync_only_no_overlap",
)


def allreduce_frame(frame: pd.DataFrame, source: str | None = None) -> pd.DataFrame:
    """The allreduce rows of a results frame with `nbytes`, `busbw_gbps`, `algbw_gbps`, `world_size`,
    and `series` (backend, or "backend · source" when `source` labels where the rows came from)."""
    f = frame[frame["op"] == "allreduce"].copy()
    f["nbytes"] = f["shape"].map(lambda s: int(s[0]))
    for key in ("busbw_gbps", "algbw_gbps", "world_size", "device"):
        f[key] = f["extra"].map(lambda e, k=key: e.get(k))
    f["series"] = f["provider"] if source is None else f["provider"] + " · " + source
    return f.sort_values(["series", "nbytes"])


def busbw_figure(frames: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Lines of busbw (GB/s) against message size (log x) per series of `allreduce_frame` rows."""
    import plotly.express as px

    fig = px.line(
        frames,
        x="nbytes",
        y="busbw_gbps",
        color="series",
        markers=True,
        log_x=True,
        hover_data={"p50_ms": ":.3f", "algbw_gbps": ":.3f", "world_size": True},
        labels={"nbytes": "message size (bytes)", "busbw_gbps": "bus bandwidth (GB/s)", "series": "backend"},
        title=title or "Allreduce bus bandwidth against message size",
    )
    fig.update_layout(height=420)
    return fig


def ddp_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The DDP step decomposition: one row per (backend, mode) with median seconds and overhead.

    `overhead_s` = that configuration's median minus backward alone (the seed's definition);
    `params` is the model's exact parameter count (`scaled_down` when below AlphaFold's 93.2M).
    """
    import pandas as pd

    f = frame[frame["op"] == "ddp_step"]
    if f.empty:
        return pd.DataFrame()
    rows = []
    for _, r in f.iterrows():
        e = r["extra"]
        rows.append(
            {
                "backend": r["provider"],
                "mode": r["mode"],
                "ranks": 1 if r["mode"] == "backward_alone" else e.get("world_size"),
                "median_s": r["p50_ms"] / 1e3,
                "overhead_s": e.get("comm_overhead_s"),
                "params": e.get("params"),
                "scaled_down": e.get("scaled_down"),
                "impl": e.get("impl", ""),
            }
        )
    order = {m: i for i, m in enumerate(DDP_MODES)}
    out = pd.DataFrame(rows)
    out["_o"] = out["mode"].map(order)
    return out.sort_values(["_o", "backend"]).drop(columns="_o").reset_index(drop=True)


def ddp_figure(table: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Bars of median step time per (backend, mode), with backward alone as a dashed reference line."""
    import plotly.express as px

    t = table[table["mode"] != "sync_only_no_overlap"].copy()
    t["config"] = t["backend"] + " · " + t["mode"]
    fig = px.bar(
        t,
        x="config",
        y="median_s",
        color="backend",
        labels={"median_s": "seconds (median)", "config": ""},
        title=title or "DDP step decomposition: backward (+ gradient synchronization)",
    )
    alone = t.loc[t["mode"] == "backward_alone", "median_s"]
    if len(alone):
        fig.add_hline(y=float(alone.iloc[0]), line_dash="dash", annotation_text="backward alone")
    fig.update_layout(height=400)
    return fig


def model_table(spec: ClusterSpec, params: int = AF2_PARAMS) -> pd.DataFrame:
    """Predicted allreduce time and busbw of `params` fp32 gradients on `spec`, per backend."""
    import pandas as pd

    nbytes = params * 4
    rows = []
    for backend in ("nccl", "hfreduce"):
        t = predict(spec, nbytes, backend)
        rows.append(
            {
                "backend": backend,
                "gpus": spec.world_size,
                "grad_MB": nbytes / 1e6,
                "allreduce_ms": t * 1e3,
                "busbw_gbps": busbw(nbytes, t, spec.world_size),
            }
        )
    return pd.DataFrame(rows)


def fitted_presets(root: str | Path | None = None) -> dict[str, ClusterSpec]:
    """One preset per committed `h200x*/comms.json` under `root` (default `results_dir()`): the H200
    NVLink spec fitted to that run (`fit_cluster`), then set to 16 nodes × 8 GPUs keeping the fitted
    per-GPU and host values. Empty when no such result is committed."""
    from hfkit.bench.comms import load_comms_results
    from hfkit.bench.results import results_dir

    presets = {}
    for path in sorted(Path(root or results_dir()).glob("h200x*/comms.json")):
        fitted = fit_cluster(h200_nvlink(nodes=1), allreduce_frame(load_comms_results(path.parent)))
        presets[f"H200 NVLink (fitted to {path.parent.name})"] = fitted.with_(gpus_per_node=8, nodes=16)
    return presets


def default_presets() -> dict[str, ClusterSpec]:
    """The panel's presets: the seed's A100 PCIe cluster, H200 NVLink, and `fitted_presets()`."""
    return {"A100 PCIe (seed)": a100_pcie_fireflyer(), "H200 NVLink": h200_nvlink(), **fitted_presets()}


def panel_figure(table: pd.DataFrame) -> go.Figure:
    """Bars of the predicted allreduce time per backend of a `model_table`."""
    import plotly.express as px

    gpus, grad_mb = int(table["gpus"].iloc[0]), float(table["grad_MB"].iloc[0])
    title = f"allreduce of {grad_mb:,.1f} MB of fp32 gradients on {gpus} GPUs (model)"
    return px.bar(
        table,
        x="backend",
        y="allreduce_ms",
        color="backend",
        height=300,
        labels={"allreduce_ms": "allreduce (ms)"},
        title=title,
    )


@dataclass
class CostModelPanel:
    """Sliders over a `ClusterSpec` (GPUs per node, nodes, NVLink/PCIe peer, PCIe, NIC, parameters)
    that show the predicted allreduce time per backend as a table and a bar chart.

    `update(**values)` recomputes from explicit values (what the widget calls; tests call it too) and
    returns the table; `show()` displays the first preset's result, then the widget. Presets
    (`default_presets`): the seed's A100 PCIe cluster, an H200 NVLink cluster from link specs, and one
    H200 cluster fitted to each committed H200 result.
    """

    presets: dict[str, ClusterSpec] = field(default_factory=default_presets)

    def spec_for(self, preset: str, **values: Any) -> ClusterSpec:
        spec = self.presets[preset]
        link = values.pop("link_gbps", None)
        if link is not None:
            # The slider sets NVLink where the preset has it, else the PCIe peer (ring hop) rate.
            spec = spec.with_(nvlink_gbps=link) if spec.nvlink_gbps is not None else spec.with_(p2p_gbps=link)
        return spec.with_(**values)

    def update(self, preset: str, params: int = AF2_PARAMS, **values: Any) -> pd.DataFrame:
        return model_table(self.spec_for(preset, **values), params)

    def show(self, preset: str | None = None) -> None:
        """Display the prediction for `preset` (default: the first) as a static table and chart, which
        an HTML report shows without the widget's JavaScript, then the interactive panel."""
        table = self.update(preset or next(iter(self.presets)))
        show_static_then_widget(self.widget(), table.round(3), panel_figure(table))

    def widget(self) -> Any:
        """The ipywidgets panel: preset, sliders, and an Output area with the table and the chart."""
        import ipywidgets as w

        names = list(self.presets)
        preset = w.Dropdown(options=names, value=names[0], description="cluster")
        gpn = w.IntSlider(value=8, min=1, max=16, description="GPUs/node")
        nodes = w.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128], value=16, description="nodes")
        link = w.FloatLogSlider(value=4.8, base=10, min=0, max=3, description="link GB/s")
        pcie = w.FloatSlider(value=24.0, min=4, max=64, step=1, description="PCIe GB/s")
        nic = w.FloatSlider(value=23.0, min=5, max=400, step=1, description="NIC GB/s")
        params = w.FloatLogSlider(value=AF2_PARAMS, base=10, min=6, max=10, description="params")
        out = w.Output()

        def load_preset(_: Any = None) -> None:
            spec = self.presets[preset.value]
            gpn.value, nodes.value = spec.gpus_per_node, spec.nodes
            link.value, pcie.value, nic.value = spec.intra_gbps, spec.pcie_gbps, spec.nic_gbps
            refresh()

        def refresh(_: Any = None) -> None:
            table = self.update(
                preset.value,
                params=int(params.value),
                gpus_per_node=gpn.value,
                nodes=nodes.value,
                link_gbps=link.value,
                pcie_gbps=pcie.value,
                nic_gbps=nic.value,
            )
            render_into(out, table.round(3), panel_figure(table))

        preset.observe(load_preset, names="value")
        for s in (gpn, nodes, link, pcie, nic, params):
            s.observe(refresh, names="value")
        load_preset()
        return w.VBox([w.HBox([preset, gpn, nodes]), w.HBox([link, pcie, nic]), params, out])


def run_comms_here(smoke: bool, gpu_count: int) -> pd.DataFrame:
    """Run notebook 02's allreduce and DDP measurements on this machine (`run_comms_benchmark`, as
    `torchrun` subprocesses) and return the rows as a frame. `smoke`: 2 ranks, 4 KB to 1 MB, a
    2M-parameter DDP model, few repetitions; otherwise every GPU (at least 2 ranks) and the full sizes.
    Without GPUs (`gpu_count` 0) the ranks are CPU processes on gloo and hfreduce."""
    from hfkit.bench.comms import default_backends, run_comms_benchmark
    from hfkit.bench.results import rows_to_frame

    backends = default_backends()
    if smoke:
        rows = run_comms_benchmark(
            nproc=2,
            backends=backends,
            max_bytes="1M",
            params=2_000_000,
            ddp_reps=3,
            reps=10,
            budget_s=0.2,
            timeout_s=300,
            cpu=gpu_count == 0,
            log=None,
        )
    else:
        rows = run_comms_benchmark(nproc=max(2, gpu_count), backends=backends, timeout_s=1800, log=None)
    return rows_to_frame(rows)


def committed_comms(root: str | Path | None = None) -> dict[str, pd.DataFrame]:
    """The committed comms results under `root` (default `results_dir()`), by label: "CPU, committed"
    for `cpu/`, "one H200 shared by <n> ranks" for each `h200/comms_shared<n>.json` (the allreduce rows
    of ranks sharing one GPU), "<folder>, reference" for each `h200x*/`. Empty when none are committed."""
    from hfkit.bench.comms import load_comms_results
    from hfkit.bench.results import load_results, results_dir

    root = Path(root or results_dir())
    sources = {}
    if (root / "cpu" / "comms.json").exists():
        sources["CPU, committed"] = load_comms_results(root / "cpu")
    for path in sorted(root.glob("h200/comms_shared*.json")):
        ranks = path.name.removeprefix("comms_shared").removesuffix(".json")
        if ranks.isdigit():  # not the DDP rows' comms_shared<n>.ddp.json
            sources[f"one H200 shared by {ranks} ranks"] = load_results(path)
    for path in sorted(root.glob("h200x*/comms.json")):
        sources[f"{path.parent.name}, reference"] = load_comms_results(path.parent)
    return sources


def calibration_table(sources: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The ring formula's α and B fitted per source and backend (`calibrate_backends` of each frame's
    allreduce rows): columns source, backend, ranks, alpha_us, bw_gbps, rel_rms."""
    import pandas as pd

    tables = [calibrate_backends(allreduce_frame(f)).assign(source=name) for name, f in sources.items()]
    columns = ["source", "backend", "ranks", "alpha_us", "bw_gbps", "rel_rms"]
    if not tables:
        return pd.DataFrame(columns=columns)
    return pd.concat(tables, ignore_index=True)[columns]


FITTED_KEYS = ("gpus_per_node", "alpha_us", "nvlink_gbps", "pcie_gbps", "chunk_overhead_us", "host_mem_gbps")


@dataclass
class ClusterFit:
    """The H200 cost model fitted to one committed run: `name` (its folder), `fitted` (`fit_cluster`),
    `comparison` (measured against the spec and fitted models, `model_comparison`) and `at_scale`
    (`model_table` of the link spec and of the fitted values on 16 nodes × 8 GPUs)."""

    name: str
    fitted: ClusterSpec
    comparison: pd.DataFrame
    at_scale: pd.DataFrame

    def fitted_values(self) -> dict[str, float]:
        """The fitted spec's shape, latency and rates (`FITTED_KEYS`), rounded for printing."""
        return {k: round(float(getattr(self.fitted, k)), 3) for k in FITTED_KEYS}


def fit_committed_h200(root: str | Path | None = None) -> list[ClusterFit]:
    """One `ClusterFit` per committed `h200x*/comms.json` under `root` (default `results_dir()`): the
    nccl and hfreduce rows fitted with `fit_cluster(h200_nvlink(nodes=1), ...)`. Empty without them."""
    import pandas as pd

    from hfkit.bench.comms import load_comms_results
    from hfkit.bench.results import results_dir

    fits = []
    for path in sorted(Path(root or results_dir()).glob("h200x*/comms.json")):
        measured = allreduce_frame(load_comms_results(path.parent))
        measured = measured[measured["provider"].isin(["nccl", "hfreduce"])]
        fitted = fit_cluster(h200_nvlink(nodes=1), measured)
        spec = h200_nvlink(nodes=1).with_(gpus_per_node=fitted.gpus_per_node)
        comparison = model_comparison(measured, {"spec_model": spec, "fitted_model": fitted})
        at_scale = pd.concat(
            [
                model_table(h200_nvlink(16)).assign(model="H200 link spec"),
                model_table(fitted.with_(gpus_per_node=8, nodes=16)).assign(
                    model=f"fitted to {path.parent.name}"
                ),
            ],
            ignore_index=True,
        )
        fits.append(ClusterFit(path.parent.name, fitted, comparison, at_scale))
    return fits


def model_fit_figure(comparison: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Lines of allreduce time against message size (log-log) per backend, solid for the measurement
    and dashed/dotted for each model column of a `model_comparison` table."""
    import plotly.express as px

    long = comparison.melt(id_vars=["backend", "nbytes"], var_name="series", value_name="ms")
    fig = px.line(
        long,
        x="nbytes",
        y="ms",
        color="backend",
        line_dash="series",
        markers=True,
        log_x=True,
        log_y=True,
        labels={"nbytes": "message size (bytes)", "ms": "allreduce (ms)"},
        title=title or "measured allreduce against the cost models",
    )
    fig.update_layout(height=420)
    return fig
