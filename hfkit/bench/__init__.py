"""Benchmark harness: timers, measured ceilings, the one runner, the result store, and the benchmarks.

`run_benchmark` measures an op's case table (`hfkit.bench.cases.<op>.BENCHMARK`) on the device with
`time_fn` (CUDA graph / events on a GPU, wall clock on a CPU), reporting against the ceilings of
`bench_ceilings` measured in the same run; `ResultFile`/`save_results`/`load_results` keep results as
JSON under `data/results/<gpu>/<op>.json`. The model, comms and data benchmarks (`hfkit.bench.model`,
`.comms`, `.data_cost`) write the same `ResultRow`s through the same writer, and `hfkit.bench.tune`
sweeps the kernels' tiles of an op whose case table has a `TileSweep` (`hfkit bench <op> --tiles`).
"""

from hfkit.bench.cases.layer_norm import layernorm_errors, run_layernorm_benchmark
from hfkit.bench.ceilings import (
    Ceilings,
    bench_ceilings,
    device_name,
    measure_ceilings,
    measure_copy_bandwidth,
    measure_matmul_tflops,
    resolve_device,
)
from hfkit.bench.kernels import best_peer_table, kernel_frame, load_kernel_results
from hfkit.bench.model import run_model_benchmark
from hfkit.bench.results import (
    ResultFile,
    ResultRow,
    environment_info,
    gpu_slug,
    load_results,
    results_dir,
    rows_to_frame,
    save_results,
    summary_table,
    with_speedup,
)
from hfkit.bench.runner import Benchmark, BenchResult, run_benchmark
from hfkit.bench.timing import (
    Timing,
    peak_memory,
    rotating,
    time_cpu,
    time_cuda,
    time_fn,
    time_interleaved,
    time_step,
)

__all__ = [
    "BenchResult",
    "Benchmark",
    "Ceilings",
    "ResultFile",
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
    "run_benchmark",
    "run_layernorm_benchmark",
    "run_model_benchmark",
    "save_results",
    "summary_table",
    "time_cpu",
    "time_cuda",
    "time_fn",
    "time_interleaved",
    "time_step",
    "with_speedup",
]
