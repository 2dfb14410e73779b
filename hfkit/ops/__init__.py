"""Fused ops: one file per op, each with Triton kernels, an autograd path and a plain-torch reference."""

from hfkit.ops.layer_norm import layer_norm, layer_norm_reference

__all__ = ["layer_norm", "layer_norm_reference"]
