"""Benchmark harness: timers, measured ceilings, the result store, and the op benchmarks.

`time_fn` times a callable on GPU (CUDA graph / events) or CPU (wall clock); `measure_ceilings` gives the
copy bandwidth and matmul rate that every result is a percentage of (`bench_ceilings`: at the
sizes every benchmark uses); `save_results`/`load_results` keep
results as JSON under `data/results/<gpu>/`; `run_layernorm_benchmark` is the LayerNorm comparison.
"""

from hfkit.bench.ceilings import (
    Ceilings,
    bench_ceilings,
    device_name,
    measure_ceilings,
    measure_copy_bandwidth,
    measure_matmul_tflops,
    resolve_device,
)
from hfkit.bench.kernels import KernelBench, best_peer_table, kernel_frame, load_kernel_results
from hfkit.bench.layernorm import layernorm_errors, run_layernorm_benchmark, summary_table
from hfkit.bench.model import run_model_benchmark
from hfkit.bench.results import (
    ResultRow,
    environment_info,
    gpu_slug,
    load_results,
    results_dir,
    rows_to_frame,
    save_results,
    with_speedup,
)
from hfkit.bench.timing import Timing, peak_memory, rotating, time_cpu, time_cuda, time_fn, time_step

__all__ = [
    "Ceilings",
    "KernelBench",
    "ResultRow",
    "Timing",
    "bench_ceilings",
    "best_peer_table",
    "device_name",
    "environment_info",
    "gpu_slug",
    "kernel_frame",
    "layernorm_errors",
    "load_kernel_results",
    "load_results",
    "measure_ceilings",
    "measure_copy_bandwidth",
    "measure_matmul_tflops",
    "peak_memory",
    "resolve_device",
    "results_dir",
    "rotating",
    "rows_to_frame",
    "run_layernorm_benchmark",
    "run_model_benchmark",
    "save_results",
    "summary_table",
    "time_cpu",
    "time_cuda",
    "time_fn",
    "time_step",
    "with_speedup",
]
