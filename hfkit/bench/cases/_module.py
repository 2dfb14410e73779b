"""What the benchmark cases of hfkit's drop-in `torch.nn` modules (MultiheadAttention, LSTM) share:
their three providers and their timed step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hfkit.bench.runner import Steps

__all__ = ["CHECK_BATCHES", "CHECK_TOL", "Wrap", "check_notes", "module_provider", "module_steps"]

# What a provider is: it takes a torch module holding the case's weights and returns the callable to time.
Wrap = Callable[[nn.Module], Callable[..., Any]]
# A provider's output on the first CHECK_BATCHES batch rows is checked against the float32 reference,
# max |error| at most CHECK_TOL of the case's dtype.
CHECK_TOL = {"bf16": 5e-2, "fp16": 1e-2, "fp32": 1e-3}
CHECK_BATCHES = 4


def check_notes(err: float, batches: int, dtype_name: str) -> dict[str, Any]:
    """A row's check notes: the max |error| against the float32 reference over `batches` rows, and
    whether it is within CHECK_TOL."""
    ok = err <= CHECK_TOL[dtype_name]
    return {"max_abs_err_vs_fp32_ref": err, "check_batches": batches, "check_ok": ok}


def module_provider(name: str, op: str) -> Wrap:
    """ "eager": the torch module as it is; "hfkit": `to_hfkit` swapping the registered op `op` (named,
    so opt-in ops are swapped too); "compile": `torch.compile` of the module (a fresh Dynamo cache per
    case, so no shape-generic kernels: see layer_norm.py)."""
    if name == "hfkit":
        from hfkit.nn import to_hfkit

        return lambda module: to_hfkit(module, include={op})
    if name == "eager":
        return lambda module: module
    torch._dynamo.reset()
    return lambda module: torch.compile(module, dynamic=False)


def module_steps(
    module: nn.Module,
    wrap: Wrap,
    x: torch.Tensor,
    dy: torch.Tensor,
    backward: bool,
    call: Callable[[Callable[..., Any], torch.Tensor], torch.Tensor],
    check: Callable[[Callable[..., Any]], dict[str, Any]],
) -> Steps:
    """The runner's `Steps` for `module` as the provider `wrap` makes it (sharing its parameters: hfkit
    swaps in place, compile wraps): a step is `call(f, x)` (the module's output tensor) and, with
    `backward`, the gradients of x and every parameter for the upstream gradient `dy`; `check(f)`
    gives the row's notes, to which the class that ran is added (`runs`: e.g. hfkit.nn.lstm.LSTM)."""
    f = wrap(module)
    params = list(module.parameters())
    leaf = x.detach().requires_grad_(backward)

    def step() -> None:
        y = call(f, leaf)
        if backward:
            torch.autograd.grad(y, [leaf, *params], dy)

    runs = f"{type(f).__module__}.{type(f).__qualname__}"
    return Steps(step, step, 1, lambda: {**check(f), "runs": runs})
