"""Plotly figures and ipywidgets panels for the notebooks (plotly/ipywidgets imported on first use)."""

from hfkit.viz.figures import LayerNormExplorer, layernorm_explorer, pct_copy_bars, speedup_bars, time_bars

__all__ = ["LayerNormExplorer", "layernorm_explorer", "pct_copy_bars", "speedup_bars", "time_bars"]
