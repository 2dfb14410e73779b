"""The import layers of hfkit (design.md, "Imports point one way"), checked from the source with `ast`.

Every module under `hfkit/` is parsed, never executed. Each import in it is an edge to the hfkit
module it names: top-level and function-level imports, imports under `if TYPE_CHECKING:`, relative
imports, and `importlib.import_module("hfkit...")` with a literal name. `from hfkit.x import y` is an
edge to `hfkit.x.y` when that is a module, else to `hfkit.x`. Importing `hfkit.x.y` also runs the
package `hfkit/x/__init__.py` first (unless the importer lives in `hfkit.x`), so that is an edge too;
the top `hfkit/__init__.py` is not (it runs before every module of hfkit, whoever imports it).

The tests fail, naming every offending edge at once, when an edge goes from a layer to a layer that
`ALLOWED_IMPORTS` does not list, when an import names no module under `hfkit/`, or when modules
import each other in a cycle (imports within a layer are allowed, cycles nowhere).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

HFKIT_ROOT = Path(__file__).resolve().parents[1] / "hfkit"

# layer -> the other layers its modules may import. A module's layer is its subpackage (`hfkit.nn.convert`
# is in "nn"), or its own name for top-level modules (`hfkit.train`, `hfkit.cli`); `hfkit/__init__.py`
# is "package" and `hfkit/__main__.py` is "main".
_BELOW_BENCH = frozenset({"ops", "data", "model", "nn", "parallel", "train"})
ALLOWED_IMPORTS: dict[str, frozenset[str]] = {
    "ops": frozenset(),
    "data": frozenset(),
    "model": frozenset({"data"}),
    "nn": frozenset({"ops", "model"}),
    "parallel": frozenset({"model", "nn", "ops"}),
    "train": frozenset({"model", "nn", "data", "parallel"}),
    "bench": _BELOW_BENCH,
    "viz": _BELOW_BENCH | {"bench"},
    "cli": _BELOW_BENCH | {"bench", "viz", "package"},
    "package": frozenset({"nn", "ops", "model", "data"}),
    "main": frozenset({"cli"}),
}


@dataclass(frozen=True)
class Edge:
    """`source` imports `target` (dotted module names) at `where` ("hfkit/x.py:12"); `via` names the
    submodule whose import runs the package `target` first, or is "" for a module named directly."""

    source: str
    target: str
    where: str
    via: str = ""

    def __str__(self) -> str:
        runs = f" (package run to import {self.via})" if self.via else ""
        return f"{self.where}: {self.source} -> {self.target}{runs}"


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file for every .py file under the package directory `root`."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def layer_of(module: str) -> str:
    """The layer of a dotted module name under the top package (see ALLOWED_IMPORTS)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    if parts[1] == "__main__":
        return "main"
    return parts[1]


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, list[str], int]]:
    """(module named, names imported from it, line) for every import anywhere in `tree`."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, [alias.name for alias in node.names], node.lineno))
        elif (
            isinstance(node, ast.Call)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id == "import_module")
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.args[0].value, [], node.lineno))
    return found


def collect_edges(root: Path) -> tuple[list[Edge], list[str]]:
    """Every import edge between modules of the package `root`, and one line per import that names a
    module of the package that does not exist."""
    top = root.name
    modules = module_files(root)
    edges, missing = [], []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        rel = path.relative_to(root.parent)
        for named, names, line in _imported_names(tree, module, path.name == "__init__.py"):
            if named != top and not named.startswith(top + "."):
                continue
            where = f"{rel}:{line}"
            targets = [f"{named}.{n}" for n in names if f"{named}.{n}" in modules]
            if len(targets) < len(names) or not names:  # some names are attributes of `named` itself
                if named in modules:
                    targets.append(named)
                else:
                    missing.append(f"{where}: {module} imports {named}, which is no module under {top}/")
            for target in targets:
                parts = target.split(".")
                packages = [".".join(parts[:i]) for i in range(2, len(parts))]
                edges += [
                    Edge(module, package, where, via=target)
                    for package in packages
                    if module != package and not module.startswith(package + ".")
                ]
                if target != module:
                    edges.append(Edge(module, target, where))
    return list(dict.fromkeys(edges)), missing


def layer_violations(edges: list[Edge]) -> list[str]:
    """One line per edge that goes to a layer its source's layer may not import (a package run to
    import a submodule is in the submodule's layer, so only the submodule's edge is named)."""
    out = []
    for edge in (e for e in edges if not e.via):
        src, dst = layer_of(edge.source), layer_of(edge.target)
        if src not in ALLOWED_IMPORTS:
            out.append(f"{edge}: layer {src!r} of {edge.source} is not in ALLOWED_IMPORTS")
        elif src != dst and dst not in ALLOWED_IMPORTS[src]:
            allowed = ", ".join(sorted(ALLOWED_IMPORTS[src])) or "nothing"
            out.append(f"{edge}: {src} may import only {allowed}, not {dst}")
    return out


def import_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """The edges inside each group of modules that import each other in a cycle (a strongly connected
    component of more than one module), sorted by module."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    # Tarjan's strongly connected components.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    by_place = lambda e: (e.where.rpartition(":")[0], int(e.where.rpartition(":")[2]), e.target)
    return sorted(
        (sorted((e for e in edges if e.source in c and e.target in c), key=by_place) for c in components),
        key=lambda cycle: min(e.source for e in cycle),
    )


def shortest_cycle(cycle_edges: list[Edge]) -> list[Edge]:
    """A shortest closed path through the first module (by name) of a cycle group's edges."""
    start = min(e.source for e in cycle_edges)
    path_to: dict[str, list[Edge]] = {start: []}
    frontier = [start]
    while frontier:
        step = []
        for v in frontier:
            for e in cycle_edges:
                if e.source != v:
                    continue
                if e.target == start:
                    return [*path_to[v], e]
                if e.target not in path_to:
                    path_to[e.target] = [*path_to[v], e]
                    step.append(e.target)
        frontier = step
    raise ValueError(f"cycle_edges: expected edges of a cycle through {start}, got none back to it")


def format_cycles(cycles: list[list[Edge]]) -> list[str]:
    """One block per cycle group: a shortest cycle through it, then every edge between its modules."""
    out = []
    for cycle in cycles:
        members = sorted({e.source for e in cycle})
        path = shortest_cycle(cycle)
        lines = [
            f"cycle among {len(members)} modules: "
            + " -> ".join([e.source for e in path] + [path[0].source]),
            *(f"    {e}" for e in cycle),
        ]
        out.append("\n".join(lines))
    return out


# ------------------------------------------------------------------------------------------ hfkit itself


def test_every_layer_is_in_the_table() -> None:
    layers = {layer_of(m) for m in module_files(HFKIT_ROOT)}
    assert layers <= ALLOWED_IMPORTS.keys(), (
        f"layers missing from ALLOWED_IMPORTS: {layers - ALLOWED_IMPORTS.keys()}"
    )
    assert {"ops", "data", "model", "nn", "package"} <= layers


def test_imports_follow_the_layers() -> None:
    edges, missing = collect_edges(HFKIT_ROOT)
    violations = missing + layer_violations(edges)
    assert not violations, f"{len(violations)} imports break the layers:\n" + "\n".join(violations)


def test_no_import_cycles() -> None:
    edges, _ = collect_edges(HFKIT_ROOT)
    cycles = format_cycles(import_cycles(edges))
    assert not cycles, f"{len(cycles)} import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize(
    ("statement", "not_loaded"),
    [("import hfkit.model", ("hfkit.nn", "hfkit.ops")), ("import hfkit", ("hfkit.nn", "hfkit.ops"))],
)
def test_plain_imports_load_no_fused_code(statement: str, not_loaded: tuple[str, ...]) -> None:
    """In a fresh interpreter, the plain model (and the package top, whose `to_hfkit` loads `hfkit.nn`
    on first use) import no fused module and no op."""
    code = f"import sys; {statement}; print(sorted(m for m in sys.modules if m.startswith({not_loaded!r})))"
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=HFKIT_ROOT.parent, check=True
    )
    assert run.stdout.strip() == "[]", f"{statement} loaded {run.stdout.strip()}"


# ------------------------------------------------------------------------- the checker on a fake package


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_checker_finds_every_kind_of_import(tmp_path: Path) -> None:
    pkg = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.nn import convert\n",
            "pkg/ops/__init__.py": "",
            "pkg/ops/a.py": "def f():\n    import pkg.model.b\n",  # function level
            "pkg/model/__init__.py": "from .b import X\n",  # relative
            "pkg/model/b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.nn import convert\n"
            ),
            "pkg/nn/__init__.py": "",
            "pkg/nn/convert.py": (
                "import importlib\nM = importlib.import_module('pkg.ops.a')\nfrom .. import data\n"
            ),
            "pkg/data/__init__.py": "from pkg.data.gone import x\n",
        },
    )
    edges, missing = collect_edges(pkg)
    assert {(e.source, e.target, e.via) for e in edges} == {
        ("pkg", "pkg.nn.convert", ""),
        ("pkg", "pkg.nn", "pkg.nn.convert"),  # the package runs before its submodule
        ("pkg.ops.a", "pkg.model.b", ""),
        ("pkg.ops.a", "pkg.model", "pkg.model.b"),
        ("pkg.model", "pkg.model.b", ""),  # no package edge: pkg.model is the importer
        ("pkg.model.b", "pkg.nn.convert", ""),
        ("pkg.model.b", "pkg.nn", "pkg.nn.convert"),
        ("pkg.nn.convert", "pkg.ops.a", ""),
        ("pkg.nn.convert", "pkg.ops", "pkg.ops.a"),
        ("pkg.nn.convert", "pkg.data", ""),
    }
    assert missing == [
        "pkg/data/__init__.py:1: pkg.data imports pkg.data.gone, which is no module under pkg/"
    ]
    violations = layer_violations(edges)
    assert [v.split(":")[0] for v in violations] == ["pkg/model/b.py", "pkg/nn/convert.py", "pkg/ops/a.py"]
    assert violations[1].endswith("pkg.nn.convert -> pkg.data: nn may import only model, ops, not data")
    assert violations[2].endswith("pkg.ops.a -> pkg.model.b: ops may import only nothing, not model")
    cycles = import_cycles(edges)
    assert [[str(e) for e in c] for c in cycles] == [
        [
            "pkg/model/__init__.py:1: pkg.model -> pkg.model.b",
            "pkg/model/b.py:3: pkg.model.b -> pkg.nn.convert",
            "pkg/nn/convert.py:2: pkg.nn.convert -> pkg.ops.a",
            "pkg/ops/a.py:2: pkg.ops.a -> pkg.model (package run to import pkg.model.b)",
            "pkg/ops/a.py:2: pkg.ops.a -> pkg.model.b",
        ]
    ]
    assert format_cycles(cycles)[0].splitlines()[0] == (
        "cycle among 4 modules: pkg.model -> pkg.model.b -> pkg.nn.convert -> pkg.ops.a -> pkg.model"
    )


def test_checker_passes_a_clean_package(tmp_path: Path) -> None:
    pkg = _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/ops/__init__.py": "import os\nfrom pkg.ops import kernels\n",
            "pkg/ops/kernels.py": "",
            "pkg/nn/__init__.py": "from pkg.ops.kernels import f\nfrom pkg.model import Attention\n",
            "pkg/model/__init__.py": "",
        },
    )
    edges, missing = collect_edges(pkg)
    assert {(e.source, e.target) for e in edges} == {
        ("pkg.ops", "pkg.ops.kernels"),
        ("pkg.nn", "pkg.ops.kernels"),
        ("pkg.nn", "pkg.ops"),
        ("pkg.nn", "pkg.model"),
    }
    assert not missing
    assert layer_violations(edges) == [] and import_cycles(edges) == []
