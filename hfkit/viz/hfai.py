"""hfai.nn's published LSTM and MultiheadAttention times (A100) beside hfkit's committed H200 results.

The source is the hfai.nn article (the seed `seeds/001_574da3aca49e9154.txt`, in Chinese). For each
configuration it times torch's module and hfai's over "10 consecutive rounds" and reports, in ms per
round, `forward`, `backward` (the backward pass alone) and `all`, which is their sum (to the article's
rounding); for MultiheadAttention also `inference`. Its benchmark section names neither the GPU nor the
dtype: the GPU is the A100 of the article's cluster (Fire-Flyer 2, "万张A100随时待命"), the dtype is taken
as torch's default float32. Our rows come from `hfkit bench multihead_attention` / `hfkit bench lstm`
(`data/results/h200/`), whose `fwd` is the forward and `fwd+bwd` the forward plus the backward: they
compare with the article's `forward` and `all`. The article's LayerNorm numbers are left out: notebook
00's LayerNorm section measures that op, and the article's LayerNorm `all` is not its forward plus backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hfkit.bench.results import load_results
from hfkit.bench.results import results_dir as repo_results_dir

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

__all__ = ["HFAI_PUBLISHED", "HFAI_SOURCE", "HfaiPublished", "hfai_comparison", "hfai_figure", "hfai_notes"]

HFAI_SOURCE = "001_574da3aca49e9154.txt"
HFAI_GPU = "A100"
HFAI_DTYPE = "fp32"
# The dtypes our H200 benchmarks of these ops run; each gets a row, NaN where a result is missing.
H200_DTYPES = ("fp32", "bf16")
H200_PROVIDERS = ("eager", "compile", "hfkit")
H200_FILES = {"multihead_attention": "multihead_attention.json", "lstm": "lstm.json"}
MODES = {"fwd": "fwd", "fwd+bwd": "fwd_bwd"}


@dataclass(frozen=True)
class HfaiPublished:
    """One configuration of the article: torch's and hfai's times in ms per round.

    `shape` is in our benchmarks' order: `[B, L, E, H]` (batch, sequence, embed, heads) for
    `multihead_attention`, `[B, T, I, H]` (batch, sequence, input, hidden) for `lstm`. `*_all_ms` is
    the article's `all`; `*_inference_ms` is None where the article gives none (LSTM).
    """

    op: str
    shape: tuple[int, int, int, int]
    config: str
    torch_fwd_ms: float
    torch_bwd_ms: float
    torch_all_ms: float
    hfai_fwd_ms: float
    hfai_bwd_ms: float
    hfai_all_ms: float
    torch_inference_ms: float | None = None
    hfai_inference_ms: float | None = None
    gpu: str = HFAI_GPU
    dtype: str = HFAI_DTYPE
    source: str = HFAI_SOURCE


HFAI_PUBLISHED: tuple[HfaiPublished, ...] = (
    HfaiPublished(
        "lstm",
        (4, 1000, 985, 985),
        "input 985, hidden 985, 1 layer, bias, batch_first, batch 4, seq 1000",
        torch_fwd_ms=31.78,
        torch_bwd_ms=93.60,
        torch_all_ms=125.38,
        hfai_fwd_ms=4.82,
        hfai_bwd_ms=9.25,
        hfai_all_ms=14.07,
    ),
    HfaiPublished(
        "multihead_attention",
        (200, 256, 1024, 16),
        "batch 200, seq 256, embed 1024, 16 heads",
        torch_fwd_ms=17.581,
        torch_bwd_ms=21.986,
        torch_all_ms=39.567,
        hfai_fwd_ms=12.165,
        hfai_bwd_ms=16.515,
        hfai_all_ms=28.680,
        torch_inference_ms=17.372,
        hfai_inference_ms=12.112,
    ),
    HfaiPublished(
        "multihead_attention",
        (5000, 64, 512, 8),
        "batch 5000, seq 64, embed 512, 8 heads, q = k = v",
        torch_fwd_ms=22.713,
        torch_bwd_ms=41.831,
        torch_all_ms=64.543,
        hfai_fwd_ms=19.599,
        hfai_bwd_ms=24.379,
        hfai_all_ms=43.978,
        torch_inference_ms=22.925,
        hfai_inference_ms=19.037,
    ),
)


def _h200_rows(folder: Path) -> pd.DataFrame | None:
    """The timed (non-error) rows of the MultiheadAttention and LSTM files in `folder`, or None."""
    import pandas as pd

    frames = []
    for op, name in H200_FILES.items():
        path = folder / name
        if not path.is_file():
            continue
        try:
            frames.append(load_results(path, op=op))
        except FileNotFoundError:  # the file holds no rows of this op
            continue
    if not frames:
        return None
    frame = pd.concat(frames, ignore_index=True)
    frame = frame[(frame["method"] != "error") & frame["p50_ms"].notna()]
    return frame


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator and not math.isnan(denominator) else math.nan


def hfai_comparison(results_dir: str | Path | None = None) -> pd.DataFrame:
    """hfai.nn's A100 times beside our H200 times, one row per (op, config, dtype).

    `results_dir` is the folder holding `multihead_attention.json` and `lstm.json` (default:
    `data/results/h200/`); a missing file or row gives NaN, not an error. Columns: `op`, `config`,
    `shape` ('BxLxExH' / 'BxTxIxH'), `dtype`; the article's `a100_{torch,hfai}_{fwd,fwd_bwd}_ms`
    (`fwd_bwd` is its `all`, forward + backward; filled on the `fp32` rows only: the
    article names no dtype, torch's default is float32) and `a100_hfai_speedup_{fwd,fwd_bwd}`
    (torch / hfai); our
    `h200_{eager,compile,hfkit}_{fwd,fwd_bwd}_ms` (p50 of the committed rows) and
    `h200_hfkit_speedup_{fwd,fwd_bwd}` (eager / hfkit); `h200_gpu` and `h200_commit` (where the
    rows came from, "" when none).
    """
    import pandas as pd

    folder = Path(results_dir) if results_dir is not None else repo_results_dir() / "h200"
    ours = _h200_rows(folder)
    records = []
    for published in HFAI_PUBLISHED:
        shape = "x".join(str(d) for d in published.shape)
        for dtype in H200_DTYPES:
            record: dict[str, object] = {
                "op": published.op,
                "config": published.config,
                "shape": shape,
                "dtype": dtype,
            }
            same_dtype = dtype == published.dtype
            for mode, suffix in MODES.items():
                torch_ms = published.torch_fwd_ms if mode == "fwd" else published.torch_all_ms
                hfai_ms = published.hfai_fwd_ms if mode == "fwd" else published.hfai_all_ms
                record[f"a100_torch_{suffix}_ms"] = torch_ms if same_dtype else math.nan
                record[f"a100_hfai_{suffix}_ms"] = hfai_ms if same_dtype else math.nan
            case = pd.DataFrame()
            if ours is not None:
                case = ours[
                    (ours["op"] == published.op) & (ours["shape_str"] == shape) & (ours["dtype"] == dtype)
                ]
            for mode, suffix in MODES.items():
                for provider in H200_PROVIDERS:
                    rows = (
                        case[(case["mode"] == mode) & (case["provider"] == provider)] if len(case) else case
                    )
                    # the file's last row of a case is its newest measurement
                    record[f"h200_{provider}_{suffix}_ms"] = (
                        float(rows["p50_ms"].iloc[-1]) if len(rows) else math.nan
                    )
            for suffix in MODES.values():
                record[f"a100_hfai_speedup_{suffix}"] = _ratio(
                    record[f"a100_torch_{suffix}_ms"], record[f"a100_hfai_{suffix}_ms"]
                )
                record[f"h200_hfkit_speedup_{suffix}"] = _ratio(
                    record[f"h200_eager_{suffix}_ms"], record[f"h200_hfkit_{suffix}_ms"]
                )
            record["h200_gpu"] = ", ".join(sorted(set(case["gpu"]))) if len(case) else ""
            record["h200_commit"] = (
                ", ".join(sorted({str(c)[:7] for c in case["commit"]})) if len(case) else ""
            )
            records.append(record)
    return pd.DataFrame.from_records(records)


def hfai_notes(frame: pd.DataFrame) -> list[str]:
    """One sentence per row of `hfai_comparison` output: its forward+backward times on each GPU.

    Says which H200 results are missing instead of leaving NaNs unexplained; speed-ups below 1 are
    printed as they are (hfkit slower than eager).
    """
    notes = []
    for row in frame.to_dict("records"):
        head = f"{row['op']} {row['shape']} {row['dtype']}"
        a100 = ""
        if not math.isnan(row["a100_hfai_fwd_bwd_ms"]):
            a100 = (
                f"A100 (article): torch {row['a100_torch_fwd_bwd_ms']:.2f} ms, hfai "
                f"{row['a100_hfai_fwd_bwd_ms']:.2f} ms ({row['a100_hfai_speedup_fwd_bwd']:.2f}×); "
            )
        if math.isnan(row["h200_hfkit_fwd_bwd_ms"]) or math.isnan(row["h200_eager_fwd_bwd_ms"]):
            h200 = "no H200 eager/hfkit forward+backward result committed"
        else:
            h200 = (
                f"{row['h200_gpu']} @ {row['h200_commit']}: eager {row['h200_eager_fwd_bwd_ms']:.2f} ms, "
                f"hfkit {row['h200_hfkit_fwd_bwd_ms']:.2f} ms "
                f"({row['h200_hfkit_speedup_fwd_bwd']:.2f}× eager)"
            )
        notes.append(f"{head}, forward+backward: {a100}{h200}")
    return notes


BAR_SERIES = {  # column stem -> legend name, in the order the bars are drawn
    "a100_torch": "A100 torch (article)",
    "a100_hfai": "A100 hfai (article)",
    "h200_eager": "H200 eager",
    "h200_compile": "H200 torch.compile",
    "h200_hfkit": "H200 hfkit",
}
BAR_COLORS = {
    "A100 torch (article)": "#bcbd22",
    "A100 hfai (article)": "#ff7f0e",
    "H200 eager": "#7f7f7f",
    "H200 torch.compile": "#1f77b4",
    "H200 hfkit": "#d62728",
}


def hfai_figure(frame: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Grouped bars of `hfai_comparison` output: time (ms, log axis) per op, shape and dtype, one bar
    per GPU and provider, one facet row per mode (forward, forward+backward); NaNs draw no bar."""
    import pandas as pd
    import plotly.express as px

    long = []
    for row in frame.to_dict("records"):
        case = f"{row['op']}<br>{row['shape']} {row['dtype']}"
        for mode, suffix in MODES.items():
            for stem, name in BAR_SERIES.items():
                long.append({"case": case, "mode": mode, "series": name, "ms": row[f"{stem}_{suffix}_ms"]})
    data = pd.DataFrame(long).dropna(subset=["ms"])
    fig = px.bar(
        data,
        x="case",
        y="ms",
        color="series",
        barmode="group",
        facet_row="mode",
        log_y=True,
        category_orders={
            "series": list(BAR_SERIES.values()),
            "mode": list(MODES),
            "case": list(dict.fromkeys(item["case"] for item in long)),
        },
        color_discrete_map=BAR_COLORS,
        labels={"case": "op, shape, dtype", "ms": "time (ms)", "series": ""},
        title=title or "hfai.nn's published A100 times beside hfkit's H200 results (lower is better)",
    )
    fig.update_layout(height=2 * 320 + 120, legend_title_text="")
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
    return fig
