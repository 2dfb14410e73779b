"""Tests of the benchmark harness on CPU: timers, result store, ceilings, LayerNorm benchmark, figures.

No test asserts a speed: CPU timings only have to be ordered, positive and consistent with the bytes
counted; what is checked is the bookkeeping around them.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import pytest
import torch

from hfkit.bench import (
    Ceilings,
    ResultRow,
    Timing,
    environment_info,
    gpu_slug,
    load_results,
    measure_ceilings,
    rotating,
    rows_to_frame,
    run_layernorm_benchmark,
    save_results,
    summary_table,
    time_cpu,
    time_cuda,
    time_fn,
    time_interleaved,
    with_speedup,
)
from hfkit.bench import results as results_mod
from hfkit.bench.cases.layer_norm import (
    CENSUS_SHAPES,
    FULL_SHAPES,
    SMOKE_SHAPES,
    layer_norm_cases,
    smoke_shape,
)
from hfkit.bench.results import ROW_FIELDS, git_commit

CPU_CEILINGS = Ceilings(copy_gbps=10.0, matmul_tflops=0.1, device_name="CPU (test)", matmul_dtype="fp32")


# --- timing -------------------------------------------------------------------------------------------


def test_timing_from_samples_percentiles():
    t = Timing.from_samples([5.0, 1.0, 3.0, 2.0, 4.0], "wall")
    assert (t.p20, t.p50, t.p80, t.n) == (pytest.approx(1.8), 3.0, pytest.approx(4.2), 5)
    with pytest.raises(ValueError, match="samples_ms"):
        Timing.from_samples([], "wall")


def test_time_cpu_orders_percentiles_and_measures_real_time():
    t = time_cpu(lambda: time.sleep(0.002), warmup=1, reps=7)
    assert t.method == "wall" and t.n == 7
    assert 0 < t.p20 <= t.p50 <= t.p80
    assert t.p50 >= 2.0  # a 2 ms sleep cannot take less than 2 ms


def test_time_cpu_divides_by_calls_per_fn():
    t = time_cpu(lambda: time.sleep(0.004), warmup=0, reps=3, calls=4)
    assert t.p50 >= 1.0  # 4 ms over 4 calls
    whole = time_cpu(lambda: time.sleep(0.004), warmup=0, reps=3)
    assert whole.p50 >= 4.0 and whole.p50 > t.p50


def test_time_fn_dispatches_on_device():
    calls = []
    t = time_fn(lambda: calls.append(1), "cpu", warmup=2, reps=5)
    assert t.method == "wall" and len(calls) == 7


def test_time_interleaved_calls_every_callable_once_a_round_in_order(monkeypatch):
    from hfkit.bench import timing

    log: list[str] = []
    monkeypatch.setattr(timing.gc, "collect", lambda: log.append("gc"))
    fns = [lambda name=name: log.append(name) for name in "abc"]
    out = time_interleaved(fns, "cpu", warmup=1, rounds=3)
    # A collection before every call; a, b, c in turn in each of the 1 + 3 rounds (not a a a a b ...).
    assert log == ["gc", "a", "gc", "b", "gc", "c"] * 4
    assert [t.n for t in out] == [3, 3, 3] and {t.method for t in out} == {"wall"}
    slow = time_interleaved([lambda: None, lambda: time.sleep(0.003)], "cpu", warmup=0, rounds=3)
    assert slow[1].p20 >= 3.0 > slow[0].p80  # each sample is its own callable's time


def test_time_interleaved_drops_a_failing_callable_and_times_the_others():
    calls = {"ok": 0, "bad": 0}
    failures = []

    def bad():
        calls["bad"] += 1
        if calls["bad"] == 2:  # the first timed round, after the warm-up
            raise RuntimeError("step exploded")

    fns = [lambda: calls.__setitem__("ok", calls["ok"] + 1), bad]
    out = time_interleaved(fns, "cpu", warmup=1, rounds=4, on_error=lambda i, e: failures.append((i, e)))
    assert out[1] is None and out[0].n == 4 and calls == {"ok": 5, "bad": 2}  # not called again
    assert [(i, str(e)) for i, e in failures] == [(1, "step exploded")]
    assert failures[0][1].__traceback__ is None  # its frames (and their tensors) are not kept
    with pytest.raises(RuntimeError, match="step exploded"):  # without on_error the error propagates
        calls["bad"] = 1
        time_interleaved([bad], "cpu", warmup=0, rounds=1)
    with pytest.raises(ValueError, match="rounds"):
        time_interleaved(fns, "cpu", rounds=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_time_cuda_without_gpu_raises():
    with pytest.raises(RuntimeError, match="CUDA"):
        time_cuda(lambda: None)


def test_rotating_exceeds_min_total_and_respects_cap():
    sets = rotating(lambda: object(), bytes_per_set=100, min_total_bytes=1000)
    assert len(sets) == 11 and len(sets) * 100 > 1000
    assert len({id(s) for s in sets}) == 11  # independent sets, not one object repeated
    assert len(rotating(lambda: 0, bytes_per_set=1, min_total_bytes=10**9, max_sets=8)) == 8
    assert len(rotating(lambda: 0, bytes_per_set=10**9, min_total_bytes=0)) == 1
    # Off a GPU one set: no L2 to defeat. On a GPU (or no device given) the count above.
    assert len(rotating(lambda: 0, bytes_per_set=100, min_total_bytes=1000, device=torch.device("cpu"))) == 1
    assert (
        len(rotating(lambda: 0, bytes_per_set=100, min_total_bytes=1000, device=torch.device("cuda"))) == 11
    )
    with pytest.raises(ValueError, match="bytes_per_set"):
        rotating(lambda: 0, bytes_per_set=0)


def test_measure_ceilings_on_cpu_are_positive():
    c = measure_ceilings("cpu", copy_nbytes=1 << 20, matmul_n=64)
    assert c.copy_gbps > 0 and c.matmul_tflops > 0
    assert c.matmul_dtype == "fp32" and c.device_name.startswith("CPU")


# --- results --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "slug"),
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100-80gb-hbm3"),
        ("NVIDIA A100-SXM4-80GB", "a100-sxm4-80gb"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("cpu", "cpu"),
        ("CPU (x86_64)", "cpu"),
        ("", "cpu"),
    ],
)
def test_gpu_slug(name, slug):
    assert gpu_slug(name) == slug


def _row(provider: str = "eager", p50: float = 2.0, shape=(1, 8, 64), **kw) -> ResultRow:
    env = environment_info("cpu", command="hfkit test")
    fields = {k: env[k] for k in ("gpu", "torch", "triton", "python", "commit", "command", "timestamp")}
    fields.update(
        op="layer_norm",
        provider=provider,
        mode="fwd",
        shape=list(shape),
        dtype="fp32",
        p20_ms=p50 * 0.9,
        p50_ms=p50,
        p80_ms=p50 * 1.1,
        method="wall",
        n_reps=10,
        bytes=4096,
        gbps=4096 / (p50 * 1e-3) / 1e9,
        pct_copy=1.0,
        extra={"note": "x"},
    )
    fields.update(kw)
    return ResultRow(**fields)


def test_save_load_round_trip_is_atomic(tmp_path):
    rows = [_row("eager", 2.0), _row("hfkit", 1.0, peak_mem_bytes=123)]
    path = save_results(rows, tmp_path / "gpu" / "layer_norm.json", ceilings=CPU_CEILINGS)
    assert [p.name for p in path.parent.iterdir()] == ["layer_norm.json"]  # no temp file left behind
    doc = json.loads(path.read_text())
    assert doc["meta"]["ceilings"]["copy_gbps"] == 10.0
    assert doc["meta"]["command"] == "hfkit test"
    assert len(doc["rows"]) == 2
    frame = load_results(path)
    assert list(frame["provider"]) == ["eager", "hfkit"]
    assert frame["p50_ms"].tolist() == [2.0, 1.0]
    assert frame["shape"][0] == [1, 8, 64] and frame["shape_str"][0] == "1x8x64"
    assert frame["peak_mem_bytes"][1] == 123 and frame["extra"][0] == {"note": "x"}
    assert frame["ceiling_copy_gbps"].eq(10.0).all()
    assert set(ROW_FIELDS) <= set(frame.columns)


def test_failed_save_keeps_old_file_and_leaves_no_temp(tmp_path):
    path = save_results([_row()], tmp_path / "r.json")
    before = path.read_text()
    with pytest.raises(TypeError):
        save_results([_row(extra={"bad": object()})], path)  # not JSON-serialisable
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_save_rejects_rows_missing_fields(tmp_path):
    row = _row().as_dict()
    del row["p50_ms"]
    with pytest.raises(ValueError, match="p50_ms"):
        save_results([row], tmp_path / "r.json")


def test_load_results_from_dir_and_slug(tmp_path, monkeypatch):
    save_results([_row("eager")], tmp_path / "h200" / "a.json")
    save_results([_row("hfkit"), _row("compile")], tmp_path / "h200" / "b.json")
    monkeypatch.setattr(results_mod, "results_dir", lambda: tmp_path)
    for source in (tmp_path / "h200", "h200", "NVIDIA H200"):
        frame = load_results(source)
        assert sorted(frame["provider"]) == ["compile", "eager", "hfkit"]
        assert set(frame["file"]) == {"a.json", "b.json"}
    with pytest.raises(FileNotFoundError, match="a100"):
        load_results("a100")
    # Another tool's JSON in the folder is skipped, not fatal; named directly, it is an error.
    (tmp_path / "h200" / "tuning.json").write_text('{"shapes": []}')
    with pytest.warns(UserWarning, match="tuning.json"):
        assert len(load_results("h200")) == 3
    with pytest.raises(ValueError, match="not a results document"):
        load_results(tmp_path / "h200" / "tuning.json")
    # The op filter keeps one op's rows, and finding none is a FileNotFoundError.
    save_results([_row("eager", op="attention")], tmp_path / "h200" / "c.json")
    with pytest.warns(UserWarning):
        assert set(load_results("h200", op="layer_norm")["op"]) == {"layer_norm"}
        with pytest.raises(FileNotFoundError, match="'lstm' rows"):
            load_results("h200", op="lstm")


def test_with_speedup_uses_the_matching_baseline():
    frame = with_speedup(
        rows_to_frame([_row("eager", 4.0), _row("hfkit", 1.0), _row("hfkit", 3.0, shape=(2, 64))])
    )
    by = {(r.provider, r.shape_str): r.speedup for r in frame.itertuples()}
    assert by[("eager", "1x8x64")] == 1.0 and by[("hfkit", "1x8x64")] == 4.0
    assert math.isnan(by[("hfkit", "2x64")])  # no eager row for that shape


def test_environment_info_and_git_commit(tmp_path, monkeypatch):
    monkeypatch.delenv("HFKIT_GIT_COMMIT", raising=False)
    info = environment_info("cpu", command="hfkit env")
    assert info["torch"] == torch.__version__ and info["command"] == "hfkit env"
    assert info["timestamp"].endswith("+00:00")
    assert git_commit(str(tmp_path)) is None  # not a repository
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "f.txt").write_text("a")
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "init"], check=True)
    head = subprocess.run(
        [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert git_commit(str(repo)) == head
    (repo / "f.txt").write_text("b")
    git_commit.cache_clear()
    assert git_commit(str(repo)) == head + "-dirty"
    # A tree copied to a GPU machine names its commit; a stale .git there does not win.
    monkeypatch.setenv("HFKIT_GIT_COMMIT", "abc1234")
    git_commit.cache_clear()
    assert git_commit(str(repo)) == "abc1234" and git_commit(str(tmp_path)) == "abc1234"


# --- LayerNorm benchmark ----------------------------------------------------------------------------------


def test_smoke_shapes_keep_the_normalized_dim():
    assert smoke_shape((1, 256, 256, 128)) == (1, 4, 4, 128)
    assert all(math.prod(s[:-1]) <= 16 for s in SMOKE_SHAPES)
    assert len(FULL_SHAPES) == len(CENSUS_SHAPES) + 1 == 12
    assert [c.shape for c in layer_norm_cases("smoke")] == list(SMOKE_SHAPES)


def test_layernorm_benchmark_rows_on_cpu():
    shape = (2, 3, 40)  # odd sizes on purpose
    rows, ceilings = run_layernorm_benchmark(
        "cpu",
        shapes=[shape],
        dtypes=("fp32", "bf16"),
        providers=("hfkit", "eager"),
        progress=False,
        ceilings=CPU_CEILINGS,
        command="hfkit bench layer_norm --test",
        warmup=1,
        reps=3,
    )
    assert ceilings is CPU_CEILINGS
    assert len(rows) == 2 * 2 * 2  # dtypes x modes x providers
    tensor_bytes = {"fp32": 240 * 4, "bf16": 240 * 2}
    for row in rows:
        data = row.as_dict()
        assert set(data) == set(ROW_FIELDS)
        for key in ("gpu", "torch", "python", "command", "timestamp", "op", "provider", "mode", "method"):
            assert data[key], key
        assert row.command == "hfkit bench layer_norm --test" and row.shape == [2, 3, 40]
        assert 0 < row.p20_ms <= row.p50_ms <= row.p80_ms and row.n_reps == 3
        assert row.bytes == {"fwd": 2, "fwd+bwd": 5}[row.mode] * tensor_bytes[row.dtype]
        assert row.gbps == pytest.approx(row.bytes / (row.p50_ms * 1e-3) / 1e9)
        assert row.pct_copy == pytest.approx(100 * row.gbps / CPU_CEILINGS.copy_gbps)
        assert row.extra["copy_p50_ms"] > 0 and row.extra["rotating_sets"] == 1
        # The guard that timed numbers come from right answers: forward vs float64.
        assert row.extra["max_abs_err_vs_fp64"] < (1e-4 if row.dtype == "fp32" else 5e-2)
    assert {(r.dtype, r.mode, r.provider) for r in rows} == {
        (d, m, p) for d in ("fp32", "bf16") for m in ("fwd", "fwd+bwd") for p in ("hfkit", "eager")
    }
    table = summary_table(rows)
    assert list(table.columns) == [
        "shape",
        "dtype",
        "mode",
        "provider",
        "p50 µs",
        "GB/s",
        "% copy",
        "speed-up vs eager",
    ]
    assert (table[table["provider"] == "eager"]["speed-up vs eager"] == 1.0).all()


def test_layernorm_benchmark_rejects_unknown_choices():
    with pytest.raises(ValueError, match="providers"):
        run_layernorm_benchmark("cpu", shapes=[(4, 8)], providers=("apex",), ceilings=CPU_CEILINGS)
    with pytest.raises(ValueError, match="modes"):
        run_layernorm_benchmark("cpu", shapes=[(4, 8)], modes=("bwd",), ceilings=CPU_CEILINGS)


# --- figures and the explorer ----------------------------------------------------------------------------


def test_figures_have_one_trace_per_provider_and_facet():
    pytest.importorskip("plotly")
    from hfkit.viz import pct_copy_bars, speedup_bars, time_bars

    rows = [
        _row(p, t, mode=m, dtype=d)
        for p, t in (("eager", 3.0), ("hfkit", 1.0), ("compile", 2.0))
        for m in ("fwd", "fwd+bwd")
        for d in ("fp32", "bf16")
    ]
    frame = rows_to_frame(rows)
    assert len(time_bars(frame).data) == 3 * 4
    assert len(pct_copy_bars(frame).data) == 3 * 4
    fig = speedup_bars(frame)
    assert {t.name for t in fig.data} == {"hfkit", "compile"}  # the baseline is not drawn against itself
    hfkit_y = [y for t in fig.data if t.name == "hfkit" for y in t.y]
    assert hfkit_y == pytest.approx([3.0] * 4)


def test_layernorm_explorer_runs_on_click(monkeypatch):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("plotly")
    from hfkit.viz import layernorm_explorer

    explorer = layernorm_explorer("cpu", providers=("eager",))
    explorer.shape.value = (1, 256, 384)
    explorer.dtype.value = "fp32"
    explorer.button.click()
    table = explorer.last_table
    assert table is not None and len(table) == 2  # fwd and fwd+bwd
    assert set(table["shape"]) == {"1x16x384"}  # scaled down on a CPU, last dim kept


def test_committed_results_load_if_present():
    folder = Path(results_mod.results_dir()) / "h200"
    if not (folder / "layer_norm.json").exists():
        pytest.skip("no committed H200 LayerNorm results yet")
    frame = load_results("h200", op="layer_norm")
    assert len(frame) > 0 and set(ROW_FIELDS) <= set(frame.columns)


def test_every_committed_results_file_follows_the_schema():
    # Every results document under data/results/<device>/ loads whole (tuning sweeps are not results).
    folders = [p for p in Path(results_mod.results_dir()).iterdir() if p.is_dir()]
    if not folders:
        pytest.skip("no committed results yet")
    for folder in folders:
        frame = load_results(folder)
        assert len(frame) > 0 and frame["command"].map(bool).all(), folder


def test_layernorm_benchmark_compile_provider_on_cpu():
    # One small compile (Inductor's C++ backend on CPU): the provider builds, runs and is correct.
    rows, _ = run_layernorm_benchmark(
        "cpu",
        shapes=[(3, 40)],
        dtypes=("fp32",),
        modes=("fwd",),
        providers=("compile",),
        progress=False,
        ceilings=CPU_CEILINGS,
        warmup=1,
        reps=3,
    )
    assert [(r.provider, r.mode) for r in rows] == [("compile", "fwd")]
    assert rows[0].extra["max_abs_err_vs_fp64"] < 1e-4


def test_layernorm_errors_table_and_that_it_catches_a_wrong_op(monkeypatch):
    import hfkit.ops
    from hfkit.bench import layernorm_errors

    table = layernorm_errors([(3, 7, 33)], dtypes=("fp32",), device="cpu")
    assert list(table.columns) == ["shape", "dtype", "y", "dx", "dweight", "dbias", "torch_y_vs_fp64"]
    row = table.iloc[0]
    assert row["shape"] == "3x7x33" and max(row["y"], row["dx"], row["dweight"], row["dbias"]) < 1e-4

    def wrong(x, normalized_shape, weight=None, bias=None, eps=1e-5):  # doubles the bias
        return torch.nn.functional.layer_norm(x, normalized_shape, weight, 2 * bias, eps)

    monkeypatch.setattr(hfkit.ops, "layer_norm", wrong)
    bad = layernorm_errors([(3, 7, 33)], dtypes=("fp32",), device="cpu").iloc[0]
    assert bad["y"] > 1e-2 and bad["dbias"] > 1e-2
