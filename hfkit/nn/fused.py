"""Shared dropout with its residual add: the plain-torch modules the Evoformer uses, and hfkit's fused ones.

`SharedDropout` (and OpenFold's `DropoutRowwise` / `DropoutColumnwise`) share one dropout mask along a
row or column of the representation (AF2 supplement 1.11.6). The Evoformer applies each one as
`z = dropout.residual_add(z, update)`, i.e. `z + dropout(update)`. `to_hfkit` swaps them for
`FusedSharedDropout` / `FusedDropoutRowwise` / `FusedDropoutColumnwise`, whose `residual_add` runs
`hfkit.ops.bias_dropout_add` (one kernel, the mask drawn in the kernel from a seed, nothing stored).
The modules have no parameters or buffers, so a swap leaves `state_dict()` unchanged. The plain
classes live here (as `Attention` lives in `hfkit.nn.attention`) so that `hfkit.nn` does not import
`hfkit.model`; `hfkit.model.primitives` re-exports them.
"""

from __future__ import annotations

import torch
from torch import nn

from hfkit.nn.convert import register_swap
from hfkit.ops.elementwise import bias_dropout_add

__all__ = [
    "DropoutColumnwise",
    "DropoutRowwise",
    "FusedDropoutColumnwise",
    "FusedDropoutRowwise",
    "FusedSharedDropout",
    "SharedDropout",
]


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


class _FusedResidual:
    """`residual_add` through `hfkit.ops.bias_dropout_add`: one pass over x and residual (eval mode:
    one add; on CPU without the interpreter: the same torch code as `SharedDropout`)."""

    rate: float
    shared_dim: int
    training: bool

    def residual_add(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return bias_dropout_add(x, residual, p=self.rate, training=self.training, shared_dim=self.shared_dim)


class FusedSharedDropout(_FusedResidual, SharedDropout):
    """`SharedDropout` whose `residual_add` is the fused `bias_dropout_add`; same attributes."""


class FusedDropoutRowwise(_FusedResidual, DropoutRowwise):
    """`DropoutRowwise` whose `residual_add` is the fused `bias_dropout_add`; same attributes."""


class FusedDropoutColumnwise(_FusedResidual, DropoutColumnwise):
    """`DropoutColumnwise` whose `residual_add` is the fused `bias_dropout_add`; same attributes."""


register_swap(SharedDropout, FusedSharedDropout)
register_swap(DropoutRowwise, FusedDropoutRowwise)
register_swap(DropoutColumnwise, FusedDropoutColumnwise)
