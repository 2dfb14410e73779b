"""Launch cost: the host time of one call, plain PyTorch against `to_hfkit`, for every swappable module
of an Evoformer block and for the whole block.

On tiny inputs the GPU work of a call is a few microseconds, so the wall time per call (many calls,
CUDA-synchronised only at both ends) is what launching costs the host: Python, the dispatcher,
autograd and the kernel launches. That is what an eager training loop pays on every op when the
device is fast enough to wait for the host, and what a CUDA graph removes. Each row compares the
plain module (the torch ops hfkit replaces) with its swapped copy, forward ("fwd", inputs requiring
grad) and forward + `autograd.grad` ("fwd+bwd"). The module inputs are those the block passes to
its children (captured with forward pre-hooks on one call of the block), so every module runs
exactly as inside the model.

Rows: op "launch_cost", provider "eager" (plain) or "hfkit" (swapped), shape = (S, N) of the block's
inputs, `method` "cpu_wall_mean", `p50_ms` the mean wall time per call, `extra["module"]` the
module's path in the block ("" for the block itself) and class.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hfkit.bench.ceilings import resolve_device
from hfkit.bench.results import ENV_KEYS, ResultFile, ResultRow, environment_info, make_row, row_key
from hfkit.bench.timing import Timing
from hfkit.model import EvoformerBlock, ModelConfig

__all__ = ["module_inputs", "per_call_seconds", "run_launch_benchmark"]

# Tiny MSA rows and residues: the device work of a call is negligible next to its launch cost.
TINY_SHAPE = (4, 16)


def per_call_seconds(fn: Callable[[], Any], device: torch.device, calls: int, warmup: int = 20) -> float:
    """Mean wall seconds per call of `fn` over `calls` calls after `warmup`, synchronised at both ends."""
    for _ in range(warmup):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / calls


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def module_inputs(
    block: nn.Module, inputs: Sequence[Any], kinds: tuple[type, ...]
) -> dict[str, tuple[nn.Module, tuple, dict]]:
    """{path: (module, args, kwargs)}: what one call of `block(*inputs)` passes to each submodule that
    is an instance of `kinds` (outermost only: a matching module's own children are not listed)."""
    captured: dict[str, tuple[nn.Module, tuple, dict]] = {}
    handles = []
    for path, module in block.named_modules():
        if path and isinstance(module, kinds) and not any(path.startswith(p + ".") for p in captured):
            captured[path] = (module, (), {})

            def hook(mod: nn.Module, args: tuple, kwargs: dict, path: str = path) -> None:
                captured[path] = (mod, _detached(args), _detached(kwargs))

            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            block(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.is_floating_point())
    if isinstance(value, tuple | list):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


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
                seconds = per_call_seconds(fn, device, calls if path else max(20, calls // 10))
                ms = seconds * 1e3
                row = make_row(
                    {k: env[k] for k in ENV_KEYS}, Timing(ms, ms, ms, calls, "wall"),
                    op="launch_cost", provider=provider + provider_suffix, mode=mode, shape=list(shape),
                    dtype=str(dtype).removeprefix("torch."),
                    extra={"module": path, "class": type(mod).__name__, "method": "cpu_wall_mean"},
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
