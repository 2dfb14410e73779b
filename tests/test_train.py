"""hfkit.train: synthetic batches match the feature schema, AlphaFold's lr schedule, gradient clipping,
timed phases, and a few steps lowering the loss (synthetic features, and real 2q2k features where
OpenFold's test data is present)."""

from __future__ import annotations

import math

import pytest
import torch

from hfkit.data.dataset import collate_fixed
from hfkit.data.msa_sampling import feature_shapes
from hfkit.model import AlphaFoldLite, ModelConfig
from hfkit.train import (
    PHASES,
    lr_schedule,
    make_optimizer,
    make_scheduler,
    synthetic_batch,
    train,
    train_step,
)

TINY = ModelConfig.tiny()


pytestmark = pytest.mark.usefixtures("one_thread")


def eval_loss(model: AlphaFoldLite, batch: dict) -> float:
    model.eval()
    with torch.no_grad():
        return float(model.loss(batch, model(batch))[0])


def test_synthetic_batch_matches_feature_schema() -> None:
    batch = synthetic_batch(TINY, batch_size=2, seed=3)
    shapes = feature_shapes(TINY.feature_config())
    assert set(batch) == set(shapes)
    for key, shape in shapes.items():
        assert batch[key].shape == (2, *shape), key
    assert batch["aatype"].dtype == torch.int64 and batch["msa_feat"].dtype == torch.float32
    assert torch.equal(batch["target_feat"].sum(-1), torch.ones(2, TINY.crop_size))
    again = synthetic_batch(TINY, batch_size=2, seed=3)
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    with pytest.raises(ValueError, match="batch_size"):
        synthetic_batch(TINY, batch_size=0)


def test_lr_schedule_warmup_constant_decay() -> None:
    assert lr_schedule(0) == 0.0
    assert lr_schedule(500) == pytest.approx(5e-4)
    assert lr_schedule(1000) == pytest.approx(1e-3)
    assert lr_schedule(1001) == lr_schedule(50000) == pytest.approx(1e-3)
    assert lr_schedule(50001) == pytest.approx(0.95e-3)
    assert lr_schedule(100000) == pytest.approx(0.95e-3)
    assert lr_schedule(100001) == pytest.approx(0.95**2 * 1e-3)
    assert lr_schedule(10, base_lr=1.0, warmup=0) == 1.0
    with pytest.raises(ValueError, match="step"):
        lr_schedule(-1)
    model = torch.nn.Linear(2, 2)
    opt = make_optimizer(model, lr=2e-3)
    assert opt.defaults["betas"] == (0.9, 0.999) and opt.defaults["eps"] == 1e-6
    sched = make_scheduler(opt, warmup=4)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 1.5e-3, 2e-3, 2e-3])


def test_train_step_clips_global_grad_norm_and_times_phases() -> None:
    torch.manual_seed(0)
    model = AlphaFoldLite(TINY)
    batch = synthetic_batch(TINY)
    opt = make_optimizer(model)
    out = train_step(model, batch, opt, clip=0.1)
    norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
    )
    assert out["grad_norm"] > 0.1  # the clip was active
    assert float(norm) <= 0.1 * (1 + 1e-4)
    assert set(out["parts"]) == {"distogram", "masked_msa"}
    assert math.isfinite(out["loss"])
    assert set(out["timings"]) == {"forward", "backward", "optimizer"}


def test_train_lowers_loss_on_synthetic_batch() -> None:
    torch.manual_seed(0)
    model = AlphaFoldLite(TINY)
    batch = synthetic_batch(TINY, seed=1)
    first = eval_loss(model, batch)
    opt = make_optimizer(model, lr=3e-3)
    records = train(model, [batch], 6, optimizer=opt, scheduler=None, progress=False)
    last = eval_loss(model, batch)
    assert last < first - 0.05, (first, last)
    assert len(records) == 6
    for record in records:
        assert tuple(record["timings"]) == PHASES
        assert all(t > 0 for t in record["timings"].values()), record["timings"]
    assert records[-1]["loss"] < records[0]["loss"]


def test_train_defaults_synthetic_data_and_schedule() -> None:
    torch.manual_seed(0)
    model = AlphaFoldLite(TINY)
    records = train(model, None, 2, progress=True)
    assert [r["lr"] for r in records] == pytest.approx([0.0, 1e-6])  # AlphaFold's warm-up
    with pytest.raises(ValueError, match="autocast_dtype"):
        train(model, None, 1, autocast_dtype=torch.float32, progress=False)


def test_train_bf16_autocast_runs() -> None:
    torch.manual_seed(0)
    model = AlphaFoldLite(TINY)
    records = train(model, None, 1, autocast_dtype=torch.bfloat16, progress=False)
    assert math.isfinite(records[0]["loss"])


def test_real_2q2k_train_lowers_loss() -> None:
    from test_model import real_2q2k_sample

    sample = real_2q2k_sample()
    if sample is None:
        pytest.skip("OpenFold test data (2q2k) not found; see hfkit.data.openfold_test_data_dir")
    batch = collate_fixed([sample])
    torch.manual_seed(0)
    model = AlphaFoldLite(TINY)
    first = eval_loss(model, batch)
    records = train(model, [batch], 8, optimizer=make_optimizer(model, lr=3e-3), progress=False)
    last = eval_loss(model, batch)
    assert last < first - 0.05, (first, last)
    assert set(records[-1]["parts"]) == {"distogram", "masked_msa"}
