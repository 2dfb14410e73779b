"""The `hfkit` command line: `hfkit env`, `hfkit bench <name>` (every benchmark), `hfkit preprocess`,
`hfkit report`.

`main(argv)` is the entry point of both the `hfkit` console script and `python -m hfkit`; it returns
the exit status instead of calling `sys.exit`, so tests can call it directly.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pandas is imported where a command needs it: `hfkit --help` starts without it
    import pandas as pd

__all__ = ["main"]


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _choices(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma list whose items must all be in `allowed`."""

    def parse(text: str) -> list[str]:
        items = _csv(text)
        bad = [item for item in items if item not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"expected a comma list of {','.join(allowed)}, got {text!r}")
        return items

    return parse


def _shapes(text: str) -> list[tuple[int, ...]]:
    # "1x256x256x128,1x256x384": shapes separated by commas, dims by 'x'.
    try:
        return [tuple(int(d) for d in part.lower().split("x")) for part in _csv(text)]
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"--shapes: expected e.g. '1x256x256x128,1x256x384', got {text!r}"
        ) from err


def _cmd_env(args: argparse.Namespace) -> int:
    from hfkit.bench import bench_ceilings, environment_info, resolve_device

    device = resolve_device(args.device)
    info = environment_info(device, command=args.command)
    lines = [
        ("device", f"{info['gpu']} ({device})"),
        ("cuda available", str(info["cuda_available"])),
        ("cuda", str(info["cuda"])),
        ("torch", info["torch"]),
        ("triton", str(info["triton"])),
        ("python", info["python"]),
        ("git commit", str(info["commit"])),
    ]
    if not args.no_ceilings:
        ceilings = bench_ceilings(device)  # small and quick on a CPU, where they mean little
        lines += [
            ("copy bandwidth", f"{ceilings.copy_gbps:,.1f} GB/s (read + write)"),
            ("matmul rate", f"{ceilings.matmul_tflops:,.3f} TFLOP/s ({ceilings.matmul_dtype})"),
        ]
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key:<{width}}  {value}")
    return 0


def _results_path(args: argparse.Namespace, folder: str, file_name: str) -> Path:
    """`--out`, else `data/results/<folder>/<file_name>`. An `--out` naming that default is dropped from
    the command stored with the rows: the command reads as a user would type it."""
    from hfkit.bench import results_dir

    default = results_dir() / folder / file_name
    if args.out is None:
        return default
    out = Path(args.out)
    if out.resolve() == default.resolve():
        words = shlex.split(args.command)
        i = words.index("--out") if "--out" in words else words.index(f"--out={args.out}")
        del words[i : i + (2 if words[i] == "--out" else 1)]
        args.command = shlex.join(words)
    return out


def _print_table(frame: pd.DataFrame, index: bool = False) -> None:
    """Print a results table whole: every row and column, up to 250 characters wide."""
    import pandas as pd

    with pd.option_context("display.max_rows", None, "display.width", 250, "display.max_columns", None):
        print(frame.to_string(index=index))


def _print_rows(rows: Sequence, ceilings: object | None, path: Path, kernels: bool) -> None:

    from hfkit.bench import best_peer_table, summary_table

    if ceilings is not None:
        print(
            f"\n{ceilings.device_name}: copy {ceilings.copy_gbps:,.1f} GB/s, "
            f"matmul {ceilings.matmul_tflops:,.3f} TFLOP/s ({ceilings.matmul_dtype})"
        )
    _print_table(summary_table(rows))
    if kernels:
        print("\nhfkit against the fastest other provider:")
        _print_table(best_peer_table(rows))
    print(f"\nwrote {len(rows)} rows to {path}")


def _cmd_bench_op(args: argparse.Namespace) -> int:
    """`hfkit bench <op>`: the op's case table through the one runner (with `--tiles`, its kernels' tile
    sweep), saved after every row."""
    from hfkit.bench import ResultFile, environment_info, gpu_slug, resolve_device, run_benchmark
    from hfkit.bench.ceilings import bench_ceilings, device_name
    from hfkit.bench.peers import peer_status
    from hfkit.bench.tune import best_tiles, run_tile_sweep

    bench = _op_benchmark(args.bench_name)
    device = resolve_device(args.device)
    tiles = getattr(args, "tiles", False)
    folder = gpu_slug(device_name(device)) + ("/tuning" if tiles else "")
    out = _results_path(args, folder, f"{bench.name}.json")
    profile = args.profile or ("full" if device.type == "cuda" else "smoke")
    try:
        cases = bench.cases(profile, **{o.flag: getattr(args, o.flag) for o in bench.options})
    except ValueError as err:
        print(f"hfkit bench {bench.name}: {err}", file=sys.stderr)
        return 2
    results = ResultFile(out, environment_info(device, args.command), append=args.append)
    done: list = []

    def save_so_far(row) -> None:
        done.append(row)
        results.save(done, partial=True)

    run = dict(device=device, dtypes=args.dtypes, command=args.command, warmup=args.warmup, reps=args.reps,
               on_row=save_so_far)  # fmt: skip
    if tiles:
        ceilings = bench_ceilings(device)
        rows = run_tile_sweep(
            bench, cases, passes=args.passes, smoke=profile == "smoke", ceilings=ceilings, **run
        )
        best = best_tiles(rows)
        path = results.save(rows, ceilings=ceilings, timestamp=rows[0].timestamp, best=best)
        for pass_, chosen in best.items():
            print(f"{pass_}: best tiles {chosen}")
        print(f"\nwrote {len(rows)} rows to {path}")
        return 0
    result = run_benchmark(
        bench,
        cases,
        modes=args.modes,
        providers=args.providers,
        progress=not args.no_progress,
        launches=args.launch,
        **run,
    )
    for line in result.skipped:
        print(f"skipped: {line}", file=sys.stderr)
    if not result.rows:
        print("no rows measured (see the skipped providers above)", file=sys.stderr)
        return 1
    path = results.save(
        result.rows, ceilings=result.ceilings, timestamp=result.rows[0].timestamp, skipped=result.skipped,
        peers=peer_status(device),
    )  # fmt: skip
    _print_rows(result.rows, result.ceilings, path, kernels=True)
    return 0


def _cmd_bench_data(args: argparse.Namespace) -> int:

    from hfkit.bench import ResultFile, environment_info, rows_to_frame
    from hfkit.bench.data_cost import data_cost_table, run_data_cost_benchmark

    out = _results_path(args, "cpu", "data_cost.json")
    real = Path(args.real_dir) if args.real_dir else None
    if real is not None and not real.is_dir():
        print(f"hfkit bench data: --real-dir {real} is not a folder", file=sys.stderr)
        return 2
    rows = run_data_cost_benchmark(
        depths=args.depths,
        length=args.length,
        n_chains=args.chains,
        repeats=args.repeats,
        real_dir=real,
        command=args.command,
        progress=not args.no_progress,
    )
    path = ResultFile(out, environment_info("cpu", args.command)).save(rows)
    _print_table(data_cost_table(rows_to_frame(rows)), index=True)
    print(f"\nwrote {len(rows)} rows to {path} (rows with dtype 'synthetic' come from synthetic inputs)")
    return 0


def _cmd_bench_comms(args: argparse.Namespace) -> int:

    from hfkit.bench import gpu_slug, rows_to_frame
    from hfkit.bench.ceilings import device_name
    from hfkit.bench.comms import ddp_path, run_comms_benchmark

    slug = gpu_slug(device_name(None))
    if slug != "cpu":
        slug = f"{slug}x{args.nproc}"  # e.g. h200x8: results depend on the GPU count
    out = _results_path(args, slug, "comms.json")
    try:
        rows = run_comms_benchmark(
            nproc=args.nproc,
            backends=args.backends,
            max_bytes=args.max_bytes,
            min_bytes=args.min_bytes,
            ddp=args.ddp,
            params=args.params,
            ddp_reps=args.ddp_reps,
            chunk_mb=args.chunk_mb,
            out=out,
            command=args.command,
            timeout_s=args.timeout,
        )
    except RuntimeError as err:
        print(f"hfkit bench comms: {err}", file=sys.stderr)
        return 1
    frame = rows_to_frame(rows)
    frame["busbw_gbps"] = [e.get("busbw_gbps") for e in frame["extra"]]
    _print_table(frame[["op", "provider", "mode", "shape_str", "p50_ms", "busbw_gbps"]])
    print(f"\nwrote {len(rows)} rows to {out} (allreduce) and {ddp_path(out)} (DDP steps)")
    return 0


def _cmd_preprocess(args: argparse.Namespace) -> int:
    from hfkit.data.preprocess import SUMMARY_NAME, preprocess

    try:
        summary = preprocess(
            args.mmcif_dir,
            args.alignment_dir,
            args.out,
            workers=args.workers,
            chains_per_file=args.chains_per_file,
            max_msa_depth=args.max_msa_depth,
            progress=not args.no_progress,
        )
    except (FileNotFoundError, ValueError, RuntimeError) as err:  # bad arguments or a busy --out
        print(f"hfkit preprocess: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"hfkit preprocess: interrupted; complete record files are kept in {args.out}, "
            "rerun the same command to resume",
            file=sys.stderr,
        )
        return 130
    print(summary.table())
    print(f"\nindex and records in {args.out}; this run's summary in {Path(args.out) / SUMMARY_NAME}")
    return 0 if summary.ok else 1


def _op_benchmark(name: str):
    import importlib

    return importlib.import_module(f"hfkit.bench.cases.{name}").BENCHMARK


def _add_op_bench(bench_sub: argparse._SubParsersAction, name: str) -> None:
    """`hfkit bench <op>`: the op's providers, dtypes, modes and case options, from its case table."""
    from hfkit.bench.runner import LAUNCHES, MODES

    bench = _op_benchmark(name)
    p = bench_sub.add_parser(name, help=bench.description, description=bench.description)
    p.add_argument("--out", default=None, help=f"results JSON (default: data/results/<gpu>/{name}.json)")
    for flag, allowed, default in (
        ("providers", bench.providers, bench.providers),
        ("dtypes", bench.dtypes, bench.default_dtypes),
        ("modes", MODES, MODES),
        ("launch", LAUNCHES, ("graph",)),
    ):
        p.add_argument(
            f"--{flag}",
            type=_choices(allowed),
            default=list(default),
            help=f"comma list of {','.join(allowed)}",
        )
    kinds = {"ints": lambda t: [int(v) for v in _csv(t)], "shapes": _shapes}
    for option in bench.options:
        kind = _choices(option.choices) if option.kind == "names" else kinds[option.kind]
        p.add_argument(f"--{option.flag}", type=kind, default=None, help=option.help)
    _add_run_options(p)
    p.add_argument(
        "--append", action="store_true", help="keep the rows in --out that this run does not repeat"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"warm-up calls per case (default {bench.gpu_warmup} on a GPU)",
    )
    p.add_argument(
        "--reps", type=int, default=None, help=f"timed replays per case (default {bench.gpu_reps} on a GPU)"
    )
    if bench.tiles is not None:
        p.add_argument(
            "--tiles",
            action="store_true",
            help="sweep the kernels' tiles, each pass alone (hfkit only; default --out "
            f"data/results/<gpu>/tuning/{name}.json) instead of comparing providers",
        )
        passes = bench.tiles.passes
        p.add_argument(
            "--passes",
            type=_choices(passes),
            default=None,
            help=f"with --tiles: comma list of {','.join(passes)}",
        )
    p.set_defaults(func=_cmd_bench_op)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    from hfkit.bench.runner import PROFILES

    p.add_argument(
        "--profile",
        choices=PROFILES,
        default=None,
        help="smoke: tiny sizes; full: AlphaFold's (default: full on a GPU, smoke on a CPU)",
    )
    p.add_argument("--device", default=None, help="e.g. cuda:0 or cpu (default: the GPU if any)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _cmd_bench_model(args: argparse.Namespace) -> int:
    from hfkit.bench import gpu_slug, resolve_device
    from hfkit.bench.ceilings import device_name
    from hfkit.bench.model import run_model_benchmark, summary_table

    device = resolve_device(args.device)
    out = _results_path(args, gpu_slug(device_name(device)), "model.json")
    profile = args.profile or ("full" if device.type == "cuda" else "smoke")
    rows = run_model_benchmark(
        device,
        parts=args.parts,
        quick=profile == "smoke",
        variants=args.variants,
        step_variants=args.step_variants,
        shapes=args.shapes,
        dtypes=args.dtypes,
        stack_dtypes=args.stack_dtypes,
        step_dtype=args.step_dtype,
        checkpointing=args.checkpointing,
        stack_launch=args.stack_launch,
        step_launch=args.step_launch,
        block_launch=args.block_launch,
        compile_backend=args.compile_backend,
        compile_mode=args.compile_mode,
        budget_s=args.budget_s,
        out=out,
        append=args.append,
        command=args.command,
        progress=not args.no_progress,
    )
    _print_table(summary_table(rows))
    failed = sum(r.method == "error" for r in rows)
    print(f"\nwrote {len(rows)} rows ({failed} failed or skipped: see 'error') to {out}")
    return 0 if len(rows) > failed else 1


def _add_model_bench(bench_sub: argparse._SubParsersAction) -> None:
    """`hfkit bench model`: Evoformer block, 48-block stack and training step, eager/hfkit/compile."""
    from hfkit.bench.model import LAUNCHES, MODULE_VARIANTS, PARTS, PRECISIONS, VARIANTS

    on_off = {"off": False, "on": True}
    p = bench_sub.add_parser(
        "model", help="Evoformer block, 48-block stack and training step: eager, hfkit, compile, both"
    )
    p.add_argument("--out", default=None, help="results JSON (default: data/results/<gpu>/model.json)")
    p.add_argument(
        "--parts",
        type=_choices(PARTS),
        default=["block", "stack", "step"],
        help=f"comma list of {','.join(PARTS)}",
    )
    p.add_argument(
        "--variants",
        type=_choices(MODULE_VARIANTS),
        default=list(MODULE_VARIANTS),
        help="block and stack variants (openfold*: OpenFold's own modules, skipped where it is absent)",
    )
    p.add_argument(
        "--step-variants", type=_choices(VARIANTS), default=["eager", "hfkit"], help="step variants"
    )
    p.add_argument(
        "--shapes",
        type=lambda t: [tuple(int(d) for d in part.split("x")) for part in _csv(t)],
        default=None,
        help="block (S, N) as SxN list (default: 128x256,256x384,128x512)",
    )
    p.add_argument(
        "--dtypes", type=_choices(list(PRECISIONS)), default=["bf16", "fp32"], help="block precisions"
    )
    p.add_argument(
        "--stack-dtypes", type=_choices(list(PRECISIONS)), default=["bf16"], help="stack precisions"
    )
    p.add_argument("--step-dtype", choices=list(PRECISIONS), default="bf16_autocast", help="step precision")
    p.add_argument(
        "--checkpointing",
        type=lambda t: [on_off[v] for v in _choices(list(on_off))(t)],
        default=[False, True],
        help="off,on: stack and step with/without per-block checkpointing",
    )
    p.add_argument(
        "--stack-launch",
        type=_choices(LAUNCHES),
        default=["eager"],
        help="eager,graph: stack launched from Python each call and/or replayed as one CUDA graph",
    )
    p.add_argument(
        "--block-launch",
        type=_choices(LAUNCHES),
        default=["graph", "eager"],
        help="graph,eager: block timed as a CUDA graph and/or launched from Python each call",
    )
    p.add_argument(
        "--step-launch",
        type=_choices(LAUNCHES),
        default=list(LAUNCHES),
        help="eager,graph: training step as train_step from a Python loop and/or as hfkit.train.graphed_step",
    )
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode (default: none)")
    p.add_argument("--budget-s", type=float, default=None, help="skip configurations starting after this")
    p.add_argument("--append", action="store_true", help="keep other configurations already in --out")
    _add_run_options(p)  # --profile smoke: the tiny preset and shapes
    p.set_defaults(func=_cmd_bench_model)


def _cmd_report(args: argparse.Namespace) -> int:
    import difflib

    from hfkit.viz.report import report_documents

    documents = report_documents(args.results, args.out, args.readme)
    if not args.check:
        for path, text in documents.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
        return 0
    stale = 0
    for path, text in documents.items():
        old = path.read_text() if path.exists() else ""
        if old == text:
            continue
        stale += 1
        diff = list(difflib.unified_diff(old.splitlines(), text.splitlines(), str(path), "hfkit report", n=0))
        changed = sum(1 for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---"))
        print(f"{path}: {changed} lines differ from what `hfkit report` writes; first differences:")
        print("\n".join(diff[:20]))
    return 1 if stale else 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    """`hfkit report`: docs/results.md and README.md's headline table from data/results/."""
    from hfkit.bench.results import results_dir

    repo = results_dir().parents[1]
    p = sub.add_parser(
        "report", help="write docs/results.md and README.md's headline table from data/results/"
    )
    p.add_argument(
        "--results", type=Path, default=results_dir(), help="results folder (default: data/results)"
    )
    p.add_argument("--out", type=Path, default=repo / "docs" / "results.md", help="default: docs/results.md")
    p.add_argument("--readme", type=Path, default=repo / "README.md", help="default: README.md")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if either file is stale")
    p.set_defaults(func=_cmd_report)


def _add_data_bench(bench_sub: argparse._SubParsersAction) -> None:
    """`hfkit bench data`: the data pipeline's cost per stage."""
    data = bench_sub.add_parser(
        "data", help="data-pipeline cost per stage: on the fly vs preprocessed records (one CPU core)"
    )
    data.add_argument("--out", default=None, help="results JSON (default: data/results/cpu/data_cost.json)")
    data.add_argument(
        "--depths", type=lambda t: [int(v) for v in _csv(t)], default=[1000, 5000, 20000], help="MSA depths"
    )
    data.add_argument("--length", type=int, default=384, help="synthetic chain length (residues)")
    data.add_argument("--chains", type=int, default=2, help="synthetic chains per depth")
    data.add_argument("--repeats", type=int, default=3, help="timed repeats per sample")
    data.add_argument("--real-dir", default=None, help="OpenFold test data folder to measure as well")
    data.add_argument("--no-progress", action="store_true", help="no progress bar")
    data.set_defaults(func=_cmd_bench_data)


def _add_launch_bench(bench_sub: argparse._SubParsersAction) -> None:
    """`hfkit bench launch`: host time per call of each swappable module, plain vs `to_hfkit`."""
    p = bench_sub.add_parser(
        "launch", help="launch cost: host time per call of every swappable block module, plain vs hfkit"
    )
    p.add_argument(
        "--out", default=None, help="results JSON (default: data/results/<gpu>/launch_overhead.json)"
    )
    p.add_argument("--calls", type=int, default=300, help="timed calls per module (default 300)")
    p.add_argument("--append", action="store_true", help="keep the other rows already in --out")
    _add_run_options(p)
    p.set_defaults(func=_cmd_bench_launch)


def _cmd_bench_launch(args: argparse.Namespace) -> int:
    import torch

    from hfkit.bench import gpu_slug, resolve_device
    from hfkit.bench.ceilings import device_name
    from hfkit.bench.launch import run_launch_benchmark
    from hfkit.bench.results import rows_to_frame
    from hfkit.model import ModelConfig

    device = resolve_device(args.device)
    out = _results_path(args, gpu_slug(device_name(device)), "launch_overhead.json")
    smoke = (args.profile or ("full" if device.type == "cuda" else "smoke")) == "smoke"
    if args.calls < 1:
        print(f"hfkit bench launch: --calls: expected >= 1, got {args.calls}", file=sys.stderr)
        return 2
    rows = run_launch_benchmark(
        device,
        config=ModelConfig.tiny() if smoke else None,
        dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        calls=args.calls,
        out=out,
        append=args.append,
        command=args.command,
    )
    frame = rows_to_frame(rows)
    frame["module"] = [r.extra["module"] or "(block)" for r in rows]
    table = frame.pivot_table(index=["module", "mode"], columns="provider", values="p50_ms", sort=False)
    print((table * 1e3).round(1).rename(columns=lambda c: f"{c} us").to_string())
    print(f"\nwrote {len(rows)} rows to {out}")
    return 0


def _add_comms_bench(bench_sub: argparse._SubParsersAction) -> None:
    """`hfkit bench comms`: allreduce bandwidth per backend and the DDP step decomposition."""
    comms = bench_sub.add_parser(
        "comms", help="allreduce bandwidth per backend and size, and the DDP step decomposition (torchrun)"
    )
    comms.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    comms.add_argument(
        "--backends",
        type=_choices(["nccl", "gloo", "hfreduce"]),
        default=None,
        help="comma list of nccl,gloo,hfreduce (default: all three on GPUs, gloo,hfreduce on CPU)",
    )
    comms.add_argument(
        "--max-bytes", default=None, help="largest message, e.g. 64M (default: 1G GPU, 64M CPU)"
    )
    comms.add_argument("--min-bytes", default="4K", help="smallest message (default 4K)")
    comms.add_argument(
        "--ddp", action=argparse.BooleanOptionalAction, default=True, help="also the DDP step decomposition"
    )
    comms.add_argument("--params", type=int, default=93_200_000, help="DDP model parameters (default 93.2M)")
    comms.add_argument("--ddp-reps", type=int, default=5, help="timed DDP steps per configuration")
    comms.add_argument(
        "--chunk-mb", type=float, default=None, help="hfreduce's pipeline chunk, MiB (default: HostReduce's)"
    )
    comms.add_argument("--timeout", type=float, default=1800.0, help="kill the run after this many seconds")
    comms.add_argument(
        "--out",
        default=None,
        help="allreduce results JSON (default: data/results/<gpu>x<n>/comms.json); DDP rows go to ddp.json",
    )
    comms.set_defaults(func=_cmd_bench_comms)


def _add_longseq_bench(bench_sub: argparse._SubParsersAction) -> None:
    """`hfkit bench longseq`: one Evoformer block's inference time and peak memory against N and chunk
    size (unchunked, chunked, the lean path), the largest N that fits, 48-block estimates."""
    from hfkit.bench.longseq import PROVIDERS
    from hfkit.bench.runner import DTYPES

    def chunk(text: str) -> int | str:
        return text if text == "auto" else int(text)

    def run(args: argparse.Namespace) -> int:

        from hfkit.bench import gpu_slug, resolve_device
        from hfkit.bench.ceilings import device_name
        from hfkit.bench.longseq import run_longseq_benchmark, summary_table

        device = resolve_device(args.device)
        out = _results_path(args, gpu_slug(device_name(device)), "longseq.json")
        try:
            rows = run_longseq_benchmark(
                device,
                profile=args.profile or ("full" if device.type == "cuda" else "smoke"),
                sizes=args.sizes,
                chunks=args.chunks,
                providers=args.providers,
                dtype=args.dtype,
                search=args.search,
                search_chunk=args.search_chunk,
                search_start=args.search_start,
                search_limit=args.search_limit,
                search_resolution=args.search_resolution,
                stack_n=args.stack_n,
                offload_msa=args.offload_msa,
                out=out,
                append=args.append,
                command=args.command,
                progress=not args.no_progress,
            )
        except ValueError as err:
            print(f"hfkit bench longseq: {err}", file=sys.stderr)
            return 2
        _print_table(summary_table(rows))
        failed = sum(r.method == "error" for r in rows)
        print(
            f"\nwrote {len(rows)} rows to {out} ({failed} failed: see 'error'; "
            "estimate rows: the stack's block count x one block, not measured)"
        )
        return 0 if len(rows) > failed else 1

    ints = lambda t: [int(v) for v in _csv(t)]  # noqa: E731
    p = bench_sub.add_parser(
        "longseq", help="long-sequence inference: one block's time and memory against N and chunk size"
    )
    p.add_argument("--out", default=None, help="results JSON (default: data/results/<gpu>/longseq.json)")
    p.add_argument("--sizes", type=ints, default=None, help="N values (default: 1024,2048,4096)")
    p.add_argument(
        "--chunks",
        type=lambda t: [chunk(v) for v in _csv(t)],
        default=None,
        help="chunk sizes, ints or auto (default: 32,64,128,auto)",
    )
    p.add_argument(
        "--providers",
        type=_choices(PROVIDERS),
        default=["hfkit_unchunked", "hfkit_lean"],
        help=f"comma list of {','.join(PROVIDERS)} (default: hfkit_unchunked,hfkit_lean)",
    )
    p.add_argument(
        "--dtype", choices=list(DTYPES), default="bf16", help="parameters and inputs (default bf16)"
    )
    p.add_argument(
        "--search",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="search the largest N whose block runs (doubling, then bisection)",
    )
    p.add_argument(
        "--search-chunk", type=chunk, default="auto", help="lean chunk of the search and stack run"
    )
    p.add_argument("--search-start", type=int, default=None, help="first N of the search (default 4096)")
    p.add_argument("--search-limit", type=int, default=None, help="largest N tried (default 32768)")
    p.add_argument("--search-resolution", type=int, default=None, help="bisection resolution (default 256)")
    p.add_argument("--stack-n", type=int, default=None, help="also run the whole 48-block stack at this N")
    p.add_argument("--offload-msa", action="store_true", help="lean path: MSA in pinned host memory")
    p.add_argument(
        "--append", action="store_true", help="keep the rows in --out that this run does not repeat"
    )
    _add_run_options(p)  # --profile smoke: the tiny preset and sizes
    p.set_defaults(func=run)


def _add_dap_bench(bench_sub: argparse._SubParsersAction) -> None:
    """`hfkit bench dap`: a DAP Evoformer block or stack over G local processes (optionally dp x dap)
    against one process, duality async on and off: time, per-rank peak memory, communication volume,
    scaling efficiency."""
    from hfkit.bench.dap import LAUNCHES, PROVIDERS
    from hfkit.bench.runner import DTYPES, MODES

    def run(args: argparse.Namespace) -> int:

        from hfkit.bench import gpu_slug, resolve_device
        from hfkit.bench.ceilings import device_name
        from hfkit.bench.dap import dap_results_folder, run_dap_benchmark, summary_table

        device = resolve_device(args.device)
        out = _results_path(args, dap_results_folder(gpu_slug(device_name(device)), args.nproc), "dap.json")
        try:
            rows = run_dap_benchmark(
                args.nproc,
                device=str(device),
                profile=args.profile,
                sizes=args.sizes,
                n_seq=args.n_seq,
                dtype=args.dtype,
                modes=args.modes,
                providers=args.providers,
                warmup=args.warmup,
                reps=args.reps,
                n_blocks=args.blocks,
                checkpoint=args.checkpoint,
                dap_size=args.dap_size,
                chunk_size=args.chunk_size,
                launch=args.launch,
                out=out,
                append=args.append,
                command=args.command,
                timeout_s=args.timeout,
            )
        except (ValueError, RuntimeError) as err:
            print(f"hfkit bench dap: {err}", file=sys.stderr)
            return 2 if isinstance(err, ValueError) else 1
        _print_table(summary_table(rows))
        failed = sum(r.method == "error" for r in rows)
        print(f"\nwrote {len(rows)} rows to {out} ({failed} failed: see 'error')")
        return 0 if len(rows) > failed else 1

    ints = lambda t: [int(v) for v in _csv(t)]  # noqa: E731
    p = bench_sub.add_parser(
        "dap", help="DAP: an Evoformer block or stack over G processes against one, overlap on and off"
    )
    p.add_argument("--nproc", type=int, default=2, help="local ranks, one GPU each on GPUs (default 2)")
    p.add_argument("--sizes", type=ints, default=None, help="N values (default: 256,512; smoke 12,17)")
    p.add_argument("--n-seq", type=int, default=None, help="MSA rows S (default 128; smoke 6)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: bf16 on GPUs, fp32 on CPU")
    p.add_argument("--modes", type=_choices(MODES), default=list(MODES), help="comma list of fwd,fwd+bwd")
    p.add_argument(
        "--providers",
        type=_choices(PROVIDERS),
        default=list(PROVIDERS),
        help=f"comma list of {','.join(PROVIDERS)} (default: all)",
    )
    p.add_argument("--blocks", type=int, default=1, help="1: one block; K > 1: a stack of K blocks")
    p.add_argument(
        "--checkpoint", action="store_true", help="stack: recompute each block in backward (--blocks > 1)"
    )
    p.add_argument(
        "--dap-size", type=int, default=None, help="DAP group size D (default --nproc): nproc/D dp replicas"
    )
    p.add_argument(
        "--chunk-size", type=int, default=None, help="the modules' chunking (long-sequence inference)"
    )
    p.add_argument(
        "--launch",
        choices=LAUNCHES,
        default="eager",
        help="eager: called from Python; graph: each call captured as one CUDA graph per rank (GPUs)",
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed calls per configuration")
    p.add_argument("--reps", type=int, default=None, help="timed calls per configuration")
    p.add_argument("--timeout", type=float, default=600.0, help="kill every rank after this many seconds")
    p.add_argument("--out", default=None, help="results JSON (default: data/results/<gpu>[x<G>]/dap.json)")
    p.add_argument(
        "--append", action="store_true", help="keep the rows in --out that this run does not repeat"
    )
    _add_run_options(p)  # --profile smoke: the tiny preset and sizes; --device cpu: gloo on CPU
    p.set_defaults(func=run)


def _add_train(sub: argparse._SubParsersAction) -> None:
    """`hfkit train`: AlphaFoldLite trained from preprocessed records or synthetic batches through
    `hfkit.train.graphed_step`."""
    p = sub.add_parser(
        "train",
        help="train AlphaFoldLite from preprocessed records or synthetic batches (a CUDA-graph step on GPUs)",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--records", default=None, help="folder written by `hfkit preprocess`")
    source.add_argument("--synthetic", action="store_true", help="random batches of the preset's sizes")
    p.add_argument(
        "--preset",
        choices=["tiny", "af2_initial", "af2_finetune"],
        default="af2_initial",
        help="model config (default af2_initial)",
    )
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--graphed",
        dest="graphed",
        action="store_const",
        const=True,
        default=None,
        help="one CUDA graph a step (default on a GPU)",
    )
    mode.add_argument(
        "--eager", dest="graphed", action="store_const", const=False, help="no CUDA graph (default on a CPU)"
    )
    p.add_argument("--checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast")
    p.add_argument(
        "--ops", choices=["hfkit", "torch"], default="hfkit", help="hfkit: fused ops via to_hfkit (default)"
    )
    p.add_argument("--batch-size", type=int, default=1, help="samples a step (default 1)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader processes for --records (0: here)")
    p.add_argument("--lr", type=float, default=1e-3, help="AlphaFold's base learning rate (default 1e-3)")
    p.add_argument("--lr-warmup", type=int, default=1000, help="learning-rate warm-up steps (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="parameters, sampling and dropout seed")
    p.add_argument("--device", default=None, help="e.g. cuda:0 or cpu (default: the GPU if any)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_train)


def _cmd_train(args: argparse.Namespace) -> int:
    import statistics
    import time

    import torch
    from tqdm.auto import tqdm

    from hfkit.model import AlphaFoldLite, ModelConfig
    from hfkit.nn.convert import to_hfkit
    from hfkit.train import batch_stream, graphed_step, make_optimizer, make_scheduler

    if args.steps < 1 or args.batch_size < 1:
        print(
            f"hfkit train: --steps and --batch-size: expected >= 1, got {args.steps} and {args.batch_size}",
            file=sys.stderr,
        )
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = getattr(ModelConfig, args.preset)().replace(checkpoint=args.checkpointing)
    torch.manual_seed(args.seed)
    model = AlphaFoldLite(config).to(device)
    if args.ops == "hfkit":
        to_hfkit(model)
    optimizer = make_optimizer(model, lr=args.lr)
    scheduler = make_scheduler(optimizer, warmup=args.lr_warmup)
    try:
        loader = None
        if args.records is not None:
            from hfkit.data.dataset import PreprocessedDataset, make_dataloader

            dataset = PreprocessedDataset(args.records, config.feature_config(), seed=args.seed)
            loader = make_dataloader(
                dataset,
                batch_size=args.batch_size,
                workers=args.workers,
                shuffle=True,
                seed=args.seed,
                pin_memory=device.type == "cuda",
                drop_last=True,
                persistent_workers=args.workers > 0,
                # forked workers would inherit this process's CUDA state
                multiprocessing_context="spawn" if device.type == "cuda" and args.workers > 0 else None,
            )
        batches = batch_stream(loader, config, args.seed, args.batch_size)
        t0 = time.perf_counter()
        example = next(batches)
        first_data = time.perf_counter() - t0
        t0 = time.perf_counter()
        step = graphed_step(
            model,
            optimizer,
            example,
            autocast_dtype=torch.bfloat16 if args.bf16 else None,
            scheduler=scheduler,
            graphed=args.graphed,
            timed=True,
        )
        setup = time.perf_counter() - t0
    except (FileNotFoundError, ValueError) as err:
        print(f"hfkit train: {err}", file=sys.stderr)
        return 2
    mode = "CUDA graph" if step.graphed else "eager"
    source = f"records {args.records}" if args.records else "synthetic batches"
    print(
        f"hfkit train: {args.preset} ({sum(p.numel() for p in model.parameters()):,} parameters, "
        f"checkpointing {args.checkpointing}, {'bf16' if args.bf16 else 'fp32'}, ops {args.ops}) "
        f"on {device}, {mode}; {source}, batch size {args.batch_size}; setup {setup:.2f} s"
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times: dict[str, list[float]] = {}
    losses = []
    bar = tqdm(total=args.steps, disable=args.no_progress, desc="train")
    try:
        for i in range(args.steps):
            t0 = time.perf_counter()
            batch = example if i == 0 else next(batches)
            data = first_data if i == 0 else time.perf_counter() - t0
            losses.append(step(batch).item())
            for phase, seconds in {"data": data, **step.last_times}.items():
                times.setdefault(phase, []).append(seconds)
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", s=f"{sum(step.last_times.values()):.3f}")
    finally:
        bar.close()
    # An eager run's first step pays one-off costs (kernel compilation, allocator growth).
    skip = 1 if args.steps > 1 else 0
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {args.steps} steps")
    print(f"seconds per step, median of steps {skip + 1}..{args.steps}:")
    for phase, values in times.items():
        print(f"  {phase:<10} {statistics.median(values[skip:]):.4f}")
    step_times = [sum(values) for values in zip(*(v[skip:] for v in times.values()), strict=True)]
    print(f"  {'total':<10} {statistics.median(step_times):.4f}")
    if device.type == "cuda":
        print(f"peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
    return 0


def _parser() -> argparse.ArgumentParser:
    from hfkit.bench.cases import NAMES

    parser = argparse.ArgumentParser(prog="hfkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command_name", required=True)

    env = sub.add_parser("env", help="device, versions and measured ceilings")
    env.add_argument("--no-ceilings", action="store_true", help="skip measuring copy and matmul ceilings")
    env.add_argument("--device", default=None, help="e.g. cuda:0 or cpu (default: the GPU if any)")
    env.set_defaults(func=_cmd_env)

    names = ", ".join([*NAMES, "model", "comms", "data", "launch", "longseq", "dap"])
    bench = sub.add_parser(
        "bench",
        help=f"run a benchmark ({names}); results under data/results/",
        description=f"benchmarks: {names}",
    )
    bench_sub = bench.add_subparsers(dest="bench_name", required=True)
    for name in NAMES:
        _add_op_bench(bench_sub, name)
    _add_model_bench(bench_sub)
    _add_comms_bench(bench_sub)
    _add_data_bench(bench_sub)
    _add_launch_bench(bench_sub)
    _add_longseq_bench(bench_sub)
    _add_dap_bench(bench_sub)

    pre = sub.add_parser(
        "preprocess",
        help="featurize mmCIFs + alignments into record files (resumable; exit 1 if some inputs failed)",
    )
    pre.add_argument("--mmcif-dir", required=True, help="folder of <pdbid>.cif files")
    pre.add_argument(
        "--alignment-dir", default=None, help="folder of <pdbid>_<chain>/ folders of .a3m/.sto files"
    )
    pre.add_argument("--out", required=True, help="output folder: records-*.ffr, index.json, summary.json")
    pre.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="processes (0 or 1: in this process)"
    )
    pre.add_argument("--chains-per-file", type=int, default=64, help="chains per record file (default 64)")
    pre.add_argument(
        "--max-msa-depth", type=int, default=None, help="keep the first N rows of each alignment file"
    )
    pre.add_argument("--no-progress", action="store_true", help="no progress bar")
    pre.set_defaults(func=_cmd_preprocess)
    _add_report(sub)
    _add_train(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `hfkit` command line on `argv` (default: `sys.argv[1:]`) and return the exit status.

    The command stored with results is `hfkit <arguments>`, the same whether it came from the console
    script, `python -m hfkit` (whose argv[0] is a path to __main__.py) or a caller's `argv`, so that it
    can be pasted to re-make the results.
    """
    args = _parser().parse_args(argv)
    args.command = shlex.join(["hfkit", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))
