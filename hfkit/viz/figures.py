"""Plotly figures of benchmark results, the ipywidgets LayerNorm explorer used by the notebooks, and
`layernorm_results` (notebook 00's speed results: measured now on a GPU, committed elsewhere).

Figures take the DataFrame of `hfkit.bench.load_results` / `rows_to_frame` (one row per op, provider,
mode, shape and dtype). plotly and ipywidgets are optional extras (`pip install hfkit[notebooks]`), so
they are imported inside the functions that need them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hfkit.bench import bench_ceilings, layernorm_errors, summary_table
from hfkit.bench.cases.layer_norm import HFAI_SHAPE
from hfkit.bench.results import rows_to_frame, with_speedup
from hfkit.viz.notebook import NotebookResults, render_into, show_static_then_widget

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go
    import torch

__all__ = [
    "LayerNormExplorer",
    "bench_ceilings",
    "layernorm_errors",
    "layernorm_results",
    "summary_table",
    "layernorm_explorer",
    "pct_copy_bars",
    "speedup_bars",
    "time_bars",
]

# `bench_ceilings`, `layernorm_errors` and `summary_table` (of LayerNorm rows) are re-exported for
# notebook 00, which imports from viz only.

# A GPU run of notebook 00 at the smoke profile: five shapes of the census (the most frequent, the
# largest, a small one and hfai.nn's own shape) at their real sizes, so the numbers stay measurements.
GPU_SMOKE_SHAPES: tuple[tuple[int, ...], ...] = (
    (1, 256, 256, 128),
    (1, 4, 256, 256, 64),
    (1, 256, 384),
    (1, 256, 256),
    HFAI_SHAPE,
)

PROVIDER_ORDER = ["eager", "compile", "hfkit"]
PROVIDER_COLORS = {"eager": "#7f7f7f", "compile": "#1f77b4", "hfkit": "#d62728"}


def _prepare(frame: pd.DataFrame) -> pd.DataFrame:
    if "shape_str" not in frame or "p50_us" not in frame:
        frame = rows_to_frame(frame.to_dict("records"))
    return frame


def _bars(
    frame: pd.DataFrame, y: str, y_title: str, title: str | None, log_y: bool = False, **kwargs: Any
) -> go.Figure:
    import plotly.express as px

    facet_row = "mode" if frame["mode"].nunique() > 1 else None
    facet_col = "dtype" if frame["dtype"].nunique() > 1 else None
    providers = [p for p in PROVIDER_ORDER if p in set(frame["provider"])]
    providers += sorted(set(frame["provider"]) - set(providers))
    fig = px.bar(
        frame,
        x="shape_str",
        y=y,
        color="provider",
        barmode="group",
        facet_row=facet_row,
        facet_col=facet_col,
        log_y=log_y,
        category_orders={
            "provider": providers,
            "shape_str": list(dict.fromkeys(frame["shape_str"])),
            "mode": ["fwd", "fwd+bwd"],
            # only the dtypes present: plotly draws an empty facet for a listed category with no data
            "dtype": [d for d in ("fp32", "bf16", "fp16") if d in set(frame["dtype"])],
        },
        color_discrete_map=PROVIDER_COLORS,
        labels={"shape_str": "shape", y: y_title},
        title=title,
        hover_data=[c for c in ("p20_ms", "p50_ms", "p80_ms", "gbps", "method") if c in frame],
        **kwargs,
    )
    rows = frame["mode"].nunique() if facet_row else 1
    fig.update_layout(height=320 * rows + 120, legend_title_text="provider")
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
    return fig


def time_bars(frame: pd.DataFrame, title: str | None = None, log_y: bool = True) -> go.Figure:
    """Grouped bars of p50 time (µs) per shape, one colour per provider, faceted by mode and dtype."""
    return _bars(
        _prepare(frame), "p50_us", "p50 time (µs)", title or "time per call (lower is better)", log_y
    )


def pct_copy_bars(frame: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Grouped bars of achieved bandwidth as % of the copy ceiling measured in the same run; a dashed
    line at 100% marks the ceiling."""
    fig = _bars(_prepare(frame), "pct_copy", "% of copy bandwidth", title or "% of copy bandwidth")
    fig.add_hline(y=100, line_dash="dash", line_color="black", opacity=0.5)
    return fig


def speedup_bars(frame: pd.DataFrame, baseline: str = "eager", title: str | None = None) -> go.Figure:
    """Grouped bars of speed-up over `baseline` (its p50 over each provider's p50); 1 is a dashed line."""
    data = with_speedup(_prepare(frame), baseline)
    data = data[data["provider"] != baseline]
    fig = _bars(data, "speedup", f"speed-up vs {baseline}", title or f"speed-up vs {baseline}")
    fig.add_hline(y=1, line_dash="dash", line_color="black", opacity=0.5)
    return fig


class LayerNormExplorer:
    """Dropdowns for a census shape and a dtype, and a button that reruns the LayerNorm comparison.

    Runs `run_layernorm_benchmark` on `device` (default: the GPU if any) for the chosen shape and
    dtype, in both modes and for every provider in `providers`, then shows the summary table and a
    time figure. On a CPU the shape is scaled down with `smoke_shape` so a click takes seconds.
    `run()` measures the current selection (what the button does, so code and tests can drive it
    without a browser); `show()` displays the last result as a static table and figure, then the widget.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        providers: Sequence[str] = ("hfkit", "eager", "compile"),
    ) -> None:
        import ipywidgets as widgets

        from hfkit.bench.cases.layer_norm import FULL_SHAPES
        from hfkit.bench.ceilings import resolve_device

        self.device = resolve_device(device)
        self.providers = tuple(providers)
        self._ceilings = None
        options = [("x".join(map(str, s)), s) for s in FULL_SHAPES]
        self.shape = widgets.Dropdown(options=options, value=FULL_SHAPES[0], description="shape")
        self.dtype = widgets.Dropdown(options=["bf16", "fp32"], value="bf16", description="dtype")
        self.button = widgets.Button(description="run", button_style="primary", icon="play")
        self.output = widgets.Output()
        self.button.on_click(self._on_click)
        where = (
            "GPU"
            if self.device.type == "cuda"
            else "CPU: the shape is scaled down and the times are a smoke test, not a measurement"
        )
        self.widget = widgets.VBox(
            [
                widgets.HBox([self.shape, self.dtype, self.button]),
                widgets.Label(f"runs on {self.device} ({where}); providers: {', '.join(self.providers)}"),
                self.output,
            ]
        )
        self.last_table: pd.DataFrame | None = None
        self.last_figure: go.Figure | None = None

    def run(self) -> pd.DataFrame:
        """Benchmark the selected shape and dtype now; return the summary table (kept as `last_table`,
        its time figure as `last_figure`)."""
        from hfkit.bench.cases.layer_norm import run_layernorm_benchmark, smoke_shape
        from hfkit.bench.ceilings import bench_ceilings

        shape = tuple(self.shape.value)
        on_cuda = self.device.type == "cuda"
        if not on_cuda:
            shape = smoke_shape(shape)
        if self._ceilings is None:  # measured once per explorer: the ceilings do not change per click
            self._ceilings = bench_ceilings(self.device)
        rows, _ = run_layernorm_benchmark(
            self.device,
            shapes=[shape],
            dtypes=[self.dtype.value],
            providers=self.providers,
            progress=False,
            ceilings=self._ceilings,
        )
        frame = rows_to_frame(rows)
        self.last_table = summary_table(frame)
        self.last_figure = time_bars(frame, title=f"LayerNorm {'x'.join(map(str, shape))} {self.dtype.value}")
        return self.last_table

    def _on_click(self, _: Any = None) -> None:
        self.run()
        render_into(self.output, self.last_table, self.last_figure)

    def show(self) -> None:
        """Display the last result (table and figure, static: readable in an HTML report), then the widget."""
        show_static_then_widget(self.widget, self.last_table, self.last_figure)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)


def layernorm_explorer(
    device: torch.device | str | None = None, providers: Sequence[str] = ("hfkit", "eager", "compile")
) -> LayerNormExplorer:
    """Build the LayerNorm explorer (see `LayerNormExplorer`); display it in a notebook cell."""
    return LayerNormExplorer(device, providers)


def layernorm_results(device: torch.device, smoke: bool, ceilings: Any = None) -> NotebookResults:
    """The LayerNorm speed results notebook 00 shows: on a GPU, `run_layernorm_benchmark` now (`smoke`:
    the `GPU_SMOKE_SHAPES` subset, else the "full" profile; `ceilings` measured once by the caller);
    elsewhere the committed H200 results (`data/results/h200/layer_norm.json`), labelled with the
    command, commit and time that made them, or a note on how to make them."""
    from hfkit.bench import load_results, run_layernorm_benchmark

    if device.type == "cuda":
        shapes = GPU_SMOKE_SHAPES if smoke else None
        rows, _ = run_layernorm_benchmark(device, shapes=shapes, profile="full", ceilings=ceilings)
        name = ceilings.device_name if ceilings is not None else str(device)
        return NotebookResults(rows_to_frame(rows), f"LayerNorm on {name} (measured now)")
    try:
        frame = load_results("h200", op="layer_norm")
    except FileNotFoundError as err:
        note = (
            f"No committed H200 results to show ({err}).\n"
            "Run `hfkit bench layer_norm` on an H200 to create data/results/h200/layer_norm.json."
        )
        return NotebookResults(None, None, [note])
    first = frame.iloc[0]
    label = "reference results: NVIDIA H200 (committed)"
    return NotebookResults(
        frame, label, [f"{label}: {first['command']!r} at commit {first['commit']}, {first['timestamp']}"]
    )
