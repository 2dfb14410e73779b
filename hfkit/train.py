"""Training: AlphaFold's optimiser, learning-rate schedule and gradient clipping, one timed step, a
loop over a DataLoader, synthetic batches for when no real data is given, and `graphed_step`: the
whole step (forward, loss, backward, clipping, Adam) captured as a CUDA graph and called from the
user's own loop, eager where there is no GPU.

AF2 supplement 1.11.3: Adam (lr 1e-3, β1 0.9, β2 0.999, ε 1e-6); the learning rate rises linearly
from 0 over the first 1000 steps, stays constant, and is multiplied by 0.95 after 50k steps
(OpenFold's `AlphaFoldLRScheduler`: by 0.95 again every further 50k steps); gradients are clipped by
their global norm at 0.1. Each step reports its losses and the time of each phase (data, forward,
backward, optimizer), CUDA-synchronised on GPU and wall clock on CPU.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from hfkit.data.msa_sampling import feature_shapes
from hfkit.model import ModelConfig

__all__ = [
    "PHASES",
    "GraphedStep",
    "batch_stream",
    "graphed_step",
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


def _fusable(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused Adam takes `params`: all floating-point CUDA tensors (and at least one)."""
    return bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)


def make_optimizer(model: nn.Module, lr: float = 1e-3) -> torch.optim.Adam:
    """Adam with AlphaFold's settings: β1 0.9, β2 0.999, ε 1e-6; torch's fused implementation when
    the model's parameters are on a GPU (one multi-tensor kernel a step, where the default multi-tensor
    path runs about ten passes over the parameters), else its default."""
    params = list(model.parameters())
    return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999), eps=1e-6, fused=_fusable(params) or None)


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


_ALIGN = 64  # elements: 128 bytes in bf16, 256 in float32


class _CastParams(torch.autograd.Function):
    """Copies of the parameters in `dtype` (views of one buffer) by one multi-tensor cast, and their
    gradients cast back to the parameters' dtype the same way: the same values as autocast's per-use
    casts, in a few kernels instead of one each way per weight and use (about 6,500 of about 2 us
    each in the af2_initial step)."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.param_dtype = params[0].dtype
        ctx.set_materialize_grads(False)  # a weight without gradient keeps none (Adam skips it)
        return _cast_into(params, dtype)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        cast = iter(_cast_into([g for g in grads if g is not None], ctx.param_dtype))
        return (None, *(None if g is None else next(cast) for g in grads))


def _cast_into(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple:
    """`tensors` copied in `dtype` into views of one new buffer per device (one multi-tensor copy each),
    every view starting `_ALIGN` elements aligned, as separately allocated tensors do (cuBLAS and Triton
    pick their vectorized kernels by the operands' alignment)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for device, index in by_device.items():
        starts = [0]
        for i in index:
            starts.append(starts[-1] + -(-tensors[i].numel() // _ALIGN) * _ALIGN)
        flat = torch.empty(starts[-1], dtype=dtype, device=device)
        views = [
            flat[start : start + tensors[i].numel()].view(tensors[i].shape)
            for start, i in zip(starts, index, strict=False)
        ]
        torch._foreach_copy_(views, [tensors[i] for i in index])
        for i, view in zip(index, views, strict=True):
            out[i] = view
    return tuple(out)


@contextlib.contextmanager
def _linears_cast(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Within the block, each trainable float32 `nn.Linear` parameter of `model` is replaced by its copy
    in `dtype` (`_CastParams`: gradients flow back to the parameter), so that autocast finds the weights
    already in its dtype and casts none of them. Covers forward and backward (checkpointed blocks
    recompute inside backward). LayerNorm and other parameters stay as they are (autocast keeps them
    in float32). Code that reads a Linear weight's dtype inside sees `dtype` (hfkit's model takes its
    feature dtype from a buffer instead). `dtype` None: nothing changes."""
    slots = [
        (module, name, p)
        for module in (model.modules() if dtype is not None else ())
        if isinstance(module, nn.Linear)
        for name, p in module._parameters.items()
        if p is not None and p.requires_grad and p.dtype == torch.float32
    ]
    if not slots:
        yield
        return
    params = list(dict.fromkeys(p for _, _, p in slots))  # a tied parameter once
    copies = dict(zip(params, _CastParams.apply(dtype, *params), strict=True))
    try:
        for module, name, p in slots:
            module._parameters[name] = copies[p]
        yield
    finally:
        for module, name, p in slots:
            module._parameters[name] = p


def _forward_loss(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    autocast_dtype: torch.dtype | None,
    cache_casts: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`model.loss(batch, model(batch))` under `torch.autocast(autocast_dtype)` when given. Without
    `cache_casts` autocast casts each weight afresh at each use (the same values): a CUDA graph
    capture would otherwise allocate and free its cache inside the graph."""
    with torch.autocast(
        _device_of(model).type,
        dtype=autocast_dtype,
        enabled=autocast_dtype is not None,
        cache_enabled=cache_casts,
    ):
        outputs = model(batch)
        return model.loss(batch, outputs)


def _clip_and_step(
    params: list[nn.Parameter], optimizer: torch.optim.Optimizer, clip: float | None
) -> torch.Tensor:
    """Clip the gradients' global norm to `clip` (None: no clipping), step the optimizer -> the norm
    before clipping. Neither reads a value back to the host, so both can be captured in a graph."""
    if clip is not None:
        grad_norm = nn.utils.clip_grad_norm_(params, clip)
    else:
        grads = [p.grad for p in params if p.grad is not None]
        grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    optimizer.step()
    return grad_norm.detach()


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
    with _linears_cast(model, autocast_dtype):
        total, parts = _forward_loss(model, batch, autocast_dtype)
        t1 = _clock(device)
        optimizer.zero_grad(set_to_none=True)
        total.backward()
    t2 = _clock(device)
    grad_norm = _clip_and_step(list(model.parameters()), optimizer, clip)
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


def batch_stream(
    loader: Iterable[Mapping[str, Any]] | None, config: ModelConfig, seed: int = 0, batch_size: int = 1
) -> Iterator[Mapping[str, Any]]:
    """Batches forever: the loader's, epoch after epoch (`set_epoch(epoch)` on its dataset where it
    has one), or `synthetic_batch(config, batch_size, seed=seed + i)` for i = 0, 1, ... when loader
    is None. Raises ValueError when the loader yields nothing in an epoch."""
    if loader is None:
        step = 0
        while True:
            yield synthetic_batch(config, batch_size, seed=seed + step)
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
    batches = batch_stream(loader, model.config, seed)
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


def _batch_spec(batch: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{feature: (shape, dtype)} of the tensors in `batch` (other values, e.g. chain names, are not
    features and are ignored)."""
    return {k: (tuple(v.shape), v.dtype) for k, v in batch.items() if isinstance(v, torch.Tensor)}


class GraphedStep:
    """A training step bound to one model, optimizer and batch layout; made by `graphed_step`.

    `step(batch)` copies `batch` (a dict of tensors on any device, laid out as the example batch)
    into the step's static buffers on the model's device, runs forward, `model.loss`, backward,
    global-norm gradient clipping, the optimizer step and then `scheduler.step()`, and returns the
    loss (a 0-d float32 tensor on the model's device). With a CUDA graph (`graphed` True) the loss
    tensor is the graph's static output: the next call overwrites it, so call `.item()` or
    `.clone()` to keep it; likewise `parts` (the unweighted losses, {name: 0-d tensor}) and
    `grad_norm` (the global gradient norm before clipping). `step_count` counts calls;
    `last_times` holds the seconds of each phase of the last call ("copy", then "graph" or
    "forward", "backward", "optimizer") when made with `timed=True` (CUDA-synchronised), else it
    stays empty.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        example_batch: Mapping[str, Any],
        *,
        clip_norm: float | None,
        autocast_dtype: torch.dtype | None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        warmup_steps: int,
        graphed: bool | None,
        timed: bool,
    ) -> None:
        if clip_norm is not None and not clip_norm > 0:
            raise ValueError(f"clip_norm: expected > 0 or None, got {clip_norm}")
        if autocast_dtype is not None and autocast_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"autocast_dtype: expected torch.bfloat16, torch.float16 or None, got {autocast_dtype}"
            )
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps: expected >= 1, got {warmup_steps}")
        self.device = _device_of(model)
        if graphed and self.device.type != "cuda":
            raise ValueError(f"graphed: a CUDA graph needs the model on a CUDA device, got {self.device}")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.clip_norm = clip_norm
        self.autocast_dtype = autocast_dtype
        self.graphed = self.device.type == "cuda" if graphed is None else bool(graphed)
        self.timed = timed
        self.spec = _batch_spec(example_batch)
        if not self.spec:
            raise ValueError("example_batch: expected a dict of feature tensors, got no tensors")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.step_count = 0
        self.last_times: dict[str, float] = {}
        self.loss: torch.Tensor | None = None
        self.parts: dict[str, torch.Tensor] = {}
        self.grad_norm: torch.Tensor | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static: dict[str, torch.Tensor] = {}
        if self.graphed:
            self._capture(example_batch, warmup_steps)

    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Raise ValueError unless `batch` has exactly the example batch's features, each with its
        shape and dtype (the CUDA graph, and the static buffers it reads, are fixed to them)."""
        spec = _batch_spec(batch)
        missing = sorted(self.spec.keys() - spec.keys())
        if missing:
            raise ValueError(
                f"batch: missing features {missing}; expected the example batch's {sorted(self.spec)}"
            )
        extra = sorted(spec.keys() - self.spec.keys())
        if extra:
            raise ValueError(f"batch: features {extra} are not in the example batch {sorted(self.spec)}")
        for key, (shape, dtype) in self.spec.items():
            if spec[key][0] != shape:
                raise ValueError(
                    f"batch[{key!r}]: expected shape {shape} (the example batch's), got {spec[key][0]}"
                )
            if spec[key][1] != dtype:
                raise ValueError(
                    f"batch[{key!r}]: expected dtype {dtype} (the example batch's), got {spec[key][1]}"
                )

    def __call__(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """One training step on `batch` -> the loss (0-d tensor; see the class docstring)."""
        self.check_batch(batch)
        times: dict[str, float] = {}
        t0 = self._clock()
        if self.graphed:
            for key, buffer in self._static.items():
                buffer.copy_(batch[key], non_blocking=True)
            t1 = self._clock()
            self._graph.replay()
            t2 = self._clock()
            times = {"copy": t1 - t0, "graph": t2 - t1}
        else:
            batch = {key: batch[key].to(self.device, non_blocking=True) for key in self.spec}
            t1 = self._clock()
            self.model.train()
            with _linears_cast(self.model, self.autocast_dtype):
                total, parts = self._forward_loss(batch, cache_casts=True)
                t2 = self._clock()
                self.optimizer.zero_grad(set_to_none=True)
                total.backward()
            t3 = self._clock()
            self.grad_norm = self._clip_and_step()
            t4 = self._clock()
            self.loss = total.detach()
            self.parts = {k: v.detach() for k, v in parts.items()}
            times = {"copy": t1 - t0, "forward": t2 - t1, "backward": t3 - t2, "optimizer": t4 - t3}
        if self.scheduler is not None:
            self.scheduler.step()  # fills the lr tensor the captured optimizer step reads
        self.step_count += 1
        if self.timed:
            self.last_times = times
        return self.loss

    def _clock(self) -> float:
        return _clock(self.device) if self.timed else 0.0

    def _forward_loss(
        self, batch: Mapping[str, torch.Tensor], cache_casts: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return _forward_loss(self.model, batch, self.autocast_dtype, cache_casts)

    def _clip_and_step(self) -> torch.Tensor:
        return _clip_and_step(self.params, self.optimizer, self.clip_norm)

    def _prepare_optimizer(self) -> None:
        """Make the optimizer capturable in place: each group's lr a 0-d tensor on the model's device
        (the schedule fills it between replays; a Python float would be frozen into the graph),
        `capturable` on, the fused update where a group's parameters are all floating-point CUDA
        tensors (one kernel a step; the capturable multi-tensor path launches about ten small kernels
        per parameter), else the multi-tensor (foreach) one, and step counters on the device."""
        if not isinstance(self.optimizer, torch.optim.Adam | torch.optim.AdamW):
            raise ValueError(
                f"optimizer: expected torch.optim.Adam or AdamW for a CUDA graph, got "
                f"{type(self.optimizer).__name__}"
            )
        for group in self.optimizer.param_groups:
            group["capturable"] = True  # fused groups too: step() checks the flag during capture
            if not group.get("fused") and not group.get("differentiable") and _fusable(group["params"]):
                group["fused"], group["foreach"] = True, False
            if not group.get("fused"):
                # The multi-tensor path: the single-tensor capturable path makes NaN (0 / 0) from
                # parameters without gradient while lr is 0, as at AlphaFold's first step.
                group["foreach"] = True
            lr = group["lr"]
            if not isinstance(lr, torch.Tensor):
                group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=self.device)
            elif lr.device != self.device:
                group["lr"] = lr.to(self.device)
        for state in self.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device != self.device:
                state["step"] = step.to(self.device)

    def _snapshot(self) -> tuple[list[torch.Tensor], dict[Any, dict[str, Any]]]:
        tensors = [t.detach().clone() for t in (*self.model.parameters(), *self.model.buffers())]
        state = {
            p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for p, s in self.optimizer.state.items()
        }
        return tensors, state

    @torch.no_grad()
    def _restore(self, snapshot: tuple[list[torch.Tensor], dict[Any, dict[str, Any]]]) -> None:
        """Undo the warm-up steps in place (the graph holds these very tensors): parameters and
        buffers as they were; optimizer state as it was, or zeros (Adam's initial state: step,
        exp_avg, exp_avg_sq) where the warm-up created it."""
        tensors, saved_state = snapshot
        for t, saved in zip((*self.model.parameters(), *self.model.buffers()), tensors, strict=True):
            t.copy_(saved)
        for p, state in self.optimizer.state.items():
            saved = saved_state.get(p)
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    if saved is not None and key in saved:
                        state[key] = saved[key]
                elif saved is not None and key in saved:
                    value.copy_(saved[key])
                else:
                    value.zero_()

    def _capture(self, example_batch: Mapping[str, Any], warmup_steps: int) -> None:
        """Warm up on a side stream, undo the warm-up, then capture one step as a CUDA graph.

        The warm-up (PyTorch's CUDA-graph recipe) compiles kernels, runs autotuning and creates the
        optimizer state outside the capture. Dropout stays random across replays: the capture
        registers the default CUDA generator, and each replay advances its philox offset.
        """
        self._prepare_optimizer()
        self._static = {
            key: torch.empty(shape, dtype=dtype, device=self.device)
            for key, (shape, dtype) in self.spec.items()
        }
        for key, buffer in self._static.items():
            buffer.copy_(example_batch[key])
        snapshot = self._snapshot()
        self.model.train()
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(warmup_steps):
                self.optimizer.zero_grad(set_to_none=True)
                with _linears_cast(self.model, self.autocast_dtype):
                    total, parts = self._forward_loss(self._static, cache_casts=False)
                    total.backward()
                self._clip_and_step()
        current.wait_stream(side)
        self._restore(snapshot)
        # The warm-up's losses hold its autograd graph, and with it the parameters' AccumulateGrad
        # nodes, made on the side stream: kept alive, the capture's backward (on the graph's own
        # stream) would reuse them across streams (torch warns, and syncs the streams).
        del snapshot, total, parts
        # Gradients allocated during the capture live in the graph's pool; each replay rewrites them.
        self.optimizer.zero_grad(set_to_none=True)
        self._graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: a DataLoader's pin-memory thread may allocate pinned memory meanwhile.
            with torch.cuda.graph(self._graph, capture_error_mode="thread_local"):
                with _linears_cast(self.model, self.autocast_dtype):
                    total, parts = self._forward_loss(self._static, cache_casts=False)
                    total.backward()
                self.grad_norm = self._clip_and_step()
        except RuntimeError as err:
            raise RuntimeError(
                f"capturing the training step as a CUDA graph failed (checkpointing "
                f"{getattr(getattr(self.model, 'config', None), 'checkpoint', None)}, autocast "
                f"{self.autocast_dtype}): {err}. graphed_step(..., graphed=False) runs it eagerly."
            ) from err
        self.loss = total.detach()
        self.parts = {k: v.detach() for k, v in parts.items()}


def graphed_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    example_batch: Mapping[str, Any],
    *,
    clip_norm: float | None = 0.1,
    autocast_dtype: torch.dtype | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    warmup_steps: int = 3,
    graphed: bool | None = None,
    timed: bool = False,
) -> GraphedStep:
    """A training step captured as a CUDA graph, to call from the user's own loop:
    `step = graphed_step(model, optimizer, example_batch)`, then `loss = step(batch)` per batch.

    One call of the step is forward, `model.loss(batch, outputs)` (e.g. `AlphaFoldLite`'s
    distogram + masked-MSA loss) under `torch.autocast(autocast_dtype)` when given, backward,
    clipping of the gradients' global norm to `clip_norm` (None: none), `optimizer.step()`, then
    `scheduler.step()` (e.g. `make_scheduler(optimizer)`: AlphaFold's warm-up and decay). Batches
    must have the example batch's features, shapes and dtypes (the fixed sizes cropping and
    padding give, e.g. `msa_feat` [B, S, N, 49]); any other raises ValueError naming the feature.

    On CUDA (`graphed` None or True, model on a GPU) the step is captured once, here: the example
    batch's layout becomes static device buffers that each call refills with `copy_`; the
    optimizer (Adam or AdamW) is made capturable in place, its lr held in a device tensor that the
    scheduler fills between replays; `warmup_steps` eager iterations on a side stream precede the
    capture and are undone afterwards (parameters and optimizer state restored), so the first call
    is the first step. Per-block checkpointing (the model config's `checkpoint`) and dropout work
    inside the graph; the model stays in train mode. Without CUDA (or `graphed=False`) the same call
    runs the same math eagerly, like `train_step`. The returned loss, `parts` and `grad_norm` are
    overwritten by the next call on CUDA: `.item()` or `.clone()` them to keep them.
    """
    return GraphedStep(
        model,
        optimizer,
        example_batch,
        clip_norm=clip_norm,
        autocast_dtype=autocast_dtype,
        scheduler=scheduler,
        warmup_steps=warmup_steps,
        graphed=graphed,
        timed=timed,
    )
