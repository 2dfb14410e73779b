"""`DistributedDataParallel`: data-parallel training over torch.distributed with backends nccl | gloo |
hfreduce, bucketed gradient averaging overlapped with backward (or run explicitly by `sync_grad()`),
optional bf16 compression, and a construction-time check that all ranks hold the same model and settings.
"""

from __future__ import annotations

import contextlib
import hashlib
import queue
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from hfkit.parallel.hfreduce import DEFAULT_CHUNK_MB, HostReduce, node_size

DEFAULT_TIMEOUT = timedelta(minutes=10)
BACKENDS = ("nccl", "gloo", "hfreduce")


@dataclass
class _Bucket:
    """Parameters whose gradients are averaged together, in one flat buffer of `numel` elements."""

    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    ready: int = 0  # how many of `params` have their gradient accumulated in this backward
    flat: torch.Tensor | None = None  # [numel] averaged-gradient buffer (in flight)
    sent: torch.Tensor | None = None  # what is being reduced: `flat`, or its bf16 copy
    work: Any = None  # dist.Work (nccl/gloo) or Future (hfreduce with overlap)


# One entry of what must agree across ranks: (kind, name, {field: value}).
_Entry = tuple[str, str, dict[str, Any]]


def _signature(
    module: nn.Module, settings: Mapping[str, Any] | None, layout: Mapping[str, Any] | None
) -> list[_Entry]:
    """Settings, then every parameter (shape, dtype, requires_grad) and buffer (shape, dtype) in
    registration order, then the layout derived from both: causes come before their consequences."""
    sig: list[_Entry] = [("setting", k, {"value": v}) for k, v in (settings or {}).items()]
    sig += [
        ("parameter", n, {"shape": tuple(p.shape), "dtype": str(p.dtype), "requires_grad": p.requires_grad})
        for n, p in module.named_parameters()
    ]
    sig += [
        ("buffer", n, {"shape": tuple(b.shape), "dtype": str(b.dtype)}) for n, b in module.named_buffers()
    ]
    sig += [("layout", k, {"value": v}) for k, v in (layout or {}).items()]
    return sig


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(entry: _Entry | None) -> str:
    if entry is None:
        return "nothing"
    kind, name, fields = entry
    return f"{kind} {name!r} " + ", ".join(f"{k} {_short(v)}" for k, v in fields.items())


def _value_difference(a: Any, b: Any, rank: int) -> str:
    """How `a` (rank 0's) and `b` differ: both values, or for lists the first differing item."""
    if isinstance(a, list) and isinstance(b, list):
        j = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
        item = lambda v: _short(v[j]) if j < len(v) else "nothing"  # noqa: E731
        return (
            f"{len(a)} items on rank 0 but {len(b)} on rank {rank}; item {j} is {item(a)} on rank 0 but "
            f"{item(b)} on rank {rank}"
        )
    return f"{_short(a)} on rank 0 but {_short(b)} on rank {rank}"


def _difference(ref: list[_Entry], other: list[_Entry], rank: int) -> str:
    """The first entry where `other` (rank `rank`'s signature) differs from rank 0's, in words."""
    for i in range(max(len(ref), len(other))):
        a = ref[i] if i < len(ref) else None
        b = other[i] if i < len(other) else None
        if a == b:
            continue
        if a is None or b is None or a[:2] != b[:2]:
            return f"entry {i} is {_describe(a)} on rank 0 but {_describe(b)} on rank {rank}"
        if list(a[2]) == ["value"]:  # a setting or layout entry: one value
            return f"{a[0]} {a[1]!r} is {_value_difference(a[2]['value'], b[2].get('value'), rank)}"
        fields = [
            f"{k} {_value_difference(v, b[2].get(k), rank)}" for k, v in a[2].items() if v != b[2].get(k)
        ]
        return f"{a[0]} {a[1]!r}: " + "; ".join(fields)
    return "no difference"


def check_same_model(
    module: nn.Module,
    group: dist.ProcessGroup | None = None,
    settings: Mapping[str, Any] | None = None,
    layout: Mapping[str, Any] | None = None,
) -> None:
    """Raise a ValueError on every rank, naming the first difference for each rank that differs from
    rank 0, unless all ranks of `group` hold models with the same parameter names, shapes, dtypes and
    requires_grad flags and buffer names, shapes and dtypes, and pass equal `settings` (name → value:
    the arguments that must agree, e.g. a backend) and `layout` (name → value: what is derived from
    model and settings, e.g. bucket boundaries; checked last, so a differing cause is named first).
    Values must be picklable and compare with ==. Collective (two all_gathers at most).
    """
    sig = _signature(module, settings, layout)
    digest = hashlib.sha256(repr(sig).encode()).hexdigest()
    world = dist.get_world_size(group)
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return
    sigs: list[Any] = [None] * world
    dist.all_gather_object(sigs, sig, group=group)
    differences = [_difference(sigs[0], sigs[r], r) for r in range(1, world) if sigs[r] != sigs[0]]
    raise ValueError(
        "DistributedDataParallel: the model or its settings differs between ranks: "
        + "; ".join(differences)
        + " (every rank must build the same model and wrap it with the same arguments)"
    )


def _broadcast_module(module: nn.Module, src: int, group: dist.ProcessGroup | None) -> None:
    """Copy rank `src`'s parameters and buffers to every rank, one flat broadcast per dtype/device."""
    tensors = [p.data for p in module.parameters()] + [b.data for b in module.buffers()]
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    gloo = dist.get_backend(group) == "gloo"
    with torch.no_grad():
        for (_, device), ts in by_kind.items():
            flat = _flatten_dense_tensors(ts)
            if gloo and device.type == "cuda":
                flat = flat.cpu()  # gloo moves host memory
            dist.broadcast(flat, src=src, group=group)
            for t, v in zip(ts, _unflatten_dense_tensors(flat, ts), strict=True):
                t.copy_(v)


class DistributedDataParallel(nn.Module):
    """Wrap `module` for data-parallel training: after backward every rank holds the same gradients,
    the average over ranks (what torch's DistributedDataParallel computes, to fp32 rounding).

    The default process group must be initialized (the caller, or `init_distributed`). backend: "nccl" |
    "gloo" (dist.all_reduce on the default group, or on a new group of that backend if the default one
    differs) | "hfreduce" (`HostReduce`) | None (the default group's backend). Gradients are packed
    into buckets of about `bucket_mb` MB in reverse registration order (the order backward produces
    them). overlap=True: a bucket's all-reduce starts asynchronously as soon as all its gradients are
    accumulated (buckets launch in order, so every rank issues the same sequence), and all are awaited
    at the end of backward. overlap=False: backward does no communication; call `sync_grad()` (as in
    hfai), so that backward and synchronization can be timed apart. compress="bf16": each bucket is
    sent as bf16 and cast back (torch's bf16_compress_hook). Every collective has `timeout`; a dead or
    stuck peer raises a RuntimeError naming the timeout, the buckets still queued are abandoned (nothing
    waits on them, also not at interpreter exit), and every later synchronization raises at once.
    Parameters and buffers are broadcast from rank 0 at construction, after checking that every rank
    holds the same model (requires_grad flags included) and passed the same backend, overlap, compress,
    bucket_mb (hence bucket boundaries) and, for hfreduce, chunk_mb and node size (ValueError on every
    rank, naming the difference, otherwise).
    """

    def __init__(
        self,
        module: nn.Module,
        backend: str | None = None,
        bucket_mb: float = 25.0,
        overlap: bool = True,
        timeout: timedelta = DEFAULT_TIMEOUT,
        compress: str | None = None,
        process_group: dist.ProcessGroup | None = None,
        chunk_mb: float = DEFAULT_CHUNK_MB,
        local_world_size: int | None = None,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel: torch.distributed is not initialized "
                "(launch with torchrun and call hfkit.parallel.init_distributed first)"
            )
        group = process_group if process_group is not None else dist.group.WORLD
        backend = backend or dist.get_backend(group)
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        if compress not in (None, "bf16"):
            raise ValueError(f"compress: expected None or 'bf16', got {compress!r}")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb: expected > 0, got {bucket_mb}")
        self.module = module
        self.backend = backend
        self.overlap = overlap
        self.timeout = timeout
        self.compress = compress
        self.world_size = dist.get_world_size(group)
        self._group = group
        src = 0 if group is dist.group.WORLD else dist.get_global_rank(group, 0)

        params = [p for p in module.parameters() if p.requires_grad]
        self._buckets = self._make_buckets(list(reversed(params)), int(bucket_mb * 2**20))
        # Everything that decides which collectives a rank issues, checked before the first of them.
        settings: dict[str, Any] = {
            "backend": backend,
            "overlap": overlap,
            "compress": compress,
            "bucket_mb": bucket_mb,
        }
        if backend == "hfreduce":
            settings["chunk_mb"] = chunk_mb
            settings["local_world_size"] = node_size(self.world_size, local_world_size)
        layout = {"buckets (elements, dtype)": [(b.numel, str(b.params[0].dtype)) for b in self._buckets]}
        check_same_model(module, group, settings, layout)
        _broadcast_module(module, src, group)

        self._comm_group: dist.ProcessGroup | None = group
        self._reducer: HostReduce | None = None
        self._reduce_thread: _ReduceThread | None = None
        if backend == "hfreduce":
            self._reducer = HostReduce(
                group, chunk_mb=chunk_mb, local_world_size=local_world_size, timeout=timeout
            )
            if overlap:
                self._reduce_thread = _ReduceThread(self._reducer)
        elif dist.get_backend(group) != backend:
            ranks = None if group is dist.group.WORLD else dist.get_process_group_ranks(group)
            self._comm_group = dist.new_group(ranks, timeout=timeout, backend=backend)

        self._failure: str | None = None  # the first failed all-reduce; then every later sync refuses
        self._bucket_of: dict[int, int] = {}
        for i, b in enumerate(self._buckets):
            for p in b.params:
                self._bucket_of[id(p)] = i
        self._next = 0  # next bucket to launch in this backward
        # Buckets whose all-reduce started during the last backward, before its end (0 if overlap=False).
        self.overlapped_buckets = 0
        self._callback_queued = False
        self._sync_enabled = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    @staticmethod
    def _make_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
        """Greedy buckets of <= cap_bytes (a bigger parameter gets its own), one dtype/device each."""
        buckets: list[_Bucket] = []
        cur: list[nn.Parameter] = []
        size = 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            if cur and (size + nbytes > cap_bytes or p.dtype != cur[0].dtype or p.device != cur[0].device):
                buckets.append(DistributedDataParallel._bucket(cur))
                cur, size = [], 0
            cur.append(p)
            size += nbytes
        if cur:
            buckets.append(DistributedDataParallel._bucket(cur))
        return buckets

    @staticmethod
    def _bucket(params: list[nn.Parameter]) -> _Bucket:
        offsets, off = [], 0
        for p in params:
            offsets.append(off)
            off += p.numel()
        return _Bucket(params=params, offsets=offsets, numel=off)

    @property
    def bucket_sizes(self) -> list[int]:
        """Elements per bucket, in launch order."""
        return [b.numel for b in self._buckets]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._callback_queued or self._next:
            # A previous backward raised before its end-of-backward callback ran: start afresh.
            self._reset()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside this context, e.g. for micro-batches."""
        prev, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = prev

    # ---------------------------------------------------------------- backward hooks

    def _on_grad(self, p: torch.Tensor) -> None:
        if not (self.overlap and self._sync_enabled):
            return  # overlap=False: backward stays communication-free; sync_grad() does the work
        if not self._callback_queued:
            # Runs once the whole backward graph is done: wait for every bucket there.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        b = self._buckets[self._bucket_of[id(p)]]
        b.ready += 1
        # Launch in bucket order only, so that all ranks issue collectives in the same sequence.
        while self._next < len(self._buckets) and self._buckets[self._next].ready == len(
            self._buckets[self._next].params
        ):
            self._launch(self._next)
            self._next += 1

    def _finish_backward(self) -> None:
        self._reduce_all()  # resets the per-backward state, also on error

    def sync_grad(self) -> None:
        """Average the gradients over ranks now (overlap=False); with overlap=True backward already did.

        Parameters without a gradient count as zero gradients (and get one), so that all ranks reduce
        the same buckets.
        """
        if self.overlap and not self._callback_queued and self._next == 0:
            return
        self._reduce_all()

    # ---------------------------------------------------------------- communication

    def _reduce_all(self) -> None:
        """Launch the buckets not launched yet (in order), then wait for all and write the gradients."""
        self.overlapped_buckets = self._next
        try:
            while self._next < len(self._buckets):
                self._launch(self._next)
                self._next += 1
            for b in self._buckets:
                self._wait(b)
        finally:
            self._reset()

    def _reset(self) -> None:
        self._next = 0
        self._callback_queued = False
        for b in self._buckets:
            b.ready, b.flat, b.sent, b.work = 0, None, None, None

    def _launch(self, i: int) -> None:
        """Pack bucket i's gradients divided by the world size (as torch's DDP: divide, then sum) and
        start their all-reduce."""
        if self._failure is not None:
            raise RuntimeError(
                f"DistributedDataParallel ({self.backend}): an earlier gradient all-reduce failed, so the "
                f"ranks can no longer synchronize; restart them ({self._failure})"
            )
        b = self._buckets[i]
        p0 = b.params[0]
        flat = torch.zeros(b.numel, dtype=p0.dtype, device=p0.device)
        scale = 1.0 / self.world_size
        for p, off in zip(b.params, b.offsets, strict=True):
            if p.grad is not None:
                torch.mul(p.grad.reshape(-1), scale, out=flat[off : off + p.numel()])
        sent = flat.to(torch.bfloat16) if self.compress == "bf16" else flat
        b.flat, b.sent = flat, sent
        try:
            if self._reducer is None:
                b.work = dist.all_reduce(sent, group=self._comm_group, async_op=True)
            elif self._reduce_thread is not None:
                event = None
                if sent.is_cuda:
                    event = torch.cuda.Event()
                    event.record()
                b.work = self._reduce_thread.submit(sent, event)
            else:
                self._reducer.allreduce_(sent)
                b.work = None
        except Exception as e:
            raise self._failed(e) from e

    def _failed(self, e: Exception) -> RuntimeError:
        """Record the first failed all-reduce (every later sync refuses) and say what happened."""
        self._failure = self._failure or f"{type(e).__name__}: {e}"
        return RuntimeError(
            f"DistributedDataParallel ({self.backend}): gradient all-reduce failed; a peer rank died or "
            f"did not answer within the {self.timeout} timeout ({type(e).__name__}: {e})"
        )

    def _wait(self, b: _Bucket) -> None:
        if b.flat is None:
            return
        try:
            if isinstance(b.work, Future):
                # HostReduce honours the timeout itself; the margin only guards against a stuck thread.
                b.work.result(timeout=2 * self.timeout.total_seconds() + 10)
            elif b.work is not None and self.backend == "nccl":
                # Non-blocking for the host: the current stream waits. NCCL's watchdog enforces the
                # group's timeout (a wait with a timeout would block the CPU until the GPU is done).
                b.work.wait()
            elif b.work is not None:
                b.work.wait(self.timeout)
        except FutureTimeout as e:
            self._failure = "hfreduce all-reduce stuck"
            if self._reduce_thread is not None:
                self._reduce_thread.close()  # abandons the buckets queued behind the stuck one
            raise RuntimeError(
                f"DistributedDataParallel: hfreduce all-reduce did not finish within the {self.timeout} "
                "timeout (a peer rank died or is stuck)"
            ) from e
        except Exception as e:
            raise self._failed(e) from e
        if b.sent is not b.flat:
            b.flat.copy_(b.sent)  # bf16 → the gradients' dtype
        for p, off in zip(b.params, b.offsets, strict=True):
            g = b.flat[off : off + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)

    def close(self) -> None:
        """Remove the hooks and release the HostReduce (if any). Waits for nothing: buckets still queued
        are abandoned, and one being reduced stops at its next barrier."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._reduce_thread is not None:
            self._reduce_thread.close()
        if self._reducer is not None:
            self._reducer.close()


class _ReduceThread:
    """Runs `HostReduce.allreduce_` on buckets in submission order (the same on every rank) on one
    daemon thread. After a failed bucket, or `close()`, the buckets still queued are abandoned: their
    futures fail at once instead of each waiting the timeout for a dead peer; and being a daemon, the
    thread is never joined at interpreter exit.
    """

    def __init__(self, reducer: HostReduce) -> None:
        self._reducer = reducer
        self._queue: queue.SimpleQueue[tuple[Future, torch.Tensor, Any] | None] = queue.SimpleQueue()
        self._failure: str | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hfkit-hfreduce", daemon=True)
        self._thread.start()

    def submit(self, tensor: torch.Tensor, ready_event: torch.cuda.Event | None) -> Future:
        """Queue the all-reduce of `tensor` (in place); the future holds its error, if any."""
        future: Future = Future()
        self._queue.put((future, tensor, ready_event))
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, tensor, ready_event = item
            if not future.set_running_or_notify_cancel():
                continue
            if self._closed or self._failure is not None:
                reason = "DistributedDataParallel was closed" if self._closed else self._failure
                future.set_exception(RuntimeError(f"hfreduce bucket abandoned: {reason}"))
                continue
            try:
                self._reducer.allreduce_(tensor, ready_event)
            except BaseException as e:
                self._failure = f"an earlier bucket failed ({type(e).__name__}: {e})"
                future.set_exception(e)
            else:
                future.set_result(None)

    def close(self) -> None:
        """Abandon the queued buckets and let the thread end (not waited for)."""
        self._closed = True
        self._queue.put(None)
