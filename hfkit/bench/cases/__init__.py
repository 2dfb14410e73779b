"""One case table per op benchmark (`Benchmark`, fed to `hfkit.bench.runner.run_benchmark`), each
module named after its op, as its results file (`data/results/<gpu>/<op>.json`) and its command
(`hfkit bench <op>`) are. `BENCHMARK` in each module is its table."""

NAMES: tuple[str, ...] = (
    "layer_norm",
    "softmax",
    "evoformer_attention",
    "triangle_multiplication",
    "elementwise",
    "multihead_attention",
    "lstm",
    "outer_product_linear",
)
