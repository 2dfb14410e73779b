"""Tile sweep for the fused softmax kernels on one GPU: the data behind `hfkit.ops.softmax._config`.

Run on a GPU: `python -m hfkit.bench.tune_softmax --out tune.json`. At the Evoformer logits shapes
(MSA row [S, 8, N, N] and triangle [N, 4, N, N], pair bias broadcast over the rows, key mask), in
bfloat16, it times the forward and the backward kernel alone for every (rows per program, num_warps)
with CUDA graphs over rotating inputs, beside a same-size copy, and reports GB/s and % of that copy.
Not part of the test suite: it needs a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch

import hfkit.ops  # noqa: F401  (registers the custom ops)
from hfkit.bench.ceilings import measure_copy_bandwidth
from hfkit.bench.timing import time_cuda

# hfkit.ops re-exports the function `softmax`, which shadows the module of the same name.
sm = sys.modules["hfkit.ops.softmax"]

SHAPES = [(128, 8, 256, 256), (256, 8, 384, 384), (128, 8, 512, 512), (256, 4, 256, 256), (384, 4, 384, 384)]
ROWS = (1, 2, 4, 8, 16)
WARPS = (1, 2, 4, 8, 16)


def make_sets(shape: tuple[int, ...], sets: int = 4) -> list[dict]:
    s, h, n, k = shape
    dev = torch.device("cuda")
    out = []
    for _ in range(sets):
        x = torch.randn(s, h, n, k, device=dev, dtype=torch.bfloat16)
        bias = torch.randn(1, h, n, k, device=dev, dtype=torch.bfloat16)
        mask = (torch.rand(s, 1, 1, k, device=dev) > 0.05).to(torch.bfloat16)
        y = torch.ops.hfkit.softmax_fwd(x, bias, mask)
        out.append(
            {
                "x": x,
                "bias": bias,
                "mask": mask,
                "y": y,
                "dy": torch.randn_like(y),
                "out": torch.empty_like(y),
            }
        )
    return out


def time_pass(pass_: str, sets: list[dict], tiles: tuple[int, int]) -> float:
    """Median ms of one call of the 'fwd' or 'bwd' kernel with `tiles` (rows a program, num_warps),
    averaged over the rotating sets."""
    if pass_ == "fwd":
        calls = [lambda t=t: sm.launch_fwd(t["x"], t["bias"], t["mask"], t["out"], tiles) for t in sets]
    else:
        calls = [lambda t=t: sm.launch_bwd(t["dy"], t["y"], t["out"], tiles) for t in sets]
    return time_cuda(lambda: [c() for c in calls], warmup=2, reps=20, calls_per_graph=len(calls)).p50


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the sweep")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_softmax: needs a CUDA device", file=sys.stderr)
        return 2
    copy_gbps = measure_copy_bandwidth(torch.device("cuda"))
    argv_text = " ".join(argv if argv is not None else sys.argv[1:])
    doc = {
        "command": f"python -m hfkit.bench.tune_softmax {argv_text}",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_gbps": copy_gbps,
        "note": "bytes: forward reads x, writes y; backward reads y, dy, writes dx (bias, mask: cache hits)",
        "rows": [],
    }
    t0 = time.time()
    for shape in SHAPES:
        sets = make_sets(shape)
        nbytes = {"fwd": 2 * sets[0]["x"].nbytes, "bwd": 3 * sets[0]["x"].nbytes}
        for pass_ in ("fwd", "bwd"):
            default_ms = time_pass(pass_, sets, sm._config(shape[-1], pass_))
            for rows, warps in itertools.product(ROWS, WARPS):
                row = {"shape": list(shape), "pass": pass_, "block_m": rows, "warps": warps}
                row["default_ms"] = default_ms
                try:
                    ms = time_pass(pass_, sets, (rows, warps))
                    row.update(ms=ms, pct_copy=100 * nbytes[pass_] / ms / 1e6 / copy_gbps)
                except Exception as exc:  # noqa: BLE001  (a tile that does not compile is a data point)
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                doc["rows"].append(row)
            timed = [r for r in doc["rows"] if "ms" in r and r["shape"] == list(shape) and r["pass"] == pass_]
            best = min(timed, key=lambda r: r["ms"])
            print(
                f"{shape} {pass_}: default {default_ms:.3f} ms, best {best['ms']:.3f} ms ({best['block_m']} "
                f"rows, {best['warps']} warps, {best['pct_copy']:.0f}% of copy)",
                flush=True,
            )
        doc["elapsed_s"] = time.time() - t0
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)
        del sets
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
