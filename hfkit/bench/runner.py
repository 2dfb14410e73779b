"""The one benchmark runner: every op benchmark is a `Benchmark` (a case table in `hfkit.bench.cases`)
measured by `run_benchmark`, one row per (case, dtype, provider, mode).

Every row is measured by one protocol, `measure_case`: first a correctness check of the provider's
forward against a reference (a fast number from a wrong setup is flagged in the row), then one step with
the CUDA peak-memory counter reset (the bytes above what the inputs already hold), then the timing: a
CUDA graph of the step replayed and timed with CUDA events (eager CUDA events when capture fails, the
reason recorded), wall clock on a CPU. A provider that raises (out of memory, an unsupported shape) gives
a row with `method` "error", NaN times and the error in `extra["error"]`: one failure never loses the
other rows, and no row is silently missing. Each row is handed to `on_row` as it completes, so a caller
can save the rows so far (`ResultFile.save(partial=True)`).
"""

from __future__ import annotations

import functools
import gc
import itertools
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from hfkit.bench.ceilings import Ceilings, bench_ceilings, resolve_device
from hfkit.bench.results import ResultRow, check_choice, make_row, row_environment
from hfkit.bench.timing import Timing, peak_memory, time_step

__all__ = [
    "DTYPES",
    "MODES",
    "PROFILES",
    "BenchResult",
    "Benchmark",
    "Measurement",
    "Option",
    "Prepared",
    "ShapeCase",
    "Skip",
    "Steps",
    "TileSweep",
    "free_memory",
    "max_abs_err",
    "measure_case",
    "op_benchmark",
    "pick_profile",
    "randomize_parameters",
    "run_benchmark",
    "run_settings",
]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES: tuple[str, ...] = ("fwd", "fwd+bwd")
# How an op's calls are timed: replayed as a CUDA graph, or launched from Python one by one.
LAUNCHES: tuple[str, ...] = ("graph", "eager")
# smoke: tiny odd sizes (CPU, CI, the Triton interpreter); full: the AlphaFold sizes a GPU run measures.
PROFILES: tuple[str, ...] = ("smoke", "full")


class Skip(Exception):
    """A provider that cannot run a case at all (a peer not installed, a layout it does not take); the
    message is the reason, listed in `BenchResult.skipped`."""


class Steps(NamedTuple):
    """What `measure_case` runs for one case: `step` makes `calls` op calls (one per rotating input
    set), `single` one call on the first set (for peak memory), `check` returns error figures (or
    notes) before timing, `after` notes read after it (e.g. the last call's loss)."""

    step: Callable[[], Any]
    single: Callable[[], Any]
    calls: int
    check: Callable[[], dict[str, Any]] | None
    after: Callable[[], dict[str, Any]] | None = None


class Prepared(NamedTuple):
    """A case's inputs at one dtype, shared by every provider and mode, and notes for every row."""

    inputs: Any
    extra: dict[str, Any]


class Option(NamedTuple):
    """A case-selection option of a benchmark's command line (`hfkit bench <name> --<flag>`): `kind` is
    "ints" (a comma list of integers), "shapes" (AxBxC,...) or "names" (a comma list of `choices`)."""

    flag: str
    kind: str
    help: str
    choices: tuple[str, ...] = ()


class TileSweep(NamedTuple):
    """The kernel passes of one op and how to time each alone with given tiles.

    - `passes`: pass names in the order the op runs them;
    - `fields[pass_]`: names of the entries of that pass's tiles (the rows' `extra["tiles"]` keys);
    - `grid(case, pass_) -> [tiles]`: the configurations swept (tuples of launcher arguments);
    - `default(case, dtype, pass_, device) -> tiles`: what the op launches today;
    - `prepare(case, dtype, device) -> inputs`: buffers shared by every pass and configuration;
    - `launch(inputs, pass_, tiles) -> step`: one call of the pass with `tiles`, returning its output
      (the check compares it with the default tiles' output); `calls(inputs)` op calls a step makes;
    - `cost(case, dtype, pass_) -> (bytes, flops)` of one call (flops None for memory-bound passes).
    """

    passes: tuple[str, ...]
    fields: Mapping[str, tuple[str, ...]]
    grid: Callable[[Any, str], Sequence[tuple]]
    default: Callable[[Any, str, str, torch.device], tuple]
    prepare: Callable[[Any, str, torch.device], Any]
    launch: Callable[[Any, str, tuple], Callable[[], torch.Tensor]]
    calls: Callable[[Any], int]
    cost: Callable[[Any, str, str], tuple[int, int | None]]


@dataclass(frozen=True)
class ShapeCase:
    """A case that is just the input's shape (LayerNorm's x, softmax's logits)."""

    shape: tuple[int, ...]

    @property
    def label(self) -> str:
        return "x".join(map(str, self.shape))


@dataclass(frozen=True)
class Benchmark:
    """One op's benchmark as a table: its name (the op's name everywhere: `cases/<name>.py`,
    `data/results/<gpu>/<name>.json`, `hfkit bench <name>`), providers, dtypes (the first
    `default_dtypes` run unless asked), and how to build each piece.

    - `cases(profile, **options)`: the cases (objects with `shape`, `label` and, where the row's op is
      not `name`, `op`) for a profile, narrowed by the `options` of the command line;
    - `prepare(case, dtype, device) -> Prepared`: inputs shared by every provider and mode;
    - `provider(name, case, device)`: what `build` runs (raise `Skip` if it cannot run here);
    - `build(case, impl, prepared, mode, dtype) -> Steps`;
    - `cost(case, dtype, mode) -> (bytes, flops)`: minimum traffic and arithmetic of one call (flops
      None for memory-bound ops);
    - `gpu_warmup`/`gpu_reps`: timing defaults on a GPU (1 and 3 on a CPU);
    - `tiles`: the `TileSweep` of the op's kernel passes (`hfkit bench <name> --tiles`, `hfkit.bench.tune`).
    """

    name: str
    description: str
    providers: tuple[str, ...]
    dtypes: tuple[str, ...]
    default_dtypes: tuple[str, ...]
    cases: Callable[..., list[Any]]
    prepare: Callable[[Any, str, torch.device], Prepared]
    provider: Callable[[str, Any, torch.device], Any]
    build: Callable[[Any, Any, Prepared, str, str], Steps]
    cost: Callable[[Any, str, str], tuple[int, int | None]]
    options: tuple[Option, ...] = ()
    gpu_warmup: int = 5
    gpu_reps: int = 20
    tiles: TileSweep | None = None


def op_benchmark(
    name: str,
    description: str,
    cases: Callable[..., list[Any]],
    hooks: tuple[
        Callable[[Any, str, torch.device], Prepared],
        Callable[[str, Any, torch.device], Any],
        Callable[[Any, Any, Prepared, str, str], Steps],
        Callable[[Any, str, str], tuple[int, int | None]],
    ],
    *,
    providers: tuple[str, ...] = ("hfkit", "eager", "compile"),
    dtypes: tuple[str, ...] = tuple(DTYPES),
    **fields: Any,
) -> Benchmark:
    """An op's `Benchmark` table: `hooks` are its `(prepare, provider, build, cost)`, `providers`
    default to hfkit against eager and compile, `dtypes` to every one in `DTYPES`; `fields` are the
    other `Benchmark` fields (`default_dtypes`, `options`, `gpu_warmup`, `gpu_reps`, `tiles`)."""
    prepare, provider, build, cost = hooks
    return Benchmark(
        name=name,
        description=description,
        providers=providers,
        dtypes=dtypes,
        cases=cases,
        prepare=prepare,
        provider=provider,
        build=build,
        cost=cost,
        **fields,
    )


class BenchResult(NamedTuple):
    """What a benchmark run returns: its rows, the ceilings they are percentages of, and the cases
    or providers it skipped, each with its reason (e.g. a peer library that is not installed)."""

    rows: list[ResultRow]
    ceilings: Ceilings
    skipped: list[str]


def free_memory(device: torch.device) -> None:
    """Drop unreachable tensors and return cached CUDA blocks, so the next case starts clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def max_abs_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| in float32 (0.0 for empty tensors)."""
    if actual.numel() == 0:
        return 0.0
    return float((actual.detach().float() - expected.detach().float()).abs().max())


def randomize_parameters(module: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter of `module` random (seeded; drawn on the CPU, so the same on every device), in
    place; returns it. AlphaFold's zero "final" and gating inits would make most of a check trivially
    equal. Matrices N(0, 1/fan_in), LayerNorm scales 1 + N(0, 0.1²), everything else N(0, 0.1²)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if p.dim() == 2:
                p.copy_(r * p.shape[1] ** -0.5)
            elif "layer_norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * r)
            else:
                p.copy_(0.1 * r)
    return module


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}"


@dataclass
class Measurement:
    """One row measured by `measure_case`'s protocol in its three parts, for callers that time several
    rows together (`hfkit.bench.model`'s waterfall times its eager stages in interleaved rounds):
    `prepare` builds the `Steps`, checks them, makes the first call and the peak-memory call; the
    caller times `steps.step` (`time_step`, `time_interleaved`) and reports a failure with `fail`;
    `row` reads the after-notes, drops the steps and makes the row, an error row when any part
    failed.

    `key` holds `make_row`'s op, provider, mode, shape, dtype, nbytes and flops; `extra` the row's
    notes so far.
    """

    env: dict[str, Any]
    ceilings: Ceilings | None
    device: torch.device
    key: dict[str, Any]
    extra: dict[str, Any]
    steps: Steps | None = None
    peak: int | None = None
    error: str | None = None

    def prepare(self, build: Callable[[], Steps], first_call: bool = False) -> bool:
        """Build, check, first call (`first_call`: its wall time, compilation included, as
        `extra["first_call_s"]`), `extra["setup_s"]` and the peak memory of one call; return whether
        all went well (else the error is kept for `row` and the steps are dropped)."""
        key, steps = self.key, None
        start = time.perf_counter()
        try:
            self.steps = steps = build()
            if steps.check is not None:
                self.extra.update(steps.check())
                if self.extra.get("check_ok") is False:
                    errors = {k: v for k, v in self.extra.items() if "err" in k}
                    warnings.warn(
                        f"{key['op']} {key['provider']} {key['dtype']} {list(key['shape'])}: output "
                        f"disagrees with the reference ({errors}); row flagged check_ok=False",
                        RuntimeWarning,
                        stacklevel=3,
                    )
            if self.device.type == "cuda" or first_call:
                # One call first: compilation, autotuning (trifast benchmarks its configs on first use)
                # and lazy workspaces stay out of the peak. (On a CPU peak_memory's own call is the
                # warm-up.)
                called = time.perf_counter()
                steps.single()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                if first_call:
                    self.extra["first_call_s"] = time.perf_counter() - called
            # Seconds spent before timing: input layouts, the check, compilation and autotuning.
            self.extra["setup_s"] = round(time.perf_counter() - start, 2)
            # On a CPU the peak-memory call is the warm-up, unless the first call was.
            if self.device.type == "cuda" or not first_call:
                self.peak, _ = peak_memory(steps.single, self.device)
        except Exception as err:  # noqa: BLE001 - one failing provider (e.g. out of memory) must not end the run
            self.fail(err)
        if self.error is not None:
            # Outside the except block: the traceback (and the tensors its frames hold) is gone by now.
            steps = None
            self._discard()
        return self.error is None

    def fail(self, err: BaseException) -> None:
        """Record that a part of the measurement raised `err`: the row becomes an error row, and the
        steps (and what they hold: inputs, a model) are dropped."""
        self.error = _short(err)
        self.steps = None

    def row(self, timing: Timing | None, note: str | None = None) -> ResultRow:
        """The row: `timing` (None or any recorded failure: an error row, NaN times, the error in
        `extra["error"]` and a warning), the after-notes, `note` (e.g. why timing fell back to
        eager calls) as `extra["note"]`."""
        if self.error is None and self.steps is not None and self.steps.after is not None:
            try:
                self.extra.update(self.steps.after())
            except Exception as err:  # noqa: BLE001 - reading the notes failed: an error row, not a lost run
                self.fail(err)
        if self.extra.get("peak_unmeasured"):  # the after-notes say why this peak means nothing
            self.peak = None
        if self.error is None and timing is None:
            self.error = "not timed"
        if self.error is not None:
            timing = None
            self._discard()
            self.extra["error"] = self.error
            key = self.key
            warnings.warn(
                f"{key['op']} {key['provider']} {key['mode']} {key['dtype']} {list(key['shape'])} failed: "
                f"{self.error}",
                RuntimeWarning,
                stacklevel=3,
            )
        elif note:
            self.extra["note"] = note
        self.steps = None  # measured: its inputs (a model, its optimizer) can go
        return make_row(
            self.env, timing, ceilings=self.ceilings, peak_mem_bytes=self.peak, extra=self.extra, **self.key
        )

    def _discard(self) -> None:
        self.steps = self.peak = None
        free_memory(self.device)


def measure_case(
    *,
    env: dict[str, Any],
    ceilings: Ceilings | None,
    device: torch.device,
    op: str,
    provider: str,
    mode: str,
    shape: Sequence[int],
    dtype: str,
    nbytes: int,
    flops: int | None,
    build: Callable[[], Steps],
    warmup: int,
    reps: int,
    extra: dict[str, Any] | None = None,
    graph: bool = True,
    first_call: bool = False,
) -> ResultRow:
    """Check, measure peak memory and time one case; return its row (an error row if anything raised).

    `build()` prepares the provider's inputs and returns the `Steps`; it runs inside the same guard, so
    running out of memory while preparing also gives an error row. `check()` returns error figures
    for `extra`, with `check_ok` False when the provider disagrees with the reference beyond its
    dtype's rounding (the row is kept and a warning raised). `nbytes` is the minimum memory traffic of
    one call, `flops` its arithmetic (None for memory-bound ops): the row reports GB/s and TFLOP/s from
    the median time and percentages of `ceilings`. `graph` False times eager calls with CUDA events
    (what a loop launching from Python gets); `first_call` records the wall time of the first call,
    compilation included, as `first_call_s`. The parts are `Measurement`'s.
    """
    key = dict(op=op, provider=provider, mode=mode, shape=shape, dtype=dtype, nbytes=nbytes, flops=flops)
    case = Measurement(env, ceilings, device, key, dict(extra or {}))
    timing = note = None
    if case.prepare(build, first_call):
        try:
            timing, note = time_step(case.steps.step, device, case.steps.calls, warmup, reps, graph)
        except Exception as err:  # noqa: BLE001 - one failing provider (e.g. out of memory) must not end the run
            case.fail(err)
    return case.row(timing, note)


def _build(
    bench: Benchmark,
    case: Any,
    impl: Any,
    prepared: Prepared,
    mode: str,
    dtype: str,
    failed: Exception | None,
) -> Steps:
    if failed is not None:  # preparing the inputs failed: every provider and mode gets the error row
        raise failed
    return bench.build(case, impl, prepared, mode, dtype)


class RunSettings(NamedTuple):
    """What every run of a `Benchmark` (`run_benchmark`, `hfkit.bench.tune.run_tile_sweep`) settles
    before its first case: the device, the checked dtypes, warm-up and repetitions, the ceilings and
    the rows' environment."""

    device: torch.device
    dtypes: list[str]
    warmup: int
    reps: int
    ceilings: Ceilings
    env: dict[str, Any]


def run_settings(
    bench: Benchmark,
    device: torch.device | str | None,
    dtypes: Sequence[str] | None,
    warmup: int | None,
    reps: int | None,
    ceilings: Ceilings | None,
    command: str | None,
) -> RunSettings:
    """`dtypes` default to `bench.default_dtypes`; `warmup`/`reps` to `bench.gpu_warmup`/`bench.gpu_reps`
    on a GPU and 1/3 on a CPU; ceilings are measured unless given."""
    device = resolve_device(device)
    on_cuda = device.type == "cuda"
    return RunSettings(
        device=device,
        dtypes=check_choice("dtypes", dtypes or bench.default_dtypes, bench.dtypes),
        warmup=warmup if warmup is not None else (bench.gpu_warmup if on_cuda else 1),
        reps=reps if reps is not None else (bench.gpu_reps if on_cuda else 3),
        ceilings=ceilings or bench_ceilings(device),
        env=row_environment(device, command),
    )


def run_benchmark(
    bench: Benchmark,
    cases: Sequence[Any],
    device: torch.device | str | None = None,
    *,
    dtypes: Sequence[str] | None = None,
    modes: Sequence[str] = MODES,
    providers: Sequence[str] | None = None,
    progress: bool = True,
    ceilings: Ceilings | None = None,
    command: str | None = None,
    warmup: int | None = None,
    reps: int | None = None,
    on_row: Callable[[ResultRow], None] | None = None,
    launches: Sequence[str] = ("graph",),
) -> BenchResult:
    """Measure every (case, dtype, provider, mode, launch) of `bench` on `device` with `measure_case`.

    `dtypes` default to `bench.default_dtypes`, `providers` to all of `bench.providers`; `warmup`/`reps`
    to `bench.gpu_warmup`/`bench.gpu_reps` on a GPU and 1/3 on a CPU. Ceilings are measured first
    unless given; `command` is stored in every row (default: this process's command line). A provider
    that raises `Skip` is listed with its reason and its rows are left out; any other failure, in
    preparing inputs too, gives error rows. Each row goes to `on_row` as soon as it is measured.
    `launches`: "graph" times a CUDA graph of the calls (the kernels' own time), "eager" the calls
    launched from Python with CUDA events (what a training loop gets, launch cost included); eager
    rows carry `extra["launch"] = "eager"`.
    """
    modes = check_choice("modes", modes, MODES)
    launches = check_choice("launches", launches, LAUNCHES)
    providers = check_choice("providers", providers or bench.providers, bench.providers)
    device, dtypes, warmup, reps, ceilings, env = run_settings(
        bench, device, dtypes, warmup, reps, ceilings, command
    )
    rows: list[ResultRow] = []
    skipped: list[str] = []
    from tqdm.auto import tqdm

    per_provider = len(modes) * len(launches)
    bar = tqdm(total=len(cases) * len(dtypes) * len(providers) * per_provider, disable=not progress)
    bar.set_description(bench.name)
    for case in cases:
        for dtype in dtypes:
            try:
                prepared, failed = bench.prepare(case, dtype, device), None
            except Exception as err:  # noqa: BLE001 - becomes an error row per provider and mode
                prepared, failed = Prepared(None, {}), err
            for provider in providers:
                try:
                    impl = bench.provider(provider, case, device)
                except Skip as why:
                    skipped.append(f"{case.label} {dtype}: {why}")
                    bar.update(per_provider)
                    continue
                for mode, launch in itertools.product(modes, launches):
                    bar.set_postfix_str(f"{case.label} {dtype} {mode} {provider} {launch}")
                    nbytes, flops = bench.cost(case, dtype, mode)
                    extra = {**prepared.extra, **getattr(impl, "note", {})}
                    if launch == "eager":
                        extra["launch"] = "eager"
                    build = functools.partial(_build, bench, case, impl, prepared, mode, dtype, failed)
                    row = measure_case(
                        env=env, ceilings=ceilings, device=device, op=getattr(case, "op", bench.name),
                        provider=provider, mode=mode, shape=case.shape, dtype=dtype, nbytes=nbytes,
                        flops=flops, build=build, warmup=warmup, reps=reps, extra=extra,
                        graph=launch == "graph",
                    )  # fmt: skip
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
                    free_memory(device)
                    bar.update(1)
            prepared = impl = None
            free_memory(device)
    bar.close()
    return BenchResult(rows, ceilings, skipped)


def pick_profile(profile: str, tables: Mapping[str, Any]) -> Any:
    """`tables[profile]`, or ValueError naming the profiles there are."""
    if profile not in tables:
        raise ValueError(f"profile: expected one of {list(tables)}, got {profile!r}")
    return tables[profile]
