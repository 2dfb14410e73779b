"""MSA attention: row-wise gated self-attention with pair bias (AF2 supplement Algorithm 7),
column-wise gated self-attention (Algorithm 8) and the extra-MSA stack's global column attention
(Algorithm 19), with OpenFold's module and parameter names."""

from __future__ import annotations

import torch
from torch import nn

from hfkit.model.primitives import Attention, attend_rows, chunk_apply, linear, mask_bias

__all__ = [
    "GlobalAttention",
    "MSAAttention",
    "MSAColumnAttention",
    "MSAColumnGlobalAttention",
    "MSARowAttentionWithPairBias",
]


class MSAAttention(nn.Module):
    """Gated self-attention along the residues of each MSA row, optionally biased by the pair
    representation (`layer_norm_m`, `layer_norm_z` + `linear_z` when `pair_bias`, `mha`)."""

    def __init__(
        self,
        c_in: int,
        c_hidden: int,
        no_heads: int,
        pair_bias: bool = False,
        c_z: int | None = None,
        inf: float = 1e9,
    ) -> None:
        super().__init__()
        if pair_bias and c_z is None:
            raise ValueError("c_z: expected the pair channel count when pair_bias=True, got None")
        self.no_heads = no_heads
        self.inf = inf
        self.layer_norm_m = nn.LayerNorm(c_in)
        self.layer_norm_z = nn.LayerNorm(c_z) if pair_bias else None
        self.linear_z = linear(c_z, no_heads, bias=False, init="normal") if pair_bias else None
        self.mha = Attention(c_in, c_in, c_in, c_hidden, no_heads)

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        chunk_size: int | None = None,
    ) -> torch.Tensor:
        """m: [*, S, N, C_m], z: [*, N, N, C_z] (pair bias only), mask: [*, S, N] -> update [*, S, N, C_m].

        Masked residues are never attended to; `chunk_size` processes that many rows at a time.
        """
        m = self.layer_norm_m(m)
        if mask is None:
            mask = m.new_ones(m.shape[:-1])
        biases = [mask_bias(mask.to(m.dtype), self.inf)]
        if self.linear_z is not None:
            if z is None:
                raise ValueError("z: expected the pair representation [*, N, N, C_z], got None")
            # [*, N, N, H] -> [*, 1, H, N, N]: one bias per head, shared by all rows.
            pair = self.linear_z(self.layer_norm_z(z))
            biases.append(pair.movedim(-1, -3).unsqueeze(-4))
        return attend_rows(self.mha, m, biases, chunk_size)


class MSARowAttentionWithPairBias(MSAAttention):
    """Algorithm 7: MSA row-wise gated self-attention with pair bias."""

    def __init__(self, c_m: int, c_z: int, c_hidden: int, no_heads: int, inf: float = 1e9) -> None:
        super().__init__(c_m, c_hidden, no_heads, pair_bias=True, c_z=c_z, inf=inf)


class MSAColumnAttention(nn.Module):
    """Algorithm 8: MSA column-wise gated self-attention, a row attention (`_msa_att`, as OpenFold)
    over the transposed MSA."""

    def __init__(self, c_m: int, c_hidden: int, no_heads: int, inf: float = 1e9) -> None:
        super().__init__()
        self._msa_att = MSAAttention(c_m, c_hidden, no_heads, pair_bias=False, inf=inf)

    def forward(
        self, m: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int | None = None
    ) -> torch.Tensor:
        """m: [*, S, N, C_m], mask: [*, S, N] -> update [*, S, N, C_m]; chunks run over residues."""
        m = m.transpose(-2, -3)
        if mask is not None:
            mask = mask.transpose(-1, -2)
        return self._msa_att(m, mask=mask, chunk_size=chunk_size).transpose(-2, -3)


class GlobalAttention(nn.Module):
    """Global gated attention of Algorithm 19: one query per column (the masked mean over rows),
    one shared key/value head (`linear_q`, `linear_k`, `linear_v`, `linear_g`, `linear_o`, as
    OpenFold's `primitives.GlobalAttention`). `eps` guards the mean over no kept rows (OpenFold's config
    passes 1e-8). Plain torch."""

    def __init__(self, c_in: int, c_hidden: int, no_heads: int, inf: float = 1e9, eps: float = 1e-8) -> None:
        super().__init__()
        self.c_hidden = c_hidden
        self.no_heads = no_heads
        self.inf = inf
        self.eps = eps
        self.linear_q = linear(c_in, c_hidden * no_heads, bias=False, init="glorot")
        self.linear_k = linear(c_in, c_hidden, bias=False, init="glorot")
        self.linear_v = linear(c_in, c_hidden, bias=False, init="glorot")
        self.linear_g = linear(c_in, c_hidden * no_heads, init="gating")
        self.linear_o = linear(c_hidden * no_heads, c_in, init="final")

    def forward(self, m: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """m: [*, N_res, S, C] (columns first), mask: [*, N_res, S] -> [*, N_res, S, C]."""
        # [*, N_res, C] mean over the kept rows -> [*, N_res, H, c_hidden]
        q = (m * mask[..., None]).sum(-2) / (mask.sum(-1)[..., None] + self.eps)
        q = self.linear_q(q).unflatten(-1, (self.no_heads, self.c_hidden)) * self.c_hidden**-0.5
        k = self.linear_k(m)  # [*, N_res, S, c_hidden]
        v = self.linear_v(m)
        a = torch.matmul(q, k.transpose(-1, -2)) + (self.inf * (mask - 1.0))[..., None, :]
        o = torch.matmul(torch.softmax(a, dim=-1), v)  # [*, N_res, H, c_hidden]
        g = torch.sigmoid(self.linear_g(m)).unflatten(-1, (self.no_heads, self.c_hidden))
        return self.linear_o((o.unsqueeze(-3) * g).flatten(-2))


class MSAColumnGlobalAttention(nn.Module):
    """Algorithm 19: MSA global column-wise gated self-attention, used by the extra-MSA stack
    (`layer_norm_m`, `global_attention`)."""

    def __init__(self, c_in: int, c_hidden: int, no_heads: int, inf: float = 1e9, eps: float = 1e-8) -> None:
        super().__init__()
        self.layer_norm_m = nn.LayerNorm(c_in)
        self.global_attention = GlobalAttention(c_in, c_hidden, no_heads, inf=inf, eps=eps)

    def forward(
        self, m: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int | None = None
    ) -> torch.Tensor:
        """m: [*, S, N, C], mask: [*, S, N] -> update [*, S, N, C]; `chunk_size` columns at a time."""
        if mask is None:
            mask = m.new_ones(m.shape[:-1])
        m = self.layer_norm_m(m.transpose(-2, -3))
        mask = mask.to(m.dtype).transpose(-1, -2)
        out = chunk_apply(self.global_attention, [m, mask], [-3, -2], -3, chunk_size)
        return out.transpose(-2, -3)
