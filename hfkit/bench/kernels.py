"""The harness shared by the Evoformer kernel benchmarks (attention, softmax, triangle multiplication).

Every case (op, provider, mode, shape, dtype) is measured by one protocol, `measure_case`: first a
correctness check of the provider's forward against a float32 reference (so a fast number from a wrong
setup is caught and flagged in the row), then one step with the CUDA peak-memory counter reset (the
bytes above what the inputs already hold), then the timing: a CUDA graph of the step replayed and timed
with CUDA events (eager CUDA events when capture fails, the reason recorded), wall clock on a CPU. A
provider that raises (out of memory, an unsupported shape) gives a row with `method` "error", NaN
times and the error in `extra["error"]`: one failure never loses the other rows.

Also here: the tables the CLI and notebook 04 show (`kernel_frame`, `best_peer_table`, `kernel_goals`,
`load_kernel_results`) and the correctness table of hfkit's kernels against their references
(`kernel_errors`).
"""

from __future__ import annotations

import gc
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from hfkit.bench.ceilings import Ceilings, bench_ceilings
from hfkit.bench.results import ResultRow, row_environment
from hfkit.bench.timing import peak_memory, time_step

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "RESULT_FILES",
    "best_peer_table",
    "free_memory",
    "kernel_errors",
    "kernel_frame",
    "kernel_goals",
    "kernel_summary",
    "KernelBench",
    "KernelRun",
    "load_kernel_results",
    "max_abs_err",
    "measure_case",
    "Steps",
]


class Steps(NamedTuple):
    """What `measure_case` runs for one case: `step` makes `calls` op calls (one per rotating input
    set), `single` one call on the first set (for peak memory), `check` returns error figures."""

    step: Callable[[], Any]
    single: Callable[[], Any]
    calls: int
    check: Callable[[], dict[str, Any]] | None


class KernelBench(NamedTuple):
    """What a kernel benchmark returns: its rows, the ceilings they are percentages of, and the cases
    or providers it skipped, each with its reason (e.g. a peer library that is not installed)."""

    rows: list[ResultRow]
    ceilings: Ceilings
    skipped: list[str]


class KernelRun:
    """What one run of a kernel benchmark shares: device, timing defaults (`warmup`/`reps` None: 5 and
    `gpu_reps` on a GPU, 1 and 3 on a CPU), ceilings, row environment, progress bar, rows, skips."""

    def __init__(
        self,
        device: torch.device,
        *,
        total: int,
        desc: str,
        progress: bool,
        ceilings: Ceilings | None,
        command: str | None,
        warmup: int | None,
        reps: int | None,
        gpu_reps: int = 20,
        on_row: Callable[[ResultRow], None] | None = None,
    ) -> None:
        from tqdm.auto import tqdm

        on_cuda = device.type == "cuda"
        self.device = device
        self.warmup = warmup if warmup is not None else (5 if on_cuda else 1)
        self.reps = reps if reps is not None else (gpu_reps if on_cuda else 3)
        self.ceilings = ceilings or bench_ceilings(device)
        self.env = row_environment(device, command)
        self.bar = tqdm(total=total, disable=not progress, desc=desc)
        self.on_row = on_row
        self.rows: list[ResultRow] = []
        self.skipped: list[str] = []

    def measure(self, label: str, **case: Any) -> None:
        """`measure_case` with this run's shared arguments; the row is kept and handed to `on_row` (e.g.
        to save the rows so far: a run cut short keeps them)."""
        self.bar.set_postfix_str(label)
        row = measure_case(
            env=self.env,
            ceilings=self.ceilings,
            device=self.device,
            warmup=self.warmup,
            reps=self.reps,
            **case,
        )
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(row)
        free_memory(self.device)
        self.bar.update(1)

    def skip(self, reason: str, cases: int) -> None:
        """A provider that cannot run: its reason, and its `cases` counted as done on the bar."""
        self.skipped.append(reason)
        self.bar.update(cases)

    def result(self) -> KernelBench:
        self.bar.close()
        return KernelBench(self.rows, self.ceilings, self.skipped)


def free_memory(device: torch.device) -> None:
    """Drop unreachable tensors and return cached CUDA blocks, so the next case starts clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}"


def measure_case(
    *,
    env: dict[str, Any],
    ceilings: Ceilings,
    device: torch.device,
    op: str,
    provider: str,
    mode: str,
    shape: Sequence[int],
    dtype: str,
    nbytes: int,
    flops: int | None,
    build: Callable[[], Steps],
    warmup: int,
    reps: int,
    extra: dict[str, Any] | None = None,
) -> ResultRow:
    """Check, measure peak memory and time one case; return its row (an error row if anything raised).

    `build()` prepares the provider's inputs and returns the `Steps`; it runs inside the same guard, so
    running out of memory while preparing also gives an error row. `check()` returns error figures
    for `extra`, with `check_ok` False when the provider disagrees with the reference beyond its
    dtype's rounding (the row is kept and a warning raised).

    `nbytes` is the minimum memory traffic of one call, `flops` its arithmetic (None for
    memory-bound ops): the row reports GB/s and TFLOP/s from the median time and percentages of
    `ceilings`.
    """
    extra = dict(extra or {})
    base = dict(env, op=op, provider=provider, mode=mode, shape=[int(d) for d in shape], dtype=dtype)
    error = None
    start = time.perf_counter()
    try:
        steps = build()
        if steps.check is not None:
            extra.update(steps.check())
            if extra.get("check_ok") is False:
                warnings.warn(
                    f"{op} {provider} {dtype} {list(shape)}: output disagrees with the reference "
                    f"({ {k: v for k, v in extra.items() if 'err' in k} }); row flagged check_ok=False",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if device.type == "cuda":
            # One call first: compilation, autotuning (trifast benchmarks its configs on first use) and
            # lazy workspaces stay out of the peak. (On a CPU peak_memory's own call is the warm-up.)
            steps.single()
        # Seconds spent before timing: input layouts, the check, compilation and autotuning.
        extra["setup_s"] = round(time.perf_counter() - start, 2)
        peak, _ = peak_memory(steps.single, device)
        timing, note = time_step(steps.step, device, steps.calls, warmup, reps)
    except Exception as err:  # noqa: BLE001 - one failing provider (e.g. out of memory) must not end the run
        error = _short(err)
    if error is not None:
        # Outside the except block: the traceback (and the tensors its frames hold) is gone by now.
        steps = None
        free_memory(device)
        extra["error"] = error
        warnings.warn(
            f"{op} {provider} {mode} {dtype} {list(shape)} failed: {error}", RuntimeWarning, stacklevel=2
        )
        nan = math.nan
        return ResultRow(
            **base,
            p20_ms=nan,
            p50_ms=nan,
            p80_ms=nan,
            method="error",
            n_reps=0,
            bytes=int(nbytes),
            gbps=nan,
            pct_copy=None,
            flops=flops,
            extra=extra,
        )
    if note:
        extra["note"] = note
    seconds = timing.p50 * 1e-3
    gbps = nbytes / seconds / 1e9
    tflops = flops / seconds / 1e12 if flops is not None else None
    return ResultRow(
        **base,
        p20_ms=timing.p20,
        p50_ms=timing.p50,
        p80_ms=timing.p80,
        method=timing.method,
        n_reps=timing.n,
        bytes=int(nbytes),
        gbps=gbps,
        pct_copy=100.0 * gbps / ceilings.copy_gbps if ceilings.copy_gbps > 0 else None,
        flops=flops,
        tflops=tflops,
        pct_matmul=(
            100.0 * tflops / ceilings.matmul_tflops
            if tflops is not None and ceilings.matmul_tflops > 0
            else None
        ),
        peak_mem_bytes=peak,
        extra=extra,
    )


def max_abs_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| in float32 (0.0 for empty tensors)."""
    if actual.numel() == 0:
        return 0.0
    return float((actual.detach().float() - expected.detach().float()).abs().max())


# --- tables ---------------------------------------------------------------------------------------------

RESULT_FILES = ("attention.json", "softmax.json", "triangle_multiplication.json")
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
    from hfkit.bench.results import rows_to_frame

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
    return frame


def best_peer_table(results: pd.DataFrame | Sequence[ResultRow], ours: str = OURS) -> pd.DataFrame:
    """Per op, case, dtype and mode: our p50 and peak memory next to the fastest other provider's
    (errors and failed checks left out), and the speed-up `best peer p50 / our p50` (>1: we are
    faster). Cases where every peer failed show the failures in `peers_failed`."""
    import pandas as pd

    frame = kernel_frame(results)
    ok = frame[frame["error"].isna() & (frame["check_ok"] != False)]  # noqa: E712 - None means unchecked
    records = []
    keys = ["op", "case", "dtype", "mode"]
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


def kernel_summary(results: pd.DataFrame | Sequence[ResultRow]) -> pd.DataFrame:
    """One line per row: op, case, dtype, mode, provider, p50 ms, TFLOP/s, % matmul, GB/s, % copy, peak
    MiB, the check's error and any failure (the CLI prints this)."""
    frame = kernel_frame(results)
    table = frame[
        [
            "op",
            "case",
            "dtype",
            "mode",
            "provider",
            "p50_ms",
            "tflops",
            "pct_matmul",
            "gbps",
            "pct_copy",
            "peak_mib",
            "max_err",
        ]
    ].copy()
    table["error"] = [e[:60] if isinstance(e, str) else "" for e in frame["error"]]  # NaN where none
    return table.round({"p50_ms": 3, "tflops": 1, "pct_matmul": 1, "gbps": 1, "pct_copy": 1, "peak_mib": 1})


def load_kernel_results(source: str | os.PathLike[str] = "h200") -> pd.DataFrame | None:
    """The kernel results (`RESULT_FILES`) in `source` (a GPU slug such as "h200" or a folder) as one
    `kernel_frame`; None when none of the files exists yet."""
    from hfkit.bench.results import load_results, results_dir

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
    from hfkit.bench.layernorm import DTYPES
    from hfkit.bench.trimul import TrimulCase, make_trimul_module
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


def kernel_goals(results: pd.DataFrame | Sequence[ResultRow], ours: str = OURS) -> pd.DataFrame:
    """Issue 4's benchmark goals against the rows at hand: triangle attention forward+backward (bf16)
    at least 3x faster than the best peer at N=1024 and 2x at every N, with peak memory no higher than
    trifast's; triangle multiplication forward+backward at N=1024 (outgoing, amp-bf16) within 5 ms;
    fused softmax at 80% of the copy bandwidth or more. One line per goal and size, NaN where the rows
    needed are missing."""
    import pandas as pd

    frame = kernel_frame(results)
    best = best_peer_table(frame, ours)
    records = []

    def add(goal: str, case: str, measured: float, target: float, higher_is_better: bool) -> None:
        met = (
            None if measured != measured else (measured >= target if higher_is_better else measured <= target)
        )
        records.append({"goal": goal, "case": case, "measured": measured, "target": target, "met": met})

    tri = best[(best["op"] == "triangle_attention") & (best["mode"] == "fwd+bwd") & (best["dtype"] == "bf16")]
    for _, r in tri.iterrows():
        target = 3.0 if r["case"] == "N=1024" else 2.0
        add("triangle attention fwd+bwd: speed-up vs best peer", r["case"], r["speed-up"], target, True)
    mem = frame[
        (frame["op"] == "triangle_attention") & (frame["mode"] == "fwd+bwd") & (frame["dtype"] == "bf16")
    ]
    for case, group in mem.groupby("case", sort=False):
        mine = group.loc[group["provider"] == ours, "peak_mib"]
        peer = group.loc[group["provider"] == "trifast", "peak_mib"]
        if len(mine) and len(peer):
            add(
                "triangle attention fwd+bwd: peak MiB vs trifast",
                case,
                float(mine.iloc[0]),
                float(peer.iloc[0]),
                False,
            )
    tm = frame[
        (frame["op"] == "triangle_multiplication")
        & (frame["provider"] == ours)
        & (frame["mode"] == "fwd+bwd")
        & (frame["dtype"] == "amp-bf16")
        & (frame["case"] == "N=1024 outgoing")
    ]
    if len(tm):
        add(
            "triangle multiplication fwd+bwd ms (amp-bf16)",
            "N=1024 outgoing",
            float(tm["p50_ms"].iloc[0]),
            5.0,
            False,
        )
    sm = frame[(frame["op"] == "softmax") & (frame["provider"] == ours)]
    for _, r in sm.iterrows():
        add(f"softmax % of copy bandwidth ({r['dtype']} {r['mode']})", r["case"], r["pct_copy"], 80.0, True)
    return pd.DataFrame.from_records(records, columns=["goal", "case", "measured", "target", "met"])
