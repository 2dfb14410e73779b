"""Triangle multiplicative update benchmark (`triangle_multiplication`, AF2 Algorithms 11 and 12):
eager, hfkit, compile, cuEquivariance.

All providers run the weights of one `hfkit.model` `TriangleMultiplicationOutgoing` / `...Incoming`
module (OpenFold's parameter names), randomized so that every path matters (AlphaFold's gating and
final inits are zeros):

- `eager`: the module as it is (OpenFold-style plain PyTorch);
- `hfkit`: `hfkit.to_hfkit` of a copy (whatever hfkit swaps in for it; the report is in `extra`);
- `compile`: `torch.compile` of a copy;
- `cuequivariance`: `cuequivariance_torch.triangle_multiplicative_update` fed the module's own
  parameters: `p_in` = [linear_a_p; linear_b_p] and `g_in` = [linear_a_g; linear_b_g] stacked by rows
  (a first), `p_out` = linear_z, `g_out` = linear_g, `norm_in`/`norm_out` = layer_norm_in/out.

Two precisions (the rows' dtype): `amp-bf16` (float32 parameters and pair, run under
`torch.autocast(bfloat16)`: how AlphaFold trains; the headline) and `bf16` (parameters and pair in
bfloat16). Every provider's forward is compared with the float32 eager module (relative max error in
`extra`), and cuEquivariance's parameter mapping is checked separately in float32. FLOPs: the five
projections and the N³ contraction, the backward counted as twice the forward.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from hfkit.bench.peers import load_cuequivariance
from hfkit.bench.results import check_choice
from hfkit.bench.runner import (
    Option,
    Prepared,
    Skip,
    Steps,
    max_abs_err,
    op_benchmark,
    pick_profile,
    randomize_parameters,
)
from hfkit.bench.timing import rotating

__all__ = [
    "BENCHMARK",
    "CHECK_REL_TOL",
    "DIRECTIONS",
    "PRECISIONS",
    "TRIMUL_SIZES",
    "TrimulCase",
    "cueq_trimul",
    "make_trimul_module",
    "trimul_cases",
]

DIRECTIONS = ("outgoing", "incoming")
PRECISIONS = ("amp-bf16", "bf16")
TRIMUL_SIZES = (256, 384, 512, 1024)
C_Z = C_HIDDEN = 128
# Max error relative to the float32 output's largest magnitude above which a row is flagged: bf16
# matmuls with float32 accumulation stay near 1e-2; a wrong weight mapping gives errors of order 1.
CHECK_REL_TOL = 0.05


@dataclass(frozen=True)
class TrimulCase:
    """One triangle multiplication problem: pair z [1, n, n, c_z], hidden width c_hidden."""

    direction: str
    n: int
    c_z: int = C_Z
    c_hidden: int = C_HIDDEN

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (1, self.n, self.n, self.c_z)

    def flops(self, backward: bool) -> int:
        n2 = self.n * self.n
        proj = 2 * n2 * (4 * self.c_z * self.c_hidden + self.c_z * self.c_z + self.c_hidden * self.c_z)
        fwd = proj + 2 * self.n**3 * self.c_hidden
        return 3 * fwd if backward else fwd

    def bytes(self, backward: bool, itemsize: int) -> int:
        z = self.n * self.n * self.c_z * itemsize
        return 5 * z if backward else 2 * z  # fwd: read z, write y; bwd: read z and dy, write dz

    @property
    def label(self) -> str:
        return f"{self.direction} N={self.n}"


def trimul_cases(
    profile: str = "full", sizes: Sequence[int] | None = None, directions: Sequence[str] | None = None
) -> list[TrimulCase]:
    """Outgoing at every size and incoming at the largest (or every direction in `directions` at every
    size). Profile "full": `TRIMUL_SIZES`, c_z = c_hidden = 128; "smoke": tiny odd sizes with
    c_z = c_hidden = 32."""
    if directions is not None:
        directions = check_choice("directions", directions, DIRECTIONS)
    if pick_profile(profile, {"full": True, "smoke": False}):
        sizes, width = list(sizes or TRIMUL_SIZES), {}
    else:
        sizes, width = list(sizes or (7, 12)), {"c_z": 32, "c_hidden": 32}
    if directions is None:
        return [TrimulCase("outgoing", n, **width) for n in sizes] + [
            TrimulCase("incoming", max(sizes), **width)
        ]
    return [TrimulCase(d, n, **width) for d in directions for n in sizes]


def make_trimul_module(case: TrimulCase, device: torch.device | str, seed: int = 0) -> nn.Module:
    """The eager module for `case` in float32 on `device`, its parameters randomized (seeded): weights
    N(0, 1/fan_in), biases N(0, 0.1²), LayerNorm scales 1 + N(0, 0.1²)."""
    from hfkit.model.triangular_multiplicative_update import (
        TriangleMultiplicationIncoming,
        TriangleMultiplicationOutgoing,
    )

    cls = TriangleMultiplicationOutgoing if case.direction == "outgoing" else TriangleMultiplicationIncoming
    return randomize_parameters(cls(case.c_z, case.c_hidden), seed).to(device)


def cueq_trimul(
    fn: Callable[..., torch.Tensor], module: nn.Module, z: torch.Tensor, mask: torch.Tensor, **kw: Any
):
    """cuEquivariance's `triangle_multiplicative_update` (passed as `fn`) on `module`'s parameters."""
    m = module
    return fn(
        z,
        direction="outgoing" if m.outgoing else "incoming",
        mask=mask,
        norm_in_weight=m.layer_norm_in.weight,
        norm_in_bias=m.layer_norm_in.bias,
        p_in_weight=torch.cat([m.linear_a_p.weight, m.linear_b_p.weight]),
        p_in_bias=torch.cat([m.linear_a_p.bias, m.linear_b_p.bias]),
        g_in_weight=torch.cat([m.linear_a_g.weight, m.linear_b_g.weight]),
        g_in_bias=torch.cat([m.linear_a_g.bias, m.linear_b_g.bias]),
        norm_out_weight=m.layer_norm_out.weight,
        norm_out_bias=m.layer_norm_out.bias,
        p_out_weight=m.linear_z.weight,
        p_out_bias=m.linear_z.bias,
        g_out_weight=m.linear_g.weight,
        g_out_bias=m.linear_g.bias,
        eps=m.layer_norm_in.eps,
        **kw,
    )


class _Impl(NamedTuple):
    """A provider's forward(z, mask), the parameters it differentiates, and notes for the rows."""

    forward: Callable
    params: list
    note: dict[str, Any]
    cueq: Callable | None = None  # cuEquivariance's function, for the float32 weight-mapping check


def _provider(provider: str, case: TrimulCase, device: torch.device) -> Callable[[nn.Module], _Impl]:
    """A function of the case's module (made per precision) to the provider's `_Impl`."""
    if provider == "eager":
        return lambda module: _Impl(module, list(module.parameters()), {})
    if provider == "hfkit":
        import hfkit.nn  # noqa: F401 - registers every hfkit swap
        from hfkit.nn.convert import to_hfkit

        def swap(module: nn.Module) -> _Impl:
            swapped, report = to_hfkit(module, inplace=False, report=True)
            return _Impl(swapped, list(swapped.parameters()), {"swap": report.summary()})

        return swap
    if provider == "compile":

        def compiled(module: nn.Module) -> _Impl:
            torch._dynamo.reset()
            inner = copy.deepcopy(module)
            return _Impl(torch.compile(inner, dynamic=False), list(inner.parameters()), {})

        return compiled
    fns, reason = load_cuequivariance(device)
    if fns is None:
        raise Skip(f"cuequivariance {reason}")
    fn = fns.triangle_multiplicative_update
    return lambda module: _Impl(
        lambda z, mask: cueq_trimul(fn, module, z, mask), list(module.parameters()), {}, fn
    )


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "amp-bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _prepare(case: TrimulCase, precision: str, device: torch.device) -> Prepared:
    """The float32 module, the module at `precision`, the key mask, rotating (z, dy) sets, and the
    float32 module's output on the first z: what every provider is checked against."""
    dtype = torch.float32 if precision == "amp-bf16" else torch.bfloat16
    module32 = make_trimul_module(case, device)
    module = module32 if dtype == torch.float32 else copy.deepcopy(module32).to(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    n, pad = case.n, max(1, case.n // 64)
    mask = torch.ones(1, n, n, device=device, dtype=dtype)
    mask[:, n - pad :, :] = 0
    mask[:, :, n - pad :] = 0

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.randn(case.shape, device=device, dtype=dtype, generator=gen)
        return z, torch.randn(case.shape, device=device, dtype=dtype, generator=gen)

    per_set = 2 * case.bytes(False, dtype.itemsize)
    sets = rotating(make, per_set, 256 << 20, 4, device=device)
    with torch.no_grad():
        ref = module32(sets[0][0].float(), mask.float())
    extra = {"direction": case.direction, "c_hidden": case.c_hidden, "rotating_sets": len(sets)}
    return Prepared((module32, module, mask, sets, ref), extra)


def _build(case: TrimulCase, make_impl: Callable, prepared: Prepared, mode: str, precision: str) -> Steps:
    module32, module, mask, sets, ref = prepared.inputs
    impl = make_impl(module)
    backward = mode == "fwd+bwd"
    device = mask.device
    zs = [z.detach().requires_grad_(backward) for z, _ in sets]
    with torch.no_grad(), _autocast(device, precision):
        y0 = impl.forward(zs[0], mask)
    dys = [dy.to(y0.dtype) for _, dy in sets]  # the upstream gradient in the output's dtype

    def run(k: int):
        def step() -> None:
            for z, dy in zip(zs[:k], dys[:k], strict=True):
                with torch.set_grad_enabled(backward), _autocast(device, precision):
                    y = impl.forward(z, mask)
                if backward:
                    torch.autograd.grad(y, (z, *impl.params), dy)

        return step

    def check() -> dict[str, Any]:
        scale = float(ref.abs().max())
        rel = max_abs_err(y0, ref) / max(scale, 1e-30)
        out = {"rel_err_vs_fp32_eager": rel, "check_ok": rel <= CHECK_REL_TOL, "fp32_out_absmax": scale}
        if impl.cueq is not None:
            # cuEquivariance in float32 on the float32 module's weights: the weight mapping alone,
            # without bf16 rounding.
            with torch.no_grad():
                y32 = cueq_trimul(impl.cueq, module32, sets[0][0].float(), mask.float())
            rel32 = max_abs_err(y32, ref) / max(scale, 1e-30)
            out.update(fp32_mapping_rel_err=rel32, fp32_mapping_ok=rel32 <= 1e-2)
            out["check_ok"] = out["check_ok"] and rel32 <= 1e-2
        return {**out, **impl.note}

    return Steps(run(len(zs)), run(1), len(zs), check)


def _cost(case: TrimulCase, precision: str, mode: str) -> tuple[int, int]:
    itemsize = 4 if precision == "amp-bf16" else 2
    return case.bytes(mode == "fwd+bwd", itemsize), case.flops(mode == "fwd+bwd")


BENCHMARK = op_benchmark(
    "triangle_multiplication",
    "triangle multiplicative update: hfkit vs eager, compile, cuEquivariance",
    trimul_cases,
    (_prepare, _provider, _build, _cost),
    providers=("hfkit", "eager", "compile", "cuequivariance"),
    dtypes=PRECISIONS,
    default_dtypes=PRECISIONS,
    options=(
        Option("sizes", "ints", "N values (default 256,384,512,1024)"),
        Option(
            "directions",
            "names",
            "at every size (default: outgoing at all, incoming at the largest)",
            DIRECTIONS,
        ),
    ),
)
