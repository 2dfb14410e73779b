"""Tests of `hfkit report`: the committed docs/results.md and README headline match data/results, and
the table building on hand-made rows (errors, missing and renamed providers, profiler rows)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from hfkit.bench.results import results_dir, rows_to_frame
from hfkit.cli import main
from hfkit.viz.report import (
    HEADLINE_END,
    HEADLINE_START,
    headline_markdown,
    op_tables,
    results_markdown,
    with_headline,
)

REPO = results_dir().parents[1]


def make_row(provider: str, p50_ms: float, **fields) -> dict:
    """A complete result row (every schema field) for `provider`, overridden by `fields`."""
    row = {
        "gpu": "NVIDIA H200",
        "torch": "2.11.0",
        "triton": "3.6.0",
        "python": "3.12.3",
        "commit": "abcdef0123456",
        "command": "hfkit bench layernorm",
        "timestamp": "2026-11-29T08:00:00+00:00",
        "op": "layer_norm",
        "provider": provider,
        "mode": "fwd",
        "shape": [4, 64],
        "dtype": "bf16",
        "p20_ms": p50_ms,
        "p50_ms": p50_ms,
        "p80_ms": p50_ms,
        "method": "cuda_graph",
        "n_reps": 10,
        "bytes": 1024,
        "gbps": 1.0,
        "pct_copy": 1.0,
        "flops": None,
        "tflops": None,
        "pct_matmul": None,
        "peak_mem_bytes": None,
        "extra": {},
    }
    row.update(fields)
    return row


def only_table(rows: list[dict]):
    tables = op_tables(rows_to_frame(rows), "h200")
    assert len(tables) == 1
    return tables[0]


def column(table, name: str) -> list[str]:
    return [line[table.header.index(name)] for line in table.rows]


# --- the committed documents ------------------------------------------------------------------------


def test_committed_results_markdown_is_what_hfkit_report_writes():
    committed = (REPO / "docs" / "results.md").read_text()
    assert results_markdown(results_dir()) == committed, "data/results changed: run `hfkit report`"


def test_readme_headline_is_what_hfkit_report_writes():
    readme = (REPO / "README.md").read_text()
    block = headline_markdown(results_dir())
    assert block in readme, "the README's headline table is stale: run `hfkit report`"
    assert with_headline(readme, block) == readme
    assert block.startswith(HEADLINE_START) and block.endswith(HEADLINE_END)
    assert "48-block Evoformer stack" in block


def test_readme_stays_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 150


def test_cli_report_writes_then_check_passes_and_fails_when_stale(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n{HEADLINE_START}\nold numbers\n{HEADLINE_END}\n\ntail\n")
    out = tmp_path / "docs" / "results.md"
    argv = ["report", "--results", str(results_dir()), "--out", str(out), "--readme", str(readme)]
    assert main([*argv, "--check"]) == 1  # nothing written yet
    assert not out.exists()
    assert main(argv) == 0
    assert out.read_text() == results_markdown(results_dir())
    text = readme.read_text()
    assert text.startswith("# title\n\n" + HEADLINE_START) and text.endswith(HEADLINE_END + "\n\ntail\n")
    assert "old numbers" not in text
    capsys.readouterr()
    assert main([*argv, "--check"]) == 0
    out.write_text(out.read_text().replace("| hfkit", "| ours", 1))
    assert main([*argv, "--check"]) == 1
    printed = capsys.readouterr().out
    assert f"{out}: 2 lines differ" in printed
    removed = [line for line in printed.splitlines() if line.startswith("-|")]
    assert len(removed) == 1 and "| ours (" in removed[0]


# --- table building on hand-made rows ---------------------------------------------------------------


def test_providers_pivot_into_columns_with_speedups():
    rows = [make_row("hfkit", 0.010), make_row("eager", 0.040), make_row("compile", 0.020)]
    table = only_table(rows)
    assert table.header == ["hfkit (µs)", "compile (µs)", "eager (µs)", "hfkit vs eager", "hfkit vs compile"]
    assert table.rows == [["10.0", "20.0", "40.0", "4.00×", "2.00×"]]
    notes = "\n".join(table.notes)
    assert "NVIDIA H200 (`h200`)" in notes and "commit abcdef0" in notes
    assert "hfkit bench layernorm" in notes
    assert "All rows: mode fwd, shape 4×64, dtype bf16." in notes


def test_error_rows_show_error_and_no_speedup():
    rows = [
        make_row("hfkit", 2.0, shape=[8, 64]),
        make_row("eager", math.nan, shape=[8, 64], method="error", extra={"error": "out of memory"}),
        make_row("hfkit", 1.0, shape=[4, 64]),
        make_row("eager", 3.0, shape=[4, 64]),
    ]
    table = only_table(rows)
    assert column(table, "shape") == ["4×64", "8×64"]  # sorted by shape
    assert column(table, "eager (ms)") == ["3.00", "error"]
    assert column(table, "hfkit vs eager") == ["3.00×", ""]


def test_missing_providers_leave_empty_cells_and_no_speedup_without_baseline():
    rows = [
        make_row("hfkit", 1.0, shape=[4, 64]),
        make_row("trifast", 2.0, shape=[4, 64]),
        make_row("hfkit", 4.0, shape=[8, 64]),
    ]
    table = only_table(rows)
    assert table.header == ["shape", "hfkit (ms)", "trifast (ms)"]
    assert table.rows == [["4×64", "1.00", "2.00"], ["8×64", "4.00", ""]]


def test_the_torch_provider_is_read_as_the_eager_baseline():
    old = [make_row("hfkit", 0.5), make_row("torch", 1.5)]
    new = [make_row("hfkit", 0.5), make_row("eager", 1.5)]
    assert only_table(old) == only_table(new)
    assert "hfkit vs eager" in only_table(old).header


def test_rows_with_fields_beyond_the_schema_are_read():
    rows = [make_row("hfkit", 1.0, note="extra top-level field"), make_row("eager", 2.0, label=3)]
    assert column(only_table(rows), "hfkit vs eager") == ["2.00×"]


def test_extra_fields_that_tell_measurements_apart_become_columns_and_repeats_keep_the_last():
    def stack(provider, p50, checkpointing, **fields):
        extra = {"checkpointing": checkpointing, "first_call_s": 1.5, **fields.pop("extra", {})}
        return make_row(provider, p50, op="evoformer_stack", extra=extra, **fields)

    rows = [
        stack("hfkit", 300.0, False),
        stack("eager", 750.0, False),
        stack("hfkit", 380.0, True),
        stack("eager", 1000.0, True),
        stack("hfkit", 290.0, False, commit="1234567aaaa"),  # measured again: replaces the first
    ]
    table = only_table(rows)
    assert table.header[0] == "checkpointing"
    assert table.rows == [["no", "290", "750", "2.59×"], ["yes", "380", "1,000", "2.63×"]]
    notes = "\n".join(table.notes)
    assert "1 earlier measurements" in notes and "commit abcdef0, 1234567" in notes


def test_rows_without_commit_or_triton_say_so():
    rows = [
        make_row("hfkit", 1.0, commit=None, triton=None),
        make_row("eager", 2.0, commit=None, triton=None),
    ]
    first = only_table(rows).notes[0]
    assert first == "NVIDIA H200 (`h200`); torch 2.11.0; commit not recorded; timed by cuda_graph."


def test_profiler_rows_get_a_table_of_their_own():
    profile = [
        make_row("aten::mm", 80.0, op="step_profile", extra={"calls": 100, "share_pct": 40.0}),
        make_row("aten::add", 20.0, op="step_profile", extra={"calls": 50, "share_pct": 10.0}),
    ]
    tables = op_tables(rows_to_frame(profile), "h200", "model: step_profile")
    assert [t.title for t in tables] == ["model: step_profile: profiled operators"]
    assert tables[0].header == ["operator", "time (ms)", "calls", "share_pct"]
    assert tables[0].rows == [["aten::mm", "80.0", "100", "40.0"], ["aten::add", "20.0", "50", "10.0"]]


def test_many_providers_are_listed_one_measurement_a_line():
    stages = ["eager", "+Attention", "+LayerNorm", "+A", "+B", "+C", "+D", "+compile"]
    rows = [make_row(s, 1000.0 + i, op="step_waterfall") for i, s in enumerate(stages)]
    table = only_table(rows)
    assert table.header == ["provider", "time (s)"]
    assert column(table, "provider") == stages  # the file's order
    assert column(table, "time (s)")[-1] == "1.01"


def _write(path: Path, rows: list[dict], **meta) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": {"command": "hfkit bench x", **meta}, "rows": rows}))


def test_results_markdown_titles_files_by_stem_and_is_deterministic(tmp_path):
    _write(tmp_path / "h200" / "layer_norm.json", [make_row("hfkit", 1.0), make_row("eager", 2.0)])
    _write(
        tmp_path / "h200" / "evoformer_attention.json",
        [make_row("hfkit", 1.0, op="triangle_attention")],
        note="hand-written note",
    )
    _write(tmp_path / "cpu" / "comms.json", [make_row("gloo", 1.0, op="allreduce", shape=[4096])])
    (tmp_path / "h200" / "other.json").write_text("[1, 2]")
    _write(tmp_path / "h200" / "partial.json", [{"op": "layer_norm", "provider": "hfkit"}])
    _write(tmp_path / "h200" / "tuning" / "sweep.json", [])
    text = results_markdown(tmp_path)
    assert text == results_markdown(tmp_path)
    assert "Generated by `hfkit report`" in text and "never edit by hand" in text
    headings = [line for line in text.splitlines() if line.startswith(("## ", "### ", "#### "))]
    assert headings == [
        "## cpu",
        "### cpu / comms",
        "#### comms: allreduce",
        "## h200",
        "### h200 / evoformer_attention",
        "#### evoformer_attention: triangle_attention",
        "### h200 / layer_norm",
        "#### layer_norm",
        "### h200 / other",
        "### h200 / partial",
    ]
    assert "> hand-written note" in text
    assert "All rows: mode fwd, shape 4.00 KiB, dtype bf16." in text  # an allreduce: shape = bytes
    assert text.count("Not a results document with schema rows; not tabulated.") == 2
    assert "- `tuning/sweep.json`" in text


def test_results_markdown_without_results_files_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="no <gpu>/\\*.json"):
        results_markdown(tmp_path)


def test_headline_reads_ops_from_any_file_name(tmp_path):
    committed = results_dir() / "h200"
    renamed = tmp_path / "h200"
    renamed.mkdir()
    for path in committed.glob("*.json"):
        shutil.copy(path, renamed / f"renamed_{path.name}")
    assert headline_markdown(tmp_path) == headline_markdown(results_dir())


def test_headline_on_hand_made_rows_shows_errors_and_leaves_out_missing_lines(tmp_path):
    def stack(provider, p50, error=None, **fields):
        extra = {"launch": "graph", "checkpointing": False, **({"error": error} if error else {})}
        fields = {"mode": "fwd+bwd", **fields}
        return make_row(provider, p50, op="evoformer_stack", extra=extra, **fields)

    rows = [
        stack("hfkit", 300.0, peak_mem_bytes=2**30),
        stack("torch", math.nan, error="out of memory", method="error"),
        stack("compile", 600.0, peak_mem_bytes=2**31),
        stack("hfkit", 100.0, mode="fwd"),  # not a forward+backward row
    ]
    _write(tmp_path / "h200" / "stack.json", rows)
    lines = headline_markdown(tmp_path).splitlines()
    body = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert body == [
        "| 48-block Evoformer stack, bf16, one CUDA graph (ms) | error | 600 (2.00 GiB) | 300 (1.00 GiB) "
        "|  |  | 2.00× |"
    ]
    with pytest.raises(FileNotFoundError, match="headline: no rows"):
        headline_markdown(tmp_path, gpu="a100")


def test_with_headline_needs_both_markers():
    with pytest.raises(ValueError, match="readme: expected one"):
        with_headline("# no markers here\n", "block")
    with pytest.raises(ValueError, match="found 1 and 0"):
        with_headline(f"{HEADLINE_START}\n", "block")
    assert with_headline(f"a\n{HEADLINE_START}\nx\n{HEADLINE_END}\nb", "NEW") == "a\nNEW\nb"
