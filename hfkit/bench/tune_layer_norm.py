"""Block-size sweep for the LayerNorm kernels on one GPU: the data behind `_fwd_config`/`_bwd_config`.

Run on a GPU: `python -m hfkit.bench.tune_layer_norm --out tune.json`. For each normalized size of the
AlphaFold LayerNorm census (at its largest census shape) and each dtype, it times every forward
(BLOCK_M, num_warps) and backward (BLOCK_M, num_warps, programs per SM) configuration with CUDA graphs
over rotating inputs (so the 60 MB L2 does not serve repeats), beside a same-size copy, torch eager and
the current default configuration. Not part of the test suite: it needs a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys

import torch
import torch.nn.functional as F

import hfkit.ops  # noqa: F401  (registers the op module)
from hfkit.bench.ceilings import measure_copy_bandwidth
from hfkit.bench.timing import time_cuda

# hfkit.ops re-exports the function `layer_norm`, which shadows the module of the same name.
ln = importlib.import_module("hfkit.ops.layer_norm")

# One representative (largest) census shape per normalized size.
SHAPES = [(1, 256, 256, 128), (1, 132, 256, 256), (1, 1024, 256, 64), (200, 128, 1024), (1, 256, 384)]
SHAPES_BWD = SHAPES[:4]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FWD_BLOCK_M = (1, 2, 4, 8, 16, 32, 64)
# Backward variants: persistent programs per SM, next-block prefetch, per-slot weight-grad partials.
PER_SM = (8, 16, 32)
PREFETCH = (False, True)
ACC2D = (False, True)


def graph_time_ms(calls: list, replays: int = 20) -> float:
    """Median per-call time (ms) of `calls` run back to back inside one CUDA graph."""
    return time_cuda(lambda: [c() for c in calls], warmup=1, reps=replays, calls_per_graph=len(calls)).p50


def sets_for(nbytes: int, budget: int = 768 << 20, most: int = 48) -> int:
    return max(2, min(most, budget // max(1, nbytes)))


def tune_shape(shape: tuple[int, ...], dtype: torch.dtype, bwd_only: bool = False) -> dict:
    """Sweep one shape; `bwd_only` skips the forward and compares the backward variants at the default
    block shape only (1-2 warps, 8 or 16 programs per SM)."""
    n = shape[-1]
    m = 1
    for d in shape[:-1]:
        m *= d
    esize = torch.tensor([], dtype=dtype).element_size()
    k = sets_for(3 * m * n * esize)
    dev = torch.device("cuda")
    xs = [torch.randn(m, n, device=dev, dtype=dtype) for _ in range(k)]
    dys = [torch.randn(m, n, device=dev, dtype=dtype) for _ in range(k)]
    ys = [torch.empty_like(x) for x in xs]
    w = torch.randn(n, device=dev, dtype=dtype)
    b = torch.randn(n, device=dev, dtype=dtype)
    means = [torch.empty(m, device=dev) for _ in range(k)]
    rstds = [torch.empty(m, device=dev) for _ in range(k)]
    tensor_bytes = m * n * esize
    out: dict = {"shape": list(shape), "dtype": str(dtype), "rows": m, "n": n, "sets": k}

    out["copy_ms"] = graph_time_ms([lambda i=i: ys[i].copy_(xs[i]) for i in range(k)])
    out["torch_fwd_ms"] = graph_time_ms([lambda i=i: F.layer_norm(xs[i], (n,), w, b) for i in range(k)])

    block_n = 1 << (n - 1).bit_length()
    fwd = []
    for block_m in () if bwd_only else FWD_BLOCK_M:
        if block_m * block_n > 16384:
            continue
        for warps in (1, 2, 4, 8, 16):
            if warps * 32 > block_m * block_n:
                continue
            cfg = (block_m, block_n, warps)
            calls = [
                lambda i=i, cfg=cfg: ln._launch_fwd(xs[i], ys[i], w, b, means[i], rstds[i], 1e-5, cfg)
                for i in range(k)
            ]
            t = graph_time_ms(calls)
            fwd.append({"block_m": block_m, "warps": warps, "ms": t, "gbps": 2 * tensor_bytes / t / 1e6})
    out["fwd"] = sorted(fwd, key=lambda r: r["ms"])
    out["fwd_default"] = list(ln._fwd_config(n, esize))

    for i in range(k):  # statistics for the backward
        ln._launch_fwd(xs[i], ys[i], w, b, means[i], rstds[i], 1e-5, ln._fwd_config(n, esize))
    bwd = []
    bm0 = ln._bwd_config(n, esize)[0]
    for block_m in (bm0,) if bwd_only else sorted({max(1, bm0 // 2), bm0, 2 * bm0}):
        if block_m * block_n > 16384:
            continue
        for warps in (1, 2) if bwd_only else (1, 2, 4):
            if warps * 32 > block_m * block_n:
                continue
            cfg = (block_m, block_n, warps)
            per_sms = (8, 16) if bwd_only else PER_SM
            for per_sm, prefetch, acc2d in itertools.product(per_sms, PREFETCH, ACC2D):
                programs = ln._bwd_programs(m, cfg, dev, per_sm)
                dwbs = [torch.empty(2, programs, n, device=dev) for _ in range(k)]
                calls = [
                    lambda i=i, cfg=cfg, p=programs, d=dwbs, f=prefetch, a=acc2d: (
                        ln._launch_bwd(xs[i], dys[i], ys[i], w, means[i], rstds[i], d[i], True, p, cfg, f, a),
                        d[i].sum(dim=1),
                    )
                    for i in range(k)
                ]
                t = graph_time_ms(calls)
                row = {
                    "block_m": block_m,
                    "warps": warps,
                    "per_sm": per_sm,
                    "prefetch": prefetch,
                    "acc2d": acc2d,
                }
                bwd.append({**row, "ms": t, "gbps": 3 * tensor_bytes / t / 1e6})
    out["bwd"] = sorted(bwd, key=lambda r: r["ms"])
    out["bwd_default"] = list(ln._bwd_config(n, esize))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="tune_layer_norm.json")
    parser.add_argument("--bwd-only", action="store_true", help="skip the forward sweep")
    args = parser.parse_args(argv)
    given = argv if argv is not None else sys.argv[1:]
    if not torch.cuda.is_available():
        print("tune_layer_norm: needs a CUDA device", file=sys.stderr)
        return 2
    shapes = SHAPES_BWD if args.bwd_only else SHAPES
    # Clocks idle low: a second of matrix products first, then the copy ceiling.
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):
        a @ a
    ceiling = measure_copy_bandwidth("cuda")  # eager-timed: see hfkit.bench.ceilings
    results = {
        "command": " ".join(["python -m hfkit.bench.tune_layer_norm", *given]),
        "gpu": torch.cuda.get_device_name(),
        "copy_ceiling_gbps": ceiling,
        "shapes": [],
    }
    del a
    for shape in shapes:
        for name, dtype in DTYPES.items():
            r = tune_shape(shape, dtype, args.bwd_only)
            results["shapes"].append(r)
            f0 = r["fwd"][0] if r["fwd"] else {"ms": float("nan"), "gbps": 0, "block_m": 0, "warps": 0}
            b0 = r["bwd"][0]
            print(
                f"{str(shape):22s} {name}: copy {r['copy_ms'] * 1e3:6.1f}us torch fwd "
                f"{r['torch_fwd_ms'] * 1e3:6.1f}us | best fwd {f0['ms'] * 1e3:6.1f}us "
                f"({f0['gbps'] / ceiling:4.0%}) bm={f0['block_m']} w={f0['warps']} | best bwd "
                f"{b0['ms'] * 1e3:6.1f}us ({b0['gbps'] / ceiling:4.0%}) bm={b0['block_m']} "
                f"w={b0['warps']} p={b0['per_sm']} prefetch={b0['prefetch']} acc2d={b0['acc2d']}",
                flush=True,
            )
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
