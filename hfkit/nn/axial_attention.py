"""`hfkit.nn.TriangleAttentionEndingNode` and `hfkit.nn.MSAColumnAttention`: the attentions along the
columns of a representation (the ending-node triangle attention, AF2 Algorithm 14, and the MSA column
attention, Algorithm 8) without transposing copies of it; and `hfkit.nn.TriangleAttentionStartingNode`
(Algorithm 13), whose triangle bias projection joins the attention's own. Both run
`hfkit.nn.attention.attend_axis`.

The model's modules attend along columns by transposing the pair or MSA representation, which
`LayerNorm` then copies (its rows need one stride), and return a transposed update that the block's
residual add meets as a strided tensor. LayerNorm and every projection are pointwise over the (row,
column) positions, so here they run on the representation as it is laid out; only
`hfkit.ops.evoformer_attention` reads transposed views of the projections (it takes any strides), and
its output is laid out like them, so the update comes back [*, R, N, C] contiguous, for a plain
contiguous residual add (`attend_axis` along columns).

The classes subclass the model's, so constructor, parameters and state_dict are the model's; only
`forward` changes. They take this path where the gated attention `mha` (`_msa_att.mha`) is hfkit's
`EvoformerAttention` (swapped by `to_hfkit` as op "Attention") and its op runs Triton for the input;
everything else runs the model's forward. Importing this file registers both swaps used by
`hfkit.to_hfkit`.
"""

from __future__ import annotations

import torch
from torch import nn

from hfkit.model.msa import MSAColumnAttention as _PlainMSAColumnAttention
from hfkit.model.triangular_attention import TriangleAttentionEndingNode as _PlainEndingNode
from hfkit.model.triangular_attention import TriangleAttentionStartingNode as _PlainStartingNode
from hfkit.nn.attention import EvoformerAttention, attend_axis
from hfkit.nn.convert import register_swap

__all__ = [
    "MSAColumnAttention",
    "TriangleAttentionEndingNode",
    "TriangleAttentionStartingNode",
    "takes_column_path",
]


def takes_column_path(mha: nn.Module, x: torch.Tensor) -> bool:
    """Whether an axial attention with gated attention `mha` tries `attend_axis` on x [*, R, N, C]:
    where `mha` is hfkit's `EvoformerAttention` whose op runs Triton for x."""
    return isinstance(mha, EvoformerAttention) and not mha.holds_logits(x)


class _FusedTriangleAttention:
    """The triangle attentions' forward through `attend_axis` (along columns for the ending node,
    `_columns`, along rows for the starting node) where `takes_column_path`; inputs that path does not
    take, and chunked calls (`chunk_size` below N), run the model's forward."""

    _columns: bool

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int | None = None
    ) -> torch.Tensor:
        """x: [*, N, N, C_z], mask: [*, N, N] -> update [*, N, N, C_z] (contiguous on the fast path)."""
        update = None
        if takes_column_path(self.mha, x):
            update = attend_axis(
                self.mha, self.layer_norm, x, mask, self.inf, self.linear, chunk_size, columns=self._columns
            )
        return super().forward(x, mask, chunk_size) if update is None else update

    def add_update_(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x += forward(x, mask) in place, without autograd (`hfkit.model.inference.lean_forward`):
        on the fast path the gated output projection adds its result into x (`gated_output`), one pass
        over x instead of writing the update and adding it."""
        if takes_column_path(self.mha, x):
            args = (self.mha, self.layer_norm, x, mask, self.inf, self.linear)
            if attend_axis(*args, columns=self._columns, add_to=x) is not None:
                return x
        return super().add_update_(x, mask)  # the model's: x.add_(forward(x, mask))


class TriangleAttentionEndingNode(_FusedTriangleAttention, _PlainEndingNode):
    """`hfkit.model.TriangleAttentionEndingNode` (AF2 Algorithm 14) attending along the columns of the
    pair representation without transposing copies (`attend_axis` along columns)."""

    _columns = True


class TriangleAttentionStartingNode(_FusedTriangleAttention, _PlainStartingNode):
    """`hfkit.model.TriangleAttentionStartingNode` (AF2 Algorithm 13) with its triangle bias projection
    computed beside the attention's q, k, v and gate (`attend_axis` along rows: one gradient of the
    normalized pair representation instead of two summed by autograd)."""

    _columns = False


class MSAColumnAttention(_PlainMSAColumnAttention):
    """`hfkit.model.MSAColumnAttention` (AF2 Algorithm 8) attending along the MSA's columns without
    transposing copies (`attend_axis`); inputs that path does not take, and chunked calls
    (`chunk_size` below N), run the model's forward."""

    def forward(
        self, m: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int | None = None
    ) -> torch.Tensor:
        """m: [*, S, N, C_m], mask: [*, S, N] -> update [*, S, N, C_m] (contiguous on the fast path)."""
        att = self._msa_att
        update = None
        if takes_column_path(att.mha, m):
            update = attend_axis(att.mha, att.layer_norm_m, m, mask, att.inf, chunk_size=chunk_size)
        return super().forward(m, mask, chunk_size) if update is None else update


register_swap(_PlainEndingNode, TriangleAttentionEndingNode)
register_swap(_PlainStartingNode, TriangleAttentionStartingNode)
register_swap(_PlainMSAColumnAttention, MSAColumnAttention)
