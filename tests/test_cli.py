"""Tests of the `hfkit` command line on CPU: `env` and `bench layer_norm`, through `main(argv)`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hfkit.bench.cases.layer_norm import SMOKE_SHAPES
from hfkit.bench.results import ROW_FIELDS, load_results
from hfkit.cli import main


def test_env_without_ceilings(capsys):
    assert main(["env", "--no-ceilings"]) == 0
    out = capsys.readouterr().out
    assert f"torch           {torch.__version__}" in out
    assert "cuda available" in out
    assert "copy bandwidth" not in out  # skipped


def test_bench_layer_norm_smoke_writes_results(tmp_path, capsys):
    out_file = tmp_path / "sub" / "ln.json"
    argv = [
        "bench",
        "layer_norm",
        "--profile",
        "smoke",
        "--out",
        str(out_file),
        "--providers",
        "hfkit,eager",
        "--no-progress",
    ]
    assert main(argv) == 0
    doc = json.loads(out_file.read_text())
    assert doc["meta"]["ceilings"]["copy_gbps"] > 0
    assert doc["meta"]["command"] == "hfkit " + " ".join(argv)
    rows = doc["rows"]
    assert len(rows) == len(SMOKE_SHAPES) * 2 * 2 * 2  # shapes x dtypes x modes x providers
    assert all(set(r) == set(ROW_FIELDS) for r in rows)
    assert {tuple(r["shape"]) for r in rows} == set(SMOKE_SHAPES)
    frame = load_results(out_file)
    assert set(frame["provider"]) == {"hfkit", "eager"}
    printed = capsys.readouterr().out
    assert "speed-up vs eager" in printed and f"wrote {len(rows)} rows" in printed
    assert [p.name for p in out_file.parent.iterdir()] == ["ln.json"]


def test_bench_layer_norm_subset_options(tmp_path):
    out_file = tmp_path / "ln.json"
    argv = ["bench", "layer_norm", "--out", str(out_file), "--shapes", "3x40,2x2x64", "--dtypes", "bf16"]
    argv += ["--modes", "fwd", "--providers", "eager", "--no-progress"]
    assert main(argv) == 0
    rows = json.loads(out_file.read_text())["rows"]
    assert sorted(tuple(r["shape"]) for r in rows) == [(2, 2, 64), (3, 40)]
    assert {(r["dtype"], r["mode"], r["provider"]) for r in rows} == {("bf16", "fwd", "eager")}


@pytest.mark.parametrize("bad", [["--providers", "apex"], ["--dtypes", "fp8"], ["--shapes", "1xa"]])
def test_bench_layer_norm_rejects_bad_arguments(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "layer_norm", *bad])
    assert exc.value.code == 2
    assert bad[0] in capsys.readouterr().err


def test_python_dash_m_hfkit():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "hfkit", "env", "--no-ceilings"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "python" in proc.stdout and "triton" in proc.stdout
