"""LSTM benchmark: `hfkit.nn.LSTM` against `torch.nn.LSTM` (eager: cuDNN on a GPU), `torch.compile`
of it and FlashRNN (`flashrnn`, where installed: its alternating CUDA backend on the same weights,
`_FlashRNNLSTM`).

The cases are one layer, one direction, `batch_first=True`, shape [B, T, I, H]: hfai.nn's published
configuration (batch 4, sequence 1000, input and hidden 985), a sweep of the sequence length at that
size and a sweep of the hidden size at sequence 1000 ("full"), and tiny odd ones ("smoke"). Every
provider gets the same weights (torch's default uniform init, drawn from a fixed generator). An LSTM
step is a small matmul and a gate update repeated T times in sequence: the time is bound by per-step
latency, not by FLOPs; each row still reports TFLOP/s of the matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from hfkit.bench.cases._module import (
    CHECK_BATCHES,
    CHECK_TOL,
    Wrap,
    check_notes,
    module_provider,
    module_steps,
)
from hfkit.bench.peers import load_flashrnn
from hfkit.bench.runner import (
    DTYPES,
    Option,
    Prepared,
    ShapeCase,
    Skip,
    Steps,
    max_abs_err,
    op_benchmark,
    pick_profile,
)

__all__ = ["BENCHMARK", "CHECK_TOL", "FULL_SHAPES", "HFAI_SHAPE", "SMOKE_SHAPES", "lstm_cases", "lstm_flops"]

# (B, T, I, H): hfai.nn's LSTM configuration.
HFAI_SHAPE: tuple[int, int, int, int] = (4, 1000, 985, 985)
FULL_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    HFAI_SHAPE,
    (4, 250, 985, 985),
    (4, 4000, 985, 985),
    (4, 1000, 256, 256),
    (4, 1000, 512, 512),
    (4, 1000, 1024, 1024),
)
SMOKE_SHAPES: tuple[tuple[int, int, int, int], ...] = ((2, 5, 7, 33), (3, 1, 5, 17))
# Max abs error of the output (values in (-1, 1)) against the float32 reference on the same weights.


def lstm_cases(profile: str = "full", shapes: Sequence[Sequence[int]] | None = None) -> list[ShapeCase]:
    """Cases [B, T, I, H]: `shapes` when given, else `FULL_SHAPES` ("full") or tiny odd ones ("smoke")."""
    chosen = (
        shapes if shapes is not None else pick_profile(profile, {"full": FULL_SHAPES, "smoke": SMOKE_SHAPES})
    )
    cases = [ShapeCase(tuple(int(d) for d in s)) for s in chosen]
    if not cases or any(len(c.shape) != 4 or min(c.shape) <= 0 for c in cases):
        raise ValueError(
            f"shapes: expected 4-d shapes [B, T, I, H] of positive sizes, got {[c.shape for c in cases]}"
        )
    return cases


def lstm_flops(shape: Sequence[int], backward: bool) -> int:
    """Matmul flops of one single-layer LSTM call on [B, T, I] with hidden size H: the input projection
    (2·B·T·I·4H) and the recurrence (2·B·T·H·4H); the backward does twice the forward's (the input
    and state gradients, and the weight gradients)."""
    b, t, i, h = shape
    fwd = 2 * b * t * 4 * h * (i + h)
    return 3 * fwd if backward else fwd


_FLASHRNN_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class _FlashRNNLSTM(nn.Module):
    """A one-layer, batch_first `nn.LSTM`'s own parameters run by FlashRNN: the input projection as one
    matmul (as hfkit's), then `flashrnn`'s recurrence with the "cuda" backend (its alternating kernels:
    a matmul and a pointwise kernel a step; its fused backend did not build on the H200) in x's dtype.
    FlashRNN's gates i, f, z, o are torch's i, f, g, o, so w_hh [4H, H] is its R [4, 1 head, H, H]."""

    def __init__(self, lstm: nn.LSTM, flashrnn: Callable[..., Any]) -> None:
        super().__init__()
        self.lstm, self.flashrnn = lstm, flashrnn

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        lstm, (batch, steps, _) = self.lstm, x.shape
        hidden = lstm.hidden_size
        wx = F.linear(x, lstm.weight_ih_l0).view(batch, steps, 4, 1, hidden)
        r = lstm.weight_hh_l0.view(4, 1, hidden, hidden)
        bias = (lstm.bias_ih_l0 + lstm.bias_hh_l0).view(4, 1, hidden)
        dtype = _FLASHRNN_DTYPES[x.dtype]
        states, _ = self.flashrnn(wx, r, bias, function="lstm", backend="cuda", dtype=dtype)
        return (states[0].reshape(batch, steps, hidden),)


def _provider(name: str, case: ShapeCase, device: torch.device) -> Wrap:
    if name == "flashrnn":
        flashrnn, reason = load_flashrnn(device)
        if flashrnn is None:
            raise Skip(f"flashrnn {reason}")
        return lambda module: _FlashRNNLSTM(module, flashrnn)
    return module_provider(name, "LSTM")


def _prepare(case: ShapeCase, dtype_name: str, device: torch.device) -> Prepared:
    dtype, (b, t, i, h) = DTYPES[dtype_name], case.shape
    gen = torch.Generator(device=device).manual_seed(0)
    weights = nn.LSTM(i, h, batch_first=True, device=device, dtype=dtype)
    with torch.no_grad():  # torch's init, U(-1/sqrt(H), 1/sqrt(H)), drawn from `gen`
        for p in weights.parameters():
            p.uniform_(-(h**-0.5), h**-0.5, generator=gen)
    x, dy = (
        torch.randn(b, t, i if k == 0 else h, device=device, dtype=dtype, generator=gen) for k in range(2)
    )
    return Prepared({"state": weights.state_dict(), "x": x, "dy": dy}, {"layers": 1, "batch_first": True})


def _build(case: ShapeCase, wrap: Wrap, prepared: Prepared, mode: str, dtype_name: str) -> Steps:
    backward = mode == "fwd+bwd"
    dtype, (_, _, i, h) = DTYPES[dtype_name], case.shape
    x, dy, state = prepared.inputs["x"], prepared.inputs["dy"], prepared.inputs["state"]
    module = nn.LSTM(i, h, batch_first=True, device=x.device, dtype=dtype)
    module.load_state_dict(state)

    def check(f: Callable[..., Any]) -> dict[str, Any]:
        from hfkit.ops import lstm_reference

        r = min(CHECK_BATCHES, x.shape[0])
        with torch.no_grad():
            y = f(x[:r])[0]
            ref, _, _ = lstm_reference(
                x[:r].transpose(0, 1).float(), None, None,
                module.weight_ih_l0.float(), module.weight_hh_l0.float(),
                module.bias_ih_l0.float(), module.bias_hh_l0.float(),
            )  # fmt: skip
        err = max_abs_err(y, ref.transpose(0, 1))
        return check_notes(err, r, dtype_name)

    return module_steps(module, wrap, x, dy, backward, lambda f, t: f(t)[0], check)


def _cost(case: ShapeCase, dtype_name: str, mode: str) -> tuple[int, int]:
    b, t, i, h = case.shape
    itemsize = torch.empty((), dtype=DTYPES[dtype_name]).element_size()
    backward = mode == "fwd+bwd"
    # Read x and the weights, write y; the backward also reads dy and writes dx and the weight gradients.
    nbytes = (b * t * (i + h) + 4 * h * (i + h + 2)) * itemsize
    return (2 * nbytes if backward else nbytes), lstm_flops(case.shape, backward)


BENCHMARK = op_benchmark(
    "lstm",
    "LSTM, one layer, batch_first: hfkit vs eager (cuDNN), compile, FlashRNN",
    lstm_cases,
    (_prepare, _provider, _build, _cost),
    providers=("hfkit", "eager", "compile", "flashrnn"),
    default_dtypes=("bf16", "fp32"),
    options=(Option("shapes", "shapes", "shapes BxTxIxH, e.g. 4x1000x985x985"),),
    gpu_warmup=2,
    gpu_reps=10,
)
