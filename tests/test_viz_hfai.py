"""Tests of hfkit.viz.hfai: the article's published table, and the comparison built from results files."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from hfkit.bench.cases.lstm import HFAI_SHAPE as LSTM_BENCH_SHAPE
from hfkit.bench.cases.multihead_attention import HFAI_SHAPES as MHA_BENCH_SHAPES
from hfkit.bench.results import results_dir
from hfkit.viz.hfai import HFAI_PUBLISHED, hfai_comparison, hfai_figure, hfai_notes

H200 = results_dir() / "h200"
SEED = Path("/work/shared/seeds/001_574da3aca49e9154.txt")
NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "00_quickstart.ipynb"

# The article's numbers, as printed (ms per round): (op, shape) -> torch / hfai (forward, backward, all)
# and, for MultiheadAttention, inference.
ARTICLE = {
    ("lstm", (4, 1000, 985, 985)): {
        "torch": (31.78, 93.60, 125.38, None),
        "hfai": (4.82, 9.25, 14.07, None),
    },
    ("multihead_attention", (200, 256, 1024, 16)): {
        "torch": (17.581, 21.986, 39.567, 17.372),
        "hfai": (12.165, 16.515, 28.680, 12.112),
    },
    ("multihead_attention", (5000, 64, 512, 8)): {
        "torch": (22.713, 41.831, 64.543, 22.925),
        "hfai": (19.599, 24.379, 43.978, 19.037),
    },
}
A100_COLUMNS = [f"a100_{p}_{m}_ms" for p in ("torch", "hfai") for m in ("fwd", "fwd_bwd")]
H200_COLUMNS = [f"h200_{p}_{m}_ms" for p in ("eager", "compile", "hfkit") for m in ("fwd", "fwd_bwd")]


def published(op: str, shape: tuple[int, ...]):
    (entry,) = [p for p in HFAI_PUBLISHED if p.op == op and p.shape == shape]
    return entry


def test_published_table_holds_the_articles_numbers():
    assert {(p.op, p.shape) for p in HFAI_PUBLISHED} == set(ARTICLE)
    for (op, shape), numbers in ARTICLE.items():
        entry = published(op, shape)
        assert (entry.torch_fwd_ms, entry.torch_bwd_ms, entry.torch_all_ms, entry.torch_inference_ms) == (
            numbers["torch"]
        )
        assert (entry.hfai_fwd_ms, entry.hfai_bwd_ms, entry.hfai_all_ms, entry.hfai_inference_ms) == (
            numbers["hfai"]
        )
        # the article's "all" is forward + backward, to its last printed digit
        assert entry.torch_all_ms == pytest.approx(entry.torch_fwd_ms + entry.torch_bwd_ms, abs=2e-3)
        assert entry.hfai_all_ms == pytest.approx(entry.hfai_fwd_ms + entry.hfai_bwd_ms, abs=2e-3)
        assert (entry.gpu, entry.dtype, entry.source) == ("A100", "fp32", SEED.name)


def test_published_shapes_are_the_benchmarked_ones():
    assert {p.shape for p in HFAI_PUBLISHED if p.op == "lstm"} == {LSTM_BENCH_SHAPE}
    assert {p.shape for p in HFAI_PUBLISHED if p.op == "multihead_attention"} == set(MHA_BENCH_SHAPES)


@pytest.mark.skipif(not SEED.is_file(), reason="the seed article is not on this machine")
def test_published_numbers_appear_in_the_article():
    text = SEED.read_text()
    for entry in HFAI_PUBLISHED:
        for value in (entry.torch_fwd_ms, entry.torch_bwd_ms, entry.hfai_fwd_ms, entry.hfai_bwd_ms):
            assert f"{value:.2f}" in text or f"{value:.3f}" in text, value


def test_comparison_rows_and_columns():
    frame = hfai_comparison()
    assert list(frame[["op", "shape", "dtype"]].itertuples(index=False, name=None)) == [
        ("lstm", "4x1000x985x985", "fp32"),
        ("lstm", "4x1000x985x985", "bf16"),
        ("multihead_attention", "200x256x1024x16", "fp32"),
        ("multihead_attention", "200x256x1024x16", "bf16"),
        ("multihead_attention", "5000x64x512x8", "fp32"),
        ("multihead_attention", "5000x64x512x8", "bf16"),
    ]
    for column in A100_COLUMNS + H200_COLUMNS + ["h200_gpu", "h200_commit", "config"]:
        assert column in frame, column
    # the article's numbers sit on its dtype's rows only
    fp32 = frame[frame["dtype"] == "fp32"]
    bf16 = frame[frame["dtype"] == "bf16"]
    assert fp32[A100_COLUMNS].notna().all().all()
    assert bf16[A100_COLUMNS].isna().all().all()
    lstm = frame[frame["op"] == "lstm"].iloc[0]
    assert lstm["a100_torch_fwd_bwd_ms"] == 125.38 and lstm["a100_hfai_fwd_ms"] == 4.82
    assert lstm["a100_hfai_speedup_fwd_bwd"] == pytest.approx(125.38 / 14.07)


@pytest.mark.parametrize("op", ["multihead_attention", "lstm"])
def test_comparison_matches_the_committed_json(op):
    path = H200 / f"{op}.json"
    if not path.is_file():
        pytest.skip(f"no committed H200 results {path.name}")
    doc = json.loads(path.read_text())
    frame = hfai_comparison()
    ok_rows = [r for r in doc["rows"] if r.get("method") != "error"]
    shape = lambda r: "x".join(map(str, r["shape"]))  # noqa: E731
    p50 = {(r["provider"], shape(r), r["dtype"], r["mode"]): r["p50_ms"] for r in ok_rows}
    rows = frame[frame["op"] == op].to_dict("records")
    checked = 0
    for row in rows:
        for mode, suffix in (("fwd", "fwd"), ("fwd+bwd", "fwd_bwd")):
            for provider in ("eager", "compile", "hfkit"):
                key = (provider, row["shape"], row["dtype"], mode)
                assert row[f"h200_{provider}_{suffix}_ms"] == pytest.approx(p50[key])
                checked += 1
            eager, hfkit = (
                p50[("eager", row["shape"], row["dtype"], mode)],
                p50[("hfkit", row["shape"], row["dtype"], mode)],
            )
            assert row[f"h200_hfkit_speedup_{suffix}"] == pytest.approx(eager / hfkit)
        assert row["h200_gpu"] == doc["meta"]["gpu"]
        # The commits of the case's rows (an --append run keeps other rows' commits beside its own).
        case = [r for r in ok_rows if shape(r) == row["shape"] and r["dtype"] == row["dtype"]]
        assert row["h200_commit"] == ", ".join(sorted({r["commit"][:7] for r in case}))
    assert rows and checked == len(rows) * 2 * 3


def test_notebook_quotes_the_committed_lstm_numbers():
    path = H200 / "lstm.json"
    if not path.is_file():
        pytest.skip("no committed H200 results lstm.json")
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    (section,) = ["".join(c["source"]) for c in cells if "".join(c["source"]).startswith("## 5 · hfai.nn")]
    rows = [r for r in json.loads(path.read_text())["rows"] if r.get("method") != "error"]
    quoted = 0
    for row in rows:
        if row["shape"] == list(LSTM_BENCH_SHAPE) and row["provider"] in ("eager", "hfkit"):
            assert f"{row['p50_ms']:.1f} ms" in section, (row["provider"], row["dtype"], row["mode"])
            quoted += 1
    assert quoted == 8


def test_missing_results_give_nans(tmp_path):
    frame = hfai_comparison(tmp_path)  # an empty folder: no results files at all
    assert len(frame) == 6
    assert frame[H200_COLUMNS + ["h200_hfkit_speedup_fwd", "h200_hfkit_speedup_fwd_bwd"]].isna().all().all()
    assert (frame["h200_commit"] == "").all()
    assert frame[frame["dtype"] == "fp32"][A100_COLUMNS].notna().all().all()
    notes = hfai_notes(frame)
    assert len(notes) == 6 and all("no H200" in n for n in notes)
    # the article's two series in each mode's facet; no H200 bars
    assert {trace.name for trace in hfai_figure(frame).data} == {
        "A100 torch (article)",
        "A100 hfai (article)",
    }


def test_one_missing_file_leaves_the_other_ops_rows(tmp_path):
    source = H200 / "multihead_attention.json"
    if not source.is_file():
        pytest.skip("no committed H200 MultiheadAttention results")
    shutil.copy(source, tmp_path / source.name)
    # an LSTM file with one row only: the other LSTM cells stay NaN
    doc = json.loads(source.read_text())
    row = dict(doc["rows"][0], op="lstm", shape=[4, 1000, 985, 985], dtype="fp32", mode="fwd+bwd")
    lstm_rows = [dict(row, provider="eager", p50_ms=40.0), dict(row, provider="hfkit", p50_ms=120.0)]
    (tmp_path / "lstm.json").write_text(json.dumps({"meta": doc["meta"], "rows": lstm_rows}))
    frame = hfai_comparison(tmp_path)
    lstm = frame[(frame["op"] == "lstm") & (frame["dtype"] == "fp32")].iloc[0]
    assert lstm["h200_hfkit_speedup_fwd_bwd"] == pytest.approx(40.0 / 120.0)
    assert math.isnan(lstm["h200_eager_fwd_ms"]) and math.isnan(lstm["h200_compile_fwd_bwd_ms"])
    assert "0.33× eager" in hfai_notes(frame)[0]
    names = {trace.name for trace in hfai_figure(frame).data}
    assert names == {
        "A100 torch (article)",
        "A100 hfai (article)",
        "H200 eager",
        "H200 torch.compile",
        "H200 hfkit",
    }
    mha = frame[frame["op"] == "multihead_attention"]
    assert mha[H200_COLUMNS].notna().all().all()
