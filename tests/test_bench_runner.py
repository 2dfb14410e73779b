"""Tests of the one benchmark runner and its case tables on CPU: error rows (never a silent gap), skips,
rows handed over as they complete, --append through `ResultFile`, the command stored as typed, every
case table behind `hfkit bench <op>`, and the committed result files (one name for the eager baseline).
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest
import torch

import hfkit.bench
from hfkit.bench import Ceilings, ResultFile, load_results, results_dir
from hfkit.bench.cases import NAMES
from hfkit.bench.runner import Benchmark, Prepared, ShapeCase, Skip, Steps, run_benchmark
from hfkit.cli import main

CEILINGS = Ceilings(copy_gbps=10.0, matmul_tflops=0.1, device_name="CPU (test)", matmul_dtype="fp32")


def _provider(name: str, case: ShapeCase, device: torch.device):
    if name == "peer":
        raise Skip("peer needs a CUDA device")
    return name


def _build(case: ShapeCase, impl: str, prepared: Prepared, mode: str, dtype: str) -> Steps:
    if impl == "broken":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
    x = prepared.inputs
    return Steps(lambda: x * 2, lambda: x * 2, 1, lambda: {"check_ok": True})


def _prepare(case: ShapeCase, dtype: str, device: torch.device) -> Prepared:
    if case.shape == (0,):
        raise ValueError("no inputs for an empty shape")
    return Prepared(torch.ones(case.shape), {"made": True})


TOY = Benchmark(
    name="toy", description="a toy op", providers=("eager", "broken", "peer"), dtypes=("fp32",),
    default_dtypes=("fp32",), cases=lambda profile: [], prepare=_prepare, provider=_provider, build=_build,
    cost=lambda case, dtype, mode: (8, None),
)  # fmt: skip


def test_runner_gives_error_rows_skips_and_hands_rows_over():
    seen = []
    with pytest.warns(RuntimeWarning, match="out of memory|failed"):
        result = run_benchmark(
            TOY, [ShapeCase((4,)), ShapeCase((0,))], "cpu", progress=False, ceilings=CEILINGS, warmup=0,
            reps=2, on_row=seen.append,
        )  # fmt: skip
    assert seen == result.rows
    # Every (case, provider, mode) that could run has a row; the skipped provider is listed, not lost.
    assert [(r.shape, r.provider, r.mode) for r in result.rows] == [
        ([s], p, m) for s in (4, 0) for p in ("eager", "broken") for m in ("fwd", "fwd+bwd")
    ]
    assert result.skipped == ["4 fp32: peer needs a CUDA device", "0 fp32: peer needs a CUDA device"]
    good, broken = result.rows[0], result.rows[2]
    assert good.method == "wall" and good.n_reps == 2 and good.extra["made"] and good.extra["check_ok"]
    assert (
        broken.method == "error" and math.isnan(broken.p50_ms) and "OutOfMemoryError" in broken.extra["error"]
    )
    # Inputs that cannot be prepared give error rows for every provider and mode.
    assert all(r.method == "error" and "ValueError" in r.extra["error"] for r in result.rows[4:])


def test_runner_rejects_unknown_choices():
    with pytest.raises(ValueError, match="providers"):
        run_benchmark(TOY, [ShapeCase((4,))], "cpu", providers=["flash"], ceilings=CEILINGS)
    with pytest.raises(ValueError, match="dtypes"):
        run_benchmark(TOY, [ShapeCase((4,))], "cpu", dtypes=["bf16"], ceilings=CEILINGS)


@pytest.mark.parametrize("name", NAMES)
def test_every_case_table_is_named_after_its_op_and_has_smoke_cases(name):
    bench = importlib.import_module(f"hfkit.bench.cases.{name}").BENCHMARK
    assert bench.name == name and "eager" in bench.providers and "hfkit" in bench.providers
    assert set(bench.default_dtypes) <= set(bench.dtypes)
    smoke, full = bench.cases("smoke"), bench.cases("full")
    assert smoke and full and len(smoke) <= len(full)
    # Smoke cases are small enough for the Triton interpreter.
    assert all(math.prod(c.shape) <= 50_000 for c in smoke), [c.shape for c in smoke]
    with pytest.raises(ValueError, match="profile"):
        bench.cases("huge")


def test_bench_help_lists_every_benchmark(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert all(name in text for name in (*NAMES, "model", "comms", "data"))
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert all(name in text for name in (*NAMES, "model", "comms", "data"))


def test_result_file_append_keeps_earlier_rows_commands_and_note(tmp_path):
    path = tmp_path / "toy.json"
    rows = run_benchmark(TOY, [ShapeCase((4,))], "cpu", providers=["eager"], progress=False,
                         ceilings=CEILINGS, warmup=0, reps=1, command="first").rows  # fmt: skip
    ResultFile(path, {"command": "first", "note": "by hand"}).save(rows)
    again = run_benchmark(TOY, [ShapeCase((4,))], "cpu", providers=["eager"], modes=["fwd"], progress=False,
                          ceilings=CEILINGS, warmup=0, reps=1, command="second").rows  # fmt: skip
    file = ResultFile(path, {"command": "second"}, append=True)
    file.save(again, partial=True)
    assert json.loads(path.read_text())["meta"]["partial"] is True
    file.save(again)
    doc = json.loads(path.read_text())
    assert "partial" not in doc["meta"] and doc["meta"]["earlier_commands"] == ["first"]
    assert doc["meta"]["note"] == "by hand" and doc["meta"]["command"] == "second"
    assert [(r["mode"], r["command"]) for r in doc["rows"]] == [("fwd+bwd", "first"), ("fwd", "second")]


def test_cli_stores_the_command_without_an_out_naming_the_default_file(tmp_path, monkeypatch):
    monkeypatch.setattr(hfkit.bench, "results_dir", lambda: tmp_path)
    default = tmp_path / "cpu" / "softmax.json"
    argv = ["bench", "softmax", "--device", "cpu", "--shapes", "2x2x3x9", "--dtypes", "fp32"]
    argv += ["--providers", "eager", "--modes", "fwd", "--reps", "1", "--no-progress"]
    assert main([*argv, "--out", str(default)]) == 0
    doc = json.loads(default.read_text())
    assert doc["meta"]["command"] == "hfkit " + " ".join(argv)
    assert {r["command"] for r in doc["rows"]} == {"hfkit " + " ".join(argv)}


def _committed_docs():
    for path in sorted(Path(results_dir()).rglob("*.json")):
        doc = json.loads(path.read_text())
        if isinstance(doc, dict) and isinstance(doc.get("meta"), dict) and isinstance(doc.get("rows"), list):
            yield path, doc


def test_committed_results_name_the_eager_baseline_eager_and_cite_commands_as_typed():
    docs = list(_committed_docs())
    if not docs:
        pytest.skip("no committed results yet")
    for path, _ in docs:
        frame = load_results(path)
        assert len(frame) > 0 and "torch" not in set(frame["provider"]), path
        # Commands as a user types them: no scratch output paths of the machine that ran them.
        assert not frame["command"].str.contains("--out /root/|--out /tmp/", regex=True).any(), path
    names = {p.name for p, _ in docs if p.parent.name == "h200"}
    assert {"layer_norm.json", "evoformer_attention.json"} <= names
    assert not {"layernorm.json", "attention.json"} & names


@pytest.mark.parametrize("unmeasured", [False, True])
def test_after_notes_can_void_the_peak(monkeypatch, unmeasured):
    """A provider whose memory is allocated before the measured window (graphs captured in the first
    call) says so in its after-notes: the row's peak is then None, not the misleading 0."""
    from hfkit.bench import runner
    from hfkit.bench.results import ENV_KEYS, environment_info

    monkeypatch.setattr(runner, "peak_memory", lambda fn, device: (123, fn()))
    after = {"peak_unmeasured": "pools allocated at capture"} if unmeasured else {}
    x = torch.ones(4)
    env = {k: v for k, v in environment_info("cpu").items() if k in ENV_KEYS}
    row = runner.measure_case(
        env=env, ceilings=CEILINGS, device=torch.device("cpu"), op="toy", provider="eager", mode="fwd",
        shape=[4], dtype="fp32", nbytes=0, flops=None, warmup=0, reps=2, extra={}, graph=False,
        build=lambda: runner.Steps(lambda: x * 2, lambda: x * 2, 1, lambda: {}, lambda: dict(after)),
    )  # fmt: skip
    assert row.peak_mem_bytes == (None if unmeasured else 123)
    assert row.extra.get("peak_unmeasured") == after.get("peak_unmeasured")
