"""Execute a notebook for `make report`, with a per-cell timeout and a failure that names its cell.

`python -m hfkit.viz.execute notebooks/02_comms.ipynb --output-dir reports --cell-timeout 900` runs the
notebook in a fresh kernel (nbclient, as `jupyter nbconvert --execute` does) in the notebook's folder
and writes the executed notebook, outputs and widget state included, to the output folder, also when a
cell fails, so that the HTML report shows how far it got. A cell that errors or runs past the timeout
ends the run with nbclient's message and a line `make report: <notebook> failed at cell N (...)`;
the exit status is 1. A timeout (never an error) is retried once in a fresh kernel, because a cell
that stalls once may pass on a second run, while one that stalls twice is reported.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NotebookRun", "execute_notebook", "main"]


@dataclass
class NotebookRun:
    """The outcome of `execute_notebook`: where the executed notebook was written, and on failure the
    index of the failing cell (0-based, as in the .ipynb file), its first line, nbclient's error text,
    and whether it was a timeout."""

    output: Path
    failed_cell: int | None = None
    first_line: str = ""
    error: str = ""
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """True when every cell ran."""
        return self.failed_cell is None

    def failure_line(self, notebook: str | Path) -> str:
        """The one line `make report` prints for a failure, naming the notebook and the cell."""
        what = "timed out" if self.timed_out else "raised"
        cell = f"cell {self.failed_cell} ({what}; it starts {self.first_line!r})"
        return f"make report: {notebook} failed at {cell}"


def execute_notebook(
    path: str | Path, output_dir: str | Path, cell_timeout: int, kernel_name: str = ""
) -> NotebookRun:
    """Execute the notebook at `path` in its own folder with `cell_timeout` seconds per cell, in the
    kernel `kernel_name` (default: the notebook's own kernelspec); write it, executed, to `output_dir`
    under the same name. Returns the `NotebookRun` (a failure is returned, not raised)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    if cell_timeout <= 0:
        raise ValueError(f"cell_timeout: expected a positive number of seconds, got {cell_timeout}")
    path, output_dir = Path(path), Path(output_dir)
    nb = nbformat.read(path, as_version=4)
    started: list[int] = []
    client = NotebookClient(
        nb,
        timeout=cell_timeout,
        kernel_name=kernel_name,
        resources={"metadata": {"path": str(path.parent.resolve())}},
        on_cell_start=lambda cell, cell_index: started.append(cell_index),
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    run = NotebookRun(output_dir / path.name)
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError, TimeoutError) as err:
        index = started[-1] if started else 0
        source = "".join(nb.cells[index].source) if index < len(nb.cells) else ""
        run.failed_cell, run.error = index, str(err)
        run.first_line = source.strip().splitlines()[0] if source.strip() else ""
        run.timed_out = not isinstance(err, CellExecutionError)
        client.set_widgets_metadata()
    nbformat.write(nb, run.output)
    return run


def main(argv: list[str] | None = None) -> int:
    """Command line: execute one notebook; print nbclient's error and the failure line on failure."""
    parser = argparse.ArgumentParser(prog="python -m hfkit.viz.execute", description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=Path)
    parser.add_argument("--output-dir", type=Path, default=Path("reports"))
    parser.add_argument("--cell-timeout", type=int, default=900, help="seconds per cell (default 900)")
    args = parser.parse_args(argv)
    run = execute_notebook(args.notebook, args.output_dir, args.cell_timeout)
    if run.timed_out:
        print(run.error, file=sys.stderr)
        print(f"{run.failure_line(args.notebook)}; running it once more in a fresh kernel", file=sys.stderr)
        run = execute_notebook(args.notebook, args.output_dir, args.cell_timeout)
    if not run.ok:
        print(run.error, file=sys.stderr)
        print(run.failure_line(args.notebook), file=sys.stderr)
        return 1
    print(f"executed {args.notebook} -> {run.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
