"""Ceilings measured on the machine itself: device-to-device copy bandwidth and matmul rate.

Every benchmark reports its achieved GB/s or TFLOP/s as a percentage of these two numbers measured in
the same run, not of a datasheet: a memory-bound op such as LayerNorm cannot beat a plain copy of the
same bytes, and the copy rate reachable in practice is below the datasheet's HBM figure.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hfkit.bench.timing import time_fn

__all__ = [
    "Ceilings",
    "bench_ceilings",
    "device_name",
    "measure_ceilings",
    "measure_copy_bandwidth",
    "measure_matmul_tflops",
    "resolve_device",
]

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def resolve_device(device: torch.device | str | None = None) -> torch.device:
    """The device to benchmark on: `device` if given, else the current CUDA device, else the CPU."""
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_name(device: torch.device | str | None = None) -> str:
    """Human-readable device name: e.g. 'NVIDIA H200' for a GPU, 'CPU (x86_64)' for the CPU."""
    device = resolve_device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine() or 'unknown'})"


@dataclass(frozen=True)
class Ceilings:
    """Measured copy bandwidth (GB/s, bytes read + written) and matmul rate (TFLOP/s) of one device."""

    copy_gbps: float
    matmul_tflops: float
    device_name: str
    matmul_dtype: str = "bf16"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_copy_bandwidth(device: torch.device | str | None = None, nbytes: int | None = None) -> float:
    """Device-to-device copy bandwidth in GB/s (1e9 bytes/s), counting bytes read plus bytes written.

    Times `dst.copy_(src)` on two buffers of `nbytes` each (default 2 GiB on CUDA, far beyond L2, timed
    with CUDA events on eager calls; 64 MiB on CPU, wall-clock timed). The buffers hold random data.
    """
    device = resolve_device(device)
    if nbytes is None:
        nbytes = 2 << 30 if device.type == "cuda" else 64 << 20
    numel = max(1, nbytes // 4)
    src = torch.randn(numel, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    # Eager, not a CUDA graph: a copy this large takes ~1 ms, so launch overhead is nothing, and a
    # captured copy_ of a buffer this size becomes a memcpy node that ran at ~2.7 TB/s on an H200
    # against ~4.25 TB/s for the eager copy (seen 2026-11-29; graph and eager agree up to 128 MiB).
    timing = time_fn(
        lambda: dst.copy_(src), device, warmup=5, reps=30 if device.type == "cuda" else 10, graph=False
    )
    moved = 2 * numel * 4
    return moved / (timing.p50 * 1e-3) / 1e9


def measure_matmul_tflops(
    device: torch.device | str | None = None, n: int | None = None, dtype: torch.dtype | None = None
) -> float:
    """Dense matmul rate in TFLOP/s (2 n^3 per product) on random n x n operands.

    Defaults: n=8192 in bf16 on CUDA (graph timed); n=1024 in fp32 on CPU. Random data, because zeros
    run measurably faster on some GPUs and would overstate the ceiling.
    """
    device = resolve_device(device)
    on_cuda = device.type == "cuda"
    n = n if n is not None else (8192 if on_cuda else 1024)
    dtype = dtype if dtype is not None else (torch.bfloat16 if on_cuda else torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    timing = time_fn(lambda: torch.matmul(a, b, out=c), device, warmup=5, reps=30 if on_cuda else 5)
    return 2 * n**3 / (timing.p50 * 1e-3) / 1e12


def measure_ceilings(
    device: torch.device | str | None = None,
    *,
    copy_nbytes: int | None = None,
    matmul_n: int | None = None,
) -> Ceilings:
    """Measure both ceilings on `device` (default: the current GPU, else the CPU).

    `copy_nbytes` and `matmul_n` override the per-device defaults of `measure_copy_bandwidth` and
    `measure_matmul_tflops` (use small values for a quick look on a CPU).
    """
    device = resolve_device(device)
    on_cuda = device.type == "cuda"
    ceilings = Ceilings(
        copy_gbps=measure_copy_bandwidth(device, copy_nbytes),
        matmul_tflops=measure_matmul_tflops(device, matmul_n),
        device_name=device_name(device),
        matmul_dtype="bf16" if on_cuda else "fp32",
    )
    if on_cuda:
        torch.cuda.empty_cache()
    return ceilings


def bench_ceilings(device: torch.device | str | None = None) -> Ceilings:
    """The ceilings a benchmark run reports against: full size on a GPU; small and quick on a CPU,
    where they only label smoke runs."""
    device = resolve_device(device)
    if device.type == "cuda":
        return measure_ceilings(device)
    return measure_ceilings(device, copy_nbytes=16 << 20, matmul_n=256)
