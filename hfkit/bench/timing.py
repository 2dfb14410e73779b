"""Timers: CUDA graphs or CUDA events on GPUs, wall clock on CPU, and rotating input sets.

Every timer returns a `Timing` (20th/50th/80th percentile in milliseconds over many runs). On a GPU the
preferred method replays a CUDA graph of `fn` and times each replay with CUDA events: the small
AlphaFold shapes are launch-bound in eager PyTorch, and a graph removes the host-side launch cost so
what is left is the kernels' own time. `fn` should loop over several input sets (`rotating`) so that
repeated runs read from HBM and not from the 50-60 MB L2 cache. `time_interleaved` times several
slow callables (whole training steps launched from Python) in rounds, so that host noise and drift
fall on all of them alike.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeVar

import numpy as np
import torch

__all__ = [
    "Timing",
    "capture_graph",
    "peak_memory",
    "rotating",
    "time_cpu",
    "time_cuda",
    "time_fn",
    "time_interleaved",
    "time_step",
]

TimingMethod = Literal["cuda_graph", "cuda_events", "wall"]
T = TypeVar("T")


@dataclass(frozen=True)
class Timing:
    """Percentiles of per-call time in milliseconds over `n` timed runs, and how they were taken."""

    p20: float
    p50: float
    p80: float
    n: int
    method: TimingMethod

    @classmethod
    def from_samples(cls, samples_ms: Sequence[float], method: TimingMethod) -> Timing:
        """Summarise per-call times (ms) by their 20th, 50th and 80th percentiles."""
        if len(samples_ms) == 0:
            raise ValueError("samples_ms: expected at least one sample, got none")
        p20, p50, p80 = np.quantile(np.asarray(samples_ms, dtype=np.float64), [0.2, 0.5, 0.8])
        return cls(float(p20), float(p50), float(p80), len(samples_ms), method)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def rotating(
    make_inputs: Callable[[], T],
    bytes_per_set: int,
    min_total_bytes: int = 512 << 20,
    max_sets: int = 64,
    *,
    device: torch.device | None = None,
) -> list[T]:
    """Build enough independent input sets that cycling through them defeats the L2 cache.

    Calls `make_inputs()` k times, with k the smallest count whose total (k * bytes_per_set) exceeds
    `min_total_bytes`, capped at `max_sets` (so very small inputs still fit the cache; callers can see
    that from `len(result) * bytes_per_set`). Always returns at least one set; exactly one when
    `device` is given and is not a GPU (no L2 to defeat, and the Triton interpreter is slow).
    """
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set: expected a positive byte count, got {bytes_per_set}")
    if max_sets < 1:
        raise ValueError(f"max_sets: expected at least 1, got {max_sets}")
    k = min(max_sets, max(1, math.floor(min_total_bytes / bytes_per_set) + 1))
    if device is not None and torch.device(device).type != "cuda":
        k = 1
    return [make_inputs() for _ in range(k)]


def _warm_up(fn: Callable[[], Any], warmup: int) -> None:
    # Warm-up on a side stream, as PyTorch's CUDA-graph docs do before capture: lazy initialisation
    # (cuBLAS handles, Triton compilation, autograd's stream bookkeeping) then happens off the
    # capture stream and stays out of the timed runs.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def capture_graph(fn: Callable[[], Any], warmup: int = 3) -> torch.cuda.CUDAGraph:
    """One call of `fn` captured as a CUDA graph on the current device, after `warmup` calls (at least
    one) on a side stream; replay it with `.replay()`. Capture errors propagate."""
    _warm_up(fn, max(1, warmup))
    # The capture allocates in a private pool: hand the warm-up's cached blocks back first, or a step
    # that uses most of the card (a 48-block stack) cannot be captured at all.
    torch.cuda.empty_cache()
    g = torch.cuda.CUDAGraph()
    # torch.cuda.graph captures on its own side stream and gives the graph a private memory pool, so
    # the tensors `fn` allocates inside the capture are reused by every replay.
    with torch.cuda.graph(g):
        fn()
    return g


def _time_with_events(run: Callable[[], Any], reps: int) -> list[float]:
    # All events are recorded first and read after one synchronize, so the host never waits on the
    # device between runs and the queue stays full.
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]


def time_cuda(
    fn: Callable[[], Any],
    *,
    warmup: int = 25,
    reps: int = 100,
    graph: bool = True,
    calls_per_graph: int = 1,
) -> Timing:
    """Time `fn` on the current CUDA device: p20/p50/p80 of per-call milliseconds.

    Runs `fn` `warmup` times on a side stream, then, with `graph=True`, captures one call of `fn` into a
    `torch.cuda.CUDAGraph` and times `reps` replays with CUDA events; with `graph=False` it times `reps`
    eager calls with events. `calls_per_graph` is how many op calls one call of `fn` makes (e.g. the
    number of rotating input sets it loops over); each measured time is divided by it, in both modes.
    Capture errors propagate (callers decide whether to fall back to `graph=False`).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("time_cuda: no CUDA device is available; use time_cpu or time_fn")
    if reps < 1 or warmup < 0 or calls_per_graph < 1:
        raise ValueError(
            f"time_cuda: expected reps >= 1, warmup >= 0, calls_per_graph >= 1, "
            f"got reps={reps}, warmup={warmup}, calls_per_graph={calls_per_graph}"
        )
    if graph:
        g = capture_graph(fn, warmup)
        for _ in range(3):  # first replays upload the graph; keep them out of the samples
            g.replay()
        torch.cuda.synchronize()
        samples = _time_with_events(g.replay, reps)
        del g
        method: TimingMethod = "cuda_graph"
    else:
        _warm_up(fn, max(1, warmup))
        samples = _time_with_events(fn, reps)
        method = "cuda_events"
    return Timing.from_samples([s / calls_per_graph for s in samples], method)


def time_cpu(fn: Callable[[], Any], *, warmup: int = 3, reps: int = 20, calls: int = 1) -> Timing:
    """Time `fn` with the wall clock (`time.perf_counter`): p20/p50/p80 of per-call milliseconds.

    For CPU tensors (or anything synchronous). `calls` is how many op calls one call of `fn` makes;
    each measured time is divided by it.
    """
    if reps < 1 or warmup < 0 or calls < 1:
        raise ValueError(
            f"time_cpu: expected reps >= 1, warmup >= 0, calls >= 1, got reps={reps}, "
            f"warmup={warmup}, calls={calls}"
        )
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3 / calls)
    return Timing.from_samples(samples, "wall")


def time_fn(
    fn: Callable[[], Any],
    device: torch.device | str,
    *,
    calls: int = 1,
    graph: bool = True,
    warmup: int | None = None,
    reps: int | None = None,
) -> Timing:
    """Time `fn` with the right timer for `device`: `time_cuda` on CUDA, `time_cpu` elsewhere.

    `calls` is the number of op calls per call of `fn`; `warmup`/`reps` default to each timer's own
    defaults; `graph` applies to CUDA only.
    """
    device = torch.device(device)
    kwargs: dict[str, int] = {}
    if warmup is not None:
        kwargs["warmup"] = warmup
    if reps is not None:
        kwargs["reps"] = reps
    if device.type == "cuda":
        with torch.cuda.device(device):
            return time_cuda(fn, graph=graph, calls_per_graph=calls, **kwargs)
    return time_cpu(fn, calls=calls, **kwargs)


def time_step(
    step: Callable[[], Any], device: torch.device, calls: int, warmup: int, reps: int, graph: bool = True
) -> tuple[Timing, str | None]:
    """`time_fn` of a benchmark step: CUDA-graph timed on a GPU and, if the capture fails, timed with
    CUDA events on eager calls, with the reason returned as a note (None when nothing fell back).
    `graph` False: eager calls timed with CUDA events from the start."""
    if device.type != "cuda" or not graph:
        return time_fn(step, device, calls=calls, warmup=warmup, reps=reps, graph=False), None
    try:
        return time_fn(step, device, calls=calls, warmup=warmup, reps=reps, graph=True), None
    except Exception as err:  # noqa: BLE001 - any capture failure means: time it eagerly instead
        torch.cuda.synchronize(device)
        note = f"CUDA graph capture failed ({type(err).__name__}: {str(err)[:200]}); timed eagerly"
        return time_fn(step, device, calls=calls, warmup=warmup, reps=reps, graph=False), note


def _attempt(fn: Callable[[], Any]) -> Exception | None:
    """Call `fn`; return what it raised, without its traceback (so its frames' tensors are freed)."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - handed to the caller's on_error
        return err.with_traceback(None)
    return None


def time_interleaved(
    fns: Sequence[Callable[[], Any]],
    device: torch.device | str,
    *,
    warmup: int = 1,
    rounds: int = 5,
    on_error: Callable[[int, Exception], None] | None = None,
) -> list[Timing | None]:
    """Time several callables in interleaved rounds: every round calls each of `fns` once, in order,
    so slow drift and bursts of host noise fall on all of them alike rather than on whichever ran
    alone while they lasted. `warmup` untimed rounds, then `rounds` timed ones. Before each call:
    `gc.collect()` and, on CUDA, a synchronize, so no call pays for another's garbage or waits for its
    kernels. A call is timed with CUDA events on CUDA (its host launches and its kernels), with
    `time.perf_counter` elsewhere.

    Returns each callable's `Timing` over its `rounds` samples (method "cuda_events" or "wall"), in
    the order of `fns`. A callable that raises is left out of later rounds and gets None; the error,
    its traceback dropped (and with it the frames' tensors), goes to `on_error(index, error)`, called
    outside the except block. Without `on_error` the error propagates.
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(
            f"time_interleaved: expected rounds >= 1, warmup >= 0, got rounds={rounds}, warmup={warmup}"
        )
    device = torch.device(device)
    cuda = device.type == "cuda"
    live: list[Callable[[], Any] | None] = list(fns)
    # Per callable, per timed round: (start, end) CUDA events, or milliseconds on the wall clock.
    marks: list[list[Any]] = [[] for _ in live]
    with torch.cuda.device(device) if cuda else contextlib.nullcontext():
        for round_ in range(warmup + rounds):
            timed = round_ >= warmup
            for i, fn in enumerate(live):
                if fn is None:
                    continue
                gc.collect()
                if cuda:
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter()
                if on_error is None:
                    fn()
                elif (failure := _attempt(fn)) is not None:
                    live[i] = None
                    marks[i] = []
                    on_error(i, failure)
                    continue
                if not timed:
                    continue
                if cuda:
                    end.record()
                    marks[i].append((start, end))
                else:
                    marks[i].append((time.perf_counter() - t0) * 1e3)
        if cuda:
            torch.cuda.synchronize()
    method: TimingMethod = "cuda_events" if cuda else "wall"
    out: list[Timing | None] = []
    for fn, samples in zip(live, marks, strict=True):
        if fn is None:
            out.append(None)
            continue
        ms = [s.elapsed_time(e) for s, e in samples] if cuda else samples
        out.append(Timing.from_samples(ms, method))
    return out


def peak_memory(fn: Callable[[], T], device: torch.device) -> tuple[int | None, T]:
    """Run `fn` once; return the CUDA memory it peaked at above what was allocated before it (the
    inputs), None on other devices, and what `fn` returned."""
    if device.type != "cuda":
        return None, fn()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base), result
