"""The `hfkit` command line: `hfkit env` (device, versions, ceilings) and `hfkit bench layernorm`.

`main(argv)` is the entry point of both the `hfkit` console script and `python -m hfkit`; it returns
the exit status instead of calling `sys.exit`, so tests can call it directly.
"""

from __future__ import annotations

import argparse
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
