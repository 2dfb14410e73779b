"""Fused shared dropout: `FusedSharedDropout` / `FusedDropoutRowwise` / `FusedDropoutColumnwise`.

Each subclasses the plain module of `hfkit.model.dropout` (`SharedDropout` and OpenFold's
`DropoutRowwise` / `DropoutColumnwise`) and changes only `residual_add` (`z + dropout(update)`, applied
by the Evoformer after each sub-layer): it runs `hfkit.ops.bias_dropout_add` (one kernel, the mask drawn
in the kernel from a seed, nothing stored). The modules have no parameters or buffers, so a swap leaves
`state_dict()` unchanged. Importing this file registers the three swaps used by `hfkit.to_hfkit`.
"""

from __future__ import annotations

import torch

from hfkit.model.dropout import DropoutColumnwise, DropoutRowwise, SharedDropout
from hfkit.nn.convert import register_swap
from hfkit.ops.elementwise import bias_dropout_add

__all__ = ["FusedDropoutColumnwise", "FusedDropoutRowwise", "FusedSharedDropout"]


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
