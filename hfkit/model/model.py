"""`AlphaFoldLite`: input embedder -> extra-MSA stack -> Evoformer stack -> distogram and masked-MSA
heads, with their losses. An AlphaFold 2 trunk (Algorithm 2) without templates, recycling or
structure module."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from hfkit.model.config import ModelConfig
from hfkit.model.embedders import ExtraMSAEmbedder, InputEmbedder, build_extra_msa_feat
from hfkit.model.evoformer import EvoformerStack, ExtraMSAStack
from hfkit.model.heads import AuxiliaryHeads
from hfkit.model.loss import distogram_loss, masked_msa_loss, pseudo_beta

__all__ = ["AlphaFoldLite"]

_INPUTS = ("target_feat", "residue_index", "msa_feat", "msa_mask", "seq_mask")
_EXTRA_INPUTS = ("extra_msa", "extra_msa_mask", "extra_has_deletion", "extra_deletion_value")


class AlphaFoldLite(nn.Module):
    """Submodules named as in OpenFold's `AlphaFold`: `input_embedder`, `extra_msa_embedder` and
    `extra_msa_stack` (None when `extra_no_blocks` is 0), `evoformer`, `aux_heads`.

    `forward(batch)` takes `process_features` outputs (with or without a leading batch axis) and
    returns `msa` [*, S, N, c_m], `pair` [*, N, N, c_z], `single` [*, N, c_s],
    `distogram_logits` [*, N, N, no_bins] and `masked_msa_logits` [*, S, N, 23].
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.input_embedder = InputEmbedder(
            config.tf_dim, config.msa_dim, config.c_z, config.c_m, config.relpos_k
        )
        self.extra_msa_embedder = None
        self.extra_msa_stack = None
        if config.extra_no_blocks > 0:
            self.extra_msa_embedder = ExtraMSAEmbedder(config.extra_msa_dim, config.c_e)
            self.extra_msa_stack = ExtraMSAStack.from_config(config)
        self.evoformer = EvoformerStack.from_config(config)
        self.aux_heads = AuxiliaryHeads(config.c_m, config.c_z, config.no_bins, config.masked_msa_dim)
        # The model's dtype for its input features, cast with the parameters by `.to(dtype)` and the
        # like; empty and outside the state_dict. (A Linear weight's dtype would say bf16 inside
        # `hfkit.train`'s autocast step, which hands the model pre-cast Linear weights.)
        self.register_buffer("dtype_probe", torch.empty(0), persistent=False)

    def forward(
        self, batch: Mapping[str, torch.Tensor], chunk_size: int | None = None
    ) -> dict[str, torch.Tensor]:
        """batch: `target_feat` [*, N, 22], `residue_index` [*, N], `msa_feat` [*, S, N, 49],
        `msa_mask` [*, S, N], `seq_mask` [*, N], and for the extra-MSA stack `extra_msa`,
        `extra_msa_mask`, `extra_has_deletion`, `extra_deletion_value` [*, E, N]. `chunk_size`
        defaults to the config's."""
        needed = _INPUTS + (_EXTRA_INPUTS if self.extra_msa_stack is not None else ())
        missing = [k for k in needed if k not in batch]
        if missing:
            raise ValueError(f"batch: missing features {missing}; expected {list(needed)}")
        if chunk_size is None:
            chunk_size = self.config.chunk_size
        dtype = self.dtype_probe.dtype
        target_feat = batch["target_feat"].to(dtype)
        m, z = self.input_embedder(target_feat, batch["residue_index"], batch["msa_feat"].to(dtype))
        seq_mask = batch["seq_mask"].to(dtype)
        msa_mask = batch["msa_mask"].to(dtype)
        pair_mask = seq_mask[..., :, None] * seq_mask[..., None, :]
        if self.extra_msa_stack is not None and batch["extra_msa"].shape[-2] > 0:
            extra = build_extra_msa_feat(
                batch["extra_msa"],
                batch["extra_has_deletion"].to(dtype),
                batch["extra_deletion_value"].to(dtype),
            )
            a = self.extra_msa_embedder(extra)
            extra_mask = batch["extra_msa_mask"].to(dtype)
            z = self.extra_msa_stack(a, z, extra_mask, pair_mask, chunk_size=chunk_size)
        m, z, s = self.evoformer(m, z, msa_mask, pair_mask, chunk_size=chunk_size)
        return {"msa": m, "pair": z, "single": s, **self.aux_heads(m, z)}

    def loss(
        self, batch: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Weighted sum of the distogram loss (needs `aatype`, `all_atom_positions`, `all_atom_mask`;
        skipped when absent) and the masked-MSA loss (`true_msa`, `bert_mask`), averaged over the
        batch -> (total, {name: unweighted loss})."""
        config = self.config
        parts: dict[str, torch.Tensor] = {}
        total = outputs["masked_msa_logits"].new_zeros((), dtype=torch.float32)
        if "all_atom_positions" in batch:
            positions, mask = pseudo_beta(
                batch["aatype"], batch["all_atom_positions"], batch["all_atom_mask"]
            )
            mask = mask * batch["seq_mask"]
            parts["distogram"] = distogram_loss(
                outputs["distogram_logits"],
                positions,
                mask,
                config.min_bin,
                config.max_bin,
                config.no_bins,
            ).mean()
            total = total + config.distogram_weight * parts["distogram"]
        parts["masked_msa"] = masked_msa_loss(
            outputs["masked_msa_logits"], batch["true_msa"], batch["bert_mask"]
        ).mean()
        total = total + config.masked_msa_weight * parts["masked_msa"]
        return total, parts
