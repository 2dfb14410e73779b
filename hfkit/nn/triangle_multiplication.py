"""`hfkit.nn.TriangleMultiplicationOutgoing/Incoming`: the model's triangle multiplicative updates whose
forward runs the fused `hfkit.ops.triangle_multiplication`.

They subclass `hfkit.model.TriangleMultiplicationOutgoing/Incoming` (OpenFold's parameter names:
`linear_a_p`, `linear_a_g`, `linear_b_p`, `linear_b_g`, `linear_g`, `linear_z`, `layer_norm_in`,
`layer_norm_out`), so constructor, parameters and state_dict are the model's; only `forward` changes.
Importing this file registers both swaps used by `hfkit.to_hfkit`.
"""

from __future__ import annotations

import torch

from hfkit.model.triangular_multiplicative_update import (
    TriangleMultiplicationIncoming as _PlainIncoming,
)
from hfkit.model.triangular_multiplicative_update import (
    TriangleMultiplicationOutgoing as _PlainOutgoing,
)
from hfkit.model.triangular_multiplicative_update import TriangleMultiplicativeUpdate
from hfkit.nn.convert import register_swap
from hfkit.ops.triangle_multiplication import triangle_multiplication

__all__ = ["TriangleMultiplicationIncoming", "TriangleMultiplicationOutgoing", "fused_triangle_update"]


def fused_triangle_update(
    module: TriangleMultiplicativeUpdate, z: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`module`'s update of z [*, N, N, C_z] (mask [*, N, N]) through `hfkit.ops.triangle_multiplication`.

    The five input projections are concatenated for the op's single matmul (a [4 C_h + C_z, C_z]
    copy of the weights per call, small next to the pair tensor). LayerNorms with different eps run
    the module's plain forward.
    """
    ln_in, ln_out = module.layer_norm_in, module.layer_norm_out
    if ln_in.eps != ln_out.eps:
        return TriangleMultiplicativeUpdate.forward(module, z, mask)
    projections = (
        module.linear_a_p,
        module.linear_a_g,
        module.linear_b_p,
        module.linear_b_g,
        module.linear_g,
    )
    proj_weight = torch.cat([lin.weight for lin in projections])
    biases = [lin.bias for lin in projections]
    proj_bias = None if any(b is None for b in biases) else torch.cat(biases)
    if proj_bias is None and any(b is not None for b in biases):
        return TriangleMultiplicativeUpdate.forward(module, z, mask)
    return triangle_multiplication(
        z, mask, ln_in.weight, ln_in.bias, proj_weight, proj_bias,
        ln_out.weight, ln_out.bias, module.linear_z.weight, module.linear_z.bias,
        outgoing=module.outgoing, eps=ln_in.eps,
    )  # fmt: skip


class TriangleMultiplicationOutgoing(_PlainOutgoing):
    """Algorithm 11 ("outgoing" edges) through the fused op; same constructor and state_dict as
    `hfkit.model.TriangleMultiplicationOutgoing`. forward(z [*, N, N, C_z], mask [*, N, N] or None)."""

    def forward(self, z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return fused_triangle_update(self, z, mask)


class TriangleMultiplicationIncoming(_PlainIncoming):
    """Algorithm 12 ("incoming" edges) through the fused op; same constructor and state_dict as
    `hfkit.model.TriangleMultiplicationIncoming`. forward(z [*, N, N, C_z], mask [*, N, N] or None)."""

    def forward(self, z: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return fused_triangle_update(self, z, mask)


register_swap(_PlainOutgoing, TriangleMultiplicationOutgoing)
register_swap(_PlainIncoming, TriangleMultiplicationIncoming)
