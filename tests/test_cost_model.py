"""Tests of the allreduce cost model: the ring formula, monotonicity, the seed's ordering, calibration."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hfkit.parallel.cost_model import (
    AF2_PARAMS,
    ClusterSpec,
    a100_pcie_fireflyer,
    busbw,
    calibrate,
    h200_nvlink,
    hfreduce_stages,
    predict,
    ring_allreduce_time,
    seed_comparison,
)

SEED_BYTES = AF2_PARAMS * 4


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
