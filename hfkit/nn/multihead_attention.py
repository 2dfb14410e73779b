"""`hfkit.nn.MultiheadAttention`: a drop-in `torch.nn.MultiheadAttention` whose forward runs
`hfkit.ops.multihead_attention`.

It subclasses `torch.nn.MultiheadAttention`, so the constructor, parameters (`in_proj_weight` or
`q_proj_weight`/`k_proj_weight`/`v_proj_weight`, `in_proj_bias`, `out_proj`, `bias_k`/`bias_v`),
`state_dict`, `extra_repr` and `isinstance` checks are torch's; only `forward` changes. Importing this
file registers the swap `torch.nn.MultiheadAttention` -> `hfkit.nn.MultiheadAttention` used by
`hfkit.to_hfkit`.
"""

from __future__ import annotations

import torch
from torch import nn

from hfkit.nn.convert import register_swap
from hfkit.ops import multihead_attention

__all__ = ["MultiheadAttention"]


class MultiheadAttention(nn.MultiheadAttention):
    """Multi-head attention computed by `hfkit.ops.multihead_attention` (SDPA when no weights are asked).

    Same constructor as `torch.nn.MultiheadAttention(embed_dim, num_heads, dropout=0.0, bias=True,
    add_bias_kv=False, add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
    dtype=None)` and the same `forward(query, key, value, key_padding_mask=None, need_weights=True,
    attn_mask=None, average_attn_weights=True, is_causal=False)`: query [L, B, E] ([B, L, E] with
    `batch_first`, [L, E] unbatched), key [S, B, kdim], value [S, B, vdim]; returns the output
    [L, B, E] and the attention weights ([B, L, S] averaged over heads, [B, H, L, S] without
    averaging) or None. Pass `need_weights=False` for the fast path. Nested-tensor inputs run torch's
    own forward, the only one that takes them.
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if query.is_nested or key.is_nested or value.is_nested:
            return super().forward(
                query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal
            )
        return multihead_attention(
            query,
            key,
            value,
            self.num_heads,
            self.in_proj_weight,
            self.in_proj_bias,
            self.out_proj.weight,
            self.out_proj.bias,
            q_proj_weight=self.q_proj_weight,
            k_proj_weight=self.k_proj_weight,
            v_proj_weight=self.v_proj_weight,
            bias_k=self.bias_k,
            bias_v=self.bias_v,
            add_zero_attn=self.add_zero_attn,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            need_weights=need_weights,
            average_attn_weights=average_attn_weights,
            is_causal=is_causal,
            dropout_p=self.dropout,
            training=self.training,
            batch_first=self.batch_first,
        )


register_swap(nn.MultiheadAttention, MultiheadAttention)
