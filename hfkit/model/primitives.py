"""Small building blocks of the Evoformer: initialised `nn.Linear`s, gated attention and chunking.

`linear` reproduces OpenFold's `primitives.Linear` initialisers (AF2 supplement section 1.11.4) on a
plain `torch.nn.Linear`, so that state_dict keys stay `weight` / `bias`. `Attention` is OpenFold's
`primitives.Attention` (Algorithms 7, 8, 13-15 use it): queries scaled by 1/sqrt(c_hidden), additive
biases, softmax over keys, a sigmoid gate computed from the query input, and an output projection.
`chunk_apply` runs a function on slices along a batch-like axis (inference memory, supplement 1.11.8);
`attend_rows` and `mask_bias` are the row-attention call and key-mask bias the attention modules share.
`residual_taps` marks the input of a residual block for a fused LayerNorm (see `ResidualTaps`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

__all__ = [
    "Attention",
    "ResidualTaps",
    "active_residual_taps",
    "attend_rows",
    "chunk_apply",
    "linear",
    "mask_bias",
    "residual_taps",
    "run_tapped",
]

_TRUNC_STD = 0.87962566103423978  # std of a unit normal truncated to [-2, 2]


class ResidualTaps:
    """The inputs x of residual connections `x + block(x)` being computed, each of which the block's
    first LayerNorm may pass through (`record`): with autograd, x is then read by that LayerNorm only,
    whose backward adds the residual's gradient as it writes x's, instead of autograd adding the two.

    The model's plain `nn.LayerNorm` never records, so `tap(x)` is x itself and nothing changes; a fused
    LayerNorm (`hfkit.nn.LayerNorm`) that normalizes exactly one of the tapped tensors, while a
    gradient is recorded, hands back its pass-through. Use through `residual_taps`.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._slots = [[t, None] for t in tensors]  # [tapped tensor, its pass-through or None]

    def wants(self, x: torch.Tensor) -> bool:
        """Whether x is one of the tapped tensors (the object itself) with no pass-through yet."""
        return any(t is x and p is None for t, p in self._slots)

    def record(self, x: torch.Tensor, passthrough: torch.Tensor) -> None:
        """Take `passthrough` (equal to x) as what the residual connection of x adds to."""
        for slot in self._slots:
            if slot[0] is x and slot[1] is None:
                slot[1] = passthrough
                return
        raise ValueError("x: not a tapped tensor waiting for its pass-through")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x's pass-through where a LayerNorm recorded one, else x."""
        for t, p in self._slots:
            if t is x and p is not None:
                return p
        return x


_ACTIVE_TAPS: contextvars.ContextVar[ResidualTaps | None] = contextvars.ContextVar(
    "hfkit_residual_taps", default=None
)


@contextlib.contextmanager
def residual_taps(*tensors: torch.Tensor) -> Iterator[ResidualTaps]:
    """`with residual_taps(x) as tap: u = block(x)` then `x = tap(x) + u`: the residual add reads what
    the block's fused LayerNorm passed through, if any (see `ResidualTaps`). Calls inside the block see
    these taps only (an outer context's come back on exit)."""
    taps = ResidualTaps(tensors)
    token = _ACTIVE_TAPS.set(taps)
    try:
        yield taps
    finally:
        _ACTIVE_TAPS.reset(token)


def active_residual_taps() -> ResidualTaps | None:
    """The taps of the innermost `residual_taps` context, or None outside one and while
    `torch.compile` traces (Dynamo cannot read a context variable)."""
    if torch.compiler.is_compiling():
        return None
    return _ACTIVE_TAPS.get()


def run_tapped(update: Callable[[], torch.Tensor], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(update(), *taps) for the residual inputs `tensors` of the update: `update()` runs inside
    `residual_taps(*tensors)` and each tap is what the residual add should read (see `ResidualTaps`).
    While `torch.compile` traces, the taps are the tensors themselves (no context variable in the
    graph; Inductor fuses the adds anyway)."""
    if torch.compiler.is_compiling():
        return (update(), *tensors)
    with residual_taps(*tensors) as tap:
        out = update()
    return (out, *(tap(t) for t in tensors))


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

    def holds_logits(self, x: torch.Tensor) -> bool:
        """Whether a call on inputs like x (its device and dtype) holds the [*, H, Q, K] logits in
        memory: always here (plain torch); a fused subclass may not."""
        return True

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


def _shape_of(x: object) -> str:
    return f"shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
