"""Losses of the auxiliary heads: distogram (AF2 supplement section 1.9.8) on pseudo-beta distances
and masked MSA (section 1.9.9), with OpenFold's normalisations."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from hfkit.data.residue_constants import ATOM_ORDER, RESTYPE_ORDER

__all__ = ["distogram_loss", "masked_msa_loss", "pseudo_beta"]

_GLY = RESTYPE_ORDER["G"]
_CA = ATOM_ORDER["CA"]
_CB = ATOM_ORDER["CB"]


def pseudo_beta(
    aatype: torch.Tensor, all_atom_positions: torch.Tensor, all_atom_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """CB (CA for glycine) of each residue: aatype [*, N], positions [*, N, 37, 3], mask [*, N, 37]
    -> (positions [*, N, 3], mask [*, N])."""
    is_gly = (aatype == _GLY)[..., None]
    positions = torch.where(is_gly, all_atom_positions[..., _CA, :], all_atom_positions[..., _CB, :])
    mask = torch.where(is_gly[..., 0], all_atom_mask[..., _CA], all_atom_mask[..., _CB])
    return positions, mask


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-position cross entropy: logits [*, C], integer targets [*] -> [*] (float32 statistics)."""
    return -torch.gather(F.log_softmax(logits.float(), dim=-1), -1, target[..., None].long())[..., 0]


def distogram_loss(
    logits: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    min_bin: float = 2.3125,
    max_bin: float = 21.6875,
    no_bins: int = 64,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Cross entropy of distance-bin logits [*, N, N, no_bins] against the binned distances of
    pseudo-beta `positions` [*, N, 3], averaged over pairs with both residues in `mask` [*, N]
    (no_bins - 1 evenly spaced edges from min_bin to max_bin, in Å) -> [*]."""
    edges = torch.linspace(min_bin, max_bin, no_bins - 1, device=logits.device) ** 2
    positions = positions.float()
    sq_dist = ((positions[..., :, None, :] - positions[..., None, :, :]) ** 2).sum(-1, keepdim=True)
    true_bins = (sq_dist > edges).sum(-1)
    errors = _cross_entropy(logits, true_bins)
    square_mask = (mask[..., :, None] * mask[..., None, :]).float()
    denom = eps + square_mask.sum(dim=(-1, -2))
    return (errors * square_mask).sum(dim=(-1, -2)) / denom


def masked_msa_loss(
    logits: torch.Tensor, true_msa: torch.Tensor, bert_mask: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """Cross entropy of MSA logits [*, S, N, 23] against the uncorrupted ids `true_msa` [*, S, N] at
    the masked positions (`bert_mask` [*, S, N]), averaged over them -> [*]."""
    errors = _cross_entropy(logits, true_msa)
    bert_mask = bert_mask.float()
    return (errors * bert_mask).sum(dim=(-1, -2)) / (eps + bert_mask.sum(dim=(-1, -2)))
