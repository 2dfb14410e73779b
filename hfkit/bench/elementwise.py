"""Fused elementwise ops benchmark: hfkit's sigmoid gate and bias + shared dropout + residual against the
Evoformer's eager code and `torch.compile` of it.

The cases are the Evoformer's own tensors at AF2's initial-training size (crop 256, 128 MSA rows):
the attention gate of MSA row attention ([1, 128, 256, 8, 32]) and of triangle attention ([1, 256,
256, 4, 32]), and the residual updates with row-wise dropout of the MSA ([1, 128, 256, 256]) and
row-/column-wise dropout of the pair representation ([1, 256, 256, 128]), in training mode (p = 0.15 /
0.25). All are memory-bound: each row reports GB/s of the minimum traffic (`TRAFFIC`) against the copy
ceiling measured in the same run, and peak memory above the inputs (eager dropout keeps a mask).
Timing as `hfkit.bench.layernorm`: CUDA graphs over rotating input sets, CUDA events as the fallback.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hfkit.bench.ceilings import Ceilings, resolve_device
from hfkit.bench.kernels import KernelBench, KernelRun, Steps
from hfkit.bench.results import ResultRow, check_choice
from hfkit.bench.timing import rotating
from hfkit.ops.elementwise import bias_dropout_add, sigmoid_gate

__all__ = [
    "CASES",
    "DTYPES",
    "MODES",
    "PROVIDERS",
    "TRAFFIC",
    "Case",
    "elementwise_cases",
    "run_elementwise_benchmark",
]


@dataclass(frozen=True)
class Case:
    """One benchmarked call: `op` ("sigmoid_gate" | "bias_dropout_add") on a tensor of `shape`."""

    name: str
    op: str
    shape: tuple[int, ...]
    p: float = 0.0
    shared_dim: int | None = None


CASES: tuple[Case, ...] = (
    Case("gate_msa_row", "sigmoid_gate", (1, 128, 256, 8, 32)),
    Case("gate_tri_att", "sigmoid_gate", (1, 256, 256, 4, 32)),
    Case("dropout_msa_row", "bias_dropout_add", (1, 128, 256, 256), p=0.15, shared_dim=-3),
    Case("dropout_pair_row", "bias_dropout_add", (1, 256, 256, 128), p=0.25, shared_dim=-3),
    Case("dropout_pair_col", "bias_dropout_add", (1, 256, 256, 128), p=0.25, shared_dim=-2),
)
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES: tuple[str, ...] = ("fwd", "fwd+bwd")
PROVIDERS: tuple[str, ...] = ("hfkit", "torch", "compile")
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


def _provider_fn(op: str, provider: str) -> Callable[..., torch.Tensor]:
    eager = _eager_gate if op == "sigmoid_gate" else _eager_dropout_add
    if provider == "hfkit":
        return sigmoid_gate if op == "sigmoid_gate" else _fused_dropout_add
    if provider == "torch":
        return eager
    if provider == "compile":
        torch._dynamo.reset()  # a fresh cache per case: static shapes, as a model compiled at one size
        return torch.compile(eager, dynamic=False)
    raise ValueError(f"provider: expected one of {PROVIDERS}, got {provider!r}")


def _smoke(case: Case) -> Case:
    """The case scaled down for CPU runs: the last two dims kept, the leading ones cut to 4."""
    shape = tuple(min(d, 4) for d in case.shape[:-2]) + case.shape[-2:]
    shape = tuple(min(d, 16) for d in shape)
    return Case(case.name, case.op, shape, case.p, case.shared_dim)


def elementwise_cases(
    names: Sequence[str] | None = None, device: torch.device | str | None = None, quick: bool = False
) -> list[Case]:
    """The `CASES` named in `names` (default: all; the first two when `quick`), scaled down on a CPU."""
    by_name = {c.name: c for c in CASES}
    bad = [n for n in (names or []) if n not in by_name]
    if bad:
        raise ValueError(f"cases: unknown {bad}; expected some of {list(by_name)}")
    cases = [by_name[n] for n in names] if names else list(CASES[:2] if quick else CASES)
    return cases if resolve_device(device).type == "cuda" else [_smoke(c) for c in cases]


def run_elementwise_benchmark(
    device: torch.device | str | None = None,
    cases: Sequence[Case] | None = None,
    dtypes: Sequence[str] = ("fp32", "bf16"),
    modes: Sequence[str] = MODES,
    providers: Sequence[str] = PROVIDERS,
    progress: bool = True,
    *,
    ceilings: Ceilings | None = None,
    command: str | None = None,
    warmup: int | None = None,
    reps: int | None = None,
    on_row: Callable[[ResultRow], None] | None = None,
) -> KernelBench:
    """Time the fused elementwise ops over the (case, dtype, mode, provider) grid (`measure_case`: a
    provider that fails gives an error row).

    `cases=None` runs `elementwise_cases(device=device)`: `CASES`, tiny versions of them on a CPU.
    Rows have op "sigmoid_gate" or "bias_dropout_add", `extra["case"]` the case name, and
    `extra["max_abs_err"]` the difference to the eager code in float32 (the gate; for dropout, of eval
    mode, where no mask is drawn, plus the kept fraction of the training mode). Defaults: warm-up 5,
    50 replays on a GPU (1 and 3 on a CPU).
    """
    device = resolve_device(device)
    dtypes = check_choice("dtypes", dtypes, list(DTYPES))
    modes = check_choice("modes", modes, MODES)
    providers = check_choice("providers", providers, PROVIDERS)
    cases = list(cases) if cases is not None else elementwise_cases(device=device)
    run = KernelRun(
        device,
        total=len(cases) * len(dtypes) * len(modes) * len(providers),
        desc="elementwise",
        progress=progress,
        ceilings=ceilings,
        command=command,
        warmup=warmup,
        reps=reps,
        gpu_reps=50,
        on_row=on_row,
    )
    for case in cases:
        for dtype_name in dtypes:
            itemsize = torch.empty((), dtype=DTYPES[dtype_name]).element_size()
            for mode in modes:
                for provider in providers:
                    extra: dict[str, Any] = {"case": case.name}
                    if case.op == "bias_dropout_add":
                        extra.update(p=case.p, shared_dim=case.shared_dim)
                    run.measure(
                        f"{case.name} {dtype_name} {mode} {provider}",
                        op=case.op,
                        provider=provider,
                        mode=mode,
                        shape=case.shape,
                        dtype=dtype_name,
                        nbytes=TRAFFIC[(case.op, mode)] * math.prod(case.shape) * itemsize,
                        flops=None,
                        build=functools.partial(_build, case, DTYPES[dtype_name], mode, provider, device),
                        extra=extra,
                    )
    return run.result()


def _build(case: Case, dtype: torch.dtype, mode: str, provider: str, device: torch.device) -> Steps:
    backward = mode == "fwd+bwd"
    gen = torch.Generator(device=device).manual_seed(0)
    tensor_bytes = math.prod(case.shape) * torch.empty((), dtype=dtype).element_size()

    def make_set() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = torch.randn(case.shape, device=device, dtype=dtype, generator=gen).requires_grad_(backward)
        b = torch.randn(case.shape, device=device, dtype=dtype, generator=gen).requires_grad_(backward)
        return a, b, torch.randn(case.shape, device=device, dtype=dtype, generator=gen)

    sets = rotating(make_set, 3 * tensor_bytes) if device.type == "cuda" else [make_set()]
    f = _provider_fn(case.op, provider)
    args = () if case.op == "sigmoid_gate" else (case.p, case.shared_dim)

    def run(inputs: Sequence[tuple[torch.Tensor, ...]]) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            for a, b, dy in inputs:
                y = f(a, b, *args)
                if backward:
                    torch.autograd.grad(y, (a, b), dy)
            return y

        return step

    return Steps(run(sets), run(sets[:1]), len(sets), lambda: _check(case, f, args, sets[0]))


def _check(case: Case, f: Callable[..., torch.Tensor], args: tuple, inputs: tuple) -> dict[str, Any]:
    """The max abs difference to eager in float32: the gate's output, or for dropout the eval-mode
    output and the kept fraction of the train mode."""
    a, b, _ = inputs
    out: dict[str, Any] = {}
    with torch.no_grad():
        y = f(a, b, *args)
        if case.op == "sigmoid_gate":
            expected = _eager_gate(a.float(), b.float())
        else:  # the mask is random: check its kept fraction, and the fused add in eval mode
            out["kept_fraction"] = float(((y - b).abs() > 0).float().mean())
            y = bias_dropout_add(a, b, training=False)
            expected = b.float() + a.float()
        out["max_abs_err"] = float((y.float() - expected).abs().max())
    return out


if (
    __name__ == "__main__"
):  # pragma: no cover - `python -m hfkit.bench.elementwise` = `hfkit bench elementwise`
    from hfkit.cli import main

    sys.exit(main(["bench", "elementwise", *sys.argv[1:]]))
