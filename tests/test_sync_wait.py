"""The synchronous-DDP waiting model and the Evoformer FLOP estimate behind notebook 01."""

import numpy as np
import pytest

from hfkit.viz.sync_wait import evoformer_flops, lognormal_lengths, sync_wait


def test_flops_match_the_issue_estimate_and_grow_with_size():
    # One block at (S, N) = (128, 256), forward+backward ~ 3x forward: about 0.6 TFLOP.
    assert 0.5e12 < 3 * evoformer_flops(256, 128) < 0.7e12
    sizes = np.array([64, 128, 256, 512])
    f = evoformer_flops(sizes, 128)
    assert np.all(np.diff(f) > 0)
    # The triangle terms make the pair stack cubic: doubling N more than quadruples the cost at large N.
    assert evoformer_flops(1024, 128) / evoformer_flops(512, 128) > 4


def test_one_rank_or_equal_costs_waste_nothing():
    rng = np.random.default_rng(0)
    costs = rng.uniform(1, 10, size=100)
    assert sync_wait(costs, 1, 500, rng).wasted_fraction == pytest.approx(0.0, abs=1e-12)
    assert sync_wait(np.full(10, 3.0), 64, 100, rng).wasted_fraction == pytest.approx(0.0, abs=1e-12)


def test_waste_grows_with_ranks_and_cropping_bounds_it():
    rng = np.random.default_rng(1)
    lengths = lognormal_lengths(5000, rng)
    uncropped = evoformer_flops(lengths, 128)
    cropped = evoformer_flops(np.minimum(lengths, 256), 128)
    w = [sync_wait(uncropped, p, 400, rng).wasted_fraction for p in (2, 8, 64)]
    assert w[0] < w[1] < w[2]
    assert sync_wait(cropped, 64, 400, rng).wasted_fraction < w[2]
    assert sync_wait(cropped, 64, 400, rng).mean_step <= evoformer_flops(256, 128) * (1 + 1e-12)


def test_bad_arguments():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="costs"):
        sync_wait(np.array([]), 2, 10, rng)
    with pytest.raises(ValueError, match="ranks"):
        sync_wait(np.ones(3), 0, 10, rng)
