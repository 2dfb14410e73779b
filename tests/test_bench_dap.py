"""`hfkit bench dap` on CPU (gloo, 2 ranks, the smoke profile): the rows it writes (every provider and
mode, times, per-rank entries, the communication volume of `dap_block_comm`, the check against one
process), the results folder's name, and a clear error for a bad `--nproc`."""

from __future__ import annotations

import json

import pytest
import torch

from hfkit.bench.dap import DAP_PROFILES, PROVIDERS, dap_results_folder
from hfkit.cli import main
from hfkit.parallel.dap import dap_block_comm


def test_bench_dap_smoke_writes_rows(tmp_path) -> None:
    out = tmp_path / "dap.json"
    argv = ["bench", "dap", "--profile", "smoke", "--device", "cpu", "--nproc", "2", "--out", str(out)]
    argv += ["--sizes", "9", "--warmup", "0", "--reps", "2"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["world_size"] == 2 and doc["meta"]["backend"] == "gloo"
    rows = doc["rows"]
    assert sorted((r["provider"], r["mode"]) for r in rows) == sorted(
        (p, m) for p in PROVIDERS for m in ("fwd", "fwd+bwd")
    )
    s = DAP_PROFILES["smoke"].n_seq
    # fp32: 4 bytes an element; N = 9 is padded to 10 over 2 ranks (dap_block_comm counts the padding)
    forward_bytes = 4 * sum(dap_block_comm(s, 9, DAP_PROFILES["smoke"].config, 2).values())
    for r in rows:
        extra = r["extra"]
        assert r["op"] == "dap_block" and r["shape"] == [s, 9] and r["dtype"] == "fp32", r
        assert r["method"] == "wall" and r["n_reps"] == 2 and r["p50_ms"] > 0, r
        assert extra["nproc"] == 2 and extra["backend"] == "gloo"
        if r["provider"] == "single_process":
            assert len(extra["peak_mem_bytes_per_rank"]) == 1  # rank 0 alone
            assert "comm_bytes" not in extra
            continue
        assert extra["overlap"] is (r["provider"] == "dap_overlap")
        assert len(extra["peak_mem_bytes_per_rank"]) == 2
        assert extra["max_rel_err_vs_single"] <= 1e-5
        assert extra["speedup_vs_single"] > 0
        expected = (
            forward_bytes if r["mode"] == "fwd" else 2 * forward_bytes + 4 * extra["param_grad_elements"]
        )
        assert extra["comm_bytes"] == expected > 0


def test_dap_results_folder() -> None:
    assert dap_results_folder("h200", 4) == "h200x4"
    assert dap_results_folder("h200", 1) == "h200"
    assert dap_results_folder("cpu", 2) == "cpu"


def test_bench_dap_rejects_a_bad_nproc(tmp_path, capsys) -> None:
    argv = ["bench", "dap", "--profile", "smoke", "--device", "cpu", "--nproc", "0"]
    assert main([*argv, "--out", str(tmp_path / "dap.json")]) == 2
    assert "nproc: expected >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "dap.json").exists()


@pytest.mark.parametrize("flag", ["--providers", "--modes"])
def test_bench_dap_rejects_unknown_choices(flag: str) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "dap", flag, "nonsense"])


def test_bench_dap_stack_in_a_dp_by_dap_layout(tmp_path) -> None:
    # 4 ranks as 2 data-parallel replicas of 2-rank DAP groups, a checkpointed 2-block stack: what issue
    # 20's multi-GPU runs ask for, rehearsed with gloo.
    out = tmp_path / "dap.json"
    argv = ["bench", "dap", "--profile", "smoke", "--device", "cpu", "--nproc", "4", "--dap-size", "2"]
    argv += ["--blocks", "2", "--checkpoint", "--sizes", "9", "--modes", "fwd+bwd", "--warmup", "0"]
    argv += ["--reps", "1", "--providers", "single_process,dap_overlap", "--out", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["provider"] for r in rows] == ["single_process", "dap_overlap"]
    config, s = DAP_PROFILES["smoke"].config, DAP_PROFILES["smoke"].n_seq
    forward_elements = 2 * sum(dap_block_comm(s, 9, config, 2).values())  # two blocks, D = 2
    for r in rows:
        extra = r["extra"]
        assert r["op"] == "dap_stack" and r["shape"] == [s, 9], r
        layout = (extra["n_blocks"], extra["checkpoint"], extra["dap_size"], extra["dp_size"])
        assert layout == (2, True, 2, 2)
        assert extra["chunk_size"] is None
    dap = rows[1]["extra"]
    assert dap["max_rel_err_vs_single"] <= 1e-5
    assert dap["comm_bytes"] == 4 * (2 * forward_elements + dap["param_grad_elements"])
    assert dap["dp_grad_elements"] == dap["param_grad_elements"] > 0
    assert len(dap["peak_mem_bytes_per_rank"]) == 4
    # samples a second per process against one process's: the speedup times 2 replicas over 4 ranks
    assert dap["scaling_efficiency"] == pytest.approx(dap["speedup_vs_single"] * 2 / 4)


def test_bench_dap_chunked_inference_rows_keep_other_layouts(tmp_path) -> None:
    out = tmp_path / "dap.json"
    argv = ["bench", "dap", "--profile", "smoke", "--device", "cpu", "--nproc", "2", "--sizes", "9"]
    argv += ["--modes", "fwd", "--warmup", "0", "--reps", "1", "--providers", "dap_overlap"]
    argv += ["--out", str(out)]
    assert main(argv) == 0
    assert main([*argv, "--chunk-size", "4", "--append"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["extra"]["chunk_size"] for r in rows] == [None, 4]  # the second run kept the first's row
    # Without single_process no rank holds the whole inputs, so there is nothing to check against.
    assert all(r["extra"]["max_rel_err_vs_single"] is None and r["p50_ms"] > 0 for r in rows)
    assert main([*argv, "--chunk-size", "4", "--append", "--providers", "single_process,dap_overlap"]) == 0
    chunked = [r for r in json.loads(out.read_text())["rows"] if r["extra"]["chunk_size"] == 4]
    assert [r["provider"] for r in chunked] == ["single_process", "dap_overlap"]
    assert chunked[1]["extra"]["max_rel_err_vs_single"] <= 1e-5


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dap-size", "3"], "dap_size: expected a positive divisor of nproc 2, got 3"),
        (["--checkpoint"], "checkpoint: recomputes the blocks of a stack; expected n_blocks > 1"),
        (["--blocks", "0"], "n_blocks: expected >= 1, got 0"),
        (["--chunk-size", "0"], "chunk_size: expected a positive int or None, got 0"),
        (["--launch", "graph"], "launch: 'graph' needs CUDA and one DAP group of every rank"),
    ],
)
def test_bench_dap_rejects_a_bad_layout(tmp_path, capsys, extra, message) -> None:
    argv = ["bench", "dap", "--profile", "smoke", "--device", "cpu", "--nproc", "2", *extra]
    assert main([*argv, "--out", str(tmp_path / "dap.json")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "dap.json").exists()


def _averaged(rank: int) -> list[list[float]]:
    from torch import nn

    from hfkit.bench.dap import _data_parallel

    module = nn.Linear(3, 2)  # weight [2, 3] and bias [2]: two gradients of different sizes
    replicas = _data_parallel(module, None)
    for i, p in enumerate(module.parameters()):
        p.grad = torch.full_like(p, float(rank + 1) * (i + 1))
    module.bias.grad[0] = 10.0 * rank  # one element differs from its tensor's others
    replicas.sync_grad()
    return [p.grad.flatten().tolist() for p in module.parameters()]


def test_average_gradients_over_the_dp_group() -> None:
    from hfkit.parallel.launch import spawn_local

    results = spawn_local(_averaged, 2, backend="gloo", timeout_s=60)
    assert results[0] == results[1] == [[1.5] * 6, [5.0, 3.0]]
