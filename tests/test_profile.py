"""hfkit.bench.profile on the CPU: the operator table of a tiny-model step and the LayerNorm
input-shape census (torch's op, and hfkit's after `to_hfkit`), with the per-shape speed table."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hfkit
from hfkit.bench.profile import census_speed, layer_norm_census, op_table, profile_step
from hfkit.model import AlphaFoldLite, ModelConfig
from hfkit.train import synthetic_batch

TINY = ModelConfig.tiny()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_and_batch():
    torch.manual_seed(0)
    return AlphaFoldLite(TINY).eval(), synthetic_batch(TINY)


def expected_layer_norm_shapes(c: ModelConfig, batch: int = 1) -> set[tuple[int, ...]]:
    """The inputs LayerNorm sees in the tiny model: pair [B, N, N, c_z], MSA [B, S, N, c_m], extra
    MSA [B, E, N, c_e], and the column-wise (transposed) MSA and extra MSA [B, N, S, c_m], [B, N, E, c_e]."""
    n, s, e = c.crop_size, c.max_msa_clusters, c.max_extra_msa
    return {
        (batch, n, n, c.c_z),
        (batch, s, n, c.c_m),
        (batch, n, s, c.c_m),
        (batch, e, n, c.c_e),
        (batch, n, e, c.c_e),
    }


def test_op_table_shares_and_layer_norm(model_and_batch) -> None:
    model, batch = model_and_batch

    def step() -> None:
        model.zero_grad(set_to_none=True)
        total, _ = model.loss(batch, model(batch))
        total.backward()

    prof = profile_step(step, "cpu", steps=1, warmup=1)
    table = op_table(prof, top=15)
    assert list(table.columns) == ["name", "calls", "time_ms", "share_pct"]
    assert 0 < len(table) <= 15
    assert (table["share_pct"] > 0).all() and table["share_pct"].sum() <= 100.0 + 1e-6
    assert table["time_ms"].is_monotonic_decreasing
    assert table.attrs["device_time"] == "cpu"
    assert table["name"].str.contains("layer_norm").any()
    full = op_table(prof, top=10_000)
    assert full["share_pct"].sum() == pytest.approx(100.0)


def test_layer_norm_census_shapes(model_and_batch) -> None:
    model, batch = model_and_batch
    prof = profile_step(lambda: model(batch), "cpu", steps=2, warmup=0)
    census = layer_norm_census(prof)
    assert list(census.columns) == ["op", "shape", "calls", "calls_pct", "time_ms", "time_pct"]
    assert set(census["op"]) == {"aten::layer_norm"}
    assert set(census["shape"]) == expected_layer_norm_shapes(TINY)
    assert census["calls_pct"].sum() == pytest.approx(100.0)
    assert census["time_pct"].sum() == pytest.approx(100.0)
    # Two forward passes: every LayerNorm module is called twice.
    n_modules = sum(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    assert census["calls"].sum() == 2 * n_modules
    # The pair representation dominates the calls (c_z LayerNorms in every pair sublayer).
    top = census.sort_values("calls", ascending=False).iloc[0]
    assert top["shape"] == (1, TINY.crop_size, TINY.crop_size, TINY.c_z)
    # From a model and batch directly: the same shapes and calls for one pass.
    direct = layer_norm_census(model, batch)
    assert set(direct["shape"]) == set(census["shape"])
    assert direct["calls"].sum() == n_modules
    with pytest.raises(ValueError, match="batch"):
        layer_norm_census(model)


def test_census_picks_up_hfkit_op_and_speed_table(model_and_batch) -> None:
    model, batch = model_and_batch
    swapped = hfkit.to_hfkit(model, inplace=False, include={"LayerNorm"})
    census = layer_norm_census(swapped, batch)
    if not (census["op"] == "hfkit::layer_norm_fwd").any():
        pytest.skip("hfkit's LayerNorm ran its torch reference (no Triton / TRITON_INTERPRET unset)")
    assert set(census["op"]) == {"hfkit::layer_norm_fwd"}
    assert set(census["shape"]) == expected_layer_norm_shapes(TINY)
    speed = census_speed(census.nsmallest(2, "calls"), "cpu", warmup=0, reps=1)
    assert list(speed.columns) == ["shape", "calls", "torch_ms", "hfkit_ms", "speedup", "saved_ms"]
    assert len(speed) == 2 and (speed["torch_ms"] > 0).all() and (speed["hfkit_ms"] > 0).all()


def test_saved_activations_by_module():
    from hfkit.bench.profile import saved_activations

    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Sequential(nn.Linear(5, 4), nn.Tanh()))
    x = torch.randn(7, 6, requires_grad=True)
    frame = saved_activations(model, lambda: model(x).sum(), depth=2)
    mib = dict(zip(frame["module"], frame["MiB"] * 2**20, strict=True))
    # Linear 0 keeps x (7 x 6 floats); ReLU its output (7 x 5), which Linear 2.0 saves again (counted
    # once); Tanh its output (7 x 4). Parameters are not counted.
    assert mib == {"0": 7 * 6 * 4, "1": 7 * 5 * 4, "2.1": 7 * 4 * 4}
    assert frame["share"].sum() == pytest.approx(1.0) and (frame["tensors"] == 1).all()
    assert list(frame["MiB"]) == sorted(frame["MiB"], reverse=True)
    # Hooks are gone afterwards; depth 1 folds the inner Sequential into "2".
    assert not model[2][0]._forward_pre_hooks
    coarse = saved_activations(model, lambda: model(x).sum(), depth=1)
    assert set(coarse["module"]) == {"0", "1", "2"}
    with pytest.raises(ValueError, match="depth"):
        saved_activations(model, lambda: model(x), depth=0)
