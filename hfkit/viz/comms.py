"""Figures, tables and the interactive cost-model panel of notebook 02 (communication).

`busbw_figure` draws nccl-tests' bus bandwidth against message size per backend (and per source when
rows from several result files are combined); `ddp_table`/`ddp_figure` show the seed's DDP step
decomposition (backward alone, concurrent, + synchronization with overlap on and off); `CostModelPanel`
is an ipywidgets panel over `hfkit.parallel.cost_model` (GPUs per node, nodes, bandwidths, parameters),
with a preset fitted to each committed H200 result (`fitted_presets`).
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
    fit_cluster,
    h200_nvlink,
    predict,
)

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

__all__ = [
    "allreduce_frame",
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


@dataclass
class CostModelPanel:
    """Sliders over a `ClusterSpec` (GPUs per node, nodes, NVLink/PCIe peer, PCIe, NIC, parameters)
    that show the predicted allreduce time per backend as a table and a bar chart.

    `update(**values)` recomputes from explicit values (what the widget calls; tests call it too) and
    returns the table. Presets (`default_presets`): the seed's A100 PCIe cluster, an H200 NVLink
    cluster from link specs, and one H200 cluster fitted to each committed H200 result.
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

    def widget(self) -> Any:
        """The ipywidgets panel: preset, sliders, and an Output area with the table and the chart."""
        import ipywidgets as w
        import plotly.express as px
        from IPython.display import display

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
            with out:
                out.clear_output(wait=True)
                display(table.round(3))
                title = f"{int(params.value):,} fp32 params on {gpn.value}×{nodes.value} GPUs"
                fig = px.bar(table, x="backend", y="allreduce_ms", color="backend", height=300, title=title)
                fig.show()

        preset.observe(load_preset, names="value")
        for s in (gpn, nodes, link, pcie, nic, params):
            s.observe(refresh, names="value")
        load_preset()
        return w.VBox([w.HBox([preset, gpn, nodes]), w.HBox([link, pcie, nic]), params, out])
