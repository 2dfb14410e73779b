"""The Evoformer trunk (AF2 supplement Algorithm 6): `MSATransition` (Algorithm 9), the block
(`EvoformerBlock` = MSA attention + `EvoformerBlockCore`) and the stack with its single projection;
the extra-MSA stack (Algorithm 18: `ExtraMSABlock` with global column attention, `ExtraMSAStack`).

Module nesting follows OpenFold's `EvoformerStack` (the `core` layout of its released weights), so
that an OpenFold state_dict loads with strict=True: `blocks.{i}.msa_att_row`, `.msa_att_col`,
`.core.{msa_transition, outer_product_mean, tri_mul_out, tri_mul_in, tri_att_start, tri_att_end,
pair_transition}`, and `linear`. `openfold_v2_to_v1_keys` maps the flat keys of OpenFold >= 2.0
(`msa_transition`, `pair_stack.tri_*`) onto them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hfkit.model.config import ModelConfig
from hfkit.model.dropout import DropoutColumnwise, DropoutRowwise
from hfkit.model.msa import MSAColumnAttention, MSAColumnGlobalAttention, MSARowAttentionWithPairBias
from hfkit.model.outer_product_mean import OuterProductMean
from hfkit.model.pair_transition import PairTransition, Transition
from hfkit.model.primitives import linear, run_tapped
from hfkit.model.triangular_attention import TriangleAttentionEndingNode, TriangleAttentionStartingNode
from hfkit.model.triangular_multiplicative_update import (
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
)

__all__ = [
    "EvoformerBlock",
    "EvoformerBlockCore",
    "EvoformerStack",
    "ExtraMSABlock",
    "ExtraMSAStack",
    "MSATransition",
    "openfold_v2_to_v1_keys",
    "run_blocks",
]


class MSATransition(Transition):
    """Algorithm 9: transition layer of the MSA representation (hidden n * c_m)."""

    def __init__(self, c_m: int, n: int) -> None:
        super().__init__(c_m, n)


class EvoformerBlockCore(nn.Module):
    """Algorithm 6 lines 6-12: MSA transition, outer product mean, triangle updates and attention,
    pair transition. Pair dropout is row-wise (column-wise for the ending-node attention).

    `mask_msa_transition` / `mask_pair_transition` multiply the transitions' updates by the MSA /
    pair mask (OpenFold's `_mask_trans`; AlphaFold and OpenFold's AlphaFold config leave them
    unmasked). Plain attributes, not state: they may be changed on a built module.
    """

    def __init__(
        self,
        c_m: int,
        c_z: int,
        c_hidden_opm: int,
        c_hidden_mul: int,
        c_hidden_pair_att: int,
        no_heads_pair: int,
        transition_n: int,
        pair_dropout: float,
        inf: float = 1e9,
        mask_msa_transition: bool = True,
        mask_pair_transition: bool = True,
    ) -> None:
        super().__init__()
        self.mask_msa_transition = mask_msa_transition
        self.mask_pair_transition = mask_pair_transition
        self.msa_transition = MSATransition(c_m, transition_n)
        self.outer_product_mean = OuterProductMean(c_m, c_z, c_hidden_opm)
        self.tri_mul_out = TriangleMultiplicationOutgoing(c_z, c_hidden_mul)
        self.tri_mul_in = TriangleMultiplicationIncoming(c_z, c_hidden_mul)
        self.tri_att_start = TriangleAttentionStartingNode(c_z, c_hidden_pair_att, no_heads_pair, inf=inf)
        self.tri_att_end = TriangleAttentionEndingNode(c_z, c_hidden_pair_att, no_heads_pair, inf=inf)
        self.pair_transition = PairTransition(c_z, transition_n)
        self.ps_dropout_row_layer = DropoutRowwise(pair_dropout)
        self.ps_dropout_col_layer = DropoutColumnwise(pair_dropout)

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        chunk_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.msa_transition_step(m, msa_mask, chunk_size)
        # Each residual input is tapped for the update's first LayerNorm (see `run_tapped`).
        update, m = run_tapped(lambda: self.outer_product_mean(m, mask=msa_mask, chunk_size=chunk_size), m)
        z = z + update
        # `residual_add(z, u)` is z + dropout(u): one fused kernel once `to_hfkit` swaps the dropout.
        row, col = self.ps_dropout_row_layer, self.ps_dropout_col_layer
        z = self._pair_step(row, self.tri_mul_out, z, mask=pair_mask)
        z = self._pair_step(row, self.tri_mul_in, z, mask=pair_mask)
        z = self._pair_step(row, self.tri_att_start, z, mask=pair_mask, chunk_size=chunk_size)
        z = self._pair_step(col, self.tri_att_end, z, mask=pair_mask, chunk_size=chunk_size)
        return m, self.pair_transition_step(z, pair_mask, chunk_size)

    @staticmethod
    def _pair_step(dropout: nn.Module, op: nn.Module, z: torch.Tensor, **kwargs) -> torch.Tensor:
        """z + dropout(op(z, **kwargs)), z tapped for op's first LayerNorm."""
        update, z_in = run_tapped(lambda: op(z, **kwargs), z)
        return dropout.residual_add(z_in, update)

    def msa_transition_step(
        self, m: torch.Tensor, msa_mask: torch.Tensor, chunk_size: int | None
    ) -> torch.Tensor:
        """m + the MSA transition's update (masked by msa_mask with `mask_msa_transition`); m and
        msa_mask may be any slice of the MSA (rows, or columns as DAP shards it)."""
        mask = msa_mask if self.mask_msa_transition else None
        update, m_in = run_tapped(lambda: self.msa_transition(m, mask=mask, chunk_size=chunk_size), m)
        return m_in + update

    def pair_transition_step(
        self, z: torch.Tensor, pair_mask: torch.Tensor, chunk_size: int | None
    ) -> torch.Tensor:
        """z + the pair transition's update (masked by pair_mask with `mask_pair_transition`); z and
        pair_mask may be any slice of rows."""
        mask = pair_mask if self.mask_pair_transition else None
        update, z_in = run_tapped(lambda: self.pair_transition(z, mask=mask, chunk_size=chunk_size), z)
        return z_in + update


class EvoformerBlock(nn.Module):
    """One Evoformer block (Algorithm 6 lines 2-12): MSA row attention with pair bias (row-wise
    dropout), MSA column attention, then `core`.

    `mask_trans` (OpenFold's `_mask_trans`) masks both transitions' updates; `eps` is the global
    column attention's (extra-MSA blocks only).
    """

    # OpenFold's ExtraMSABlock masks its MSA transition whatever `_mask_trans` says.
    _msa_transition_always_masked = False

    def __init__(
        self,
        c_m: int,
        c_z: int,
        c_hidden_msa_att: int,
        c_hidden_opm: int,
        c_hidden_mul: int,
        c_hidden_pair_att: int,
        no_heads_msa: int,
        no_heads_pair: int,
        transition_n: int,
        msa_dropout: float,
        pair_dropout: float,
        inf: float = 1e9,
        mask_trans: bool = True,
        eps: float = 1e-8,
    ) -> None:
        super().__init__()
        self.msa_att_row = MSARowAttentionWithPairBias(c_m, c_z, c_hidden_msa_att, no_heads_msa, inf=inf)
        self.msa_att_col = self._column_attention(c_m, c_hidden_msa_att, no_heads_msa, inf, eps)
        self.msa_dropout_layer = DropoutRowwise(msa_dropout)
        self.core = EvoformerBlockCore(
            c_m=c_m,
            c_z=c_z,
            c_hidden_opm=c_hidden_opm,
            c_hidden_mul=c_hidden_mul,
            c_hidden_pair_att=c_hidden_pair_att,
            no_heads_pair=no_heads_pair,
            transition_n=transition_n,
            pair_dropout=pair_dropout,
            inf=inf,
            mask_msa_transition=mask_trans or self._msa_transition_always_masked,
            mask_pair_transition=mask_trans,
        )

    @staticmethod
    def _column_attention(c_m: int, c_hidden: int, no_heads: int, inf: float, eps: float) -> nn.Module:
        return MSAColumnAttention(c_m, c_hidden, no_heads, inf=inf)

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        chunk_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """m: [*, S, N, C_m], z: [*, N, N, C_z], msa_mask: [*, S, N], pair_mask: [*, N, N] -> (m, z)."""
        # Residual inputs tapped for the updates' first LayerNorms (see `run_tapped`); z for the
        # pair bias's LayerNorm, its other reader being the outer product mean's residual add.
        update, m_in, z = run_tapped(
            lambda: self.msa_att_row(m, z=z, mask=msa_mask, chunk_size=chunk_size), m, z
        )
        m = self.msa_dropout_layer.residual_add(m_in, update)
        update, m_in = run_tapped(lambda: self.msa_att_col(m, mask=msa_mask, chunk_size=chunk_size), m)
        m = m_in + update
        return self.core(m, z, msa_mask, pair_mask, chunk_size=chunk_size)


class EvoformerStack(nn.Module):
    """Algorithm 6: `no_blocks` Evoformer blocks, then the single representation s = Linear(m_1)
    (`linear`, c_m -> c_s) from the first MSA row.

    With `checkpoint`, each block is recomputed in backward (torch.utils.checkpoint,
    use_reentrant=False; the RNG state is replayed, so dropout masks match). `mask_trans` is
    OpenFold's `_mask_trans` (see `EvoformerBlockCore`).
    """

    def __init__(
        self,
        c_m: int,
        c_z: int,
        c_hidden_msa_att: int,
        c_hidden_opm: int,
        c_hidden_mul: int,
        c_hidden_pair_att: int,
        c_s: int,
        no_heads_msa: int,
        no_heads_pair: int,
        no_blocks: int,
        transition_n: int,
        msa_dropout: float,
        pair_dropout: float,
        inf: float = 1e9,
        checkpoint: bool = False,
        mask_trans: bool = True,
    ) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.blocks = nn.ModuleList(
            EvoformerBlock(
                c_m=c_m,
                c_z=c_z,
                c_hidden_msa_att=c_hidden_msa_att,
                c_hidden_opm=c_hidden_opm,
                c_hidden_mul=c_hidden_mul,
                c_hidden_pair_att=c_hidden_pair_att,
                no_heads_msa=no_heads_msa,
                no_heads_pair=no_heads_pair,
                transition_n=transition_n,
                msa_dropout=msa_dropout,
                pair_dropout=pair_dropout,
                inf=inf,
                mask_trans=mask_trans,
            )
            for _ in range(no_blocks)
        )
        self.linear = linear(c_m, c_s)

    @classmethod
    def from_config(cls, config: ModelConfig) -> EvoformerStack:
        """The stack of `config` (its sizes, dropout rates and `checkpoint` switch)."""
        return cls(
            c_m=config.c_m,
            c_z=config.c_z,
            c_hidden_msa_att=config.c_hidden_msa_att,
            c_hidden_opm=config.c_hidden_opm,
            c_hidden_mul=config.c_hidden_mul,
            c_hidden_pair_att=config.c_hidden_pair_att,
            c_s=config.c_s,
            no_heads_msa=config.no_heads_msa,
            no_heads_pair=config.no_heads_pair,
            no_blocks=config.no_blocks,
            transition_n=config.transition_n,
            msa_dropout=config.msa_dropout,
            pair_dropout=config.pair_dropout,
            inf=config.inf,
            checkpoint=config.checkpoint,
            mask_trans=config._mask_trans,
        )

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        chunk_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """m: [*, S, N, C_m], z: [*, N, N, C_z], msa_mask: [*, S, N], pair_mask: [*, N, N]
        -> (m [*, S, N, C_m], z [*, N, N, C_z], s [*, N, C_s])."""
        if m.shape[-2] != z.shape[-2] or z.shape[-2] != z.shape[-3]:
            raise ValueError(
                f"m, z: expected [*, S, N, C_m] and [*, N, N, C_z], got {tuple(m.shape)} and {tuple(z.shape)}"
            )
        m, z = run_blocks(self.blocks, m, z, msa_mask, pair_mask, chunk_size, recompute=self.checkpoint)
        s = self.linear(m[..., 0, :, :])
        return m, z, s


def run_blocks(
    blocks: Iterable[Callable[..., tuple[torch.Tensor, torch.Tensor]]],
    m: torch.Tensor,
    z: torch.Tensor,
    *rest: Any,
    recompute: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """m, z through `blocks` in order, each called as block(m, z, *rest) -> (m, z) (`rest`: the masks,
    chunk size, ...); with `recompute` (and autograd on), each under a non-reentrant checkpoint."""
    recompute = recompute and torch.is_grad_enabled()
    for block in blocks:
        if recompute:
            m, z = checkpoint(block, m, z, *rest, use_reentrant=False)
        else:
            m, z = block(m, z, *rest)
    return m, z


class ExtraMSABlock(EvoformerBlock):
    """Algorithm 18 lines 2-12: an Evoformer block whose column attention is global (Algorithm 19),
    cheap enough for thousands of extra MSA rows. Its MSA transition is always masked (as OpenFold's)."""

    _msa_transition_always_masked = True

    @staticmethod
    def _column_attention(c_m: int, c_hidden: int, no_heads: int, inf: float, eps: float) -> nn.Module:
        return MSAColumnGlobalAttention(c_m, c_hidden, no_heads, inf=inf, eps=eps)


class ExtraMSAStack(nn.Module):
    """Algorithm 18: `no_blocks` extra-MSA blocks; only the pair representation is kept. `mask_trans`
    is OpenFold's `_mask_trans` (here: the pair transition only), `eps` the global attention's."""

    def __init__(
        self,
        c_m: int,
        c_z: int,
        c_hidden_msa_att: int,
        c_hidden_opm: int,
        c_hidden_mul: int,
        c_hidden_pair_att: int,
        no_heads_msa: int,
        no_heads_pair: int,
        no_blocks: int,
        transition_n: int,
        msa_dropout: float,
        pair_dropout: float,
        inf: float = 1e9,
        checkpoint: bool = False,
        mask_trans: bool = True,
        eps: float = 1e-8,
    ) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.blocks = nn.ModuleList(
            ExtraMSABlock(
                c_m=c_m,
                c_z=c_z,
                c_hidden_msa_att=c_hidden_msa_att,
                c_hidden_opm=c_hidden_opm,
                c_hidden_mul=c_hidden_mul,
                c_hidden_pair_att=c_hidden_pair_att,
                no_heads_msa=no_heads_msa,
                no_heads_pair=no_heads_pair,
                transition_n=transition_n,
                msa_dropout=msa_dropout,
                pair_dropout=pair_dropout,
                inf=inf,
                mask_trans=mask_trans,
                eps=eps,
            )
            for _ in range(no_blocks)
        )

    @classmethod
    def from_config(cls, config: ModelConfig) -> ExtraMSAStack:
        """The extra-MSA stack of `config` (`c_e`, `extra_*` sizes; the pair sizes of the main stack)."""
        return cls(
            c_m=config.c_e,
            c_z=config.c_z,
            c_hidden_msa_att=config.extra_c_hidden_msa_att,
            c_hidden_opm=config.c_hidden_opm,
            c_hidden_mul=config.c_hidden_mul,
            c_hidden_pair_att=config.c_hidden_pair_att,
            no_heads_msa=config.extra_no_heads_msa,
            no_heads_pair=config.no_heads_pair,
            no_blocks=config.extra_no_blocks,
            transition_n=config.transition_n,
            msa_dropout=config.msa_dropout,
            pair_dropout=config.pair_dropout,
            inf=config.inf,
            checkpoint=config.checkpoint,
            mask_trans=config._mask_trans,
            eps=config.global_attention_eps,
        )

    def forward(
        self,
        a: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        chunk_size: int | None = None,
    ) -> torch.Tensor:
        """a: [*, S_extra, N, C_e], z: [*, N, N, C_z], msa_mask: [*, S_extra, N], pair_mask: [*, N, N]
        -> z [*, N, N, C_z]."""
        return run_blocks(self.blocks, a, z, msa_mask, pair_mask, chunk_size, recompute=self.checkpoint)[1]


_V2_TO_V1 = (
    (re.compile(r"(blocks\.\d+\.)(msa_transition|outer_product_mean)\."), r"\1core.\2."),
    (re.compile(r"(blocks\.\d+\.)pair_stack\."), r"\1core."),
)


def openfold_v2_to_v1_keys(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An OpenFold >= 2.0 EvoformerStack state_dict (`blocks.i.msa_transition`,
    `blocks.i.pair_stack.tri_mul_out`, ...) renamed to the `core` layout used here (the inverse of
    OpenFold's `convert_deprecated_v1_keys` for the Evoformer)."""
    out = {}
    for key, value in state_dict.items():
        for pattern, repl in _V2_TO_V1:
            key = pattern.sub(repl, key)
        out[key] = value
    return out
