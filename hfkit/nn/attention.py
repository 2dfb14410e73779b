"""Gated multi-head attention with OpenFold's parameter names: `Attention` (plain torch) and
`EvoformerAttention` (same parameters, forward through the fused `hfkit.ops.evoformer_attention`).

`Attention` follows `openfold/model/primitives.py::Attention` (AlphaFold 2 supplement, Algorithms 7,
8, 13-15 use it): queries scaled by 1/sqrt(c_hidden), additive biases, softmax over keys, a sigmoid gate
computed from the query input, and an output projection. Importing this file registers the swap
`Attention` -> `EvoformerAttention` used by `hfkit.to_hfkit`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from hfkit.nn.convert import register_swap
from hfkit.ops.evoformer_attention import evoformer_attention
from hfkit.ops.gated_linear import gated_linear

__all__ = ["Attention", "EvoformerAttention"]


def _glorot_(weight: torch.Tensor) -> None:
    nn.init.xavier_uniform_(weight, gain=1.0)


class Attention(nn.Module):
    """Gated multi-head attention over `[*, Q, c_q]` queries and `[*, K, c_k]` keys/values.

    Parameters (OpenFold names, so its state_dicts load): `linear_q`, `linear_k`, `linear_v`
    (c_{q,k,v} -> no_heads * c_hidden, no bias, Glorot init), `linear_o` (no_heads * c_hidden -> c_q,
    with bias, zero init: OpenFold's "final"), and with `gating` `linear_g` (c_q -> no_heads * c_hidden,
    weight 0 and bias 1: the gate starts open at sigmoid(1)).
    """

    def __init__(
        self, c_q: int, c_k: int, c_v: int, c_hidden: int, no_heads: int, gating: bool = True
    ) -> None:
        super().__init__()
        for name, value in (
            ("c_q", c_q),
            ("c_k", c_k),
            ("c_v", c_v),
            ("c_hidden", c_hidden),
            ("no_heads", no_heads),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.c_q = c_q
        self.c_k = c_k
        self.c_v = c_v
        self.c_hidden = c_hidden
        self.no_heads = no_heads
        self.gating = gating
        hc = c_hidden * no_heads
        self.linear_q = nn.Linear(c_q, hc, bias=False)
        self.linear_k = nn.Linear(c_k, hc, bias=False)
        self.linear_v = nn.Linear(c_v, hc, bias=False)
        self.linear_o = nn.Linear(hc, c_q)
        self.linear_g = nn.Linear(c_q, hc) if gating else None
        self.sigmoid = nn.Sigmoid()
        with torch.no_grad():
            for lin in (self.linear_q, self.linear_k, self.linear_v):
                _glorot_(lin.weight)
            self.linear_o.weight.zero_()
            self.linear_o.bias.zero_()
            if self.linear_g is not None:
                self.linear_g.weight.zero_()
                self.linear_g.bias.fill_(1.0)

    def extra_repr(self) -> str:
        return (
            f"c_q={self.c_q}, c_k={self.c_k}, c_v={self.c_v}, c_hidden={self.c_hidden}, "
            f"no_heads={self.no_heads}, gating={self.gating}"
        )

    def _check(self, q_x: torch.Tensor, kv_x: torch.Tensor, biases: Sequence[torch.Tensor] | None) -> list:
        if not isinstance(q_x, torch.Tensor) or q_x.dim() < 2 or q_x.shape[-1] != self.c_q:
            raise ValueError(f"q_x: expected a tensor [*, Q, {self.c_q}], got {_shape_of(q_x)}")
        if not isinstance(kv_x, torch.Tensor) or kv_x.dim() < 2 or kv_x.shape[-1] != self.c_k:
            raise ValueError(f"kv_x: expected a tensor [*, K, {self.c_k}], got {_shape_of(kv_x)}")
        if self.c_k != self.c_v:
            raise ValueError(
                f"kv_x: serves as key and value input, so c_k ({self.c_k}) must equal c_v ({self.c_v})"
            )
        if biases is None:
            return []
        if isinstance(biases, torch.Tensor):
            raise ValueError(
                "biases: expected a list of tensors or None, got a single tensor; wrap it in a list"
            )
        biases = list(biases)
        for i, b in enumerate(biases):
            if not isinstance(b, torch.Tensor):
                raise ValueError(f"biases[{i}]: expected a torch.Tensor, got {type(b).__name__}")
        return biases

    def _project(
        self, q_x: torch.Tensor, kv_x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [*, Q|K, H, c_hidden]; q not yet scaled."""
        h = self.no_heads
        q = self.linear_q(q_x).unflatten(-1, (h, self.c_hidden))
        k = self.linear_k(kv_x).unflatten(-1, (h, self.c_hidden))
        v = self.linear_v(kv_x).unflatten(-1, (h, self.c_hidden))
        return q, k, v

    def _wrap_up(self, o: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
        """o: [*, Q, H, c_hidden] -> gate, flatten heads, project: [*, Q, c_q]."""
        if self.linear_g is not None:
            g = self.sigmoid(self.linear_g(q_x)).unflatten(-1, (self.no_heads, self.c_hidden))
            o = o * g
        return self.linear_o(o.flatten(-2))

    def _attend_reference(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, biases: list[torch.Tensor]
    ) -> torch.Tensor:
        # [*, H, Q, C] layout as in OpenFold; logits [*, H, Q, K] in the input dtype.
        q = q.transpose(-2, -3) / math.sqrt(self.c_hidden)
        k = k.transpose(-2, -3)
        v = v.transpose(-2, -3)
        a = torch.matmul(q, k.transpose(-1, -2))
        for b in biases:
            a = a + b
        a = torch.softmax(a, dim=-1)
        return torch.matmul(a, v).transpose(-2, -3)

    def forward(
        self, q_x: torch.Tensor, kv_x: torch.Tensor, biases: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """q_x: [*, Q, c_q], kv_x: [*, K, c_k], biases: tensors broadcastable to [*, H, Q, K] (added to
        the logits) or None -> [*, Q, c_q]."""
        biases = self._check(q_x, kv_x, biases)
        q, k, v = self._project(q_x, kv_x)
        return self._wrap_up(self._attend_reference(q, k, v, biases), q_x)


class EvoformerAttention(Attention):
    """`Attention` whose attention core runs the fused, memory-efficient `hfkit.ops.evoformer_attention`.

    Same constructor, parameters and state_dict as `Attention`; `forward` maps OpenFold's biases onto
    the op for inputs `q_x`, `kv_x`: [*, Q|K, c] with at most two leading dims [B, S] shared by both:
    every bias of shape [*, 1, 1, K] (a mask bias `inf * (mask - 1)`) is summed into the op's additive
    key bias, every other bias (a pair bias [*, 1, H, Q, K], with its gradient) into `bias`. Anything
    else (more leading dims, biases with more dims than the logits, a mask bias that requires grad)
    runs `Attention`'s plain-torch path.
    """

    def forward(
        self, q_x: torch.Tensor, kv_x: torch.Tensor, biases: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        biases = self._check(q_x, kv_x, biases)
        q, k, v = self._project(q_x, kv_x)
        lead = q_x.dim() - 2
        mapped = _map_biases(biases, lead) if lead <= 2 and q_x.shape[:-2] == kv_x.shape[:-2] else None
        if mapped is None:
            return self._wrap_up(self._attend_reference(q, k, v, biases), q_x)
        pair, key = mapped
        # [*, N, H, C] -> [B, S, H, N, C]: a strided view, the kernels take any strides.
        to5 = lambda t: t.reshape((1,) * (2 - lead) + tuple(t.shape)).transpose(-2, -3)
        o = evoformer_attention(to5(q), to5(k), to5(v), pair, key_bias=key)
        o = o.transpose(-2, -3).reshape(q.shape)
        return self._wrap_up(o, q_x)

    def _wrap_up(self, o: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
        """`Attention._wrap_up` as `hfkit.ops.gated_linear`: the gate `sigmoid(linear_g(q_x)) * o` is one
        fused kernel, and the backward recomputes it instead of keeping it for linear_o's weight
        gradient. linear_o's parameters are read directly (its forward hooks, if any, do not run)."""
        o = o.flatten(-2)
        if self.linear_g is None:
            return self.linear_o(o)
        return gated_linear(self.linear_g(q_x), o, self.linear_o.weight, self.linear_o.bias)


def _map_biases(
    biases: list[torch.Tensor], lead: int
) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """Split biases for logits [*lead, H, Q, K] into (pair bias [B, S, H, Q, K] or None, key bias
    [B, S, K] or None), both with 1 where broadcast; None when some bias does not fit."""
    pair = key = None
    for b in biases:
        if b.dim() > lead + 3:
            return None
        b5 = b.reshape((1,) * (5 - b.dim()) + tuple(b.shape))
        if b5.shape[2] == 1 and b5.shape[3] == 1:
            if b.requires_grad:
                return None
            kb = b5[:, :, 0, 0, :].float()
            key = kb if key is None else key + kb
        else:
            pair = b5 if pair is None else pair + b5
    return pair, key


register_swap(Attention, EvoformerAttention)


def _shape_of(x: object) -> str:
    return f"shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
