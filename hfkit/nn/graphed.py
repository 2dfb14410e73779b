"""Per-module CUDA graphs for a training loop the user writes: `graph_modules(model)` makes every
Evoformer block of `model` replay its forward and backward as CUDA graphs, called from the user's
own Python loop with the user's own loss, `backward()` and optimizer.

Why: launched from Python, a block's time is the host's (Python, autograd and a few hundred kernel
launches per forward+backward), not the GPU's; one graph replay launches all of them at once.

How: `GraphedForward(module)` is set as the module's instance attribute `forward`, so the module's
class, parameters, buffers, names and `state_dict` stay as they are and `nn.Module.__call__` (with
its hooks) calls it. For each call signature (shape, dtype, device and requires_grad of every tensor
argument, the value of every other argument, grad mode, training mode, CUDA autocast) it captures
the class's forward and its backward once with `torch.cuda.make_graphed_callables`, then replays
them: one autograd node whose forward replays the forward graph and whose backward replays the
backward graph. Under `torch.no_grad()` (a signature of its own) only a forward graph is captured
and replayed. `ungraph_modules` takes the graphs away again.

The contract of a graphed module:

- Static shapes (cropping and padding give them): every new signature is one more capture (three
  warm-up runs and the captures: a few eager calls' time) and one more memory pool; at most
  `max_signatures` per module are kept (least recently used dropped).
- Memory: each graph keeps its module's activations in its own pool between calls, as training
  without checkpointing does. A module run under activation checkpointing runs eagerly (below).
- Outputs are the graph's static buffers, overwritten by the next replay of the same signature:
  clone an output to hold it across two calls of the same module. The same holds for the input
  gradients `torch.autograd.grad` returns. Gradients accumulated into `.grad` (of parameters and of
  leaf inputs) are protected: hooks copy the gradients the backward graph returns before autograd
  stores them, so `.grad` never is a static buffer and accumulates as in eager mode.
- A module runs at most once between a forward and the backward of that forward (a second replay
  overwrites the activations the first one's backward reads).
- Dropout draws fresh masks at every replay: the capture registers the default CUDA generator, and
  each replay advances its Philox offset (hfkit's fused dropout draws its seed on the device from
  that generator). A `torch.Generator` of the caller's own is not registered: its masks would repeat.
- Parameters may change in value (optimizer steps, `load_state_dict`) but not in storage: after
  `.to(...)` or new parameter tensors every graph is dropped and captured again. Submodules are
  fixed: swap ops (`to_hfkit`) before `graph_modules`. Python side effects and hooks inside the
  module run at capture only.

The class's own forward runs instead (eagerly, `fallbacks` counts why) where a graph cannot or must
not be used: a tensor argument not on CUDA (so on CPU everything is eager); an outer capture in
progress (`hfkit.train.graphed_step`, a benchmark's own graph); `torch.compile` tracing; inference
mode; activation checkpointing (the module's own switch, that of a stack it sits in as
`graph_modules` found it, a non-reentrant checkpoint's saved-tensor hooks, or recomputation inside a
backward pass); training modes other than those of the first capture (`reset` to capture anew); a
non-tensor argument that is not a constant (None, bool, int, float, str, dtype, device, or tuples of
them); a signature whose capture failed (warned once).

CUDA autocast works with its weight cache on or off (`torch.autocast`'s default is on). The capture
runs with the cache off (`make_graphed_callables` refuses it): the graphs hold their own casts of
the weights, so every replay casts the current values, and no cast made inside a capture (in the
graph's pool) is handed to eager code; the code around the module keeps the cache as it was.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import math
import warnings
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hfkit.model.evoformer import EvoformerBlock

__all__ = ["GraphedForward", "graph_modules", "graphed_forwards", "ungraph_modules"]

# OpenFold's block, recognised by the qualified name of its class (hfkit does not import OpenFold).
OPENFOLD_EVOFORMER_BLOCK = "openfold.model.evoformer.EvoformerBlock"
# hfkit's `EvoformerBlock` covers its subclass `ExtraMSABlock`, the extra-MSA stack's block.
DEFAULT_CLASSES: tuple[type[nn.Module] | str, ...] = (EvoformerBlock, OPENFOLD_EVOFORMER_BLOCK)
# Each signature's graphs hold a pool of the module's activations and gradients; a bound keeps a loop
# whose shapes keep changing from filling the GPU, and 4 covers the shapes one training run has
# (training crop, evaluation crop, their no_grad forwards).
MAX_SIGNATURES = 4

_MISSING = object()
_CONSTANT_TYPES = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.layout)


def _constant_key(value: object) -> object | None:
    """A hashable key for a non-tensor argument that a graph may bake in, tagged with its type (1,
    1.0 and True are equal as keys otherwise); None where `value` is not such a constant."""
    if isinstance(value, _CONSTANT_TYPES):
        if isinstance(value, float) and math.isnan(value):  # NaN != NaN: never a cache hit
            return None
        return (type(value), value)
    if type(value) is tuple:
        keys = tuple(_constant_key(v) for v in value)
        return None if any(k is None for k in keys) else (tuple, keys)
    return None


def _checkpoints(module: nn.Module) -> bool:
    """Whether `module`'s activation-checkpointing switch is on: hfkit's stacks' `checkpoint`,
    OpenFold's stacks' `blocks_per_ckpt`."""
    return getattr(module, "checkpoint", None) is True or getattr(module, "blocks_per_ckpt", None) is not None


def _has_checkpoint_switch(module: nn.Module) -> bool:
    return isinstance(getattr(module, "checkpoint", None), bool) or hasattr(module, "blocks_per_ckpt")


def _checkpoint_in_progress() -> str | None:
    """Why the current call is part of an activation checkpoint, or None. torch has no public query:
    a non-reentrant checkpoint installs default saved-tensor hooks around its forward, and both
    kinds recompute the forward inside a backward pass (a graph task is running)."""
    hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if hooks is not None and hooks(False) is not None:
        return "saved-tensor hooks (non-reentrant checkpoint or offloading)"
    task = getattr(torch._C, "_current_graph_task_id", None)
    if task is not None and task() != -1:
        return "called inside a backward pass (checkpoint recomputation)"
    return None


def _all_on_cuda(tensors: list[torch.Tensor]) -> bool:
    return bool(tensors) and all(t.device.type == "cuda" for t in tensors)


def _make_graphed(bound: nn.Module, samples: tuple[torch.Tensor, ...]) -> None:
    """`torch.cuda.make_graphed_callables` on `bound` with `samples`, on their device: it sets
    `bound.forward` to the graphed forward. Its defaults hold: 3 warm-up runs (forward and
    `autograd.grad`, on a side stream, no `.grad` written) before the captures; `allow_unused_input`
    because a module may leave a parameter unused at some setting (its gradient stays None). With
    autocast's weight cache off (`_autocast_cache_off`)."""
    with torch.cuda.device(samples[0].device), _autocast_cache_off():
        torch.cuda.make_graphed_callables(bound, samples, allow_unused_input=True)


@contextlib.contextmanager
def _autocast_cache_off() -> Iterator[None]:
    """Autocast's weight-cast cache off inside (casts neither read from it nor added to it), back to
    its previous setting on exit, exceptions included. Autocast itself stays as it is."""
    previous = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(previous)


class _BoundForward(nn.Module):
    """`type(module).forward(module, ...)` with the tensor arguments positional and the others bound:
    what `make_graphed_callables` captures (it passes tensors only, positionally). `module` is its
    child, so its `parameters()` are the module's; it is reachable from no model."""

    def __init__(
        self, module: nn.Module, n_args: int, names: tuple[str, ...], items: list[Any], slots: list[int]
    ) -> None:
        super().__init__()
        self.module = module
        # The module's own flag, set directly: `.train(mode)` would set every submodule's flag too.
        self.training = module.training
        self.n_args = n_args
        self.names = names
        self.items = items
        self.slots = slots

    def forward(self, *tensors: torch.Tensor) -> Any:
        items = list(self.items)
        for slot, tensor in zip(self.slots, tensors, strict=True):
            items[slot] = tensor
        kwargs = dict(zip(self.names, items[self.n_args :], strict=True))
        return type(self.module).forward(self.module, *items[: self.n_args], **kwargs)


@dataclass
class _Graph:
    """One signature's graphs: `bound.forward` (set by make_graphed_callables) replays them."""

    bound: _BoundForward

    def release(self) -> None:
        # make_graphed_callables' instance forward closes over `bound`: break that cycle so the
        # graphs and their pool go with the last reference.
        self.bound.__dict__.pop("forward", None)


class GraphedForward:
    """A module's forward replayed as CUDA graphs, one pair (forward, backward) per call signature;
    set as the module's instance `forward` (see `graph_modules`), or called as `GraphedForward(m)(...)`.

    Takes the module's forward arguments and returns what it returns (the graph's static buffers: see
    the module docstring for the contract and for when it runs eagerly instead). `checkpointed_by`:
    modules whose checkpointing switch (`checkpoint`, `blocks_per_ckpt`) makes this module run
    eagerly while gradients are taken (its stacks); `max_signatures`: graphs kept per module.
    `captures` counts captures made, `signatures` lists the cached call signatures (least recently
    used first), `fallbacks` counts eager calls by reason.
    """

    def __init__(
        self,
        module: nn.Module,
        checkpointed_by: Iterable[nn.Module] = (),
        max_signatures: int = MAX_SIGNATURES,
    ) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: expected an nn.Module, got {type(module).__name__}")
        if not isinstance(max_signatures, int) or isinstance(max_signatures, bool) or max_signatures < 1:
            raise ValueError(f"max_signatures: expected an int >= 1, got {max_signatures!r}")
        self.module = module
        self.max_signatures = max_signatures
        # The module first: its own switch counts too. Nothing here reads the module's state, which a
        # deepcopy or unpickling of the whole model fills in after making this object.
        self._owners = [weakref.ref(module), *(weakref.ref(o) for o in checkpointed_by if o is not module)]
        self._submodules: list[nn.Module] | None = None  # module.modules(), listed at the first call
        self._graphs: collections.OrderedDict[tuple, _Graph | None] = collections.OrderedDict()
        self._mode: tuple[bool, ...] | None = None  # training flags of the submodules when captured
        self._params: tuple[tuple[int, bool], ...] | None = None  # (data_ptr, requires_grad) then
        self._hooks: list[Any] = []  # the parameters' gradient-copy hooks (`_guard_grads`)
        self._hooked_leaves: dict[int, weakref.ref] = {}  # leaf inputs hooked, by id (tensors hash by id)
        self.captures = 0
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self.__wrapped__ = type(module).forward.__get__(module)  # inspect.signature follows it

    @property
    def signatures(self) -> tuple[tuple, ...]:
        """The call signatures with cached graphs, least recently used first."""
        return tuple(key for key, graph in self._graphs.items() if graph is not None)

    def __repr__(self) -> str:
        name = type(self.module).__qualname__
        return f"GraphedForward({name}, captures={self.captures}, signatures={len(self.signatures)})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # first: Dynamo traces the class's forward, nothing of ours
            return type(self.module).forward(self.module, *args, **kwargs)
        reason, key, tensors, layout = self._plan(args, kwargs)
        if reason is None:
            graph = self._graphs.get(key, _MISSING)
            if graph is _MISSING:
                graph = self._capture(key, tensors, layout)
            else:
                self._graphs.move_to_end(key)
            if graph is not None:
                outputs = graph.bound.forward(*tensors)
                if torch.is_grad_enabled():
                    self._guard_grads(tensors)
                return outputs
            reason = "its capture failed"
        self.fallbacks[reason] += 1
        return type(self.module).forward(self.module, *args, **kwargs)

    def reset(self) -> None:
        """Drop every graph (their memory goes with them) and the captured training mode: the next
        call captures again, in the module's mode then."""
        if self._drop_graphs():
            gc.collect()  # the graphed autograd Function classes are in reference cycles

    def _drop_graphs(self) -> bool:
        """Forget every graph and the captured mode; whether any graph was dropped."""
        graphs = [g for g in self._graphs.values() if g is not None]
        self._graphs.clear()
        self._mode = self._params = self._submodules = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for graph in graphs:
            graph.release()
        return bool(graphs)

    def __deepcopy__(self, memo: dict[int, Any]) -> GraphedForward:
        # A copy of the module gets a GraphedForward of its own with no graphs (CUDA graphs cannot be
        # copied). Its stacks are those copied along with it (in `memo` when a whole model is being
        # copied): copying a block alone does not copy the stack around it.
        owners = [memo[id(o)] for o in self._stacks() if id(o) in memo]
        return GraphedForward(copy.deepcopy(self.module, memo), owners, self.max_signatures)

    def __reduce__(self) -> tuple[Any, ...]:
        return GraphedForward, (self.module, self._stacks(), self.max_signatures)

    def _stacks(self) -> list[nn.Module]:
        """The live modules of `checkpointed_by`."""
        return [o for o in (ref() for ref in self._owners[1:]) if o is not None]

    # ------------------------------------------------------------------------------------ internals

    def _plan(self, args: tuple, kwargs: dict[str, Any]) -> tuple[str | None, Any, list, Any]:
        """(why the call runs eagerly or None, its signature, its tensors, the layout to rebind the
        other arguments)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return "an outer CUDA graph capture is in progress", None, [], None
        if torch.is_inference_mode_enabled():
            return "inference mode", None, [], None
        names = tuple(sorted(kwargs))
        items = [*args, *(kwargs[name] for name in names)]
        tensors, slots, parts = [], [], []
        for i, value in enumerate(items):
            if isinstance(value, torch.Tensor):
                tensors.append(value)
                slots.append(i)
                parts.append(("tensor", tuple(value.shape), value.dtype, value.device, value.requires_grad))
            else:
                part = _constant_key(value)
                if part is None:
                    where = f"argument {i}" if i < len(args) else f"argument {names[i - len(args)]!r}"
                    return f"{where} is not a constant ({type(value).__name__})", None, [], None
                parts.append(part)
        grad = torch.is_grad_enabled()
        if grad or any(t.requires_grad for t in tensors):
            for ref in self._owners:
                owner = ref()
                if owner is not None and _checkpoints(owner):
                    return f"checkpointing is on ({type(owner).__name__})", None, [], None
            reason = _checkpoint_in_progress()
            if reason is not None:
                return reason, None, [], None
        if not _all_on_cuda(tensors):
            return "a tensor argument is not on CUDA", None, [], None
        if self._submodules is None:
            self._submodules = list(self.module.modules())
        mode = tuple(m.training for m in self._submodules)
        if self._mode is not None and mode != self._mode:
            return "training mode differs from the captured one", None, [], None
        params = tuple((p.data_ptr(), p.requires_grad) for p in self._parameters())
        if self._params is not None and params != self._params:
            self.reset()  # moved or replaced parameters: the graphs read the old storage
        autocast = torch.is_autocast_enabled("cuda")
        autocast_dtype = torch.get_autocast_dtype("cuda") if autocast else None
        key = (len(args), names, tuple(parts), grad, self.module.training, autocast, autocast_dtype)
        return None, key, tensors, (len(args), names, items, slots, mode, params)

    def _parameters(self) -> list[nn.Parameter]:
        modules = self._submodules if self._submodules is not None else self.module.modules()
        return [p for m in modules for p in m._parameters.values() if p is not None]

    def _capture(self, key: tuple, tensors: list[torch.Tensor], layout: tuple) -> _Graph | None:
        """Capture the graphs of one signature on detached copies of the call's tensors (the same
        requires_grad), cache them (dropping the least recently used beyond `max_signatures`) and
        return them; None, with a warning, where the capture fails."""
        n_args, names, items, slots, mode, params = layout
        constants = [None if i in slots else v for i, v in enumerate(items)]
        bound = _BoundForward(self.module, n_args, names, constants, slots)
        samples = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors)
        try:
            _make_graphed(bound, samples)
        except Exception as err:  # noqa: BLE001 - any capture failure means: run this signature eagerly
            warnings.warn(
                f"GraphedForward: capturing {type(self.module).__qualname__} failed "
                f"({type(err).__name__}: {err}); this call signature runs eagerly",
                stacklevel=3,
            )
            self._graphs[key] = None
            return None
        self.captures += 1
        self._mode, self._params = mode, params
        graph = _Graph(bound)
        self._graphs[key] = graph
        evicted = []
        while len(self._graphs) > self.max_signatures:
            evicted.append(self._graphs.popitem(last=False)[1])
        for old in evicted:
            if old is not None:
                old.release()
        if any(old is not None for old in evicted):
            gc.collect()
        return graph

    def _guard_grads(self, tensors: list[torch.Tensor]) -> None:
        """Hook the module's parameters (once) and the call's leaf inputs (once each) so that the
        gradients the backward graph returns reach `.grad` as copies: the graph returns its static
        buffers, which autograd would otherwise adopt as `.grad` (the next replay would overwrite
        them, and accumulation would read the overwritten values). A hook runs on the stream of the
        node that made the gradient, so the copy is ordered before any later replay."""
        if not self._hooks:
            self._hooks = [p.register_hook(_fresh) for p in self._parameters() if p.requires_grad]
        for tensor in tensors:
            if not (tensor.requires_grad and tensor.is_leaf):
                continue
            seen = self._hooked_leaves.get(id(tensor))
            if seen is not None and seen() is tensor:
                continue
            tensor.register_hook(_fresh)
            if len(self._hooked_leaves) >= 64:  # forget leaves that are gone
                self._hooked_leaves = {k: r for k, r in self._hooked_leaves.items() if r() is not None}
            self._hooked_leaves[id(tensor)] = weakref.ref(tensor)


def _fresh(grad: torch.Tensor) -> torch.Tensor:
    return grad.clone()


def _matches(module: nn.Module, classes: tuple[type[nn.Module] | str, ...]) -> bool:
    """`module` is an instance of a class of `classes`, or of a class whose qualified name
    (module.Class) ends with a string of `classes`."""
    types = tuple(c for c in classes if isinstance(c, type))
    if types and isinstance(module, types):
        return True
    names = [c for c in classes if isinstance(c, str)]
    return any(f"{k.__module__}.{k.__qualname__}".endswith(n) for k in type(module).__mro__ for n in names)


def graph_modules(
    model: nn.Module,
    classes: Iterable[type[nn.Module] | str] | None = None,
    max_signatures: int = MAX_SIGNATURES,
) -> nn.Module:
    """Give every module of `model` (`model` itself included) that is an instance of `classes` a
    `GraphedForward` as its instance `forward`, in place; return `model`.

    `classes`: classes, or qualified class names (`"package.module.Class"`, matched at the end) for
    classes hfkit does not import; default hfkit's `EvoformerBlock` (its `ExtraMSABlock` too) and
    OpenFold's `EvoformerBlock` by name. The modules inside a graphed one are part of its graph. The
    checkpointing switches of the stacks around each module are handed to its `GraphedForward`, so
    a checkpointed stack's blocks run eagerly. Call it after `to_hfkit` (a graph holds the ops it
    captured) and on the device the model trains on; `ungraph_modules` undoes it. Parameters,
    buffers, module classes and `state_dict` keys are unchanged.
    """
    classes = DEFAULT_CLASSES if classes is None else tuple(classes)
    for c in classes:
        if not (isinstance(c, str) or (isinstance(c, type) and issubclass(c, nn.Module))):
            raise TypeError(f"classes: expected nn.Module subclasses or qualified class names, got {c!r}")

    def visit(module: nn.Module, name: str, owners: tuple[nn.Module, ...]) -> None:
        if _matches(module, classes):
            forward = module.__dict__.get("forward")
            if forward is not None and not isinstance(forward, GraphedForward):
                raise ValueError(
                    f"model: module {name or '(model)'} ({type(module).__name__}) already has an instance "
                    f"forward ({forward!r}); remove it (e.g. `del module.forward`) before graph_modules"
                )
            if forward is None:
                module.forward = GraphedForward(module, owners, max_signatures)
            return
        if _has_checkpoint_switch(module):
            owners = (*owners, module)
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name, owners)

    visit(model, "", ())
    return model


def graphed_forwards(model: nn.Module) -> list[GraphedForward]:
    """The `GraphedForward`s of `model`'s modules (`model` included), in `model.modules()` order: for
    their `captures`, `signatures` and `fallbacks`."""
    return [f for m in model.modules() if isinstance(f := m.__dict__.get("forward"), GraphedForward)]


def ungraph_modules(model: nn.Module) -> nn.Module:
    """Remove every `GraphedForward` of `model`'s modules (`model` included), in place, so that each
    runs its class's forward again; their graphs and memory pools are freed. Return `model`."""
    freed = False
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, GraphedForward):
            freed |= forward._drop_graphs()
            del module.forward
    if freed:
        gc.collect()  # the graphed autograd Function classes are in reference cycles
    return model
