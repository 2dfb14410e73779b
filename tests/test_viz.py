"""Tests of `hfkit.viz`'s notebook support: `setup_notebook` (profile, device, renderer, no environment
writes), the report renderer and plotly.js loader, the static-then-widget display of every panel,
and the functions the notebooks call instead of holding logic in their cells."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pandas as pd
import pytest
import torch

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

import plotly.graph_objects as go  # noqa: E402
import plotly.io as pio  # noqa: E402

from hfkit.bench.results import ResultRow, rows_to_frame  # noqa: E402
from hfkit.viz import notebook  # noqa: E402
from hfkit.viz.notebook import (  # noqa: E402
    REPORT_RENDERER,
    NotebookResults,
    plotly_js_path,
    plotly_loader_html,
    render_into,
    resolve_profile,
    setup_notebook,
    show_static_then_widget,
)

RESULTS = Path(__file__).resolve().parents[1] / "data" / "results"
CPU = torch.device("cpu")
ENV = {
    "gpu": "test",
    "torch": "x",
    "triton": None,
    "python": "3",
    "commit": None,
    "command": "t",
    "timestamp": "t",
}


def result_row(
    op: str, provider: str, shape: list[int], p50: float, peak: int | None = None, **extra
) -> ResultRow:
    """A measured fwd+bwd row of `op` in bf16."""
    return ResultRow(
        **ENV, op=op, provider=provider, mode="fwd+bwd", shape=shape, dtype="bf16", p20_ms=p50, p50_ms=p50,
        p80_ms=p50, method="cuda_graph", n_reps=1, bytes=1, gbps=1.0, pct_copy=90.0, peak_mem_bytes=peak,
        extra=extra,
    )  # fmt: skip


@pytest.fixture
def displayed(monkeypatch):
    """What `IPython.display.display` was given, in order (nothing is drawn)."""
    import IPython.display

    shown: list = []
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **_: shown.extend(objs))
    return shown


@pytest.fixture
def keep_renderer():
    default = pio.renderers.default
    yield
    pio.renderers.default = default


# --- setup_notebook ---------------------------------------------------------------------------------


def test_resolve_profile_defaults_env_and_errors(monkeypatch):
    monkeypatch.delenv("HFKIT_PROFILE", raising=False)
    assert resolve_profile(None, has_gpu=False) == "smoke"
    assert resolve_profile(None, has_gpu=True) == "full"
    monkeypatch.setenv("HFKIT_PROFILE", "full")
    assert resolve_profile(None, has_gpu=False) == "full"
    assert resolve_profile("smoke", has_gpu=True) == "smoke"  # an argument beats the environment
    monkeypatch.setenv("HFKIT_PROFILE", "fast")
    with pytest.raises(ValueError, match=r"HFKIT_PROFILE: expected one of \('smoke', 'full'\), got 'fast'"):
        resolve_profile(None, has_gpu=False)
    with pytest.raises(ValueError, match="profile: expected"):
        resolve_profile("big", has_gpu=False)


def test_setup_notebook_reads_but_never_writes_the_environment(monkeypatch, capsys, displayed, keep_renderer):
    monkeypatch.setenv("HFKIT_PROFILE", "smoke")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    before = dict(os.environ)
    settings = setup_notebook()
    assert dict(os.environ) == before
    assert settings.profile == "smoke" and settings.smoke
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else CPU
    assert settings.device == expected and settings.has_gpu == (expected.type == "cuda")
    assert settings.triton_interpret is False
    assert {"hfkit", "torch", "plotly", "python"} <= set(settings.versions)
    out = capsys.readouterr().out
    assert "profile: smoke" in out and f"torch {torch.__version__}" in out
    if not settings.has_gpu:
        assert "plain-torch references" in out and settings.where.endswith(
            "CPU times, small sizes (smoke profile)"
        )
    assert pio.renderers.default == REPORT_RENDERER
    assert len(displayed) == 1 and 'src="plotly.min.js"' in displayed[0].data  # the loader, once


def test_setup_notebook_reports_the_interpreter_from_the_environment(monkeypatch, keep_renderer):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    settings = setup_notebook(profile="full", show=False)
    assert settings.profile == "full" and settings.triton_interpret
    if not settings.has_gpu:
        assert "TRITON_INTERPRET=1" in settings.summary()


# --- the report renderer -------------------------------------------------------------------------------


def test_report_renderer_emits_the_plotly_mime_and_html_without_plotly_js(keep_renderer):
    notebook.use_report_renderer()
    fig = go.Figure(go.Bar(x=["a", "b"], y=[1, 2]))
    bundle = pio.renderers._build_mime_bundle(fig.to_dict())
    assert set(bundle) == {"application/vnd.plotly.v1+json", "text/html"}
    assert bundle["application/vnd.plotly.v1+json"]["data"][0]["y"] == [1, 2]
    html = bundle["text/html"]
    assert "Plotly.newPlot" in html and len(html) < 50_000  # the figure only: plotly.js is 4.8 MB
    assert "<script" in plotly_loader_html() and 'src="plotly.min.js"' in plotly_loader_html()


def test_plotly_js_is_the_bundle_shipped_with_plotly():
    path = plotly_js_path()
    assert path.name == "plotly.min.js" and path.stat().st_size > 1_000_000


# --- panels: static outputs first, widget last; outputs set without capture --------------------------


def test_render_into_sets_outputs_without_capturing(displayed, keep_renderer):
    import ipywidgets as widgets

    notebook.use_report_renderer()  # what setup_notebook does first in every notebook
    out = widgets.Output()
    fig = go.Figure(go.Bar(y=[3]))
    render_into(out, "hello", pd.DataFrame({"a": [1]}), fig)
    kinds = [o["output_type"] for o in out.outputs]
    assert kinds == ["stream", "display_data", "display_data"]
    assert out.outputs[0]["text"] == "hello\n" and "text/html" in out.outputs[1]["data"]
    # the figure is in the widget, not displayed into the cell
    assert out.outputs[2]["data"]["application/vnd.plotly.v1+json"]["data"][0]["y"] == [3]
    assert displayed == []
    assert out.msg_id == ""  # never captured: a headless executor gets nothing to send back
    render_into(out, "again")
    assert len(out.outputs) == 1


def test_show_static_then_widget_orders_and_skips_none(displayed, capsys):
    table, widget = pd.DataFrame({"a": [1]}), object()
    show_static_then_widget(widget, table, None, "a line")
    assert displayed == [table, widget] and capsys.readouterr().out == "a line\n"


def test_notebook_results_failed_rows():
    frame = pd.DataFrame({"op": ["x", "y"], "provider": ["a", "b"], "error": [None, "OOM"]})
    assert NotebookResults(frame, "label").failed["error"].tolist() == ["OOM"]
    assert NotebookResults(None, None, ["no results"]).failed is None


def test_layernorm_explorer_shows_its_result_before_the_widget(displayed):
    from hfkit.viz import layernorm_explorer

    explorer = layernorm_explorer("cpu", providers=("eager",))
    explorer.dtype.value = "fp32"
    table = explorer.run()
    assert explorer.output.outputs == ()  # run() computes; it draws into the widget on a click only
    explorer.show()
    assert displayed[0] is table and isinstance(displayed[1], go.Figure) and displayed[2] is explorer.widget


def _kernel_rows() -> list[ResultRow]:
    return [
        result_row("triangle_attention", provider, [1, n, 4, n, 32], ms, 2**20 * n)
        for n in (256, 512)
        for provider, ms in (("hfkit", 1.0), ("trifast", 2.0))
    ]


def test_kernel_explorer_shows_the_first_case_before_the_widget(displayed):
    from hfkit.bench.kernels import kernel_frame
    from hfkit.viz import kernel_explorer

    explorer = kernel_explorer(kernel_frame(_kernel_rows()))
    assert len(explorer.output.outputs) == 2  # table and chart, set as the widget's state
    explorer.show()
    assert isinstance(displayed[0], pd.DataFrame) and set(displayed[0]["provider"]) == {"hfkit", "trifast"}
    assert isinstance(displayed[1], go.Figure) and displayed[2] is explorer.widget


def test_cost_model_panel_shows_the_first_preset_before_the_widget(displayed):
    from hfkit.viz.comms import CostModelPanel, panel_figure

    panel = CostModelPanel()
    panel.show()
    table, fig, widget = displayed
    assert list(table["backend"]) == ["nccl", "hfreduce"] and (table["gpus"] == 128).all()
    assert [t.name for t in fig.data] == ["nccl", "hfreduce"]
    assert widget.children[-1].outputs  # the panel's own output area holds the same result
    assert "372.8 MB" in panel_figure(table).layout.title.text


def test_data_cost_explorer_show_runs_once_then_shows_the_widget(displayed, monkeypatch):
    from hfkit.viz.data_cost import DataCostExplorer

    explorer = DataCostExplorer()
    calls = []

    def fake_run(crop, depth, workers, ranks):
        calls.append((crop, depth, workers, ranks))
        return pd.DataFrame({"crop": [crop]})

    monkeypatch.setattr(explorer, "run", fake_run)
    table = explorer.show(64, 1000, 0, 8)
    assert calls == [(64, 1000, 0, 8)] and displayed[0] is table
    assert type(displayed[1]).__name__ == "VBox"


def _profile_result() -> dict:
    ops = pd.DataFrame({"name": ["aten::mm", "aten::add_"], "calls": [2, 3], "time_ms": [2.0, 1.0]})
    ops["share_pct"] = [66.7, 33.3]
    ops.attrs["device_time"] = "cpu"
    census = pd.DataFrame({"shape": [(1, 8, 8, 16)], "calls": [4], "calls_pct": [100.0], "time_pct": [100.0]})
    speed = pd.DataFrame({"shape": [(1, 8, 8, 16)], "torch_ms": [0.2], "hfkit_ms": [0.1], "speedup": [2.0]})
    return {"ops": ops, "census": census, "speed": speed, "step_ms": 3.0}


def test_profile_explorer_shows_a_given_result_before_the_widget(displayed, capsys):
    from hfkit.viz.model import ProfileExplorer

    explorer = ProfileExplorer("cpu", result=_profile_result(), label="tiny on CPU")
    explorer.show()
    assert "tiny on CPU: 3.0 ms of operator time per step" in capsys.readouterr().out
    assert [type(o).__name__ for o in displayed] == ["DataFrame", "Figure", "DataFrame", "Figure", "VBox"]
    assert ProfileExplorer("cpu").result_outputs() == []  # nothing to show before a first result


def test_layernorm_results_on_a_cpu_load_the_committed_results_or_say_how_to_make_them():
    from hfkit.viz.figures import layernorm_results

    shown = layernorm_results(CPU, smoke=True)
    if (RESULTS / "h200" / "layer_norm.json").exists():
        assert len(shown.frame) > 0 and set(shown.frame["op"]) == {"layer_norm"}
        assert "H200" in shown.label and "commit" in shown.notes[0]
    else:
        assert shown.frame is None and "hfkit bench layer_norm" in shown.notes[0]


def test_committed_kernels_and_kernel_results(tmp_path):
    from hfkit.viz.kernels import committed_kernels, kernel_results

    empty = committed_kernels(tmp_path)
    assert empty.frame is None and empty.label is None and "hfkit bench evoformer_attention" in empty.notes[0]
    if not (RESULTS / "h200" / "evoformer_attention.json").exists():
        pytest.skip("no committed H200 kernel results")
    shown = kernel_results(CPU, smoke=True, source="h200")
    assert {"triangle_attention", "softmax"} <= set(shown.frame["op"])
    assert shown.label.startswith("measured on ") and any("attention" in n for n in shown.notes)


def test_goal_sentences_say_how_many_cases_reach_each_target():
    goals = pd.DataFrame(
        {
            "goal": ["speed-up", "speed-up", "speed-up", "softmax %", "memory"],
            "case": ["N=256", "N=512", "N=1024", "S=1", "N=256"],
            "measured": [2.5, 1.5, 3.5, 1234.5, math.nan],
            "target": [2.0, 2.0, 3.0, 80.0, 1.0],
            "met": [True, False, True, True, None],
        }
    )
    assert goal_sentences_of(goals) == [
        "speed-up: reached in 2 of 3 cases "
        "(N=256: 2.5 against 2; N=512: 1.5 against 2; N=1024: 3.5 against 3).",
        "softmax %: reached in 1 of 1 case (S=1: 1,234 against 80).",
        "memory: not measured in these results.",
    ]


def goal_sentences_of(goals: pd.DataFrame) -> list[str]:
    from hfkit.viz.kernels import goal_sentences

    return goal_sentences(goals)


# --- notebook 02: comms ------------------------------------------------------------------------------


def test_run_comms_here_picks_the_profile_sizes(monkeypatch):
    import hfkit.bench.comms as comms
    from hfkit.viz.comms import run_comms_here

    seen = []
    monkeypatch.setattr(comms, "run_comms_benchmark", lambda **kw: seen.append(kw) or [])
    run_comms_here(smoke=True, gpu_count=0)
    run_comms_here(smoke=False, gpu_count=4)
    assert seen[0]["nproc"] == 2 and seen[0]["max_bytes"] == "1M" and seen[0]["cpu"] is True
    assert seen[1]["nproc"] == 4 and "max_bytes" not in seen[1]


def test_committed_comms_calibration_and_h200_fits(tmp_path):
    from hfkit.bench.results import results_dir
    from hfkit.parallel.cost_model import bound_comparison
    from hfkit.viz.comms import (
        allreduce_frame,
        calibration_table,
        committed_comms,
        fit_committed_h200,
        model_fit_figure,
    )

    assert committed_comms(tmp_path) == {} and fit_committed_h200(tmp_path) == []
    assert list(calibration_table({}).columns) == [
        "source",
        "backend",
        "ranks",
        "alpha_us",
        "bw_gbps",
        "rel_rms",
    ]
    sources = committed_comms()
    for ranks in (2, 4):  # the hfreduce runs on one shared H200, with their bounds (notebook 02)
        if (results_dir() / "h200" / f"comms_shared{ranks}.json").exists():
            frame = sources[f"one H200 shared by {ranks} ranks"]
            assert not bound_comparison(allreduce_frame(frame)).empty
    if "CPU, committed" not in sources:
        pytest.skip("no committed CPU comms results")
    table = calibration_table(sources)
    cpu = table[table["source"] == "CPU, committed"]
    assert set(cpu["backend"]) >= {"gloo", "hfreduce"} and (cpu["bw_gbps"] > 0).all()
    fits = fit_committed_h200()
    if not fits:
        pytest.skip("no committed H200 comms results")
    fit = fits[0]
    assert list(fit.comparison.columns) == [
        "backend",
        "nbytes",
        "measured_ms",
        "spec_model_ms",
        "fitted_model_ms",
    ]
    assert fit.fitted_values()["chunk_overhead_us"] > 0 and set(fit.at_scale["gpus"]) == {128}
    assert len(model_fit_figure(fit.comparison).data) == 2 * 3  # 2 backends x (measured, spec, fitted)


# --- notebooks 03 and 05: model -------------------------------------------------------------------------


def test_reference_ops_and_census_unpack_the_extra_dicts():
    from hfkit.viz.model import census_timings, reference_census, reference_ops

    common = {"gpu": "NVIDIA H200", "command": "hfkit bench model", "commit": "abc"}
    ops = pd.DataFrame(
        {
            "provider": ["aten::mm", "broken"],
            "method": ["profile", "failed"],
            "p50_ms": [2.0, math.nan],
            "extra": [{"calls": 4, "share_pct": 40.0}, {}],
            **{k: [v, v] for k, v in common.items()},
        }
    )
    table = reference_ops(ops)
    assert table.to_dict("records") == [{"name": "aten::mm", "calls": 4, "time_ms": 2.0, "share_pct": 40.0}]
    assert "NVIDIA H200" in table.attrs["label"] and "abc" in table.attrs["label"]
    assert reference_ops(None) is None and reference_ops(ops.iloc[1:]) is None
    census = pd.DataFrame(
        {
            "shape": [[1, 256, 256, 128], [1, 132, 256, 256]],
            "extra": [{"calls": 60, "calls_pct": 60.0, "torch_ms": 0.3, "hfkit_ms": 0.1}, {"calls": 40}],
        }
    )
    table = reference_census(census)
    assert table["shape"].tolist() == [(1, 256, 256, 128), (1, 132, 256, 256)]
    assert table["calls"].tolist() == [60, 40] and table["time_pct"].isna().all()
    assert census_timings(table)["shape"].tolist() == [(1, 256, 256, 128)]
    assert census_timings(table.assign(torch_ms=None)) is None and reference_census(None) is None


def test_saved_activation_table_and_figure():
    from hfkit.viz.model import saved_activation_figure, saved_activation_table

    memory = saved_activation_table(CPU, quick=True)
    assert list(memory.columns) == ["eager", "hfkit"] and (memory.sum() > 0).all()
    assert memory["eager"].is_monotonic_decreasing and memory.attrs["inputs"] == "4x8, float32"
    assert {t.name for t in saved_activation_figure(memory).data} == {"eager", "hfkit"}


# --- notebook 05: batches of the real data pipeline ----------------------------------------------------


def test_deepen_msa_appends_mutated_copies_of_real_rows_and_keeps_the_real_ones():
    import numpy as np

    from hfkit.viz.batches import deepen_msa

    msa = np.array([[0, 1, 2, 21, 4], [5, 6, 21, 8, 9], [10, 11, 12, 13, 21]], dtype=np.int8)
    deletions = np.arange(15, dtype=np.uint8).reshape(3, 5)
    raw = {"msa": msa, "deletion_matrix": deletions, "num_alignments": np.asarray(3, dtype=np.int32)}
    copies = deepen_msa(raw, 40, mutation_rate=0.0, seed=1)
    assert copies["msa"].shape == (40, 5) and copies["msa"].dtype == np.int8
    assert (copies["msa"][:3] == msa).all() and (copies["deletion_matrix"][:3] == deletions).all()
    source = [int(np.flatnonzero((msa == row).all(1))[0]) for row in copies["msa"][3:]]  # exact copies
    assert (copies["deletion_matrix"][3:] == deletions[source]).all() and len(set(source)) == 3
    assert int(copies["num_alignments"]) == 40 and copies["num_alignments"].dtype == np.int32
    np.testing.assert_allclose(copies["hhblits_profile"].sum(-1), 1.0, rtol=1e-6)
    mutated = deepen_msa(raw, 4000, mutation_rate=0.5, seed=1)["msa"][3:]
    gaps = mutated == 21
    assert (gaps.sum(0) > 0).sum() == 3  # gaps stay where the copied rows have them, nowhere else
    changed = [(mutated[:, c] != np.bincount(mutated[:, c]).argmax()).mean() for c in range(5)]
    assert 0.3 < float(np.mean(changed)) < 0.8 and mutated.max() < 22
    assert (deepen_msa(raw, 4000, 0.5, seed=1)["msa"][3:] == mutated).all()  # seeded
    assert deepen_msa(raw, 3)["msa"] is msa and deepen_msa(raw, 2)["msa"] is msa  # deep enough already
    with pytest.raises(ValueError, match="depth: expected >= 1"):
        deepen_msa(raw, 0)
    with pytest.raises(ValueError, match=r"mutation_rate: expected a probability in \[0, 1\], got 1.5"):
        deepen_msa(raw, 5, mutation_rate=1.5)


def test_sample_msa_depth_covers_block_deletion():
    from dataclasses import replace

    from hfkit.data.msa_sampling import FeatureConfig
    from hfkit.model import ModelConfig
    from hfkit.viz.batches import sample_msa_depth

    assert sample_msa_depth(ModelConfig.tiny()) == math.ceil(24 / 0.7**5) == 143
    assert sample_msa_depth(replace(FeatureConfig.tiny(), block_delete_msa=False)) == 24
    assert sample_msa_depth(ModelConfig.af2_initial()) == math.ceil(1152 / 0.7**5)


def _contains_window(chain: torch.Tensor, window: torch.Tensor) -> bool:
    n = window.shape[0]
    return any(torch.equal(chain[s : s + n], window) for s in range(chain.shape[0] - n + 1))


def test_pipeline_batches_of_the_real_chains_fit_the_graphed_step(tmp_path, one_thread):
    from conftest import real_data

    from hfkit.model import AlphaFoldLite, ModelConfig
    from hfkit.train import graphed_step, make_optimizer, synthetic_batch
    from hfkit.viz.batches import PipelineBatches

    real = real_data("alignments").parent
    config = ModelConfig.tiny()
    with PipelineBatches.open(real, work_dir=tmp_path) as source:
        assert not source.synthetic and str(real) in source.label
        chains = source.chains(config)
        assert (chains["msa rows (real)"] < 24).all() and (chains["msa rows (deepened)"] == 143).all()
        batch = source.batch(config)
        torch.manual_seed(0)
        model = AlphaFoldLite(config)
        step = graphed_step(model, make_optimizer(model), synthetic_batch(config))
        step.check_batch(batch)  # the example batch's features, shapes and dtypes
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
            k: (v.shape, v.dtype) for k, v in synthetic_batch(config).items()
        }
        chain = torch.as_tensor(source.dataset(config).raw_features(0)["aatype"]).long()
        n = int(batch["seq_length"][0])
        assert n == config.crop_size < chain.shape[0]  # cropped from the real chain
        assert _contains_window(chain, batch["aatype"][0, :n])
        assert batch["extra_msa_mask"][0].amax(-1).sum() == config.max_extra_msa  # deepened: rows full
        stream = source.stream(config)
        losses = [float(step(next(stream))) for _ in range(2)]
        assert all(math.isfinite(x) for x in losses)
        assert Path(source.inputs.records).is_dir()
    assert not Path(source.inputs.records).exists()  # the temporary records are gone


def test_pipeline_batches_fall_back_to_synthetic_chains_and_say_so(tmp_path, capsys, one_thread):
    from hfkit.model import ModelConfig
    from hfkit.train import synthetic_batch
    from hfkit.viz.batches import PipelineBatches

    config = ModelConfig.tiny().replace(crop_size=40)
    with PipelineBatches.open(tmp_path / "absent", work_dir=tmp_path) as source:
        assert source.synthetic and "synthetic" in source.label
        note = capsys.readouterr().out
        assert f"not found (looked in {tmp_path / 'absent'})" in note and "synthetic chains" in note
        batch = next(source.stream(config))
        assert {k: v.shape for k, v in batch.items()} == {
            k: v.shape for k, v in synthetic_batch(config).items()
        }
        with pytest.raises(ValueError, match="batch_size: expected at most 2"):
            source.stream(config, batch_size=3)


def test_measure_train_step_steps_on_the_given_batch(tmp_path, one_thread):
    from hfkit.bench.model import measure_train_step
    from hfkit.model import AlphaFoldLite, ModelConfig
    from hfkit.train import make_optimizer, synthetic_batch, train_step

    config = ModelConfig.tiny()
    batch = synthetic_batch(config, seed=7)
    out = measure_train_step(config, CPU, "fp32", "eager", batch=batch, warmup=0, reps=1)
    torch.manual_seed(0)  # measure_train_step's seed: the same model, two steps on the same batch
    model = AlphaFoldLite(config)
    optimizer = make_optimizer(model)
    losses = [train_step(model, batch, optimizer, clip=0.1)["loss"] for _ in range(2)]
    assert out["loss"] == pytest.approx(losses[-1], rel=1e-6)
    other = measure_train_step(config, CPU, "fp32", "eager", warmup=0, reps=1)  # its own synthetic batch
    assert other["loss"] != pytest.approx(out["loss"], rel=1e-6)


def test_batch_waterfall_measures_every_stage_on_the_batch_and_keeps_failures(monkeypatch):
    import hfkit.bench.model as bench_model
    from hfkit.model import AlphaFoldLite, ModelConfig
    from hfkit.viz.model import batch_waterfall, stage_bars, waterfall_figure

    batch = {"aatype": torch.zeros(1, 4, dtype=torch.int64)}
    calls = []

    def fake(config, device, precision, variant, ops, backend, compile_mode, *args, launch, batch, **kwargs):
        calls.append({"variant": variant, "ops": ops, "launch": launch, "backend": backend, "batch": batch})
        if variant == "compile_hfkit":
            raise RuntimeError("compile failed")
        return bench_model.Steps(lambda: None, lambda: None, 1, lambda: {}, None)

    monkeypatch.setattr(bench_model, "_train_steps", fake)
    config = ModelConfig.tiny()
    with pytest.warns(RuntimeWarning, match="compile failed"):
        table = batch_waterfall(config, CPU, "fp32", batch, progress=False)
    # The stages of the ops the model holds (the bench's), each built once, in stage order.
    stages = bench_model.waterfall_stages(bench_model.present_ops(AlphaFoldLite(config)))
    assert "+LSTM" not in table["stage"].tolist()
    assert table["stage"].tolist() == [label for label, *_ in stages]
    assert table["launch"].tolist() == [launch for *_, launch in stages]
    assert [c["variant"] for c in calls] == [variant for _, variant, _, _ in stages]
    assert [c["ops"] for c in calls] == [ops for _, _, ops, _ in stages]
    assert all(c["batch"] is batch and c["backend"] == "eager" for c in calls)
    measured = table.iloc[:-1]
    assert (measured["step_ms"] > 0).all() and (measured["first call s"] >= 0).all()
    deltas = measured["step_ms"].diff().fillna(measured["step_ms"])
    assert measured["delta_ms"].tolist() == pytest.approx(deltas.tolist())
    assert math.isnan(table["step_ms"].iloc[-1]) and "compile failed" in table["error"].iloc[-1]
    assert table["peak_GiB"].isna().all()  # measured on CUDA only
    fig = stage_bars(table.assign(peak_GiB=1.0))
    assert len(fig.data) == 2 and list(fig.data[0].x) == table["stage"].tolist()
    colors = list(fig.data[0].marker.color)
    assert colors[0] == "#7f7f7f" and colors[-2] == "#2ca02c"  # launched from Python, graphed
    assert len(stage_bars(table).data) == 1  # no memory measured: no panel
    assert list(waterfall_figure(table).data[0].x)[-2] == "+graph"  # the failed stage is left out


def test_step_launch_explorer_times_eager_and_graphed_steps_on_pipeline_batches(displayed, one_thread):
    from types import SimpleNamespace

    from hfkit.train import synthetic_batch
    from hfkit.viz.model import StepLaunchExplorer

    asked = []
    batches = SimpleNamespace(
        label="test batches", batch=lambda config: asked.append(config) or synthetic_batch(config)
    )
    explorer = StepLaunchExplorer(batches, CPU, preset="tiny")
    assert explorer.result_outputs() == [] and explorer.precision.value == "fp32"
    explorer.run()
    explorer.crop.value, explorer.checkpoint.value = 20, True
    table = explorer.run()
    assert [(c.crop_size, c.checkpoint) for c in asked] == [(32, False), (20, True)]
    assert table["launch"].tolist() == ["eager", "graph"] * 2 and table["run"].tolist() == [1, 1, 2, 2]
    assert table["crop"].tolist() == [32, 32, 20, 20] and (table["step_ms"] > 0).all()
    assert (table["error"] == "").all()
    fig = explorer.figure()
    assert {t.name for t in fig.data} == {"eager", "graph"} and len(fig.data[0].x) == 2
    explorer.show()
    assert len(displayed[0]) == 4 and displayed[2] is explorer.widget


def test_openfold_stack_here_says_why_it_skips_and_runs_the_peers_on_a_gpu(monkeypatch, capsys):
    import hfkit.bench.model as bench_model
    import hfkit.bench.peers as peers
    from hfkit.viz.model import openfold_stack_here

    assert openfold_stack_here(CPU, full=False) is None
    assert "skipped: needs a CUDA GPU" in capsys.readouterr().out
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(peers, "load_openfold", lambda: (None, "OpenFold's source not found"))
    assert openfold_stack_here(gpu, full=True) is None
    assert "skipped: OpenFold's source not found" in capsys.readouterr().out
    monkeypatch.setattr(peers, "load_openfold", lambda: (object(), None))
    seen = {}

    def fake(device, **kwargs):
        seen.update(kwargs, device=device)
        return [result_row("evoformer_stack", "openfold", [128, 256], 10.0, launch="graph")]

    monkeypatch.setattr(bench_model, "run_model_benchmark", fake)
    frame = openfold_stack_here(gpu, full=True)
    assert frame["provider"].tolist() == ["openfold"] and seen["device"] == gpu
    assert seen["variants"] == (
        "eager",
        "hfkit",
        "compile_hfkit",
        "openfold",
        "openfold_compile",
        "openfold_hfkit",
    )
    assert set(seen["variants"]) <= set(bench_model.MODULE_VARIANTS)
    assert "openfold" in seen["variants"] and not seen["quick"]
    assert seen["parts"] == ("stack",) and seen["stack_launch"] == ("eager", "graph")


def test_committed_model_outputs_show_whichever_rows_exist():
    from hfkit.viz.model import committed_model_outputs

    steps = [
        result_row("train_step", "eager", [128, 256], 2000.0, 2**33, checkpointing=True),
        result_row("train_step", "hfkit", [128, 256], 500.0, 2**32, checkpointing=True, launch="graph"),
    ]
    stages = [
        result_row("step_waterfall", "eager", [128, 256], 2000.0, 2**33, stage=0, ops=[]),
        result_row(
            "step_waterfall", "+graph", [128, 256], 600.0, 2**32, stage=1, ops=["LayerNorm"], launch="graph"
        ),
        result_row("step_waterfall", "+compile", [128, 256], math.nan, None, stage=2, error="compile failed"),
    ]
    census = [result_row("layer_norm_census", "aten::layer_norm", [1, 8], 1.0)]
    outputs = committed_model_outputs(rows_to_frame(steps + stages + census))
    assert [type(o).__name__ for o in outputs] == ["str", "DataFrame", "Figure", "Figure", "Figure"]
    assert outputs[0].startswith("reference results: test") and "layer_norm_census" not in set(
        outputs[1]["op"]
    )
    assert set(outputs[1]["op"]) == {"train_step", "step_waterfall"}
    assert list(outputs[-1].data[0].x) == ["eager", "+graph", "final"]  # the failed stage left out
    assert "train_step" in outputs[2].layout.title.text and "per stage" in outputs[3].layout.title.text
    only_failed = committed_model_outputs(rows_to_frame(stages[2:] + census))
    assert [type(o).__name__ for o in only_failed] == ["str", "DataFrame"]  # a table, no figure of nothing
    assert committed_model_outputs(rows_to_frame(census)) == [] and committed_model_outputs(None) == []


# --- notebook 01: data cost -----------------------------------------------------------------------------


def test_missing_real_inputs_note_names_the_variable_and_the_source():
    from hfkit.viz.data_cost import missing_real_inputs_note

    note = missing_real_inputs_note()
    assert "HFKIT_OPENFOLD_TEST_DATA" in note and "aqlaboratory/openfold" in note and "skipped" in note


def test_real_sample_times_both_paths(tmp_path, one_thread):
    from conftest import real_data

    from hfkit.data.msa_sampling import FeatureConfig
    from hfkit.viz.data_cost import real_sample_times

    real = real_data("alignments")
    times, shapes = real_sample_times(real.parent, tmp_path, FeatureConfig.tiny(), repeats=1)
    assert set(times["path"]) == {"on the fly", "preprocessed"} and (times["total"] > 0).all()
    assert set(shapes) == {"msa_feat", "extra_msa", "target_feat", "seq_mask"}


def test_data_cost_helpers(tmp_path, monkeypatch):
    import hfkit.bench.data_cost as data_cost
    from hfkit.viz.data_cost import committed_data_cost, run_data_cost_here, sync_wait_here

    seen = []
    monkeypatch.setattr(data_cost, "run_data_cost_benchmark", lambda **kw: seen.append(kw) or [])
    run_data_cost_here(smoke=True)
    assert seen[0]["depths"] == (200, 1000) and seen[0]["length"] == 96
    assert committed_data_cost(tmp_path) is None
    if (RESULTS / "cpu" / "data_cost.json").exists():
        assert len(committed_data_cost()) > 0
    table = sync_wait_here(crops=(256,), smoke=True)
    assert set(table["ranks"]) == {1, 2, 4, 8, 16, 32, 64, 128, 256} and "wasted_fraction" in table


def test_frames_of_rows_keep_the_schema():
    # The fake rows above go through the same frame as real ones.
    frame = rows_to_frame(_kernel_rows())
    assert len(frame) == 4 and set(frame["provider"]) == {"hfkit", "trifast"}


# --- make report's notebook runner ---------------------------------------------------------------------


def _write_notebook(path: Path, *sources: str) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# t")])
    nb.cells += [nbformat.v4.new_code_cell(s) for s in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_execute_notebook_writes_outputs_and_names_the_failing_cell(tmp_path, capsys):
    import nbformat

    from hfkit.viz.execute import execute_notebook, main

    good = _write_notebook(tmp_path / "good.ipynb", "x = 20 + 1", "print(x * 2)")
    run = execute_notebook(good, tmp_path / "out", cell_timeout=60)
    assert run.ok and nbformat.read(run.output, 4).cells[2].outputs[0]["text"] == "42\n"
    bad = _write_notebook(tmp_path / "bad.ipynb", "x = 1", "raise RuntimeError('boom')", "y = 2")
    assert main([str(bad), "--output-dir", str(tmp_path / "out"), "--cell-timeout", "60"]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError" in err and "boom" in err
    assert f"make report: {bad} failed at cell 2 (raised; it starts \"raise RuntimeError('boom')\")" in err
    written = nbformat.read(tmp_path / "out" / "bad.ipynb", 4)  # kept, so the report shows how far it got
    assert written.cells[2].outputs[0]["ename"] == "RuntimeError" and written.cells[3].outputs == []


def test_execute_notebook_turns_a_stall_into_a_named_timeout(tmp_path):
    from hfkit.viz.execute import execute_notebook

    slow = _write_notebook(tmp_path / "slow.ipynb", "import time", "time.sleep(60)")
    run = execute_notebook(slow, tmp_path / "out", cell_timeout=2)
    assert run.timed_out and run.failed_cell == 2 and "2 seconds" in run.error
    assert run.failure_line("slow.ipynb").startswith("make report: slow.ipynb failed at cell 2 (timed out")
    with pytest.raises(ValueError, match="cell_timeout: expected a positive number of seconds, got 0"):
        execute_notebook(slow, tmp_path / "out", cell_timeout=0)


def test_panels_send_nothing_back_on_the_shell_channel_of_a_headless_run(tmp_path, monkeypatch):
    # nbclient mirrors output captured by an Output widget back to the kernel on the shell channel it
    # waits on for the cell's reply; the panels set their Output's state instead, so it sends nothing.
    from nbclient.output_widget import OutputWidget

    from hfkit.viz.execute import execute_notebook

    sent = []
    monkeypatch.setattr(OutputWidget, "send", lambda self, *args, **kwargs: sent.append(args))
    capture = _write_notebook(
        tmp_path / "capture.ipynb",
        "import ipywidgets as w\nout = w.Output()\ndisplay(out)\nwith out:\n    print(1)",
    )
    assert execute_notebook(capture, tmp_path / "out", cell_timeout=120).ok and sent  # the check can fail
    sent.clear()
    panels = _write_notebook(
        tmp_path / "panels.ipynb",
        "from hfkit.viz.comms import CostModelPanel\nCostModelPanel().show()",
        "from hfkit.viz.model import ProfileExplorer\nProfileExplorer('cpu').show()",
    )
    run = execute_notebook(panels, tmp_path / "out", cell_timeout=120)
    assert run.ok, run.error
    assert sent == []


def test_html_report_loads_plotly_js_once_from_beside_it(tmp_path):
    from nbconvert import HTMLExporter

    from hfkit.viz.execute import execute_notebook

    source = _write_notebook(
        tmp_path / "report.ipynb",
        "from hfkit.viz import setup_notebook\nsettings = setup_notebook(profile='smoke')",
        "import plotly.graph_objects as go\ngo.Figure(go.Bar(y=[1, 2])).show()",
        "go.Figure(go.Bar(y=[3])).show()",
    )
    run = execute_notebook(source, tmp_path / "out", cell_timeout=120)
    assert run.ok, run.error
    html, _ = HTMLExporter().from_filename(str(run.output))
    assert html.count('src="plotly.min.js"') == 1 and html.count("Plotly.newPlot") == 2
    assert html.index('src="plotly.min.js"') < html.index("Plotly.newPlot")  # loaded before the figures draw
    assert "window.Plotly = Plotly" not in html and len(html) < 1_000_000  # plotly.js (4.8 MB) not embedded
