"""Input embedder (AF2 supplement Algorithm 3, with relative position encoding Algorithm 4): target
and MSA features -> initial MSA [*, S, N, c_m] and pair [*, N, N, c_z] representations; and the
extra-MSA embedder (Algorithm 2 line 14)."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from hfkit.model.primitives import linear

__all__ = ["ExtraMSAEmbedder", "InputEmbedder", "build_extra_msa_feat"]


class InputEmbedder(nn.Module):
    """Parameters as OpenFold: `linear_tf_z_i`, `linear_tf_z_j`, `linear_tf_m`, `linear_msa_m`,
    `linear_relpos` (one-hot of the residue offset clipped to [-relpos_k, relpos_k] -> c_z)."""

    def __init__(self, tf_dim: int, msa_dim: int, c_z: int, c_m: int, relpos_k: int) -> None:
        super().__init__()
        self.tf_dim = tf_dim
        self.msa_dim = msa_dim
        self.relpos_k = relpos_k
        self.linear_tf_z_i = linear(tf_dim, c_z)
        self.linear_tf_z_j = linear(tf_dim, c_z)
        self.linear_tf_m = linear(tf_dim, c_m)
        self.linear_msa_m = linear(msa_dim, c_m)
        self.linear_relpos = linear(2 * relpos_k + 1, c_z)

    def relpos(self, residue_index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Algorithm 4: residue_index [*, N] -> Linear(one-hot(clip(r_i - r_j, ±k))) [*, N, N, c_z]."""
        offset = residue_index[..., :, None] - residue_index[..., None, :]
        bins = offset.long().clamp(-self.relpos_k, self.relpos_k) + self.relpos_k
        return self.linear_relpos(F.one_hot(bins, 2 * self.relpos_k + 1).to(dtype))

    def forward(
        self, target_feat: torch.Tensor, residue_index: torch.Tensor, msa_feat: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """target_feat [*, N, tf_dim], residue_index [*, N], msa_feat [*, S, N, msa_dim]
        -> (m [*, S, N, c_m], z [*, N, N, c_z])."""
        if target_feat.shape[-1] != self.tf_dim:
            raise ValueError(f"target_feat: expected [*, N, {self.tf_dim}], got {tuple(target_feat.shape)}")
        if msa_feat.shape[-1] != self.msa_dim or msa_feat.shape[-2] != target_feat.shape[-2]:
            raise ValueError(
                f"msa_feat: expected [*, S, {target_feat.shape[-2]}, {self.msa_dim}], "
                f"got {tuple(msa_feat.shape)}"
            )
        z = self.relpos(residue_index, target_feat.dtype)
        z = (
            z
            + self.linear_tf_z_i(target_feat)[..., :, None, :]
            + self.linear_tf_z_j(target_feat)[..., None, :, :]
        )
        m = self.linear_msa_m(msa_feat) + self.linear_tf_m(target_feat)[..., None, :, :]
        return m, z


def build_extra_msa_feat(
    extra_msa: torch.Tensor, extra_has_deletion: torch.Tensor, extra_deletion_value: torch.Tensor
) -> torch.Tensor:
    """Extra-MSA features (supplement Table 1): ids [*, E, N] one-hot (23) | has_deletion |
    deletion_value -> [*, E, N, 25] (OpenFold's `build_extra_msa_feat`)."""
    one_hot = F.one_hot(extra_msa.long(), 23).to(extra_deletion_value.dtype)
    return torch.cat([one_hot, extra_has_deletion[..., None], extra_deletion_value[..., None]], dim=-1)


class ExtraMSAEmbedder(nn.Module):
    """Algorithm 2 line 14: extra-MSA features [*, E, N, 25] -> [*, E, N, c_e] (`linear`)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.linear = linear(c_in, c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)
