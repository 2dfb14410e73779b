"""Plotly figures, ipywidgets panels and the notebook setup (plotly/ipywidgets imported on first use).

`setup_notebook()` is every notebook's first call; the per-notebook modules (`data_cost`, `comms`,
`model`, `kernels`, `figures`) hold what the notebooks run, so that tests reach it.
"""

from hfkit.viz.figures import LayerNormExplorer, layernorm_explorer, pct_copy_bars, speedup_bars, time_bars
from hfkit.viz.hfai import HFAI_PUBLISHED, hfai_comparison, hfai_figure, hfai_notes
from hfkit.viz.kernels import (
    KernelExplorer,
    goal_sentences,
    kernel_explorer,
    kernel_memory_figure,
    kernel_rate_figure,
    kernel_results,
    kernel_time_figure,
)
from hfkit.viz.model import (
    ProfileExplorer,
    census_figure,
    model_time_bars,
    op_share_bars,
    waterfall_figure,
    waterfall_frame,
)
from hfkit.viz.notebook import NotebookResults, NotebookSettings, plotly_js_path, setup_notebook

__all__ = [
    "HFAI_PUBLISHED",
    "KernelExplorer",
    "LayerNormExplorer",
    "NotebookResults",
    "NotebookSettings",
    "ProfileExplorer",
    "census_figure",
    "goal_sentences",
    "hfai_comparison",
    "hfai_figure",
    "hfai_notes",
    "kernel_explorer",
    "kernel_memory_figure",
    "kernel_rate_figure",
    "kernel_results",
    "kernel_time_figure",
    "layernorm_explorer",
    "model_time_bars",
    "op_share_bars",
    "pct_copy_bars",
    "plotly_js_path",
    "setup_notebook",
    "speedup_bars",
    "time_bars",
    "waterfall_figure",
    "waterfall_frame",
]
