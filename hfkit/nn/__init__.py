"""hfkit modules over the fused ops (drop-ins for torch modules) and the swaps `to_hfkit` / `to_torch`.

Each module file registers its torch -> hfkit swap when imported; this package imports them all, so
`to_hfkit` sees every registered op once `hfkit.nn` is imported.
"""

from hfkit.nn.attention import Attention, EvoformerAttention
from hfkit.nn.convert import SwapReport, register_swap, to_hfkit, to_torch
from hfkit.nn.fused import (
    DropoutColumnwise,
    DropoutRowwise,
    FusedDropoutColumnwise,
    FusedDropoutRowwise,
    FusedSharedDropout,
    SharedDropout,
)
from hfkit.nn.layer_norm import LayerNorm
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
    "LayerNorm",
    "MSATransition",
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
