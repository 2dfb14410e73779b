"""Profiler → pandas: where a step's time goes (the hfai article's operator table), the LayerNorm
input-shape census (which shapes LayerNorm sees, how often, and for how long) with a per-shape
comparison of torch's and hfkit's LayerNorm, and where a forward's memory goes (`saved_activations`:
what each submodule keeps alive for the backward).

Device time is CUDA time on a GPU and CPU time on the CPU.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from hfkit.bench.timing import time_fn

__all__ = [
    "LAYER_NORM_OPS",
    "census_speed",
    "layer_norm_census",
    "op_table",
    "profile_step",
    "saved_activations",
]

# The forward LayerNorm ops the census counts: torch's (aten::layer_norm dispatches to
# aten::native_layer_norm, which is counted only where no aten::layer_norm event is seen) and hfkit's.
LAYER_NORM_OPS = ("aten::layer_norm", "aten::native_layer_norm", "hfkit::layer_norm_fwd")


def _is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def profile_step(
    fn: Callable[[], Any],
    device: torch.device | str,
    steps: int = 2,
    warmup: int = 1,
    record_shapes: bool = True,
) -> profile:
    """Run `fn` `warmup` times unprofiled, then `steps` times under `torch.profiler` (CPU activity,
    plus CUDA on a CUDA device; input shapes recorded), and return the finished profiler."""
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps: expected >= 1 and warmup >= 0, got {steps}, {warmup}")
    cuda = _is_cuda(device)
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=record_shapes) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    return prof


def _profiled_on_cuda(prof: profile) -> bool:
    return any(a == ProfilerActivity.CUDA for a in (prof.activities or ()))


def _self_time_us(event: Any, cuda: bool) -> float:
    if cuda:
        return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))
    return float(event.self_cpu_time_total)


def _total_time_us(event: Any, cuda: bool) -> float:
    if cuda:
        return float(getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0.0)))
    return float(event.cpu_time_total)


def _is_operator(event: Any) -> bool:
    """An operator (a CPU-side event), not a kernel or memcpy event (their device time is already
    the operators' self device time) nor a user annotation."""
    if getattr(event, "is_user_annotation", False):
        return False
    return getattr(event, "device_type", DeviceType.CPU) == DeviceType.CPU


def op_table(prof: profile, top: int = 15) -> pd.DataFrame:
    """The `top` operators by self device time (CUDA on a GPU profile, CPU otherwise; kernels count
    towards the operator that launched them): columns
    `name`, `calls`, `time_ms` (self time over all profiled steps) and `share_pct` (of the total self
    device time of all operators), largest first."""
    cuda = _profiled_on_cuda(prof)
    rows = [(e.key, e.count, _self_time_us(e, cuda)) for e in prof.key_averages() if _is_operator(e)]
    rows = [r for r in rows if r[2] > 0]
    total = sum(r[2] for r in rows)
    rows.sort(key=lambda r: r[2], reverse=True)
    frame = pd.DataFrame(
        [
            {
                "name": name,
                "calls": calls,
                "time_ms": us / 1e3,
                "share_pct": 100.0 * us / total if total else 0.0,
            }
            for name, calls, us in rows[:top]
        ],
        columns=["name", "calls", "time_ms", "share_pct"],
    )
    frame.attrs["device_time"] = "cuda" if cuda else "cpu"
    frame.attrs["total_ms"] = total / 1e3
    return frame


def _census_events(prof: profile) -> list[Any]:
    averages = prof.key_averages(group_by_input_shape=True)
    events = [e for e in averages if e.key in LAYER_NORM_OPS]
    if any(e.key == "aten::layer_norm" for e in events):
        events = [e for e in events if e.key != "aten::native_layer_norm"]
    return events


def layer_norm_census(
    source: profile | nn.Module,
    batch: Mapping[str, torch.Tensor] | None = None,
    device: torch.device | str | None = None,
) -> pd.DataFrame:
    """The LayerNorm input-shape census of a profile (made with `record_shapes=True`), or of one
    forward pass of the model `source` on `batch` (profiled here, no gradients).

    Counts forward LayerNorm calls: `aten::layer_norm` (torch's; `aten::native_layer_norm` where no
    `aten::layer_norm` is seen) and `hfkit::layer_norm_fwd` (a model swapped with `to_hfkit`, where
    the Triton path runs). One row per (op, input shape): `op`, `shape` (a tuple), `calls`,
    `calls_pct`, `time_ms` (total device time, children included), `time_pct` (shares of all
    LayerNorm calls and time), largest time first.
    """
    if isinstance(source, nn.Module):
        if batch is None:
            raise ValueError("batch: required when source is a model")
        if device is None:
            device = next(source.parameters()).device

        def forward() -> None:
            with torch.no_grad():
                source(batch)

        source = profile_step(forward, device, steps=1, warmup=0)
    elif not isinstance(source, profile):
        raise ValueError(
            f"source: expected a torch.profiler.profile or an nn.Module, got {type(source).__name__}"
        )
    cuda = _profiled_on_cuda(source)
    rows = []
    for e in _census_events(source):
        shapes = e.input_shapes or [[]]
        rows.append(
            {"op": e.key, "shape": tuple(shapes[0]), "calls": e.count, "time_us": _total_time_us(e, cuda)}
        )
    columns = ["op", "shape", "calls", "calls_pct", "time_ms", "time_pct"]
    if not rows:
        return pd.DataFrame(columns=columns)
    frame = pd.DataFrame(rows)
    frame = frame.groupby(["op", "shape"], as_index=False, sort=False)[["calls", "time_us"]].sum()
    frame["calls_pct"] = 100.0 * frame["calls"] / frame["calls"].sum()
    total = frame["time_us"].sum()
    frame["time_pct"] = 100.0 * frame["time_us"] / total if total else 0.0
    frame["time_ms"] = frame["time_us"] / 1e3
    frame = frame.sort_values(["time_ms", "calls"], ascending=False, ignore_index=True)
    frame.attrs["device_time"] = "cuda" if cuda else "cpu"
    return frame[columns]


def census_speed(
    census: pd.DataFrame,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    warmup: int | None = None,
    reps: int | None = None,
) -> pd.DataFrame:
    """Time torch's `F.layer_norm` and `hfkit.ops.layer_norm` (forward, over the last dim, with a
    weight and bias) on each distinct shape of `census`, with `time_fn`. Returns one row a shape:
    `shape`, `calls` (summed over ops), `torch_ms`, `hfkit_ms` (median per call), `speedup`
    (torch / hfkit) and `saved_ms` (per call × calls)."""
    from hfkit.ops import layer_norm

    device = torch.device(device)
    columns = ["shape", "calls", "torch_ms", "hfkit_ms", "speedup", "saved_ms"]
    if census.empty:
        return pd.DataFrame(columns=columns)
    calls = census.groupby("shape", sort=False)["calls"].sum()
    rows = []
    for shape, count in calls.items():
        shape = tuple(int(d) for d in shape)
        if not shape or math.prod(shape) == 0:
            continue
        x = torch.randn(shape, device=device, dtype=dtype)
        w = torch.randn(shape[-1], device=device, dtype=dtype)
        b = torch.randn(shape[-1], device=device, dtype=dtype)
        times = {}
        for name, op in (("torch", F.layer_norm), ("hfkit", layer_norm)):
            run = functools.partial(op, x, shape[-1:], w, b)
            times[name] = time_fn(run, device, warmup=warmup, reps=reps).p50
        t_torch, t_hfkit = times["torch"], times["hfkit"]
        rows.append(
            {
                "shape": shape,
                "calls": int(count),
                "torch_ms": t_torch,
                "hfkit_ms": t_hfkit,
                "speedup": t_torch / t_hfkit if t_hfkit > 0 else math.nan,
                "saved_ms": (t_torch - t_hfkit) * int(count),
            }
        )
    return pd.DataFrame(rows, columns=columns)


def saved_activations(module: nn.Module, forward: Callable[[], Any], depth: int = 2) -> pd.DataFrame:
    """What a forward keeps alive for its backward, by submodule: one row per module (named to `depth`
    levels below `module`, e.g. "core.tri_mul_out" at depth 2) with `MiB` and `tensors` saved, and
    their `share` of the total; tensors saved outside any submodule count under "(top level)".

    Runs `forward()` (which must call `module`, with autograd on) under
    `torch.autograd.graph.saved_tensors_hooks`: each saved tensor's storage is counted once, at the
    innermost named module running when it is first saved; parameters are not counted (they live
    anyway). A storage that two modules save counts for the first. This is the memory that stays
    allocated from the forward to the backward: the bulk of a training step's peak.
    """
    if depth < 1:
        raise ValueError(f"depth: expected >= 1, got {depth}")
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    stack: list[str] = []
    seen: set[int] = set()
    totals: dict[str, list[int]] = {}
    handles = []

    def leave(_module: nn.Module, _inputs: Any, _output: Any) -> None:
        stack.pop()

    for name, sub in module.named_modules():
        if name and name.count(".") < depth:
            handles.append(sub.register_forward_pre_hook(lambda _m, _i, name=name: stack.append(name)))
            handles.append(sub.register_forward_hook(leave))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in params and key not in seen:
            seen.add(key)
            entry = totals.setdefault(stack[-1] if stack else "(top level)", [0, 0])
            entry[0] += storage.nbytes()
            entry[1] += 1
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
    finally:
        for handle in handles:
            handle.remove()
    frame = pd.DataFrame(
        [{"module": k, "MiB": v[0] / 2**20, "tensors": v[1]} for k, v in totals.items()],
        columns=["module", "MiB", "tensors"],
    )
    frame = frame.sort_values("MiB", ascending=False, ignore_index=True)
    total = frame["MiB"].sum()
    frame["share"] = frame["MiB"] / total if total > 0 else 0.0
    return frame
