"""Why cropping matters for synchronous data parallelism: a step lasts as long as the slowest rank.

Each rank of a synchronous DDP job draws its own protein; every rank then waits at the gradient
all-reduce for the slowest one. `evoformer_flops` estimates one Evoformer block's forward FLOPs from
the residue count and MSA depth (the AlphaFold 2 supplement's Algorithms 7-20, dense matmul terms
only), and `sync_wait` simulates P ranks drawing samples: the step time is the maximum over ranks,
and the wasted fraction is the idle time of the other ranks over the step. Cropping caps the residue
count (and MSA sampling the depth), so it caps the slowest rank. `sync_wait_table` is notebook 01's
table of it: the wasted fraction per cropping policy, crop size and rank count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["evoformer_flops", "SyncWait", "sync_wait", "lognormal_lengths", "sync_wait_table"]


def evoformer_flops(
    n_res: np.ndarray | int,
    n_seq: np.ndarray | int,
    c_m: int = 256,
    c_z: int = 128,
    heads_msa: int = 8,
    heads_pair: int = 4,
    c_hidden: int = 32,
    c_opm: int = 32,
    c_tri: int = 128,
) -> np.ndarray:
    """Forward FLOPs of one Evoformer block (2 per multiply-add), dense matmul terms only.

    n_res: residues (after cropping), n_seq: MSA rows (after sampling); broadcastable arrays. Counts:
    MSA row attention with pair bias (projections + logits + weighted sum), MSA column attention,
    MSA transition (4x), outer product mean, triangle multiplication out/in, triangle attention
    start/end, pair transition (4x). Elementwise work (LayerNorm, softmax, gating) is memory-bound
    and left out; so are the recycling, extra-MSA and structure modules.
    """
    r = np.asarray(n_res, dtype=np.float64)
    s = np.asarray(n_seq, dtype=np.float64)
    hm, hp = heads_msa * c_hidden, heads_pair * c_hidden
    msa_row = s * r * c_m * 4 * hm + 2 * s * r * r * hm + r * r * c_z * heads_msa
    msa_col = s * r * c_m * 4 * hm + 2 * s * s * r * hm
    msa_trans = s * r * c_m * 8 * c_m
    opm = s * r * c_m * 2 * c_opm + s * r * r * c_opm * c_opm + r * r * c_opm * c_opm * c_z
    tri_mul = 2 * (r * r * c_z * 5 * c_tri + r * r * r * c_tri + r * r * c_tri * c_z)
    tri_att = 2 * (r * r * c_z * 4 * hp + 2 * r * r * r * hp + r * r * c_z * heads_pair)
    pair_trans = r * r * c_z * 8 * c_z
    return 2.0 * (msa_row + msa_col + msa_trans + opm + tri_mul + tri_att + pair_trans)


def lognormal_lengths(
    n: int, rng: np.random.Generator, median: float = 250.0, sigma: float = 0.6
) -> np.ndarray:
    """Protein chain lengths from a log-normal model (an assumption, not PDB statistics), >= 16."""
    return np.maximum(16, np.round(rng.lognormal(np.log(median), sigma, size=n))).astype(np.int64)


@dataclass(frozen=True)
class SyncWait:
    """Result of `sync_wait`: mean step (max over ranks) and mean per-rank compute, in cost units."""

    ranks: int
    mean_step: float
    mean_work: float
    wasted_fraction: float  # 1 - mean_work / mean_step: share of rank-time spent waiting
    p95_step: float


def sync_wait(costs: np.ndarray, ranks: int, steps: int, rng: np.random.Generator) -> SyncWait:
    """Simulate `steps` synchronous steps of `ranks` ranks, each drawing one sample cost at random.

    costs: [n] per-sample compute costs (any unit). The step time is the maximum cost over the ranks;
    the work is their mean. With one rank nothing is wasted.
    """
    costs = np.asarray(costs, dtype=np.float64)
    if costs.ndim != 1 or costs.size == 0:
        raise ValueError(f"costs: expected a non-empty 1-D array, got shape {costs.shape}")
    if ranks < 1 or steps < 1:
        raise ValueError(f"ranks, steps: expected >= 1, got ranks={ranks}, steps={steps}")
    draws = costs[rng.integers(0, costs.size, size=(steps, ranks))]
    step = draws.max(axis=1)
    work = draws.mean(axis=1)
    return SyncWait(
        ranks=ranks,
        mean_step=float(step.mean()),
        mean_work=float(work.mean()),
        wasted_fraction=float(1.0 - work.sum() / step.sum()),
        p95_step=float(np.percentile(step, 95)),
    )


def sync_wait_table(
    lengths: np.ndarray,
    crop_sizes: Sequence[int],
    ranks: Sequence[int],
    n_seq: int = 128,
    steps: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """Wasted fraction and mean step cost of synchronous DDP for each (policy, crop size, ranks).

    Policies: "no crop" (each protein at full length), "crop" (at most `crop` residues, no padding),
    "crop + pad" (every sample padded to `crop`: equal cost, no waiting, padding computed instead).
    Costs are Evoformer-block FLOPs (`evoformer_flops`) at `n_seq` MSA rows; `mean_step_rel` is the
    mean step cost relative to one full `crop`-sized sample.
    """
    import pandas as pd

    rng = np.random.default_rng(seed)
    rows = []
    for crop in crop_sizes:
        unit = float(evoformer_flops(crop, n_seq))
        policies = {
            "no crop": evoformer_flops(lengths, n_seq),
            "crop": evoformer_flops(np.minimum(lengths, crop), n_seq),
            "crop + pad": np.full(len(lengths), unit),
        }
        for policy, costs in policies.items():
            for p in ranks:
                r = sync_wait(costs, p, steps, rng)
                rows.append(
                    {
                        "policy": policy,
                        "crop": crop,
                        "ranks": p,
                        "wasted_fraction": r.wasted_fraction,
                        "mean_step_rel": r.mean_step / unit,
                        "p95_step_rel": r.p95_step / unit,
                    }
                )
    return pd.DataFrame(rows)
