"""hfkit's fused modules (drop-ins for model and torch modules) and the swaps `to_hfkit` / `to_torch`.

Each fused module subclasses a plain module of `hfkit.model` or of torch and registers its swap when
its file is imported; this package imports them all, so `to_hfkit` sees every registered op once
`hfkit.nn` is imported (`hfkit.nn.openfold` registers OpenFold's own classes by name). The plain
classes that the swaps replace (`Attention`, the shared dropouts) are re-exported from `hfkit.model`
so that each pair can be imported from one place.

`graph_modules(model)` (`hfkit.nn.graphed`) makes every Evoformer block replay its forward and
backward as CUDA graphs from the user's own training loop (`ungraph_modules` undoes it): use it where
the host, not the GPU, bounds a block launched from Python, on the static shapes that cropping and
padding give (each new shape is one more capture). Memory: every block keeps its activations in its
graph's pool, as training without checkpointing does; a checkpointed stack's blocks run eagerly.
"""

from hfkit.model.dropout import DropoutColumnwise, DropoutRowwise, SharedDropout
from hfkit.model.primitives import Attention
from hfkit.nn import openfold as _openfold  # noqa: F401  (importing it registers OpenFold's swaps)
from hfkit.nn.attention import EvoformerAttention
from hfkit.nn.axial_attention import (
    MSAColumnAttention,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
)
from hfkit.nn.convert import SwapReport, register_swap, to_hfkit, to_torch
from hfkit.nn.fused import FusedDropoutColumnwise, FusedDropoutRowwise, FusedSharedDropout
from hfkit.nn.graphed import GraphedForward, graph_modules, graphed_forwards, ungraph_modules
from hfkit.nn.layer_norm import LayerNorm
from hfkit.nn.lstm import LSTM
from hfkit.nn.multihead_attention import MultiheadAttention
from hfkit.nn.outer_product_mean import OuterProductMean
from hfkit.nn.transition import MSATransition, PairTransition
from hfkit.nn.triangle_multiplication import TriangleMultiplicationIncoming, TriangleMultiplicationOutgoing

__all__ = [
    "Attention",
    "DropoutColumnwise",
    "DropoutRowwise",
    "EvoformerAttention",
    "FusedDropoutColumnwise",
    "FusedDropoutRowwise",
    "FusedSharedDropout",
    "GraphedForward",
    "LSTM",
    "LayerNorm",
    "MSAColumnAttention",
    "MSATransition",
    "MultiheadAttention",
    "OuterProductMean",
    "PairTransition",
    "SharedDropout",
    "SwapReport",
    "TriangleAttentionEndingNode",
    "TriangleAttentionStartingNode",
    "TriangleMultiplicationIncoming",
    "TriangleMultiplicationOutgoing",
    "graph_modules",
    "graphed_forwards",
    "register_swap",
    "to_hfkit",
    "to_torch",
    "ungraph_modules",
]
