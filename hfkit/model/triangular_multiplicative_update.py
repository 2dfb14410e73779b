"""Triangle multiplicative updates of the pair representation, "outgoing" and "incoming" edges
(AF2 supplement Algorithms 11 and 12)."""

from __future__ import annotations

import torch
from torch import nn

from hfkit.model.primitives import linear

__all__ = [
    "TriangleMultiplicationIncoming",
    "TriangleMultiplicationOutgoing",
    "TriangleMultiplicativeUpdate",
]


class TriangleMultiplicativeUpdate(nn.Module):
    """z_ij <- g_ij * Linear(LN(sum_k a_ik b_jk)) (outgoing) or sum_k a_ki b_kj (incoming), with a and b
    gated projections of LN(z) (names as OpenFold: `linear_{a,b}_{p,g}`, `linear_g`, `linear_z`,
    `layer_norm_in`, `layer_norm_out`)."""

    def __init__(self, c_z: int, c_hidden: int, outgoing: bool = True) -> None:
        super().__init__()
        self.outgoing = outgoing
        self.linear_a_p = linear(c_z, c_hidden)
        self.linear_a_g = linear(c_z, c_hidden, init="gating")
        self.linear_b_p = linear(c_z, c_hidden)
        self.linear_b_g = linear(c_z, c_hidden, init="gating")
        self.linear_g = linear(c_z, c_z, init="gating")
        self.linear_z = linear(c_hidden, c_z, init="final")
        self.layer_norm_in = nn.LayerNorm(c_z)
        self.layer_norm_out = nn.LayerNorm(c_hidden)

    def forward(self, z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """z: [*, N, N, C_z], mask: [*, N, N] -> update [*, N, N, C_z]; masked pairs contribute 0."""
        if mask is None:
            mask = z.new_ones(z.shape[:-1])
        mask = mask.to(z.dtype)[..., None]
        z = self.layer_norm_in(z)
        a = mask * torch.sigmoid(self.linear_a_g(z)) * self.linear_a_p(z)
        b = mask * torch.sigmoid(self.linear_b_g(z)) * self.linear_b_p(z)
        # Channels first so that the sum over k is one batched matmul: [*, C, N, N].
        a = a.movedim(-1, -3)
        b = b.movedim(-1, -3)
        # Outgoing: x_ij = sum_k a_ik b_jk; incoming: x_ij = sum_k a_ki b_kj.
        x = torch.matmul(a, b.transpose(-1, -2)) if self.outgoing else torch.matmul(a.transpose(-1, -2), b)
        x = self.linear_z(self.layer_norm_out(x.movedim(-3, -1)))
        return x * torch.sigmoid(self.linear_g(z))

    def add_update_(self, z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """z += forward(z, mask) in place (inference, no autograd); returns z. hfkit's fused module
        adds the update inside its output kernel."""
        return z.add_(self(z, mask))


class TriangleMultiplicationOutgoing(TriangleMultiplicativeUpdate):
    """Algorithm 11: triangular multiplicative update using "outgoing" edges."""

    def __init__(self, c_z: int, c_hidden: int) -> None:
        super().__init__(c_z, c_hidden, outgoing=True)


class TriangleMultiplicationIncoming(TriangleMultiplicativeUpdate):
    """Algorithm 12: triangular multiplicative update using "incoming" edges."""

    def __init__(self, c_z: int, c_hidden: int) -> None:
        super().__init__(c_z, c_hidden, outgoing=False)
