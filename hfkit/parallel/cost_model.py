"""An alpha-beta cost model of gradient allreduce: NCCL's ring against hfreduce's host-staged reduction.

`ClusterSpec` describes a cluster (GPUs per node, nodes, link bandwidths, latency); `predict` gives the
time of one allreduce of `nbytes` for a backend: `"ring"`/`"nccl"` (one ring through every GPU, bounded
by its slowest hop: NVLink or PCIe peer copies inside a node, the node's NIC between nodes) or
`"hfreduce"` (per chunk: device-to-host over PCIe, a sum in host memory, an allreduce among node
leaders over a double binary tree, host-to-device; pipelined by chunk). `calibrate` fits latency and
bandwidth to measured (size, time) pairs by least squares, `fit_cluster` fits a spec to one measured
single-node run (nccl and hfreduce; with the stage rates the comms benchmark measured in the same run,
those replace the fitted copy and host-sum rates: `with_stage_rates`), `hfreduce_bound` is the time a
pipelined host-staged allreduce cannot beat given measured `StageRates`, and `seed_comparison` sets
the model's prediction for AlphaFold's 93.2M fp32 gradients on 128 A100 PCIe GPUs next to the seed's
measurement.
Bandwidths are in GB/s (1e9 bytes/s, one direction), latencies in microseconds, sizes in bytes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "AF2_PARAMS",
    "SEED_MEASURED",
    "Backend",
    "ClusterSpec",
    "Calibration",
    "StageRates",
    "a100_pcie_fireflyer",
    "best_chunk_bytes",
    "bound_comparison",
    "h200_nvlink",
    "calibrate",
    "calibrate_backends",
    "fit_cluster",
    "hfreduce_bound",
    "hfreduce_stages",
    "measured_stage_rates",
    "model_comparison",
    "predict",
    "ring_allreduce_time",
    "seed_comparison",
    "with_stage_rates",
]

Backend = Literal["ring", "nccl", "gloo", "hfreduce"]

# AlphaFold's parameter count and the seed's measured DDP communication overhead on 128 A100s
# (backward 5.63 s alone; 6.03 s with NCCL; 5.91 s with hfreduce).
AF2_PARAMS = 93_200_000
SEED_MEASURED: dict[str, float] = {"backward_alone_s": 5.63, "nccl": 0.40, "hfreduce": 0.28}

GB = 1e9


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster for the cost model: shape, per-link bandwidths (GB/s, one direction) and latency.

    `pcie_gbps`: one GPU's device<->host copy rate; `gpus_per_pcie_switch` GPUs share one uplink;
    `h2d_gbps`: the host->device rate where it differs (None: `pcie_gbps`).
    `nvlink_gbps`: per-GPU NVLink rate NCCL's ring reaches inside a node (None: no NVLink). Without
    NVLink a ring hop inside a node is a PCIe peer copy through the CPU's root complex, at
    `p2p_gbps` (default `pcie_gbps`), which is what NCCL really gets between GPUs on different root
    ports or sockets. `nic_gbps`: a node's network rate (all its NICs). `host_mem_gbps`: the node's
    achievable host memory bandwidth. `alpha_us`: per-message latency of one ring step or tree level.
    `chunk_bytes`: hfreduce's pipeline chunk. `chunk_overhead_us`: a fixed host cost per hfreduce
    chunk (synchronising the node's ranks, launching the per-chunk copies and sum), added to the host
    reduce stage; 0 in the link-spec presets, fitted by `fit_cluster`. `notes`: where the numbers come
    from.
    """

    name: str
    gpus_per_node: int
    nodes: int
    pcie_gbps: float
    nvlink_gbps: float | None
    nic_gbps: float
    host_mem_gbps: float
    alpha_us: float
    p2p_gbps: float | None = None
    gpus_per_pcie_switch: int = 1
    chunk_bytes: int = 4 << 20
    chunk_overhead_us: float = 0.0
    h2d_gbps: float | None = None
    notes: str = ""

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nodes", "gpus_per_pcie_switch", "chunk_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ClusterSpec.{name}: expected >= 1, got {getattr(self, name)}")
        for name in ("pcie_gbps", "nic_gbps", "host_mem_gbps", "nvlink_gbps", "p2p_gbps", "h2d_gbps"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"ClusterSpec.{name}: expected a positive bandwidth, got {value}")
        for name in ("alpha_us", "chunk_overhead_us"):
            if getattr(self, name) < 0:
                raise ValueError(f"ClusterSpec.{name}: expected >= 0, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def intra_gbps(self) -> float:
        """The bandwidth of a ring hop between two GPUs of one node: NVLink if present, else PCIe peer."""
        if self.nvlink_gbps is not None:
            return self.nvlink_gbps
        return self.p2p_gbps if self.p2p_gbps is not None else self.pcie_gbps

    def with_(self, **changes: Any) -> ClusterSpec:
        """A copy with some fields changed (e.g. `spec.with_(nodes=4)`)."""
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def a100_pcie_fireflyer(nodes: int = 16) -> ClusterSpec:
    """The seed's cluster (Fire-Flyer 2, arXiv 2408.14158): 8 A100 PCIe per node, no NVLink, 1×200 Gb/s IB.

    Hardware per the paper: GPUs attach straight to the CPUs' root ports (no PCIe switch), one
    200 Gb/s InfiniBand NIC per node on its own root complex, 2 AMD EPYC CPUs with 16 DDR4-3200
    channels (409.6 GB/s peak; 300 GB/s assumed achievable). PCIe 4.0 x16 copies: 24 GB/s assumed.
    `p2p_gbps` = 4.8 GB/s is an *effective* value, not a link spec: the paper reports NCCL reaching
    only 1.6-4.8 GB/s on this cluster (186 MiB allreduce) against HFReduce's 6.3-8.1 GB/s, because
    ring hops between GPUs on different root complexes (and GPU to NIC) cross the CPU fabric; we take
    the top of NCCL's range as the rate of its slowest ring hop.
    """
    return ClusterSpec(
        name="A100 PCIe ×8/node, no NVLink, 1×200 Gb/s IB (Fire-Flyer 2)",
        gpus_per_node=8,
        nodes=nodes,
        pcie_gbps=24.0,
        nvlink_gbps=None,
        nic_gbps=200 / 8 * 0.92,  # 200 Gb/s = 25 GB/s line rate; ~92% after IB encoding and headers
        host_mem_gbps=300.0,
        alpha_us=20.0,
        p2p_gbps=4.8,
        gpus_per_pcie_switch=1,
        notes="arXiv 2408.14158; p2p_gbps effective (top of NCCL's measured 1.6-4.8 GB/s)",
    )


def h200_nvlink(nodes: int = 16) -> ClusterSpec:
    """8 H200 SXM per node with NVLink (900 GB/s bidirectional, 450 one way) and 8×400 Gb/s NICs.

    PCIe 5.0 x16 copies at 50 GB/s assumed, two GPUs per PCIe switch (HGX boards pair GPUs behind a
    switch that also holds their NICs), 2-socket DDR5 host memory at 450 GB/s achievable (assumed).
    """
    return ClusterSpec(
        name="H200 SXM ×8/node, NVLink 900 GB/s, 8×400 Gb/s",
        gpus_per_node=8,
        nodes=nodes,
        pcie_gbps=50.0,
        nvlink_gbps=450.0,
        nic_gbps=8 * 400 / 8 * 0.92,
        host_mem_gbps=450.0,
        alpha_us=5.0,
        gpus_per_pcie_switch=2,
        notes="vendor link rates; PCIe, host memory and efficiencies assumed",
    )


def ring_allreduce_time(nbytes: float, n: int, alpha_us: float, bw_gbps: float) -> float:
    """Seconds for a ring allreduce of `nbytes` over `n` ranks: 2(n-1)·α + 2(n-1)/n · S/B.

    The ring does n-1 reduce-scatter and n-1 all-gather steps, each a latency α and a 1/n slice of S
    over the slowest hop (bandwidth B). One rank takes no time.
    """
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha_us * 1e-6 + 2 * (n - 1) / n * nbytes / (bw_gbps * GB)


def _ring_bandwidth(spec: ClusterSpec) -> float:
    # The ring crosses each node boundary once per direction, so with several nodes its slowest hop
    # is min(intra-node hop, the node's NIC); inside one node only the intra hop counts.
    if spec.nodes > 1:
        return min(spec.intra_gbps, spec.nic_gbps)
    return spec.intra_gbps


def hfreduce_stages(spec: ClusterSpec, chunk: float) -> dict[str, float]:
    """Seconds per pipeline stage for one hfreduce chunk of `chunk` bytes per GPU.

    d2h: the chunk over PCIe (GPUs behind one switch share its uplink); reduce: a fixed
    `chunk_overhead_us`, then the host sums the node's g chunks (reads g·c, writes c at host memory
    bandwidth); inter: allreduce among node leaders on a double binary tree (≈2·c/B_nic +
    log2(nodes)·α; zero on one node); h2d: the result back (at `h2d_gbps` where set).
    """
    g = spec.gpus_per_node
    share = min(spec.gpus_per_pcie_switch, g)
    d2h = share * chunk / (spec.pcie_gbps * GB)
    h2d = share * chunk / ((spec.h2d_gbps or spec.pcie_gbps) * GB)
    reduce = spec.chunk_overhead_us * 1e-6 + (g + 1) * chunk / (spec.host_mem_gbps * GB)
    inter = 0.0
    if spec.nodes > 1:
        inter = 2 * chunk / (spec.nic_gbps * GB) + math.ceil(math.log2(spec.nodes)) * spec.alpha_us * 1e-6
    return {"d2h": d2h, "reduce": reduce, "inter": inter, "h2d": h2d}


def _chunking(spec: ClusterSpec, nbytes: float) -> tuple[int, float]:
    """hfreduce's chunk count and chunk size (bytes) for an allreduce of `nbytes`."""
    chunks = max(1, math.ceil(nbytes / spec.chunk_bytes))
    return chunks, nbytes / chunks


def _hfreduce_time(spec: ClusterSpec, nbytes: float) -> float:
    if spec.world_size <= 1 or nbytes <= 0:
        return 0.0
    chunks, chunk = _chunking(spec, nbytes)
    stages = hfreduce_stages(spec, chunk)
    # Pipelined: the first chunk passes every stage, then one chunk leaves per slowest stage.
    return sum(stages.values()) + (chunks - 1) * max(stages.values())


@dataclass(frozen=True)
class StageRates:
    """hfreduce's stage rates measured on one node (the comms benchmark, in the same run as the
    allreduce), in GB/s per rank. `_all` rates are taken with all `local_ranks` ranks working at once,
    `_alone` with one rank while the others wait. `host_sum_gbps`: a 2-input torch add on `threads`
    threads, counting its memory traffic (read, read, write); `host_copy_gbps`: host copies as hfreduce
    moves a CPU tensor (into a one-chunk slot and back out, chunk by chunk), counting read and write
    each way. Device rates (None without CUDA): pinned device→host and host→device copies of
    one rank, and `bidir_all_gbps`, both directions at once on two streams (both directions' bytes).
    """

    local_ranks: int
    threads: int
    host_sum_gbps: float
    host_copy_gbps: float
    d2h_alone_gbps: float | None = None
    h2d_alone_gbps: float | None = None
    d2h_all_gbps: float | None = None
    h2d_all_gbps: float | None = None
    bidir_all_gbps: float | None = None

    def __post_init__(self) -> None:
        if self.local_ranks < 1 or self.threads < 1:
            raise ValueError(
                f"StageRates: expected local_ranks and threads >= 1, got {self.local_ranks}, {self.threads}"
            )
        for name, value in asdict(self).items():
            if name.endswith("_gbps") and value is not None and not value > 0:
                raise ValueError(f"StageRates.{name}: expected a positive rate or None, got {value}")

    @property
    def cuda(self) -> bool:
        """Whether the device copy rates were measured (all three `_all` rates present)."""
        return None not in (self.d2h_all_gbps, self.h2d_all_gbps, self.bidir_all_gbps)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> StageRates:
        """The rates of `as_dict` (keys it does not know are ignored)."""
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in values.items() if k in names})


def hfreduce_bound(
    nbytes: float,
    rates: StageRates,
    chunk_bytes: int = 4 << 20,
    small_bytes: int = 256 << 10,
    cuda: bool = True,
) -> float:
    """Seconds a pipelined host-staged allreduce of `nbytes` per rank cannot beat on one node with the
    measured `rates` (L = `rates.local_ranks`, chunks of c = min(S, `chunk_bytes`), k = ⌈S/c⌉).

    CUDA tensors (`cuda` and device rates present), per chunk the stages overlap: d2h = c/D (D: the
    device→host rate with every local rank copying), h2d = c/U, both at once on the two copy
    engines copy = max(d2h, h2d, 2c/B) (B: the bidirectional rate), and the host sum of this rank's
    slice sum = (L+1)·(c/L)/H (L slot reads and one write at the threaded sum rate H). The pipeline
    takes T = d2h + sum + h2d (one chunk's latency of fill) + (k−1)·max(copy, sum). CPU tensors: the
    copies into and out of the slots (2c each of traffic at the host copy rate C) and the sum share the
    rank's cores, so nothing overlaps: T = 4S/C + (L+1)·S/(L·H). Messages of at most `small_bytes`
    take the one-barrier path, where each rank sums the whole message: T = in + (L+1)·S/H + out with
    in = out = S/D, S/U (CUDA) or 2S/C (CPU). Barriers and launches are left out: it is a bandwidth
    bound, far below what small messages can reach.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes: expected >= 0, got {nbytes}")
    if cuda and not rates.cuda:
        raise ValueError("rates: expected device copy rates for a CUDA bound, got a CPU-only measurement")
    if nbytes == 0:
        return 0.0
    L, H = rates.local_ranks, rates.host_sum_gbps * GB
    C = rates.host_copy_gbps * GB
    if cuda:
        D, U, B = (float(r or 0) * GB for r in (rates.d2h_all_gbps, rates.h2d_all_gbps, rates.bidir_all_gbps))
    if nbytes <= small_bytes:
        copy_in, copy_out = (nbytes / D, nbytes / U) if cuda else (2 * nbytes / C, 2 * nbytes / C)
        return copy_in + (L + 1) * nbytes / H + copy_out
    if not cuda:
        return 4 * nbytes / C + (L + 1) * nbytes / (L * H)
    c = min(nbytes, chunk_bytes)
    k = math.ceil(nbytes / c)
    d2h, h2d, summed = c / D, c / U, (L + 1) * (c / L) / H
    copy = max(d2h, h2d, 2 * c / B)
    return d2h + summed + h2d + (k - 1) * max(copy, summed)


def best_chunk_bytes(
    nbytes: float,
    rates: StageRates,
    chunk_overhead_us: float,
    candidates: Sequence[int] = tuple(1 << k for k in range(18, 27)),
) -> int:
    """The chunk size (of `candidates`, default 256 KiB .. 64 MiB) at which a pipelined allreduce of
    `nbytes` on CUDA tensors is fastest with the measured `rates` and a fixed cost per chunk of
    `chunk_overhead_us` (the barrier and the copy launches: e.g. `fit_cluster`'s): the argmin of
    `hfreduce_bound` (no small path) + chunks·overhead. Small chunks pay the overhead often, large
    ones a long fill; ties go to the smaller chunk (a smaller segment)."""
    if chunk_overhead_us < 0:
        raise ValueError(f"chunk_overhead_us: expected >= 0, got {chunk_overhead_us}")
    if not candidates:
        raise ValueError("candidates: expected at least one chunk size, got none")

    def cost(c: int) -> float:
        chunks = max(1, math.ceil(nbytes / c))
        return hfreduce_bound(nbytes, rates, c, small_bytes=0) + chunks * chunk_overhead_us * 1e-6

    return min(sorted(candidates), key=cost)


def with_stage_rates(spec: ClusterSpec, rates: StageRates) -> ClusterSpec:
    """`spec` with hfreduce's copy and host-sum rates replaced by measured ones: `gpus_per_node` =
    L = `rates.local_ranks`; `pcie_gbps` and `h2d_gbps` = the per-rank device↔host rates with every
    local rank copying (so `gpus_per_pcie_switch` = 1: the sharing is in the measurement);
    `host_mem_gbps` = L·`host_sum_gbps` (the model's reduce stage moves the node's (g+1)·c at the
    node's rate; each rank's slice runs at the measured rate). Without device rates (a CPU run) the
    copy rates stay as in `spec`."""
    changes: dict[str, Any] = {
        "gpus_per_node": rates.local_ranks,
        "host_mem_gbps": rates.local_ranks * rates.host_sum_gbps,
    }
    if rates.cuda:
        changes.update(pcie_gbps=rates.d2h_all_gbps, h2d_gbps=rates.h2d_all_gbps, gpus_per_pcie_switch=1)
    return spec.with_(**changes)


def predict(spec: ClusterSpec, nbytes: float, backend: str) -> float:
    """Predicted seconds of one allreduce of `nbytes` per GPU on `spec` with `backend`.

    `"ring"`, `"nccl"` and `"gloo"` use the ring (gloo on a GPU cluster is slower in practice; it is a
    ring over host copies, not modelled separately); `"hfreduce"` the host-staged pipeline.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes: expected >= 0, got {nbytes}")
    if backend in ("ring", "nccl", "gloo"):
        return ring_allreduce_time(nbytes, spec.world_size, spec.alpha_us, _ring_bandwidth(spec))
    if backend == "hfreduce":
        return _hfreduce_time(spec, nbytes)
    raise ValueError(f"backend: expected ring, nccl, gloo or hfreduce, got {backend!r}")


@dataclass(frozen=True)
class Calibration:
    """A fitted ring model: latency α (µs), bandwidth B (GB/s), the rank count and the fit's rms error."""

    alpha_us: float
    bw_gbps: float
    n: int
    rel_rms: float

    def predict(self, nbytes: float) -> float:
        return ring_allreduce_time(nbytes, self.n, self.alpha_us, self.bw_gbps)


def calibrate(sizes: Sequence[float], times_s: Sequence[float], n: int) -> Calibration:
    """Fit the ring formula's α and B to measured allreduce times by least squares.

    t = a + b·S is linear in a = 2(n-1)·α and b = 2(n-1)/(n·B); rows are weighted by 1/t so that small
    and large messages count alike (a relative-error fit). Coefficients are kept positive (a tiny
    floor) so that the fitted α and B are physical. `rel_rms` is the rms relative residual.
    """
    s = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times_s, dtype=np.float64)
    if s.shape != t.shape or s.size < 2:
        raise ValueError(f"calibrate: expected >= 2 matching sizes and times, got {s.size} and {t.size}")
    if n < 2:
        raise ValueError(f"calibrate: a ring needs n >= 2 ranks, got {n}")
    if np.any(t <= 0):
        raise ValueError("calibrate: times must be positive")
    w = 1.0 / t
    design = np.stack([np.ones_like(s), s], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    a, b = max(float(a), 1e-12), max(float(b), 1e-18)
    alpha_us = a / (2 * (n - 1)) * 1e6
    bw_gbps = 2 * (n - 1) / (n * b) / GB
    rel = (a + b * s - t) / t
    return Calibration(alpha_us, bw_gbps, n, float(np.sqrt(np.mean(rel**2))))


def _require_columns(frame: pd.DataFrame, columns: set[str]) -> None:
    """Raise ValueError naming the `columns` (of `allreduce_frame`) that `frame` lacks."""
    missing = columns - set(frame.columns)
    if missing:
        raise ValueError(f"frame: expected allreduce_frame columns, missing {sorted(missing)}")


def calibrate_backends(frame: pd.DataFrame) -> pd.DataFrame:
    """`calibrate` per backend of allreduce rows (columns provider, nbytes, p50_ms, world_size; one run
    per backend): one line each with backend, ranks, alpha_us, bw_gbps and rel_rms. Backends with
    fewer than 2 sizes are left out (a line cannot be fitted to one point)."""
    import pandas as pd

    _require_columns(frame, {"provider", "nbytes", "p50_ms", "world_size"})
    lines = []
    for backend, rows in frame.groupby("provider"):
        if len(rows) < 2:
            continue
        n = int(rows["world_size"].iloc[0])
        fit = calibrate(rows["nbytes"], rows["p50_ms"] / 1e3, n=n)
        lines.append(
            {
                "backend": backend,
                "ranks": n,
                "alpha_us": fit.alpha_us,
                "bw_gbps": fit.bw_gbps,
                "rel_rms": fit.rel_rms,
            }
        )
    return pd.DataFrame(lines, columns=["backend", "ranks", "alpha_us", "bw_gbps", "rel_rms"])


def model_comparison(frame: pd.DataFrame, models: dict[str, ClusterSpec]) -> pd.DataFrame:
    """Measured allreduce times next to each model's prediction: one line per row of `frame` (columns
    provider, nbytes, p50_ms) with backend, nbytes, measured_ms and one `<label>_ms` column per entry
    of `models` (`predict` of that spec for the row's backend and size)."""
    import pandas as pd

    _require_columns(frame, {"provider", "nbytes", "p50_ms"})
    table = pd.DataFrame(
        {
            "backend": frame["provider"].to_numpy(),
            "nbytes": frame["nbytes"].to_numpy(dtype=np.int64),
            "measured_ms": frame["p50_ms"].to_numpy(dtype=float),
        }
    )
    for label, spec in models.items():
        table[f"{label}_ms"] = [
            predict(spec, s, b) * 1e3 for s, b in zip(table["nbytes"], table["backend"], strict=True)
        ]
    return table


def _nonneg_lstsq(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0, exactly: the best unconstrained fit over the subsets of
    columns whose coefficients all come out >= 0 (a handful of columns here); zeros if none does."""
    n = design.shape[1]
    best, best_err = np.zeros(n), float(np.sum(target**2))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            x, *_ = np.linalg.lstsq(design[:, cols], target, rcond=None)
            err = float(np.sum((design[:, cols] @ x - target) ** 2))
            if np.all(x >= 0) and err < best_err:
                best, best_err = np.zeros(n), err
                best[list(cols)] = x
    return best


def fit_cluster(spec: ClusterSpec, frame: pd.DataFrame) -> ClusterSpec:
    """`spec` fitted to the nccl and hfreduce times of one single-node run (rows of `allreduce_frame`:
    columns provider, nbytes, p50_ms, world_size).

    The result has the run's shape (`gpus_per_node` = its world size g, `nodes` = 1). nccl rows:
    `calibrate`'s ring fit sets `alpha_us` and the ring hop (`nvlink_gbps`, or `p2p_gbps` without
    NVLink). hfreduce rows: with the model's chunking (`chunks` chunks of c = S/chunks bytes) and the
    host reduce stage the slowest, the pipeline takes T = d2h + h2d + chunks·(L + (g+1)·c/H), so
    T − (d2h + h2d) = chunks·L + (g+1)·S/H, linear in L and 1/H: a non-negative least-squares fit on
    relative errors sets `chunk_overhead_us` = L and an effective `host_mem_gbps` = H (the host sum's
    rate as hfreduce reaches it); `pcie_gbps` and the NIC are kept from `spec`. `notes` gives the
    source and each backend's rms relative error of the fitted spec's `predict` (which also covers
    sizes where the reduce stage turns out not to be the slowest; their count is noted). Both backends
    must be present with >= 3 sizes: a spec fitted on one alone would mix measured and assumed rates.
    Where the hfreduce rows carry the stage rates measured in the same run (`extra["stage_rates"]`,
    a `StageRates` dict), those set the copy and host-sum rates (`with_stage_rates`) and only the
    per-chunk cost L is fitted.
    """
    _require_columns(frame, {"provider", "nbytes", "p50_ms", "world_size"})
    worlds = frame["world_size"].unique()
    if len(worlds) != 1 or int(worlds[0]) < 2:
        raise ValueError(f"frame: expected one run of >= 2 ranks, got world sizes {list(worlds)}")
    if "extra" in frame and any(e.get("nodes", 1) != 1 for e in frame["extra"]):
        raise ValueError("frame: expected a single-node run, got rows with nodes != 1")
    rows = {b: frame[frame["provider"] == b] for b in ("nccl", "hfreduce")}
    for backend, r in rows.items():
        if r["nbytes"].nunique() < 3:
            raise ValueError(f"frame: expected {backend} rows of >= 3 sizes, got {r['nbytes'].nunique()}")
        if (r["p50_ms"] <= 0).any():
            raise ValueError(f"frame: {backend} times must be positive")
    g = int(worlds[0])
    base = spec.with_(gpus_per_node=g, nodes=1, chunk_overhead_us=0.0)
    rates = measured_stage_rates(rows["hfreduce"])
    if rates is not None:
        if rates.local_ranks != g:
            raise ValueError(f"frame: expected stage rates of {g} local ranks, got {rates.local_ranks}")
        base = with_stage_rates(base, rates)

    def measured(backend: str) -> tuple[np.ndarray, np.ndarray]:  # sizes (bytes), times (s)
        return rows[backend]["nbytes"].to_numpy(float), rows[backend]["p50_ms"].to_numpy(float) / 1e3

    ring = calibrate(*measured("nccl"), n=g)
    link = "nvlink_gbps" if spec.nvlink_gbps is not None else "p2p_gbps"

    sizes, times = measured("hfreduce")
    chunks, chunk = np.array([_chunking(base, s) for s in sizes]).T
    copies = np.array([(st := hfreduce_stages(base, c))["d2h"] + st["h2d"] for c in chunk])
    # Columns in µs per chunk and s per GB, so that the coefficients are L (µs) and 1/H (1/(GB/s)).
    design = np.stack([chunks * 1e-6, (g + 1) * sizes / GB], axis=1) / times[:, None]
    if rates is None:
        overhead_us, inv_host = _nonneg_lstsq(design, (times - copies) / times)
        host_mem_gbps = 1.0 / max(float(inv_host), 1e-9)
    else:  # the host rate is measured: fit L alone
        host_mem_gbps = base.host_mem_gbps
        summed = (g + 1) * sizes / (host_mem_gbps * GB)
        (overhead_us,) = _nonneg_lstsq(design[:, :1], (times - copies - summed) / times)
    fitted = base.with_(
        alpha_us=ring.alpha_us,
        chunk_overhead_us=float(overhead_us),
        host_mem_gbps=host_mem_gbps,
        **{link: ring.bw_gbps},
    )

    def rms(backend: str) -> float:
        sizes, times = measured(backend)
        pred = np.array([predict(fitted, s, backend) for s in sizes])
        return float(np.sqrt(np.mean((pred / times - 1) ** 2)))

    stages = [hfreduce_stages(fitted, c) for c in chunk]
    not_slowest = sum(st["reduce"] < max(st.values()) for st in stages)
    gpu = f"{frame['gpu'].iloc[0]} " if "gpu" in frame else ""
    when = f" of {frame['timestamp'].iloc[0]}" if "timestamp" in frame else ""
    if rates is None:
        source = "pcie_gbps and nic_gbps from the spec"
    else:
        source = f"{'copy and ' if rates.cuda else ''}host-sum rates measured in the run"
    notes = (
        f"fit_cluster of {spec.name!r} to a {g}× {gpu}allreduce run{when}: rms relative error "
        f"nccl {rms('nccl'):.1%}, hfreduce {rms('hfreduce'):.1%}; {source}"
    )
    if not_slowest:
        notes += f"; the reduce stage is not the slowest at {not_slowest} of {len(sizes)} hfreduce sizes"
    return fitted.with_(name=f"{g}× {gpu}(fitted)", notes=notes)


def measured_stage_rates(frame: pd.DataFrame) -> StageRates | None:
    """The `StageRates` in the `extra` of a run's hfreduce allreduce rows (columns provider, extra and,
    where present, nbytes, as `allreduce_frame` gives them): the comms benchmark measures them at each
    size, and those of the largest size are returned. None where the rows have none (results from
    before the rates were recorded)."""
    if "extra" not in frame or "provider" not in frame:
        return None
    rows = frame[frame["provider"] == "hfreduce"]
    if "nbytes" in rows:
        rows = rows.sort_values("nbytes", ascending=False)
    for extra in rows["extra"]:
        if isinstance(extra, dict) and extra.get("stage_rates"):
            return StageRates.from_dict(extra["stage_rates"])
    return None


def bound_comparison(frame: pd.DataFrame) -> pd.DataFrame:
    """hfreduce's measured time beside the bound measured in the same run, per size: one line per
    hfreduce row of `frame` (`allreduce_frame` columns provider, nbytes, p50_ms, extra) whose `extra`
    has a bound, with backend ("hfreduce"), nbytes, measured_ms, bound_ms, bound_fraction (bound over
    measured: 1 = at the bound), path (small | pipelined), and gloo_ms where the run has gloo at that
    size. Empty (those columns) when no row has a bound."""
    import pandas as pd

    _require_columns(frame, {"provider", "nbytes", "p50_ms", "extra"})
    columns = ["backend", "nbytes", "measured_ms", "bound_ms", "bound_fraction", "path", "gloo_ms"]
    gloo_rows = frame[frame["provider"] == "gloo"]
    gloo = dict(zip(gloo_rows["nbytes"].astype(int), gloo_rows["p50_ms"].astype(float), strict=True))
    lines = [
        {
            "backend": "hfreduce",
            "nbytes": int(r.nbytes),
            "measured_ms": float(r.p50_ms),
            "bound_ms": float(r.extra["bound_ms"]),
            "bound_fraction": float(r.extra["bound_fraction"]),
            "path": r.extra.get("path"),
            "gloo_ms": gloo.get(int(r.nbytes), float("nan")),
        }
        for r in frame[frame["provider"] == "hfreduce"].itertuples()
        if isinstance(r.extra, dict) and "bound_ms" in r.extra
    ]
    return pd.DataFrame(lines, columns=columns).sort_values("nbytes", ignore_index=True)


def seed_comparison(params: int = AF2_PARAMS, bucket_mb: float = 25.0) -> pd.DataFrame:
    """Model against seed: 93.2M fp32 gradients on 16 nodes × 8 A100 PCIe, NCCL ring vs hfreduce.

    Mapping: DDP overlaps bucket allreduces with backward, so the measured overhead (backward+sync −
    backward alone) lies between the last bucket's allreduce (`exposed_min_s`: everything else hidden)
    and the whole allreduce (`allreduce_s`: nothing hidden), plus waiting on slower ranks, which no
    backend removes. That waiting is common to both backends, so the *difference* NCCL − hfreduce is
    the comparable number (`saving_s`: model vs the seed's 0.40 − 0.28 = 0.12 s). With NVLink (H200
    preset, same shape) the ordering flips; both clusters are in the table.
    """
    import pandas as pd

    nbytes = params * 4
    bucket = min(nbytes, bucket_mb * (1 << 20))
    rows = []
    for spec in (a100_pcie_fireflyer(16), h200_nvlink(16)):
        times = {b: predict(spec, nbytes, b) for b in ("nccl", "hfreduce")}
        for backend, t in times.items():
            measured = SEED_MEASURED[backend] if spec.nvlink_gbps is None else None
            rows.append(
                {
                    "cluster": spec.name,
                    "gpus": spec.world_size,
                    "backend": backend,
                    "allreduce_s": t,
                    "exposed_min_s": predict(spec, bucket, backend),
                    "busbw_gbps": busbw(nbytes, t, spec.world_size),
                    "saving_s": times["nccl"] - times["hfreduce"],
                    "seed_overhead_s": measured,
                    "seed_saving_s": SEED_MEASURED["nccl"] - SEED_MEASURED["hfreduce"]
                    if measured is not None
                    else None,
                }
            )
    return pd.DataFrame(rows)


def busbw(nbytes: float, seconds: float, n: int) -> float:
    """nccl-tests' bus bandwidth of an allreduce in GB/s: S/t · 2(n-1)/n."""
    if seconds <= 0:
        return float("nan")
    return nbytes / seconds / GB * 2 * (n - 1) / n
