"""Model configuration: one frozen dataclass with presets `tiny` (CPU tests), `af2_initial` and
`af2_finetune` (AF2 supplement Table 4 / section 1.11; OpenFold's `config.py` names)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hfkit.data.msa_sampling import MSA_FEAT_DIM, TARGET_FEAT_DIM, FeatureConfig
from hfkit.data.residue_constants import MSA_NUM_CLASSES

__all__ = ["ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the Evoformer, embedder and heads, the sample sizes they train on, and run switches.

    `checkpoint` recomputes each Evoformer block in backward (activation checkpointing);
    `chunk_size` (None: off) runs attention, transitions and the outer product mean that many rows
    at a time (inference memory; results equal the unchunked ones). `_mask_trans` is OpenFold's
    option of that name: True multiplies the MSA and pair transitions' updates by the masks; False
    (AlphaFold's and OpenFold's AlphaFold config) leaves them unmasked, except the extra-MSA blocks'
    MSA transition, which OpenFold always masks. `global_attention_eps` is the extra-MSA global column
    attention's eps (OpenFold's config: 1e-8).
    """

    c_m: int = 256
    c_z: int = 128
    c_s: int = 384
    c_hidden_msa_att: int = 32
    c_hidden_opm: int = 32
    c_hidden_mul: int = 128
    c_hidden_pair_att: int = 32
    no_heads_msa: int = 8
    no_heads_pair: int = 4
    no_blocks: int = 48
    transition_n: int = 4
    msa_dropout: float = 0.15
    pair_dropout: float = 0.25
    inf: float = 1e9
    _mask_trans: bool = False
    # Extra-MSA stack (Alg. 18, 19); extra_no_blocks = 0 turns it off
    c_e: int = 64
    extra_c_hidden_msa_att: int = 8
    extra_no_heads_msa: int = 8
    extra_no_blocks: int = 4
    extra_msa_dim: int = MSA_NUM_CLASSES + 2
    global_attention_eps: float = 1e-8
    # Input embedder (Alg. 3, 4)
    tf_dim: int = TARGET_FEAT_DIM
    msa_dim: int = MSA_FEAT_DIM
    relpos_k: int = 32
    # Heads and losses (supplement 1.9.8, 1.9.9)
    no_bins: int = 64
    min_bin: float = 2.3125
    max_bin: float = 21.6875
    masked_msa_dim: int = MSA_NUM_CLASSES
    distogram_weight: float = 0.3
    masked_msa_weight: float = 2.0
    # Sample sizes (FeatureConfig)
    crop_size: int = 256
    max_msa_clusters: int = 128
    max_extra_msa: int = 1024
    # Run switches
    checkpoint: bool = False
    chunk_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("c_m", "c_z", "c_s", "no_heads_msa", "no_heads_pair", "no_bins", "transition_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        for name in ("no_blocks", "extra_no_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size: expected >= 1 or None, got {self.chunk_size}")

    def replace(self, **changes: object) -> ModelConfig:
        """A copy with `changes` applied (dataclasses.replace)."""
        return replace(self, **changes)

    def feature_config(self) -> FeatureConfig:
        """The `FeatureConfig` whose samples this model trains on (crop and MSA sizes)."""
        return FeatureConfig(
            crop_size=self.crop_size,
            max_msa_clusters=self.max_msa_clusters,
            max_extra_msa=self.max_extra_msa,
        )

    @classmethod
    def af2_initial(cls) -> ModelConfig:
        """AlphaFold 2 initial training: 48 blocks, c_m 256, c_z 128, 4 extra-MSA blocks (c_e 64);
        crop 256, 128 clusters, 1024 extra rows."""
        return cls()

    @classmethod
    def af2_finetune(cls) -> ModelConfig:
        """AlphaFold 2 fine-tuning: the same network; crop 384, 512 clusters, 5120 extra rows."""
        return cls(crop_size=384, max_msa_clusters=512, max_extra_msa=5120)

    @classmethod
    def tiny(cls) -> ModelConfig:
        """A 2-block model for CPU tests on `FeatureConfig.tiny()` samples (crop 32, 8 clusters)."""
        return cls(
            c_m=16,
            c_z=8,
            c_s=16,
            c_hidden_msa_att=4,
            c_hidden_opm=4,
            c_hidden_mul=8,
            c_hidden_pair_att=4,
            no_heads_msa=2,
            no_heads_pair=2,
            no_blocks=2,
            transition_n=2,
            c_e=8,
            extra_c_hidden_msa_att=4,
            extra_no_heads_msa=2,
            extra_no_blocks=1,
            relpos_k=8,
            crop_size=32,
            max_msa_clusters=8,
            max_extra_msa=16,
        )
