"""What the benchmark cases of hfkit's drop-in `torch.nn` modules (MultiheadAttention, LSTM) share:
their three providers and their timed step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hfkit.bench.runner import Steps

__all__ = ["Wrap", "module_provider", "module_steps"]

# What a provider is: it takes a torch module holding the case's weights and returns the callable to time.
Wrap = Callable[[nn.Module], Callable[..., Any]]


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
