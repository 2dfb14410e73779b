"""Outer product mean core benchmark (`outer_product_linear`, AF2 Algorithm 10 lines 2-4):
`linear(flatten(sum_s a_s ⊗ b_s))` at the Evoformer's and the extra-MSA stack's sizes.

a, b: [1, S, N, C] (C = 32, the model's c_hidden_opm), weight [c_z, C*C] and bias [c_z] (c_z = 128),
random. Providers:

- `hfkit`: `hfkit.ops.outer_product_linear`, which builds the outer product by stride-0 batched
  matmuls up to `STRIDE0_MAX_ROWS` MSA rows and by one matmul plus a swapping copy beyond;
- `hfkit_batched` / `hfkit_rows`: the same op held to one of those layouts at every S (the comparison
  that sets `STRIDE0_MAX_ROWS`);
- `eager`: `einsum` then `F.linear`, as OpenFold's module computes it (the outer product kept for the
  backward);
- `compile`: `torch.compile` of `eager`.

Every provider's forward is compared with the float32 eager result (max abs error relative to its
largest value, in `extra`). FLOPs: the outer product 2·S·N²·C² and the linear 2·N²·C²·c_z forward;
the backward recomputes the outer product (hfkit) and takes both operands' and the weight's gradients,
counted for every provider as 4 outer products and 3 linears in all.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hfkit.bench.runner import DTYPES, Option, Prepared, Steps, op_benchmark, pick_profile
from hfkit.bench.timing import rotating
from hfkit.ops import outer_product_linear, outer_product_linear_reference

__all__ = ["BENCHMARK", "CASES", "OpmCase", "opm_cases"]


@dataclass(frozen=True)
class OpmCase:
    """One call: `s` MSA rows, `n` residues, `c` channels of a and b, `c_z` outputs."""

    name: str
    s: int
    n: int
    c: int = 32
    c_z: int = 128

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.s, self.n, self.c, self.c_z)

    @property
    def label(self) -> str:
        return f"{self.name} S={self.s} N={self.n}"


CASES: tuple[OpmCase, ...] = (
    OpmCase("main_initial", 128, 256),
    OpmCase("main_crop384", 128, 384),
    OpmCase("main_finetune", 512, 384),
    OpmCase("extra_initial", 1024, 256),
    OpmCase("extra_finetune", 5120, 384),
)
SMOKE_CASES: tuple[OpmCase, ...] = (OpmCase("small", 6, 9, 4, 8), OpmCase("deep", 40, 7, 3, 5))


def opm_cases(profile: str = "full", cases: Sequence[str] | None = None) -> list[OpmCase]:
    """The `CASES` named in `cases` (default: all); profile "smoke": two small ones, any names."""
    if not pick_profile(profile, {"full": True, "smoke": False}):
        return list(SMOKE_CASES)
    by_name = {c.name: c for c in CASES}
    bad = [n for n in (cases or []) if n not in by_name]
    if bad:
        raise ValueError(f"cases: unknown {bad}; expected some of {list(by_name)}")
    return [by_name[n] for n in cases] if cases else list(CASES)


def _layout(by_rows: bool) -> Callable[..., torch.Tensor]:
    # The module, not the function of the same name that `hfkit.ops` exports.
    module = importlib.import_module("hfkit.ops.outer_product_linear")
    return lambda a, b, weight, bias: module._by_layout(a, b, weight, bias, by_rows)


def _provider(name: str, case: OpmCase, device: torch.device) -> Callable[..., torch.Tensor]:
    if name == "hfkit":
        return outer_product_linear
    if name in ("hfkit_batched", "hfkit_rows"):
        return _layout(name == "hfkit_rows")
    if name == "eager":
        return outer_product_linear_reference
    torch._dynamo.reset()  # a fresh cache per case: static shapes, as a model compiled at one size
    return torch.compile(outer_product_linear_reference, dynamic=False)


def _prepare(case: OpmCase, dtype_name: str, device: torch.device) -> Prepared:
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device=device).manual_seed(0)

    def make() -> tuple[torch.Tensor, ...]:
        rand = lambda *shape, scale=1.0: (torch.randn(shape, device=device, generator=gen) * scale).to(dtype)  # noqa: E731
        return (
            rand(1, case.s, case.n, case.c),
            rand(1, case.s, case.n, case.c),
            rand(case.c_z, case.c * case.c, scale=case.c**-1),
            rand(case.c_z),
            rand(1, case.n, case.n, case.c_z),
        )

    itemsize = dtype.itemsize
    set_bytes = (2 * case.s * case.n * case.c + case.n * case.n * case.c_z) * itemsize
    return Prepared(rotating(make, set_bytes, device=device), {"case": case.name})


def _build(
    case: OpmCase, f: Callable[..., torch.Tensor], prepared: Prepared, mode: str, dtype_name: str
) -> Steps:
    backward = mode == "fwd+bwd"
    sets = [
        (*(t.detach().requires_grad_(backward) for t in (a, b, w, bias)), dy)
        for a, b, w, bias, dy in prepared.inputs
    ]

    def run(k: int) -> Callable[[], Any]:
        def step() -> Any:
            for a, b, w, bias, dy in sets[:k]:
                y = f(a, b, w, bias)
                if backward:
                    torch.autograd.grad(y, (a, b, w, bias), dy)
            return y

        return step

    def check() -> dict[str, Any]:
        """Max abs error of the forward against float32 eager, relative to that result's largest value."""
        a, b, w, bias, _ = sets[0]
        with torch.no_grad():
            y = f(a, b, w, bias).float()
            expected = outer_product_linear_reference(*(t.float() for t in (a, b, w, bias)))
        return {"max_rel_err": float((y - expected).abs().max() / expected.abs().max().clamp_min(1e-30))}

    return Steps(run(len(sets)), run(1), len(sets), check)


def _cost(case: OpmCase, dtype_name: str, mode: str) -> tuple[int, int]:
    """Minimum traffic (a, b and the output; with the backward also dy and the gradients of a and b)
    and FLOPs (see the module docstring)."""
    s, n, c, c_z = case.shape
    outer, linear = 2 * s * n * n * c * c, 2 * n * n * c * c * c_z
    tensors = 2 * s * n * c + n * n * c_z
    if mode == "fwd":
        return tensors * DTYPES[dtype_name].itemsize, outer + linear
    return 2 * tensors * DTYPES[dtype_name].itemsize, 4 * outer + 3 * linear


BENCHMARK = op_benchmark(
    "outer_product_linear",
    "outer product mean core linear(flatten(sum_s a_s (x) b_s)): hfkit (both layouts) vs eager, compile",
    opm_cases,
    (_prepare, _provider, _build, _cost),
    providers=("hfkit", "hfkit_batched", "hfkit_rows", "eager", "compile"),
    default_dtypes=("bf16",),
    options=(Option("cases", "names", "which cases (default: all)", tuple(c.name for c in CASES)),),
)
