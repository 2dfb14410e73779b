"""Fused ops: one file per op (reference, input checks, autograd, dispatch; long Triton kernels beside it
in `_<op>_kernels.py`), and `reference_on_cpu()`, which sends CPU tensors to the references."""

from hfkit.ops._triton import reference_on_cpu
from hfkit.ops.elementwise import (
    bias_dropout_add,
    bias_dropout_add_reference,
    row_scale,
    row_scale_add_,
    row_scale_reference,
    sigmoid_gate,
    sigmoid_gate_reference,
)
from hfkit.ops.evoformer_attention import evoformer_attention, evoformer_attention_reference
from hfkit.ops.gated_linear import gated_linear, gated_linear_add_, gated_linear_reference
from hfkit.ops.layer_norm import layer_norm, layer_norm_reference
from hfkit.ops.linear import linear, linear_reference
from hfkit.ops.lstm import lstm_layer, lstm_reference
from hfkit.ops.multihead_attention import multihead_attention, multihead_attention_reference
from hfkit.ops.outer_product_linear import outer_product_linear, outer_product_linear_reference
from hfkit.ops.relu_mlp import relu_mlp, relu_mlp_reference
from hfkit.ops.softmax import softmax, softmax_reference
from hfkit.ops.triangle_multiplication import triangle_multiplication, triangle_multiplication_reference

__all__ = [
    "bias_dropout_add",
    "bias_dropout_add_reference",
    "evoformer_attention",
    "evoformer_attention_reference",
    "gated_linear",
    "gated_linear_add_",
    "gated_linear_reference",
    "layer_norm",
    "layer_norm_reference",
    "linear",
    "linear_reference",
    "lstm_layer",
    "lstm_reference",
    "multihead_attention",
    "multihead_attention_reference",
    "outer_product_linear",
    "outer_product_linear_reference",
    "reference_on_cpu",
    "relu_mlp",
    "relu_mlp_reference",
    "row_scale",
    "row_scale_add_",
    "row_scale_reference",
    "sigmoid_gate",
    "sigmoid_gate_reference",
    "softmax",
    "softmax_reference",
    "triangle_multiplication",
    "triangle_multiplication_reference",
]
