"""Tile sweeps: every kernel pass of an op timed alone at every tile configuration of its grid, through
the runner's one protocol (`measure_case`: a check, peak memory, CUDA-graph timing, an error row for a
configuration that does not compile). `hfkit bench <op> --tiles` runs the sweep of an op whose case
table has a `TileSweep` (`layer_norm`, `softmax`, `evoformer_attention`) over that table's cases; the
rows (provider "hfkit", mode = the kernel pass, the tiles in `extra`) go to
`data/results/<gpu>/tuning/<op>.json`, the data behind the ops' tile tables.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hfkit.bench.ceilings import Ceilings
from hfkit.bench.results import ResultRow, check_choice
from hfkit.bench.runner import (
    Benchmark,
    Steps,
    TileSweep,
    free_memory,
    max_abs_err,
    measure_case,
    run_settings,
)

__all__ = ["best_tiles", "run_tile_sweep"]


def _steps(sweep: TileSweep, inputs: Any, pass_: str, tiles: tuple, expected: torch.Tensor) -> Steps:
    step = sweep.launch(inputs, pass_, tiles)

    def check() -> dict[str, Any]:
        err = max_abs_err(step(), expected)
        # Tiles change the summation order only: anything beyond rounding is a broken configuration.
        return {
            "max_abs_err_vs_default": err,
            "check_ok": err <= 1e-2 * max(1.0, float(expected.abs().max())),
        }

    return Steps(step, step, sweep.calls(inputs), check)


def run_tile_sweep(
    bench: Benchmark,
    cases: Sequence[Any],
    device: torch.device | str | None = None,
    *,
    dtypes: Sequence[str] | None = None,
    passes: Sequence[str] | None = None,
    smoke: bool = False,
    ceilings: Ceilings | None = None,
    command: str | None = None,
    warmup: int | None = None,
    reps: int | None = None,
    on_row: Callable[[ResultRow], None] | None = None,
) -> list[ResultRow]:
    """Time every (case, dtype, pass, tiles) of `bench.tiles` on `device`; return the rows.

    Each row: op `bench.name`, provider "hfkit", mode the pass, `extra["tiles"]` the configuration and
    `extra["default"]` whether it is the one the op launches; a configuration that fails (it does not
    compile, or runs out of shared memory) is an error row. `smoke` sweeps only the default tiles and
    the grid's last configuration (the Triton interpreter on a CPU). Warm-up and repetitions as in
    `run_benchmark`; each row goes to `on_row` as soon as it is measured.
    """
    sweep = bench.tiles
    if sweep is None:
        raise ValueError(f"bench: {bench.name} has no tile sweep (TileSweep in its case table)")
    passes = check_choice("passes", passes or sweep.passes, sweep.passes)
    device, dtypes, warmup, reps, ceilings, env = run_settings(
        bench, device, dtypes, warmup, reps, ceilings, command
    )
    rows: list[ResultRow] = []
    for case in cases:
        for dtype in dtypes:
            inputs = sweep.prepare(case, dtype, device)
            for pass_ in passes:
                default = tuple(sweep.default(case, dtype, pass_, device))
                expected = sweep.launch(inputs, pass_, default)().clone()
                grid = list(sweep.grid(case, pass_))
                grid = [default] + [tuple(t) for t in (grid[-1:] if smoke else grid) if tuple(t) != default]
                nbytes, flops = sweep.cost(case, dtype, pass_)
                for tiles in grid:
                    notes = {
                        "tiles": dict(zip(sweep.fields[pass_], tiles, strict=True)),
                        "default": tiles == default,
                    }
                    row = measure_case(
                        env=env, ceilings=ceilings, device=device, op=bench.name, provider="hfkit",
                        mode=pass_, shape=case.shape, dtype=dtype, nbytes=nbytes, flops=flops,
                        build=functools.partial(_steps, sweep, inputs, pass_, tuple(tiles), expected),
                        warmup=warmup, reps=reps,
                        extra=notes,
                    )  # fmt: skip
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
            inputs = expected = None
            free_memory(device)
    return rows


def best_tiles(rows: Sequence[ResultRow | Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per pass, the tiles whose time summed over the (shape, dtype) cases, each relative to that case's
    fastest tiles, is least; only tiles that ran at every case of the pass count."""
    data = [r.as_dict() if isinstance(r, ResultRow) else dict(r) for r in rows]
    ok = [r for r in data if r["method"] != "error" and r["extra"].get("check_ok", True)]
    best: dict[str, dict[str, Any]] = {}
    for pass_ in dict.fromkeys(r["mode"] for r in ok):
        timed = [r for r in ok if r["mode"] == pass_]
        case = lambda r: (tuple(r["shape"]), r["dtype"])  # noqa: E731
        fastest: dict[tuple, float] = {}
        for r in timed:
            fastest[case(r)] = min(fastest.get(case(r), r["p50_ms"]), r["p50_ms"])
        score: dict[tuple, list[float]] = {}
        for r in timed:
            score.setdefault(tuple(r["extra"]["tiles"].items()), []).append(r["p50_ms"] / fastest[case(r)])
        full = {key: sum(v) for key, v in score.items() if len(v) == len(fastest)}
        if full:
            best[pass_] = dict(min(full, key=full.get))
    return best
