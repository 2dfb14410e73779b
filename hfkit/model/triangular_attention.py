"""Triangle self-attention around the starting node (AF2 supplement Algorithm 13) and around the
ending node (Algorithm 14) of each pair edge."""

from __future__ import annotations

import torch
from torch import nn

from hfkit.model.primitives import Attention, attend_rows, linear, mask_bias

__all__ = ["TriangleAttention", "TriangleAttentionEndingNode", "TriangleAttentionStartingNode"]


class TriangleAttention(nn.Module):
    """Gated attention of edge ij over edges ik (starting node) or, on the transposed pair
    representation, of ij over kj (ending node), biased by a projection of the third edge
    (`layer_norm`, `linear` (c_z -> heads, no bias), `mha`, as OpenFold)."""

    def __init__(
        self, c_in: int, c_hidden: int, no_heads: int, starting: bool = True, inf: float = 1e9
    ) -> None:
        super().__init__()
        self.starting = starting
        self.inf = inf
        self.layer_norm = nn.LayerNorm(c_in)
        self.linear = linear(c_in, no_heads, bias=False, init="normal")
        self.mha = Attention(c_in, c_in, c_in, c_hidden, no_heads)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int | None = None
    ) -> torch.Tensor:
        """x: [*, N, N, C_z], mask: [*, N, N] -> update [*, N, N, C_z]; `chunk_size` rows at a time."""
        if mask is None:
            mask = x.new_ones(x.shape[:-1])
        if not self.starting:
            x = x.transpose(-2, -3)
            mask = mask.transpose(-1, -2)
        x = self.layer_norm(x)
        # [*, I, J, H] -> [*, 1, H, I, J]: the bias b_jk of Alg. 13 line 3, shared by all rows i.
        triangle_bias = self.linear(x).movedim(-1, -3).unsqueeze(-4)
        x = attend_rows(self.mha, x, [mask_bias(mask.to(x.dtype), self.inf), triangle_bias], chunk_size)
        return x if self.starting else x.transpose(-2, -3)

    def add_update_(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x += forward(x, mask) in place (inference, no autograd); returns x. hfkit's fused module adds
        its output projection into x."""
        return x.add_(self(x, mask))


class TriangleAttentionStartingNode(TriangleAttention):
    """Algorithm 13: triangular gated self-attention around the starting node."""

    def __init__(self, c_in: int, c_hidden: int, no_heads: int, inf: float = 1e9) -> None:
        super().__init__(c_in, c_hidden, no_heads, starting=True, inf=inf)


class TriangleAttentionEndingNode(TriangleAttention):
    """Algorithm 14: triangular gated self-attention around the ending node."""

    def __init__(self, c_in: int, c_hidden: int, no_heads: int, inf: float = 1e9) -> None:
        super().__init__(c_in, c_hidden, no_heads, starting=False, inf=inf)
