"""Small building blocks of the Evoformer: initialised `nn.Linear`s, shared dropout and chunking.

`linear` reproduces OpenFold's `primitives.Linear` initialisers (AF2 supplement section 1.11.4) on a
plain `torch.nn.Linear`, so that state_dict keys stay `weight` / `bias`. `DropoutRowwise` and
`DropoutColumnwise` share one mask along a row or column of the representation (supplement 1.11.6).
`chunk_apply` runs a function on slices along a batch-like axis (inference memory, supplement 1.11.8).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

__all__ = [
    "DropoutColumnwise",
    "DropoutRowwise",
    "SharedDropout",
    "attend_rows",
    "chunk_apply",
    "linear",
    "mask_bias",
]

_TRUNC_STD = 0.87962566103423978  # std of a unit normal truncated to [-2, 2]


def linear(c_in: int, c_out: int, bias: bool = True, init: str = "default") -> nn.Linear:
    """An `nn.Linear(c_in, c_out)` initialised as OpenFold's `Linear(..., init=init)`.

    init: "default" (LeCun truncated normal), "relu" (He truncated normal), "glorot", "normal"
    (fan-in normal, used for bias projections), "gating" (weight 0, bias 1), "final" (all zero).
    """
    layer = nn.Linear(c_in, c_out, bias=bias)
    with torch.no_grad():
        if bias:
            layer.bias.zero_()
        if init in ("default", "relu"):
            std = math.sqrt((2.0 if init == "relu" else 1.0) / c_in) / _TRUNC_STD
            nn.init.trunc_normal_(layer.weight, std=std, a=-2.0 * std, b=2.0 * std)
        elif init == "glorot":
            nn.init.xavier_uniform_(layer.weight)
        elif init == "normal":
            nn.init.normal_(layer.weight, std=math.sqrt(1.0 / c_in))
        elif init == "gating":
            layer.weight.zero_()
            if bias:
                layer.bias.fill_(1.0)
        elif init == "final":
            layer.weight.zero_()
        else:
            raise ValueError(
                f"init: expected one of default, relu, glorot, normal, gating, final; got {init!r}"
            )
    return layer


class SharedDropout(nn.Module):
    """Dropout whose mask is shared along `shared_dim` (the mask has size 1 there); off in eval."""

    def __init__(self, rate: float, shared_dim: int) -> None:
        super().__init__()
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"rate: expected a probability in [0, 1), got {rate}")
        self.rate = rate
        self.shared_dim = shared_dim

    def extra_repr(self) -> str:
        return f"rate={self.rate}, shared_dim={self.shared_dim}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.rate == 0.0:
            return x
        shape = list(x.shape)
        shape[self.shared_dim] = 1
        keep = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - self.rate)
        return x * keep / (1.0 - self.rate)


class DropoutRowwise(SharedDropout):
    """One dropout mask per row: shared along dim -3 of `[*, N_rows, N_cols, C]` (OpenFold's name)."""

    def __init__(self, rate: float) -> None:
        super().__init__(rate, shared_dim=-3)


class DropoutColumnwise(SharedDropout):
    """One dropout mask per column: shared along dim -2 of `[*, N_rows, N_cols, C]`."""

    def __init__(self, rate: float) -> None:
        super().__init__(rate, shared_dim=-2)


def chunk_apply(
    fn: Callable[..., torch.Tensor],
    args: Sequence[torch.Tensor],
    dims: Sequence[int],
    out_dim: int,
    chunk_size: int | None,
) -> torch.Tensor:
    """fn(*args) computed `chunk_size` entries at a time along a batch-like axis; equal to fn(*args).

    `dims[i]` (negative) is that axis in `args[i]`; an argument of size 1 there is broadcast, not
    sliced. The chunk outputs are concatenated along `out_dim`. `fn` must treat the axis as a batch.
    """
    if chunk_size is None:
        return fn(*args)
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected >= 1 or None, got {chunk_size}")
    sizes = {a.shape[d] for a, d in zip(args, dims, strict=True) if a.shape[d] != 1}
    if len(sizes) > 1:
        raise ValueError(f"args: the chunked axes disagree in size: {sorted(sizes)}")
    total = sizes.pop() if sizes else 1
    if total <= chunk_size:
        return fn(*args)
    outs = []
    for start in range(0, total, chunk_size):
        sliced = [
            a if a.shape[d] == 1 else a.narrow(d, start, min(chunk_size, total - start))
            for a, d in zip(args, dims, strict=True)
        ]
        outs.append(fn(*sliced))
    return torch.cat(outs, dim=out_dim)


def attend_rows(
    mha: nn.Module, x: torch.Tensor, biases: list[torch.Tensor], chunk_size: int | None
) -> torch.Tensor:
    """Self-attention within each row of x [*, R, N, C]; biases [*, R|1, H, N, N]; chunked over R."""
    return chunk_apply(
        lambda x_, *b: mha(x_, x_, list(b)),
        [x, *biases],
        dims=[-3] + [-4] * len(biases),
        out_dim=-3,
        chunk_size=chunk_size,
    )


def mask_bias(mask: torch.Tensor, inf: float) -> torch.Tensor:
    """Attention bias from a key mask [*, R, N]: 0 where kept, -inf where masked; [*, R, 1, 1, N]."""
    return (inf * (mask - 1.0))[..., :, None, None, :]
