"""Plotly figures of benchmark results, and the ipywidgets LayerNorm explorer used by the notebooks.

Figures take the DataFrame of `hfkit.bench.load_results` / `rows_to_frame` (one row per op, provider,
mode, shape and dtype). plotly and ipywidgets are optional extras (`pip install hfkit[notebooks]`), so
they are imported inside the functions that need them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hfkit.bench.results import rows_to_frame, with_speedup

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go
    import torch

__all__ = [
    "LayerNormExplorer",
    "layernorm_explorer",
    "pct_copy_bars",
    "speedup_bars",
    "time_bars",
]

PROVIDER_ORDER = ["torch", "compile", "hfkit"]
PROVIDER_COLORS = {"torch": "#7f7f7f", "compile": "#1f77b4", "hfkit": "#d62728"}


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


def speedup_bars(frame: pd.DataFrame, baseline: str = "torch", title: str | None = None) -> go.Figure:
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
    `run()` does what the button does, so code (and tests) can drive it without a browser.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        providers: Sequence[str] = ("hfkit", "torch", "compile"),
    ) -> None:
        import ipywidgets as widgets

        from hfkit.bench.ceilings import resolve_device
        from hfkit.bench.layernorm import FULL_SHAPES

        self.device = resolve_device(device)
        self.providers = tuple(providers)
        self._ceilings = None
        options = [("x".join(map(str, s)), s) for s in FULL_SHAPES]
        self.shape = widgets.Dropdown(options=options, value=FULL_SHAPES[0], description="shape")
        self.dtype = widgets.Dropdown(options=["bf16", "fp32"], value="bf16", description="dtype")
        self.button = widgets.Button(description="run", button_style="primary", icon="play")
        self.output = widgets.Output()
        self.button.on_click(lambda _: self.run())
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

    def run(self) -> pd.DataFrame:
        """Benchmark the selected shape and dtype now; show and return the summary table."""
        from IPython.display import display

        from hfkit.bench.ceilings import bench_ceilings
        from hfkit.bench.layernorm import run_layernorm_benchmark, smoke_shape, summary_table

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
        self.output.clear_output(wait=True)
        with self.output:
            display(self.last_table)
            display(time_bars(frame, title=f"LayerNorm {'x'.join(map(str, shape))} {self.dtype.value}"))
        return self.last_table

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)


def layernorm_explorer(
    device: torch.device | str | None = None, providers: Sequence[str] = ("hfkit", "torch", "compile")
) -> LayerNormExplorer:
    """Build the LayerNorm explorer (see `LayerNormExplorer`); display it in a notebook cell."""
    return LayerNormExplorer(device, providers)
