"""Transitions: the two-layer feed-forward networks of the MSA (AF2 supplement Algorithm 9, see
`evoformer.MSATransition`) and pair (Algorithm 15) representations."""

from __future__ import annotations

import torch
from torch import nn

from hfkit.model.primitives import chunk_apply, linear

__all__ = ["PairTransition", "Transition"]


class Transition(nn.Module):
    """LayerNorm -> Linear(c, n*c) -> ReLU -> Linear(n*c, c), masked (`layer_norm`, `linear_1`,
    `linear_2`, as OpenFold)."""

    def __init__(self, c: int, n: int) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(c)
        self.linear_1 = linear(c, n * c, init="relu")
        self.relu = nn.ReLU()
        self.linear_2 = linear(n * c, c, init="final")

    def _transition(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.relu(self.linear_1(x))) * mask

    def add_transition_(self, x: torch.Tensor, normed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x += `_transition(normed, mask)` in place (inference, no autograd; normed = layer_norm(x),
        mask [*, 1]); returns x. hfkit's fused transitions mask and add in one pass."""
        return x.add_(self._transition(normed, mask))

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int | None = None
    ) -> torch.Tensor:
        """x: [*, R, N, C], mask: [*, R, N] -> update [*, R, N, C]; `chunk_size` rows at a time."""
        if mask is None:
            mask = x.new_ones(x.shape[:-1])
        x = self.layer_norm(x)
        return chunk_apply(self._transition, [x, mask.to(x.dtype)[..., None]], [-3, -3], -3, chunk_size)


class PairTransition(Transition):
    """Algorithm 15: transition layer of the pair representation (hidden n * c_z)."""

    def __init__(self, c_z: int, n: int) -> None:
        super().__init__(c_z, n)
