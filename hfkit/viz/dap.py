"""Figures, tables, models and the live check of notebook 06 (Dynamic Axial Parallelism and long
sequences).

- The layout: `shard_owner` / `dap_layout` say which rank of a DAP group of P holds each MSA row,
  MSA column, pair row or pair column in each of the four layouts an Evoformer block goes through
  (`LAYOUT_STAGES`, FastFold's layout as `hfkit.parallel.dap` implements it); `dap_layout_figure`
  draws them.
- Communication: `dap_comm_table` gives, per N, group size and collective, what one rank receives in
  one block's forward (`hfkit.parallel.dap.dap_block_comm`) in bytes and, as a model, in time over a
  link of a stated bandwidth and latency; `dap_comm_summary` sums it per block, `dap_comm_breakdown`
  gives one (N, P) by collective, `dap_comm_figure` plots it.
- Memory and time per GPU (`dap_model_table`, `dap_model_figure`): a model, labelled so. One GPU is
  `hfkit.model.inference.lean_forward`'s working set (`lean_working_set_bytes`); P GPUs are the same
  chunking applied to one rank's shards plus the tensors DAP gathers whole (`dap_working_set_bytes`),
  with the attention logits counted (plain torch) or not (hfkit's fused attention holds none).
  Time is the block's matmul FLOPs (`evoformer_block_flops`) split over the ranks at a stated rate,
  plus the communication model, without overlap.
- Measured: `load_longseq` reads `data/results/<gpu>/longseq.json` (None when absent),
  `measure_longseq_here` measures on this machine's GPU (None without one), `measured_tflops` gives
  the rate they imply, `longseq_table` / `longseq_figure` show them. `load_dap_runs` reads every
  `data/results/<gpu>x<G>/dap.json` (`hfkit bench dap`, `make bench-multigpu`; None when there is none),
  `dap_scaling_table` / `dap_scaling_figure` show time and scaling efficiency against the GPU count.
- `dap_exactness_check` runs `to_dap` of a tiny float64 Evoformer block on 2 gloo CPU processes and
  reports the largest difference of its outputs and gradients from the single-process block.
- `DAPExplorer`: an N slider and dropdowns for the GPUs, the chunk and the attention (fused, or plain
  torch with its logits) over all of the above, the static result first.

plotly and ipywidgets are imported inside the functions (they are the `notebooks` extra).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hfkit.bench.model import evoformer_block_flops
from hfkit.model.config import ModelConfig
from hfkit.model.inference import LEAN_OPS, BlockWidths
from hfkit.parallel.cost_model import h200_nvlink
from hfkit.parallel.dap import dap_block_comm
from hfkit.viz.notebook import render_into, show_static_then_widget

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

__all__ = [
    "ASSUMED_TFLOPS",
    "CHUNK_SIZES",
    "DEVICE_GIB",
    "GPU_COUNTS",
    "LAYOUT_STAGES",
    "LINK_ALPHA_US",
    "LINK_GBPS",
    "N_VALUES",
    "DAPExplorer",
    "LayoutStage",
    "dap_comm_breakdown",
    "dap_comm_figure",
    "dap_comm_summary",
    "dap_comm_table",
    "dap_exactness_check",
    "dap_layout",
    "dap_layout_figure",
    "dap_model_figure",
    "dap_model_table",
    "dap_scaling_figure",
    "dap_scaling_table",
    "dap_working_set_bytes",
    "load_dap_runs",
    "load_longseq",
    "longseq_figure",
    "longseq_table",
    "measure_longseq_here",
    "measured_tflops",
    "shard_owner",
]

# The link the communication model assumes: H200 NVLink one way, and a per-collective latency
# (`hfkit.parallel.cost_model.h200_nvlink`'s values).
LINK_GBPS = h200_nvlink(nodes=1).nvlink_gbps
LINK_ALPHA_US = h200_nvlink(nodes=1).alpha_us
# The matmul rate the time model assumes for one block on one GPU when no measurement gives one: an
# assumption of the order a bf16 Evoformer block reaches on an H200 at N in the thousands.
ASSUMED_TFLOPS = 150.0
# H200 device memory, the line the memory model is drawn against.
DEVICE_GIB = 141.0
GPU_COUNTS = (1, 2, 4, 8)
N_VALUES = (256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 10240, 12288, 16384)
CHUNK_SIZES = (4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class LayoutStage:
    """One layout of a DAP Evoformer block: which tensor (`"m"`, S x N, or `"z"`, N x N), along which
    axis it is sharded (`"rows"` or `"columns"`), the ops that run in it, and the collective that
    leaves it (empty for the last)."""

    name: str
    tensor: str
    axis: str
    ops: str
    then: str


LAYOUT_STAGES = (
    LayoutStage(
        "MSA by rows", "m", "rows", "MSA row attention (pair bias gathered: H channels)",
        "all-to-all to columns",
    ),
    LayoutStage(
        "MSA by columns", "m", "columns",
        "column attention, MSA transition, outer product mean (b gathered over all residues)",
        "all-to-all to rows (next block)",
    ),
    LayoutStage(
        "pair by rows", "z", "rows",
        "outer product mean's update, triangle multiplication (b gathered; incoming: a transposed), "
        "starting-node attention (bias gathered), pair transition",
        "all-to-all to columns",
    ),
    LayoutStage(
        "pair by columns", "z", "columns", "ending-node attention (bias gathered)",
        "all-to-all back to rows",
    ),
)  # fmt: skip


def shard_owner(index: np.ndarray | Sequence[int], size: int, group_size: int) -> np.ndarray:
    """The rank of a DAP group of `group_size` that holds each position `index` (0 <= index < size)
    of an axis of `size`: the axis is padded to a multiple of the group size and split evenly, so rank
    r holds positions [r * ceil(size / P), (r + 1) * ceil(size / P)). Returns an int array shaped as
    `index`."""
    if group_size < 1:
        raise ValueError(f"group_size: expected >= 1, got {group_size}")
    index = np.asarray(index)
    if index.size and (index.min() < 0 or index.max() >= size):
        raise ValueError(f"index: expected positions in [0, {size}), got {index.min()}..{index.max()}")
    return index // math.ceil(size / group_size)


def _sample(size: int, samples: int) -> np.ndarray:
    """Every position of an axis of `size`, or `samples` evenly spread ones (first and last kept)."""
    if size <= samples:
        return np.arange(size)
    return np.unique(np.linspace(0, size - 1, samples).round().astype(int))


def dap_layout(
    n_seq: int, n_res: int, group_size: int, samples: int = 64
) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """For each of `LAYOUT_STAGES`, (row positions, column positions, owner [rows, cols]): the rank
    that holds each element of the MSA representation (S = n_seq rows, N = n_res columns) or the pair
    representation (N x N) in that layout. Axes longer than `samples` are shown at `samples` evenly
    spread positions."""
    for name, value in (("n_seq", n_seq), ("n_res", n_res), ("group_size", group_size)):
        if value < 1:
            raise ValueError(f"{name}: expected >= 1, got {value}")
    layout = {}
    for stage in LAYOUT_STAGES:
        n_rows = n_seq if stage.tensor == "m" else n_res
        rows, cols = _sample(n_rows, samples), _sample(n_res, samples)
        if stage.axis == "rows":
            owner = np.repeat(shard_owner(rows, n_rows, group_size)[:, None], len(cols), axis=1)
        else:
            owner = np.repeat(shard_owner(cols, n_res, group_size)[None, :], len(rows), axis=0)
        layout[stage.name] = (rows, cols, owner)
    return layout


def _shard_note(size: int, group_size: int) -> str:
    """'N_p/P = k each' and, with padding, how many real positions the last rank holds."""
    per = math.ceil(size / group_size)
    last = size - per * (group_size - 1)
    note = f"{per} each"
    if per * group_size != size:
        note += f", padded to {per * group_size}: rank {group_size - 1} holds {max(last, 0)} real"
    return note


def dap_layout_figure(n_seq: int, n_res: int, group_size: int) -> go.Figure:
    """Four heatmaps, one per layout of `LAYOUT_STAGES` in block order, coloured by the rank that holds
    each element of m [S, N] or z [N, N] for a DAP group of `group_size` (long axes sampled, see
    `dap_layout`); hovering names the ops run in a layout, and the collective that leaves it is
    written under each panel."""
    import plotly.colors as pc
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    layout = dap_layout(n_seq, n_res, group_size)
    palette = pc.qualitative.Plotly
    p = group_size
    # A discrete colour scale: rank r maps to palette[r] over [r / P, (r + 1) / P].
    scale = []
    for r in range(p):
        colour = palette[r % len(palette)]
        scale += [[r / p, colour], [(r + 1) / p, colour]]
    fig = make_subplots(
        rows=1, cols=4, subplot_titles=[f"{i + 1}. {s.name}" for i, s in enumerate(LAYOUT_STAGES)],
        horizontal_spacing=0.05,
    )  # fmt: skip
    for i, stage in enumerate(LAYOUT_STAGES):
        rows, cols, owner = layout[stage.name]
        row_label = "MSA row s" if stage.tensor == "m" else "residue i"
        fig.add_trace(
            go.Heatmap(
                z=owner, x=cols, y=rows, zmin=-0.5, zmax=p - 0.5, colorscale=scale, showscale=i == 0,
                colorbar={"title": "rank", "tickvals": list(range(p))},
                hovertemplate=f"{row_label} %{{y}}, residue %{{x}}: rank %{{z}}<extra>{stage.ops}</extra>",
            ),
            row=1, col=i + 1,
        )  # fmt: skip
        fig.update_yaxes(autorange="reversed", title_text=row_label, row=1, col=i + 1)
        x_label = f"residue{' j' if stage.tensor == 'z' else ''}<br>then: {stage.then}"
        fig.update_xaxes(title_text=x_label, title_font_size=10, row=1, col=i + 1)
    fig.update_layout(
        height=430,
        title=(
            f"DAP layout over {p} rank{'s' * (p > 1)}: S = {n_seq} MSA rows ({_shard_note(n_seq, p)}), "
            f"N = {n_res} residues ({_shard_note(n_res, p)})"
        ),
        title_font_size=13,
    )
    return fig


def dap_comm_table(
    n_res_values: Sequence[int],
    group_sizes: Sequence[int],
    n_seq: int,
    config: ModelConfig,
    itemsize: int = 2,
    link_gbps: float = LINK_GBPS,
    alpha_us: float = LINK_ALPHA_US,
) -> pd.DataFrame:
    """One row per (N, group size P, collective) of one DAP Evoformer block's forward
    (`dap_block_comm`): `elements` and `bytes` (of `itemsize`) one rank receives, and `model_ms`, the
    time of that collective modelled as alpha + bytes / link (latency `alpha_us`, `link_gbps` GB/s one
    way per rank; 0 for P = 1). Columns: n_res, gpus, collective, elements, bytes, model_ms."""
    import pandas as pd

    rows = []
    for n in n_res_values:
        for p in group_sizes:
            for name, elements in dap_block_comm(n_seq, n, config, p).items():
                nbytes = elements * itemsize
                seconds = 0.0 if p == 1 else alpha_us * 1e-6 + nbytes / (link_gbps * 1e9)
                rows.append(
                    {"n_res": n, "gpus": p, "collective": name, "elements": elements, "bytes": nbytes,
                     "model_ms": seconds * 1e3}
                )  # fmt: skip
    return pd.DataFrame(rows, columns=["n_res", "gpus", "collective", "elements", "bytes", "model_ms"])


def dap_comm_summary(table: pd.DataFrame) -> pd.DataFrame:
    """A `dap_comm_table` summed per (N, gpus): `MiB_per_rank` received in one block's forward and its
    `model_ms`."""
    summary = table.groupby(["n_res", "gpus"], as_index=False)[["bytes", "model_ms"]].sum()
    summary["MiB_per_rank"] = summary.pop("bytes") / 2**20
    return summary[["n_res", "gpus", "MiB_per_rank", "model_ms"]]


def dap_comm_breakdown(
    n_res: int,
    gpus: int,
    n_seq: int,
    config: ModelConfig,
    itemsize: int = 2,
    link_gbps: float = LINK_GBPS,
    alpha_us: float = LINK_ALPHA_US,
) -> pd.DataFrame:
    """One rank's communication in one block's forward at (N = n_res, P = gpus), by collective in
    block order: collective, MiB received, model_ms (`dap_comm_table`'s model)."""
    table = dap_comm_table([n_res], [gpus], n_seq, config, itemsize, link_gbps, alpha_us)
    return table.assign(MiB=table["bytes"] / 2**20)[["collective", "MiB", "model_ms"]]


def dap_comm_figure(table: pd.DataFrame, link_gbps: float = LINK_GBPS) -> go.Figure:
    """Two panels from a `dap_comm_table` (P > 1): MiB one rank receives per block's forward against N
    (log-log), one line per group size; and the modelled time of those collectives at `link_gbps`."""
    import plotly.express as px

    summary = dap_comm_summary(table[table["gpus"] > 1])
    long = summary.melt(id_vars=["n_res", "gpus"], value_vars=["MiB_per_rank", "model_ms"])
    long["value_name"] = long["variable"].map(
        {"MiB_per_rank": "MiB received per rank", "model_ms": f"ms at {link_gbps:g} GB/s (model)"}
    )
    long["gpus"] = long["gpus"].astype(str)
    fig = px.line(
        long, x="n_res", y="value", color="gpus", facet_col="value_name", markers=True, log_x=True,
        log_y=True, labels={"n_res": "N (residues)", "value": "", "gpus": "DAP group"},
        title="Communication of one DAP Evoformer block's forward, per rank (backward: as much again)",
    )  # fmt: skip
    fig.update_yaxes(matches=None, showticklabels=True)
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
    fig.update_layout(height=400)
    return fig


def dap_working_set_bytes(
    widths: BlockWidths,
    n_seq: int,
    n_res: int,
    group_size: int,
    chunk_size: int,
    itemsize: int,
    logits: bool = True,
) -> dict[str, int]:
    """Modelled peak bytes each op (`LEAN_OPS`) allocates on one rank of a DAP group of P beyond its
    shards of m [S/P, N, C_m] and z [N/P, N, C_z], if `lean_forward`'s chunking ran on the shards:
    `lean_working_set_bytes`'s terms with each chunked axis cut to the rank's shard (S/P MSA rows in
    row attention; N/P residues or pair rows elsewhere; the MSA transition runs on S rows of the N/P
    column shard), the tensors DAP gathers whole kept whole (row attention's pair bias H_m N², the
    outer product's b S N C_o, triangle multiplication's b C_h N², the triangle biases H_z N²), and for
    P > 1 the out-of-place transposes (m by columns S (N/P) C_m beside the rows; the triangle
    multiplication's local b and transposed a, 2 C_h (N/P) N; z by columns (N/P) N C_z). P = 1 gives
    `lean_working_set_bytes` exactly. hfkit's `to_dap` runs the triangle multiplication unchunked, so
    it holds more than this. `logits`: the attention terms count plain-torch logits and their softmax,
    2 c H L² for c rows of L keys (as `lean_working_set_bytes` does); without, they are left out, as
    hfkit's fused attention never holds them. Returns {op: bytes}."""
    if group_size < 1 or chunk_size < 1:
        raise ValueError(f"group_size, chunk_size: expected >= 1, got {group_size}, {chunk_size}")
    w, s, n, p = widths, n_seq, n_res, group_size
    s_p, n_p = math.ceil(s / p), math.ceil(n / p)
    r, k = min(chunk_size, s_p), min(chunk_size, n_p)
    r_cols = min(chunk_size, s)
    sharded = p > 1
    qkvgo_m = 5 * w.heads_msa * w.c_hidden_msa
    qkvgo_z = 5 * w.heads_pair * w.c_hidden_pair
    m_cols = sharded * s * n_p * w.c_m
    held = 2 * logits  # logits and their softmax, per attention row
    elements = (
        w.heads_msa * n * n + r * n * (2 * w.c_m + qkvgo_m) + held * r * w.heads_msa * n * n,
        m_cols + k * s * (2 * w.c_m + qkvgo_m) + held * k * w.heads_msa * s * s,
        m_cols + r_cols * n_p * w.c_m * (2 + 2 * w.transition_n),
        m_cols + (s * n_p + s * n) * w.c_hidden_opm + k * n * (w.c_hidden_opm**2 + 2 * w.c_z),
        w.c_hidden_mul * n * (n + 2 * sharded * n_p) + k * n * (4 * w.c_z + 6 * w.c_hidden_mul),
        sharded * n_p * n * w.c_z + w.heads_pair * n * n * (1 + held * k) + k * n * (2 * w.c_z + qkvgo_z),
        k * n * w.c_z * (2 + 2 * w.transition_n),
    )
    return {op: int(e * itemsize) for op, e in zip(LEAN_OPS, elements, strict=True)}


def dap_model_table(
    n_res_values: Sequence[int],
    gpu_counts: Sequence[int],
    config: ModelConfig,
    n_seq: int = 128,
    chunk_size: int = 32,
    itemsize: int = 2,
    tflops: float = ASSUMED_TFLOPS,
    link_gbps: float = LINK_GBPS,
    alpha_us: float = LINK_ALPHA_US,
    logits: bool = True,
) -> pd.DataFrame:
    """Modelled memory and time of one Evoformer block's inference per GPU, one row per (N, GPUs):
    `resident_GiB` (the rank's shards of m and z), `working_GiB` (the largest op of
    `dap_working_set_bytes` with `logits`, named in `peak_op`), `memory_GiB` (their sum; parameters
    left out, a few MiB), `compute_s` (`evoformer_block_flops` / GPUs at `tflops`), `comm_s`
    (`dap_comm_table`'s collectives, forward only), `block_s` (compute + communication, not
    overlapped) and `stack_s` (`config.no_blocks` blocks). `itemsize` 2: bf16."""
    import pandas as pd

    widths = BlockWidths.from_config(config)
    comm = dap_comm_summary(
        dap_comm_table(n_res_values, gpu_counts, n_seq, config, itemsize, link_gbps, alpha_us)
    ).set_index(["n_res", "gpus"])["model_ms"]
    rows = []
    for n in n_res_values:
        flops = evoformer_block_flops(n_seq, n, config)
        for p in gpu_counts:
            s_p, n_p = math.ceil(n_seq / p), math.ceil(n / p)
            resident = (s_p * n * config.c_m + n_p * n * config.c_z) * itemsize
            ops = dap_working_set_bytes(widths, n_seq, n, p, chunk_size, itemsize, logits)
            peak_op = max(ops, key=ops.get)
            compute_s = flops / p / (tflops * 1e12)
            comm_s = float(comm[(n, p)]) / 1e3
            rows.append(
                {
                    "n_res": n,
                    "gpus": p,
                    "resident_GiB": resident / 2**30,
                    "working_GiB": ops[peak_op] / 2**30,
                    "memory_GiB": (resident + ops[peak_op]) / 2**30,
                    "peak_op": peak_op,
                    "compute_s": compute_s,
                    "comm_s": comm_s,
                    "block_s": compute_s + comm_s,
                    "stack_s": config.no_blocks * (compute_s + comm_s),
                }
            )
    return pd.DataFrame(rows)


def dap_model_figure(
    table: pd.DataFrame,
    measured: pd.DataFrame | None = None,
    device_gib: float = DEVICE_GIB,
    n_blocks: int = 48,
    marker_n: int | None = None,
) -> go.Figure:
    """Two panels of a `dap_model_table` against N, one line per GPU count, all labelled "modelled":
    memory per GPU (with a line at `device_gib`) and the time of `n_blocks` blocks. `measured` (a
    `longseq_table`) adds its one-GPU points as markers; `marker_n` draws a vertical line at that N."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(
        rows=1, cols=2, horizontal_spacing=0.1,
        subplot_titles=("memory per GPU (GiB)", f"time of {n_blocks} blocks (s)"),
    )  # fmt: skip
    for p, group in table.groupby("gpus"):
        name = f"{p} GPU{'s' * (p > 1)} (modelled)"
        hover = group["peak_op"]
        for col, y in ((1, group["memory_GiB"]), (2, group["block_s"] * n_blocks)):
            fig.add_trace(
                go.Scatter(
                    x=group["n_res"], y=y, mode="lines+markers", name=name, legendgroup=name,
                    showlegend=col == 1, line={"dash": "solid" if p == 1 else "dash"}, customdata=hover,
                    hovertemplate="N %{x}: %{y:.3g}<br>peak op: %{customdata}<extra>" + name + "</extra>",
                ),
                row=1, col=col,
            )  # fmt: skip
    if measured is not None and len(measured):
        for provider, group in measured.groupby("provider"):
            name = f"1 GPU, {provider} (measured)"
            text = "chunk " + group["chunk"].astype(str)
            for col, y in ((1, group["total_GiB"]), (2, group["seconds"] * n_blocks)):
                fig.add_trace(
                    go.Scatter(
                        x=group["n_res"], y=y, mode="markers", name=name, legendgroup=name,
                        showlegend=col == 1, marker={"symbol": "x", "size": 10}, text=text,
                        hovertemplate="N %{x}: %{y:.3g} (%{text})<extra>" + name + "</extra>",
                    ),
                    row=1, col=col,
                )  # fmt: skip
    # A trace rather than `add_hline`: plotly places a line's annotation wrongly on a log axis.
    span = [table["n_res"].min(), table["n_res"].max()]
    fig.add_trace(
        go.Scatter(
            x=span, y=[device_gib] * 2, mode="lines", name=f"device memory ({device_gib:g} GiB)",
            line={"dash": "dot", "color": "black"}, hoverinfo="skip",
        ),
        row=1, col=1,
    )  # fmt: skip
    if marker_n is not None:
        for col in (1, 2):
            fig.add_vline(x=marker_n, line_dash="dot", line_color="grey", row=1, col=col)
    fig.update_xaxes(type="log", title_text="N (residues)")
    fig.update_yaxes(type="log")
    fig.update_layout(
        height=430,
        title="Evoformer inference per GPU against N: modelled (lines)"
        + (", measured (×)" if measured is not None and len(measured) else ""),
    )
    return fig


def load_longseq(gpu: str = "h200", root: str | Path | None = None) -> pd.DataFrame | None:
    """The rows of `<root>/<gpu>/longseq.json` (default root: `data/results`) as a results frame
    (`hfkit.bench.results.load_results`), or None when the file does not exist."""
    from hfkit.bench.results import load_results, results_dir

    path = Path(root or results_dir()) / gpu / "longseq.json"
    if not path.is_file():
        return None
    return load_results(path)


def measure_longseq_here(device: torch.device, smoke: bool) -> pd.DataFrame | None:
    """One block's inference time and peak memory against N measured on `device` now
    (`hfkit.bench.longseq.run_longseq_benchmark`, no largest-N search, nothing saved), as a
    `longseq_table`; None off CUDA (peak memory is measured on CUDA only, and CPU times of a block say
    nothing about a GPU). `smoke`: the benchmark's smoke profile (the `tiny` preset, N = 9 and 16);
    otherwise `af2_initial` at N = 1024, 2048 and 4096, unchunked and lean with chunk "auto"."""
    if device.type != "cuda":
        return None
    from hfkit.bench.longseq import run_longseq_benchmark
    from hfkit.bench.results import rows_to_frame

    if smoke:
        rows = run_longseq_benchmark(device, profile="smoke", search=False)
    else:
        rows = run_longseq_benchmark(
            device, profile="full", sizes=(1024, 2048, 4096), chunks=("auto",), search=False
        )
    return longseq_table(rows_to_frame(rows))


def longseq_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The measured one-GPU block rows (`longseq_block`, errors left out) of a `load_longseq` frame:
    provider, chunk, n_seq, n_res, seconds (p50), total_GiB (peak with inputs and parameters), tflops."""
    import pandas as pd

    rows = frame[(frame["op"] == "longseq_block") & frame["p50_ms"].notna()]
    total = rows["extra"].map(lambda e: e.get("total_peak_bytes"))
    peak = rows["peak_mem_bytes"]
    return pd.DataFrame(
        {
            "provider": rows["provider"],
            "chunk": rows["extra"].map(lambda e: str(e.get("chunk_size"))),
            "n_seq": rows["shape"].map(lambda s: int(s[0])),
            "n_res": rows["shape"].map(lambda s: int(s[1])),
            "seconds": rows["p50_ms"] / 1e3,
            "total_GiB": total.where(total.notna(), peak).astype(float) / 2**30,
            "tflops": rows["tflops"],
        }
    ).reset_index(drop=True)


def measured_tflops(table: pd.DataFrame, provider: str = "hfkit_lean") -> float | None:
    """The median TFLOP/s of `provider`'s rows of a `longseq_table` at its largest N (the rate the
    time model can use instead of `ASSUMED_TFLOPS`); None without such rows."""
    rows = table[(table["provider"] == provider) & table["tflops"].notna()]
    if rows.empty:
        return None
    return float(rows[rows["n_res"] == rows["n_res"].max()]["tflops"].median())


def longseq_figure(table: pd.DataFrame, title: str) -> go.Figure:
    """Two panels of a `longseq_table` against N, one line per (provider, chunk): seconds per block and
    total peak GiB."""
    import plotly.express as px

    t = table.assign(series=table["provider"] + " · chunk " + table["chunk"])
    long = t.melt(id_vars=["series", "n_res"], value_vars=["seconds", "total_GiB"])
    fig = px.line(
        long, x="n_res", y="value", color="series", facet_col="variable", markers=True, log_x=True,
        labels={"n_res": "N (residues)", "value": ""}, title=title,
    )  # fmt: skip
    fig.update_yaxes(matches=None, showticklabels=True)
    fig.update_layout(height=400)
    return fig


def load_dap_runs(gpu: str = "h200", root: str | Path | None = None) -> pd.DataFrame | None:
    """The rows of every `<root>/<gpu>x<G>/dap.json` (default root: `data/results`; `hfkit bench dap`
    on G GPUs) and of `<root>/<gpu>/dap.json` (one GPU: DAP against one process with nothing to
    exchange, what its layouts cost) as one results frame, or None when there is none."""
    import pandas as pd

    from hfkit.bench.results import load_results, results_dir

    folder = Path(root or results_dir())
    paths = sorted(folder.glob(f"{gpu}x*/dap.json")) + sorted(folder.glob(f"{gpu}/dap.json"))
    frames = [load_results(path) for path in paths]
    return pd.concat(frames, ignore_index=True) if frames else None


def dap_scaling_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The measured rows of a `load_dap_runs` frame (errors left out), one per configuration: op,
    provider, mode, n_seq, n_res, blocks, dap_size (D), gpus (G), chunk, launch (eager from Python, or
    graph: CUDA graph replays), seconds (p50), speedup over one process (launched alike),
    scaling_efficiency (speedup x replicas / G), peak_GiB (the largest rank's)."""
    import pandas as pd

    rows = frame[frame["p50_ms"].notna()]
    extra = rows["extra"]
    g = extra.map(lambda e: int(e["nproc"]))
    peak = rows["peak_mem_bytes"]
    return pd.DataFrame(
        {
            "op": rows["op"],
            "provider": rows["provider"],
            "mode": rows["mode"],
            "n_seq": rows["shape"].map(lambda s: int(s[0])),
            "n_res": rows["shape"].map(lambda s: int(s[1])),
            "blocks": extra.map(lambda e: int(e.get("n_blocks", 1))),
            "dap_size": [int(e.get("dap_size", n)) for e, n in zip(extra, g, strict=True)],
            "gpus": g,
            "chunk": extra.map(lambda e: str(e.get("chunk_size"))),
            "launch": extra.map(lambda e: e.get("launch", "eager")),
            "seconds": rows["p50_ms"] / 1e3,
            "speedup": extra.map(lambda e: e.get("speedup_vs_single", math.nan)),
            "scaling_efficiency": extra.map(lambda e: e.get("scaling_efficiency", math.nan)),
            "peak_GiB": peak.astype(float) / 2**30,
        }
    ).reset_index(drop=True)


def dap_scaling_figure(table: pd.DataFrame, title: str) -> go.Figure:
    """Scaling efficiency against the GPU count of a `dap_scaling_table`'s DAP rows (one line per op,
    S x N, blocks, D = G or dp x dap, mode, launch and provider), with issue 20's goals marked (80% at 2
    GPUs, 60% at 8)."""
    import plotly.express as px

    t = table[table["provider"] != "single_process"].dropna(subset=["scaling_efficiency"])
    layout = t["dap_size"].astype(str).where(t["dap_size"] != t["gpus"], "all")
    shape = t["n_seq"].astype(str) + "x" + t["n_res"].astype(str)
    series = t["op"] + " " + shape + " K=" + t["blocks"].astype(str) + " D=" + layout
    series = series + " " + t["mode"] + " " + t["launch"] + " " + t["provider"]
    fig = px.line(
        t.assign(series=series).sort_values("gpus"), x="gpus", y="scaling_efficiency", color="series",
        markers=True, title=title, labels={"gpus": "GPUs", "scaling_efficiency": "scaling efficiency"},
    )  # fmt: skip
    for gpus, goal in ((2, 0.8), (8, 0.6)):
        fig.add_scatter(x=[gpus], y=[goal], mode="markers", marker_symbol="x", name=f"goal at {gpus} GPUs")
    fig.update_layout(height=420)
    return fig


# ---- the live exactness check ----------------------------------------------------------------------


def _tiny_block(seed: int) -> torch.nn.Module:
    """The `tiny` preset's first Evoformer block in float64, dropout off, every parameter perturbed (its
    zero-initialised output projections would otherwise hide most of the computation)."""
    from hfkit.model.evoformer import EvoformerStack

    torch.manual_seed(seed)
    config = ModelConfig.tiny().replace(no_blocks=1, msa_dropout=0.0, pair_dropout=0.0)
    block = EvoformerStack.from_config(config).blocks[0].to(torch.float64)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return block


def _tiny_inputs(n_seq: int, n_res: int, seed: int) -> tuple[torch.Tensor, ...]:
    """m, z, msa_mask, pair_mask in float64, the same on every rank; the last MSA row and the last
    residue fully masked, as padding is, and a fifth of the other MSA entries masked at random."""
    config = ModelConfig.tiny()
    g = torch.Generator().manual_seed(seed + 1)
    m = torch.randn(n_seq, n_res, config.c_m, generator=g, dtype=torch.float64)
    z = torch.randn(n_res, n_res, config.c_z, generator=g, dtype=torch.float64)
    msa_mask = (torch.rand(n_seq, n_res, generator=g) > 0.2).to(torch.float64)
    msa_mask[-1, :] = 0
    msa_mask[:, -1] = 0
    seq_mask = torch.ones(n_res, dtype=torch.float64)
    seq_mask[-1] = 0
    return m, z, msa_mask, seq_mask[:, None] * seq_mask[None, :]


def _outputs_and_grads(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """The block's outputs, input gradients and parameter gradients for a fixed random weighting of
    the outputs as the loss (the same weights on every rank)."""
    module.zero_grad()
    m, z = (t.clone().requires_grad_() for t in inputs[:2])
    out_m, out_z = module(m, z, *inputs[2:])
    g = torch.Generator().manual_seed(7)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in (out_m, out_z))
    loss.backward()
    result = {"output m": out_m.detach(), "output z": out_z.detach(), "grad m": m.grad, "grad z": z.grad}
    result.update({f"grad {name}": p.grad.clone() for name, p in module.named_parameters()})
    return result


def _exactness_rank(rank: int, n_seq: int, n_res: int, seed: int) -> dict[str, tuple[float, float]]:
    """One rank of `dap_exactness_check`: {quantity: (max |DAP - single|, max |single|)}."""
    from hfkit.parallel.dap import to_dap

    block = _tiny_block(seed)
    inputs = _tiny_inputs(n_seq, n_res, seed)
    single = _outputs_and_grads(block, inputs)
    dap = _outputs_and_grads(to_dap(block), inputs)
    return {k: (float((dap[k] - v).abs().max()), float(v.abs().max())) for k, v in single.items()}


def dap_exactness_check(
    nprocs: int = 2, n_seq: int = 5, n_res: int = 7, seed: int = 0, timeout_s: float = 60.0
) -> pd.DataFrame:
    """Run `to_dap` of a tiny float64 Evoformer block on `nprocs` gloo CPU processes
    (`hfkit.parallel.launch.spawn_local`) with the same full inputs on every rank (S = n_seq MSA rows,
    N = n_res residues, padded when they do not divide by `nprocs`; the last row and residue masked),
    and compare its outputs m [S, N, C_m] and z [N, N, C_z], the gradients of m and z and of every
    parameter, after backward of a fixed weighting of the outputs, with the single-process block's.

    Returns one row per (rank, quantity): rank, quantity ("output m", "output z", "grad m", "grad z",
    "grad parameters": the worst of all parameters, their count in `tensors`), max_abs_diff,
    max_abs_value (of the single-process tensor) and rel_diff (their ratio; the parameters' row: the
    worst parameter's ratio, each against at least 1e-3 of the largest gradient, as a gradient that is
    zero in exact arithmetic holds only rounding noise)."""
    import pandas as pd

    from hfkit.parallel.launch import spawn_local

    results = spawn_local(_exactness_rank, nprocs, n_seq, n_res, seed, backend="gloo", timeout_s=timeout_s)
    rows = []
    for rank, errors in enumerate(results):
        params = {k: v for k, v in errors.items() if k.startswith("grad ") and k not in ("grad m", "grad z")}
        floor = 1e-3 * max(v[1] for v in params.values())
        for name in ("output m", "output z", "grad m", "grad z"):
            diff, scale = errors[name]
            rows.append({"rank": rank, "quantity": name, "tensors": 1, "max_abs_diff": diff,
                         "max_abs_value": scale, "rel_diff": diff / max(scale, 1e-300)})  # fmt: skip
        rows.append(
            {"rank": rank, "quantity": "grad parameters", "tensors": len(params),
             "max_abs_diff": max(v[0] for v in params.values()),
             "max_abs_value": max(v[1] for v in params.values()),
             "rel_diff": max(d / max(s, floor) for d, s in params.values())}
        )  # fmt: skip
    return pd.DataFrame(rows)


# ---- the explorer --------------------------------------------------------------------------------------


@dataclass
class DAPExplorer:
    """An N slider and dropdowns for the GPUs, the chunk and the attention over the DAP layout, the
    communication of one block and the memory/time model per GPU, at `n_seq` MSA rows, `config`'s
    widths, bf16 (`itemsize` 2) and the rate `tflops`. `measured` (a `longseq_table`, or None) adds the
    one-GPU measurements to the model's figure.

    `update(n_res, gpus, chunk_size, logits)` returns (layout figure, `dap_comm_breakdown` at that
    (N, GPUs), the model table at that N for every GPU count, the model figure against N) — what the
    widget shows, and what tests call; `show()` displays the first result, then the widget."""

    config: ModelConfig = field(default_factory=ModelConfig.af2_initial)
    n_seq: int = 128
    itemsize: int = 2
    tflops: float = ASSUMED_TFLOPS
    measured: pd.DataFrame | None = None
    n_values: tuple[int, ...] = N_VALUES
    gpu_counts: tuple[int, ...] = GPU_COUNTS
    chunk_sizes: tuple[int, ...] = CHUNK_SIZES

    def update(
        self, n_res: int, gpus: int, chunk_size: int = 32, logits: bool = False
    ) -> tuple[go.Figure, pd.DataFrame, pd.DataFrame, go.Figure]:
        """What the panel shows at N = n_res on `gpus` GPUs with `chunk_size` and `logits` (plain-torch
        attention logits counted, or the fused attention's none)."""
        if gpus not in self.gpu_counts:
            raise ValueError(f"gpus: expected one of {self.gpu_counts}, got {gpus!r}")
        layout = dap_layout_figure(self.n_seq, n_res, gpus)
        comm = dap_comm_breakdown(n_res, gpus, self.n_seq, self.config, self.itemsize)
        model = partial(
            dap_model_table,
            gpu_counts=self.gpu_counts,
            config=self.config,
            n_seq=self.n_seq,
            chunk_size=chunk_size,
            itemsize=self.itemsize,
            tflops=self.tflops,
            logits=logits,
        )
        figure = dap_model_figure(
            model(self.n_values), self.measured, n_blocks=self.config.no_blocks, marker_n=n_res
        )
        attention = "plain-torch attention" if logits else "fused attention"
        figure.update_layout(
            title=f"{figure.layout.title.text}; chunk {chunk_size}, {attention}, {self.tflops:.3g} TFLOP/s"
        )
        return layout, comm, model([n_res]), figure

    def show(self, n_res: int = 4096, gpus: int = 4, chunk_size: int = 32, logits: bool = False) -> None:
        """Display the result of `update` as static outputs (kept in an HTML report), then the widget."""
        layout, comm, at_n, figure = self.update(n_res, gpus, chunk_size, logits)
        widget = self.widget(n_res, gpus, chunk_size, logits)
        show_static_then_widget(widget, layout, comm.round(3), at_n.round(3), figure)

    def widget(self, n_res: int = 4096, gpus: int = 4, chunk_size: int = 32, logits: bool = False) -> Any:
        """The ipywidgets panel: N (a slider over `n_values`), GPUs, chunk and attention (dropdowns),
        and an Output area with what `update` returns."""
        import ipywidgets as w

        n_slider = w.SelectionSlider(options=list(self.n_values), value=n_res, description="N")
        gpu_menu = w.Dropdown(options=list(self.gpu_counts), value=gpus, description="GPUs")
        chunk_menu = w.Dropdown(options=list(self.chunk_sizes), value=chunk_size, description="chunk")
        attention = [("fused (no logits)", False), ("plain torch (logits)", True)]
        logits_menu = w.Dropdown(options=attention, value=logits, description="attention")
        out = w.Output()

        def refresh(_: Any = None) -> None:
            shown = self.update(n_slider.value, gpu_menu.value, chunk_menu.value, logits_menu.value)
            layout, comm, at_n, figure = shown
            render_into(out, layout, comm.round(3), at_n.round(3), figure)

        for control in (n_slider, gpu_menu, chunk_menu, logits_menu):
            control.observe(refresh, names="value")
        refresh()
        return w.VBox([w.HBox([n_slider, gpu_menu]), w.HBox([chunk_menu, logits_menu]), out])
