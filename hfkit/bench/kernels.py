"""Tables of the Evoformer kernel benchmarks' rows (evoformer_attention, softmax, triangle_multiplication):
`kernel_frame` with readable columns, `best_peer_table` (hfkit against the fastest other provider),
`load_kernel_results`; and the correctness table of hfkit's kernels against their
references (`kernel_errors`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hfkit.bench.results import ResultRow, load_results, results_dir, rows_to_frame
from hfkit.bench.runner import DTYPES, max_abs_err

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "RESULT_FILES",
    "best_peer_table",
    "kernel_errors",
    "kernel_frame",
    "load_kernel_results",
]


# --- tables ---------------------------------------------------------------------------------------------

RESULT_FILES = ("evoformer_attention.json", "softmax.json", "triangle_multiplication.json")
OURS = "hfkit"


def _case_label(op: str, shape: Sequence[int], direction: str) -> str:
    if op == "triangle_attention":
        return f"N={shape[3]}"
    if op == "msa_row_attention":
        return f"S={shape[1]} N={shape[3]}"
    if op == "triangle_multiplication":
        return f"N={shape[1]} {direction}".strip()
    return "x".join(str(d) for d in shape)


def _n_of(op: str, shape: Sequence[int]) -> int:
    index = {"triangle_attention": 3, "msa_row_attention": 3, "softmax": 2, "triangle_multiplication": 1}
    return int(shape[index.get(op, -1)])


def kernel_frame(results: pd.DataFrame | Sequence[ResultRow]) -> pd.DataFrame:
    """Kernel benchmark rows as a DataFrame with readable extra columns: `case` (e.g. "N=512",
    "S=132 N=256", "N=1024 incoming"), `n`, `direction`, `peak_mib`, `error`, `check_ok` and
    `max_err` (the provider's error against the float32 reference)."""
    frame = rows_to_frame(results) if not hasattr(results, "columns") else results.copy()
    if "shape_str" not in frame:
        frame = rows_to_frame(frame.to_dict("records"))
    extras = [e if isinstance(e, dict) else {} for e in frame["extra"]]
    frame["direction"] = [e.get("direction", "") for e in extras]
    columns = zip(frame["op"], frame["shape"], frame["direction"], strict=True)
    frame["case"] = [
        e.get("case") or _case_label(o, s, d) for e, (o, s, d) in zip(extras, columns, strict=True)
    ]
    frame["n"] = [_n_of(o, s) for o, s in zip(frame["op"], frame["shape"], strict=True)]
    frame["peak_mib"] = frame["peak_mem_bytes"].astype("float64") / 2**20
    frame["error"] = [e.get("error") for e in extras]
    frame["check_ok"] = [e.get("check_ok") for e in extras]
    frame["max_err"] = [e.get("max_abs_err_vs_fp32_ref", e.get("rel_err_vs_fp32_eager")) for e in extras]
    frame["launch"] = [e.get("launch", "graph") for e in extras]
    return frame


def best_peer_table(results: pd.DataFrame | Sequence[ResultRow], ours: str = OURS) -> pd.DataFrame:
    """Per op, case, dtype, mode and launch (a CUDA graph of the calls, or the calls launched from
    Python): our p50 and peak memory next to the fastest other provider's (errors and failed checks
    left out), and the speed-up `best peer p50 / our p50` (>1: we are faster). Cases where every peer
    failed show the failures in `peers_failed`."""
    import pandas as pd

    frame = kernel_frame(results)
    ok = frame[frame["error"].isna() & (frame["check_ok"] != False)]  # noqa: E712 - None means unchecked
    records = []
    keys = ["op", "case", "dtype", "mode", "launch"]
    for key, group in frame.groupby(keys, sort=False):
        good = ok.loc[ok.index.intersection(group.index)]
        mine = good[good["provider"] == ours]
        peers = good[good["provider"] != ours]
        best = peers.loc[peers["p50_ms"].idxmin()] if len(peers) else None
        ours_ms = float(mine["p50_ms"].iloc[0]) if len(mine) else float("nan")
        failed = sorted(set(group["provider"]) - set(good["provider"]))
        records.append(
            dict(
                zip(keys, key, strict=True),
                **{
                    f"{ours} ms": ours_ms,
                    f"{ours} MiB": float(mine["peak_mib"].iloc[0]) if len(mine) else float("nan"),
                    "best peer": best["provider"] if best is not None else None,
                    "peer ms": float(best["p50_ms"]) if best is not None else float("nan"),
                    "peer MiB": float(best["peak_mib"]) if best is not None else float("nan"),
                    "speed-up": float(best["p50_ms"]) / ours_ms if best is not None else float("nan"),
                    "failed or flagged": ", ".join(failed),
                },
            )
        )
    return pd.DataFrame.from_records(records).round(
        {f"{ours} ms": 3, "peer ms": 3, f"{ours} MiB": 1, "peer MiB": 1, "speed-up": 2}
    )


def load_kernel_results(source: str | os.PathLike[str] = "h200") -> pd.DataFrame | None:
    """The kernel results (`RESULT_FILES`) in `source` (a GPU slug such as "h200" or a folder) as one
    `kernel_frame`; None when none of the files exists yet."""
    folder = Path(source)
    if not folder.is_dir():
        folder = results_dir() / str(source)
    files = [folder / name for name in RESULT_FILES if (folder / name).is_file()]
    if not files:
        return None
    import pandas as pd

    return kernel_frame(pd.concat([load_results(f) for f in files], ignore_index=True))


# --- correctness ----------------------------------------------------------------------------------------


def _grads(
    f: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], extra_args: Sequence[Any], dy_seed: int
):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = f(*leaves, *extra_args)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(dy_seed)).to(y)
    return [y.detach(), *torch.autograd.grad(y, leaves, dy)]


def kernel_errors(
    device: torch.device | str | None = None,
    dtypes: Sequence[str] = ("fp32", "bf16"),
    sizes: Sequence[int] = (13, 37),
    seed: int = 0,
) -> pd.DataFrame:
    """Max abs error of hfkit's kernels against their plain-torch references on fresh random inputs of
    odd sizes N in `sizes`, forward and every gradient: `softmax` (x [3, 2, N, N], bias [1, 2, N, N],
    key mask), `evoformer_attention` (q/k/v [1, 3, 2, N, 16], pair bias, key mask with zeros) and the
    triangle multiplication module after `to_hfkit` against the eager module (c = 16). `tol` is the
    dtype's rounding scale; `ok` says whether the error is within it."""
    import pandas as pd

    import hfkit.nn  # noqa: F401 - registers the swaps to_hfkit performs
    from hfkit.bench.cases.triangle_multiplication import TrimulCase, make_trimul_module
    from hfkit.nn.convert import to_hfkit
    from hfkit.ops import evoformer_attention, evoformer_attention_reference, softmax, softmax_reference

    device = torch.device(device) if device is not None else torch.device("cpu")
    tol = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 5e-3}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    records = []

    def add(
        op: str, shape: Sequence[int], dtype: str, names: Sequence[str], got: list, want: list, scale=1.0
    ):
        for name, a, b in zip(names, got, want, strict=True):
            err = max_abs_err(a, b)
            limit = tol[dtype] * max(1.0, float(b.float().abs().max())) * scale
            records.append(
                {"op": op, "shape": "x".join(map(str, shape)), "dtype": dtype, "output": name}
                | {"max_abs_err": err, "tol": limit, "ok": err <= limit}
            )

    for n in sizes:
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]

            def randn(*shape: int, dtype=dtype) -> torch.Tensor:
                return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

            mask = torch.ones(3, 1, 1, n, device=device, dtype=dtype)
            mask[..., n - 2 :] = 0
            x, bias = randn(3, 2, n, n), randn(1, 2, n, n)
            got, want = (_grads(f, (x, bias), (mask,), seed) for f in (softmax, softmax_reference))
            add("softmax", x.shape, dtype_name, ("y", "dx", "dbias"), got, want)

            q, k, v = randn(1, 3, 2, n, 16), randn(1, 3, 2, n, 16), randn(1, 3, 2, n, 16)
            bias = randn(1, 1, 2, n, n)
            amask = mask[None]
            attn = (evoformer_attention, evoformer_attention_reference)
            got, want = (_grads(f, (q, k, v, bias), (amask,), seed) for f in attn)
            add("evoformer_attention", q.shape, dtype_name, ("o", "dq", "dk", "dv", "dbias"), got, want)

            module = make_trimul_module(TrimulCase("outgoing", n, 16, 16), device, seed).to(dtype)
            swapped = to_hfkit(module, inplace=False)
            z = randn(1, n, n, 16)
            tmask = torch.ones(1, n, n, device=device, dtype=dtype)
            got, want = (_grads(m, (z,), (tmask,), seed) for m in (swapped, module))
            add("triangle_multiplication", z.shape, dtype_name, ("y", "dz"), got, want, scale=4.0)
    return pd.DataFrame.from_records(records)
