"""hfkit.bench.model on the CPU at the tiny preset: the block / stack / step / waterfall parts run,
their rows are complete and saved, failures and the time budget become rows, and the compiled
block is compiled once for many blocks."""

from __future__ import annotations

import json
import math

import pytest
import torch

import hfkit.bench.model as bench_model
from hfkit.bench import load_results
from hfkit.bench.model import (
    PRECISIONS,
    bench_config,
    compile_blocks,
    evoformer_block_flops,
    make_block,
    make_variant,
    measure_train_step,
    measure_waterfall,
    present_ops,
    reference_ops_on_cpu,
    run_model_benchmark,
    summary_table,
    swappable_ops,
    waterfall_stages,
)
from hfkit.cli import main
from hfkit.model import AlphaFoldLite, EvoformerStack
from hfkit.nn import to_hfkit

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = bench_config(quick=True)
QUICK = dict(quick=True, progress=False, compile_backend="eager", shapes=[(3, 5)])


def test_block_flops_match_the_issue_estimate() -> None:
    # Issue 5: "one block needs about 0.6 TFLOP ... for forward+backward" at af2_initial (128, 256).
    af2 = bench_config()
    assert 0.55e12 < 3 * evoformer_block_flops(128, 256, af2) < 0.75e12
    assert evoformer_block_flops(256, 384, af2) > evoformer_block_flops(128, 384, af2)
    assert evoformer_block_flops(128, 512, af2) > evoformer_block_flops(128, 256, af2)


def test_compile_blocks_compiles_once_for_many_blocks(seed) -> None:
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    config = TINY.replace(no_blocks=3, msa_dropout=0.0, pair_dropout=0.0)
    stack = EvoformerStack.from_config(config)
    # Inputs that require grad, as inside a model: block 0 then sees what blocks 1 and 2 see.
    m = torch.randn(1, 3, 7, config.c_m, requires_grad=True)
    z = torch.randn(1, 7, 7, config.c_z, requires_grad=True)
    masks = (torch.ones(1, 3, 7), torch.ones(1, 7, 7))
    expected = stack(m, z, *masks)
    assert compile_blocks(stack, backend=counting_backend) == 3
    got = stack(m, z, *masks)
    assert len(graphs) == 1  # three blocks, one graph
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
    for block in stack.blocks:
        del block.forward
    assert all(not hasattr(b.__dict__, "forward") for b in stack.blocks)


def test_make_variant_swaps_and_leaves_the_original(seed) -> None:
    block = make_block(TINY)
    hf, notes = make_variant(block, "hfkit")
    assert "swapped" in notes["swap"]
    assert type(block.msa_att_row.layer_norm_m) is torch.nn.LayerNorm  # the copy was swapped
    assert type(hf.msa_att_row.layer_norm_m) is not torch.nn.LayerNorm
    only, notes = make_variant(block, "hfkit", ops=["LayerNorm"])
    assert notes["ops"] == ["LayerNorm"] and "LayerNorm" in notes["swap"]
    with pytest.raises(ValueError, match="variant"):
        make_variant(block, "fast")


def test_block_stack_step_rows_on_cpu(tmp_path) -> None:
    out = tmp_path / "model.json"
    rows = run_model_benchmark(
        "cpu",
        parts=("block", "stack", "step"),
        variants=("eager", "hfkit", "compile"),
        step_variants=("eager", "hfkit"),
        dtypes=("bf16",),
        stack_dtypes=("fp32",),
        checkpointing=(False, True),
        out=out,
        command="test",
        **QUICK,
    )
    by_op = {
        op: [r for r in rows if r.op == op] for op in ("evoformer_block", "evoformer_stack", "train_step")
    }
    assert len(by_op["evoformer_block"]) == 2 * 3 * 2  # launches x variants x modes
    assert len(by_op["evoformer_stack"]) == 2 * 3  # checkpointing x variants
    assert len(by_op["train_step"]) == 2 * 2 * 2  # launches x checkpointing x variants
    for r in rows:
        assert r.method == "wall" and "error" not in r.extra, r.extra
        assert r.p50_ms > 0 and r.n_reps >= 1 and r.extra["first_call_s"] > 0
        assert r.command == "test" and r.gpu.startswith("CPU")
    block = by_op["evoformer_block"][0]
    assert block.shape == [3, 5] and block.flops == evoformer_block_flops(3, 5, TINY)
    assert {r.extra["params_dtype"] for r in by_op["evoformer_block"]} == {"bfloat16"}
    assert {r.extra["params_dtype"] for r in by_op["evoformer_stack"]} == {"float32"}
    assert {r.extra["checkpointing"] for r in by_op["evoformer_stack"]} == {False, True}
    hfkit_step = next(r for r in by_op["train_step"] if r.provider == "hfkit")
    assert "swapped" in hfkit_step.extra["swap"] and hfkit_step.extra["autocast"] == "bfloat16"
    assert set(hfkit_step.extra["phases_s"]) == {"forward", "backward", "optimizer"}
    assert math.isfinite(hfkit_step.extra["loss"])
    compiled = next(r for r in by_op["evoformer_stack"] if r.provider == "compile")
    assert compiled.extra["compiled_blocks"] == TINY.no_blocks
    saved = load_results(out)
    assert len(saved) == len(rows) and set(saved["op"]) == set(by_op)
    table = summary_table(saved)
    assert (table[table["variant"] == "eager"]["vs eager"] == 1.0).all()


def test_failures_and_budget_become_rows(tmp_path) -> None:
    def broken_backend(gm, example_inputs):
        raise RuntimeError("backend exploded")

    with pytest.warns(RuntimeWarning, match="backend exploded"):
        rows = run_model_benchmark(
            "cpu",
            parts=("block",),
            variants=("compile", "eager"),
            dtypes=("fp32",),
            **{**QUICK, "compile_backend": broken_backend},
        )
    failed = [r for r in rows if r.provider == "compile"]
    assert len(failed) == 2 * 2 and all(r.method == "error" and math.isnan(r.p50_ms) for r in failed)
    assert all("backend exploded" in r.extra["error"] for r in failed)
    assert all(r.method == "wall" for r in rows if r.provider == "eager")  # the run went on

    skipped = run_model_benchmark("cpu", parts=("stack",), variants=("eager",), budget_s=1e-9, **QUICK)
    assert len(skipped) == 2 and all("budget" in r.extra["error"] for r in skipped)


def test_append_keeps_other_configurations(tmp_path) -> None:
    out = tmp_path / "model.json"
    common = dict(
        parts=("block",), dtypes=("fp32",), modes=("fwd",), block_launch=("graph",), out=out, **QUICK
    )
    run_model_benchmark("cpu", variants=("eager",), **common)
    run_model_benchmark("cpu", variants=("eager", "hfkit"), append=True, **common)
    doc = json.loads(out.read_text())
    assert sorted(r["provider"] for r in doc["rows"]) == ["eager", "hfkit"]  # eager replaced, not doubled
    run_model_benchmark("cpu", variants=("hfkit",), **common)  # without append: overwritten
    assert [r["provider"] for r in json.loads(out.read_text())["rows"]] == ["hfkit"]


def test_waterfall_stages_and_train_step_subset() -> None:
    ops = swappable_ops()
    assert "LayerNorm" in ops and "Attention" in ops
    stages = waterfall_stages()
    assert [s[0] for s in stages] == ["eager", *(f"+{op}" for op in ops), "+graph", "+compile"]
    assert stages[-1][2] == ops and stages[1][2] == ops[:1]
    assert all(len(s) == 4 for s in stages)
    assert [s[3] for s in stages] == ["eager"] * (len(ops) + 1) + ["graph", "graph"]
    assert stages[-2][1:3] == ("hfkit", ops) and stages[-1][1] == "compile_hfkit"
    assert [s[0] for s in waterfall_stages(["LayerNorm"], compile=False)] == ["eager", "+LayerNorm", "+graph"]
    out = measure_train_step(TINY, "cpu", "fp32", "hfkit", ops=["LayerNorm"], reps=1)
    assert "LayerNorm" in out["notes"]["swap"] and out["timing"].p50 > 0
    assert math.isfinite(out["loss"])


def test_present_ops_lists_only_the_ops_the_model_holds(seed) -> None:
    model = AlphaFoldLite(TINY)
    held = present_ops(model)
    assert held == [op for op in swappable_ops() if op in held]  # the registry's order
    assert {"Attention", "LayerNorm", "PairTransition", "DropoutRowwise"} <= set(held)
    # No nn.LSTM or nn.MultiheadAttention in AlphaFoldLite, and only subclasses of SharedDropout.
    assert not {"LSTM", "MultiheadAttention", "SharedDropout"} & set(held)
    assert type(model.evoformer.blocks[0].msa_att_row.layer_norm_m) is torch.nn.LayerNorm  # left as it is
    # An opt-in op counts where the model holds it; a subclass is never swapped; nor is what is swapped.
    lstm = torch.nn.Sequential(torch.nn.LSTM(4, 4), torch.nn.LayerNorm(4))
    assert present_ops(lstm) == ["LayerNorm", "LSTM"]
    assert present_ops(torch.nn.Sequential(type("MyNorm", (torch.nn.LayerNorm,), {})(4))) == []
    assert present_ops(to_hfkit(lstm, inplace=False, include=["LayerNorm", "LSTM"])) == []


def _fake_train_steps(log: list[str], fail: dict[str, str]):
    """A stand-in for `_train_steps`: a step logs its stage's label; `fail` maps a label to "build"
    (building it raises) or "step" (its third call, the first timed round after one warm-up, raises)."""

    def build(config, device, precision, variant, ops, *args, launch="eager", batch=None, mode="fwd+bwd"):
        label = "+graph" if launch == "graph" else f"+{ops[-1]}" if ops else "eager"
        if fail.get(label) == "build":
            raise RuntimeError(f"{label}: build exploded")
        calls = []

        def step():
            calls.append(1)
            log.append(label)
            if fail.get(label) == "step" and len(calls) == 3:
                raise RuntimeError(f"{label}: step exploded")

        return bench_model.Steps(step, step, 1, lambda: {"batch": batch}, None)

    return build


def test_waterfall_times_eager_stages_in_interleaved_rounds_and_keeps_failures(monkeypatch) -> None:
    log: list[str] = []
    fake = _fake_train_steps(log, {"+Attention": "build", "+LSTM": "step"})
    monkeypatch.setattr(bench_model, "_train_steps", fake)
    ops = ["LayerNorm", "Attention", "LSTM"]
    with pytest.warns(RuntimeWarning, match="exploded"):
        rows = measure_waterfall(TINY, "cpu", "fp32", ops=ops, compile=False, rounds=(1, 3), batch={})
    assert [r.provider for r in rows] == ["eager", "+LayerNorm", "+Attention", "+LSTM", "+graph"]
    assert [r.extra["stage"] for r in rows] == [0, 1, 2, 3, 4]
    eager = ["eager", "+LayerNorm", "+LSTM"]  # "+Attention" never built
    # First calls stage by stage, then the rounds: every stage once a round, in stage order ("+LSTM"
    # fails in the first timed round and is left out after); then the graphed stage on its own.
    assert log == eager + eager + eager + ["eager", "+LayerNorm"] * 2 + ["+graph"] * 2
    ok, layer_norm, attention, lstm, graph = rows
    for row in (ok, layer_norm):
        assert row.method == "wall" and row.n_reps == 3 and row.extra["timing"] == "interleaved"
        assert row.extra["first_call_s"] >= 0 and row.extra["launch"] == "eager" and "error" not in row.extra
    assert layer_norm.extra["ops"] == ["LayerNorm"] and layer_norm.extra["batch"] == {}
    assert attention.method == "error" and "build exploded" in attention.extra["error"]
    assert lstm.method == "error" and "step exploded" in lstm.extra["error"] and math.isnan(lstm.p50_ms)
    assert graph.method == "wall" and "timing" not in graph.extra and graph.extra["launch"] == "graph"


def test_waterfall_part_has_stages_only_for_ops_the_model_holds() -> None:
    held = present_ops(AlphaFoldLite(TINY))
    rows = run_model_benchmark("cpu", parts=("waterfall",), budget_s=1e-9, **QUICK)
    assert [r.provider for r in rows] == ["eager", *(f"+{op}" for op in held), "+graph", "+compile"]
    assert "+LSTM" not in [r.provider for r in rows]
    assert all("budget" in r.extra["error"] for r in rows)
    assert [r.extra["stage"] for r in rows] == list(range(len(rows)))
    # Measured for real (a few stages): the eager ones in interleaved rounds, each on its own model.
    real = measure_waterfall(TINY, "cpu", "fp32", ops=["LayerNorm"], compile=False, rounds=(0, 2))
    assert [(r.provider, r.extra.get("timing")) for r in real] == [
        ("eager", "interleaved"),
        ("+LayerNorm", "interleaved"),
        ("+graph", None),
    ]
    assert all(r.method == "wall" and r.p50_ms > 0 and "error" not in r.extra for r in real)
    assert [r.n_reps for r in real] == [2, 2, 1] and "LayerNorm" in real[1].extra["swap"]
    assert math.isfinite(real[0].extra["loss"]) and "swap" not in real[0].extra


def test_reference_ops_on_cpu_runs_the_references(monkeypatch) -> None:
    import os

    pytest.importorskip("triton")
    from hfkit.ops import layer_norm, layer_norm_reference
    from hfkit.ops.layer_norm import uses_triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(3, 8)
    assert uses_triton(x, 8)
    with reference_ops_on_cpu():
        assert not uses_triton(x, 8)
        assert os.environ["TRITON_INTERPRET"] == "1"  # a context variable, not an environment rewrite
        assert torch.equal(layer_norm(x, (8,)), layer_norm_reference(x, (8,)))
    assert uses_triton(x, 8)
    with pytest.raises(RuntimeError, match="inside"), reference_ops_on_cpu():
        assert not uses_triton(x, 8)
        raise RuntimeError("inside")
    assert uses_triton(x, 8)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="parts"):
        run_model_benchmark("cpu", parts=("everything",), **QUICK)
    with pytest.raises(ValueError, match="shapes"):
        run_model_benchmark("cpu", parts=("block",), **{**QUICK, "shapes": [(3,)]})
    with pytest.raises(ValueError, match="precision"):
        run_model_benchmark("cpu", parts=("step",), step_dtype="fp8", **QUICK)
    with pytest.raises(ValueError, match="budget_s"):
        run_model_benchmark("cpu", parts=("step",), budget_s=0, **QUICK)
    assert set(PRECISIONS) == {"fp32", "bf16", "bf16_autocast"}


def test_cli_bench_model(tmp_path, capsys) -> None:
    out = tmp_path / "m.json"
    argv = ["bench", "model", "--profile", "smoke", "--device", "cpu", "--parts", "block"]
    argv += ["--variants", "eager", "--dtypes", "fp32", "--shapes", "3x5", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["command"].startswith("hfkit bench model --profile smoke")
    assert {r["mode"] for r in doc["rows"]} == {"fwd", "fwd+bwd"}
    assert "evoformer_block" in capsys.readouterr().out


def test_waterfall_frame_and_figures() -> None:
    pytest.importorskip("plotly")
    from hfkit.bench import rows_to_frame
    from hfkit.viz.model import model_time_bars, preset_config, stage_bars, waterfall_figure, waterfall_frame

    rows = run_model_benchmark("cpu", parts=("block",), variants=("eager",), dtypes=("fp32",), **QUICK)
    frame = rows_to_frame(rows)
    assert len(model_time_bars(frame, "evoformer_block").data) >= 1
    with pytest.raises(ValueError, match="no measured"):
        model_time_bars(frame, "train_step")
    # Waterfall rows made by hand: stage order from extra["stage"], deltas between stages.
    stages = []
    for stage, (label, ms) in enumerate([("eager", 10.0), ("+LayerNorm", 8.0), ("+compile", 5.0)]):
        row = rows[0].as_dict() | {"op": "step_waterfall", "provider": label, "p50_ms": ms}
        row |= {"p20_ms": ms - 1.0, "p80_ms": ms + 0.5 * (stage + 1)}
        stages.append(row | {"extra": {"stage": stage, "ops": ["LayerNorm"] if stage else []}})
    table = waterfall_frame(rows_to_frame(stages[::-1]))
    assert list(table["stage"]) == ["eager", "+LayerNorm", "+compile"]
    assert list(table["delta_ms"]) == [10.0, -2.0, -3.0]
    assert list(table["p20_ms"]) == [9.0, 7.0, 4.0] and list(table["p80_ms"]) == [10.5, 9.0, 6.5]
    fig = waterfall_figure(table)
    assert list(fig.data[0].measure) == ["absolute", "relative", "relative", "total"]
    # The bars' whiskers run from each stage's 20th to its 80th percentile.
    whiskers = stage_bars(table).data[0].error_y
    assert list(whiskers.array) == [0.5, 1.0, 1.5] and list(whiskers.arrayminus) == [1.0, 1.0, 1.0]
    assert preset_config("af2_initial", on_cpu=True).no_blocks == 1
    assert preset_config("af2_finetune", crop=64).crop_size == 64
    with pytest.raises(ValueError, match="preset"):
        preset_config("huge")
    with pytest.raises(ValueError, match="crop"):
        preset_config("tiny", crop=0)


def test_stack_launches_are_separate_configurations(tmp_path) -> None:
    out = tmp_path / "model.json"
    common = dict(parts=("stack",), variants=("eager",), checkpointing=(False,), out=out, **QUICK)
    rows = run_model_benchmark("cpu", stack_launch=("eager", "graph"), command="first", **common)
    assert [r.extra["launch"] for r in rows] == ["eager", "graph"]
    doc = json.loads(out.read_text())
    doc["meta"]["note"] = "how the first rows were made"
    out.write_text(json.dumps(doc))
    # Measuring one launch again replaces only its own row, and keeps the file's note and commands.
    run_model_benchmark("cpu", stack_launch=("graph",), append=True, command="second", **common)
    meta = json.loads(out.read_text())["meta"]
    assert meta["command"] == "second" and meta["earlier_commands"] == ["first"]
    assert meta["note"] == "how the first rows were made"
    saved = load_results(out)
    assert sorted(e["launch"] for e in saved["extra"]) == ["eager", "graph"]
    table = summary_table(saved)
    assert sorted(table["launch"]) == ["eager", "graph"]
    assert (table["vs eager"] == 1.0).all()  # each launch is compared with eager's own launch
    with pytest.raises(ValueError, match="stack_launch"):
        run_model_benchmark("cpu", parts=("stack",), stack_launch=("graphs",), **QUICK)


def test_step_launch_graph_runs_eagerly_on_cpu(tmp_path) -> None:
    # Without CUDA graphed_step runs the step eagerly: the same code path as on a GPU, launch "graph".
    out = tmp_path / "model.json"
    rows = run_model_benchmark(
        "cpu",
        parts=("step",),
        step_variants=("hfkit",),
        checkpointing=(True,),
        step_launch=("eager", "graph"),
        out=out,
        **QUICK,
    )
    assert [r.extra["launch"] for r in rows] == ["eager", "graph"]
    eager, graph = rows
    assert graph.op == "train_step" and graph.provider == "hfkit" and graph.method == "wall"
    assert "error" not in graph.extra, graph.extra
    assert graph.extra["capture"]["cuda_graph"] is False and graph.extra["capture"]["seconds"] >= 0
    assert graph.extra["first_call_s"] >= graph.extra["capture"]["seconds"]
    assert math.isfinite(graph.extra["loss"]) and graph.p50_ms > 0
    assert "phases_s" in eager.extra and "phases_s" not in graph.extra
    assert sorted(load_results(out)["extra"].apply(lambda e: e["launch"])) == ["eager", "graph"]
    out_graph = measure_train_step(TINY, "cpu", "fp32", "eager", reps=1, launch="graph")
    assert out_graph["notes"]["launch"] == "graph" and out_graph["phases_s"] == {}
    assert math.isfinite(out_graph["loss"])
    with pytest.raises(ValueError, match="launch"):
        measure_train_step(TINY, "cpu", "fp32", "eager", reps=1, launch="graphs")
    with pytest.raises(ValueError, match="step_launch"):
        run_model_benchmark("cpu", parts=("step",), step_launch=("cuda",), **QUICK)


def test_cli_bench_model_step_and_block_launch(tmp_path) -> None:
    out = tmp_path / "m.json"
    argv = ["bench", "model", "--profile", "smoke", "--device", "cpu", "--parts", "step", "--no-progress"]
    argv += [
        "--step-variants",
        "eager",
        "--checkpointing",
        "off",
        "--step-launch",
        "graph",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["op"], r["extra"]["launch"]) for r in rows] == [("train_step", "graph")]
    argv = ["bench", "model", "--profile", "smoke", "--device", "cpu", "--parts", "block", "--no-progress"]
    argv += ["--variants", "eager", "--dtypes", "fp32", "--shapes", "3x5", "--block-launch", "eager"]
    assert main([*argv, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["extra"]["launch"]) for r in rows] == [("fwd", "eager"), ("fwd+bwd", "eager")]


def test_block_launches_are_separate_configurations(tmp_path) -> None:
    out = tmp_path / "model.json"
    common = dict(parts=("block",), variants=("eager", "hfkit"), dtypes=("fp32",), out=out, **QUICK)
    rows = run_model_benchmark("cpu", block_launch=("graph", "eager"), **common)
    assert [(r.extra["launch"], r.provider) for r in rows if r.mode == "fwd"] == [
        ("graph", "eager"),
        ("graph", "hfkit"),
        ("eager", "eager"),
        ("eager", "hfkit"),
    ]
    assert all(r.method == "wall" and "error" not in r.extra for r in rows)
    run_model_benchmark("cpu", block_launch=("eager",), append=True, **common)
    saved = load_results(out)
    assert len(saved) == len(rows)  # the eager launch replaced its own rows only
    table = summary_table(saved)
    assert sorted(set(table["launch"])) == ["eager", "graph"]
    assert (table[table["variant"] == "eager"]["vs eager"] == 1.0).all()
    with pytest.raises(ValueError, match="block_launch"):
        run_model_benchmark("cpu", parts=("block",), block_launch=("python",), **QUICK)


@pytest.fixture(scope="module")
def openfold():
    from hfkit.bench.peers import load_openfold

    modules, reason = load_openfold()
    if modules is None:
        pytest.skip(reason)
    return modules


def test_openfold_variants_run_on_cpu(openfold) -> None:
    from hfkit.bench.model import OPENFOLD_VARIANTS

    common = dict(**{**QUICK, "shapes": [(3, 4)]}, dtypes=("fp32",), stack_dtypes=("fp32",))
    rows = run_model_benchmark(
        "cpu",
        parts=("block", "stack"),
        variants=OPENFOLD_VARIANTS,
        modes=("fwd+bwd",),
        block_launch=("graph",),
        checkpointing=(True,),
        **common,
    )
    assert [(r.op, r.provider) for r in rows] == [
        *(("evoformer_block", v) for v in OPENFOLD_VARIANTS),
        *(("evoformer_stack", v) for v in OPENFOLD_VARIANTS),
    ]
    for r in rows:
        assert r.method == "wall" and "error" not in r.extra, r.extra
        assert r.p50_ms > 0
    by = {(r.op, r.provider): r.extra for r in rows}
    assert by[("evoformer_block", "openfold_compile")]["compiled_blocks"] == 1
    assert by[("evoformer_stack", "openfold_compile")]["compiled_blocks"] == TINY.no_blocks
    assert "openfold.Attention" in by[("evoformer_block", "openfold_hfkit")]["swap"]
    assert "swap" not in by[("evoformer_block", "openfold")]
    # OpenFold's reentrant checkpointing (blocks_per_ckpt) takes gradients the way its training does.
    assert "backward" in by[("evoformer_stack", "openfold")]
    # OpenFold's blocks are graphed by class; on the CPU, and in a checkpointed stack, they run eagerly.
    assert by[("evoformer_block", "openfold_hfkit_graphed")]["graphed_blocks"] == 1
    assert list(by[("evoformer_block", "openfold_hfkit_graphed")]["graph_fallbacks"]) == [
        "a tensor argument is not on CUDA"
    ]
    stack = by[("evoformer_stack", "openfold_hfkit_graphed")]
    assert stack["graphed_blocks"] == TINY.no_blocks
    assert list(stack["graph_fallbacks"]) == ["checkpointing is on (EvoformerStack)"]


def test_compile_blocks_routes_openfold_blocks_with_their_keywords(openfold, seed) -> None:
    from hfkit.bench.peers import openfold_evoformer_stack, openfold_training_kwargs

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    config = TINY.replace(msa_dropout=0.0, pair_dropout=0.0)
    stack = openfold_evoformer_stack(openfold, config)
    with torch.no_grad():
        for p in stack.parameters():  # OpenFold zero-initialises its output projections
            p.copy_(torch.randn_like(p) * 0.3)
    m = torch.randn(1, 3, 4, config.c_m, requires_grad=True)
    z = torch.randn(1, 4, 4, config.c_z, requires_grad=True)
    args = (m, z, torch.ones(1, 3, 4), torch.ones(1, 4, 4))
    expected = stack(*args, **openfold_training_kwargs(config))
    blocks = (openfold.evoformer.EvoformerBlock,)
    assert compile_blocks(stack, backend=counting_backend, blocks=blocks) == config.no_blocks
    assert compile_blocks(stack, backend=counting_backend) == 0  # not hfkit's block class
    got = stack(*args, **openfold_training_kwargs(config))
    assert len(graphs) == 1
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_openfold_variants_without_openfold_become_skipped_rows(monkeypatch) -> None:
    import hfkit.bench.model as bench_model

    monkeypatch.setattr(bench_model, "load_openfold", lambda peers_dir=None: (None, "no OpenFold here"))
    rows = run_model_benchmark(
        "cpu",
        parts=("block", "stack"),
        variants=("eager", "openfold", "openfold_hfkit"),
        dtypes=("fp32",),
        stack_dtypes=("fp32",),
        modes=("fwd",),
        block_launch=("eager",),
        checkpointing=(False,),
        **QUICK,
    )
    assert [(r.op, r.provider) for r in rows] == [
        (op, v)
        for op in ("evoformer_block", "evoformer_stack")
        for v in ("eager", "openfold", "openfold_hfkit")
    ]
    for r in rows:
        if r.provider == "eager":
            assert r.method == "wall" and "error" not in r.extra
        else:
            assert r.method == "error" and math.isnan(r.p50_ms)
            assert r.extra["error"] == "skipped: no OpenFold here"
            assert r.extra["launch"] == "eager" and r.extra["params_dtype"] == "float32"


def test_make_variant_hfkit_graphed_swaps_then_graphs_the_blocks(seed) -> None:
    from hfkit.nn import GraphedForward, graphed_forwards

    block = make_block(TINY)
    graphed, notes = make_variant(block, "hfkit_graphed")
    assert "forward" not in block.__dict__  # the copy was graphed
    assert isinstance(graphed.__dict__["forward"], GraphedForward) and notes["graphed_blocks"] == 1
    assert "swapped" in notes["swap"] and type(graphed.msa_att_row.layer_norm_m) is not torch.nn.LayerNorm
    stack, notes = make_variant(EvoformerStack.from_config(TINY), "hfkit_graphed", inplace=True)
    assert [f.module for f in graphed_forwards(stack)] == list(stack.blocks)
    assert notes["graphed_blocks"] == TINY.no_blocks


def test_graphed_variant_rows_run_on_cpu_and_say_why_blocks_ran_eagerly() -> None:
    rows = run_model_benchmark(
        "cpu",
        parts=("block", "stack"),
        variants=("hfkit", "hfkit_graphed"),
        dtypes=("fp32",),
        stack_dtypes=("fp32",),
        modes=("fwd+bwd",),
        block_launch=("eager",),
        checkpointing=(True,),
        **QUICK,
    )
    by = {(r.op, r.provider): r for r in rows}
    assert sorted(by) == sorted(
        (op, v) for op in ("evoformer_block", "evoformer_stack") for v in ("hfkit", "hfkit_graphed")
    )
    for r in rows:
        assert "error" not in r.extra and r.p50_ms > 0, r.extra
    block = by[("evoformer_block", "hfkit_graphed")].extra
    assert block["graphed_blocks"] == 1 and block["graph_captures"] == 0
    assert list(block["graph_fallbacks"]) == ["a tensor argument is not on CUDA"]  # no CUDA here
    stack = by[("evoformer_stack", "hfkit_graphed")].extra
    assert stack["graphed_blocks"] == TINY.no_blocks and stack["graph_captures"] == 0
    assert list(stack["graph_fallbacks"]) == ["checkpointing is on (EvoformerStack)"]
    assert stack["swap"] == by[("evoformer_stack", "hfkit")].extra["swap"]
    assert "graph_fallbacks" not in by[("evoformer_stack", "hfkit")].extra
