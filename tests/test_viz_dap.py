"""Tests of `hfkit.viz.dap` (notebook 06): the shard owners and layout figure, the communication table
against `dap_block_comm`, the per-GPU memory model against `lean_working_set_bytes` at one GPU, the
time model, the longseq loader (absent and present), the live exactness check on 2 gloo processes, and
the explorer's static-then-widget display."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

import plotly.graph_objects as go  # noqa: E402

from hfkit.bench.model import evoformer_block_flops, make_block  # noqa: E402
from hfkit.bench.results import make_row, save_results  # noqa: E402
from hfkit.bench.timing import Timing  # noqa: E402
from hfkit.model import ModelConfig  # noqa: E402
from hfkit.model.inference import LEAN_OPS, BlockWidths, lean_working_set_bytes  # noqa: E402
from hfkit.parallel.dap import dap_block_comm  # noqa: E402
from hfkit.viz.dap import (  # noqa: E402
    LAYOUT_STAGES,
    DAPExplorer,
    dap_comm_breakdown,
    dap_comm_figure,
    dap_comm_summary,
    dap_comm_table,
    dap_exactness_check,
    dap_layout,
    dap_layout_figure,
    dap_model_figure,
    dap_model_table,
    dap_scaling_figure,
    dap_scaling_table,
    dap_working_set_bytes,
    load_dap_runs,
    load_longseq,
    longseq_figure,
    longseq_table,
    measure_longseq_here,
    measured_tflops,
    shard_owner,
)

AF2 = ModelConfig.af2_initial()
ENV = {"gpu": "test", "torch": "x", "triton": None, "python": "3", "commit": None, "command": "t",
       "timestamp": "t"}  # fmt: skip


@pytest.fixture
def displayed(monkeypatch):
    """What `IPython.display.display` was given, in order (nothing is drawn)."""
    import IPython.display

    shown: list = []
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **_: shown.extend(objs))
    return shown


# ---- layout ----------------------------------------------------------------------------------------------


def test_shard_owner_pads_to_a_multiple_of_the_group() -> None:
    assert shard_owner(range(7), 7, 2).tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert shard_owner(range(7), 7, 4).tolist() == [0, 0, 1, 1, 2, 2, 3]  # padded to 8: 2 each
    assert shard_owner(range(8), 8, 1).tolist() == [0] * 8
    with pytest.raises(ValueError, match=r"index: expected positions in \[0, 7\), got 0..7"):
        shard_owner(range(8), 7, 2)
    with pytest.raises(ValueError, match="group_size: expected >= 1, got 0"):
        shard_owner([0], 7, 0)


def test_dap_layout_shards_rows_then_columns() -> None:
    layout = dap_layout(n_seq=8, n_res=12, group_size=4)
    assert list(layout) == [s.name for s in LAYOUT_STAGES]
    for stage in LAYOUT_STAGES:
        rows, cols, owner = layout[stage.name]
        assert owner.shape == (len(rows), len(cols)) == ((8 if stage.tensor == "m" else 12), 12)
        assert set(np.unique(owner)) == {0, 1, 2, 3}
        expected = {8: [0, 0, 1, 1, 2, 2, 3, 3], 12: [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]}
        if stage.axis == "rows":  # every row whole on one rank
            assert (owner == owner[:, :1]).all() and owner[:, 0].tolist() == expected[len(rows)]
        else:
            assert (owner == owner[:1, :]).all() and owner[0].tolist() == expected[12]
    # Long axes are sampled, first and last position kept.
    rows, cols, owner = dap_layout(128, 4096, 8, samples=32)["pair by rows"]
    assert len(rows) == len(cols) == 32 and rows[0] == 0 and rows[-1] == 4095
    assert owner[0, 0] == 0 and owner[-1, 0] == 7
    with pytest.raises(ValueError, match="n_res: expected >= 1, got 0"):
        dap_layout(4, 0, 2)


def test_dap_layout_figure_has_one_panel_per_layout_and_names_the_padding() -> None:
    fig = dap_layout_figure(n_seq=5, n_res=7, group_size=2)
    heatmaps = [t for t in fig.data if isinstance(t, go.Heatmap)]
    assert len(heatmaps) == len(LAYOUT_STAGES) == 4
    assert [int(v) for v in np.unique(np.asarray(heatmaps[0].z))] == [0, 1]
    assert "4 each, padded to 8: rank 1 holds 3 real" in fig.layout.title.text
    assert "3 each, padded to 6: rank 1 holds 2 real" in fig.layout.title.text
    assert "(32 each)" in dap_layout_figure(128, 4096, 4).layout.title.text  # no padding
    assert "then: all-to-all to columns" in fig.layout.xaxis.title.text


# ---- communication ---------------------------------------------------------------------------------------


def test_comm_table_is_dap_block_comm_in_bytes_and_modelled_time() -> None:
    table = dap_comm_table([100, 256], [1, 2, 4], 30, AF2, itemsize=2, link_gbps=100.0, alpha_us=5.0)
    assert len(table) == 2 * 3 * len(dap_block_comm(30, 100, AF2, 2))
    for (n, p), rows in table.groupby(["n_res", "gpus"]):
        expected = dap_block_comm(30, n, AF2, p)
        assert rows["collective"].tolist() == list(expected)
        assert rows["bytes"].tolist() == [2 * e for e in expected.values()]
        if p == 1:
            assert (rows["bytes"] == 0).all() and (rows["model_ms"] == 0).all()
        else:
            assert np.allclose(rows["model_ms"], (5e-6 + rows["bytes"] / 100e9) * 1e3)
    summary = dap_comm_summary(table)
    row = summary[(summary["n_res"] == 256) & (summary["gpus"] == 4)].iloc[0]
    assert row["MiB_per_rank"] == pytest.approx(2 * sum(dap_block_comm(30, 256, AF2, 4).values()) / 2**20)
    breakdown = dap_comm_breakdown(256, 4, 30, AF2, itemsize=2, link_gbps=100.0, alpha_us=5.0)
    at = table[(table["n_res"] == 256) & (table["gpus"] == 4)]
    assert breakdown["collective"].tolist() == at["collective"].tolist()
    assert np.allclose(breakdown["MiB"] * 2**20, at["bytes"]) and np.allclose(
        breakdown["model_ms"], at["model_ms"]
    )
    fig = dap_comm_figure(table)
    assert {t.name for t in fig.data} == {"2", "4"} and len(fig.data) == 4  # two panels, P = 1 left out


# ---- memory and time model -------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [ModelConfig.tiny(), AF2], ids=["tiny", "af2_initial"])
def test_block_widths_match_a_built_block(config: ModelConfig) -> None:
    assert BlockWidths.from_config(config) == BlockWidths.from_block(make_block(config))


@pytest.mark.parametrize("chunk", [1, 16, 64, 10_000])
def test_one_gpu_working_set_is_the_lean_path(chunk: int) -> None:
    widths = BlockWidths.from_config(AF2)
    assert dap_working_set_bytes(widths, 128, 1000, 1, chunk, 2) == lean_working_set_bytes(
        widths, 128, 1000, chunk, 2
    )


def test_dap_working_set_keeps_gathered_tensors_whole_and_shards_the_rest() -> None:
    w = BlockWidths.from_config(AF2)
    s, n, p, c = 128, 2048, 4, 32
    one, four = dap_working_set_bytes(w, s, n, 1, c, 2), dap_working_set_bytes(w, s, n, p, c, 2)
    assert list(four) == list(LEAN_OPS)
    # The gathered b of the triangle multiplication is whole on every rank, plus 2 local shards.
    assert four["triangle_multiplication"] == 2 * (
        w.c_hidden_mul * n * n + 2 * w.c_hidden_mul * (n // p) * n + c * n * (4 * w.c_z + 6 * w.c_hidden_mul)
    )
    # The pair transition's chunk is the same; with chunks smaller than the shard nothing else changes.
    assert four["pair_transition"] == one["pair_transition"]
    # A chunk larger than the shard: the chunked axis is cut to the shard (N/P pair rows).
    big_one, big_four = (dap_working_set_bytes(w, s, n, q, n, 2)["pair_transition"] for q in (1, p))
    assert big_four * p == big_one
    # Without logits (fused attention) exactly the logits and softmax of one chunk are left out.
    fused = dap_working_set_bytes(w, s, n, p, c, 2, logits=False)
    r, k = min(c, s // p), min(c, n // p)
    left_out = {
        "msa_row_attention": 2 * r * w.heads_msa * n * n,
        "msa_column_attention": 2 * k * w.heads_msa * s * s,
        "triangle_attention": 2 * k * w.heads_pair * n * n,
    }
    assert {op: (four[op] - fused[op]) // 2 for op in LEAN_OPS} == {
        op: left_out.get(op, 0) for op in LEAN_OPS
    }
    with pytest.raises(ValueError, match="group_size, chunk_size: expected >= 1, got 0, 4"):
        dap_working_set_bytes(w, s, n, 0, 4, 2)


def test_model_table_memory_and_time() -> None:
    table = dap_model_table([1024, 4096], [1, 2, 4, 8], AF2, n_seq=128, chunk_size=16, tflops=100.0)
    assert len(table) == 8
    one = table[(table["n_res"] == 4096) & (table["gpus"] == 1)].iloc[0]
    assert one["resident_GiB"] * 2**30 == 2 * (128 * 4096 * AF2.c_m + 4096 * 4096 * AF2.c_z)
    lean = lean_working_set_bytes(BlockWidths.from_config(AF2), 128, 4096, 16, 2)
    assert one["working_GiB"] * 2**30 == max(lean.values()) and one["peak_op"] == max(lean, key=lean.get)
    assert one["compute_s"] == pytest.approx(evoformer_block_flops(128, 4096, AF2) / 100e12)
    assert one["comm_s"] == 0
    assert np.allclose(table["memory_GiB"], table["resident_GiB"] + table["working_GiB"])
    assert np.allclose(table["block_s"], table["compute_s"] + table["comm_s"])
    assert np.allclose(table["stack_s"], AF2.no_blocks * table["block_s"])
    for _, rows in table.groupby("n_res"):
        assert rows["memory_GiB"].is_monotonic_decreasing and rows["compute_s"].is_monotonic_decreasing
        assert np.allclose(rows["compute_s"] * rows["gpus"], rows["compute_s"].iloc[0])
        assert (rows["comm_s"].iloc[1:] > 0).all()


# ---- measured results ------------------------------------------------------------------------------------


def _longseq_rows() -> list:
    """longseq rows as `hfkit bench longseq` writes them: two lean block rows, an error row and a
    48-block estimate (not a block row)."""
    rows = []
    for n, ms, peak in ((1024, 1000.0, 2**31), (2048, 8000.0, 2**33)):
        flops = evoformer_block_flops(128, n, AF2)
        rows.append(
            make_row(ENV, Timing(ms, ms, ms, 3, "cuda_event"), op="longseq_block", provider="hfkit_lean",
                     mode="fwd", shape=[128, n], dtype="bf16", flops=flops, peak_mem_bytes=peak,
                     extra={"chunk_size": 32, "total_peak_bytes": peak + 2**30})
        )  # fmt: skip
    oom = {"chunk_size": None, "error": "OutOfMemoryError"}
    rows.append(make_row(ENV, None, op="longseq_block", provider="hfkit_unchunked", mode="fwd",
                         shape=[128, 8192], dtype="bf16", extra=oom))  # fmt: skip
    rows.append(make_row(ENV, Timing(1, 1, 1, 1, "wall"), op="longseq_stack_estimate", provider="hfkit_lean",
                         mode="fwd", shape=[128, 1024], dtype="bf16", extra={"chunk_size": 32}))  # fmt: skip
    return rows


def test_load_longseq_is_none_without_the_file_and_reads_it_when_present(tmp_path) -> None:
    assert load_longseq("h200", root=tmp_path) is None
    save_results(_longseq_rows(), tmp_path / "h200" / "longseq.json", meta={})
    frame = load_longseq("h200", root=tmp_path)
    assert frame is not None and len(frame) == 4
    table = longseq_table(frame)
    assert table["n_res"].tolist() == [1024, 2048] and table["chunk"].tolist() == ["32", "32"]
    assert table["seconds"].tolist() == [1.0, 8.0]
    assert table["total_GiB"].tolist() == [3.0, 9.0]
    rate = evoformer_block_flops(128, 2048, AF2) / 8.0 / 1e12
    assert measured_tflops(table) == pytest.approx(rate)
    assert measured_tflops(table, provider="hfkit_unchunked") is None
    assert len(longseq_figure(table, "t").data) == 2
    model = dap_model_table([1024, 2048], [1, 2], AF2)
    fig = dap_model_figure(model, measured=table, marker_n=1024)
    names = [t.name for t in fig.data]
    assert names.count("1 GPU, hfkit_lean (measured)") == 2 and names.count("2 GPUs (modelled)") == 2
    line = next(t for t in fig.data if t.name == "device memory (141 GiB)")
    assert list(line.x) == [1024, 2048] and list(line.y) == [141.0, 141.0]
    measured_time = [t for t in fig.data if t.name.endswith("(measured)")][1]
    assert list(measured_time.y) == [48.0, 384.0]
    assert "measured" in fig.layout.title.text and "measured" not in dap_model_figure(model).layout.title.text


def _dap_rows(gpus: int, dap_ms: float, dap_size: int | None = None, launch: str | None = None) -> list:
    """dap rows as `hfkit bench dap --nproc <gpus>` writes them: one process at 100 ms, DAP at `dap_ms`
    (speedup and efficiency as the benchmark computes them), and a DAP row that ran out of memory;
    `launch` recorded where given (rows written before it was: eager)."""
    d = dap_size or gpus
    layout = {"nproc": gpus, "dap_size": d, "dp_size": gpus // d, "n_blocks": 1, "chunk_size": None}
    if launch is not None:
        layout["launch"] = launch
    common = dict(op="dap_block", mode="fwd+bwd", shape=[128, 256], dtype="bf16")
    speedup = 100.0 / dap_ms
    extra = {**layout, "speedup_vs_single": speedup, "scaling_efficiency": speedup * (gpus // d) / gpus}
    return [
        make_row(ENV, Timing(100.0, 100.0, 100.0, 3, "wall"), provider="single_process", extra=layout,
                 peak_mem_bytes=2**32, **common),
        make_row(ENV, Timing(dap_ms, dap_ms, dap_ms, 3, "wall"), provider="dap_overlap", extra=extra,
                 peak_mem_bytes=2**31, **common),
        make_row(ENV, None, provider="dap_sync", extra={**layout, "error": "OutOfMemoryError"}, **common),
    ]  # fmt: skip


def test_load_dap_runs_reads_every_gpu_count_and_tables_the_scaling(tmp_path) -> None:
    assert load_dap_runs("h200", root=tmp_path) is None
    save_results(
        _dap_rows(2, 62.5) + _dap_rows(2, 55.0, launch="graph"), tmp_path / "h200x2" / "dap.json", meta={}
    )
    save_results(
        _dap_rows(8, 25.0) + _dap_rows(8, 20.0, dap_size=4), tmp_path / "h200x8" / "dap.json", meta={}
    )
    save_results(_dap_rows(2, 1.0), tmp_path / "a100x2" / "dap.json", meta={})  # another GPU: not read
    save_results(_dap_rows(1, 125.0), tmp_path / "h200" / "dap.json", meta={})  # one GPU: DAP's own cost
    frame = load_dap_runs("h200", root=tmp_path)
    assert frame is not None and len(frame) == 15
    table = dap_scaling_table(frame)  # the out-of-memory rows are left out
    dap = table[table["provider"] == "dap_overlap"]
    assert dap[["gpus", "dap_size", "launch"]].values.tolist() == [
        [2, 2, "eager"], [2, 2, "graph"], [8, 8, "eager"], [8, 4, "eager"], [1, 1, "eager"],
    ]  # fmt: skip
    assert dap["speedup"].tolist() == pytest.approx([1.6, 100 / 55, 4.0, 5.0, 0.8])
    assert dap["scaling_efficiency"].tolist() == pytest.approx([0.8, 50 / 55, 0.5, 1.25, 0.8])
    assert table["peak_GiB"].tolist() == [4.0, 2.0] * 5
    fig = dap_scaling_figure(table, "t")
    lines = {t.name: list(t.y) for t in fig.data}
    assert lines["dap_block 128x256 K=1 D=all fwd+bwd eager dap_overlap"] == pytest.approx([0.8, 0.8, 0.5])
    assert lines["dap_block 128x256 K=1 D=all fwd+bwd graph dap_overlap"] == pytest.approx([50 / 55])
    assert lines["dap_block 128x256 K=1 D=4 fwd+bwd eager dap_overlap"] == pytest.approx([1.25])
    assert lines["goal at 2 GPUs"] == [0.8] and lines["goal at 8 GPUs"] == [0.6]


def test_measure_longseq_here_needs_cuda_and_runs_the_benchmark_without_search(monkeypatch) -> None:
    import hfkit.bench.longseq as longseq

    calls = []

    def fake_benchmark(device, **kwargs):
        calls.append((device, kwargs))
        return _longseq_rows()

    monkeypatch.setattr(longseq, "run_longseq_benchmark", fake_benchmark)
    assert measure_longseq_here(torch.device("cpu"), smoke=False) is None and calls == []
    cuda = torch.device("cuda", 0)  # a device object only: nothing runs on it
    table = measure_longseq_here(cuda, smoke=False)
    assert calls[-1] == (
        cuda,
        {"profile": "full", "sizes": (1024, 2048, 4096), "chunks": ("auto",), "search": False},
    )
    assert table["n_res"].tolist() == [1024, 2048] and table["seconds"].tolist() == [1.0, 8.0]
    measure_longseq_here(cuda, smoke=True)
    assert calls[-1] == (cuda, {"profile": "smoke", "search": False})


# ---- the live check --------------------------------------------------------------------------------------


def test_exactness_check_on_two_gloo_processes_is_exact() -> None:
    table = dap_exactness_check(nprocs=2, n_seq=5, n_res=7)
    assert table["rank"].tolist() == [0] * 5 + [1] * 5
    assert set(table["quantity"]) == {"output m", "output z", "grad m", "grad z", "grad parameters"}
    params = table[table["quantity"] == "grad parameters"]
    assert (params["tensors"] > 30).all()
    assert (table["max_abs_value"] > 0).all()
    assert (table["rel_diff"] <= 1e-10).all(), table


# ---- the explorer ----------------------------------------------------------------------------------------


def test_explorer_shows_its_result_before_the_widget(displayed) -> None:
    explorer = DAPExplorer(n_values=(512, 1024, 4096))
    explorer.show(n_res=1024, gpus=2, chunk_size=16, logits=False)
    layout, comm, at_n, figure, widget = displayed
    assert isinstance(layout, go.Figure) and "over 2 ranks" in layout.layout.title.text
    assert comm["collective"].tolist() == list(dap_block_comm(128, 1024, AF2, 2))
    assert at_n["n_res"].tolist() == [1024] * 4 and at_n["gpus"].tolist() == [1, 2, 4, 8]
    expected = dap_model_table([1024], [1, 2, 4, 8], AF2, chunk_size=16, logits=False).round(3)
    pd.testing.assert_frame_equal(at_n, expected)
    assert isinstance(figure, go.Figure) and "chunk 16, fused attention" in figure.layout.title.text
    plain = explorer.update(1024, 2, 16, logits=True)[2]
    assert (plain["memory_GiB"] > at_n["memory_GiB"]).all()
    assert type(widget).__name__ == "VBox"
    with pytest.raises(ValueError, match=r"gpus: expected one of \(1, 2, 4, 8\), got 3"):
        explorer.update(1024, 3)
    assert math.isclose(comm["MiB"].sum() * 2**20, 2 * sum(dap_block_comm(128, 1024, AF2, 2).values()))
