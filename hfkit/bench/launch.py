"""Launch cost: the host time of one call, plain PyTorch against `to_hfkit`, for every swappable module
of an Evoformer block and for the whole block.

On tiny inputs the GPU work of a call is a few microseconds, so the wall time per call (samples of
many calls, each synchronised at its end: `host_timing`) is what launching costs the host: Python,
the dispatcher, autograd and the kernel launches. That is what an eager training loop pays on every
op when the device is fast enough to wait for the host, and what a CUDA graph removes. Each row compares the
plain module (the torch ops hfkit replaces) with its swapped copy, forward ("fwd", inputs requiring
grad) and forward + `autograd.grad` ("fwd+bwd"). The module inputs are those the block passes to
its children (captured with forward pre-hooks on one call of the block), so every module runs
exactly as inside the model.

Rows: op "launch_cost", provider "eager" (plain) or "hfkit" (swapped), shape = (S, N) of the block's
inputs, `method` "wall", p20/p50/p80 over the samples of the mean time per call in a sample,
`extra["module"]` the module's path in the block ("" for the block itself) and class. (Rows with
`extra["method"]` "cpu_wall_mean" hold one mean over all calls, synchronised only at both ends.)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from hfkit.bench.ceilings import resolve_device
from hfkit.bench.results import ENV_KEYS, ResultFile, ResultRow, environment_info, make_row, row_key
from hfkit.bench.timing import Timing, time_cpu
from hfkit.model import EvoformerBlock, ModelConfig

__all__ = ["host_timing", "module_inputs", "run_launch_benchmark"]

# Tiny MSA rows and residues: the device work of a call is negligible next to its launch cost.
TINY_SHAPE = (4, 16)


# Calls per timed sample: the host time of a sample is the mean of this many calls, synchronised at
# its end, so a slow call here and there does not move the median.
CALLS_PER_SAMPLE = 30


def host_timing(fn: Callable[[], Any], device: torch.device, calls: int) -> Timing:
    """Host time per call of `fn` (`time_cpu`): about `calls` calls in samples of `CALLS_PER_SAMPLE`,
    each sample synchronised with the device at its end (so queued work is paid for), after two
    warm-up samples; percentiles over the samples."""
    per_sample = min(CALLS_PER_SAMPLE, calls)

    def sample() -> None:
        for _ in range(per_sample):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return time_cpu(sample, warmup=2, reps=max(1, calls // per_sample), calls=per_sample)


def module_inputs(
    block: nn.Module, inputs: Sequence[Any], kinds: tuple[type, ...]
) -> dict[str, tuple[nn.Module, tuple, dict]]:
    """{path: (module, args, kwargs)}: what one call of `block(*inputs)` passes to each submodule that
    is an instance of `kinds` (outermost only: a matching module's own children are not listed), as
    detached copies that require grad where the block's tensors did: the activations that follow
    from inputs requiring grad do, masks do not (their gradients are no work a training step does)."""
    captured: dict[str, tuple[nn.Module, tuple, dict]] = {}
    handles = []
    for path, module in block.named_modules():
        if path and isinstance(module, kinds) and not any(path.startswith(p + ".") for p in captured):
            captured[path] = (module, (), {})

            def hook(mod: nn.Module, args: tuple, kwargs: dict, path: str = path) -> None:
                captured[path] = (mod, _detached(args), _detached(kwargs))

            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.enable_grad():
            block(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _detached(value: Any) -> Any:
    """`value` with every tensor replaced by a detached copy that requires grad where the tensor did."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.requires_grad), value)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _calls(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Callable[[], Any]]:
    """{"fwd": forward, "fwd+bwd": forward then gradients of every output w.r.t. inputs and params}."""
    wrt = [t for t in _tensors((args, kwargs)) if t.requires_grad]
    wrt += [p for p in module.parameters() if p.requires_grad]
    grads: dict[str, list[torch.Tensor]] = {}

    def forward() -> Any:
        return module(*args, **kwargs)

    def forward_backward() -> None:
        outs = [o for o in _tensors(forward()) if o.requires_grad]
        if "out" not in grads:
            grads["out"] = [torch.randn_like(o) for o in outs]
        torch.autograd.grad(outs, wrt, grads["out"], allow_unused=True)

    return {"fwd": forward, "fwd+bwd": forward_backward}


def run_launch_benchmark(
    device: torch.device | str | None = None,
    *,
    config: ModelConfig | None = None,
    shape: tuple[int, int] = TINY_SHAPE,
    dtype: torch.dtype = torch.bfloat16,
    calls: int = 300,
    out: str | Path | None = None,
    append: bool = False,
    command: str | None = None,
    provider_suffix: str = "",
) -> list[ResultRow]:
    """Time one call of every swappable module of an `EvoformerBlock` (the preset's channel sizes,
    default `ModelConfig.af2_initial()`, dropout off) and of the block, plain and swapped, forward
    and forward+backward, on inputs of (S, N) = `shape` in `dtype`; `calls` calls each. With `out`,
    rows are written there (`append` keeps other rows). `provider_suffix` is appended to the
    providers' names (e.g. "@<commit>" to compare code versions in one file)."""
    from hfkit.bench.model import _block_inputs, make_block
    from hfkit.nn.convert import registered_ops, to_hfkit

    device = resolve_device(device)
    config = config or ModelConfig.af2_initial()
    block = make_block(config).to(device, dtype)
    inputs = _block_inputs(config, shape[0], shape[1], device, dtype)
    swapped_block, _ = to_hfkit(copy.deepcopy(block), report=True)
    # The plain classes `to_hfkit` swaps; EvoformerBlock itself is timed whole, last.
    swappable = tuple(cls for cls, _ in registered_ops().values() if cls is not EvoformerBlock)
    env = environment_info(device, command)
    file = None if out is None else ResultFile(out, env, append=append, key=_key)
    rows: list[ResultRow] = []
    targets = module_inputs(block, inputs, swappable)
    targets[""] = (block, _detached(tuple(inputs)), {})
    for path, (module, args, kwargs) in targets.items():
        swapped = swapped_block if path == "" else swapped_block.get_submodule(path)
        for provider, mod in (("eager", module), ("hfkit", swapped)):
            for mode, fn in _calls(mod, args, kwargs).items():
                timing = host_timing(fn, device, calls if path else max(CALLS_PER_SAMPLE, calls // 10))
                row = make_row(
                    {k: env[k] for k in ENV_KEYS}, timing,
                    op="launch_cost", provider=provider + provider_suffix, mode=mode, shape=list(shape),
                    dtype=str(dtype).removeprefix("torch."),
                    extra={"module": path, "class": type(mod).__name__},
                )  # fmt: skip
                rows.append(row)
                if file is not None:
                    file.save(rows, partial=True)
    if file is not None:
        file.save(rows)
    return rows


def _key(row: Any) -> tuple:
    """`row_key` and the module: every module of the block is its own configuration."""
    return (*row_key(row), (row.get("extra") or {}).get("module"))
