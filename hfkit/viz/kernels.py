"""Plotly figures and an ipywidgets explorer for the Evoformer kernel benchmarks (notebook 04).

Every function takes the DataFrame of `hfkit.bench.kernels.kernel_frame` / `load_kernel_results` (rows
of attention, softmax and triangle multiplication results, one per op, case, dtype, mode and provider)
and draws one op in one dtype: lines over the problem size (the `case` column: "N=512",
"S=132 N=256", ...), one colour per provider, fwd and fwd+bwd side by side. Failed rows (an error such
as running out of memory) are left out of the charts and listed in the explorer's table.
`kernel_results` gives the rows notebook 04 shows (measured now on a GPU, committed elsewhere),
`kernel_goals` the table of the benchmarks' targets against them, and `goal_sentences` says, per
target, in how many cases it is reached.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hfkit.bench.kernels import OURS, best_peer_table, kernel_errors, kernel_frame
from hfkit.viz.notebook import NotebookResults, render_into, show_static_then_widget

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go
    import torch

    from hfkit.bench.results import ResultRow

# `best_peer_table` and `kernel_errors` are re-exported for notebook 04, which imports from viz only.
__all__ = [
    "KernelExplorer",
    "best_peer_table",
    "kernel_errors",
    "committed_kernels",
    "goal_sentences",
    "kernel_results",
    "measure_kernels",
    "kernel_explorer",
    "kernel_goals",
    "kernel_memory_figure",
    "kernel_rate_figure",
    "kernel_time_figure",
]

# Notebook 04's GPU run: the full profile narrowed to its smaller sizes (N for attention and triangle
# multiplication; the first MSA-row and the first triangle logits shape of `SOFTMAX_SHAPES`).
QUICK_SIZES: tuple[int, ...] = (256, 512)
QUICK_SOFTMAX_SHAPES: tuple[tuple[int, int, int, int], ...] = ((128, 8, 256, 256), (256, 4, 256, 256))

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

    `update()` does what changing a dropdown does, so code and tests can drive it without a browser;
    `show()` displays the current selection's table and chart as static outputs, then the widget.
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
        self.last_figure: go.Figure | None = None
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
        """Redraw for the current selection; return its table (kept as `last_table`, the chart as
        `last_figure`)."""
        import plotly.express as px

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
        self.last_figure = fig
        render_into(self.output, self.last_table, fig)
        return self.last_table

    def show(self) -> None:
        """Display the current selection (table and chart, static: readable in an HTML report), then
        the widget."""
        show_static_then_widget(self.widget, self.last_table, self.last_figure)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)


def kernel_explorer(frame: pd.DataFrame, title: str = "") -> KernelExplorer:
    """Build the explorer (see `KernelExplorer`), drawn once; display it in a notebook cell."""
    explorer = KernelExplorer(frame, title)
    explorer.update()
    return explorer


def measure_kernels(device: torch.device, smoke: bool) -> NotebookResults:
    """Run a quick subset of the attention, softmax and triangle-multiplication benchmarks on `device`
    (a GPU) now: the full profile's smaller sizes (attention and triangle multiplication at N = 256
    and 512, softmax at `QUICK_SOFTMAX_SHAPES`), every installed provider, one ceiling measurement
    shared by the three; `smoke` keeps triangle multiplication to amp-bf16."""
    from hfkit.bench import device_name, run_benchmark
    from hfkit.bench.cases import evoformer_attention, softmax, triangle_multiplication
    from hfkit.bench.ceilings import bench_ceilings
    from hfkit.bench.kernels import kernel_frame

    ceilings = bench_ceilings(device)
    dtypes = ("amp-bf16",) if smoke else ("amp-bf16", "bf16")
    runs = [
        run_benchmark(
            evoformer_attention.BENCHMARK,
            evoformer_attention.attention_cases("full", sizes=QUICK_SIZES),
            device,
            ceilings=ceilings,
        ),
        run_benchmark(
            softmax.BENCHMARK, softmax.softmax_cases("full", QUICK_SOFTMAX_SHAPES), device, ceilings=ceilings
        ),
        run_benchmark(
            triangle_multiplication.BENCHMARK,
            triangle_multiplication.trimul_cases("full", sizes=QUICK_SIZES),
            device,
            ceilings=ceilings,
            dtypes=dtypes,
        ),
    ]
    frame = kernel_frame([row for run in runs for row in run.rows])
    frame["ceiling_copy_gbps"] = ceilings.copy_gbps
    frame["ceiling_matmul_tflops"] = ceilings.matmul_tflops
    notes = [f"skipped: {line}" for run in runs for line in run.skipped]
    return NotebookResults(frame, f"measured now on {device_name(device)} (quick subset)", notes)


def committed_kernels(source: str | os.PathLike[str] | None = None) -> NotebookResults:
    """The committed kernel results of `source` (a folder under data/results/, or a path; default:
    `HFKIT_KERNEL_RESULTS`, else "h200"), labelled with the GPU and commits that made them; an empty
    `NotebookResults` whose note says how to make them when there are none."""
    from hfkit.bench.kernels import load_kernel_results

    source = source if source is not None else os.environ.get("HFKIT_KERNEL_RESULTS", "h200")
    frame = load_kernel_results(source)
    if frame is None:
        return NotebookResults(
            None,
            None,
            [
                f"No kernel results yet in {str(source)!r}: run `hfkit bench evoformer_attention`, "
                "`hfkit bench softmax` and `hfkit bench triangle_multiplication` on an H200 to create "
                "data/results/h200/{evoformer_attention,softmax,triangle_multiplication}.json. The sections "
                "below are skipped."
            ],
        )
    commits = ", ".join(sorted({str(c)[:12] for c in frame["commit"]}))
    notes = [
        f"{file}: {group['command'].iloc[0]!r} at {group['timestamp'].iloc[0]} ({len(group)} rows)"
        for file, group in frame.groupby("file")
    ]
    return NotebookResults(frame, f"measured on {frame['gpu'].iloc[0]}, commit {commits}", notes)


def kernel_results(device: torch.device, smoke: bool, source: str | None = None) -> NotebookResults:
    """What notebook 04 shows: `measure_kernels` on a GPU, `committed_kernels(source)` elsewhere."""
    if device.type == "cuda":
        return measure_kernels(device, smoke)
    return committed_kernels(source)


def _number(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def kernel_goals(results: pd.DataFrame | Sequence[ResultRow], ours: str = OURS) -> pd.DataFrame:
    """The kernel benchmarks' targets against the rows at hand: triangle attention forward+backward
    (bf16) at least 3x faster than the best peer at N=1024 and 2x at every N, with peak memory no higher than
    trifast's; triangle multiplication forward+backward at N=1024 (outgoing, amp-bf16) within 5 ms;
    fused softmax at 80% of the copy bandwidth or more; at AlphaFold's training sizes (N = 256 and 384,
    bf16 forward+backward) triangle attention and triangle multiplication at least as fast as
    cuEquivariance and with no more peak memory, both as a CUDA graph and launched from Python. One
    line per goal and size, NaN where the rows needed are missing. Only rows timed as CUDA graphs
    count for the other goals (they are about the kernels)."""
    import pandas as pd

    every_launch = kernel_frame(results)
    frame = every_launch[every_launch["launch"] == "graph"]
    best = best_peer_table(frame, ours)
    records = []

    def add(goal: str, case: str, measured: float, target: float, higher_is_better: bool) -> None:
        met = (
            None if measured != measured else (measured >= target if higher_is_better else measured <= target)
        )
        records.append({"goal": goal, "case": case, "measured": measured, "target": target, "met": met})

    tri = best[(best["op"] == "triangle_attention") & (best["mode"] == "fwd+bwd") & (best["dtype"] == "bf16")]
    for _, r in tri.iterrows():
        target = 3.0 if r["case"] == "N=1024" else 2.0
        add("triangle attention fwd+bwd: speed-up vs best peer", r["case"], r["speed-up"], target, True)
    mem = frame[
        (frame["op"] == "triangle_attention") & (frame["mode"] == "fwd+bwd") & (frame["dtype"] == "bf16")
    ]
    for case, group in mem.groupby("case", sort=False):
        mine = group.loc[group["provider"] == ours, "peak_mib"]
        peer = group.loc[group["provider"] == "trifast", "peak_mib"]
        if len(mine) and len(peer):
            add(
                "triangle attention fwd+bwd: peak MiB vs trifast",
                case,
                float(mine.iloc[0]),
                float(peer.iloc[0]),
                False,
            )
    tm = frame[
        (frame["op"] == "triangle_multiplication")
        & (frame["provider"] == ours)
        & (frame["mode"] == "fwd+bwd")
        & (frame["dtype"] == "amp-bf16")
        & (frame["case"] == "N=1024 outgoing")
    ]
    if len(tm):
        add(
            "triangle multiplication fwd+bwd ms (amp-bf16)",
            "N=1024 outgoing",
            float(tm["p50_ms"].iloc[0]),
            5.0,
            False,
        )
    sm = frame[(frame["op"] == "softmax") & (frame["provider"] == ours)]
    for _, r in sm.iterrows():
        add(f"softmax % of copy bandwidth ({r['dtype']} {r['mode']})", r["case"], r["pct_copy"], 80.0, True)
    training = every_launch[
        every_launch["op"].isin(["triangle_attention", "triangle_multiplication"])
        & (every_launch["mode"] == "fwd+bwd")
        & every_launch["dtype"].isin(["bf16", "amp-bf16"])
        & every_launch["n"].isin([256, 384])
        & every_launch["error"].isna()
    ]
    for (op, case, dtype, launch), group in training.groupby(["op", "case", "dtype", "launch"], sort=False):
        mine = group[group["provider"] == ours]
        peer = group[group["provider"] == "cuequivariance"]
        if len(mine) and len(peer):
            what = f"{op} fwd+bwd ({dtype}, {launch})"
            ratio = float(peer["p50_ms"].iloc[0]) / float(mine["p50_ms"].iloc[0])
            add(f"{what}: speed-up vs cuEquivariance", case, ratio, 1.0, True)
            mem = float(mine["peak_mib"].iloc[0]) / float(peer["peak_mib"].iloc[0])
            add(f"{what}: peak memory / cuEquivariance's", case, mem, 1.0, False)
    return pd.DataFrame.from_records(records, columns=["goal", "case", "measured", "target", "met"])


def goal_sentences(goals: pd.DataFrame) -> list[str]:
    """One sentence per target of `kernel_goals`' table: in how many of the measured cases it is
    reached, then each case's measurement against its target (targets with no measurement say so)."""
    sentences = []
    for goal, group in goals.groupby("goal", sort=False):
        measured = group[group["measured"].notna()]
        if measured.empty:
            sentences.append(f"{goal}: not measured in these results.")
            continue
        reached = int((measured["met"] == True).sum())  # noqa: E712 (met holds True/False/None)
        cases = "; ".join(
            f"{r.case}: {_number(r.measured)} against {_number(r.target)}"
            for r in measured.itertuples(index=False)
        )
        noun = "case" if len(measured) == 1 else "cases"
        sentences.append(f"{goal}: reached in {reached} of {len(measured)} {noun} ({cases}).")
    return sentences
