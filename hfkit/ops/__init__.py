"""Fused ops: one file per op, each with Triton kernels, an autograd path and a plain-torch reference."""

from hfkit.ops.evoformer_attention import evoformer_attention, evoformer_attention_reference
from hfkit.ops.layer_norm import layer_norm, layer_norm_reference
from hfkit.ops.softmax import softmax, softmax_reference

__all__ = [
    "evoformer_attention",
    "evoformer_attention_reference",
    "layer_norm",
    "layer_norm_reference",
    "softmax",
    "softmax_reference",
]
