"""Small building blocks of the Evoformer: initialised `nn.Linear`s, shared dropout and chunking.

`linear` reproduces OpenFold's `primitives.Linear` initialisers (AF2 supplement section 1.11.4) on a
plain `torch.nn.Linear`, so that state_dict keys stay `weight` / `bias`. `DropoutRowwise` and
`DropoutColumnwise` (from `hfkit.nn.fused`) share one mask along a row or column of the representation
(supplement 1.11.6); the Evoformer adds their output to the residual with `residual_add`.
`chunk_apply` runs a function on slices along a batch-like axis (inference memory, supplement 1.11.8).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

# The shared-dropout modules live in hfkit.nn (with the fused versions `to_hfkit` swaps in).
from hfkit.nn.fused import DropoutColumnwise, DropoutRowwise, SharedDropout

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
