"""Fused elementwise ops benchmark: hfkit's sigmoid gate and bias + shared dropout + residual against the
Evoformer's eager code and `torch.compile` of it.

The cases are the Evoformer's own tensors at AF2's initial-training size (crop 256, 128 MSA rows):
the attention gate of MSA row attention ([1, 128, 256, 8, 32]) and of triangle attention ([1, 256,
256, 4, 32]), and the residual updates with row-wise dropout of the MSA ([1, 128, 256, 256]) and
row-/column-wise dropout of the pair representation ([1, 256, 256, 128]), in training mode (p = 0.15 /
0.25). All are memory-bound: each row reports GB/s of the minimum traffic (`TRAFFIC`) against the copy
ceiling measured in the same run, and peak memory above the inputs (eager dropout keeps a mask).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hfkit.bench.runner import DTYPES, Option, Prepared, Steps, op_benchmark, pick_profile
from hfkit.bench.timing import rotating
from hfkit.ops.elementwise import bias_dropout_add, sigmoid_gate

__all__ = ["BENCHMARK", "CASES", "TRAFFIC", "Case", "elementwise_cases"]


@dataclass(frozen=True)
class Case:
    """One benchmarked call: `op` ("sigmoid_gate" | "bias_dropout_add") on a tensor of `shape`."""

    name: str
    op: str
    shape: tuple[int, ...]
    p: float = 0.0
    shared_dim: int | None = None

    @property
    def label(self) -> str:
        return self.name


CASES: tuple[Case, ...] = (
    Case("gate_msa_row", "sigmoid_gate", (1, 128, 256, 8, 32)),
    Case("gate_tri_att", "sigmoid_gate", (1, 256, 256, 4, 32)),
    Case("dropout_msa_row", "bias_dropout_add", (1, 128, 256, 256), p=0.15, shared_dim=-3),
    Case("dropout_pair_row", "bias_dropout_add", (1, 256, 256, 128), p=0.25, shared_dim=-3),
    Case("dropout_pair_col", "bias_dropout_add", (1, 256, 256, 128), p=0.25, shared_dim=-2),
)
# Minimum traffic in units of the tensor's size. gate: fwd reads g, o, writes y; bwd reads g, o, dy,
# writes dg, do. dropout: fwd reads x, residual, writes y; bwd reads dy, writes dx (the residual's
# gradient is dy itself). The mask is not counted: the fused op keeps none.
TRAFFIC = {
    ("sigmoid_gate", "fwd"): 3,
    ("sigmoid_gate", "fwd+bwd"): 8,
    ("bias_dropout_add", "fwd"): 3,
    ("bias_dropout_add", "fwd+bwd"): 5,
}


def _eager_gate(g: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(g) * o  # Attention._wrap_up


def _eager_dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float, shared_dim: int) -> torch.Tensor:
    shape = list(x.shape)  # SharedDropout.forward, then the block's residual add
    shape[shared_dim] = 1
    keep = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - p)
    return residual + x * keep / (1.0 - p)


def _fused_dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float, shared_dim: int) -> torch.Tensor:
    return bias_dropout_add(x, residual, p=p, training=True, shared_dim=shared_dim)


def _provider(name: str, case: Case, device: torch.device) -> Callable[..., torch.Tensor]:
    eager = _eager_gate if case.op == "sigmoid_gate" else _eager_dropout_add
    if name == "hfkit":
        return sigmoid_gate if case.op == "sigmoid_gate" else _fused_dropout_add
    if name == "eager":
        return eager
    torch._dynamo.reset()  # a fresh cache per case: static shapes, as a model compiled at one size
    return torch.compile(eager, dynamic=False)


def _smoke(case: Case) -> Case:
    """The case scaled down: the leading dims cut to 4, every dim to 16."""
    shape = tuple(min(d, 4) for d in case.shape[:-2]) + tuple(min(d, 16) for d in case.shape[-2:])
    return Case(case.name, case.op, shape, case.p, case.shared_dim)


def elementwise_cases(profile: str = "full", cases: Sequence[str] | None = None) -> list[Case]:
    """The `CASES` named in `cases` (default: all), scaled down for profile "smoke"."""
    by_name = {c.name: c for c in CASES}
    bad = [n for n in (cases or []) if n not in by_name]
    if bad:
        raise ValueError(f"cases: unknown {bad}; expected some of {list(by_name)}")
    chosen = [by_name[n] for n in cases] if cases else list(CASES)
    return chosen if pick_profile(profile, {"full": True, "smoke": False}) else [_smoke(c) for c in chosen]


def _prepare(case: Case, dtype_name: str, device: torch.device) -> Prepared:
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device=device).manual_seed(0)
    make = lambda: tuple(torch.randn(case.shape, device=device, dtype=dtype, generator=gen) for _ in range(3))  # noqa: E731
    tensor_bytes = math.prod(case.shape) * dtype.itemsize
    sets = rotating(make, 3 * tensor_bytes, device=device)
    extra: dict[str, Any] = {"case": case.name}
    if case.op == "bias_dropout_add":
        extra.update(p=case.p, shared_dim=case.shared_dim)
    return Prepared(sets, extra)


def _build(
    case: Case, f: Callable[..., torch.Tensor], prepared: Prepared, mode: str, dtype_name: str
) -> Steps:
    backward = mode == "fwd+bwd"
    sets = [
        (a.detach().requires_grad_(backward), b.detach().requires_grad_(backward), dy)
        for a, b, dy in prepared.inputs
    ]
    args = () if case.op == "sigmoid_gate" else (case.p, case.shared_dim)

    def run(k: int):
        def step() -> torch.Tensor:
            for a, b, dy in sets[:k]:
                y = f(a, b, *args)
                if backward:
                    torch.autograd.grad(y, (a, b), dy)
            return y

        return step

    def check() -> dict[str, Any]:
        """The max abs difference to eager in float32: the gate's output, or for dropout the eval-mode
        output and the kept fraction of the train mode (the mask is random)."""
        a, b, _ = sets[0]
        out: dict[str, Any] = {}
        with torch.no_grad():
            y = f(a, b, *args)
            if case.op == "sigmoid_gate":
                expected = _eager_gate(a.float(), b.float())
            else:
                out["kept_fraction"] = float(((y - b).abs() > 0).float().mean())
                y = bias_dropout_add(a, b, training=False)
                expected = b.float() + a.float()
            out["max_abs_err"] = float((y.float() - expected).abs().max())
        return out

    return Steps(run(len(sets)), run(1), len(sets), check)


def _cost(case: Case, dtype_name: str, mode: str) -> tuple[int, None]:
    itemsize = DTYPES[dtype_name].itemsize
    return TRAFFIC[(case.op, mode)] * math.prod(case.shape) * itemsize, None


BENCHMARK = op_benchmark(
    "elementwise",
    "fused sigmoid gate and bias+dropout+residual: hfkit vs eager, compile",
    elementwise_cases,
    (_prepare, _provider, _build, _cost),
    default_dtypes=("fp32", "bf16"),
    options=(Option("cases", "names", "which cases (default: all)", tuple(c.name for c in CASES)),),
    gpu_reps=50,
)
