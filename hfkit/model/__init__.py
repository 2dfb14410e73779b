"""A compact AlphaFold 2 Evoformer with OpenFold's parameter names and semantics, its heads and
losses: plain torch modules (swap in fused kernels with `hfkit.to_hfkit`). Imports torch and
`hfkit.data` only.

One file per component, named after OpenFold's: `primitives` (`linear`, gated `Attention`), `dropout`
(shared dropout, 1.11.6), `msa` (Alg. 7, 8, 19), `pair_transition` (Alg. 15),
`outer_product_mean` (Alg. 10), `triangular_multiplicative_update` (Alg. 11, 12),
`triangular_attention` (Alg. 13, 14), `evoformer` (Alg. 6, 9, 18), `embedders` (Alg. 3, 4), `heads` and
`loss` (1.9.8, 1.9.9), `model` (`AlphaFoldLite`), `config` (`ModelConfig` presets), `openfold_weights`
(`load_openfold_state_dict`: OpenFold checkpoints).
"""

from hfkit.model.config import ModelConfig
from hfkit.model.dropout import DropoutColumnwise, DropoutRowwise, SharedDropout
from hfkit.model.embedders import ExtraMSAEmbedder, InputEmbedder, build_extra_msa_feat
from hfkit.model.evoformer import (
    EvoformerBlock,
    EvoformerBlockCore,
    EvoformerStack,
    ExtraMSABlock,
    ExtraMSAStack,
    MSATransition,
    openfold_v2_to_v1_keys,
)
from hfkit.model.heads import AuxiliaryHeads, DistogramHead, MaskedMSAHead
from hfkit.model.inference import BlockWidths, choose_chunk_size, lean_forward, lean_working_set_bytes
from hfkit.model.loss import distogram_loss, masked_msa_loss, pseudo_beta
from hfkit.model.model import AlphaFoldLite
from hfkit.model.msa import (
    GlobalAttention,
    MSAAttention,
    MSAColumnAttention,
    MSAColumnGlobalAttention,
    MSARowAttentionWithPairBias,
)
from hfkit.model.openfold_weights import LoadReport, load_openfold_state_dict
from hfkit.model.outer_product_mean import OuterProductMean
from hfkit.model.pair_transition import PairTransition
from hfkit.model.primitives import Attention
from hfkit.model.triangular_attention import (
    TriangleAttention,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
)
from hfkit.model.triangular_multiplicative_update import (
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)

__all__ = [
    "AlphaFoldLite",
    "Attention",
    "AuxiliaryHeads",
    "BlockWidths",
    "DistogramHead",
    "DropoutColumnwise",
    "DropoutRowwise",
    "EvoformerBlock",
    "EvoformerBlockCore",
    "EvoformerStack",
    "ExtraMSABlock",
    "ExtraMSAEmbedder",
    "ExtraMSAStack",
    "GlobalAttention",
    "InputEmbedder",
    "LoadReport",
    "MSAAttention",
    "MSAColumnAttention",
    "MSAColumnGlobalAttention",
    "MSARowAttentionWithPairBias",
    "MSATransition",
    "MaskedMSAHead",
    "ModelConfig",
    "OuterProductMean",
    "PairTransition",
    "SharedDropout",
    "TriangleAttention",
    "TriangleAttentionEndingNode",
    "TriangleAttentionStartingNode",
    "TriangleMultiplicationIncoming",
    "TriangleMultiplicationOutgoing",
    "build_extra_msa_feat",
    "choose_chunk_size",
    "lean_forward",
    "lean_working_set_bytes",
    "load_openfold_state_dict",
    "distogram_loss",
    "masked_msa_loss",
    "openfold_v2_to_v1_keys",
    "pseudo_beta",
]
