"""Tests of the allreduce cost model: the ring formula, monotonicity, the seed's ordering, calibration,
and the fit of a spec to measured runs (synthetic, and the committed H200 results)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from hfkit.parallel.cost_model import (
    AF2_PARAMS,
    ClusterSpec,
    StageRates,
    a100_pcie_fireflyer,
    best_chunk_bytes,
    busbw,
    calibrate,
    calibrate_backends,
    fit_cluster,
    h200_nvlink,
    hfreduce_bound,
    hfreduce_stages,
    model_comparison,
    predict,
    ring_allreduce_time,
    seed_comparison,
    with_stage_rates,
)

SEED_BYTES = AF2_PARAMS * 4
H200X2 = Path(__file__).resolve().parents[1] / "data" / "results" / "h200x2"
SIZES = [4096 * 4**k for k in range(10)]  # 4 KB .. 1 GB, as the comms benchmark steps


def synthetic_frame(spec: ClusterSpec, noise: float = 0.0, seed: int = 0) -> pd.DataFrame:
    """Allreduce rows (allreduce_frame's columns) of nccl and hfreduce timed by the model itself."""
    rng = np.random.default_rng(seed)
    rows = [
        {
            "provider": b,
            "nbytes": s,
            "p50_ms": predict(spec, s, b) * 1e3 * (1 + noise * rng.standard_normal()),
            "world_size": spec.world_size,
        }
        for b in ("nccl", "hfreduce")
        for s in SIZES
    ]
    return pd.DataFrame(rows)


def rel_errors(spec: ClusterSpec, frame: pd.DataFrame) -> np.ndarray:
    pred = np.array([predict(spec, r["nbytes"], r["provider"]) for _, r in frame.iterrows()])
    return pred / (frame["p50_ms"].to_numpy() / 1e3) - 1


def test_ring_formula_by_hand():
    # n = 4, α = 10 µs, B = 2 GB/s, S = 1e9 B: 2·3·10e-6 + 2·3/4 · 1e9/2e9 = 6e-5 + 0.75.
    assert ring_allreduce_time(1e9, 4, 10.0, 2.0) == pytest.approx(0.75006)
    assert ring_allreduce_time(1e9, 1, 10.0, 2.0) == 0.0


def test_predict_ring_uses_slowest_link():
    spec = ClusterSpec("t", 4, 2, pcie_gbps=20, nvlink_gbps=100, nic_gbps=10, host_mem_gbps=100, alpha_us=1)
    assert predict(spec, 1e8, "nccl") == pytest.approx(ring_allreduce_time(1e8, 8, 1.0, 10.0))
    one_node = spec.with_(nodes=1)  # no NIC in the ring: NVLink bounds it
    assert predict(one_node, 1e8, "ring") == pytest.approx(ring_allreduce_time(1e8, 4, 1.0, 100.0))
    no_nvlink = one_node.with_(nvlink_gbps=None)  # PCIe peer copies bound it
    assert predict(no_nvlink, 1e8, "ring") == pytest.approx(ring_allreduce_time(1e8, 4, 1.0, 20.0))


def test_hfreduce_pipeline_by_hand():
    spec = ClusterSpec(
        "t", 2, 2, pcie_gbps=10, nvlink_gbps=None, nic_gbps=5, host_mem_gbps=30, alpha_us=0, chunk_bytes=10**6
    )
    stages = hfreduce_stages(spec, 1e6)
    assert stages["d2h"] == pytest.approx(1e-4) and stages["h2d"] == pytest.approx(1e-4)
    assert stages["reduce"] == pytest.approx(3e6 / 30e9)
    assert stages["inter"] == pytest.approx(2e6 / 5e9)
    # 4 chunks: the first passes all stages, then 3 more at the slowest (inter) stage.
    expected = sum(stages.values()) + 3 * stages["inter"]
    assert predict(spec, 4e6, "hfreduce") == pytest.approx(expected)


@pytest.mark.parametrize("spec", [a100_pcie_fireflyer(), h200_nvlink()])
@pytest.mark.parametrize("backend", ["nccl", "hfreduce"])
def test_monotone_in_size_and_bandwidth(spec, backend):
    sizes = [2**k for k in range(12, 31, 2)]
    times = [predict(spec, s, backend) for s in sizes]
    assert all(b >= a for a, b in zip(times, times[1:], strict=False))
    faster = spec.with_(nic_gbps=spec.nic_gbps * 2, pcie_gbps=spec.pcie_gbps * 2)
    assert predict(faster, 1 << 28, backend) <= predict(spec, 1 << 28, backend)
    assert predict(spec.with_(nodes=1, gpus_per_node=1), 1 << 20, backend) == 0.0


def test_seed_ordering():
    pcie, nvl = a100_pcie_fireflyer(16), h200_nvlink(16)
    assert pcie.world_size == 128
    assert predict(pcie, SEED_BYTES, "hfreduce") < predict(pcie, SEED_BYTES, "nccl")
    assert predict(nvl, SEED_BYTES, "nccl") < predict(nvl, SEED_BYTES, "hfreduce")
    table = seed_comparison()
    a100 = table[table["seed_overhead_s"].notna()].set_index("backend")
    assert a100.loc["nccl", "seed_overhead_s"] == 0.40 and a100.loc["hfreduce", "seed_overhead_s"] == 0.28
    # The model's raw allreduce time bounds what DDP exposes; the saving has the seed's sign.
    assert (a100["exposed_min_s"] <= a100["allreduce_s"]).all()
    assert a100.loc["nccl", "saving_s"] > 0


def test_calibrate_recovers_alpha_and_bandwidth():
    rng = np.random.default_rng(0)
    sizes = np.array([2.0**k for k in range(12, 27, 2)])
    true = [ring_allreduce_time(s, 2, 50.0, 3.0) for s in sizes]
    noisy = np.array(true) * (1 + 0.01 * rng.standard_normal(len(sizes)))
    fit = calibrate(sizes, noisy, n=2)
    assert fit.alpha_us == pytest.approx(50.0, rel=0.05)
    assert fit.bw_gbps == pytest.approx(3.0, rel=0.05)
    assert fit.rel_rms < 0.03
    assert fit.predict(1 << 20) == pytest.approx(ring_allreduce_time(1 << 20, 2, fit.alpha_us, fit.bw_gbps))
    with pytest.raises(ValueError):
        calibrate([1.0], [1.0], n=2)


def test_busbw_and_bad_inputs():
    assert busbw(1e9, 1.0, 2) == pytest.approx(1.0)
    assert busbw(1e9, 1.0, 8) == pytest.approx(1.75)
    assert math.isnan(busbw(1.0, 0.0, 2))
    with pytest.raises(ValueError):
        predict(a100_pcie_fireflyer(), 1.0, "mpi")
    with pytest.raises(ValueError):
        a100_pcie_fireflyer().with_(nic_gbps=0)


def test_chunk_overhead_zero_leaves_predictions_unchanged():
    assert a100_pcie_fireflyer().chunk_overhead_us == 0 and h200_nvlink().chunk_overhead_us == 0
    # Values of the model before the field existed.
    assert predict(h200_nvlink(1).with_(gpus_per_node=2), 1 << 30, "hfreduce") == pytest.approx(0.0431454071)
    assert predict(a100_pcie_fireflyer(), SEED_BYTES, "hfreduce") == pytest.approx(0.0400121179)
    # A per-chunk cost lands in the reduce stage only, and leaves the ring alone.
    spec = h200_nvlink(2)
    slow = spec.with_(chunk_overhead_us=250.0)
    stages, slow_stages = hfreduce_stages(spec, 1 << 20), hfreduce_stages(slow, 1 << 20)
    assert slow_stages["reduce"] == pytest.approx(stages["reduce"] + 250e-6)
    assert {k: v for k, v in slow_stages.items() if k != "reduce"} == {
        k: v for k, v in stages.items() if k != "reduce"
    }
    assert predict(slow, 1 << 30, "nccl") == predict(spec, 1 << 30, "nccl")
    # With 4 MiB chunks reduce is then the slowest stage: each of the 256 chunks of 1 GiB pays it.
    st = hfreduce_stages(slow, 1 << 22)
    assert st["reduce"] == max(st.values())
    expected = st["d2h"] + st["h2d"] + st["inter"] + 256 * st["reduce"]
    assert predict(slow, 1 << 30, "hfreduce") == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("spec", [h200_nvlink(1), a100_pcie_fireflyer(1)], ids=["nvlink", "pcie"])
@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_fit_cluster_recovers_known_parameters(spec, noise):
    link = "nvlink_gbps" if spec.nvlink_gbps is not None else "p2p_gbps"
    true = spec.with_(
        gpus_per_node=4, alpha_us=12.0, chunk_overhead_us=400.0, host_mem_gbps=15.0, **{link: 120.0}
    )
    fitted = fit_cluster(spec, synthetic_frame(true, noise))
    rel = 1e-6 if noise == 0 else 0.1
    assert (fitted.gpus_per_node, fitted.nodes) == (4, 1)
    assert fitted.alpha_us == pytest.approx(12.0, rel=rel)
    assert getattr(fitted, link) == pytest.approx(120.0, rel=rel)
    assert fitted.chunk_overhead_us == pytest.approx(400.0, rel=rel)
    assert fitted.host_mem_gbps == pytest.approx(15.0, rel=rel)
    assert fitted.pcie_gbps == spec.pcie_gbps and fitted.nic_gbps == spec.nic_gbps
    assert "rms relative error nccl" in fitted.notes and "not the slowest" not in fitted.notes


def test_fit_cluster_keeps_parameters_non_negative():
    # Times with no per-chunk cost at all: the fit puts L at 0, not below.
    true = h200_nvlink(1).with_(gpus_per_node=2, host_mem_gbps=5.0)
    fitted = fit_cluster(h200_nvlink(1), synthetic_frame(true, noise=0.03, seed=1))
    assert fitted.chunk_overhead_us >= 0 and fitted.host_mem_gbps > 0


def test_fit_cluster_and_spec_validation_name_the_argument():
    with pytest.raises(ValueError, match="chunk_overhead_us"):
        h200_nvlink().with_(chunk_overhead_us=-1.0)
    frame = synthetic_frame(h200_nvlink(1).with_(gpus_per_node=2))
    with pytest.raises(ValueError, match="frame: expected hfreduce rows of >= 3 sizes"):
        fit_cluster(h200_nvlink(), frame[frame["provider"] == "nccl"])
    with pytest.raises(ValueError, match="frame: expected nccl rows of >= 3 sizes, got 2"):
        fit_cluster(h200_nvlink(), frame[(frame["provider"] == "hfreduce") | (frame["nbytes"] < 50_000)])
    with pytest.raises(ValueError, match="frame: expected one run"):
        fit_cluster(h200_nvlink(), frame.assign(world_size=[2, 4] * (len(frame) // 2)))
    with pytest.raises(ValueError, match="frame: expected allreduce_frame columns"):
        fit_cluster(h200_nvlink(), frame.drop(columns="p50_ms"))


def test_fitted_presets_empty_without_results(tmp_path):
    from hfkit.viz.comms import fitted_presets

    assert fitted_presets(tmp_path) == {}


@pytest.mark.skipif(not (H200X2 / "comms.json").exists(), reason="no committed h200x2 results")
def test_fit_cluster_predicts_committed_h200_results():
    from hfkit.bench.comms import load_comms_results
    from hfkit.viz.comms import allreduce_frame

    frame = allreduce_frame(load_comms_results(H200X2))
    fitted = fit_cluster(h200_nvlink(1), frame)
    # The fitted model reproduces every measured nccl and hfreduce time: rms within 30%, each within 40%.
    for backend in ("nccl", "hfreduce"):
        err = rel_errors(fitted, frame[frame["provider"] == backend])
        assert np.sqrt(np.mean(err**2)) < 0.3 and np.abs(err).max() < 0.4, (backend, err)
    # The link-spec model misses hfreduce by ~7x at 1 GiB; the fit puts that into a per-chunk cost.
    gib = frame[(frame["provider"] == "hfreduce") & (frame["nbytes"] == 1 << 30)]["p50_ms"].iloc[0] / 1e3
    assert gib > 5 * predict(h200_nvlink(1).with_(gpus_per_node=2), 1 << 30, "hfreduce")
    assert fitted.chunk_overhead_us > 100
    assert all(predict(fitted, s, "nccl") < predict(fitted, s, "hfreduce") for s in SIZES)
    # The panel offers the fitted cluster as a preset at 16 nodes × 8 GPUs.
    from hfkit.viz.comms import CostModelPanel

    panel = CostModelPanel()
    table = panel.update("H200 NVLink (fitted to h200x2)").set_index("backend")
    assert (table["gpus"] == 128).all() and table.loc["nccl", "allreduce_ms"] < table.loc[
        "hfreduce", "allreduce_ms"
    ]


def test_calibrate_backends_recovers_each_backends_ring_parameters():
    sizes = SIZES[:6]
    frame = pd.DataFrame(
        [
            {
                "provider": b,
                "nbytes": s,
                "p50_ms": ring_allreduce_time(s, 4, alpha, bw) * 1e3,
                "world_size": 4,
            }
            for b, alpha, bw in (("gloo", 50.0, 2.0), ("nccl", 5.0, 100.0))
            for s in sizes
        ]
        + [{"provider": "hfreduce", "nbytes": 4096, "p50_ms": 1.0, "world_size": 4}]  # one size: left out
    )
    table = calibrate_backends(frame).set_index("backend")
    assert list(table.index) == ["gloo", "nccl"] and (table["ranks"] == 4).all()
    assert table.loc["gloo", "alpha_us"] == pytest.approx(50.0, rel=1e-6)
    assert table.loc["nccl", "bw_gbps"] == pytest.approx(100.0, rel=1e-6)
    assert (table["rel_rms"] < 1e-9).all()
    with pytest.raises(
        ValueError, match="frame: expected allreduce_frame columns, missing \\['world_size'\\]"
    ):
        calibrate_backends(frame.drop(columns="world_size"))


def test_model_comparison_sets_each_models_prediction_beside_the_measurement():
    spec = h200_nvlink(1).with_(gpus_per_node=2)
    frame = synthetic_frame(spec)
    slower = spec.with_(nvlink_gbps=spec.nvlink_gbps / 2)
    table = model_comparison(frame, {"same": spec, "slower": slower})
    assert list(table.columns) == ["backend", "nbytes", "measured_ms", "same_ms", "slower_ms"]
    assert np.allclose(table["same_ms"], table["measured_ms"])  # the spec that made the rows predicts them
    nccl = table[table["backend"] == "nccl"]
    assert (nccl["slower_ms"] > nccl["same_ms"]).all()
    with pytest.raises(ValueError, match="frame: expected allreduce_frame columns"):
        model_comparison(frame.drop(columns="p50_ms"), {"same": spec})


# The H200 host: copies at 55 GB/s each way, ~103 GB/s both at once; 2 ranks with 8 cores each.
H200_RATES = StageRates(
    local_ranks=2, threads=8, host_sum_gbps=85.0, host_copy_gbps=60.0,
    d2h_alone_gbps=55.3, h2d_alone_gbps=55.4, d2h_all_gbps=50.0, h2d_all_gbps=40.0, bidir_all_gbps=80.0,
)  # fmt: skip


def test_hfreduce_bound_by_hand():
    r = H200_RATES
    c = 4 << 20
    # 64 MiB on CUDA: 16 chunks; per chunk d2h = c/50, h2d = c/40, both at once 2c/80 = c/40 -> copy c/40;
    # the sum of a 1/2 slice reads 2 halves and writes one: 3·(c/2)/85 = c/56.7 -> the copy bounds.
    d2h, h2d, summed = c / 50e9, c / 40e9, 3 * (c / 2) / 85e9
    expected = d2h + summed + h2d + 15 * max(c / 40e9, summed)
    assert hfreduce_bound(64 << 20, r, chunk_bytes=c) == pytest.approx(expected, rel=1e-12)
    # With a slow host sum the sum bounds instead.
    slow = StageRates(**{**r.as_dict(), "host_sum_gbps": 10.0})
    slow_sum = 3 * (c / 2) / 10e9
    assert hfreduce_bound(64 << 20, slow, chunk_bytes=c) == pytest.approx(
        d2h + slow_sum + h2d + 15 * slow_sum, rel=1e-12
    )
    # A message below one chunk: no overlap, d2h + sum + h2d; the small path sums the whole message.
    s = 1 << 20
    assert hfreduce_bound(s, r, chunk_bytes=c, small_bytes=0) == pytest.approx(
        s / 50e9 + 3 * s / 2 / 85e9 + s / 40e9
    )
    assert hfreduce_bound(s, r, chunk_bytes=c, small_bytes=s) == pytest.approx(
        s / 50e9 + 3 * s / 85e9 + s / 40e9
    )
    # CPU tensors: copies in and out (2 bytes of traffic each) and the sum share the cores.
    cpu = StageRates(local_ranks=2, threads=1, host_sum_gbps=12.0, host_copy_gbps=10.0)
    assert not cpu.cuda and r.cuda
    big = 64 << 20
    assert hfreduce_bound(big, cpu, cuda=False) == pytest.approx(4 * big / 10e9 + 3 * big / 2 / 12e9)
    assert hfreduce_bound(0, cpu, cuda=False) == 0.0
    with pytest.raises(ValueError, match="rates: expected device copy rates"):
        hfreduce_bound(big, cpu, cuda=True)
    with pytest.raises(ValueError, match="nbytes: expected >= 0"):
        hfreduce_bound(-1, cpu, cuda=False)


def test_hfreduce_bound_grows_with_size_and_falls_with_rates():
    sizes = [4 << 10 << 2 * k for k in range(10)]
    bounds = [hfreduce_bound(s, H200_RATES) for s in sizes]
    assert all(b > a for a, b in zip(bounds, bounds[1:], strict=False))
    faster = StageRates(**{**H200_RATES.as_dict(), "h2d_all_gbps": 50.0, "bidir_all_gbps": 100.0})
    assert hfreduce_bound(1 << 30, faster) < hfreduce_bound(1 << 30, H200_RATES)


def test_stage_rates_validation_and_round_trip():
    assert StageRates.from_dict({**H200_RATES.as_dict(), "unknown": 1}) == H200_RATES
    with pytest.raises(ValueError, match="StageRates.host_sum_gbps: expected a positive rate"):
        StageRates(local_ranks=2, threads=1, host_sum_gbps=0.0, host_copy_gbps=1.0)
    with pytest.raises(ValueError, match="local_ranks and threads >= 1"):
        StageRates(local_ranks=0, threads=1, host_sum_gbps=1.0, host_copy_gbps=1.0)


def test_with_stage_rates_sets_the_measured_rates():
    spec = with_stage_rates(h200_nvlink(1), H200_RATES)
    assert spec.gpus_per_node == 2 and spec.gpus_per_pcie_switch == 1
    assert spec.pcie_gbps == 50.0 and spec.h2d_gbps == 40.0 and spec.host_mem_gbps == 170.0
    st = hfreduce_stages(spec, 1e6)
    assert st["d2h"] == pytest.approx(1e6 / 50e9) and st["h2d"] == pytest.approx(1e6 / 40e9)
    # The model's node-wide reduce stage equals one rank's slice at the measured per-rank rate.
    assert st["reduce"] == pytest.approx(3 * (1e6 / 2) / 85e9)
    cpu = StageRates(local_ranks=2, threads=1, host_sum_gbps=12.0, host_copy_gbps=10.0)
    assert with_stage_rates(h200_nvlink(1), cpu).pcie_gbps == h200_nvlink(1).pcie_gbps


def test_fit_cluster_with_measured_stage_rates_fits_only_the_chunk_cost():
    true = with_stage_rates(h200_nvlink(1), H200_RATES).with_(alpha_us=8.0, chunk_overhead_us=150.0)
    frame = synthetic_frame(true)
    frame["extra"] = [
        {"stage_rates": H200_RATES.as_dict()} if p == "hfreduce" else {} for p in frame["provider"]
    ]
    fitted = fit_cluster(h200_nvlink(1), frame)
    assert fitted.host_mem_gbps == pytest.approx(170.0) and fitted.pcie_gbps == 50.0
    assert fitted.h2d_gbps == 40.0
    # The reduce stage is the slowest at every size here, so the fit recovers L exactly.
    assert fitted.chunk_overhead_us == pytest.approx(150.0, rel=1e-6)
    assert "copy and host-sum rates measured in the run" in fitted.notes
    bad = frame.assign(world_size=4)
    with pytest.raises(ValueError, match="frame: expected stage rates of 4 local ranks, got 2"):
        fit_cluster(h200_nvlink(1), bad)


def test_best_chunk_bytes_trades_fill_against_per_chunk_cost():
    gib = 1 << 30
    # No per-chunk cost: the smallest chunk (the shortest fill) wins.
    assert best_chunk_bytes(gib, H200_RATES, 0.0) == 1 << 18
    # A per-chunk cost moves the optimum up; a larger cost, further up.
    mid, high = best_chunk_bytes(gib, H200_RATES, 50.0), best_chunk_bytes(gib, H200_RATES, 2000.0)
    assert (1 << 18) < mid < high

    # The choice is the argmin over the candidates of bound + chunks·overhead.
    def cost(c: int, overhead_us: float = 50.0) -> float:
        return hfreduce_bound(gib, H200_RATES, c, small_bytes=0) + math.ceil(gib / c) * overhead_us * 1e-6

    assert all(cost(mid) <= cost(1 << k) for k in range(18, 27))
    assert best_chunk_bytes(gib, H200_RATES, 50.0, candidates=[4 << 20]) == 4 << 20
    with pytest.raises(ValueError, match="chunk_overhead_us: expected >= 0"):
        best_chunk_bytes(gib, H200_RATES, -1.0)
