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

import gc
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hfkit.bench.ceilings import Ceilings, bench_ceilings, resolve_device
from hfkit.bench.results import ResultRow, check_choice, row_environment
from hfkit.bench.timing import peak_memory, rotating, time_step
from hfkit.ops.elementwise import bias_dropout_add, sigmoid_gate

__all__ = [
    "CASES",
    "DTYPES",
    "MODES",
    "PROVIDERS",
    "TRAFFIC",
    "Case",
    "run_elementwise_benchmark",
    "run_from_cli",
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
) -> tuple[list[ResultRow], Ceilings]:
    """Time the fused elementwise ops over the (case, dtype, mode, provider) grid; return rows and ceilings.

    `cases=None` runs `CASES` on a GPU and tiny versions of them on a CPU. Rows have op
    "sigmoid_gate" or "bias_dropout_add", `extra["case"]` the case name, and `extra["max_abs_err"]`
    the difference to the eager provider (the gate; for dropout, of eval mode, where no mask is drawn).
    """
    from tqdm.auto import tqdm

    device = resolve_device(device)
    on_cuda = device.type == "cuda"
    check_choice("dtypes", dtypes, list(DTYPES))
    check_choice("modes", modes, MODES)
    check_choice("providers", providers, PROVIDERS)
    case_list = list(cases) if cases is not None else [c if on_cuda else _smoke(c) for c in CASES]
    warmup = warmup if warmup is not None else (10 if on_cuda else 1)
    reps = reps if reps is not None else (50 if on_cuda else 3)
    ceilings = ceilings or bench_ceilings(device)
    row_env = row_environment(device, command)
    rows: list[ResultRow] = []
    bar = tqdm(total=len(case_list) * len(dtypes) * len(modes) * len(providers), disable=not progress)
    for case in case_list:
        for dtype_name in dtypes:
            for mode in modes:
                for provider in providers:
                    bar.set_postfix_str(f"{case.name} {dtype_name} {mode} {provider}")
                    try:
                        rows.append(
                            _bench_one(
                                case, dtype_name, mode, provider, device, ceilings, row_env, warmup, reps
                            )
                        )
                    except Exception as err:  # noqa: BLE001 - one broken provider must not lose the rest
                        warnings.warn(
                            f"elementwise benchmark: {provider} failed on {case.name} {dtype_name} {mode}: "
                            f"{type(err).__name__}: {err}",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                    bar.update(1)
            gc.collect()
            if on_cuda:
                torch.cuda.empty_cache()
    bar.close()
    return rows, ceilings


def _bench_one(
    case: Case,
    dtype_name: str,
    mode: str,
    provider: str,
    device: torch.device,
    ceilings: Ceilings,
    row_env: dict[str, Any],
    warmup: int,
    reps: int,
) -> ResultRow:
    dtype = DTYPES[dtype_name]
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

    def step() -> None:
        for a, b, dy in sets:
            y = f(a, b, *args)
            if backward:
                torch.autograd.grad(y, (a, b), dy)

    timing, note = time_step(step, device, len(sets), warmup, reps)
    extra: dict[str, Any] = {"case": case.name, "rotating_sets": len(sets)}
    if case.op == "bias_dropout_add":
        extra.update(p=case.p, shared_dim=case.shared_dim)
    if note:
        extra["note"] = note
    extra.update(_peak_and_error(case, f, args, sets[0], backward))
    nbytes = TRAFFIC[(case.op, mode)] * tensor_bytes
    gbps = nbytes / (timing.p50 * 1e-3) / 1e9
    return ResultRow(
        **row_env,
        op=case.op,
        provider=provider,
        mode=mode,
        shape=list(case.shape),
        dtype=dtype_name,
        p20_ms=timing.p20,
        p50_ms=timing.p50,
        p80_ms=timing.p80,
        method=timing.method,
        n_reps=timing.n,
        bytes=nbytes,
        gbps=gbps,
        pct_copy=100.0 * gbps / ceilings.copy_gbps if ceilings.copy_gbps > 0 else None,
        peak_mem_bytes=extra.pop("peak_mem_bytes", None),
        extra=extra,
    )


def _peak_and_error(
    case: Case, f: Callable[..., torch.Tensor], args: tuple, inputs: tuple, backward: bool
) -> dict[str, Any]:
    """Peak memory of one call above what was allocated (CUDA), and the max abs difference to eager:
    the gate's output, or for dropout the eval-mode output and the kept fraction of the train mode."""
    a, b, dy = inputs

    def call() -> torch.Tensor:
        y = f(a, b, *args)
        if backward:
            torch.autograd.grad(y, (a, b), dy)
        return y

    peak, y = peak_memory(call, a.device)
    out: dict[str, Any] = {} if peak is None else {"peak_mem_bytes": peak}
    with torch.no_grad():
        if case.op == "sigmoid_gate":
            expected = _eager_gate(a.float(), b.float())
        else:  # the mask is random: check its kept fraction, and the fused add in eval mode
            out["kept_fraction"] = float(((y - b).abs() > 0).float().mean())
            y = bias_dropout_add(a, b, training=False)
            expected = b.float() + a.float()
        out["max_abs_err"] = float((y.float() - expected).abs().max())
    return out


def run_from_cli(args: Any) -> int:
    """`hfkit bench elementwise`: run, save to data/results/<gpu>/elementwise.json (or --out), print."""
    from pathlib import Path

    import pandas as pd

    from hfkit.bench.ceilings import device_name
    from hfkit.bench.results import gpu_slug, results_dir, rows_to_frame, save_results

    device = resolve_device(args.device)
    names = {c.name: c for c in CASES}
    bad = [n for n in (args.cases or []) if n not in names]
    if bad:
        raise ValueError(f"cases: unknown {bad}; expected some of {list(names)}")
    cases = [names[n] for n in args.cases] if args.cases else None
    if cases is not None and device.type != "cuda":
        cases = [_smoke(c) for c in cases]
    out = Path(args.out) if args.out else results_dir() / gpu_slug(device_name(device)) / "elementwise.json"
    rows, ceilings = run_elementwise_benchmark(
        device, cases, args.dtypes, args.modes, args.providers, not args.no_progress, command=args.command
    )
    if not rows:
        print("no rows measured (every provider failed; see the warnings above)", file=sys.stderr)
        return 1
    path = save_results(rows, out, ceilings=ceilings)
    frame = rows_to_frame(rows)
    frame["case"] = [r.extra["case"] for r in rows]
    table = frame.pivot_table(index=["case", "dtype", "mode"], columns="provider", values="p50_ms")
    pct = frame[frame.provider == "hfkit"].set_index(["case", "dtype", "mode"])["pct_copy"]
    table["hfkit_pct_copy"] = pct
    print(f"\n{ceilings.device_name}: copy {ceilings.copy_gbps:,.1f} GB/s; p50 ms per call")
    with pd.option_context("display.max_rows", None, "display.width", 200):
        print(table.round(4).to_string())
    print(f"\nwrote {len(rows)} rows to {path}")
    return 0


if (
    __name__ == "__main__"
):  # pragma: no cover - `python -m hfkit.bench.elementwise` = `hfkit bench elementwise`
    from hfkit.cli import main

    sys.exit(main(["bench", "elementwise", *sys.argv[1:]]))
