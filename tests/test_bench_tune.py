"""Tests of the tile sweeps (`hfkit bench <op> --tiles`, `hfkit.bench.tune`) on CPU under the Triton
interpreter: every pass has its default tiles and the swept ones, each row checked against the default
tiles' output; a configuration that fails gives an error row; the CLI writes result rows with the best
tiles in the file's meta.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import hfkit.bench
from hfkit.bench import Ceilings, load_results
from hfkit.bench.cases import evoformer_attention, layer_norm, softmax
from hfkit.bench.tune import best_tiles, run_tile_sweep
from hfkit.cli import main

pytest.importorskip("triton")

CEILINGS = Ceilings(copy_gbps=10.0, matmul_tflops=0.1, device_name="CPU (test)", matmul_dtype="fp32")


@pytest.mark.parametrize("module", [softmax, layer_norm])
def test_sweep_times_default_and_swept_tiles_of_every_pass(module):
    bench = module.BENCHMARK
    case = bench.cases("smoke")[:1]
    rows = run_tile_sweep(
        bench, case, "cpu", dtypes=["fp32"], smoke=True, ceilings=CEILINGS, warmup=0, reps=1
    )
    assert [r.mode for r in rows] == [p for p in module.TILES.passes for _ in range(2)]
    for pass_ in module.TILES.passes:
        default, swept = (r for r in rows if r.mode == pass_)
        assert default.extra["default"] and not swept.extra["default"]
        assert default.extra["tiles"] != swept.extra["tiles"]
        assert set(default.extra["tiles"]) == set(module.TILES.fields[pass_])
    assert all(r.method == "wall" and r.provider == "hfkit" and r.op == bench.name for r in rows)
    assert all(r.extra["check_ok"] and r.extra["max_abs_err_vs_default"] < 1e-4 for r in rows)
    assert all(r.bytes > 0 and r.gbps > 0 for r in rows)
    assert set(best_tiles(rows)) == set(module.TILES.passes)


def test_sweep_gives_an_error_row_for_tiles_that_do_not_run():
    # BLOCK_M must be a power of two (tl.arange): a configuration that fails is a data point, not a crash.
    tiles = softmax.TILES._replace(grid=lambda case, pass_: [(3, 1)])
    bench = dataclasses.replace(softmax.BENCHMARK, tiles=tiles)
    case = bench.cases("smoke")[:1]
    with pytest.warns(RuntimeWarning, match="failed"):
        rows = run_tile_sweep(bench, case, "cpu", dtypes=["fp32"], passes=["fwd"], ceilings=CEILINGS, reps=1)
    default, broken = rows
    assert default.method == "wall" and broken.method == "error" and broken.extra["tiles"]["block_m"] == 3
    # Only tiles that ran at every case compete for the best.
    assert best_tiles(rows) == {"fwd": default.extra["tiles"]}


def test_best_tiles_sums_times_relative_to_each_cases_fastest():
    def row(shape, tiles, ms):
        return {"mode": "fwd", "shape": shape, "dtype": "fp32", "method": "wall", "p50_ms": ms,
                "extra": {"tiles": {"block_m": tiles}, "check_ok": True}}  # fmt: skip

    rows = [row([1], 1, 1.0), row([1], 2, 1.5), row([2], 1, 30.0), row([2], 2, 10.0), row([2], 4, 1.0)]
    # tiles 1: 1 + 3 = 4; tiles 2: 1.5 + 1 = 2.5; tiles 4 did not run at shape [1].
    assert best_tiles(rows) == {"fwd": {"block_m": 2}}


def test_attention_sweep_has_every_backward_pass():
    assert evoformer_attention.TILES.passes == ("fwd", "dq", "dkdv", "dbias")
    case = evoformer_attention.BENCHMARK.cases("smoke")[0]
    assert all(len(evoformer_attention.TILES.grid(case, p)) >= 24 for p in evoformer_attention.TILES.passes)
    nbytes, flops = evoformer_attention.TILES.cost(case, "bf16", "dkdv")
    assert nbytes == 0 and flops == 2 * case.flops(False)  # four matmuls: twice the forward's two


def test_cli_tiles_writes_result_rows_under_tuning(tmp_path, monkeypatch):
    monkeypatch.setattr(hfkit.bench, "results_dir", lambda: tmp_path)
    argv = ["bench", "softmax", "--tiles", "--device", "cpu", "--shapes", "2x2x3x9", "--dtypes", "fp32"]
    assert main([*argv, "--passes", "bwd", "--reps", "1", "--no-progress"]) == 0
    path = tmp_path / "cpu" / "tuning" / "softmax.json"
    doc = json.loads(path.read_text())
    assert set(doc["meta"]["best"]) == {"bwd"} and doc["meta"]["ceilings"]["copy_gbps"] > 0
    frame = load_results(path)
    assert (
        set(frame["mode"]) == {"bwd"} and len(frame) == 2 and frame["extra"].map(lambda e: "tiles" in e).all()
    )
    with pytest.raises(SystemExit):
        main(["bench", "triangle_multiplication", "--tiles"])  # no sweep: not an option there
    assert torch.isfinite(torch.tensor(frame["p50_ms"].tolist())).all()
