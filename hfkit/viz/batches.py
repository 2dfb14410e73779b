"""Training batches from the real data pipeline for notebook 05: OpenFold's test chains (real mmCIF
and alignments) preprocessed once into a temporary record folder, then sampled, cropped and padded by
`hfkit.data` exactly as training does, with the MSA deepened synthetically to the sample's depth.

The test data's alignments are shallow (2q2k: 21 rows) next to what a training sample draws
(af2_initial: 128 cluster centres and 1024 extra rows, after block deletion keeps about a sixth of
the rows), so `deepen_msa` appends rows made by mutating real rows: each added row copies a real row
(drawn uniformly, query included) with its deletion counts, and every residue of it (not gaps) is
replaced with probability `mutation_rate` by an amino acid drawn uniformly from the 20, seeded per
chain. The query, the structure and the real rows are unchanged; only the MSA depth is synthetic.
Where the real inputs are absent, `PipelineBatches.open` falls back to synthetic chains
(`hfkit.data.synthetic`) and says so in its `label`.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hfkit.data.dataset import PreprocessedDataset, collate_fixed, make_dataloader, sample_seed
from hfkit.data.features import hhblits_profile
from hfkit.data.msa_sampling import FeatureConfig
from hfkit.data.residue_constants import GAP_ID

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from hfkit.bench.data_cost import Inputs
    from hfkit.model import ModelConfig

__all__ = [
    "DEFAULT_MUTATION_RATE",
    "DeepenedMsaDataset",
    "PipelineBatches",
    "deepen_msa",
    "sample_msa_depth",
]

DEFAULT_MUTATION_RATE = 0.15
_AMINO_ACIDS = 20  # ids 0..19 (RESTYPES); 20 is X, 21 the gap
# Synthetic chains where the real inputs are absent: long enough to fill a CPU crop, shallow enough
# that deepening is exercised as it is on the real chains.
_SYNTHETIC_CHAINS, _SYNTHETIC_LENGTH, _SYNTHETIC_DEPTH = 2, 96, 24


def _feature_config(config: ModelConfig | FeatureConfig) -> FeatureConfig:
    return config if isinstance(config, FeatureConfig) else config.feature_config()


def sample_msa_depth(config: ModelConfig | FeatureConfig) -> int:
    """The MSA rows a chain needs for `config`'s samples to be full on average: cluster centres plus
    extra rows (`max_msa_clusters + max_extra_msa`), divided by the share of rows that training-time
    block deletion keeps in expectation (`(1 - msa_fraction_per_block) ** num_blocks`: about 0.17 for
    AlphaFold's 5 blocks of 30 %), rounded up."""
    features = _feature_config(config)
    rows = features.max_msa_clusters + features.max_extra_msa
    if features.block_delete_msa and features.num_blocks > 0:
        rows = math.ceil(rows / max((1.0 - features.msa_fraction_per_block) ** features.num_blocks, 1e-3))
    return rows


def deepen_msa(
    raw: Mapping[str, Any], depth: int, mutation_rate: float = DEFAULT_MUTATION_RATE, seed: int = 0
) -> dict[str, Any]:
    """A chain's raw features (`make_raw_features`: `msa` ids [N, L], `deletion_matrix` [N, L], ...)
    with the MSA deepened to `depth` rows where it has fewer: rows N..depth-1 each copy a real row
    (drawn uniformly) and its deletion counts, and each of their residues (gaps kept) becomes a
    uniformly drawn amino acid with probability `mutation_rate`; drawn from
    `numpy.random.default_rng(seed)`. `hhblits_profile` [L, 22] is recomputed over the deepened MSA
    and `num_alignments` set to its depth. Returns a new dict (the input arrays, read-only record
    views among them, are not written); at or above `depth` rows, a shallow copy of `raw`."""
    if depth < 1:
        raise ValueError(f"depth: expected >= 1 rows, got {depth}")
    if not 0.0 <= mutation_rate <= 1.0:
        raise ValueError(f"mutation_rate: expected a probability in [0, 1], got {mutation_rate}")
    msa, deletions = np.asarray(raw["msa"]), np.asarray(raw["deletion_matrix"])
    if msa.ndim != 2 or msa.shape[0] < 1 or deletions.shape != msa.shape:
        raise ValueError(
            f"raw['msa'], raw['deletion_matrix']: expected equal shapes [N >= 1, L], got "
            f"{msa.shape} and {deletions.shape}"
        )
    out = dict(raw)
    added = depth - msa.shape[0]
    if added <= 0:
        return out
    rng = np.random.default_rng(seed)
    source = rng.integers(0, msa.shape[0], size=added)
    rows = msa[source].copy()
    mutate = (rng.random(rows.shape) < mutation_rate) & (rows != GAP_ID)
    rows[mutate] = rng.integers(0, _AMINO_ACIDS, size=int(mutate.sum())).astype(rows.dtype)
    out["msa"] = np.concatenate([msa, rows])
    out["deletion_matrix"] = np.concatenate([deletions, deletions[source]])
    out["hhblits_profile"] = hhblits_profile(out["msa"])
    out["num_alignments"] = np.asarray(depth, dtype=np.asarray(raw.get("num_alignments", 0)).dtype)
    return out


class DeepenedMsaDataset(PreprocessedDataset):
    """A `PreprocessedDataset` whose chains' MSAs are deepened (`deepen_msa`) to `depth` rows
    (default `sample_msa_depth(config)`) before sampling. The added rows of chain i are drawn from
    `sample_seed(seed, 0, i)`: fixed across epochs, like a real alignment, while the sampling,
    cropping and masking change with `set_epoch` as usual. Items are `process_features` samples."""

    def __init__(
        self,
        records: str | Path,
        config: FeatureConfig,
        depth: int | None = None,
        mutation_rate: float = DEFAULT_MUTATION_RATE,
        seed: int = 0,
    ) -> None:
        if depth is not None and depth < 1:
            raise ValueError(f"depth: expected >= 1 rows or None, got {depth}")
        if not 0.0 <= mutation_rate <= 1.0:
            raise ValueError(f"mutation_rate: expected a probability in [0, 1], got {mutation_rate}")
        super().__init__(records, config, seed=seed)
        self.depth = sample_msa_depth(config) if depth is None else int(depth)
        self.mutation_rate = float(mutation_rate)

    def raw_features(self, index: int, timings: dict[str, float] | None = None) -> dict[str, Any]:
        """Chain `index`'s raw features from its record, the MSA deepened to `depth` rows."""
        raw = super().raw_features(index, timings)
        return deepen_msa(raw, self.depth, self.mutation_rate, sample_seed(self.seed, 0, index))


class PipelineBatches:
    """Batches of the real data pipeline at any config's sizes, from chains preprocessed once.

    Made by `PipelineBatches.open()`: the OpenFold test data's chains with alignments
    (`hfkit.bench.data_cost.real_inputs`) preprocessed into a temporary record folder, kept until
    `close()`. `dataset(config)` samples them (`DeepenedMsaDataset`), `stream(config)` yields
    batches forever (`hfkit.train.batch_stream` over a shuffled DataLoader), `batch(config)` gives
    one. Every batch has the features, shapes and dtypes of `hfkit.train.synthetic_batch(config,
    batch_size)`, so one graphed step takes both. `label` says what the chains are; `synthetic` is
    True where the real inputs were absent and synthetic chains stand in.
    """

    def __init__(
        self,
        inputs: Inputs,
        label: str,
        synthetic: bool,
        workdir: tempfile.TemporaryDirectory[str] | None = None,
        mutation_rate: float = DEFAULT_MUTATION_RATE,
        seed: int = 0,
    ) -> None:
        self.inputs = inputs
        self.label = label
        self.synthetic = synthetic
        self.mutation_rate = float(mutation_rate)
        self.seed = int(seed)
        self._workdir = workdir

    @classmethod
    def open(
        cls,
        real_dir: str | Path | None = None,
        work_dir: str | Path | None = None,
        mutation_rate: float = DEFAULT_MUTATION_RATE,
        seed: int = 0,
    ) -> PipelineBatches:
        """Preprocess the chains with alignments under `real_dir` (default: `openfold_test_data_dir()`)
        into a temporary folder (under `work_dir` if given). Where no such folder exists, write
        and preprocess synthetic chains instead (labelled synthetic) and print why."""
        from hfkit.bench.data_cost import real_inputs, synthetic_inputs
        from hfkit.data import openfold_test_data_dir

        real = Path(real_dir) if real_dir is not None else openfold_test_data_dir()
        workdir = tempfile.TemporaryDirectory(prefix="hfkit-batches-", dir=work_dir)
        root = Path(workdir.name)
        try:
            if real is not None and (real / "alignments").is_dir() and (real / "mmcifs").is_dir():
                inputs = real_inputs(real, root / "real")
                return cls(inputs, f"real chains from {real}", False, workdir, mutation_rate, seed)
            where = (
                f"looked in {real_dir}"
                if real_dir is not None
                else "set HFKIT_OPENFOLD_TEST_DATA, or place them at shared/data/openfold_test_data "
                "beside the repository"
            )
            print(
                f"real inputs (OpenFold's test data: mmcifs/, alignments/) not found ({where}): "
                f"{_SYNTHETIC_CHAINS} synthetic chains of {_SYNTHETIC_LENGTH} residues stand in"
            )
            inputs = synthetic_inputs(
                root / "synthetic", _SYNTHETIC_CHAINS, _SYNTHETIC_LENGTH, _SYNTHETIC_DEPTH, seed=seed
            )
            label = f"synthetic chains ({_SYNTHETIC_LENGTH} residues; real inputs not found)"
            return cls(inputs, label, True, workdir, mutation_rate, seed)
        except BaseException:
            workdir.cleanup()
            raise

    def dataset(self, config: ModelConfig | FeatureConfig, depth: int | None = None) -> DeepenedMsaDataset:
        """The chains sampled at `config`'s sizes, MSAs deepened to `depth` rows (default
        `sample_msa_depth(config)`)."""
        return DeepenedMsaDataset(
            self.inputs.records, _feature_config(config), depth, self.mutation_rate, self.seed
        )

    def stream(
        self, config: ModelConfig | FeatureConfig, batch_size: int = 1, depth: int | None = None
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Batches of `batch_size` samples forever, in a shuffled order seeded with `seed`, each
        epoch's samples drawn afresh: `msa_feat` [B, max_msa_clusters, crop_size, 49] and the rest of
        `feature_shapes(config)` with a leading batch axis."""
        from hfkit.train import batch_stream

        dataset = self.dataset(config, depth)
        loader = make_dataloader(dataset, batch_size=batch_size, shuffle=True, seed=self.seed, drop_last=True)
        if len(loader) == 0:
            raise ValueError(f"batch_size: expected at most {len(dataset)} (the chains), got {batch_size}")
        return batch_stream(loader, config)

    def batch(
        self, config: ModelConfig | FeatureConfig, index: int = 0, depth: int | None = None
    ) -> dict[str, torch.Tensor]:
        """One batch (B = 1) of chain `index`, sampled at `config`'s sizes."""
        return collate_fixed([self.dataset(config, depth)[index]])

    def chains(self, config: ModelConfig | FeatureConfig | None = None) -> pd.DataFrame:
        """One row per chain: its id, residues, real MSA rows, and (with `config`) the rows after
        deepening for that config."""
        import pandas as pd

        plain = PreprocessedDataset(self.inputs.records, FeatureConfig.tiny())
        rows = []
        for i in range(len(plain)):
            raw = plain.raw_features(i)
            row = {
                "chain": plain.chain_ids[i] if plain.chain_ids else str(i),
                "residues": int(raw["aatype"].shape[0]),
                "msa rows (real)": int(raw["msa"].shape[0]),
            }
            if config is not None:
                row["msa rows (deepened)"] = max(row["msa rows (real)"], sample_msa_depth(config))
            rows.append(row)
        return pd.DataFrame(rows)

    def close(self) -> None:
        """Delete the temporary record folder."""
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> PipelineBatches:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
