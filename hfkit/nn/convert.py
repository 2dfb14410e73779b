"""Module swapping: `to_hfkit(model)` puts hfkit modules in place of torch ones; `to_torch` undoes it.

A registry maps each torch module class to its hfkit replacement (`register_swap`); each `hfkit.nn`
module registers itself when its file is imported. Classes of other packages that hfkit must not import
(OpenFold's) are registered by qualified class name (`register_foreign_swap`): on first sight of such a
class `to_hfkit` checks the module's parameter layout and makes an adapter subclass of that very class
whose methods run hfkit ops. Both directions share the original Parameter, buffer and hook objects, so
`state_dict()` keys and values never change, and both return a `SwapReport` on request that lists
every swapped or skipped module.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, overload

from torch import nn

__all__ = [
    "SwapReport",
    "SwapRow",
    "rebuild_as",
    "register_foreign_swap",
    "register_swap",
    "registered_ops",
    "to_hfkit",
    "to_torch",
    "unregister_swap",
]

# A builder makes a module of class `cls` out of `module` (used in both directions).
Builder = Callable[[nn.Module, type[nn.Module]], nn.Module]

# Attribute set on every replacement made by `to_hfkit`: the exact class it replaced, so that `to_torch`
# restores that class even when several torch classes map to one hfkit class.
ORIGINAL_CLS_ATTR = "_hfkit_original_cls"

# Per-module containers that must not be aliased between the original and its replacement: adding a
# parameter to one must not add it to the other. Hook registries are deliberately shared instead (see
# `rebuild_as`).
_OWN_CONTAINERS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def rebuild_as(module: nn.Module, cls: type[nn.Module]) -> nn.Module:
    """Return a new `cls` instance holding `module`'s state: the default builder of `register_swap`.

    The new module gets a shallow copy of `module.__dict__`: the same Parameter, buffer and child
    module objects (in containers of its own), the same `training` flag and every other attribute.
    The hook registries (forward, forward-pre, backward, state_dict hooks) are the same dict objects,
    so hooks keep firing on the replacement and a `RemovableHandle` taken before the swap still
    removes its hook. It needs `cls` to keep its state in the same attributes as `type(module)`,
    which holds for an hfkit class that subclasses the torch class and only overrides `forward`.
    """
    new = cls.__new__(cls)
    state = dict(module.__dict__)
    for key in _OWN_CONTAINERS:
        if key in state:
            state[key] = copy.copy(state[key])
    state.pop(ORIGINAL_CLS_ATTR, None)
    # `module.compile()` stores a compiled call bound to the *old* object; the new one must recompile.
    if state.get("_compiled_call_impl") is not None:
        state["_compiled_call_impl"] = None
    new.__dict__.update(state)
    return new


@dataclass(frozen=True)
class _Swap:
    name: str
    torch_cls: type[nn.Module]
    hfkit_cls: type[nn.Module]
    to_hfkit: Builder
    to_torch: Builder
    opt_in: str = ""  # why the op is swapped only when `include` names it ("": swapped by default)


_BY_TORCH: dict[type[nn.Module], _Swap] = {}
_BY_HFKIT: dict[type[nn.Module], _Swap] = {}  # first registration wins for the way back
_BY_NAME: dict[str, _Swap] = {}


def register_swap(
    torch_cls: type[nn.Module],
    hfkit_cls: type[nn.Module],
    *,
    name: str | None = None,
    to_hfkit: Builder = rebuild_as,
    to_torch: Builder = rebuild_as,
    opt_in: str = "",
) -> None:
    """Register `hfkit_cls` as the replacement that `to_hfkit` puts in place of modules of `torch_cls`.

    `name` is the op name used by `include`/`exclude` and in reports (default: `torch_cls.__name__`).
    `to_hfkit(module, hfkit_cls)` and `to_torch(module, torch_cls)` build the replacement in each
    direction; the default, `rebuild_as`, shares all state and suits an hfkit class that subclasses
    the torch class. `opt_in`, when given, says why the op is swapped only where `to_hfkit`'s
    `include` names it (e.g. measured slower than torch's own at common sizes); the swap report lists
    it as skipped with that reason otherwise. Registering the same pair again is a no-op; a
    conflicting registration of `torch_cls` or of `name` raises ValueError.
    """
    for arg, cls in (("torch_cls", torch_cls), ("hfkit_cls", hfkit_cls)):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"register_swap: {arg} must be an nn.Module subclass, got {cls!r}")
    name = name or torch_cls.__name__
    entry = _Swap(name, torch_cls, hfkit_cls, to_hfkit, to_torch, opt_in)
    old = _BY_TORCH.get(torch_cls)
    if old is not None:
        if (old.hfkit_cls, old.name) == (hfkit_cls, name):
            return  # re-import of the registering module (e.g. importlib.reload)
        raise ValueError(
            f"register_swap: torch_cls {_qualname(torch_cls)} is already mapped to "
            f"{_qualname(old.hfkit_cls)} as {old.name!r}; call unregister_swap first"
        )
    if name in _BY_NAME:
        raise ValueError(
            f"register_swap: name {name!r} is already used for {_qualname(_BY_NAME[name].torch_cls)}"
        )
    _BY_TORCH[torch_cls] = entry
    _BY_NAME[name] = entry
    _BY_HFKIT.setdefault(hfkit_cls, entry)


def unregister_swap(torch_cls: type[nn.Module] | str) -> None:
    """Remove the registration of `torch_cls`, or of a qualified class name registered by
    `register_foreign_swap` (for tests and for replacing a registration)."""
    if isinstance(torch_cls, str):
        if _BY_QUALNAME.pop(torch_cls, None) is None:
            raise ValueError(f"unregister_swap: qualified name {torch_cls!r} is not registered")
        _drop_adapters(torch_cls)
        return
    entry = _BY_TORCH.pop(torch_cls, None)
    if entry is None:
        raise ValueError(f"unregister_swap: torch_cls {_qualname(torch_cls)} is not registered")
    del _BY_NAME[entry.name]
    if _BY_HFKIT.get(entry.hfkit_cls) is entry:
        del _BY_HFKIT[entry.hfkit_cls]
        # Another torch class mapping to the same hfkit class becomes the default way back.
        for other in _BY_TORCH.values():
            if other.hfkit_cls is entry.hfkit_cls:
                _BY_HFKIT[entry.hfkit_cls] = other
                break


@dataclass(frozen=True)
class _ForeignSwap:
    name: str
    check: Callable[[nn.Module], str]
    methods: dict[str, Callable[..., object]]


_BY_QUALNAME: dict[str, _ForeignSwap] = {}  # "package.module.Class" -> how to swap it
_FOREIGN_ENTRIES: dict[type[nn.Module], _Swap] = {}  # foreign class -> its entry (adapter made once)


def register_foreign_swap(
    qualname: str,
    name: str,
    check: Callable[[nn.Module], str],
    methods: dict[str, Callable[..., object]],
) -> None:
    """Register a swap for the class whose `module.qualname` is `qualname`, without importing it.

    `to_hfkit` swaps a module whose class has exactly that qualified name when `check(module)` returns
    "" (else it skips the module and reports the returned reason): the replacement is an instance of an
    adapter subclass of the module's own class, made once per class, whose namespace is `methods`
    (e.g. `{"forward": fn}`); it shares all state (`rebuild_as`), so the adapter may only override
    methods. `to_torch` restores the original class. `name` is the op name for `include`/`exclude`
    and reports (e.g. "openfold.Attention"). Registering the same qualname again replaces it.
    """
    if not isinstance(qualname, str) or "." not in qualname:
        raise ValueError(f"register_foreign_swap: qualname must be 'package.module.Class', got {qualname!r}")
    if name in _BY_NAME:
        raise ValueError(f"register_foreign_swap: name {name!r} is already used by a registered swap")
    _BY_QUALNAME[qualname] = _ForeignSwap(name, check, dict(methods))
    _drop_adapters(qualname)


def _drop_adapters(qualname: str) -> None:
    """Forget the adapters made for classes named `qualname` (their registration changed)."""
    for cls in [c for c in _FOREIGN_ENTRIES if _qualname(c) == qualname]:
        _BY_HFKIT.pop(_FOREIGN_ENTRIES.pop(cls).hfkit_cls, None)


def _foreign_entry(cls: type[nn.Module], foreign: _ForeignSwap) -> _Swap:
    """The entry for foreign class `cls`, with its adapter subclass (made on first use)."""
    entry = _FOREIGN_ENTRIES.get(cls)
    if entry is None:
        namespace = {
            **foreign.methods,
            "__reduce_ex__": _reduce_adapter,
            "__module__": __name__,
            "__qualname__": f"Hfkit{cls.__name__}",
            "__doc__": f"{_qualname(cls)} whose forward runs hfkit ops (made by to_hfkit; same state).",
        }
        adapter = type(f"Hfkit{cls.__name__}", (cls,), namespace)
        entry = _Swap(foreign.name, cls, adapter, rebuild_as, rebuild_as)
        _FOREIGN_ENTRIES[cls] = entry
        _BY_HFKIT[adapter] = entry
    return entry


def _reduce_adapter(module: nn.Module, protocol: int) -> tuple[object, ...]:
    """Pickle and deepcopy an adapter by its foreign class (importable), not by the adapter class
    (made at run time, so not importable): `_blank_adapter` makes it again on the way back."""
    return _blank_adapter, (type(module).__bases__[0],), dict(module.__dict__)


def _blank_adapter(cls: type[nn.Module]) -> nn.Module:
    """An empty instance of the adapter of foreign class `cls` (its state is set after)."""
    foreign = _BY_QUALNAME.get(_qualname(cls))
    if foreign is None:
        raise ValueError(
            f"to_hfkit: no foreign swap is registered for {_qualname(cls)}; import hfkit.nn before "
            "unpickling a model swapped by to_hfkit"
        )
    adapter = _foreign_entry(cls, foreign).hfkit_cls
    return adapter.__new__(adapter)


def registered_ops() -> dict[str, tuple[type[nn.Module], type[nn.Module]]]:
    """Return `{op name: (torch class, hfkit class)}` for every registered swap."""
    return {name: (e.torch_cls, e.hfkit_cls) for name, e in _BY_NAME.items()}


Status = Literal["swapped", "skipped"]


@dataclass(frozen=True)
class SwapRow:
    """One module seen by a swap: where it sits, its type before and after, and what happened."""

    name: str  # qualified name from the root ("" for the root); the first of several if shared
    op: str  # registered op name
    from_type: str  # importable class name, e.g. "torch.nn.LayerNorm"
    to_type: str
    status: Status
    reason: str = ""


@dataclass
class SwapReport:
    """What `to_hfkit` / `to_torch` did: one row per distinct module swapped or skipped.

    A module reachable under several names (a shared instance) is one row, named by its first
    qualified name, with the others in its reason. `str(report)` renders an aligned table followed
    by summary lines such as `swapped 12 modules: LayerNorm ×12`.
    """

    direction: Literal["to_hfkit", "to_torch"]
    rows: list[SwapRow] = field(default_factory=list)

    @property
    def swapped(self) -> list[SwapRow]:
        return [r for r in self.rows if r.status == "swapped"]

    @property
    def skipped(self) -> list[SwapRow]:
        return [r for r in self.rows if r.status == "skipped"]

    def counts(self, status: Status = "swapped") -> Counter[str]:
        """Number of modules per op name with the given status."""
        return Counter(r.op for r in self.rows if r.status == status)

    def summary(self) -> str:
        """One line per status, e.g. `swapped 12 modules: LayerNorm ×12` (the skipped line only if any)."""
        lines = []
        for status in ("swapped", "skipped"):
            counts = self.counts(status)
            total = sum(counts.values())
            if status == "skipped" and not total:
                continue
            detail = ", ".join(f"{op} ×{n}" for op, n in sorted(counts.items()))
            noun = "module" if total == 1 else "modules"
            lines.append(f"{status} {total} {noun}" + (f": {detail}" if detail else ""))
        return "\n".join(lines)

    def __str__(self) -> str:
        header = ("module", "from", "to", "status", "reason")
        body = [(r.name or "(root)", r.from_type, r.to_type, r.status, r.reason) for r in self.rows]
        widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
        fmt = lambda row: "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        lines = [fmt(header), fmt(tuple("-" * w for w in widths)), *map(fmt, body)] if body else []
        return "\n".join([*lines, self.summary()])


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _public_name(cls: type) -> str:
    """Shortest importable name of `cls`: `torch.nn.LayerNorm`, not `torch.nn.modules.normalization.…`."""
    parts = cls.__module__.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if getattr(sys.modules.get(prefix), cls.__qualname__, None) is cls:
            return f"{prefix}.{cls.__qualname__}"
    return _qualname(cls)


def _check_ops(arg: str, names: Iterable[str] | None) -> frozenset[str] | None:
    if names is None:
        return None
    if isinstance(names, str):  # a bare "LayerNorm" would otherwise iterate as letters
        names = {names}
    names = frozenset(names)
    known = _BY_NAME.keys() | {f.name for f in _BY_QUALNAME.values()}
    unknown = names - known
    if unknown:
        raise ValueError(
            f"to_hfkit: {arg} holds unknown op names {sorted(unknown)}; registered: {sorted(known)}"
        )
    return names


def _swap_tree(
    model: nn.Module,
    decide: Callable[[nn.Module], tuple[_Swap, type[nn.Module] | None, str] | None],
    report: SwapReport,
) -> nn.Module:
    """Walk the module tree once and replace every module `decide` picks; return the (new) root.

    `decide(module)` returns None for modules it ignores, else `(entry, target class or None, reason)`;
    a None target means "skip and report". Replacements are memoised by module identity, so a module
    reachable under several names is replaced once and stays shared.
    """
    done: dict[int, nn.Module] = {}
    rows: dict[int, int] = {}  # module id -> index of its row in report.rows

    def visit(module: nn.Module, qualname: str) -> nn.Module:
        key = id(module)
        if key in done:
            if key in rows:  # note the alias on the module's row
                i = rows[key]
                row = report.rows[i]
                reason = f"{row.reason}; " if row.reason else ""
                report.rows[i] = dataclasses.replace(row, reason=f"{reason}shared as {qualname!r}")
            return done[key]
        new = module
        verdict = decide(module)
        if verdict is not None:
            entry, target, reason = verdict
            if target is not None:
                new = (entry.to_hfkit if report.direction == "to_hfkit" else entry.to_torch)(module, target)
                if report.direction == "to_hfkit":
                    # Plain attribute (not a buffer): invisible to state_dict, survives deepcopy/pickle.
                    object.__setattr__(new, ORIGINAL_CLS_ATTR, type(module))
                status: Status = "swapped"
            else:
                status = "skipped"
            rows[key] = len(report.rows)
            report.rows.append(
                SwapRow(
                    qualname, entry.name, _public_name(type(module)), _public_name(type(new)), status, reason
                )
            )
        done[key] = new
        # Children of a replacement are the same objects (shared state), so the walk goes on below it.
        for child_name, child in list(new._modules.items()):
            if child is not None:
                new_child = visit(child, f"{qualname}.{child_name}" if qualname else child_name)
                if new_child is not child:
                    new._modules[child_name] = new_child
        return new

    return visit(model, "")


def _check_model(fn: str, model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module, got {type(model).__name__}")


@overload
def to_hfkit(
    model: nn.Module,
    *,
    inplace: bool = ...,
    include: Iterable[str] | None = ...,
    exclude: Iterable[str] | None = ...,
    report: Literal[False] = ...,
) -> nn.Module: ...
@overload
def to_hfkit(
    model: nn.Module,
    *,
    inplace: bool = ...,
    include: Iterable[str] | None = ...,
    exclude: Iterable[str] | None = ...,
    report: Literal[True],
) -> tuple[nn.Module, SwapReport]: ...
@overload
def to_hfkit(
    model: nn.Module,
    *,
    inplace: bool = ...,
    include: Iterable[str] | None = ...,
    exclude: Iterable[str] | None = ...,
    report: bool,
) -> nn.Module | tuple[nn.Module, SwapReport]: ...
def to_hfkit(
    model: nn.Module,
    *,
    inplace: bool = True,
    include: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    report: bool = False,
) -> nn.Module | tuple[nn.Module, SwapReport]:
    """Replace every module whose type is exactly a registered torch class by its hfkit module.

    `include` / `exclude` are sets of registered op names (e.g. `{"LayerNorm"}`; unknown names raise
    ValueError): only ops in `include` (default: all but the opt-in ones, see `register_swap`) and not in
    `exclude` are swapped; modules left out by them are listed as skipped. Subclasses of a registered
    class are never swapped (their forward may differ) and are listed as skipped. Classes registered by
    qualified name (`register_foreign_swap`, e.g. OpenFold's) are swapped when their parameter layout
    checks out, and listed as skipped with the reason otherwise. Replacements share the original
    Parameters, buffers, child modules, hooks and `training` flag, so `state_dict()` is unchanged; a
    module shared under several names stays one shared module. With `inplace=False` the model is
    deep-copied first and left untouched. Returns the model (a new object when the root itself was
    swapped), or `(model, SwapReport)` with `report=True`. Undo with `to_torch`. References to swapped
    modules held outside the module tree (e.g. in a plain Python list) still point at the old modules.
    """
    _check_model("to_hfkit", model)
    include_set = _check_ops("include", include)
    exclude_set = _check_ops("exclude", exclude)

    def decide(module: nn.Module) -> tuple[_Swap, type[nn.Module] | None, str] | None:
        cls = type(module)
        entry = _BY_TORCH.get(cls)
        foreign = None if entry is not None else _BY_QUALNAME.get(_qualname(cls))
        if foreign is not None:
            entry = _foreign_entry(cls, foreign)
        if entry is not None:
            if include_set is not None and entry.name not in include_set:
                return entry, None, "not in include"
            if include_set is None and entry.opt_in:
                return entry, None, f"opt-in (include={{{entry.name!r}}}): {entry.opt_in}"
            if exclude_set is not None and entry.name in exclude_set:
                return entry, None, "in exclude"
            if foreign is not None:
                try:
                    why = foreign.check(module)
                except AttributeError as err:  # another version of the class, without an attribute
                    why = f"unknown layout ({err})"
                if why:
                    return entry, None, f"skipped: {why}"
            return entry, entry.hfkit_cls, ""
        if cls in _BY_HFKIT:
            return None  # already an hfkit module
        for base in cls.__mro__[1:]:
            entry = _BY_TORCH.get(base)
            if entry is not None:
                return entry, None, f"subclass of {base.__name__}; only exact types are swapped"
        return None

    if not inplace:
        model = copy.deepcopy(model)
    swap_report = SwapReport("to_hfkit")
    model = _swap_tree(model, decide, swap_report)
    return (model, swap_report) if report else model


@overload
def to_torch(model: nn.Module, *, inplace: bool = ..., report: Literal[False] = ...) -> nn.Module: ...
@overload
def to_torch(
    model: nn.Module, *, inplace: bool = ..., report: Literal[True]
) -> tuple[nn.Module, SwapReport]: ...
@overload
def to_torch(
    model: nn.Module, *, inplace: bool = ..., report: bool
) -> nn.Module | tuple[nn.Module, SwapReport]: ...
def to_torch(
    model: nn.Module, *, inplace: bool = True, report: bool = False
) -> nn.Module | tuple[nn.Module, SwapReport]:
    """Replace every hfkit module by a torch module: the exact class it replaced, or else the registered one.

    Undoes `to_hfkit`: each module whose type is exactly a registered hfkit class becomes the class
    remembered by `to_hfkit` (so `type()` of every submodule is restored exactly), or the registered
    torch class for hfkit modules built directly. State is shared as in `to_hfkit`, so `state_dict()`
    is unchanged. With `inplace=False` the model is deep-copied first. Returns the model (a new object
    when the root itself was swapped), or `(model, SwapReport)` with `report=True`.
    """
    _check_model("to_torch", model)

    def decide(module: nn.Module) -> tuple[_Swap, type[nn.Module] | None, str] | None:
        entry = _BY_HFKIT.get(type(module))
        if entry is None:
            return None
        target = module.__dict__.get(ORIGINAL_CLS_ATTR, entry.torch_cls)
        # The builder for the way back belongs to the registration of the class being restored.
        return _BY_TORCH.get(target, entry), target, ""

    if not inplace:
        model = copy.deepcopy(model)
    swap_report = SwapReport("to_torch")
    model = _swap_tree(model, decide, swap_report)
    return (model, swap_report) if report else model
