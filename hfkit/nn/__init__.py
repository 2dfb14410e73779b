"""hfkit's fused modules (drop-ins for model and torch modules) and the swaps `to_hfkit` / `to_torch`.

Each fused module subclasses a plain module of `hfkit.model` or of torch and registers its swap when
its file is imported; this package imports them all, so `to_hfkit` sees every registered op once
`hfkit.nn` is imported (`hfkit.nn.openfold` registers OpenFold's own classes by name). The plain
classes that the swaps replace (`Attention`, the shared dropouts) are re-exported from `hfkit.model`
so that each pair can be imported from one place.
"""

from hfkit.model.dropout import DropoutColumnwise, DropoutRowwise, SharedDropout
from hfkit.model.primitives import Attention
from hfkit.nn import openfold as _openfold  # noqa: F401  (importing it registers OpenFold's swaps)
from hfkit.nn.attention import EvoformerAttention
from hfkit.nn.convert import SwapReport, register_swap, to_hfkit, to_torch
from hfkit.nn.fused import FusedDropoutColumnwise, FusedDropoutRowwise, FusedSharedDropout
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
    "LSTM",
    "LayerNorm",
    "MSATransition",
    "MultiheadAttention",
    "OuterProductMean",
    "PairTransition",
    "SharedDropout",
    "SwapReport",
    "TriangleMultiplicationIncoming",
    "TriangleMultiplicationOutgoing",
    "register_swap",
    "to_hfkit",
    "to_torch",
]
