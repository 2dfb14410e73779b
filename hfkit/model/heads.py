"""Auxiliary heads: distogram (AF2 supplement section 1.9.8) and masked MSA (section 1.9.9)."""

from __future__ import annotations

import torch
from torch import nn

from hfkit.model.primitives import linear

__all__ = ["AuxiliaryHeads", "DistogramHead", "MaskedMSAHead"]


class DistogramHead(nn.Module):
    """Pair representation -> symmetric logits over `no_bins` distance bins (`linear`)."""

    def __init__(self, c_z: int, no_bins: int) -> None:
        super().__init__()
        self.linear = linear(c_z, no_bins, init="final")

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """z: [*, N, N, C_z] -> logits [*, N, N, no_bins], symmetric in (i, j)."""
        logits = self.linear(z)
        return logits + logits.transpose(-2, -3)


class MaskedMSAHead(nn.Module):
    """MSA representation -> logits over the 23 MSA classes of each position (`linear`)."""

    def __init__(self, c_m: int, c_out: int) -> None:
        super().__init__()
        self.linear = linear(c_m, c_out, init="final")

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        """m: [*, S, N, C_m] -> logits [*, S, N, c_out]."""
        return self.linear(m)


class AuxiliaryHeads(nn.Module):
    """The heads this model trains (OpenFold's `aux_heads` names: `distogram`, `masked_msa`)."""

    def __init__(self, c_m: int, c_z: int, no_bins: int, masked_msa_dim: int) -> None:
        super().__init__()
        self.distogram = DistogramHead(c_z, no_bins)
        self.masked_msa = MaskedMSAHead(c_m, masked_msa_dim)

    def forward(self, m: torch.Tensor, z: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"distogram_logits": self.distogram(z), "masked_msa_logits": self.masked_msa(m)}
