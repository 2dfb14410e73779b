"""Plotly figures and ipywidgets panels for the notebooks (plotly/ipywidgets imported on first use)."""

from hfkit.viz.figures import LayerNormExplorer, layernorm_explorer, pct_copy_bars, speedup_bars, time_bars
from hfkit.viz.kernels import (
    KernelExplorer,
    kernel_explorer,
    kernel_memory_figure,
    kernel_rate_figure,
    kernel_time_figure,
)
from hfkit.viz.model import (
    ProfileExplorer,
    SwapExplorer,
    census_figure,
    model_time_bars,
    op_share_bars,
    waterfall_figure,
    waterfall_frame,
)

__all__ = [
    "KernelExplorer",
    "LayerNormExplorer",
    "ProfileExplorer",
    "SwapExplorer",
    "census_figure",
    "kernel_explorer",
    "kernel_memory_figure",
    "kernel_rate_figure",
    "kernel_time_figure",
    "layernorm_explorer",
    "model_time_bars",
    "op_share_bars",
    "pct_copy_bars",
    "speedup_bars",
    "time_bars",
    "waterfall_figure",
    "waterfall_frame",
]
