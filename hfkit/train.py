"""Training: AlphaFold's optimiser, learning-rate schedule and gradient clipping, one timed step, a
loop over a DataLoader, and synthetic batches for when no real data is given.

AF2 supplement 1.11.3: Adam (lr 1e-3, β1 0.9, β2 0.999, ε 1e-6); the learning rate rises linearly
from 0 over the first 1000 steps, stays constant, and is multiplied by 0.95 after 50k steps
(OpenFold's `AlphaFoldLRScheduler`: by 0.95 again every further 50k steps); gradients are clipped by
their global norm at 0.1. Each step reports its losses and the time of each phase (data, forward,
backward, optimizer), CUDA-synchronised on GPU and wall clock on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from hfkit.data.msa_sampling import feature_shapes
from hfkit.model import ModelConfig

__all__ = [
    "PHASES",
    "lr_schedule",
    "make_optimizer",
    "make_scheduler",
    "synthetic_batch",
    "train",
    "train_step",
]

PHASES = ("data", "forward", "backward", "optimizer")
_INT_FEATURES = frozenset({"aatype", "residue_index", "seq_length", "true_msa", "extra_msa"})


def synthetic_batch(
    config: ModelConfig,
    batch_size: int = 1,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Random features with exactly the names, shapes and dtypes `process_features` gives for
    `config.feature_config()`, with a leading batch axis of `batch_size` (no padding: every residue
    and row is real). Values are plausible: one-hot target features, ~15 % BERT-masked positions,
    a random-walk backbone so that the distogram loss has finite targets."""
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
    shapes = feature_shapes(config.feature_config())
    g = torch.Generator().manual_seed(int(seed))
    b = batch_size
    n = shapes["aatype"][0]
    s = shapes["msa_mask"][0]
    e = shapes["extra_msa"][0]

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand((b, *shape), generator=g)

    aatype = torch.randint(0, 20, (b, n), generator=g)
    batch = {
        "aatype": aatype,
        "residue_index": torch.arange(n).expand(b, n).clone(),
        "seq_mask": torch.ones(b, n),
        "seq_length": torch.full((b,), n, dtype=torch.int64),
        "target_feat": torch.cat(
            [torch.zeros(b, n, 1), F.one_hot(aatype, shapes["target_feat"][-1] - 1)], -1
        ).float(),
        "msa_feat": rand(*shapes["msa_feat"]),
        "msa_mask": torch.ones(b, s, n),
        "true_msa": torch.randint(0, 22, (b, s, n), generator=g),
        "bert_mask": (rand(s, n) < 0.15).float(),
        "extra_msa": torch.randint(0, 23, (b, e, n), generator=g),
        "extra_msa_mask": torch.ones(b, e, n),
        "extra_has_deletion": (rand(e, n) < 0.1).float(),
        "extra_deletion_value": rand(e, n),
        "all_atom_positions": torch.cumsum(
            torch.randn((b, *shapes["all_atom_positions"]), generator=g) * 2.0, 1
        ),
        "all_atom_mask": torch.ones(b, *shapes["all_atom_mask"]),
        "resolution": torch.full((b,), 2.0),
    }
    batch["bert_mask"][..., 0, 0] = 1.0  # at least one masked position: a defined masked-MSA loss
    for key, shape in shapes.items():  # the schema is the contract
        assert batch[key].shape == (b, *shape), key
        assert (batch[key].dtype == torch.int64) == (key in _INT_FEATURES), key
    if device is not None:
        batch = {k: v.to(device) for k, v in batch.items()}
    return batch


def lr_schedule(
    step: int,
    base_lr: float = 1e-3,
    warmup: int = 1000,
    decay_after: int = 50000,
    decay: float = 0.95,
    decay_every: int = 50000,
) -> float:
    """AlphaFold's learning rate at optimiser step `step` (AF2 supplement 1.11.3, OpenFold's
    `AlphaFoldLRScheduler`): `base_lr * step / warmup` while `step <= warmup` (linear warm-up from
    0), then `base_lr`, times `decay` once `step > decay_after` and once more every `decay_every`
    further steps (`decay ** (1 + (step - decay_after - 1) // decay_every)`)."""
    if step < 0:
        raise ValueError(f"step: expected >= 0, got {step}")
    if warmup < 0 or decay_after < 0 or decay_every < 1:
        raise ValueError("warmup, decay_after: expected >= 0; decay_every: expected >= 1")
    if warmup > 0 and step <= warmup:
        return base_lr * step / warmup
    if step > decay_after:
        return base_lr * decay ** (1 + (step - decay_after - 1) // decay_every)
    return base_lr


def make_optimizer(model: nn.Module, lr: float = 1e-3) -> torch.optim.Adam:
    """Adam with AlphaFold's settings: β1 0.9, β2 0.999, ε 1e-6."""
    return torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-6)


def make_scheduler(optimizer: torch.optim.Optimizer, **schedule: Any) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR that scales the optimizer's lr (the base lr) by `lr_schedule` (keywords: warmup,
    decay_after, decay, decay_every)."""
    if "base_lr" in schedule:
        raise ValueError("base_lr: set it as the optimizer's lr")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_schedule(step, base_lr=1.0, **schedule)
    )


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def train_step(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    clip: float | None = 0.1,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """One optimiser step: forward, `model.loss`, backward, clip the global gradient norm to `clip`
    (None: no clipping), `optimizer.step()`, then `scheduler.step()`.

    `autocast_dtype` (e.g. torch.bfloat16) runs forward and loss under `torch.autocast` on the
    model's device. Returns {"loss": float, "parts": {name: float}, "grad_norm": global norm before
    clipping, "lr": the lr this step used, "timings": {"forward", "backward", "optimizer": seconds}}.
    """
    device = _device_of(model)
    model.train()
    lr = optimizer.param_groups[0]["lr"]
    t0 = _clock(device)
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        outputs = model(batch)
        total, parts = model.loss(batch, outputs)
    t1 = _clock(device)
    optimizer.zero_grad(set_to_none=True)
    total.backward()
    t2 = _clock(device)
    params = [p for p in model.parameters() if p.grad is not None]
    if clip is not None:
        grad_norm = nn.utils.clip_grad_norm_(params, clip)
    else:
        grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    t3 = _clock(device)
    return {
        "loss": float(total.detach()),
        "parts": {k: float(v.detach()) for k, v in parts.items()},
        "grad_norm": float(grad_norm),
        "lr": lr,
        "timings": {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2},
    }


def _batches(loader: Iterable[Mapping[str, Any]] | None, config: ModelConfig, seed: int):
    """Batches forever: the loader's, epoch after epoch (set_epoch on its dataset where it has one),
    or synthetic ones when loader is None."""
    if loader is None:
        step = 0
        while True:
            yield synthetic_batch(config, seed=seed + step)
            step += 1
    epoch = 0
    while True:
        dataset = getattr(loader, "dataset", None)
        if epoch and hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("loader: yielded no batches")
        epoch += 1


def train(
    model: nn.Module,
    loader: Iterable[Mapping[str, Any]] | None,
    steps: int,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    clip: float | None = 0.1,
    autocast_dtype: torch.dtype | None = None,
    progress: bool = True,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Run `steps` training steps on batches from `loader` (a DataLoader of `process_features`
    samples, restarted each epoch; None: `synthetic_batch`es of `model.config`), with a tqdm bar.

    `optimizer` defaults to `make_optimizer(model)` and `scheduler` to AlphaFold's `make_scheduler`
    over it (pass both to control them). The data phase — waiting for the loader and copying the
    batch to the model's device — is timed with the others. Returns one `train_step` record a step,
    its "timings" holding all of `PHASES`.
    """
    from tqdm.auto import tqdm

    if steps < 0:
        raise ValueError(f"steps: expected >= 0, got {steps}")
    if autocast_dtype is not None and autocast_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"autocast_dtype: expected torch.bfloat16, torch.float16 or None, got {autocast_dtype}"
        )
    device = _device_of(model)
    if optimizer is None:
        optimizer = make_optimizer(model)
        if scheduler is None:
            scheduler = make_scheduler(optimizer)
    batches = _batches(loader, model.config, seed)
    records: list[dict[str, Any]] = []
    bar = tqdm(total=steps, disable=not progress, desc="train")
    try:
        for _ in range(steps):
            t0 = _clock(device)
            batch = next(batches)
            batch = {
                k: v.to(device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)
            }
            data_time = _clock(device) - t0
            record = train_step(model, batch, optimizer, scheduler, clip=clip, autocast_dtype=autocast_dtype)
            record["timings"] = {"data": data_time, **record["timings"]}
            records.append(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", s=f"{sum(record['timings'].values()):.3f}")
    finally:
        bar.close()
    return records
