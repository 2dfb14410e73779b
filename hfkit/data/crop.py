"""Residue cropping for training: which residues of a chain a sample keeps, as sorted index tensors.

`crop_contiguous` is AlphaFold's monomer crop (a random window, AF2 supplement section 1.2.8), its
start drawn as OpenFold's `random_crop_to_size` draws it (or uniformly, as DeepMind's AlphaFold);
`crop_spatial` is the spatial crop of AlphaFold-Multimer (Evans et al. 2021) as
OpenFold implements it for multimers (`get_spatial_crop_idx`): the residues nearest, by CA distance,
to a random target residue, which lies on an interface when the chains have one. `choose_crop`
picks one of the two with `spatial_crop_prob`. All take a `torch.Generator` and draw nothing from
the global RNG.
"""

from __future__ import annotations

import torch

from hfkit.data.residue_constants import ATOM_ORDER

__all__ = ["choose_crop", "crop_contiguous", "crop_spatial"]

_CA = ATOM_ORDER["CA"]


def _randint(high: int, generator: torch.Generator) -> int:
    """A uniform int in [0, high)."""
    return int(torch.randint(high, (1,), generator=generator).item())


def crop_contiguous(
    num_res: int, crop_size: int, generator: torch.Generator, uniform_start: bool = False
) -> torch.Tensor:
    """Indices int64 [min(num_res, crop_size)] of a window with a random start in [0, n].

    n = num_res - crop_size. By default the start is drawn in OpenFold's two steps (its
    `random_crop_to_size`): x uniform in [0, n], then the start uniform in [0, n - x], which favours
    early starts (mean n/4); the same `generator` state gives OpenFold's start. `uniform_start`
    draws it uniformly in [0, n] (mean n/2), as DeepMind's AlphaFold does. A chain no longer than
    `crop_size` is kept whole (and nothing is drawn from `generator`).
    """
    if num_res < 1:
        raise ValueError(f"num_res: expected >= 1, got {num_res}")
    if crop_size < 1:
        raise ValueError(f"crop_size: expected >= 1, got {crop_size}")
    if num_res <= crop_size:
        return torch.arange(num_res)
    slack = num_res - crop_size
    if uniform_start:
        start = _randint(slack + 1, generator)
    else:
        start = _randint(slack - _randint(slack + 1, generator) + 1, generator)
    return torch.arange(start, start + crop_size)


def crop_spatial(
    positions: torch.Tensor,
    mask: torch.Tensor,
    crop_size: int,
    generator: torch.Generator,
    chain_index: torch.Tensor | None = None,
    interface_threshold: float = 10.0,
) -> torch.Tensor:
    """Indices int64 [min(L, crop_size)], sorted, of the residues nearest a random target residue.

    positions: atom37 coordinates [L, 37, 3] (or CA coordinates [L, 3]); mask: [L, 37] (or [L]).
    The target is uniform over residues with a resolved CA; with `chain_index` [L] naming two or
    more chains, over interface residues (CA within `interface_threshold` Å of another chain's CA)
    when there are any. The crop is the `crop_size` residues with a CA nearest the target's CA (ties
    to the lower index), then residues without a CA; if no residue has a CA, the crop is contiguous.
    """
    if positions.dim() == 3:
        positions, mask = positions[:, _CA], mask[:, _CA]
    if positions.dim() != 2 or positions.shape[-1] != 3:
        raise ValueError(f"positions: expected [L, 37, 3] or [L, 3], got {tuple(positions.shape)}")
    num_res = positions.shape[0]
    if mask.shape != (num_res,):
        raise ValueError(f"mask: expected [{num_res}, 37] or [{num_res}], got {tuple(mask.shape)}")
    if num_res <= crop_size:
        return torch.arange(num_res)
    has_ca = mask > 0
    candidates = has_ca.nonzero().squeeze(-1)
    if candidates.numel() == 0:
        return crop_contiguous(num_res, crop_size, generator)
    ca = positions.to(torch.float32)
    if chain_index is not None:
        dist = torch.cdist(ca, ca)
        other = chain_index[:, None] != chain_index[None, :]
        near = (dist < interface_threshold) & other & has_ca[:, None] & has_ca[None, :]
        interface = near.any(dim=1).nonzero().squeeze(-1)
        if interface.numel() > 0:
            candidates = interface
    target = candidates[_randint(candidates.numel(), generator)]
    dist_to_target = (ca - ca[target]).norm(dim=-1)
    dist_to_target = torch.where(has_ca, dist_to_target, torch.inf)
    # A stable sort breaks ties by index, as OpenFold's arange * 1e-3 tie-breaker does.
    nearest = torch.sort(dist_to_target, stable=True).indices[:crop_size]
    return torch.sort(nearest).values


def choose_crop(
    num_res: int,
    crop_size: int,
    generator: torch.Generator,
    spatial_crop_prob: float = 0.5,
    positions: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    interface_threshold: float = 10.0,
    uniform_start: bool = False,
) -> torch.Tensor:
    """Sorted residue indices int64 [min(num_res, crop_size)]: spatial with `spatial_crop_prob`.

    Draws one uniform number to choose, then crops: `crop_spatial` when chosen and a structure
    (`positions` [L, 37, 3], `mask` [L, 37]) is given, `crop_contiguous` (with `uniform_start`)
    otherwise. Chains no longer than `crop_size` are kept whole and draw nothing.
    """
    if num_res <= crop_size:
        return torch.arange(num_res)
    use_spatial = bool(torch.rand((), generator=generator) < spatial_crop_prob)
    if use_spatial and positions is not None and mask is not None:
        return crop_spatial(positions, mask, crop_size, generator, interface_threshold=interface_threshold)
    return crop_contiguous(num_res, crop_size, generator, uniform_start)
