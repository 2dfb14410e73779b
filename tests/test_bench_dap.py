"""`hfkit bench dap` on CPU (gloo, 2 ranks, the smoke profile): the rows it writes (every provider and
mode, times, per-rank entries, the communication volume of `dap_block_comm`, the check against one
process), the results folder's name, and a clear error for a bad `--nproc`."""

from __future__ import annotations

import json

import pytest

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
