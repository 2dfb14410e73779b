"""Outer product mean (AF2 supplement Algorithm 10): the MSA -> pair communication."""

from __future__ import annotations

import torch
from torch import nn

from hfkit.model.primitives import chunk_apply, linear

__all__ = ["OuterProductMean"]


class OuterProductMean(nn.Module):
    """Mean over MSA rows of the outer product of two projections of the MSA, projected to c_z.

    Parameters as OpenFold: `layer_norm`, `linear_1`, `linear_2` (c_m -> c_hidden), `linear_out`
    (c_hidden^2 -> c_z). The mean is over rows kept by the mask (normalised by eps + count).
    """

    def __init__(self, c_m: int, c_z: int, c_hidden: int, eps: float = 1e-3) -> None:
        super().__init__()
        self.eps = eps
        self.layer_norm = nn.LayerNorm(c_m)
        self.linear_1 = linear(c_m, c_hidden)
        self.linear_2 = linear(c_m, c_hidden)
        self.linear_out = linear(c_hidden * c_hidden, c_z, init="final")

    def _outer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # a: [*, S, I, C], b: [*, S, J, E] -> [*, I, J, C*E] -> [*, I, J, C_z]
        outer = torch.einsum("...sic,...sje->...ijce", a, b)
        return self.linear_out(outer.flatten(-2))

    def _normalize(self, outer: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """outer [*, N, N, C_z] / count [*, N, N, 1] (eps + the rows where both residues are present)."""
        return outer / count

    def add_normalized_(self, z: torch.Tensor, outer: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """z += `_normalize(outer, count)` in place (inference, no autograd); returns z. hfkit's fused
        module divides and adds in one pass."""
        return z.add_(self._normalize(outer, count))

    def _project(self, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear_1(ln), linear_2(ln)) of ln = layer_norm(m)."""
        ln = self.layer_norm(m)
        return self.linear_1(ln), self.linear_2(ln)

    def forward(
        self, m: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int | None = None
    ) -> torch.Tensor:
        """m: [*, S, N, C_m], mask: [*, S, N] -> pair update [*, N, N, C_z]; chunks over rows i."""
        if mask is None:
            mask = m.new_ones(m.shape[:-1])
        mask = mask.to(m.dtype)[..., None]
        a, b = self._project(m)
        a, b = a * mask, b * mask
        outer = chunk_apply(lambda a_: self._outer(a_, b), [a], [-2], -3, chunk_size)
        # Number of rows where both residues are present: [*, N, N, 1].
        norm = torch.einsum("...sia,...sja->...ija", mask, mask)
        return self._normalize(outer, self.eps + norm)
