"""Tests of the comms benchmark: bandwidth formulas, sizes, the model, the torchrun worker, viz, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hfkit.bench.comms import (
    STAGE_BYTES,
    algbw_gbps,
    build_param_model,
    busbw_gbps,
    ddp_path,
    load_comms_results,
    message_sizes,
    parse_bytes,
    run_comms_benchmark,
)
from hfkit.bench.results import ROW_FIELDS
from hfkit.cli import _parser, main


def test_bandwidth_formulas_match_nccl_tests():
    # 1 GB in 0.5 s: algbw 2 GB/s; busbw ×2(n-1)/n: n=2 -> 2, n=8 -> 3.5.
    assert algbw_gbps(1e9, 0.5) == pytest.approx(2.0)
    assert busbw_gbps(1e9, 0.5, 2) == pytest.approx(2.0)
    assert busbw_gbps(1e9, 0.5, 8) == pytest.approx(3.5)


def test_sizes_and_parse_bytes():
    assert parse_bytes("64K") == 65536 and parse_bytes("64MB") == 64 << 20 and parse_bytes("1G") == 1 << 30
    assert parse_bytes("4096") == 4096
    with pytest.raises(ValueError):
        parse_bytes("lots")
    assert message_sizes(4096, 65536) == [4096, 16384, 65536]
    assert message_sizes(4096, 32768, factor=4) == [4096, 16384, 32768]
    assert message_sizes(4 << 10, 1 << 30)[-1] == 1 << 30


def test_param_model_counts():
    model = build_param_model(93_200_000)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - 93_200_000) < 2049 + 1
    small = build_param_model(100_000)
    assert abs(sum(p.numel() for p in small.parameters()) - 100_000) < 200
    assert len(small) >= 8


@pytest.fixture(scope="module")
def worker_rows(tmp_path_factory):
    backends = ["gloo", "hfreduce"]
    out = tmp_path_factory.mktemp("comms") / "comms.json"
    rows = run_comms_benchmark(
        nproc=2,
        backends=backends,
        max_bytes="64K",
        params=100_000,
        ddp_reps=2,
        budget_s=0.1,
        reps=5,
        out=out,
        timeout_s=120,
        cpu=True,
        log=None,
    )
    return backends, rows, json.loads(out.read_text()), json.loads((out.parent / "ddp.json").read_text())


def test_worker_allreduce_rows(worker_rows):
    backends, rows, doc, ddp_doc = worker_rows
    assert doc["meta"]["world_size"] == 2 and "torchrun" in doc["meta"]["command"]
    # Allreduce rows in comms.json, DDP rows in ddp.json beside it; the run returns both.
    assert {r["op"] for r in doc["rows"]} == {"allreduce"}
    assert {r["op"] for r in ddp_doc["rows"]} == {"ddp_step"}
    assert len(doc["rows"]) + len(ddp_doc["rows"]) == len(rows)
    ar = [r for r in rows if r["op"] == "allreduce"]
    assert {r["provider"] for r in ar} == set(backends)
    for r in ar:
        assert set(ROW_FIELDS) <= set(r)
        assert r["mode"] == "allreduce" and r["dtype"] == "fp32" and r["shape"][0] in (4096, 16384, 65536)
        assert 0 < r["p20_ms"] <= r["p50_ms"] <= r["p80_ms"]
        e = r["extra"]
        assert e["world_size"] == 2 and e["nodes"] == 1 and e["device"] == "cpu"
        assert e["busbw_gbps"] == pytest.approx(busbw_gbps(r["shape"][0], r["p50_ms"] / 1e3, 2), rel=1e-6)


def test_worker_ddp_rows(worker_rows):
    backends, rows, _, _ = worker_rows
    ddp = [r for r in rows if r["op"] == "ddp_step"]
    modes = {(r["provider"], r["mode"]) for r in ddp}
    assert ("none", "backward_alone") in modes and ("none", "backward_concurrent") in modes
    assert ("gloo", "backward+sync_overlap") in modes
    for r in ddp:
        assert r["extra"]["params"] == r["shape"][0] and r["extra"]["scaled_down"]
        if r["mode"].startswith("backward+sync"):
            assert r["extra"]["comm_overhead_s"] == pytest.approx(r["p50_ms"] / 1e3 - ddp[0]["p50_ms"] / 1e3)
    assert ("hfreduce", "backward+sync_no_overlap") in modes


def test_cli_parses_comms():
    args = _parser().parse_args(["bench", "comms", "--backends", "gloo", "--max-bytes", "64K", "--no-ddp"])
    assert args.nproc == 2 and args.backends == ["gloo"] and args.max_bytes == "64K" and args.ddp is False
    assert _parser().parse_args(["bench", "comms"]).ddp is True
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench", "comms", "--backends", "mpi"])


def test_cli_comms_runs(tmp_path, capsys):
    out = tmp_path / "c.json"
    argv = ["bench", "comms", "--backends", "gloo", "--max-bytes", "16K", "--no-ddp", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["command"].startswith("hfkit bench comms")
    assert "wrote" in capsys.readouterr().out
    assert ddp_path(out) == tmp_path / "c.ddp.json" and not ddp_path(out).exists()  # --no-ddp


def test_cli_comms_chunk_mb_sets_hfreduce_chunk(tmp_path):
    """`--chunk-mb` reaches every rank's HostReduce: a 1 MiB message in 0.5 MiB chunks runs the pipeline
    (not the small path) and its row records the chunk; the bound is computed for that chunk."""
    out = tmp_path / "c.json"
    argv = ["bench", "comms", "--backends", "hfreduce", "--min-bytes", "1M", "--max-bytes", "1M", "--no-ddp",
            "--chunk-mb", "0.5", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["extra"]["chunk_bytes"] == 512 << 10 and row["extra"]["path"] == "pipelined"
    assert "--chunk-mb 0.5" in row["command"]


def test_load_comms_results_reads_both_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="comms.json"):
        load_comms_results(tmp_path)
    frame = load_comms_results(Path(__file__).resolve().parents[1] / "data" / "results" / "cpu")
    assert set(frame["op"]) == {"allreduce", "ddp_step"}


def test_viz_frames_and_panel(worker_rows):
    from hfkit.bench.results import rows_to_frame
    from hfkit.viz.comms import CostModelPanel, allreduce_frame, busbw_figure, ddp_figure, ddp_table

    _, rows, _, _ = worker_rows
    frame = rows_to_frame(rows)
    ar = allreduce_frame(frame, source="test")
    assert ar["series"].str.endswith(" · test").all() and (ar["busbw_gbps"] > 0).all()
    assert len(busbw_figure(ar).data) == ar["series"].nunique()
    table = ddp_table(frame)
    assert table["mode"].iloc[0] == "backward_alone" and table["ranks"].iloc[0] == 1
    assert len(ddp_figure(table).data) >= 1
    panel = CostModelPanel()
    pcie = panel.update("A100 PCIe (seed)").set_index("backend")["allreduce_ms"]
    assert pcie["hfreduce"] < pcie["nccl"]
    nvl = panel.update("H200 NVLink", nodes=2).set_index("backend")["allreduce_ms"]
    assert nvl["nccl"] < nvl["hfreduce"]
    # A faster PCIe peer path (the slider's link) closes NCCL's gap on the PCIe cluster.
    faster = panel.update("A100 PCIe (seed)", link_gbps=24.0).set_index("backend")["allreduce_ms"]
    assert faster["nccl"] < pcie["nccl"]


def test_worker_stage_rates_and_bound(worker_rows):
    from hfkit.parallel.cost_model import StageRates, hfreduce_bound

    _, rows, doc, _ = worker_rows
    meta = doc["meta"]
    rates = StageRates.from_dict(meta["stage_rates"])
    assert rates.local_ranks == 2 and rates.threads >= 1 and rates.host_sum_gbps > 0 and not rates.cuda
    entries = {(e["stage"], e["mode"]): e for e in meta["stage_rows"]}
    assert all(e["bytes"] == STAGE_BYTES for e in entries.values())
    assert entries[("host_sum", "all_ranks")]["gbps"] == pytest.approx(rates.host_sum_gbps)
    assert entries[("host_copy", "all_ranks")]["gbps"] == pytest.approx(rates.host_copy_gbps)
    # On a CPU the device copies are skipped rows, with the reason.
    for key in (
        ("d2h", "alone"),
        ("d2h", "all_ranks"),
        ("h2d", "alone"),
        ("h2d", "all_ranks"),
        ("bidir", "all_ranks"),
    ):
        assert entries[key]["gbps"] is None and "no CUDA device" in entries[key]["skipped"], entries[key]
    hf = [r for r in rows if r["op"] == "allreduce" and r["provider"] == "hfreduce"]
    assert len(hf) == 3
    for r in hf:
        e = r["extra"]
        nbytes = r["shape"][0]
        # Each row's bound comes from the rates measured at its own size (buffers of one pipeline step).
        row_rates = StageRates.from_dict(e["stage_rates"])
        assert row_rates.local_ranks == 2 and row_rates.host_sum_gbps > 0 and not row_rates.cuda
        expected = hfreduce_bound(nbytes, row_rates, e["chunk_bytes"], 256 << 10, cuda=False)
        assert e["bound_ms"] == pytest.approx(expected * 1e3) and e["bound_ms"] > 0
        assert e["bound_fraction"] == pytest.approx(e["bound_ms"] / r["p50_ms"], rel=1e-6)
        assert e["path"] == ("small" if nbytes <= 256 << 10 else "pipelined")
    gloo = [r for r in rows if r["op"] == "allreduce" and r["provider"] == "gloo"]
    assert all("bound_ms" not in r["extra"] for r in gloo)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: device copy rates")
def test_worker_measures_device_copy_rates(tmp_path):
    from hfkit.parallel.cost_model import StageRates

    rows = run_comms_benchmark(nproc=2, backends=["hfreduce"], max_bytes="64K", ddp=False, budget_s=0.1,
                               reps=3, out=tmp_path / "comms.json", timeout_s=300, log=None)  # fmt: skip
    for r in rows:
        rates = StageRates.from_dict(r["extra"]["stage_rates"])
        assert rates.cuda and rates.d2h_alone_gbps > 0 and rates.h2d_alone_gbps > 0
        assert r["extra"]["device"] == "cuda" and r["extra"]["bound_ms"] > 0


def test_bound_comparison_of_a_run(worker_rows):
    from hfkit.bench.results import rows_to_frame
    from hfkit.parallel.cost_model import bound_comparison, measured_stage_rates
    from hfkit.viz.comms import allreduce_frame

    _, rows, _, _ = worker_rows
    frame = allreduce_frame(rows_to_frame(rows))
    table = bound_comparison(frame)
    assert list(table["nbytes"]) == [4096, 16384, 65536] and (table["backend"] == "hfreduce").all()
    assert (table["bound_ms"] > 0).all() and (table["gloo_ms"] > 0).all()
    assert np.allclose(table["bound_fraction"], table["bound_ms"] / table["measured_ms"])
    assert list(table["path"]) == ["small"] * 3
    largest = next(r for r in rows if r["provider"] == "hfreduce" and r["shape"] == [65536])
    assert measured_stage_rates(frame).as_dict() == largest["extra"]["stage_rates"]
    # Results from before the stage rates (rows without them): an empty table, no rates.
    bound_keys = ("stage_rates", "bound_ms", "bound_fraction", "path")
    old_rows = [{**r, "extra": {k: v for k, v in r["extra"].items() if k not in bound_keys}} for r in rows]
    old = allreduce_frame(rows_to_frame(old_rows))
    assert bound_comparison(old).empty and measured_stage_rates(old) is None
    # The committed CPU results carry them: hfreduce's sizes, each with a positive bound.
    committed = bound_comparison(
        allreduce_frame(load_comms_results(Path(__file__).resolve().parents[1] / "data" / "results" / "cpu"))
    )
    assert not committed.empty and (committed["bound_ms"] > 0).all()
