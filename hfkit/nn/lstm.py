"""`hfkit.nn.LSTM`: a drop-in `torch.nn.LSTM` whose layers run `hfkit.ops.lstm_layer`.

It subclasses `torch.nn.LSTM`, so the constructor, parameters (`weight_ih_l0`, `weight_hh_l0`,
`bias_ih_l0`, `bias_hh_l0`, `_reverse` for the second direction), `state_dict`, `extra_repr` and
`isinstance` checks are torch's; only `forward` changes. Importing this file registers the swap
`torch.nn.LSTM` -> `hfkit.nn.LSTM` used by `hfkit.to_hfkit`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from hfkit.nn.convert import register_swap
from hfkit.ops import lstm_layer

__all__ = ["LSTM"]

Tensor = torch.Tensor


class LSTM(nn.LSTM):
    """LSTM whose layers run `hfkit.ops.lstm_layer` (one matmul for the input projection of every step,
    Triton kernels for the recurrence: on CUDA one launch for the whole sequence where its grid fits on
    the GPU), layer by layer and direction by direction.

    Same constructor as `torch.nn.LSTM(input_size, hidden_size, num_layers=1, bias=True,
    batch_first=False, dropout=0.0, bidirectional=False, proj_size=0, device=None, dtype=None)` and the
    same `forward(input, hx=None)`: input [T, B, I] ([B, T, I] with `batch_first`, [T, I] unbatched),
    hx = (h0, c0) each [num_layers·D, B, H] ([num_layers·D, H] unbatched) or None for zeros, with D = 2
    when bidirectional; returns (output [T, B, D·H], (h_n, c_n)) in the same layouts. The reverse
    direction runs the op on the time-flipped sequence. Dropout between layers applies in training,
    drawn by `F.dropout` (not cuDNN's random stream). `proj_size > 0` and `PackedSequence` input run
    torch's own forward. A wrong input or hx dimension or shape raises ValueError naming it.
    """

    def forward(
        self, input: Tensor | PackedSequence, hx: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor | PackedSequence, tuple[Tensor, Tensor]]:
        if isinstance(input, PackedSequence) or self.proj_size > 0:
            return super().forward(input, hx)
        if not isinstance(input, Tensor) or input.dim() not in (2, 3):
            shape = list(input.shape) if isinstance(input, Tensor) else type(input).__name__
            raise ValueError(f"input: expected a 3-d (batched) or 2-d (unbatched) tensor, got {shape}")
        batched = input.dim() == 3
        # Time-major [T, B, I] (a view: the op's input projection reads any strides).
        transpose = batched and self.batch_first
        x = input.transpose(0, 1) if transpose else input if batched else input.unsqueeze(1)
        if x.shape[2] != self.input_size:
            raise ValueError(
                f"input: expected {self.input_size} features (input_size) in the last dim, got shape "
                f"{list(input.shape)}"
            )
        directions = 2 if self.bidirectional else 1
        h0, c0 = self._initial_state(hx, batched, x.shape[1], directions)
        h_n, c_n = [], []
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(directions):
                suffix = "_reverse" if direction else ""
                weights = [
                    getattr(self, f"weight_ih_l{layer}{suffix}"),
                    getattr(self, f"weight_hh_l{layer}{suffix}"),
                ]
                biases = (
                    [getattr(self, f"bias_ih_l{layer}{suffix}"), getattr(self, f"bias_hh_l{layer}{suffix}")]
                    if self.bias
                    else [None, None]
                )
                index = layer * directions + direction
                state = (h0[index], c0[index]) if h0 is not None else (None, None)
                seq = x.flip(0) if direction else x
                y, h, c = lstm_layer(seq, *state, *weights, *biases)
                outputs.append(y.flip(0) if direction else y)
                h_n.append(h)
                c_n.append(c)
            x = torch.cat(outputs, dim=2) if directions == 2 else outputs[0]
            if self.dropout > 0.0 and self.training and layer < self.num_layers - 1:
                x = F.dropout(x, p=self.dropout, training=True)
        h_out, c_out = torch.stack(h_n), torch.stack(c_n)
        if not batched:
            return x[:, 0], (h_out[:, 0], c_out[:, 0])
        return (x.transpose(0, 1) if self.batch_first else x), (h_out, c_out)

    def _initial_state(
        self, hx: tuple[Tensor, Tensor] | None, batched: bool, batch: int, directions: int
    ) -> tuple[Tensor | None, Tensor | None]:
        """(h0, c0) as [num_layers·D, B, H] from the caller's hx, or (None, None) for zeros."""
        if hx is None:
            return None, None
        if not isinstance(hx, tuple | list) or len(hx) != 2:
            raise ValueError(f"hx: expected a pair (h0, c0) of tensors, got {type(hx).__name__}")
        expected = (self.num_layers * directions, batch, self.hidden_size)
        dims = 3 if batched else 2
        states = []
        for name, t in zip(("hx[0] (h0)", "hx[1] (c0)"), hx, strict=True):
            if not isinstance(t, Tensor) or t.dim() != dims:
                got = list(t.shape) if isinstance(t, Tensor) else type(t).__name__
                kind = "batched" if batched else "unbatched"
                raise ValueError(f"{name}: expected a {dims}-d tensor ({kind} input), got {got}")
            t = t if batched else t.unsqueeze(1)
            if tuple(t.shape) != expected:
                want = list(expected) if batched else [expected[0], expected[2]]
                got = list(t.shape) if batched else [t.shape[0], t.shape[2]]
                raise ValueError(f"{name}: expected shape {want}, got {got}")
            states.append(t)
        return states[0], states[1]


# Opt-in: at hfai's size on the H200 it beats cuDNN's LSTM in bfloat16 and float32
# (data/results/h200/lstm.json), but the sequence kernels' grid barrier spins until every program has
# arrived, with no bound: one swap of every nn.LSTM should not risk a stall on a shared GPU.
register_swap(
    nn.LSTM,
    LSTM,
    opt_in=(
        "its one-launch recurrence waits at a grid barrier that needs every program resident at once; "
        "on a GPU whose SMs are shared (MPS limits, another persistent kernel) it could stall"
    ),
)
