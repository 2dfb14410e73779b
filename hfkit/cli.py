"""The `hfkit` command line: `hfkit env`, `hfkit bench layernorm|data|comms|elementwise`, `hfkit preprocess`.

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
    import torch

    from hfkit.bench import environment_info, measure_ceilings, resolve_device

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
        on_cuda = device.type == "cuda"
        # On a CPU the full-size ceilings would take long and mean little; measure small ones.
        ceilings = measure_ceilings(device) if on_cuda else measure_ceilings(device, copy_nbytes=64 << 20)
        lines += [
            ("copy bandwidth", f"{ceilings.copy_gbps:,.1f} GB/s (read + write)"),
            ("matmul rate", f"{ceilings.matmul_tflops:,.3f} TFLOP/s ({ceilings.matmul_dtype})"),
        ]
        if on_cuda:
            torch.cuda.empty_cache()
    width = max(len(k) for k, _ in lines)
    for key, value in lines:
        print(f"{key:<{width}}  {value}")
    return 0


def _cmd_bench_layernorm(args: argparse.Namespace) -> int:
    import pandas as pd

    from hfkit.bench import (
        gpu_slug,
        resolve_device,
        results_dir,
        run_layernorm_benchmark,
        save_results,
        summary_table,
    )
    from hfkit.bench.ceilings import device_name

    device = resolve_device(args.device)
    out = Path(args.out) if args.out else results_dir() / gpu_slug(device_name(device)) / "layernorm.json"
    rows, ceilings = run_layernorm_benchmark(
        device,
        shapes=args.shapes,
        dtypes=args.dtypes,
        modes=args.modes,
        providers=args.providers,
        progress=not args.no_progress,
        quick=args.quick,
        command=args.command,
    )
    if not rows:
        print("no rows measured (every provider failed; see the warnings above)", file=sys.stderr)
        return 1
    path = save_results(rows, out, ceilings=ceilings)
    print(
        f"\n{ceilings.device_name}: copy {ceilings.copy_gbps:,.1f} GB/s, "
        f"matmul {ceilings.matmul_tflops:,.3f} TFLOP/s ({ceilings.matmul_dtype})"
    )
    with pd.option_context("display.max_rows", None, "display.width", 200):
        print(summary_table(rows).to_string(index=False))
    print(f"\nwrote {len(rows)} rows to {path}")
    return 0


def _cmd_bench_elementwise(args: argparse.Namespace) -> int:
    from hfkit.bench.elementwise import elementwise_cases, run_elementwise_benchmark

    def run(device, common):
        cases = elementwise_cases(args.cases, device, args.quick)
        return run_elementwise_benchmark(device, cases, dtypes=args.dtypes, **common)

    return _run_kernel_bench(args, "elementwise.json", run)


def _cmd_bench_data(args: argparse.Namespace) -> int:
    import pandas as pd

    from hfkit.bench import results_dir, save_results
    from hfkit.bench.data_cost import data_cost_table, run_data_cost_benchmark
    from hfkit.bench.results import rows_to_frame

    out = Path(args.out) if args.out else results_dir() / "cpu" / "data_cost.json"
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
    path = save_results(rows, out)
    with pd.option_context("display.max_rows", None, "display.width", 200):
        print(data_cost_table(rows_to_frame(rows)).to_string())
    print(f"\nwrote {len(rows)} rows to {path} (rows with dtype 'synthetic' come from synthetic inputs)")
    return 0


def _cmd_bench_comms(args: argparse.Namespace) -> int:
    import pandas as pd

    from hfkit.bench import gpu_slug, results_dir, rows_to_frame
    from hfkit.bench.ceilings import device_name
    from hfkit.bench.comms import ddp_path, default_backends, run_comms_benchmark

    slug = gpu_slug(device_name(None))
    if slug != "cpu":
        slug = f"{slug}x{args.nproc}"  # e.g. h200x8: results depend on the GPU count
    out = Path(args.out) if args.out else results_dir() / slug / "comms.json"
    backends = args.backends or default_backends()
    try:
        rows = run_comms_benchmark(
            nproc=args.nproc,
            backends=backends,
            max_bytes=args.max_bytes,
            min_bytes=args.min_bytes,
            ddp=args.ddp,
            params=args.params,
            ddp_reps=args.ddp_reps,
            out=out,
            command=args.command,
            timeout_s=args.timeout,
        )
    except RuntimeError as err:
        print(f"hfkit bench comms: {err}", file=sys.stderr)
        return 1
    frame = rows_to_frame(rows)
    frame["busbw_gbps"] = [e.get("busbw_gbps") for e in frame["extra"]]
    with pd.option_context("display.max_rows", None, "display.width", 200):
        print(frame[["op", "provider", "mode", "shape_str", "p50_ms", "busbw_gbps"]].to_string(index=False))
    print(f"\nwrote {len(rows)} rows to {out} (allreduce) and {ddp_path(out)} (DDP steps)")
    return 0


def _run_kernel_bench(args: argparse.Namespace, file_name: str, run: Callable[..., object]) -> int:
    """Run one kernel benchmark, save it and print its tables. `run(device, common)` returns a
    `KernelBench`; `common` holds the options every kernel benchmark takes (modes, providers, progress,
    command, warm-up, reps, and `on_row`, called with each row as it is measured)."""
    import pandas as pd

    from hfkit.bench import environment_info, gpu_slug, resolve_device, results_dir, save_results
    from hfkit.bench.ceilings import device_name
    from hfkit.bench.kernels import best_peer_table, kernel_summary
    from hfkit.bench.peers import peer_status
    from hfkit.bench.results import appended_meta, earlier_results, merge_rows

    device = resolve_device(args.device)
    out = Path(args.out) if args.out else results_dir() / gpu_slug(device_name(device)) / file_name
    # --append: the rows already in `out` stay, except those this run measures again.
    earlier, earlier_meta = earlier_results(out) if args.append else ([], None)
    # The environment (versions, git commit: a subprocess) is read once, not once per saved row.
    meta = appended_meta(earlier_meta, environment_info(device, args.command))
    done: list = []

    def save_so_far(row) -> None:
        # Every finished case is on disk at once, marked partial: a run that is cut short (a time
        # limit, a crash in a peer library) keeps what it measured.
        done.append(row)
        save_results(merge_rows(earlier, done), out, meta={**meta, "partial": True})

    common = dict(
        modes=args.modes,
        providers=args.providers,
        progress=not args.no_progress,
        command=args.command,
        warmup=args.warmup,
        reps=args.reps,
        on_row=save_so_far,
    )
    result = run(device, common)
    for line in result.skipped:
        print(f"skipped: {line}", file=sys.stderr)
    if not result.rows:
        print("no rows measured (see the skipped providers above)", file=sys.stderr)
        return 1
    meta.update(timestamp=result.rows[0].timestamp, skipped=result.skipped, peers=peer_status(device))
    path = save_results(merge_rows(earlier, result.rows), out, ceilings=result.ceilings, meta=meta)
    ceilings = result.ceilings
    print(
        f"\n{ceilings.device_name}: copy {ceilings.copy_gbps:,.1f} GB/s, "
        f"matmul {ceilings.matmul_tflops:,.3f} TFLOP/s ({ceilings.matmul_dtype})"
    )
    with pd.option_context("display.max_rows", None, "display.width", 250, "display.max_columns", None):
        print(kernel_summary(result.rows).to_string(index=False))
        print("\nhfkit against the fastest other provider:")
        print(best_peer_table(result.rows).to_string(index=False))
    print(f"\nwrote {len(result.rows)} rows to {path}")
    return 0


def _cmd_bench_attention(args: argparse.Namespace) -> int:
    from hfkit.bench.attention import attention_cases, run_attention_benchmark

    def run(device, common):
        cases = attention_cases(args.ops, args.sizes, device, args.quick)
        return run_attention_benchmark(device, cases, dtypes=args.dtypes, **common)

    return _run_kernel_bench(args, "attention.json", run)


def _cmd_bench_softmax(args: argparse.Namespace) -> int:
    from hfkit.bench.softmax_bench import run_softmax_benchmark

    def run(device, common):
        return run_softmax_benchmark(device, args.shapes, dtypes=args.dtypes, quick=args.quick, **common)

    return _run_kernel_bench(args, "softmax.json", run)


def _cmd_bench_trimul(args: argparse.Namespace) -> int:
    from hfkit.bench.trimul import run_trimul_benchmark, trimul_cases

    def run(device, common):
        cases = trimul_cases(args.sizes, args.directions, device, args.quick)
        return run_trimul_benchmark(device, cases, precisions=args.precisions, **common)

    return _run_kernel_bench(args, "triangle_multiplication.json", run)


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


def _add_kernel_benches(bench_sub: argparse._SubParsersAction) -> None:
    """`hfkit bench attention|softmax|trimul|elementwise`: the Evoformer kernels against their peers."""
    from hfkit.bench import attention, elementwise, softmax_bench, trimul

    ints = lambda t: [int(v) for v in _csv(t)]  # noqa: E731
    specs = [
        ("attention", "triangle / MSA-row attention: hfkit vs eager, compile, SDPA, trifast, cuEquivariance",
         _cmd_bench_attention, attention.PROVIDERS, ["bf16"], "attention.json"),
        ("softmax", "fused softmax with pair bias and key mask: hfkit vs eager, compile",
         _cmd_bench_softmax, softmax_bench.PROVIDERS, ["bf16", "fp32"], "softmax.json"),
        ("trimul", "triangle multiplicative update: hfkit vs eager, compile, cuEquivariance",
         _cmd_bench_trimul, trimul.PROVIDERS, None, "triangle_multiplication.json"),
        ("elementwise", "fused sigmoid gate and bias+dropout+residual: hfkit vs eager, compile",
         _cmd_bench_elementwise, elementwise.PROVIDERS, ["fp32", "bf16"], "elementwise.json"),
    ]  # fmt: skip
    for name, help_text, func, providers, dtypes, file_name in specs:
        p = bench_sub.add_parser(name, help=help_text)
        p.add_argument("--out", default=None, help=f"results JSON (default: data/results/<gpu>/{file_name})")
        p.add_argument(
            "--providers",
            type=_choices(providers),
            default=list(providers),
            help=f"comma list of {','.join(providers)}",
        )
        p.add_argument(
            "--modes", type=_choices(["fwd", "fwd+bwd"]), default=["fwd", "fwd+bwd"], help="fwd,fwd+bwd"
        )
        if dtypes is not None:
            p.add_argument(
                "--dtypes", type=_choices(["fp32", "bf16", "fp16"]), default=dtypes, help="e.g. bf16,fp32"
            )
        p.add_argument("--quick", action="store_true", help="a few shapes (tiny ones on a CPU)")
        p.add_argument(
            "--append",
            action="store_true",
            help="keep the rows in --out that this run does not repeat",
        )
        p.add_argument("--warmup", type=int, default=None, help="warm-up calls per case (default 5 on a GPU)")
        p.add_argument("--reps", type=int, default=None, help="timed replays per case")
        p.add_argument("--device", default=None, help="e.g. cuda:0 or cpu (default: the GPU if any)")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.set_defaults(func=func)
        if name == "attention":
            p.add_argument(
                "--ops",
                type=_choices(list(attention.OPS)),
                default=list(attention.OPS),
                help="triangle,msa_row",
            )
            p.add_argument(
                "--sizes", type=ints, default=None, help="keep these N, e.g. 256,512 (default: all)"
            )
        elif name == "elementwise":
            p.add_argument("--cases", type=_csv, default=None, help="comma list of case names (default: all)")
        elif name == "softmax":
            p.add_argument(
                "--shapes", type=_shapes, default=None, help="x shapes SxHxNxK, e.g. 128x8x256x256"
            )
        else:
            p.add_argument("--sizes", type=ints, default=None, help="N values (default 256,384,512,1024)")
            p.add_argument(
                "--directions",
                type=_choices(list(trimul.DIRECTIONS)),
                default=None,
                help="outgoing,incoming at every size (default: outgoing at all, incoming at the largest)",
            )
            p.add_argument(
                "--precisions",
                type=_choices(list(trimul.PRECISIONS)),
                default=list(trimul.PRECISIONS),
                help="amp-bf16 (fp32 params under bf16 autocast), bf16 (bf16 params)",
            )


def _cmd_bench_model(args: argparse.Namespace) -> int:
    import pandas as pd

    from hfkit.bench import gpu_slug, resolve_device, results_dir
    from hfkit.bench.ceilings import device_name
    from hfkit.bench.model import run_model_benchmark, summary_table

    device = resolve_device(args.device)
    out = Path(args.out) if args.out else results_dir() / gpu_slug(device_name(device)) / "model.json"
    rows = run_model_benchmark(
        device,
        parts=args.parts,
        quick=args.quick,
        variants=args.variants,
        step_variants=args.step_variants,
        shapes=args.shapes,
        dtypes=args.dtypes,
        stack_dtypes=args.stack_dtypes,
        step_dtype=args.step_dtype,
        checkpointing=args.checkpointing,
        stack_launch=args.stack_launch,
        compile_backend=args.compile_backend,
        compile_mode=args.compile_mode,
        budget_s=args.budget_s,
        out=out,
        append=args.append,
        command=args.command,
        progress=not args.no_progress,
    )
    with pd.option_context("display.max_rows", None, "display.width", 250, "display.max_columns", None):
        print(summary_table(rows).to_string(index=False))
    failed = sum(r.method == "failed" for r in rows)
    print(f"\nwrote {len(rows)} rows ({failed} failed or skipped: see 'error') to {out}")
    return 0 if len(rows) > failed else 1


def _add_model_bench(bench_sub: argparse._SubParsersAction) -> None:
    """`hfkit bench model`: Evoformer block, 48-block stack and training step, eager/hfkit/compile."""
    from hfkit.bench.model import LAUNCHES, PARTS, PRECISIONS, VARIANTS

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
        "--variants", type=_choices(VARIANTS), default=list(VARIANTS), help="block and stack variants"
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
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode (default: none)")
    p.add_argument("--budget-s", type=float, default=None, help="skip configurations starting after this")
    p.add_argument("--append", action="store_true", help="keep other configurations already in --out")
    p.add_argument("--quick", action="store_true", help="tiny preset and shapes (a smoke run)")
    p.add_argument("--device", default=None, help="e.g. cuda:0 or cpu (default: the GPU if any)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_bench_model)


def _cmd_report(args: argparse.Namespace) -> int:
    import difflib

    from hfkit.bench.report import report_documents

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


def _parser() -> argparse.ArgumentParser:
    from hfkit.bench.layernorm import DTYPES, MODES, PROVIDERS

    parser = argparse.ArgumentParser(prog="hfkit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command_name", required=True)

    env = sub.add_parser("env", help="device, versions and measured ceilings")
    env.add_argument("--no-ceilings", action="store_true", help="skip measuring copy and matmul ceilings")
    env.add_argument("--device", default=None, help="e.g. cuda:0 or cpu (default: the GPU if any)")
    env.set_defaults(func=_cmd_env)

    bench = sub.add_parser("bench", help="run a benchmark and store its results under data/results/")
    bench_sub = bench.add_subparsers(dest="bench_name", required=True)
    ln = bench_sub.add_parser("layernorm", help="hfkit LayerNorm vs torch eager vs torch.compile")
    ln.add_argument("--out", default=None, help="results JSON (default: data/results/<gpu>/layernorm.json)")
    ln.add_argument(
        "--dtypes", type=_choices(list(DTYPES)), default=["fp32", "bf16"], help="comma list of fp32,bf16,fp16"
    )
    ln.add_argument(
        "--modes", type=_choices(MODES), default=["fwd", "fwd+bwd"], help="comma list of fwd,fwd+bwd"
    )
    ln.add_argument(
        "--providers",
        type=_choices(PROVIDERS),
        default=["hfkit", "torch", "compile"],
        help="comma list of hfkit,torch,compile",
    )
    ln.add_argument("--shapes", type=_shapes, default=None, help="e.g. 1x256x256x128,1x256x384")
    ln.add_argument("--quick", action="store_true", help="a few shapes (tiny ones on a CPU)")
    ln.add_argument("--device", default=None, help="e.g. cuda:0 or cpu (default: the GPU if any)")
    ln.add_argument("--no-progress", action="store_true", help="no progress bar")
    ln.set_defaults(func=_cmd_bench_layernorm)

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
    comms.add_argument("--timeout", type=float, default=1800.0, help="kill the run after this many seconds")
    comms.add_argument(
        "--out",
        default=None,
        help="allreduce results JSON (default: data/results/<gpu>x<n>/comms.json); DDP rows go to ddp.json",
    )
    comms.set_defaults(func=_cmd_bench_comms)

    _add_kernel_benches(bench_sub)
    _add_model_bench(bench_sub)

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
