"""Figures and widgets of notebooks 03 (op profiling) and 05 (end to end): the operator-share bars,
the LayerNorm shape census, model-benchmark bars, the swap waterfall, and explorers that rerun a
profile or a training step for the settings chosen; and what the notebooks run for their profile
(`profile_step`, `reference_ops`/`reference_census` of the committed profile,
`saved_activation_table`). For notebook 05's user-side
step: `batch_waterfall` (the waterfall on a given batch, e.g. the data pipeline's from
`hfkit.viz.batches`), `stage_bars`, `StepLaunchExplorer` (checkpointing, precision, crop: the step
launched from Python against the graphed step) and `openfold_stack_here` (OpenFold's own stack
beside hfkit's on a GPU).

Inputs are the DataFrames of `hfkit.bench.profile` (`op_table`, `layer_norm_census`, `census_speed`)
and of `hfkit.bench.load_results` / `rows_to_frame` for `hfkit bench model` rows. plotly and
ipywidgets are imported inside the functions that need them.
"""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING, Any

import pandas as pd

from hfkit.bench.cases.layer_norm import CENSUS_SHAPES
from hfkit.bench.ceilings import resolve_device
from hfkit.bench.model import summary_table
from hfkit.viz.notebook import RunPanel

if TYPE_CHECKING:
    import plotly.graph_objects as go
    import torch

    from hfkit.model import ModelConfig
    from hfkit.viz.batches import PipelineBatches

# `summary_table` (of model benchmark rows) is re-exported for notebook 05, which imports from viz only.
__all__ = [
    "CENSUS_COLUMNS",
    "COMMITTED_MODEL_OPS",
    "PRESETS",
    "SEED_LN_CENSUS",
    "SEED_OP_TABLE",
    "STEP_PRECISIONS",
    "ProfileExplorer",
    "StepLaunchExplorer",
    "census_figure",
    "batch_waterfall",
    "census_timings",
    "committed_model_outputs",
    "load_reference",
    "model_time_bars",
    "op_share_bars",
    "openfold_stack_here",
    "preset_config",
    "profile_step",
    "reference_census",
    "reference_ops",
    "saved_activation_figure",
    "saved_activation_table",
    "stage_bars",
    "summary_table",
    "waterfall_figure",
    "waterfall_frame",
]

VARIANT_ORDER = ["eager", "hfkit", "compile", "compile_hfkit"]
VARIANT_COLORS = {"eager": "#7f7f7f", "hfkit": "#d62728", "compile": "#1f77b4", "compile_hfkit": "#9467bd"}
PRESETS = ("tiny", "af2_initial", "af2_finetune")

# The hfai article's profile of one AlphaFold training step with torch ops (12.6 s, A100s), and its
# LayerNorm input-shape census (shares of calls; torch and hfai LayerNorm seconds per call). Quoted
# from ../shared/seeds/000_*.txt, for comparison with what is measured here.
SEED_OP_TABLE = pd.DataFrame(
    {
        "name": [
            "aten::native_layer_norm",
            "RowwiseMoments kernel (layer_norm)",
            "aten::mm",
            "aten::native_layer_norm_backward",
            "aten::add_",
        ],
        "time_ms": [2105.0, 1866.0, 1716.0, 1642.0, 1454.0],
        "share_pct": [16.81, 14.90, 13.70, 13.11, 11.61],
    }
)
SEED_LN_CENSUS = pd.DataFrame(
    {
        "shape": list(CENSUS_SHAPES),  # the census behind our LayerNorm benchmark, in the seed's order
        "calls_pct": [59.96, 13.2, 8.03, 7.92, 4.4, 2.64, 1.87, 1.32, 0.44, 0.11, 0.11],
        "torch_s": [0.003, 0.0017, 0.0028, 0.0017, 0.0017, 0.0017, 0.0002, 0.0111, 0.0111, 0.0111, 0.0003],
        "hfai_s": [0.0008, 0.0007, 0.0007, 0.0006, 0.0006, 0.0006, 0.0003, 0.0024, 0.0024, 0.0024, 0.0003],
    }
)


def preset_config(preset: str, crop: int | None = None, on_cpu: bool = False) -> ModelConfig:
    """The `ModelConfig` of `preset` ("tiny", "af2_initial", "af2_finetune"), with crop size `crop`
    if given. `on_cpu` scales the AlphaFold presets down (1 Evoformer block, 1 extra-MSA block,
    crop <= 24, <= 8 clusters, <= 16 extra rows; channel sizes kept) so one step takes seconds."""
    from hfkit.model import ModelConfig

    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {PRESETS}, got {preset!r}")
    config = getattr(ModelConfig, preset)()
    if crop is not None:
        if crop < 1:
            raise ValueError(f"crop: expected a positive residue count, got {crop}")
        config = config.replace(crop_size=int(crop))
    if on_cpu and preset != "tiny":
        config = config.replace(
            no_blocks=1,
            extra_no_blocks=1,
            crop_size=min(config.crop_size, 24),
            max_msa_clusters=min(config.max_msa_clusters, 8),
            max_extra_msa=min(config.max_extra_msa, 16),
        )
    return config


def load_reference(gpu: str = "h200", op: str | None = None) -> pd.DataFrame | None:
    """Committed results of `hfkit bench model` for `gpu` (rows of `op`, or all), or None with a
    printed note when there are none yet."""
    from hfkit.bench import load_results, results_dir

    try:
        return load_results(results_dir() / gpu / "model.json", op=op)
    except (FileNotFoundError, ValueError) as err:
        print(
            f"No committed {gpu.upper()} model results to show ({err}).\n"
            f"Run `hfkit bench model` on an {gpu.upper()} to create data/results/{gpu}/model.json."
        )
        return None


def op_share_bars(ops: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Horizontal bars of each operator's share of device time (an `op_table`), largest on top."""
    import plotly.express as px

    data = ops.sort_values("share_pct")
    hover = [c for c in ("calls", "time_ms") if c in data]
    fig = px.bar(
        data,
        x="share_pct",
        y="name",
        orientation="h",
        hover_data=hover,
        labels={"share_pct": "% of device time", "name": ""},
        title=title or "top operators by device time",
    )
    fig.update_layout(height=max(300, 26 * len(data) + 120))
    return fig


def census_figure(
    census: pd.DataFrame, speed: pd.DataFrame | None = None, title: str | None = None
) -> go.Figure:
    """The LayerNorm census: per input shape, the share of calls and of LayerNorm time (left), and
    with `speed` (`census_speed`) torch's and hfkit's time per call on that shape (right)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    shapes = ["x".join(map(str, s)) for s in census["shape"]]
    cols = 2 if speed is not None and not speed.empty else 1
    titles = ["share of LayerNorm calls and time (%)"] + (["time per call (ms)"] if cols == 2 else [])
    fig = make_subplots(rows=1, cols=cols, subplot_titles=titles, horizontal_spacing=0.12)
    fig.add_trace(go.Bar(x=shapes, y=census["calls_pct"], name="% of calls"), 1, 1)
    fig.add_trace(go.Bar(x=shapes, y=census["time_pct"], name="% of time"), 1, 1)
    if cols == 2:
        names = ["x".join(map(str, s)) for s in speed["shape"]]
        fig.add_trace(go.Bar(x=names, y=speed["torch_ms"], name="torch", marker_color="#7f7f7f"), 1, 2)
        fig.add_trace(go.Bar(x=names, y=speed["hfkit_ms"], name="hfkit", marker_color="#d62728"), 1, 2)
    fig.update_layout(barmode="group", title=title or "LayerNorm input-shape census", height=430)
    return fig


def model_time_bars(frame: pd.DataFrame, op: str = "evoformer_block", title: str | None = None) -> go.Figure:
    """Grouped bars of p50 time (ms) per (S x N [, checkpointing] [, "graph": replayed as one CUDA
    graph]) for each variant of `op`'s rows,
    faceted by mode and precision; failed configurations are left out (see their `extra['error']`)."""
    import plotly.express as px

    data = frame[(frame["op"] == op) & frame["p50_ms"].notna()].copy()
    if data.empty:
        raise ValueError(f"frame: no measured {op!r} rows")
    ckpt = data["extra"].apply(lambda e: (e or {}).get("checkpointing"))
    graph = data["extra"].apply(lambda e: (e or {}).get("launch") == "graph")
    data["config"] = [
        "x".join(map(str, s))
        + ("" if c is None else f" ckpt {'on' if c else 'off'}")
        + (" graph" if g else "")
        for s, c, g in zip(data["shape"], ckpt, graph, strict=True)
    ]
    data["peak_GiB"] = data["peak_mem_bytes"].astype(float) / 2**30
    variants = [v for v in VARIANT_ORDER if v in set(data["provider"])]
    variants += sorted(set(data["provider"]) - set(variants))
    fig = px.bar(
        data,
        x="config",
        y="p50_ms",
        color="provider",
        barmode="group",
        facet_row="mode" if data["mode"].nunique() > 1 else None,
        facet_col="dtype" if data["dtype"].nunique() > 1 else None,
        category_orders={"provider": variants, "mode": ["fwd", "fwd+bwd"]},
        color_discrete_map=VARIANT_COLORS,
        hover_data=["p20_ms", "p80_ms", "peak_GiB", "tflops", "method"],
        labels={"config": "S x N", "p50_ms": "p50 time (ms)", "provider": "variant"},
        title=title or f"{op}: time per call (lower is better)",
    )
    fig.update_yaxes(matches=None)
    fig.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
    fig.update_layout(height=330 * max(1, data["mode"].nunique()) + 100)
    return fig


def waterfall_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """`step_waterfall` rows as the waterfall's table: stage, step time (ms, the median), change from
    the stage before (ms), the 20th and 80th percentiles of the step time (ms: how far the stage's
    own steps spread; a change smaller than that is noise), peak memory (GiB), swapped ops, error,
    launch ("eager": from Python, "graph": the graphed step), first call s (compilation and capture;
    NaN where not recorded); ordered by stage. Failed stages keep NaN times."""
    data = frame[frame["op"] == "step_waterfall"].copy()
    if data.empty:
        raise ValueError("frame: no 'step_waterfall' rows")
    data["stage_index"] = data["extra"].apply(lambda e: (e or {}).get("stage", math.inf))
    data = data.sort_values("stage_index")
    table = pd.DataFrame(
        {
            "stage": data["provider"].to_numpy(),
            "step_ms": data["p50_ms"].to_numpy(dtype=float),
            "p20_ms": data["p20_ms"].to_numpy(dtype=float),
            "p80_ms": data["p80_ms"].to_numpy(dtype=float),
            "peak_GiB": data["peak_mem_bytes"].astype(float).to_numpy() / 2**30,
            "ops": data["extra"].apply(lambda e: ", ".join((e or {}).get("ops", []))).to_numpy(),
            "error": data["extra"].apply(lambda e: (e or {}).get("error", "")).to_numpy(),
            "launch": data["extra"].apply(lambda e: (e or {}).get("launch", "eager")).to_numpy(),
            "first call s": data["extra"]
            .apply(lambda e: (e or {}).get("first_call_s", math.nan))
            .to_numpy(dtype=float),
        }
    )
    table.insert(2, "delta_ms", table["step_ms"].diff().fillna(table["step_ms"]))
    return table


def waterfall_figure(table: pd.DataFrame, title: str | None = None) -> go.Figure:
    """A plotly waterfall from `waterfall_frame`'s table: the eager step time, each stage's change
    (negative: faster), and the final step time. Failed stages are skipped."""
    import plotly.graph_objects as go

    data = table[table["step_ms"].notna()].reset_index(drop=True)
    if data.empty:
        raise ValueError("table: no measured stages")
    deltas = data["step_ms"].diff().fillna(data["step_ms"]).tolist()
    x = [*data["stage"], "final"]
    y = [*deltas, 0.0]
    measure = ["absolute", *(["relative"] * (len(data) - 1)), "total"]
    text = [f"{data['step_ms'].iloc[0]:.1f}"] + [f"{d:+.1f}" for d in deltas[1:]]
    text.append(f"{data['step_ms'].iloc[-1]:.1f}")
    fig = go.Figure(
        go.Waterfall(
            x=x,
            y=y,
            measure=measure,
            text=text,
            textposition="outside",
            decreasing={"marker": {"color": "#2ca02c"}},
            increasing={"marker": {"color": "#d62728"}},
            totals={"marker": {"color": "#1f77b4"}},
        )
    )
    fig.update_layout(
        title=title or "training step: eager -> each swapped op -> compile",
        yaxis_title="step time (ms)",
        height=460,
        showlegend=False,
    )
    return fig


def _gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 2**30


class ProfileExplorer(RunPanel):
    """Dropdowns for preset and precision, a crop box, and a button that profiles one training step
    (`hfkit.bench.model.profile_train_step`) and shows the operator table, the LayerNorm census and
    their figures. On a CPU the AlphaFold presets are scaled down (`preset_config(on_cpu=True)`).
    `run()` does what the button does; `result` is a first result to show (e.g. the notebook's own
    profile of the same step); `show()` displays the last result as static figures, then the widget."""

    def __init__(
        self,
        device: torch.device | str | None = None,
        preset: str = "tiny",
        result: dict[str, Any] | None = None,
        label: str = "",
    ) -> None:
        import ipywidgets as widgets

        self.device = resolve_device(device)
        self.preset = widgets.Dropdown(options=list(PRESETS), value=preset, description="preset")
        self.crop = widgets.BoundedIntText(value=0, min=0, max=4096, description="crop (0: preset)")
        self.dtype = widgets.Dropdown(
            options=["fp32", "bf16_autocast"], value="fp32" if self.device.type == "cpu" else "bf16_autocast"
        )
        self.dtype.description = "precision"
        self.button = widgets.Button(description="profile", button_style="primary", icon="play")
        self.output = widgets.Output()
        self.button.on_click(self._on_click)
        where = "GPU" if self.device.type == "cuda" else "CPU: AlphaFold presets scaled down, CPU time"
        self.widget = widgets.VBox(
            [
                widgets.HBox([self.preset, self.crop, self.dtype, self.button]),
                widgets.Label(f"profiles on {self.device} ({where})"),
                self.output,
            ]
        )
        self.last: dict[str, Any] | None = result
        self.last_label = label

    def run(self) -> dict[str, Any]:
        """Profile now; return `profile_train_step`'s tables (plus "config"), kept as `last`."""
        from hfkit.bench.model import profile_train_step

        on_cpu = self.device.type != "cuda"
        config = preset_config(self.preset.value, self.crop.value or None, on_cpu=on_cpu)
        out = profile_train_step(config, self.device, self.dtype.value, census_reps=3 if on_cpu else 20)
        out["config"] = config
        self.last = out
        self.last_label = (
            f"{self.preset.value} crop {config.crop_size}, {config.no_blocks} blocks, {self.dtype.value}, "
            f"{out['ops'].attrs['device_time'].upper()} time"
        )
        return out

    def result_outputs(self) -> list[Any]:
        """The last result as outputs to display: a line, the operator table and bars, the census table
        and figure; empty before the first result."""
        if self.last is None:
            return []
        out, label = self.last, self.last_label
        return [
            f"{label}: {out['step_ms']:.1f} ms of operator time per step",
            out["ops"].round(2),
            op_share_bars(out["ops"], title=f"top operators: {label}"),
            out["census"].round(2),
            census_figure(out["census"], out["speed"], title=f"LayerNorm census: {label}"),
        ]


def profile_step(device: torch.device, full: bool, where: str) -> dict[str, Any]:
    """Profile one training step for notebook 03: on a GPU with `full`, `af2_initial` with per-block
    checkpointing under bf16 autocast; otherwise the `tiny` preset in fp32. Returns
    `profile_train_step`'s tables plus "config", "precision" and "label" (what ran, on `where`)."""
    from hfkit.bench.model import profile_train_step
    from hfkit.model import ModelConfig

    if full and device.type == "cuda":
        config, precision = ModelConfig.af2_initial().replace(checkpoint=True), "bf16_autocast"
    else:
        config, precision = ModelConfig.tiny(), "fp32"
    out = profile_train_step(config, device, precision, census_reps=20 if device.type == "cuda" else 3)
    out["config"], out["precision"] = config, precision
    out["label"] = f"crop {config.crop_size}, {config.no_blocks} blocks, {precision} on {where}"
    return out


def _reference_label(frame: pd.DataFrame) -> str:
    return (
        f"reference results: {frame['gpu'].iloc[0]} (committed): {frame['command'].iloc[0]!r}, "
        f"commit {frame['commit'].iloc[0]}"
    )


def reference_ops(frame: pd.DataFrame | None) -> pd.DataFrame | None:
    """Committed `step_profile` rows (`load_reference(op="step_profile")`) as an operator table like
    `op_table`'s: name, calls, time_ms, share_pct; failed rows left out. `attrs["label"]` names the
    GPU, command and commit. None when `frame` is None or holds no measured row."""
    if frame is None:
        return None
    ok = frame[frame["method"] != "failed"]
    if ok.empty:
        return None
    table = pd.DataFrame(
        {
            "name": ok["provider"].to_numpy(),
            "calls": [e["calls"] for e in ok["extra"]],
            "time_ms": ok["p50_ms"].to_numpy(),
            "share_pct": [e["share_pct"] for e in ok["extra"]],
        }
    )
    table.attrs["label"] = _reference_label(ok)
    return table


CENSUS_COLUMNS = ("calls", "calls_pct", "time_pct", "torch_ms", "hfkit_ms", "speedup")


def reference_census(frame: pd.DataFrame | None) -> pd.DataFrame | None:
    """Committed `layer_norm_census` rows as the census table: shape, then `CENSUS_COLUMNS` from each
    row's `extra` (None where a row lacks one). None when `frame` is None."""
    if frame is None:
        return None
    table = pd.DataFrame({"shape": [tuple(s) for s in frame["shape"]]})
    for key in CENSUS_COLUMNS:
        table[key] = [(e or {}).get(key) for e in frame["extra"]]
    return table


def census_timings(table: pd.DataFrame) -> pd.DataFrame | None:
    """The shapes of a census table with both torch and hfkit timed (`census_figure`'s `speed`), or
    None when no shape was timed."""
    speed = table[["shape", "torch_ms", "hfkit_ms"]].dropna()
    return speed if len(speed) else None


def saved_activation_table(device: torch.device, quick: bool) -> pd.DataFrame:
    """MiB each submodule of one Evoformer block saves for the backward (`saved_activations`, depth 2),
    plain ("eager") and after `to_hfkit` ("hfkit"), one column each, largest first. `quick`: the
    `bench_config(quick=True)` block on (S, N) = (4, 8); else (128, 256). bfloat16 on a GPU, float32
    elsewhere. `attrs["inputs"]` says the sizes and dtype."""
    import torch

    from hfkit.bench.model import bench_config, make_block, make_variant
    from hfkit.bench.profile import saved_activations

    config = bench_config(quick)
    s, n = (4, 8) if quick else (128, 256)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    base = make_block(config).to(device, dtype)
    m = torch.randn(1, s, n, config.c_m, device=device, dtype=dtype, requires_grad=True)
    z = torch.randn(1, n, n, config.c_z, device=device, dtype=dtype, requires_grad=True)
    masks = (torch.ones(1, s, n, device=device, dtype=dtype), torch.ones(1, n, n, device=device, dtype=dtype))
    columns = {}
    for variant in ("eager", "hfkit"):
        block, _ = make_variant(base, variant)
        census = saved_activations(block, partial(block, m, z, *masks), depth=2)
        columns[variant] = census.set_index("module")["MiB"]
    memory = pd.DataFrame(columns).fillna(0.0).sort_values("eager", ascending=False)
    memory.attrs["inputs"] = f"{s}x{n}, {str(dtype).removeprefix('torch.')}"
    return memory


def saved_activation_figure(memory: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Grouped bars of `saved_activation_table`: MiB saved per module, one colour per variant."""
    import plotly.express as px

    long = memory.reset_index(names="module").melt(id_vars="module", var_name="variant", value_name="MiB")
    return px.bar(
        long,
        x="module",
        y="MiB",
        color="variant",
        barmode="group",
        color_discrete_map=VARIANT_COLORS,
        title=title or "Activations saved for the backward, one Evoformer block",
    )


# --- notebook 05: the user's step on the data pipeline's batches ----------------------------------------

STEP_PRECISIONS = {"bf16 autocast": "bf16_autocast", "fp32": "fp32"}


def _step_backend(device: torch.device, compile_backend: str | None) -> str:
    # On a CPU, Inductor's C++ build takes minutes; the "eager" backend (Dynamo only) checks the path.
    return compile_backend or ("inductor" if device.type == "cuda" else "eager")


def _error_text(err: BaseException) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())[:300]


def batch_waterfall(
    config: ModelConfig,
    device: torch.device | str | None = None,
    precision: str = "bf16_autocast",
    batch: dict[str, torch.Tensor] | None = None,
    compile_backend: str | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """The training-step waterfall on `batch` (e.g. `PipelineBatches.batch(config)`; None: a synthetic
    batch), measured as `hfkit bench model` measures it (`hfkit.bench.model.measure_waterfall`): a
    fresh, identically seeded `AlphaFoldLite(config)` for each stage of `waterfall_stages` over the
    ops the model holds (eager, each op swapped in turn, the swapped step graphed, then compiled inside
    the graph); the eager stages timed together in interleaved rounds. Returns `waterfall_frame`'s
    table (stage, step_ms, delta_ms, p20_ms, p80_ms, peak_GiB, ops, error, launch, first call s:
    compilation and capture); a failed stage keeps NaN times and its error. Compiling uses Inductor
    on a GPU and Dynamo's "eager" backend elsewhere unless `compile_backend` is given."""
    from hfkit.bench.model import measure_waterfall
    from hfkit.bench.results import rows_to_frame

    device = resolve_device(device)
    backend = _step_backend(device, compile_backend)
    rows = measure_waterfall(
        config, device, precision, batch=batch, compile_backend=backend, progress=progress
    )
    return waterfall_frame(rows_to_frame(rows))


def stage_bars(table: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Bars of a waterfall table (`batch_waterfall`, `waterfall_frame`): step time per stage on top
    (the median, with whiskers from the 20th to the 80th percentile where the table has them),
    peak memory per stage below (where measured: CUDA only), coloured by launch ("eager": from
    Python, "graph": the graphed step) when the table says."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    launch = table.get("launch", pd.Series(["eager"] * len(table)))
    colors = launch.map({"eager": "#7f7f7f", "graph": "#2ca02c"}).fillna("#1f77b4")
    has_peak = bool(table["peak_GiB"].notna().any())
    fig = make_subplots(
        rows=2 if has_peak else 1,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=["step time (ms)", *(["peak memory (GiB)"] if has_peak else [])],
    )
    hover = table.get("launch")
    spread = None
    if {"p20_ms", "p80_ms"} <= set(table.columns) and table["p20_ms"].notna().any():
        spread = {
            "type": "data",
            "symmetric": False,
            "array": (table["p80_ms"] - table["step_ms"]).tolist(),
            "arrayminus": (table["step_ms"] - table["p20_ms"]).tolist(),
        }
    fig.add_trace(
        go.Bar(x=table["stage"], y=table["step_ms"], marker_color=colors, hovertext=hover, error_y=spread),
        1,
        1,
    )
    if has_peak:
        fig.add_trace(
            go.Bar(x=table["stage"], y=table["peak_GiB"], marker_color=colors, hovertext=hover), 2, 1
        )
    fig.update_layout(
        title=title or "training step per stage (grey: launched from Python, green: graphed step)",
        showlegend=False,
        height=620 if has_peak else 400,
    )
    return fig


class StepLaunchExplorer(RunPanel):
    """Checkpointing, precision (bf16 autocast / fp32) and crop size, and a button that times the
    swapped ("hfkit") training step on a batch of the data pipeline (`PipelineBatches.batch`) at
    those sizes, launched from Python ("eager": `train_step`) and as `graphed_step` ("graph"), with
    `measure_train_step`. `run()` does what the button does; `show()` displays the runs so far as a
    static table and chart, then the widget. On a CPU the AlphaFold presets are scaled down
    (`preset_config(on_cpu=True)`) and the graphed step runs eagerly."""

    def __init__(
        self,
        batches: PipelineBatches,
        device: torch.device | str | None = None,
        preset: str = "tiny",
        checkpoint: bool = False,
        compile_backend: str | None = None,
    ) -> None:
        import ipywidgets as widgets

        self.batches = batches
        self.device = resolve_device(device)
        on_cuda = self.device.type == "cuda"
        self.preset = preset
        self.compile_backend = _step_backend(self.device, compile_backend)
        crop = preset_config(preset, on_cpu=not on_cuda).crop_size
        self.checkpoint = widgets.Checkbox(value=checkpoint, description="checkpointing", indent=False)
        self.precision = widgets.Dropdown(
            options=list(STEP_PRECISIONS.items()),
            value="bf16_autocast" if on_cuda else "fp32",
            description="precision",
        )
        self.crop = widgets.BoundedIntText(value=crop, min=8, max=1024, description="crop")
        self.button = widgets.Button(description="run step", button_style="primary", icon="play")
        self.output = widgets.Output()
        self.button.on_click(self._on_click)
        where = (
            "GPU" if on_cuda else "CPU: AlphaFold presets scaled down, CPU time, graphed step runs eagerly"
        )
        self.widget = widgets.VBox(
            [
                widgets.HBox([self.checkpoint, self.precision, self.crop, self.button]),
                widgets.Label(f"{preset} on {self.device} ({where}); batches: {batches.label}"),
                self.output,
            ]
        )
        self.history: list[dict[str, Any]] = []

    def config(self) -> ModelConfig:
        """The model config the widgets choose."""
        on_cpu = self.device.type != "cuda"
        config = preset_config(self.preset, self.crop.value, on_cpu=on_cpu)
        return config.replace(checkpoint=bool(self.checkpoint.value))

    def run(self) -> pd.DataFrame:
        """Time the step eager and graphed on one pipeline batch of the chosen sizes; return every run
        so far, a row per (run, launch)."""
        from hfkit.bench.model import measure_train_step

        config = self.config()
        batch = self.batches.batch(config)
        number = 1 + (self.history[-1]["run"] if self.history else 0)
        for launch in ("eager", "graph"):
            row = {
                "run": number,
                "crop": config.crop_size,
                "ckpt": config.checkpoint,
                "precision": self.precision.value,
                "launch": launch,
            }
            try:
                out = measure_train_step(
                    config, self.device, self.precision.value, "hfkit", launch=launch, batch=batch,
                    compile_backend=self.compile_backend,
                )  # fmt: skip
            except RuntimeError as err:
                row |= {"step_ms": math.nan, "peak_GiB": None, "first_call_s": math.nan}
                row["error"] = _error_text(err)
            else:
                row |= {"step_ms": out["timing"].p50, "peak_GiB": _gib(out["peak_mem_bytes"])}
                row |= {"first_call_s": out["first_call_s"], "error": ""}
            self.history.append(row)
        return pd.DataFrame(self.history)

    def figure(self) -> go.Figure:
        """Grouped bars of every run so far: step time (and peak memory where measured) per run,
        eager beside graphed."""
        import plotly.express as px

        table = pd.DataFrame(self.history)
        table["setting"] = [
            f"{r['run']}: crop {r['crop']}, ckpt {'on' if r['ckpt'] else 'off'}, {r['precision']}"
            for _, r in table.iterrows()
        ]
        table["peak_GiB"] = table["peak_GiB"].astype(float)
        value_vars = ["step_ms", *(["peak_GiB"] if table["peak_GiB"].notna().any() else [])]
        long = table.melt(id_vars=["setting", "launch"], value_vars=value_vars, var_name="metric")
        fig = px.bar(
            long,
            x="setting",
            y="value",
            color="launch",
            barmode="group",
            facet_row="metric" if len(value_vars) > 1 else None,
            color_discrete_map={"eager": "#7f7f7f", "graph": "#2ca02c"},
            labels={"setting": "", "value": ""},
            title="the swapped step launched from Python (eager) and graphed: ms per step, peak GiB",
        )
        fig.update_yaxes(matches=None)
        fig.for_each_annotation(lambda a: a.update(text=a.text.split("=")[-1]))
        fig.update_layout(height=300 * len(value_vars) + 120)
        return fig

    def result_outputs(self) -> list[Any]:
        """The runs so far as outputs to display (table and chart); empty before the first run."""
        if not self.history:
            return []
        return [pd.DataFrame(self.history).round(3), self.figure()]


# OpenFold's variants beside hfkit's checkpointed stack (graph_modules' blocks run eagerly there).
STACK_OPENFOLD_VARIANTS = ("openfold", "openfold_compile", "openfold_hfkit")


def openfold_stack_here(device: torch.device | str | None, full: bool) -> pd.DataFrame | None:
    """OpenFold's own `EvoformerStack` beside hfkit's, measured now with `run_model_benchmark`
    (part "stack": forward+backward, bf16, per-block checkpointing, launched from Python and as a
    CUDA graph; hfkit's eager, hfkit and compile_hfkit variants and OpenFold's `STACK_OPENFOLD_VARIANTS`:
    as it is, compiled, swapped by `to_hfkit`; not the graphed ones, whose blocks run eagerly in a
    checkpointed stack), `af2_initial` with `full`, else the `tiny` preset.
    Needs a CUDA device and OpenFold's source (`hfkit.bench.peers.load_openfold`); otherwise prints
    why it is skipped and returns None. Returns the rows as a frame (for
    `model_time_bars(frame, "evoformer_stack")`)."""
    from hfkit.bench import model as bench_model
    from hfkit.bench import rows_to_frame
    from hfkit.bench.peers import load_openfold

    device = resolve_device(device)
    if device.type != "cuda":
        print(f"OpenFold's EvoformerStack beside hfkit's: skipped: needs a CUDA GPU (running on {device}).")
        return None
    openfold, reason = load_openfold()
    if openfold is None:
        print(f"OpenFold's EvoformerStack beside hfkit's: skipped: {reason}")
        return None
    rows = bench_model.run_model_benchmark(
        device,
        parts=("stack",),
        quick=not full,
        variants=("eager", "hfkit", "compile_hfkit", *STACK_OPENFOLD_VARIANTS),
        stack_dtypes=("bf16",),
        checkpointing=(True,),
        stack_launch=("eager", "graph"),
    )
    return rows_to_frame(rows)


COMMITTED_MODEL_OPS = ("evoformer_block", "evoformer_stack", "train_step")


def committed_model_outputs(frame: pd.DataFrame | None, gpu: str = "H200") -> list[Any]:
    """Committed `hfkit bench model` rows (`load_reference`) as outputs to display, for whichever
    rows the file holds: a line naming the GPU, command and commit; the summary table of the block,
    stack, step and waterfall rows; time bars of each of `COMMITTED_MODEL_OPS` with a measured row
    (every variant and launch there); the waterfall's per-stage bars and waterfall figure when a
    stage was measured. Empty for None or a frame without any of those rows."""
    if frame is None:
        return []
    main = frame[frame["op"].isin([*COMMITTED_MODEL_OPS, "step_waterfall"])]
    if main.empty:
        return []
    outputs: list[Any] = [_reference_label(main), summary_table(main)]
    for op in COMMITTED_MODEL_OPS:
        if main.loc[main["op"] == op, "p50_ms"].notna().any():
            outputs.append(model_time_bars(main, op, title=f"reference: {gpu} (committed), {op}"))
    if main.loc[main["op"] == "step_waterfall", "p50_ms"].notna().any():
        steps = waterfall_frame(main)
        outputs.append(stage_bars(steps, title=f"reference: {gpu} (committed), training step per stage"))
        outputs.append(waterfall_figure(steps, title=f"reference: {gpu} (committed), training step"))
    return outputs
