"""Plotly figures and an ipywidgets explorer for the Evoformer kernel benchmarks (notebook 04).

Every function takes the DataFrame of `hfkit.bench.kernels.kernel_frame` / `load_kernel_results` (rows
of attention, softmax and triangle multiplication results, one per op, case, dtype, mode and provider)
and draws one op in one dtype: lines over the problem size (the `case` column: "N=512",
"S=132 N=256", ...), one colour per provider, fwd and fwd+bwd side by side. Failed rows (an error such
as running out of memory) are left out of the charts and listed in the explorer's table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

__all__ = [
    "KernelExplorer",
    "kernel_explorer",
    "kernel_memory_figure",
    "kernel_rate_figure",
    "kernel_time_figure",
]

PROVIDER_ORDER = ["hfkit", "eager", "compile", "sdpa", "trifast", "cuequivariance"]
PROVIDER_COLORS = {
    "hfkit": "#d62728",
    "eager": "#7f7f7f",
    "compile": "#1f77b4",
    "sdpa": "#2ca02c",
    "trifast": "#9467bd",
    "cuequivariance": "#ff7f0e",
}


_HOVER = ("shape_str", "p20_ms", "p50_ms", "p80_ms", "peak_mib", "tflops", "pct_matmul", "gbps", "pct_copy")


def _select(frame: pd.DataFrame, op: str, dtype: str) -> pd.DataFrame:
    data = frame[(frame["op"] == op) & (frame["dtype"] == dtype)]
    if data.empty:
        raise ValueError(f"op/dtype: no rows for op={op!r} dtype={dtype!r}; have {sorted(set(frame['op']))}")
    return data


def _lines(
    frame: pd.DataFrame, op: str, dtype: str, y: str, y_title: str, title: str, log_y: bool = False
) -> go.Figure:
    import plotly.express as px

    data = _select(frame, op, dtype)
    cases = list(dict.fromkeys(data.sort_values(["n", "shape_str"])["case"]))  # x axis in size order
    data = data[data[y].notna() & data["error"].isna()]
    providers = [p for p in PROVIDER_ORDER if p in set(data["provider"])]
    providers += sorted(set(data["provider"]) - set(providers))
    fig = px.line(
        data,
        x="case",
        y=y,
        color="provider",
        facet_col="mode" if data["mode"].nunique() > 1 else None,
        markers=True,
        log_y=log_y,
        category_orders={"case": cases, "provider": providers, "mode": ["fwd", "fwd+bwd"]},
        color_discrete_map=PROVIDER_COLORS,
        labels={"case": "size", y: y_title},
        hover_data=[c for c in _HOVER if c in data],
        title=title,
    )
    fig.update_layout(height=420, legend_title_text="provider")
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
    return fig


def kernel_time_figure(frame: pd.DataFrame, op: str, dtype: str, title: str | None = None) -> go.Figure:
    """p50 time per call (ms, log scale) over size, per provider; fwd and fwd+bwd side by side."""
    return _lines(frame, op, dtype, "p50_ms", "p50 time (ms)", title or f"{op} {dtype}: time per call", True)


def kernel_memory_figure(frame: pd.DataFrame, op: str, dtype: str, title: str | None = None) -> go.Figure:
    """Peak CUDA memory of one call above its inputs (MiB, log scale) over size, per provider."""
    return _lines(
        frame,
        op,
        dtype,
        "peak_mib",
        "peak memory above inputs (MiB)",
        title or f"{op} {dtype}: peak memory",
        True,
    )


def kernel_rate_figure(frame: pd.DataFrame, op: str, dtype: str, title: str | None = None) -> go.Figure:
    """Achieved rate over size: TFLOP/s with the measured matmul ceiling as a dashed line for the
    arithmetic-bound ops; % of the measured copy bandwidth (dashed: 100%, dotted: the 80% goal) for
    softmax."""
    data = _select(frame, op, dtype)
    if data["flops"].notna().any():
        fig = _lines(frame, op, dtype, "tflops", "TFLOP/s", title or f"{op} {dtype}: achieved TFLOP/s")
        ceiling = data["ceiling_matmul_tflops"].dropna() if "ceiling_matmul_tflops" in data else []
        if len(ceiling):
            fig.add_hline(
                y=float(ceiling.iloc[0]),
                line_dash="dash",
                opacity=0.5,
                annotation_text="matmul ceiling (measured)",
            )
        return fig
    fig = _lines(
        frame, op, dtype, "pct_copy", "% of copy bandwidth", title or f"{op} {dtype}: % of copy bandwidth"
    )
    fig.add_hline(y=100, line_dash="dash", opacity=0.5, annotation_text="copy (measured)")
    fig.add_hline(y=80, line_dash="dot", opacity=0.5, annotation_text="goal 80%")
    return fig


class KernelExplorer:
    """Dropdowns for op, dtype and size over a kernel results frame: shows that case's table (every
    provider and mode: time, rate, peak memory, check, failure) and a bar chart of the times.

    `update()` does what changing a dropdown does, so code and tests can drive it without a browser.
    """

    def __init__(self, frame: pd.DataFrame, title: str = "") -> None:
        import ipywidgets as widgets

        if frame is None or frame.empty:
            raise ValueError("frame: expected kernel benchmark rows, got none")
        self.frame = frame
        ops = list(dict.fromkeys(frame["op"]))
        self.op = widgets.Dropdown(options=ops, value=ops[0], description="op")
        self.dtype = widgets.Dropdown(description="dtype")
        self.case = widgets.Dropdown(description="size")
        self.output = widgets.Output()
        self.last_table: pd.DataFrame | None = None
        self._refresh_options()
        self.op.observe(lambda _: (self._refresh_options(), self.update()), names="value")
        self.dtype.observe(lambda _: (self._refresh_cases(), self.update()), names="value")
        self.case.observe(lambda _: self.update(), names="value")
        self.widget = widgets.VBox(
            [widgets.HTML(title), widgets.HBox([self.op, self.dtype, self.case]), self.output]
        )

    def _refresh_options(self) -> None:
        dtypes = list(dict.fromkeys(self.frame.loc[self.frame["op"] == self.op.value, "dtype"]))
        self.dtype.options = dtypes
        self.dtype.value = dtypes[0]
        self._refresh_cases()

    def _refresh_cases(self) -> None:
        data = self.frame[(self.frame["op"] == self.op.value) & (self.frame["dtype"] == self.dtype.value)]
        cases = list(dict.fromkeys(data.sort_values(["n", "shape_str"])["case"]))
        self.case.options = cases
        if cases:
            self.case.value = cases[0]

    def table(self) -> pd.DataFrame:
        """The selected case: one line per provider and mode."""
        f = self.frame
        data = f[
            (f["op"] == self.op.value) & (f["dtype"] == self.dtype.value) & (f["case"] == self.case.value)
        ]
        columns = [
            "provider",
            "mode",
            "shape_str",
            "p50_ms",
            "tflops",
            "gbps",
            "pct_copy",
            "peak_mib",
            "max_err",
        ]
        table = data[columns + ["check_ok", "error"]].copy()
        table["error"] = table["error"].fillna("")
        return table.round({"p50_ms": 3, "tflops": 1, "gbps": 1, "pct_copy": 1, "peak_mib": 1}).reset_index(
            drop=True
        )

    def update(self) -> pd.DataFrame:
        """Redraw for the current selection; return its table."""
        import plotly.express as px
        from IPython.display import display

        self.last_table = self.table()
        timed = self.last_table[self.last_table["p50_ms"].notna()]
        fig = px.bar(
            timed,
            x="provider",
            y="p50_ms",
            color="provider",
            facet_col="mode",
            color_discrete_map=PROVIDER_COLORS,
            category_orders={"provider": PROVIDER_ORDER, "mode": ["fwd", "fwd+bwd"]},
            title=f"{self.op.value} {self.dtype.value} {self.case.value}: p50 time (ms)",
        )
        fig.update_layout(height=360, showlegend=False)
        self.output.clear_output(wait=True)
        with self.output:
            display(self.last_table)
            display(fig)
        return self.last_table

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)


def kernel_explorer(frame: pd.DataFrame, title: str = "") -> KernelExplorer:
    """Build the explorer (see `KernelExplorer`), drawn once; display it in a notebook cell."""
    explorer = KernelExplorer(frame, title)
    explorer.update()
    return explorer
