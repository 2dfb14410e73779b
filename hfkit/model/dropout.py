"""Shared dropout (AF2 supplement 1.11.6): `SharedDropout` and OpenFold's `DropoutRowwise` /
`DropoutColumnwise`, which share one dropout mask along a row or column of the representation.

The Evoformer applies each one as `z = dropout.residual_add(z, update)`, i.e. `z + dropout(update)`, so
that a fused subclass (`hfkit.nn.FusedSharedDropout` and its row/column forms) can replace the dropout
and the add with one kernel. The modules have no parameters or buffers.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["DropoutColumnwise", "DropoutRowwise", "SharedDropout"]


class SharedDropout(nn.Module):
    """Dropout whose mask is shared along `shared_dim` (the mask has size 1 there); off in eval."""

    def __init__(self, rate: float, shared_dim: int) -> None:
        super().__init__()
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"rate: expected a probability in [0, 1), got {rate}")
        self.rate = rate
        self.shared_dim = shared_dim

    def extra_repr(self) -> str:
        return f"rate={self.rate}, shared_dim={self.shared_dim}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.rate == 0.0:
            return x
        shape = list(x.shape)
        shape[self.shared_dim] = 1
        keep = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - self.rate)
        return x * keep / (1.0 - self.rate)

    def residual_add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`residual + self(x)`: the residual update the Evoformer applies after each sub-layer."""
        return residual + self(x)


class DropoutRowwise(SharedDropout):
    """One dropout mask per row: shared along dim -3 of `[*, N_rows, N_cols, C]` (OpenFold's name)."""

    def __init__(self, rate: float) -> None:
        super().__init__(rate, shared_dim=-3)


class DropoutColumnwise(SharedDropout):
    """One dropout mask per column: shared along dim -2 of `[*, N_rows, N_cols, C]`."""

    def __init__(self, rate: float) -> None:
        super().__init__(rate, shared_dim=-2)
