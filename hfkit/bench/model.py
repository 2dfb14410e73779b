"""Model benchmark: one Evoformer block, the 48-block Evoformer stack and a whole AlphaFold training
step, each for eager PyTorch, `to_hfkit`, `torch.compile` and `torch.compile(to_hfkit)`, the block
and stack also with per-block CUDA graphs over the swap ("hfkit_graphed": `hfkit.nn.graph_modules`)
and for OpenFold's own modules (`OPENFOLD_VARIANTS`: as they are, compiled, swapped by `to_hfkit`,
swapped and graphed); the swap waterfall (eager, then one more swapped op at a time, then the graphed step,
then compile) and a profile of the step.

Parts (`run_model_benchmark(parts=...)`, `hfkit bench model --parts`):

- `block`: `EvoformerBlock` at the preset's channel sizes with dropout off (rate 0, as OpenFold's
  block benchmark), forward and forward+backward at (S, N) in `BLOCK_SHAPES`. "fwd" is the training
  forward (inputs require grad, activations are kept for backward), so a compiled block serves both
  modes with one compiled graph. `block_launch` "graph": timed as a CUDA graph (CUDA events when
  capture fails); "eager": launched from Python each call, timed with CUDA events.
- `stack`: the 48-block `EvoformerStack` at the preset's sample size (S = clusters, N = crop),
  forward+backward, with and without per-block checkpointing. `stack_launch` "eager": launched from
  Python each call, timed with CUDA events (what a plain training loop gets); "graph": the whole
  forward+backward captured as one CUDA graph and replayed (what `torch.cuda.graph` capture of a
  static-shape training step gets: no per-op launch cost).
- `step`: a training step of `AlphaFoldLite` (embedders, extra-MSA stack, Evoformer, heads, losses,
  Adam, clipping) on a synthetic batch of the preset's shapes, with and without checkpointing, called
  from a Python loop as a user calls it. `step_launch` "eager": `hfkit.train.train_step`; "graph":
  the step `hfkit.train.graphed_step` makes (one CUDA graph; made once, its capture counted in
  `first_call_s`, eager where there is no CUDA), then `step(batch).item()` a call.
- `waterfall`: the step with the registered ops that `AlphaFoldLite` holds (`present_ops`, in
  `hfkit.nn.convert.registered_ops()` order) swapped in one at a time (cumulative, launched eagerly),
  then as a graphed step, then with compiled blocks inside the graphed step (`waterfall_stages`).
  The eager stages take seconds a step and differ by about as much as the host's noise, so they are
  built first and timed together in interleaved rounds (`hfkit.bench.timing.time_interleaved`: 1
  warm-up and 5 timed rounds on CUDA, a step of every stage a round; rows' `extra["timing"]`
  "interleaved"); the graphed stages one after another. `measure_waterfall` is the same measurement
  on a given batch (notebook 05).
- `profile`: `torch.profiler` of one step: the top operators and the LayerNorm input-shape census
  with torch's and hfkit's LayerNorm timed on every census shape.

Graphed variants ("hfkit_graphed", "openfold_hfkit_graphed") replay each block's CUDA graphs from
Python: their "eager" launch rows are what a user's loop gets with `graph_modules`. Under launch
"graph" the benchmark's own capture is in progress, so their blocks run eagerly inside it (rows equal
"hfkit"'s); so do the blocks of a checkpointed stack. Their rows' `graph_fallbacks` count the eager
block calls by reason and `graph_captures` the captures made (their time is in `first_call_s`).

Precisions: `fp32`; `bf16` (parameters and activations in bfloat16, as OpenFold's bf16 benchmark);
`bf16_autocast` (fp32 parameters under `torch.autocast(bfloat16)`, how AlphaFold trains). Compiling:
every `EvoformerBlock` (and `ExtraMSABlock`) gets its forward routed through ONE compiled function
(`compile_blocks`), so Dynamo compiles a block once per (variant, precision, shape) and reuses it for
all 48 blocks. The first call of each configuration (compile included) is timed as `first_call_s`.
Failures (out of memory, compile errors) become rows with NaN times and the error in `extra`.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import gc
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hfkit.bench.ceilings import Ceilings, bench_ceilings, resolve_device
from hfkit.bench.peers import (
    load_openfold,
    openfold_evoformer_block,
    openfold_evoformer_stack,
    openfold_training_kwargs,
)
from hfkit.bench.results import (
    ENV_KEYS,
    ResultFile,
    ResultRow,
    check_choice,
    environment_info,
    make_row,
    row_environment,
    row_key,
)
from hfkit.bench.runner import Measurement, Steps, free_memory, measure_case
from hfkit.bench.timing import Timing, time_interleaved
from hfkit.model import AlphaFoldLite, EvoformerBlock, EvoformerStack, ModelConfig

__all__ = [
    "BLOCK_SHAPES",
    "LAUNCHES",
    "MODES",
    "MODULE_VARIANTS",
    "OPENFOLD_VARIANTS",
    "PARTS",
    "PRECISIONS",
    "QUICK_BLOCK_SHAPES",
    "VARIANTS",
    "Precision",
    "bench_config",
    "compile_blocks",
    "evoformer_block_flops",
    "make_block",
    "make_variant",
    "measure_train_step",
    "measure_waterfall",
    "present_ops",
    "profile_train_step",
    "reference_ops_on_cpu",
    "run_model_benchmark",
    "summary_table",
    "swappable_ops",
    "waterfall_stages",
]

PARTS = ("block", "stack", "step", "waterfall", "profile")
LAUNCHES = ("eager", "graph")
VARIANTS = ("eager", "hfkit", "compile", "compile_hfkit")
# OpenFold's own block and stack (`hfkit.bench.peers.load_openfold`): as it is, compiled like
# `compile_blocks`, swapped by `to_hfkit` (hfkit.nn.openfold's registrations), and swapped with
# per-block CUDA graphs (`hfkit.nn.graph_modules`).
OPENFOLD_VARIANTS = ("openfold", "openfold_compile", "openfold_hfkit", "openfold_hfkit_graphed")
# The block's and the stack's; "hfkit_graphed": `to_hfkit`, then `graph_modules` on the blocks.
MODULE_VARIANTS = (*VARIANTS, "hfkit_graphed", *OPENFOLD_VARIANTS)
_OPENFOLD_AS = {
    "openfold": "eager",
    "openfold_compile": "compile",
    "openfold_hfkit": "hfkit",
    "openfold_hfkit_graphed": "hfkit_graphed",
}
MODES = ("fwd", "fwd+bwd")
BLOCK_SHAPES: tuple[tuple[int, int], ...] = ((128, 256), (256, 384), (128, 512))
# Tiny (S, N) for CPU runs and tests; odd sizes on purpose.
QUICK_BLOCK_SHAPES: tuple[tuple[int, int], ...] = ((4, 8), (3, 11))


@dataclass(frozen=True)
class Precision:
    """How a configuration runs: parameter (and input) dtype, and the autocast dtype (None: off)."""

    name: str
    params: torch.dtype
    autocast: torch.dtype | None

    def describe(self) -> dict[str, str | None]:
        return {
            "params_dtype": str(self.params).removeprefix("torch."),
            "autocast": None if self.autocast is None else str(self.autocast).removeprefix("torch."),
        }

    def context(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast)


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", torch.float32, None),
    "bf16": Precision("bf16", torch.bfloat16, None),
    "bf16_autocast": Precision("bf16_autocast", torch.float32, torch.bfloat16),
}


def bench_config(quick: bool = False) -> ModelConfig:
    """The preset the benchmark runs: `af2_initial` (c_m 256, c_z 128, 8 MSA / 4 pair heads, 48
    blocks, crop 256, 128 clusters, 1024 extra rows), or `tiny` when `quick`."""
    return ModelConfig.tiny() if quick else ModelConfig.af2_initial()


def make_block(config: ModelConfig, dropout: bool = False) -> EvoformerBlock:
    """One `EvoformerBlock` with `config`'s sizes (the block a one-block stack of `config` builds);
    dropout rates 0 unless `dropout`."""
    if not dropout:
        config = config.replace(msa_dropout=0.0, pair_dropout=0.0)
    return EvoformerStack.from_config(config.replace(no_blocks=1)).blocks[0]


def evoformer_block_flops(s: int, n: int, config: ModelConfig) -> int:
    """Matmul FLOPs (2 per multiply-add) of one Evoformer block's forward at MSA depth `s` and `n`
    residues; forward+backward is about 3x this. Elementwise work, softmax and LayerNorm are not
    counted (they are memory-bound). At af2_initial sizes and (128, 256): ~0.22 TFLOP forward."""
    c_m, c_z = config.c_m, config.c_z
    h_m, c_a = config.no_heads_msa, config.c_hidden_msa_att
    h_z, c_p = config.no_heads_pair, config.c_hidden_pair_att
    c_o, c_x, t = config.c_hidden_opm, config.c_hidden_mul, config.transition_n
    rows, pairs = s * n, n * n
    # Gated attention over `r` rows of length `l`: q, k, v, g and output projections, logits, A @ V.
    attn = lambda r, l, c_in, h, c: 2 * r * l * c_in * h * c * 5 + 2 * 2 * r * h * l * l * c
    flops = attn(s, n, c_m, h_m, c_a) + 2 * pairs * c_z * h_m  # row attention + pair bias
    flops += attn(n, s, c_m, h_m, c_a)  # column attention
    flops += 2 * 2 * rows * c_m * t * c_m  # MSA transition
    flops += 2 * 2 * rows * c_m * c_o + 2 * s * pairs * c_o * c_o + 2 * pairs * c_o * c_o * c_z  # OPM
    # Two triangle multiplications: a/b projections and gates, g, output, the triangle product.
    flops += 2 * (
        2 * pairs * c_z * c_x * 4 + 2 * pairs * c_z * c_z + 2 * pairs * c_x * c_z + 2 * n * pairs * c_x
    )
    flops += 2 * (attn(n, n, c_z, h_z, c_p) + 2 * pairs * c_z * h_z)  # two triangle attentions
    flops += 2 * 2 * pairs * c_z * t * c_z  # pair transition
    return int(flops)


def _block_forward(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The class's forward, not block(...): blocks routed through `compile_blocks` have this very
    # function as their instance forward, and calling the module would come back here.
    return type(block).forward(block, *args, **kwargs)


@functools.cache
def _compiled_block_forward(backend: str, mode: str | None) -> Callable[..., Any]:
    # One compiled callable per (backend, mode), shared by every block: Dynamo caches compiled code
    # per code object and guards on the block's structure, not its identity, so 48 blocks of one
    # class and precision compile once.
    return torch.compile(_block_forward, backend=backend, mode=mode, dynamic=False)


def compile_blocks(
    model: nn.Module,
    backend: str = "inductor",
    mode: str | None = None,
    blocks: tuple[type[nn.Module], ...] = (EvoformerBlock,),
) -> int:
    """Route the forward of every module of a `blocks` class in `model` (default: hfkit's
    `EvoformerBlock`, extra-MSA blocks included; OpenFold's `EvoformerBlock` for its stack) through
    one shared `torch.compile`d function, in place; return how many blocks were routed.

    Per-block compilation keeps compile time to one block's graph (a 48-block stack compiled whole
    takes minutes) and works under per-block checkpointing. `del block.forward` undoes it.
    """
    compiled = _compiled_block_forward(backend, mode)
    count = 0
    for module in model.modules():
        if isinstance(module, blocks):
            module.forward = functools.partial(compiled, module)
            count += 1
    return count


def _recompile_limit(limit: int = 256) -> contextlib.AbstractContextManager[Any]:
    """Dynamo's per-code-object recompile limit (default 8) raised within the block by Dynamo's own
    scoped `config.patch`: one compiled function serves every (variant, precision, shape) of the run,
    each a cache entry of its own."""
    return torch._dynamo.config.patch(recompile_limit=limit)


def swappable_ops() -> list[str]:
    """The op names `to_hfkit` can swap now (`registered_ops()`, in registration order)."""
    from hfkit.nn.convert import registered_ops

    return list(registered_ops())


def make_variant(
    module: nn.Module,
    variant: str,
    *,
    ops: Sequence[str] | None = None,
    inplace: bool = False,
    compile_backend: str = "inductor",
    compile_mode: str | None = None,
    blocks: tuple[type[nn.Module], ...] = (EvoformerBlock,),
) -> tuple[nn.Module, dict[str, Any]]:
    """`module` as `variant`: "eager" (unchanged), "hfkit" (`to_hfkit`, only `ops` when given),
    "compile" (`compile_blocks` of the `blocks` classes), "compile_hfkit" (both), "hfkit_graphed"
    (`to_hfkit`, then `hfkit.nn.graph_modules` on the `blocks` classes); for an OpenFold module
    "openfold", "openfold_hfkit", "openfold_compile" and "openfold_hfkit_graphed" are "eager",
    "hfkit", "compile" and "hfkit_graphed" (with `blocks` OpenFold's block class). A deep copy unless
    `inplace`. Returns the module and notes for the result row (`swap`: the swap report's summary,
    `compiled_blocks`, `graphed_blocks`)."""
    if variant not in MODULE_VARIANTS:
        raise ValueError(f"variant: expected one of {MODULE_VARIANTS}, got {variant!r}")
    from hfkit.nn.convert import to_hfkit

    variant = _OPENFOLD_AS.get(variant, variant)

    if not inplace:
        module = copy.deepcopy(module)
    notes: dict[str, Any] = {}
    if variant in ("hfkit", "compile_hfkit", "hfkit_graphed"):
        include = None if ops is None else list(ops)
        module, report = to_hfkit(module, include=include, report=True)
        notes["swap"] = report.summary()
        if ops is not None:
            notes["ops"] = list(ops)
    if variant in ("compile", "compile_hfkit"):
        notes["compiled_blocks"] = compile_blocks(module, compile_backend, compile_mode, blocks)
        notes["compile"] = {"backend": compile_backend, "mode": compile_mode, "dynamic": False}
    if variant == "hfkit_graphed":
        from hfkit.nn.graphed import graph_modules, graphed_forwards

        notes["graphed_blocks"] = len(graphed_forwards(graph_modules(module, classes=blocks)))
        notes["graphed"] = (
            "per-block CUDA graphs replayed from Python; blocks run eagerly inside the benchmark's own "
            "capture (launch 'graph': as 'hfkit') and in a checkpointed stack (graph_fallbacks counts "
            "them)"
        )
    return module, notes


def _grad_step(
    forward: Callable[[], Sequence[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    backward: bool,
    device: torch.device,
    precision: Precision,
    accumulate: bool = False,
) -> Callable[[], None]:
    """One call: `forward()` under the precision's autocast, then (if `backward`) the gradients of
    its outputs against random output gradients, w.r.t. `inputs` and `params` (`autograd.grad`: no
    `.grad` accumulation, so the call can be captured in a CUDA graph). With `accumulate` they are
    added to each `.grad` instead (`autograd.backward`, as a training loop's `loss.backward()`): the
    way for modules whose reentrant checkpointing rejects `autograd.grad` (OpenFold's stack)."""
    cache: dict[str, list[torch.Tensor]] = {}

    def step() -> None:
        with precision.context(device):
            outs = [o for o in forward() if o.requires_grad]
        if not backward:
            return
        if "grads" not in cache:  # made on the first (unmeasured) call, never during capture
            cache["grads"] = [torch.randn_like(o) for o in outs]
        if accumulate:
            torch.autograd.backward(outs, cache["grads"])
        else:
            torch.autograd.grad(outs, [*inputs, *params], cache["grads"])

    return step


# The error of a row whose configuration would have started after the run's `budget_s`.
_BUDGET_SPENT = "skipped: the run's time budget (budget_s) was spent"


@dataclass
class _Run:
    """What a benchmark run shares: device, row environment, ceilings, budget, output, collected rows."""

    device: torch.device
    env: dict[str, Any]
    ceilings: Ceilings | None
    deadline: float | None
    file: ResultFile | None
    compile_backend: str
    compile_mode: str | None
    progress: Any
    interpret: bool = False
    rows: list[ResultRow] = field(default_factory=list)
    openfold_loaded: tuple[Any, str | None] | None = None

    def openfold(self) -> tuple[Any, str | None]:
        """`load_openfold()`, once a run: (OpenFold's modules, None) or (None, why not)."""
        if self.openfold_loaded is None:
            self.openfold_loaded = load_openfold()
        return self.openfold_loaded

    def out_of_time(self) -> bool:
        """Whether the run's time budget is spent: what starts now gets a `_BUDGET_SPENT` row."""
        return self.deadline is not None and time.perf_counter() > self.deadline

    def skip(self, label: str, key: tuple, extra: Mapping[str, Any], reason: str) -> None:
        """Rows for a configuration that cannot run here: each mode of `key` (as in `measure`) gets a
        row with NaN times and `extra["error"]` "skipped: <reason>"."""
        op, provider, modes, shape, precision, flops = key
        self.progress.set_postfix_str(label)
        notes = {**precision.describe(), **extra, "error": f"skipped: {reason}"}
        for mode in modes:
            row = dict(op=op, provider=provider, mode=mode, shape=shape, dtype=precision.name)
            row["flops"] = None if flops is None else flops * (3 if mode == "fwd+bwd" else 1)
            self.rows.append(make_row(self.env, None, ceilings=self.ceilings, extra=notes, **row))
        self.done(len(modes))

    def measure(
        self,
        label: str,
        key: tuple[str, str, Sequence[str], Sequence[int], Precision, int | None],
        extra: Mapping[str, Any],
        build: Callable[[str], Steps],
        timing: tuple[int, int, bool],
    ) -> None:
        """One configuration, a row per mode through the runner's `measure_case`: `key` is (op,
        provider, modes, shape, precision, forward FLOPs), `build(mode)` gives the `Steps` (its check
        returns the variant's notes), `timing` is (warmup, reps, CUDA graph). With the time budget
        spent each mode gets an error row that says so. Then the rows so far are saved."""
        op, provider, modes, shape, precision, flops = key
        self.progress.set_postfix_str(label)
        notes = {**precision.describe(), **extra}
        for mode in modes:
            row = dict(op=op, provider=provider, mode=mode, shape=shape, dtype=precision.name)
            row["flops"] = None if flops is None else flops * (3 if mode == "fwd+bwd" else 1)
            if self.out_of_time():
                self.rows.append(
                    make_row(
                        self.env, None, ceilings=self.ceilings, extra={**notes, "error": _BUDGET_SPENT}, **row
                    )
                )
                continue
            warmup, reps, graph = timing
            with self.cpu_path():
                measured = measure_case(
                    env=self.env, ceilings=self.ceilings, device=self.device, nbytes=0,
                    build=functools.partial(build, mode=mode), warmup=warmup, reps=reps, extra=notes,
                    graph=graph, first_call=True, **row,
                )  # fmt: skip
            self.rows.append(_graph_peak(measured))
        self.done(len(modes))

    def done(self, count: int) -> None:
        self.progress.update(count)
        free_memory(self.device)
        if self.file is not None:
            self.file.save(self.rows, ceilings=self.ceilings)

    def cpu_path(self) -> contextlib.AbstractContextManager[Any]:
        return _cpu_path(self.device, self.interpret)


def _cpu_path(device: torch.device, interpret: bool) -> contextlib.AbstractContextManager[Any]:
    if interpret or device.type == "cuda":
        return contextlib.nullcontext()
    return reference_ops_on_cpu()


def reference_ops_on_cpu() -> contextlib.AbstractContextManager[None]:
    """Within this block, hfkit's ops run their plain-torch reference on CPU tensors even under
    `TRITON_INTERPRET=1` (the interpreter runs a model ~1000x slower: fine for testing a kernel, not
    for timing or profiling a model). CUDA tensors are unaffected: `hfkit.ops.reference_on_cpu()`."""
    from hfkit.ops import reference_on_cpu

    return reference_on_cpu()


def _block_inputs(
    config: ModelConfig, s: int, n: int, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """m [1, S, N, c_m] and z [1, N, N, c_z] (requiring grad, as inside a stack), all-ones masks."""
    g = torch.Generator(device=device).manual_seed(seed)
    m = torch.randn((1, s, n, config.c_m), device=device, dtype=dtype, generator=g).requires_grad_()
    z = torch.randn((1, n, n, config.c_z), device=device, dtype=dtype, generator=g).requires_grad_()
    msa_mask = torch.ones((1, s, n), device=device, dtype=dtype)
    pair_mask = torch.ones((1, n, n), device=device, dtype=dtype)
    return m, z, msa_mask, pair_mask


def _module_steps(
    run: _Run,
    module: nn.Module,
    variant: str,
    inputs: Sequence[torch.Tensor],
    precision: Precision,
    inplace: bool,
    mode: str,
    *,
    call_kwargs: Mapping[str, Any] | None = None,
    blocks: tuple[type[nn.Module], ...] = (EvoformerBlock,),
    accumulate: bool = False,
) -> Steps:
    """`module(*inputs, **call_kwargs)` (inputs: m, z, msa_mask, pair_mask) as `variant`, one call of
    `mode`; `blocks`: the block classes a compiled variant compiles; `accumulate`: see `_grad_step`."""
    module, notes = make_variant(
        module,
        variant,
        inplace=inplace,
        compile_backend=run.compile_backend,
        compile_mode=run.compile_mode,
        blocks=blocks,
    )
    params = [p for p in module.parameters() if p.requires_grad]
    forward = functools.partial(module, *inputs, **(call_kwargs or {}))
    step = _grad_step(forward, inputs[:2], params, mode == "fwd+bwd", run.device, precision, accumulate)
    if accumulate:
        notes["backward"] = "autograd.backward (gradients accumulate in .grad)"
    return Steps(step, step, 1, lambda: notes, _graph_notes(module))


def _graph_notes(module: nn.Module) -> Callable[[], dict[str, Any]] | None:
    """For a module with graphed blocks: notes read after timing, the captures made and the eager
    block calls by reason (e.g. inside the benchmark's own capture, checkpointing)."""
    from hfkit.nn.graphed import graphed_forwards

    forwards = graphed_forwards(module)
    if not forwards:
        return None

    def notes() -> dict[str, Any]:
        fallbacks = sum((f.fallbacks for f in forwards), collections.Counter())
        captures = sum(f.captures for f in forwards)
        out = {"graph_captures": captures, "graph_fallbacks": dict(fallbacks)}
        if captures:
            # The graphs' memory pools are allocated at capture, in the first call, before the
            # measured window: a replay allocates nothing new, so the measured peak reads 0.
            out["peak_unmeasured"] = "the graphs' pools are allocated at capture, before the measured calls"
        return out

    return notes


def _openfold_call(of: Any, config: ModelConfig) -> dict[str, Any]:
    """`_module_steps` keywords for an OpenFold block or stack: its training call, its block class."""
    return {"call_kwargs": openfold_training_kwargs(config), "blocks": (of.evoformer.EvoformerBlock,)}


def _bench_blocks(run, config, shapes, precisions, variants, modes, launches, timing) -> None:
    """Block rows: each launch ("graph": a CUDA graph replayed; "eager": launched from Python each
    call, CUDA events) x precision x shape x variant x mode. OpenFold's variants use its own
    `EvoformerBlock` at the same sizes on the same inputs, or become skipped rows without it."""
    for launch in launches:
        extra = {"n_blocks": 1, "dropout": "off", "fwd_grad": True, "launch": launch}
        for precision in precisions:
            for s, n in shapes:
                torch.manual_seed(0)
                base = make_block(config).to(run.device, precision.params)
                inputs = _block_inputs(config, s, n, run.device, precision.params)
                flops = evoformer_block_flops(s, n, config)
                theirs = None
                for variant in variants:
                    key = ("evoformer_block", variant, modes, [s, n], precision, flops)
                    label = f"block {launch} {s}x{n} {precision.name} {variant}"
                    if variant in OPENFOLD_VARIANTS:
                        of, reason = run.openfold()
                        if of is None:
                            run.skip(label, key, extra, reason)
                            continue
                        if theirs is None:
                            torch.manual_seed(0)
                            theirs = openfold_evoformer_block(of, config).to(run.device, precision.params)
                        build = functools.partial(
                            _module_steps,
                            run,
                            theirs,
                            variant,
                            inputs,
                            precision,
                            False,
                            **_openfold_call(of, config),
                        )
                    else:
                        build = functools.partial(_module_steps, run, base, variant, inputs, precision, False)
                    run.measure(label, key, extra, build, (*timing, launch == "graph"))
                del base, inputs, theirs


def _stack_steps(run: _Run, config: ModelConfig, variant: str, precision: Precision, mode: str) -> Steps:
    s, n = config.max_msa_clusters, config.crop_size
    torch.manual_seed(0)
    if variant in OPENFOLD_VARIANTS:
        of, reason = run.openfold()
        if of is None:
            raise RuntimeError(f"OpenFold: {reason}")
        stack = openfold_evoformer_stack(of, config).to(run.device, precision.params)
        # OpenFold checkpoints with torch's reentrant checkpoint, which rejects autograd.grad.
        call = {**_openfold_call(of, config), "accumulate": config.checkpoint}
    else:
        stack = EvoformerStack.from_config(config).to(run.device, precision.params)
        call = {}
    inputs = _block_inputs(config, s, n, run.device, precision.params)
    return _module_steps(run, stack, variant, inputs, precision, True, mode, **call)


def _bench_stack(run, config, precisions, variants, checkpointing, launches, timing) -> None:
    """Stack rows: each launch x precision x checkpointing x variant. OpenFold's variants use its
    own `EvoformerStack` (per-block checkpointing: its `blocks_per_ckpt` 1), or become skipped rows
    without it."""
    s, n = config.max_msa_clusters, config.crop_size
    flops = config.no_blocks * evoformer_block_flops(s, n, config)
    for launch in launches:
        for precision in precisions:
            for ckpt in checkpointing:
                stack_config = config.replace(checkpoint=ckpt, msa_dropout=0.0, pair_dropout=0.0)
                extra = {
                    "n_blocks": config.no_blocks,
                    "checkpointing": ckpt,
                    "dropout": "off",
                    "launch": launch,
                }
                for variant in variants:
                    key = ("evoformer_stack", variant, ["fwd+bwd"], [s, n], precision, flops)
                    label = f"stack {launch} ckpt={ckpt} {precision.name} {variant}"
                    reason = run.openfold()[1] if variant in OPENFOLD_VARIANTS else None
                    if reason is not None:
                        run.skip(label, key, extra, reason)
                        continue
                    build = functools.partial(_stack_steps, run, stack_config, variant, precision)
                    run.measure(label, key, extra, build, (*timing, launch == "graph"))


def _train_steps(
    config: ModelConfig,
    device: torch.device,
    precision: Precision,
    variant: str,
    ops: Sequence[str] | None,
    compile_backend: str,
    compile_mode: str | None,
    seed: int = 0,
    *,
    launch: str = "eager",
    batch: Mapping[str, torch.Tensor] | None = None,
    mode: str = "fwd+bwd",
) -> Steps:
    """One training step a call, as a user's Python loop makes it (always forward+backward: `mode` is
    there for `_Run.measure`). `launch` "eager": `hfkit.train.train_step`; "graph": the step made by
    `hfkit.train.graphed_step` (AlphaFold's schedule, clipping at 0.1) on the first call, so its
    capture (and any compilation in its warm-up) is part of the first call and not of the timing,
    then `loss = step(batch); loss.item()` a call (the host reads the loss, as a loop that logs it
    does). `batch`: the step's batch (copied to `device`), else `synthetic_batch(config, seed=seed)`.
    The check gives the variant's notes, `after` the last call's loss (and, eager, phases)."""
    from hfkit.train import make_optimizer, synthetic_batch, train_step

    check_choice("launch", [launch], LAUNCHES)
    torch.manual_seed(seed)
    model = AlphaFoldLite(config).to(device, precision.params)
    model, notes = make_variant(
        model, variant, ops=ops, inplace=True, compile_backend=compile_backend, compile_mode=compile_mode
    )
    optimizer = make_optimizer(model)
    if batch is None:
        batch = synthetic_batch(config, seed=seed, device=device)
    else:
        batch = {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}

    if launch == "eager":
        records: list[dict[str, Any]] = []

        def step() -> None:
            records.append(train_step(model, batch, optimizer, clip=0.1, autocast_dtype=precision.autocast))

        last = lambda: {"phases_s": records[-1]["timings"], "loss": records[-1]["loss"]}  # noqa: E731
        return Steps(step, step, 1, lambda: dict(notes), last)

    made: dict[str, Any] = {}

    def graph_step() -> None:
        if "step" not in made:
            made.update(_capture_step(model, optimizer, batch, precision, device))
        made["loss"] = made["step"](batch).item()

    def graph_notes() -> dict[str, Any]:
        # `cuda_graph`: whether the step is one (without CUDA graphed_step runs it eagerly). A dict:
        # the launch, not these notes, tells the configurations apart.
        capture = {"cuda_graph": made["step"].graphed, "seconds": made["capture_s"]}
        notes = {"capture": capture, "loss": made["loss"]}
        if made["capture_peak_bytes"] is not None:
            notes["capture_peak_bytes"] = made["capture_peak_bytes"]
        return notes

    return Steps(graph_step, graph_step, 1, lambda: dict(notes), graph_notes)


def _capture_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Mapping[str, torch.Tensor],
    precision: Precision,
    device: torch.device,
) -> dict[str, Any]:
    """`hfkit.train.graphed_step` of `model` as a user makes it -> {"step", "capture_s": seconds to
    make it (warm-up steps and capture), "capture_peak_bytes": CUDA memory it peaked at above what
    was allocated before (None off CUDA)}. Replays allocate nothing, so this peak, not a replay's, is
    the memory the graphed step needs."""
    from hfkit.train import graphed_step, make_scheduler

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    started = time.perf_counter()
    step = graphed_step(
        model,
        optimizer,
        batch,
        autocast_dtype=precision.autocast,
        clip_norm=0.1,
        scheduler=make_scheduler(optimizer),
    )
    capture_s = time.perf_counter() - started
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = int(torch.cuda.max_memory_allocated(device) - base)
    return {"step": step, "capture_s": capture_s, "capture_peak_bytes": peak}


def _graph_peak(row: ResultRow) -> ResultRow:
    """A graph-launched step's row with the capture's peak memory as its peak (see `_capture_step`)."""
    peak = row.extra.pop("capture_peak_bytes", None)
    if peak is not None:
        row.peak_mem_bytes = peak
    return row


def measure_train_step(
    config: ModelConfig,
    device: torch.device | str | None = None,
    precision: str = "bf16_autocast",
    variant: str = "eager",
    *,
    ops: Sequence[str] | None = None,
    warmup: int | None = None,
    reps: int | None = None,
    compile_backend: str = "inductor",
    compile_mode: str | None = None,
    seed: int = 0,
    interpret: bool = False,
    launch: str = "eager",
    batch: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Time a training step of a fresh `AlphaFoldLite(config)` (seeded) as `variant` (`ops`: the
    registered ops "hfkit" swaps; None: all) on `batch` (default: a synthetic batch of the preset's
    shapes; e.g. one of the data pipeline's, with `config`'s sizes), called
    from a Python loop, with CUDA events (a step reads its loss on the host) or the wall clock.
    `launch` "eager": `hfkit.train.train_step`; "graph": the step `hfkit.train.graphed_step` makes
    (made on the first call, outside the timing; eager where there is no CUDA).

    Returns {"timing": Timing, "first_call_s" (compilation and capture included), "peak_mem_bytes"
    (None off CUDA; graph: the capture's peak), "phases_s" (eager: forward, backward, optimizer
    seconds of the last call; graph: {}), "loss", "notes" (swap summary, compile settings; graph:
    `capture`: {"cuda_graph": whether it is one, "seconds": to make it})}. On a CPU hfkit's ops run
    their references unless `interpret` (see `reference_ops_on_cpu`). Raises RuntimeError with the
    error when the step fails.
    """
    device = resolve_device(device)
    prec = _precision(precision)
    check_choice("launch", [launch], LAUNCHES)
    build = functools.partial(
        _train_steps,
        config,
        device,
        prec,
        variant,
        ops,
        compile_backend,
        compile_mode,
        seed,
        launch=launch,
        batch=batch,
    )
    with _recompile_limit(), _cpu_path(device, interpret):
        row = measure_case(
            env=row_environment(device, None), ceilings=None, device=device, op="train_step",
            provider=variant, mode="fwd+bwd", shape=[config.max_msa_clusters, config.crop_size],
            dtype=prec.name, nbytes=0, flops=None, build=build, graph=False, first_call=True,
            warmup=_slow_timing(device)[0] if warmup is None else warmup,
            reps=_slow_timing(device)[1] if reps is None else reps, extra={"launch": launch},
        )  # fmt: skip
    row = _graph_peak(row)
    if row.method == "error":
        raise RuntimeError(f"measure_train_step: {row.extra['error']}")
    notes = {k: v for k, v in row.extra.items() if k not in ("first_call_s", "setup_s", "phases_s", "loss")}
    return {
        "timing": Timing(row.p20_ms, row.p50_ms, row.p80_ms, row.n_reps, row.method),
        "first_call_s": row.extra["first_call_s"],
        "peak_mem_bytes": row.peak_mem_bytes,
        "phases_s": row.extra.get("phases_s", {}),
        "loss": row.extra["loss"],
        "notes": notes,
    }


def _step_extra(config: ModelConfig) -> dict[str, Any]:
    return {
        "n_blocks": config.no_blocks,
        "extra_msa_blocks": config.extra_no_blocks,
        "extra_msa_rows": config.max_extra_msa,
        "checkpointing": config.checkpoint,
        "dropout": "on (training)",
    }


def _step_builder(
    run: _Run,
    config: ModelConfig,
    precision: Precision,
    variant: str,
    ops: Sequence[str] | None,
    launch: str,
    batch: Mapping[str, torch.Tensor] | None,
) -> Callable[..., Steps]:
    """`_train_steps` of one training-step configuration on the run's device and compile settings,
    for `_Run.measure` (which passes the mode) or `Measurement.prepare`."""
    return functools.partial(
        _train_steps,
        config,
        run.device,
        precision,
        variant,
        ops,
        run.compile_backend,
        run.compile_mode,
        launch=launch,
        batch=batch,
    )


def _bench_train_steps(
    run: _Run,
    op: str,
    runs: list,
    precision: Precision,
    timing: tuple[int, int],
    batch: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Training steps, a row each, measured one after another: `runs` of (provider, config, variant,
    swapped ops or None, launch, notes); see `_train_steps` for the launches and `batch`."""
    for provider, config, variant, ops, launch, notes in runs:
        key = (op, provider, ["fwd+bwd"], [config.max_msa_clusters, config.crop_size], precision, None)
        build = _step_builder(run, config, precision, variant, ops, launch, batch)
        label = f"{op} {provider} {launch} ckpt={config.checkpoint} {precision.name}"
        extra = {**_step_extra(config), "launch": launch, **notes}
        run.measure(label, key, extra, build, (*timing, False))


def waterfall_stages(
    ops: Sequence[str] | None = None, compile: bool = True
) -> list[tuple[str, str, list[str], str]]:
    """The waterfall's stages as (label, variant, swapped ops, launch): "eager", then "+<op>" for each
    op of `ops` (default: every registered one, `swappable_ops()`; the benchmark passes the ops its
    model holds, `present_ops`) swapped in cumulatively, all launched eagerly (`train_step`); then
    "+graph" (all swapped, the step made by `graphed_step`), then "+compile" (all swapped, blocks
    compiled, inside the graphed step) unless `compile` is False."""
    ops = swappable_ops() if ops is None else list(ops)
    stages = [("eager", "eager", [], "eager")]
    stages += [(f"+{op}", "hfkit", ops[: i + 1], "eager") for i, op in enumerate(ops)]
    stages.append(("+graph", "hfkit", list(ops), "graph"))
    if compile:
        stages.append(("+compile", "compile_hfkit", list(ops), "graph"))
    return stages


def present_ops(model: nn.Module) -> list[str]:
    """The registered op names (`swappable_ops()`, in that order, opt-in ones included) of which
    `model` holds at least one module that `to_hfkit` swaps: those `to_hfkit(model, include=<every
    name>)` reports as swapped, found on a copy (`model` is left as it is; one on the meta device
    copies for nothing)."""
    from hfkit.nn.convert import to_hfkit

    names = swappable_ops()
    _, report = to_hfkit(model, inplace=False, include=names, report=True)
    swapped = report.counts("swapped")
    return [name for name in names if swapped[name]]


def _model_ops(config: ModelConfig) -> list[str]:
    """`present_ops` of `AlphaFoldLite(config)`, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        return present_ops(AlphaFoldLite(config))


def _waterfall_rounds(device: torch.device) -> tuple[int, int]:
    """(warm-up, timed) interleaved rounds of the waterfall's eager stages: on CUDA 1 and 5 (a step
    takes seconds at af2_initial); elsewhere 0 and 1 (the tiny preset's smoke run)."""
    return (1, 5) if device.type == "cuda" else (0, 1)


def _slow_timing(device: torch.device) -> tuple[int, int]:
    """(warm-up, reps) of a call that takes about a second (the stack, the step): 1 and 3 on CUDA."""
    return (1, 3) if device.type == "cuda" else (0, 1)


def _bench_waterfall(
    run: _Run,
    config: ModelConfig,
    precision: Precision,
    stages: Sequence[tuple[str, str, list[str], str]],
    timing: tuple[int, int],
    rounds: tuple[int, int],
    batch: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """The waterfall's rows, op "step_waterfall", one per stage of `stages` (`waterfall_stages`;
    `extra["stage"]` its index), on `batch` (see `_train_steps`).

    The stages launched from Python take seconds a step, and the host's speed wanders by more than
    neighbouring stages differ, so they are timed together: each is built first (a fresh,
    identically seeded model) and given its first call and peak-memory call (`Measurement.prepare`),
    then all take `rounds` = (warm-up, timed) interleaved rounds (`time_interleaved`: one step of
    every stage a round, in stage order; `extra["timing"]` "interleaved"). A stage failing in any of
    these gets an error row and the others go on. The graphed stages (fast and stable) are then
    measured one by one (`_Run.measure`, `timing` = (warm-up, reps)). A stage that would start after
    the run's budget gets a skipped row."""
    shape = [config.max_msa_clusters, config.crop_size]
    common = {**precision.describe(), **_step_extra(config)}
    eager = [(i, stage) for i, stage in enumerate(stages) if stage[3] == "eager"]
    rows: dict[int, ResultRow] = {}  # by stage index
    cases: dict[int, Measurement] = {}
    for i, (label, variant, ops, launch) in eager:
        key = dict(op="step_waterfall", provider=label, mode="fwd+bwd", shape=shape, dtype=precision.name)
        key |= {"nbytes": 0, "flops": None}
        notes = {**common, "launch": launch, "stage": i, "variant": variant, "ops": ops}
        if run.out_of_time():
            notes["error"] = _BUDGET_SPENT
            rows[i] = make_row(run.env, None, ceilings=run.ceilings, extra=notes, **key)
            continue
        case = Measurement(run.env, run.ceilings, run.device, key, {**notes, "timing": "interleaved"})
        cases[i] = case
        run.progress.set_postfix_str(f"step_waterfall {label} (first call)")
        build = _step_builder(run, config, precision, variant, ops, launch, batch)
        with run.cpu_path():
            case.prepare(build, first_call=True)
    ready = [case for case in cases.values() if case.error is None]
    run.progress.set_postfix_str(f"step_waterfall: {len(ready)} stages, {sum(rounds)} rounds")
    with run.cpu_path():
        # Each callable looks its steps up when called: a stage that fails drops its steps (and
        # model) at once, not after the last round.
        timings = time_interleaved(
            [lambda case=case: case.steps.step() for case in ready],
            run.device,
            warmup=rounds[0],
            rounds=rounds[1],
            on_error=lambda index, err: ready[index].fail(err),
        )
    timed = {id(case): t for case, t in zip(ready, timings, strict=True)}
    # Making a row drops its stage's steps: the models are gone before the graphed stages.
    rows |= {i: _graph_peak(case.row(timed.get(id(case)))) for i, case in cases.items()}
    run.rows.extend(rows[i] for i in sorted(rows))
    run.done(len(eager))
    graphed = [
        (label, config, variant, ops, launch, {"stage": i, "variant": variant, "ops": ops})
        for i, (label, variant, ops, launch) in enumerate(stages)
        if launch != "eager"
    ]
    _bench_train_steps(run, "step_waterfall", graphed, precision, timing, batch)


def measure_waterfall(
    config: ModelConfig,
    device: torch.device | str | None = None,
    precision: str = "bf16_autocast",
    *,
    batch: Mapping[str, torch.Tensor] | None = None,
    ops: Sequence[str] | None = None,
    compile: bool = True,
    compile_backend: str = "inductor",
    compile_mode: str | None = None,
    rounds: tuple[int, int] | None = None,
    timing: tuple[int, int] | None = None,
    interpret: bool = False,
    progress: bool = False,
) -> list[ResultRow]:
    """The training-step waterfall of `AlphaFoldLite(config)` on `batch` (None: a synthetic batch of
    the preset's shapes), measured as `hfkit bench model --parts waterfall` measures it: a
    "step_waterfall" row per stage of `waterfall_stages(ops, compile)`, `ops` defaulting to the
    registered ops the model holds (`present_ops`). The eager stages are timed in interleaved rounds,
    `rounds` = (warm-up, timed) (default 1 and 5 on CUDA, 0 and 1 elsewhere); the graphed ones one by
    one with `timing` = (warm-up, reps) (default 1 and 3 on CUDA, 0 and 1 elsewhere). Rows keep their
    first call (`first_call_s`: compilation and capture), peak memory (CUDA) and notes; a failing stage
    gives an error row. On a CPU hfkit's ops run their references unless `interpret`."""
    from tqdm.auto import tqdm

    device = resolve_device(device)
    prec = _precision(precision)
    stages = waterfall_stages(_model_ops(config) if ops is None else ops, compile=compile)
    bar = tqdm(total=len(stages), disable=not progress, desc="waterfall")
    run = _Run(
        device=device,
        env=row_environment(device, None),
        ceilings=None,
        deadline=None,
        file=None,
        compile_backend=compile_backend,
        compile_mode=compile_mode,
        progress=bar,
        interpret=interpret,
    )
    try:
        with _recompile_limit():
            _bench_waterfall(
                run,
                config,
                prec,
                stages,
                timing or _slow_timing(device),
                rounds or _waterfall_rounds(device),
                batch,
            )
    finally:
        bar.close()
    return run.rows


def profile_train_step(
    config: ModelConfig,
    device: torch.device | str | None = None,
    precision: str = "bf16_autocast",
    variant: str = "eager",
    *,
    steps: int = 1,
    top: int = 15,
    census_reps: int | None = None,
    seed: int = 0,
    interpret: bool = False,
) -> dict[str, Any]:
    """Profile `steps` training steps (after one warm-up step) of `AlphaFoldLite(config)` as
    `variant` with `torch.profiler`. Returns {"ops": `op_table` (top operators by device time),
    "census": the LayerNorm input-shape census, "speed": torch vs hfkit LayerNorm on each census
    shape (`census_speed`, in the precision's compute dtype), "step_ms": profiled device time per
    step}. On a CPU hfkit's ops run their references unless `interpret`."""
    from hfkit.bench.profile import census_speed, layer_norm_census, op_table, profile_step

    device = resolve_device(device)
    prec = _precision(precision)
    train = _train_steps(config, device, prec, variant, None, "inductor", None, seed)
    with _cpu_path(device, interpret):
        prof = profile_step(train.step, device, steps=steps, warmup=1)
        ops = op_table(prof, top=top)
        census = layer_norm_census(prof)
        del train, prof
        gc.collect()
        dtype = prec.autocast or prec.params
        warmup = None if census_reps is None else 2
        speed = census_speed(census, device, dtype=dtype, warmup=warmup, reps=census_reps)
    return {"ops": ops, "census": census, "speed": speed, "step_ms": ops.attrs["total_ms"] / steps}


def _profile_rows(run: _Run, config: ModelConfig, precision: Precision) -> list[ResultRow]:
    s, n = config.max_msa_clusters, config.crop_size
    reps = 20 if run.device.type == "cuda" else 3
    out = profile_train_step(config, run.device, precision.name, census_reps=reps)
    ops, census = out["ops"], out["census"]
    device_time = ops.attrs["device_time"]

    def row(op: str, provider: str, mode: str, shape: Sequence[int], ms: float, notes: dict) -> ResultRow:
        # A profiled total is one number, not a distribution: p20 = p50 = p80.
        return make_row(
            run.env, Timing(ms, ms, ms, 1, "wall"), op=op, provider=provider, mode=mode, shape=shape,
            dtype=precision.name, ceilings=run.ceilings, extra={**precision.describe(), **notes},
        )  # fmt: skip

    rows = []
    for r in ops.itertuples():
        notes = {"calls": int(r.calls), "share_pct": r.share_pct, "device_time": device_time}
        rows.append(
            row("step_profile", r.name, "fwd+bwd", [s, n], r.time_ms, {**notes, "step_ms": out["step_ms"]})
        )
    speed = {tuple(r.shape): r for r in out["speed"].itertuples()}
    for r in census.itertuples():
        sp = speed.get(tuple(r.shape))
        notes = {
            "calls": int(r.calls),
            "calls_pct": r.calls_pct,
            "time_pct": r.time_pct,
            "device_time": device_time,
            "torch_ms": getattr(sp, "torch_ms", None),
            "hfkit_ms": getattr(sp, "hfkit_ms", None),
            "speedup": getattr(sp, "speedup", None),
        }
        rows.append(row("layer_norm_census", r.op, "fwd", list(r.shape), r.time_ms, notes))
    return rows


def _bench_profile(run: _Run, config: ModelConfig, precision: Precision) -> None:
    """The profile's rows (top operators, the LayerNorm census); one error row if it fails."""
    run.progress.set_postfix_str("profile")
    error = _BUDGET_SPENT
    if not run.out_of_time():
        try:
            with run.cpu_path():
                run.rows.extend(_profile_rows(run, config, precision))
            error = None
        except Exception as err:  # noqa: BLE001 - a failed profile must not stop the run
            error = " ".join(f"{type(err).__name__}: {err}".split())[:500]
    if error is not None:
        extra = {**precision.describe(), "checkpointing": config.checkpoint, "error": error}
        shape = [config.max_msa_clusters, config.crop_size]
        run.rows.append(
            make_row(
                run.env,
                None,
                op="step_profile",
                provider="eager",
                mode="fwd+bwd",
                shape=shape,
                dtype=precision.name,
                ceilings=run.ceilings,
                extra=extra,
            )  # fmt: skip
        )
    run.done(1)


def _precision(name: str) -> Precision:
    if name not in PRECISIONS:
        raise ValueError(f"precision: expected one of {list(PRECISIONS)}, got {name!r}")
    return PRECISIONS[name]


def _row_key(row: Mapping[str, Any]) -> tuple:
    """`row_key`, checkpointing and launch: a stack or step with and without checkpointing, launched
    eagerly or replayed as a CUDA graph, are different configurations."""
    extra = row.get("extra") or {}
    return (*row_key(row, _launch(extra)), extra.get("checkpointing"))


def _launch(extra: Mapping[str, Any]) -> str:
    # Rows without a launch: blocks (n_blocks 1) were timed as CUDA graphs, stacks and steps launched
    # from Python.
    return extra.get("launch", "graph" if extra.get("n_blocks") == 1 else "eager")


def run_model_benchmark(
    device: torch.device | str | None = None,
    parts: Sequence[str] = ("block", "stack", "step"),
    *,
    quick: bool = False,
    variants: Sequence[str] = MODULE_VARIANTS,
    step_variants: Sequence[str] = ("eager", "hfkit"),
    shapes: Sequence[Sequence[int]] | None = None,
    dtypes: Sequence[str] = ("bf16", "fp32"),
    stack_dtypes: Sequence[str] = ("bf16",),
    step_dtype: str = "bf16_autocast",
    modes: Sequence[str] = MODES,
    checkpointing: Sequence[bool] = (False, True),
    stack_launch: Sequence[str] = ("eager",),
    block_launch: Sequence[str] = ("graph", "eager"),
    step_launch: Sequence[str] = LAUNCHES,
    compile_backend: str = "inductor",
    compile_mode: str | None = None,
    budget_s: float | None = None,
    out: str | Path | None = None,
    append: bool = False,
    ceilings: Ceilings | None = None,
    command: str | None = None,
    progress: bool = True,
    interpret: bool = False,
) -> list[ResultRow]:
    """Run the model benchmark's `parts` (see the module docstring) on `device`; return the rows.

    `quick` uses the `tiny` preset and `QUICK_BLOCK_SHAPES` (a smoke run on a CPU); otherwise
    `af2_initial` and `BLOCK_SHAPES` (`shapes` overrides: (S, N) pairs). `variants` apply to the block
    and stack, `step_variants` to the step; `dtypes` are the block's precisions, `stack_dtypes` the
    stack's, `step_dtype` the step's, waterfall's and profile's; `stack_launch` how the stack is
    launched ("eager", "graph"; see the module docstring), `block_launch` how the block is, `step_launch`
    how the step is (see `measure_train_step`). `variants` "openfold*" run OpenFold's own modules
    (`hfkit.bench.peers.load_openfold`), skipped rows where it is absent. `budget_s`: configurations that
    would start after this many seconds are recorded as skipped. With `out`, results are saved after
    every configuration (with `append`, rows already in `out` are kept unless this run measures the
    same configuration). Ceilings are measured first unless given (small ones on a CPU). On a CPU
    hfkit's ops run their plain-torch references unless `interpret` (Triton's interpreter).
    """
    from tqdm.auto import tqdm

    device = resolve_device(device)
    on_cuda = device.type == "cuda"
    check_choice("parts", parts, PARTS)
    check_choice("variants", variants, MODULE_VARIANTS)
    check_choice("step_variants", step_variants, VARIANTS)
    check_choice("dtypes", dtypes, list(PRECISIONS))
    check_choice("stack_dtypes", stack_dtypes, list(PRECISIONS))
    check_choice("modes", modes, MODES)
    check_choice("checkpointing", list(checkpointing), [False, True])
    check_choice("stack_launch", stack_launch, LAUNCHES)
    check_choice("step_launch", step_launch, LAUNCHES)
    check_choice("block_launch", block_launch, LAUNCHES)
    step_precision = _precision(step_dtype)
    shape_list = [
        tuple(int(d) for d in s) for s in (shapes or (QUICK_BLOCK_SHAPES if quick else BLOCK_SHAPES))
    ]
    if any(len(s) != 2 or min(s) < 1 for s in shape_list):
        raise ValueError(f"shapes: expected (S, N) pairs of positive sizes, got {shape_list}")
    if budget_s is not None and budget_s <= 0:
        raise ValueError(f"budget_s: expected a positive number of seconds or None, got {budget_s}")
    config = bench_config(quick)
    waterfall_config = config.replace(checkpoint=bool(checkpointing[-1]))
    stages = waterfall_stages(_model_ops(waterfall_config)) if "waterfall" in parts else []
    t_start = time.perf_counter()
    ceilings = ceilings or bench_ceilings(device)
    env = environment_info(device, command)  # the file's meta; rows repeat its ENV_KEYS

    counts = {
        "block": len(block_launch) * len(dtypes) * len(shape_list) * len(variants) * len(modes),
        "stack": len(stack_launch) * len(stack_dtypes) * len(checkpointing) * len(variants),
        "step": len(step_launch) * len(checkpointing) * len(step_variants),
        "waterfall": len(stages),
        "profile": 1,
    }
    bar = tqdm(total=sum(counts[p] for p in parts), disable=not progress, desc="model")
    run = _Run(
        device=device,
        env={k: env[k] for k in ENV_KEYS},
        ceilings=ceilings,
        deadline=None if budget_s is None else t_start + budget_s,
        file=None if out is None else ResultFile(out, env, append=append, key=_row_key),
        compile_backend=compile_backend,
        compile_mode=compile_mode,
        progress=bar,
        interpret=interpret,
    )
    fast = (5, 20) if on_cuda else (1, 2)  # (warmup, reps): the block, milliseconds a call
    slow = _slow_timing(device)
    try:
        with _recompile_limit():
            for part in parts:
                if part == "block":
                    precisions = [_precision(d) for d in dtypes]
                    _bench_blocks(run, config, shape_list, precisions, variants, modes, block_launch, fast)
                elif part == "stack":
                    precisions = [_precision(d) for d in stack_dtypes]
                    _bench_stack(run, config, precisions, variants, checkpointing, stack_launch, slow)
                elif part == "step":
                    runs = [
                        (v, config.replace(checkpoint=c), v, None, launch, {})
                        for launch in step_launch
                        for c in checkpointing
                        for v in step_variants
                    ]
                    _bench_train_steps(run, "train_step", runs, step_precision, slow)
                elif part == "waterfall":
                    rounds = _waterfall_rounds(device)
                    _bench_waterfall(run, waterfall_config, step_precision, stages, slow, rounds)
                elif part == "profile":
                    # Checkpointed, as AlphaFold trains (and as the hfai profile's step presumably ran).
                    _bench_profile(run, config.replace(checkpoint=True), step_precision)
    finally:
        bar.close()
    return run.rows


def summary_table(frame: Any) -> Any:
    """A readable table of model rows: op, variant, mode, S x N, precision, checkpointing, p50 ms,
    speed-up vs eager, TFLOP/s, peak GiB, first call s (compile included), and the error if any."""
    import pandas as pd

    from hfkit.bench.results import rows_to_frame

    if not isinstance(frame, pd.DataFrame):
        frame = rows_to_frame(frame)
    extra = frame["extra"].apply(lambda e: e or {})
    table = pd.DataFrame(
        {
            "op": frame["op"],
            "variant": frame["provider"],
            "mode": frame["mode"],
            "S x N": frame["shape"].apply(lambda s: "x".join(map(str, s))),
            "dtype": frame["dtype"],
            "ckpt": extra.apply(lambda e: e.get("checkpointing")),
            "launch": extra.apply(lambda e: _launch(e) if "n_blocks" in e else None),
            "p50 ms": frame["p50_ms"],
            "TFLOP/s": frame["tflops"],
            "peak GiB": frame["peak_mem_bytes"].astype(float) / 2**30,
            "first call s": extra.apply(lambda e: e.get("first_call_s")),
            "error": extra.apply(lambda e: e.get("error", "")),
        }
    )
    keys = ["op", "mode", "S x N", "dtype", "ckpt", "launch"]
    eager = table[table["variant"] == "eager"].drop_duplicates(keys, keep="last").set_index(keys)["p50 ms"]
    base = table.set_index(keys).index.map(lambda k: eager.get(k, math.nan))
    table.insert(8, "vs eager", base.to_numpy(dtype=float) / table["p50 ms"].to_numpy(dtype=float))
    return table.round({"p50 ms": 3, "vs eager": 2, "TFLOP/s": 1, "peak GiB": 2, "first call s": 1})
