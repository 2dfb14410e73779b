"""Tile sweep for the Evoformer attention kernels on one GPU: the data behind `CONFIGS_SMALL_D`.

Run on a GPU: `python -m hfkit.bench.tune_attention --out tune.json`. For triangle attention (H=4,
D=32, pair bias, key mask) at several N and MSA row attention with pair bias, in bfloat16, it times
each kernel pass alone — the forward, and the backward's dk/dv, dq and dbias passes — for every
(BLOCK_M, BLOCK_N, num_warps, num_stages) in the pass's grid with CUDA graphs, then times the passes
of the whole op (forward, forward+backward) with the best tiles per pass beside the current defaults.
Configurations that fail to compile (too many registers or too much shared memory) are recorded as
failures. Not part of the test suite: it needs a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
import triton

import hfkit.ops  # noqa: F401  (registers the custom ops)
from hfkit.bench.timing import time_cuda

# hfkit.ops re-exports the function `evoformer_attention`, which shadows the module of the same name.
ea = sys.modules["hfkit.ops.evoformer_attention"]

# name -> (B, S, H, N, D); bias [B, 1, H, N, N] shared by the S rows.
SHAPES = {
    "tri256": (1, 256, 4, 256, 32),
    "tri512": (1, 512, 4, 512, 32),
    "tri1024": (1, 1024, 4, 1024, 32),
    "msa128x256": (1, 128, 8, 256, 32),
}
GRIDS = {
    "fwd": list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))),
    "dkdv": list(itertools.product((32, 64, 128), (64, 128), (4, 8), (2, 3))),
    "dq": list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))),
    "dbias": list(itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2))),
}


def make_inputs(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> dict:
    b, s, h, n, d = shape
    dev = torch.device("cuda")
    q, k, v = (torch.randn(b, s, h, n, d, device=dev, dtype=dtype) for _ in range(3))
    bias = torch.randn(b, 1, h, n, n, device=dev, dtype=dtype)
    mask = torch.rand(b, s, n, device=dev) > 0.05
    key_bias = (mask.float() - 1.0) * 1e9
    return {"q": q, "k": k, "v": v, "bias": bias, "mask": mask, "key_bias": key_bias}


def pass_runner(pass_: str, t: dict, cfg: ea.Config):
    """A callable that runs one kernel pass with tiles `cfg` on the inputs `t` (outputs preallocated;
    the dq pass, which writes delta, has run once before a dk/dv or dbias runner is returned)."""
    q, k, v, bias, kb = t["q"], t["k"], t["v"], t["bias"], t["key_bias"]
    b, s, h, n, d = q.shape
    o, mx, lg = torch.ops.hfkit.evoformer_attention_fwd(q, k, v, bias, kb)
    if pass_ == "fwd":
        return lambda: ea.launch_fwd(q, k, v, bias, kb, o, mx, lg, cfg)
    do = torch.randn_like(o)
    delta = torch.empty(o.shape[:-1], dtype=torch.float32, device=q.device)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    args = (q, k, v, bias, kb, o, do, mx, lg, delta, dq, dk, dv)
    dummy = torch.empty((0,), dtype=torch.float32, device=q.device)
    ea.launch_bwd("dq", *args, dummy, ea.Config(64, 64, 32, 4, 2))
    if pass_ != "dbias":
        return lambda: ea.launch_bwd(pass_, *args, dummy, cfg)
    nb = list(bias.shape[:3])
    tiles = triton.cdiv(n, cfg.block_m) * triton.cdiv(n, cfg.block_n) * nb[0] * nb[1] * nb[2]
    splits = ea.dbias_splits(b * s * h // (nb[0] * nb[1] * nb[2]), tiles, q.device)
    parts = torch.empty((splits, *nb, n, n), dtype=torch.float32, device=q.device)

    def run():
        ea.launch_bwd("dbias", *args, parts, cfg)
        parts.sum(0)

    return run


def flops(shape: tuple[int, ...], matmuls: int) -> float:
    b, s, h, n, d = shape
    return 2.0 * matmuls * b * s * h * n * n * d


# Matmuls per pass: fwd q·kᵀ and p·v; dk/dv recomputes q·kᵀ, do·vᵀ, then pᵀ·do and dsᵀ·q; dq
# recomputes two and adds ds·k; dbias recomputes two.
MATMULS = {"fwd": 2, "dkdv": 4, "dq": 3, "dbias": 2}


def sweep_pass(pass_: str, shape_names: list[str], inputs: dict, reps: int) -> list[dict]:
    rows = []
    for bm, bn, warps, stages in GRIDS[pass_]:
        cfg = ea.Config(bm, bn, 32, warps, stages)
        for name in shape_names:
            row = {
                "pass": pass_,
                "shape": name,
                "block_m": bm,
                "block_n": bn,
                "warps": warps,
                "stages": stages,
            }
            try:
                ms = time_cuda(pass_runner(pass_, inputs[name], cfg), warmup=2, reps=reps).p50
                row["ms"] = ms
                row["tflops"] = flops(SHAPES[name], MATMULS[pass_]) / ms / 1e9
            except Exception as exc:  # noqa: BLE001  (a tile that does not compile is a data point)
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
    return rows


def best_per_pass(rows: list[dict], shape_names: list[str]) -> dict[str, tuple[int, int, int, int]]:
    """Per pass, the tiles whose time summed over the shapes, each relative to that shape's fastest
    tiles, is least; only tiles that ran at every shape count."""
    best = {}
    for pass_ in GRIDS:
        ok = [r for r in rows if r["pass"] == pass_ and "ms" in r]
        fastest = {
            name: min((r["ms"] for r in ok if r["shape"] == name), default=None) for name in shape_names
        }
        score: dict[tuple, list[float]] = {}
        for r in ok:
            key = (r["block_m"], r["block_n"], r["warps"], r["stages"])
            score.setdefault(key, []).append(r["ms"] / fastest[r["shape"]])
        full = {key: sum(v) for key, v in score.items() if len(v) == len(shape_names)}
        if full:
            best[pass_] = min(full, key=full.get)
    return best


def time_op(t: dict, configs: dict[str, ea.Config], reps: int) -> dict[str, float]:
    """Median ms of the forward and of forward + backward (every pass, in the op's order) with the
    tiles `configs` per pass."""
    runs = {pass_: pass_runner(pass_, t, cfg) for pass_, cfg in configs.items()}
    fwd = time_cuda(runs["fwd"], warmup=3, reps=reps).p50
    both = time_cuda(lambda: [runs[p]() for p in ("fwd", "dq", "dkdv", "dbias")], warmup=3, reps=reps).p50
    return {"fwd_ms": fwd, "fwd_bwd_ms": both}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the sweep")
    parser.add_argument("--passes", default="fwd,dkdv,dq,dbias")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_attention: needs a CUDA device", file=sys.stderr)
        return 2
    names = args.shapes.split(",")
    inputs = {name: make_inputs(SHAPES[name]) for name in names}
    command = "python -m hfkit.bench.tune_attention " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = {
        "command": command,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shapes": {k: SHAPES[k] for k in names},
        "note": f"tflops per pass count 2*matmuls*B*S*H*N*N*D, matmuls {MATMULS}",
        "rows": [],
    }
    t0 = time.time()

    def dump() -> None:
        doc["elapsed_s"] = time.time() - t0
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)

    for pass_ in args.passes.split(","):
        doc["rows"] += sweep_pass(pass_, names, inputs, args.reps)
        print(f"{pass_}: {len(GRIDS[pass_])} configs, {time.time() - t0:.0f} s", flush=True)
        dump()
    best = best_per_pass(doc["rows"], names)
    doc["best"] = {k: list(v) for k, v in best.items()}
    print("best", best, flush=True)
    doc["op"] = {}
    default = {pass_: ea._config(pass_, 32, torch.device("cuda")) for pass_ in GRIDS}
    tuned = {pass_: ea.Config(bm, bn, 32, w, st) for pass_, (bm, bn, w, st) in best.items()}
    for label, configs in (("default", default), ("best", {**default, **tuned})):
        doc["op"][label] = {name: time_op(inputs[name], configs, args.reps) for name in names}
        print(label, doc["op"][label], flush=True)
        dump()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
