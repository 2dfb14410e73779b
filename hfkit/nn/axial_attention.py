"""`hfkit.nn.TriangleAttentionEndingNode` and `hfkit.nn.MSAColumnAttention`: the attentions along the
columns of a representation (the ending-node triangle attention, AF2 Algorithm 14, and the MSA column
attention, Algorithm 8) without transposing copies of it.

The model's modules attend along columns by transposing the pair or MSA representation, which
`LayerNorm` then copies (its rows need one stride), and return a transposed update that the block's
residual add meets as a strided tensor. LayerNorm and every projection are pointwise over the (row,
column) positions, so here they run on the representation as it is laid out; only
`hfkit.ops.evoformer_attention` reads transposed views of the projections (it takes any strides), and
its output is laid out like them, so the update comes back [*, R, N, C] contiguous, for a plain
contiguous residual add (`hfkit.nn.attention.fused_gated_attention` with `transposed=True`).

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
from hfkit.model.primitives import mask_bias
from hfkit.model.triangular_attention import TriangleAttentionEndingNode as _PlainEndingNode
from hfkit.nn.attention import EvoformerAttention, fused_gated_attention, map_attention_biases
from hfkit.nn.convert import register_swap

__all__ = ["MSAColumnAttention", "TriangleAttentionEndingNode", "attend_columns"]


def attend_columns(
    mha: nn.Module,
    layer_norm: nn.Module,
    x: torch.Tensor,
    mask: torch.Tensor | None,
    inf: float,
    chunk_size: int | None,
    bias_projection: nn.Module | None = None,
) -> torch.Tensor | None:
    """The update of gated self-attention `mha` within the columns of `layer_norm(x)`, x [*, R, N, C]
    (at most one leading dim), mask [*, R, N] (None: all kept), with the key mask bias
    `inf * (mask - 1)` and, with `bias_projection` (C -> heads), the triangle bias of the ending node:
    the bias of query row i and key row k in column j is `bias_projection(layer_norm(x))[k, i]`.
    Returns the update [*, R, N, C] laid out like x (contiguous for a contiguous x), equal to the
    model's row attention on the transposed x, transposed back; None where this path does not apply
    (`mha` not an `EvoformerAttention` whose op runs Triton for x; `chunk_size` below N, the number
    of attended columns; more leading dims; a mask that requires grad): the caller runs its plain
    forward then. Unchunked: the fused op keeps no logits, so chunks would only save the [*, R, N, C]
    projections."""
    if not isinstance(mha, EvoformerAttention) or mha.holds_logits(x):
        return None
    if chunk_size is not None and chunk_size < x.shape[-2]:
        return None
    if x.dim() not in (3, 4) or (mask is not None and mask.requires_grad):
        return None
    xn = layer_norm(x)
    if mask is None:
        mask = xn.new_ones(xn.shape[:-1])
    # The biases of the model's row attention on the transposed x: views, no copies.
    biases = [mask_bias(mask.to(xn.dtype).transpose(-1, -2), inf)]
    if bias_projection is not None:
        biases.append(bias_projection(xn).transpose(-2, -3).movedim(-1, -3).unsqueeze(-4))
    xn_t = xn.transpose(-2, -3)
    mapped = map_attention_biases(xn_t, xn_t, biases)
    if mapped is None:
        return None
    return fused_gated_attention(mha, xn, xn, mapped, transposed=True)


class TriangleAttentionEndingNode(_PlainEndingNode):
    """`hfkit.model.TriangleAttentionEndingNode` (AF2 Algorithm 14) attending along the columns of the
    pair representation without transposing copies (`attend_columns`); inputs that path does not
    take, and chunked calls (`chunk_size` below N), run the model's forward."""

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int | None = None
    ) -> torch.Tensor:
        """x: [*, N, N, C_z], mask: [*, N, N] -> update [*, N, N, C_z] (contiguous on the fast path)."""
        update = attend_columns(
            self.mha, self.layer_norm, x, mask, self.inf, chunk_size, bias_projection=self.linear
        )
        return super().forward(x, mask, chunk_size) if update is None else update


class MSAColumnAttention(_PlainMSAColumnAttention):
    """`hfkit.model.MSAColumnAttention` (AF2 Algorithm 8) attending along the MSA's columns without
    transposing copies (`attend_columns`); inputs that path does not take, and chunked calls
    (`chunk_size` below N), run the model's forward."""

    def forward(
        self, m: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int | None = None
    ) -> torch.Tensor:
        """m: [*, S, N, C_m], mask: [*, S, N] -> update [*, S, N, C_m] (contiguous on the fast path)."""
        att = self._msa_att
        update = attend_columns(att.mha, att.layer_norm_m, m, mask, att.inf, chunk_size)
        return super().forward(m, mask, chunk_size) if update is None else update


register_swap(_PlainEndingNode, TriangleAttentionEndingNode)
register_swap(_PlainMSAColumnAttention, MSAColumnAttention)
