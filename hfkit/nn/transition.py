"""`hfkit.nn.MSATransition` / `hfkit.nn.PairTransition`: the Evoformer's transitions with their hidden
layer recomputed in the backward (`hfkit.ops.relu_mlp`) instead of kept from the forward.

They subclass the model's transitions (OpenFold's parameter names: `layer_norm`, `linear_1`,
`linear_2`), so constructor, parameters and state_dict are the model's; only the feed-forward part of
`forward` changes. Each transition then keeps its [*, c] input for the backward, not its [*, 4 c]
hidden layer: 64 MB less per transition at AlphaFold's sizes in bfloat16, for one matmul more.
Importing this file registers both swaps used by `hfkit.to_hfkit`.
"""

from __future__ import annotations

import torch

from hfkit.model.evoformer import MSATransition as _PlainMSATransition
from hfkit.model.pair_transition import PairTransition as _PlainPairTransition
from hfkit.model.primitives import chunk_apply
from hfkit.nn.convert import register_swap
from hfkit.nn.layer_norm import matmul_dtype
from hfkit.ops.elementwise import row_scale_add_
from hfkit.ops.relu_mlp import relu_mlp

__all__ = ["MSATransition", "PairTransition"]


class _RecomputedHidden:
    """The transitions' `_transition` through `relu_mlp` (linear_1 and linear_2's parameters are read
    directly: their forward hooks, if any, do not run), masked inside it; under autocast the
    LayerNorm writes the autocast dtype (`matmul_dtype`)."""

    layer_norm: torch.nn.Module
    linear_1: torch.nn.Linear
    linear_2: torch.nn.Linear

    def _transition(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        l1, l2 = self.linear_1, self.linear_2
        return relu_mlp(x, l1.weight, l1.bias, l2.weight, l2.bias, mask)

    def add_transition_(self, x: torch.Tensor, normed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        l1, l2 = self.linear_1, self.linear_2
        return row_scale_add_(x, relu_mlp(normed, l1.weight, l1.bias, l2.weight, l2.bias), mask)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int | None = None
    ) -> torch.Tensor:
        """The model's transition; under autocast hfkit's LayerNorm writes the autocast dtype
        (`matmul_dtype`), which `relu_mlp` would cast its input to."""
        out_dtype = matmul_dtype(self.layer_norm, x)
        if out_dtype is None:
            return super().forward(x, mask, chunk_size)  # type: ignore[misc]
        if mask is None:
            mask = x.new_ones(x.shape[:-1])
        xn = self.layer_norm(x, out_dtype=out_dtype)
        return chunk_apply(self._transition, [xn, mask.to(x.dtype)[..., None]], [-3, -3], -3, chunk_size)


class MSATransition(_RecomputedHidden, _PlainMSATransition):
    """`hfkit.model.MSATransition` (AF2 Algorithm 9) with the hidden layer recomputed in the backward."""


class PairTransition(_RecomputedHidden, _PlainPairTransition):
    """`hfkit.model.PairTransition` (AF2 Algorithm 15) with the hidden layer recomputed in the backward."""


register_swap(_PlainMSATransition, MSATransition)
register_swap(_PlainPairTransition, PairTransition)
