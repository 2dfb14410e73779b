"""Tests of the stored notebooks' form: short code cells that call hfkit (no definitions), one setup call
first, no stored outputs, and imports from `hfkit.viz` rather than `hfkit.bench`.

Running the notebooks is nbmake's job (`make test`); these checks read the files only.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
MAX_CODE_LINES = 25


def code_cells(path: Path) -> list[tuple[int, str]]:
    """(index, source) of each code cell of the notebook at `path`."""
    cells = json.loads(path.read_text())["cells"]
    return [(i, "".join(c["source"])) for i, c in enumerate(cells) if c["cell_type"] == "code"]


def code_lines(source: str) -> int:
    """Lines of a cell that are neither blank nor comments."""
    return sum(1 for line in source.splitlines() if line.strip() and not line.strip().startswith("#"))


def definitions(source: str) -> list[str]:
    """Names of the functions, classes and lambdas a cell's code defines (IPython magics skipped)."""
    python = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    found = []
    for node in ast.walk(ast.parse(python)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.append(f"{type(node).__name__} {node.name}")
        elif isinstance(node, ast.Lambda):
            found.append(f"lambda at line {node.lineno}")
    return found


def bench_imports(source: str) -> list[str]:
    """Modules of `hfkit.bench` a cell imports directly."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hfkit.bench"):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("hfkit.bench")]
    return found


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 6, [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_code_cells_are_short_and_define_nothing(path):
    for index, source in code_cells(path):
        lines = code_lines(source)
        assert lines <= MAX_CODE_LINES, (
            f"{path.name} cell {index}: {lines} code lines (at most {MAX_CODE_LINES})"
        )
        found = definitions(source)
        assert not found, f"{path.name} cell {index} defines {found}: move it into hfkit.viz, with a test"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_stored_without_outputs(path):
    cells = json.loads(path.read_text())["cells"]
    for index, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [], f"{path.name} cell {index} is stored with outputs (run nbstripout)"
            assert cell["execution_count"] is None, f"{path.name} cell {index} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_code_cell_calls_setup_notebook_and_nothing_imports_bench(path):
    cells = code_cells(path)
    assert "setup_notebook()" in cells[0][1], f"{path.name}: the first code cell must call setup_notebook()"
    assert "os.environ" not in "".join(source for _, source in cells), f"{path.name} touches os.environ"
    for index, source in cells:
        assert not bench_imports(source), (
            f"{path.name} cell {index} imports hfkit.bench: go through hfkit.viz"
        )


def test_the_checks_catch_what_they_are_for():
    long_cell = "\n".join(f"x{i} = {i}" for i in range(MAX_CODE_LINES + 1))
    assert code_lines(long_cell + "\n\n# a comment\n") == MAX_CODE_LINES + 1
    assert definitions("def f():\n    pass\nclass C:\n    pass\ng = lambda: 1\n") == [
        "FunctionDef f",
        "ClassDef C",
        "lambda at line 5",
    ]
    assert definitions("%matplotlib inline\nx = 1\n") == []
    assert bench_imports(
        "from hfkit.bench.comms import x\nimport hfkit.bench\nfrom hfkit.viz import y\n"
    ) == [
        "hfkit.bench.comms",
        "hfkit.bench",
    ]
