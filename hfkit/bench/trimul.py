"""Triangle multiplicative update benchmark (AF2 Algorithms 11 and 12): eager, hfkit, compile, cuEquivariance.

All providers run the weights of one `hfkit.model` `TriangleMultiplicationOutgoing` / `...Incoming`
module (OpenFold's parameter names), randomized so that every path matters (AlphaFold's gating and
final inits are zeros):

- `eager`: the module as it is (OpenFold-style plain PyTorch);
- `hfkit`: `hfkit.to_hfkit` of a copy (whatever hfkit swaps in for it; the report is in `extra`);
- `compile`: `torch.compile` of a copy;
- `cuequivariance`: `cuequivariance_torch.triangle_multiplicative_update` fed the module's own
  parameters: `p_in` = [linear_a_p; linear_b_p] and `g_in` = [linear_a_g; linear_b_g] stacked by rows
  (a first), `p_out` = linear_z, `g_out` = linear_g, `norm_in`/`norm_out` = layer_norm_in/out.

Two precisions: `amp-bf16` (float32 parameters and pair, run under `torch.autocast(bfloat16)`: how
AlphaFold trains; the headline) and `bf16` (parameters and pair in bfloat16). Every provider's forward is
compared with the float32 eager module (relative max error in `extra`), and cuEquivariance's parameter
mapping is checked separately in float32. FLOPs: the five projections and the N³ contraction, the
backward counted as twice the forward.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hfkit.bench.ceilings import Ceilings, resolve_device
from hfkit.bench.kernels import (
    KernelBench,
    KernelRun,
    Steps,
    free_memory,
    max_abs_err,
)
from hfkit.bench.peers import load_cuequivariance
from hfkit.bench.results import ResultRow, check_choice
from hfkit.bench.timing import rotating

__all__ = [
    "CHECK_REL_TOL",
    "DIRECTIONS",
    "MODES",
    "PRECISIONS",
    "PROVIDERS",
    "TRIMUL_SIZES",
    "TrimulCase",
    "cueq_trimul",
    "make_trimul_module",
    "run_trimul_benchmark",
    "trimul_cases",
]

PROVIDERS = ("hfkit", "eager", "compile", "cuequivariance")
MODES = ("fwd", "fwd+bwd")
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

    def label(self) -> str:
        return f"{self.direction} N={self.n}"


def trimul_cases(
    sizes: Sequence[int] | None = None,
    directions: Sequence[str] | None = None,
    device: torch.device | str | None = None,
    quick: bool = False,
) -> list[TrimulCase]:
    """Outgoing at every size and incoming at the largest (or every direction in `directions` at every
    size). GPU sizes: `TRIMUL_SIZES` (`quick`: 256 and 512), c_z = c_hidden = 128; on a CPU tiny odd
    sizes with c_z = c_hidden = 32."""
    on_cuda = resolve_device(device).type == "cuda"
    if directions is not None:
        directions = check_choice("directions", directions, DIRECTIONS)
    if on_cuda:
        sizes = list(sizes or ((256, 512) if quick else TRIMUL_SIZES))
        width = {}
    else:
        sizes = list(sizes or (7, 12))
        width = {"c_z": 32, "c_hidden": 32}
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
    module = cls(case.c_z, case.c_hidden).to(device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if p.dim() == 2:
                p.copy_(r * p.shape[1] ** -0.5)
            elif name.startswith("layer_norm") and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * r)
            else:
                p.copy_(0.1 * r)
    return module


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


class _Skip(Exception):
    """A provider that cannot run here; the message is the reason."""


def _provider(
    provider: str, module: nn.Module, device: torch.device
) -> tuple[Callable, list, dict[str, Any]]:
    """(forward(z, mask), the parameters it differentiates, notes for extra)."""
    if provider == "eager":
        return module, list(module.parameters()), {}
    if provider == "hfkit":
        import hfkit.nn  # noqa: F401 - registers every hfkit swap
        from hfkit.nn.convert import to_hfkit

        swapped, report = to_hfkit(module, inplace=False, report=True)
        return swapped, list(swapped.parameters()), {"swap": report.summary()}
    if provider == "compile":
        torch._dynamo.reset()
        inner = copy.deepcopy(module)
        return torch.compile(inner, dynamic=False), list(inner.parameters()), {}
    if provider == "cuequivariance":
        fns, reason = load_cuequivariance(device)
        if fns is None:
            raise _Skip(f"cuequivariance {reason}")
        fn = fns.triangle_multiplicative_update
        return (lambda z, mask: cueq_trimul(fn, module, z, mask)), list(module.parameters()), {}
    raise ValueError(f"providers: unknown provider {provider!r}; expected one of {PROVIDERS}")


def _autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "amp-bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _build(
    f: Callable,
    params: list[torch.Tensor],
    sets: list[tuple[torch.Tensor, torch.Tensor]],
    mask: torch.Tensor,
    ref: torch.Tensor,
    precision: str,
    backward: bool,
    device: torch.device,
    extra_check: Callable[[], dict[str, Any]] | None,
) -> Callable[[], Steps]:
    def build() -> Steps:
        zs = [z.detach().requires_grad_(backward) for z, _ in sets]
        with torch.no_grad(), _autocast(device, precision):
            y0 = f(zs[0], mask)
        dys = [dy.to(y0.dtype) for _, dy in sets]  # the upstream gradient in the output's dtype

        def run(k: int) -> Callable[[], None]:
            def step() -> None:
                for z, dy in zip(zs[:k], dys[:k], strict=True):
                    with torch.set_grad_enabled(backward), _autocast(device, precision):
                        y = f(z, mask)
                    if backward:
                        torch.autograd.grad(y, (z, *params), dy)

            return step

        def check() -> dict[str, Any]:
            scale = float(ref.abs().max())
            rel = max_abs_err(y0, ref) / max(scale, 1e-30)
            out = {"rel_err_vs_fp32_eager": rel, "check_ok": rel <= CHECK_REL_TOL, "fp32_out_absmax": scale}
            if extra_check is not None:
                out.update(extra_check())
                out["check_ok"] = out["check_ok"] and out.get("fp32_mapping_ok", True)
            return out

        return Steps(run(len(zs)), run(1), len(zs), check)

    return build


def run_trimul_benchmark(
    device: torch.device | str | None = None,
    cases: Sequence[TrimulCase] | None = None,
    precisions: Sequence[str] = PRECISIONS,
    modes: Sequence[str] = MODES,
    providers: Sequence[str] = PROVIDERS,
    progress: bool = True,
    *,
    quick: bool = False,
    ceilings: Ceilings | None = None,
    command: str | None = None,
    warmup: int | None = None,
    reps: int | None = None,
    on_row: Callable[[ResultRow], None] | None = None,
) -> KernelBench:
    """Time the triangle multiplicative update over (case, precision, provider, mode).

    `cases=None` picks `trimul_cases(device=device, quick=quick)`. Rows: op "triangle_multiplication",
    dtype the precision ("amp-bf16" or "bf16"), shape [1, N, N, c_z], `extra["direction"]`. The
    forward+backward step differentiates the pair and every parameter. Defaults: warm-up 5, 20 replays
    on a GPU (1 and 3 on a CPU).
    """

    device = resolve_device(device)
    on_cuda = device.type == "cuda"
    precisions = check_choice("precisions", precisions, PRECISIONS)
    modes = check_choice("modes", modes, MODES)
    providers = check_choice("providers", providers, PROVIDERS)
    cases = list(cases) if cases is not None else trimul_cases(device=device, quick=quick)
    run = KernelRun(
        device,
        total=len(cases) * len(precisions) * len(providers) * len(modes),
        desc="trimul",
        progress=progress,
        ceilings=ceilings,
        command=command,
        warmup=warmup,
        reps=reps,
        on_row=on_row,
    )
    for case in cases:
        module32 = make_trimul_module(case, device)
        for precision in precisions:
            dtype = torch.float32 if precision == "amp-bf16" else torch.bfloat16
            module = module32 if dtype == torch.float32 else copy.deepcopy(module32).to(dtype)
            itemsize = torch.empty((), dtype=dtype).element_size()
            gen = torch.Generator(device=device).manual_seed(0)
            n = case.n
            mask = torch.ones(1, n, n, device=device, dtype=dtype)
            pad = max(1, n // 64)
            mask[:, n - pad :, :] = 0
            mask[:, :, n - pad :] = 0

            def make(shape=case.shape, dtype=dtype, gen=gen) -> tuple[torch.Tensor, torch.Tensor]:
                z = torch.randn(shape, device=device, dtype=dtype, generator=gen)
                return z, torch.randn(shape, device=device, dtype=dtype, generator=gen)

            sets = rotating(make, 2 * case.bytes(False, itemsize), 256 << 20, 4) if on_cuda else [make()]
            with (
                torch.no_grad()
            ):  # the float32 eager module on the same pair: what every provider is checked against
                ref = module32(sets[0][0].float(), mask.float())
            for provider in providers:
                try:
                    f, params, note = _provider(provider, module, device)
                except _Skip as why:
                    run.skip(f"{case.label()} {precision}: {why}", len(modes))
                    continue
                extra_check = (
                    _cueq_mapping_check(module32, sets[0][0], mask, ref)
                    if provider == "cuequivariance"
                    else None
                )
                for mode in modes:
                    backward = mode == "fwd+bwd"
                    run.measure(
                        f"{case.label()} {precision} {mode} {provider}",
                        op="triangle_multiplication",
                        provider=provider,
                        mode=mode,
                        shape=case.shape,
                        dtype=precision,
                        nbytes=case.bytes(backward, itemsize),
                        flops=case.flops(backward),
                        build=_build(f, params, sets, mask, ref, precision, backward, device, extra_check),
                        extra={
                            "direction": case.direction,
                            "c_hidden": case.c_hidden,
                            "rotating_sets": len(sets),
                            **note,
                        },
                    )
                del f, params
            del sets, ref, module
            free_memory(device)
    return run.result()


def _cueq_mapping_check(
    module32: nn.Module, z: torch.Tensor, mask: torch.Tensor, ref: torch.Tensor
) -> Callable[[], dict[str, Any]]:
    """cuEquivariance in float32 (no autocast) on the float32 module's weights against the float32 eager
    module: isolates the weight mapping from bf16 rounding."""

    def check() -> dict[str, Any]:
        fns, _ = load_cuequivariance(z.device)
        with torch.no_grad():
            y = cueq_trimul(fns.triangle_multiplicative_update, module32, z.float(), mask.float())
        rel = max_abs_err(y, ref) / max(float(ref.abs().max()), 1e-30)
        return {"fp32_mapping_rel_err": rel, "fp32_mapping_ok": rel <= 1e-2}

    return check
