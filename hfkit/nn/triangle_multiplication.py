"""`hfkit.nn.TriangleMultiplicationOutgoing/Incoming`: the model's triangle multiplicative updates whose
forward runs the fused `hfkit.ops.triangle_multiplication`.

They subclass `hfkit.model.TriangleMultiplicationOutgoing/Incoming` (OpenFold's parameter names:
`linear_a_p`, `linear_a_g`, `linear_b_p`, `linear_b_g`, `linear_g`, `linear_z`, `layer_norm_in`,
`layer_norm_out`), so constructor, parameters and state_dict are the model's; only `forward` changes.
Importing this file registers both swaps used by `hfkit.to_hfkit`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hfkit.model.primitives import active_residual_taps
from hfkit.model.triangular_multiplicative_update import (
    TriangleMultiplicationIncoming as _PlainIncoming,
)
from hfkit.model.triangular_multiplicative_update import (
    TriangleMultiplicationOutgoing as _PlainOutgoing,
)
from hfkit.model.triangular_multiplicative_update import TriangleMultiplicativeUpdate
from hfkit.nn.convert import register_swap
from hfkit.ops.triangle_multiplication import Contraction, triangle_multiplication

__all__ = [
    "TriangleMultiplicationIncoming",
    "TriangleMultiplicationOutgoing",
    "fused_triangle_update",
    "triangle_update_from_parts",
]


def fused_triangle_update(
    module: TriangleMultiplicativeUpdate,
    z: torch.Tensor,
    mask: torch.Tensor | None = None,
    contraction: Contraction | None = None,
    add_to_z: bool = False,
) -> torch.Tensor | None:
    """`module`'s update of z [*, N, N, C_z] (mask [*, N, N]) through `hfkit.ops.triangle_multiplication`
    (see `triangle_update_from_parts`). LayerNorms with different eps, or projections of which only some
    have a bias, run the module's plain forward; with a `contraction` (z a block of rows [*, R, N, C_z],
    see the op), None there instead: the caller runs its own. With `add_to_z` (inference, no
    contraction) z += the update in place (the op's `add_to_z`) and z is returned."""
    projections = (
        module.linear_a_p,
        module.linear_a_g,
        module.linear_b_p,
        module.linear_b_g,
        module.linear_g,
    )
    out = triangle_update_from_parts(
        z,
        mask,
        module.layer_norm_in,
        module.layer_norm_out,
        [lin.weight for lin in projections],
        [lin.bias for lin in projections],
        module.linear_z,
        module.outgoing,
        contraction,
        add_to_z,
    )
    if out is None and contraction is None:
        plain = TriangleMultiplicativeUpdate.forward(module, z, mask)
        return z.add_(plain) if add_to_z else plain
    return out


def triangle_update_from_parts(
    z: torch.Tensor,
    mask: torch.Tensor | None,
    layer_norm_in: nn.Module,
    layer_norm_out: nn.Module,
    proj_weights: Sequence[torch.Tensor],
    proj_biases: Sequence[torch.Tensor | None],
    linear_z: nn.Linear,
    outgoing: bool,
    contraction: Contraction | None = None,
    add_to_z: bool = False,
) -> torch.Tensor | None:
    """The triangle multiplicative update of z [*, N, N, C_z] (mask [*, N, N] or None) through
    `hfkit.ops.triangle_multiplication`, from its parts: the two LayerNorms (`weight`, `bias`, `eps`),
    the five projections' weights [C_h|C_z, C_z] and biases in the order a_p, a_g, b_p, b_g, g, and
    `linear_z`. The projections are concatenated for the op's single matmul (a [4 C_h + C_z, C_z] copy
    of the weights per call, small next to the pair tensor). None when the op does not cover the
    parts (LayerNorms with different eps; only some projections with a bias). `contraction` and
    `add_to_z`: the op's."""
    if layer_norm_in.eps != layer_norm_out.eps:
        return None
    if any(b is None for b in proj_biases):
        if any(b is not None for b in proj_biases):
            return None
        proj_bias = None
    else:
        proj_bias = torch.cat(list(proj_biases))
    proj_weight = torch.cat(list(proj_weights))
    # Inside the model's residual taps, z passes through the op for the residual add (`ResidualTaps`).
    taps = active_residual_taps()
    tapped = taps is not None and taps.wants(z) and not add_to_z
    result = triangle_multiplication(
        z, mask, layer_norm_in.weight, layer_norm_in.bias, proj_weight, proj_bias,
        layer_norm_out.weight, layer_norm_out.bias, linear_z.weight, linear_z.bias,
        outgoing=outgoing, eps=layer_norm_in.eps, residual=tapped, contraction=contraction, add_to_z=add_to_z,
    )  # fmt: skip
    if not tapped:
        return result
    out, passthrough = result
    if passthrough is not z:
        taps.record(z, passthrough)
    return out


class _AddUpdate:
    """`add_update_`, the in-place residual update the lean inference path calls."""

    def add_update_(self, z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """z += forward(z, mask) in place, without autograd (`hfkit.model.inference.lean_forward`): the
        fused output kernel adds the update into z as it writes it."""
        return fused_triangle_update(self, z, mask, add_to_z=True)


class TriangleMultiplicationOutgoing(_AddUpdate, _PlainOutgoing):
    """Algorithm 11 ("outgoing" edges) through the fused op; same constructor and state_dict as
    `hfkit.model.TriangleMultiplicationOutgoing`. forward(z [*, N, N, C_z], mask [*, N, N] or None)."""

    def forward(self, z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return fused_triangle_update(self, z, mask)


class TriangleMultiplicationIncoming(_AddUpdate, _PlainIncoming):
    """Algorithm 12 ("incoming" edges) through the fused op; same constructor and state_dict as
    `hfkit.model.TriangleMultiplicationIncoming`. forward(z [*, N, N, C_z], mask [*, N, N] or None)."""

    def forward(self, z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return fused_triangle_update(self, z, mask)


register_swap(_PlainOutgoing, TriangleMultiplicationOutgoing)
register_swap(_PlainIncoming, TriangleMultiplicationIncoming)
