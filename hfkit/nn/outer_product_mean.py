"""`hfkit.nn.OuterProductMean`: the Evoformer's outer product mean with its [*, N, N, c*c] outer product
recomputed in the backward (`hfkit.ops.outer_product_linear`) instead of kept from the forward.

It subclasses the model's module (OpenFold's parameter names: `layer_norm`, `linear_1`, `linear_2`,
`linear_out`), so constructor, parameters and state_dict are the model's; only the outer product and its
projection change. The block then keeps the two [*, S, N, c] projections for the backward, not the
outer product: 128 MB less per Evoformer block at AlphaFold's sizes in bfloat16, for two matmuls more
(the outer product again, and its gradient once more, in the layout the other operand's gradient needs).
Importing this file registers the swap used by `hfkit.to_hfkit`.
"""

from __future__ import annotations

import torch

from hfkit.model.outer_product_mean import OuterProductMean as _PlainOuterProductMean
from hfkit.nn.attention import fusable_linears, linears_of
from hfkit.nn.convert import register_swap
from hfkit.nn.layer_norm import matmul_dtype
from hfkit.ops.elementwise import row_scale, row_scale_add_
from hfkit.ops.outer_product_linear import outer_product_linear

__all__ = ["OuterProductMean"]


class OuterProductMean(_PlainOuterProductMean):
    """`hfkit.model.OuterProductMean` (AF2 Algorithm 10) with the outer product recomputed in the backward
    (`linear_out`'s parameters are read directly: its forward hooks, if any, do not run), and
    linear_1 and linear_2 as one `hfkit.ops.multi_linear` where they are plain linears (one gradient
    of the normalized MSA, no autograd add), and the division by the row counts as `row_scale`."""

    def _project(self, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        layers = (self.linear_1, self.linear_2)
        # Where one multi_linear reads the LayerNorm's output, under autocast it is written in that dtype.
        out_dtype = matmul_dtype(self.layer_norm, m) if fusable_linears(m, layers) else None
        ln = self.layer_norm(m) if out_dtype is None else self.layer_norm(m, out_dtype=out_dtype)
        return linears_of(ln, layers)

    def _normalize(self, outer: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return row_scale(outer, count, divide=True)

    def add_normalized_(self, z: torch.Tensor, outer: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return row_scale_add_(z, outer, count, divide=True)

    def _outer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = self.linear_out
        return outer_product_linear(a, b, out.weight, out.bias)


register_swap(_PlainOuterProductMean, OuterProductMean)
