"""hfreduce: `HostReduce`, an all-reduce staged through pinned host memory shared by a node's ranks.

After the Fire-Flyer AI-HPC paper (arXiv 2408.14158): a tensor is cut into chunks; each rank copies a
chunk device→host (async, side stream) into its slot of a node-wide shared-memory segment; every local
rank sums its slice of the chunk over all local slots (a reduce-scatter on the CPU, vectorized torch);
the node sums are all-reduced across nodes over gloo; every rank copies the summed chunk host→device.
One PCIe crossing each way and no GPU kernels. Chunks are double-buffered so that chunk k+1's copy
overlaps chunk k's reduction. The node's ranks meet once per chunk; on x86 that is a barrier of
counters in the shared segment (a few microseconds), elsewhere a gloo barrier (~0.1 ms), since the
counters rely on x86's store ordering. CPU tensors skip the device copies: their data is written to and read
from the shared slots directly.

Under faults: a rank that gives up (timeout, failed peer, `close()`) marks itself in the shared segment, so
that its local peers waiting for it fail at once instead of after their timeout, and a HostReduce that
failed refuses further use (its ranks no longer agree on which chunk comes next).

Also `allreduce(tensor, backend)`, the one-call all-reduce (nccl | gloo | hfreduce) used by the comms
benchmark.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import platform
import secrets
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(minutes=10)
# Chunk sizes are rounded down to this many bytes so that every dtype's view of a slot is aligned.
_ALIGN = 64
# Each local rank's 64-byte cache line at the start of the segment holds its barrier counter (int64 0)
# and its "gave up" mark (int64 1: nonzero once it will not arrive at any further barrier).
_FLAG_BYTES = 64
_COUNTER, _GAVE_UP = 0, 1
# The counter barrier needs a rank's earlier stores (its chunk in the slot) to be seen before its counter:
# guaranteed by x86's total store order, not by weaker models (Arm), where the gloo barrier is used.
_STORE_ORDERED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _shm_dir() -> str:
    """Directory for the shared segment: /dev/shm (RAM-backed tmpfs) where it exists."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def node_size(world_size: int, local_world_size: int | None = None) -> int:
    """Ranks per node that `HostReduce` uses for a group of `world_size` ranks: `local_world_size` if
    given, else env HFKIT_LOCAL_WORLD_SIZE (a simulated layout for tests), else torchrun's
    LOCAL_WORLD_SIZE, else `world_size` (one node)."""
    return (
        local_world_size or _env_int("HFKIT_LOCAL_WORLD_SIZE") or _env_int("LOCAL_WORLD_SIZE") or world_size
    )


class HostReduce:
    """Sum-all-reduce of tensors through node-shared host memory (see the module docstring).

    Collective: every rank of `process_group` constructs it, and calls `allreduce_` with tensors of the
    same numel and dtype, in the same order. Node layout: ranks `[n*L, (n+1)*L)` form node n, where
    L = `local_world_size` (default: env HFKIT_LOCAL_WORLD_SIZE — a simulated layout for tests — else
    torchrun's LOCAL_WORLD_SIZE, else the whole group on one node). Cross-node sums run on gloo
    "rail" groups (the ranks with the same local index on every node): each local rank is the leader
    of its slice, so node leaders' all-reduce is spread over all of a node's ranks and cores.
    Local synchronization per chunk is a barrier of counters in the shared segment on x86 (a gloo
    barrier on a node group elsewhere, and while setting up); both give up after `timeout`, so a dead
    or late peer raises a RuntimeError within `timeout` instead of hanging.

    Shared memory: one segment per node, an anonymous memory file (memfd) of the node leader that the
    other local ranks open through /proc/<leader pid>/fd while the leader holds it open; it has no name
    in /dev/shm, so nothing is left behind however a rank dies, also during set-up. (Where memfd is
    unavailable: a file in /dev/shm or the temp dir, unlinked once every local rank has mapped it.)
    Where CUDA is present the segment is pinned (cudaHostRegister) the first time a CUDA tensor is
    reduced. After a failure (a barrier timeout, a peer that gave up, a failed cross-node all-reduce)
    every later `allreduce_` raises RuntimeError: the ranks no longer agree on the chunk sequence.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        chunk_mb: float = 4.0,
        local_world_size: int | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("HostReduce: torch.distributed is not initialized (call init_distributed)")
        if chunk_mb <= 0:
            raise ValueError(f"chunk_mb: expected > 0, got {chunk_mb}")
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.timeout = timeout
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        simulated = local_world_size or _env_int("HFKIT_LOCAL_WORLD_SIZE")
        lws = node_size(self.world_size, local_world_size)
        if lws < 1 or self.world_size % lws:
            raise ValueError(
                f"local_world_size {lws} does not divide the group's world size {self.world_size} "
                "(HostReduce needs the same number of ranks on every node)"
            )
        self.local_world_size = lws
        self.num_nodes = self.world_size // lws
        self.node, self.local_rank = divmod(self.rank, lws)
        env_local = _env_int("LOCAL_RANK")
        if (
            not simulated
            and env_local is not None
            and self.group is dist.group.WORLD
            and env_local != self.local_rank
        ):
            raise ValueError(
                f"rank {self.rank}: LOCAL_RANK={env_local} but HostReduce expects {self.local_rank}; "
                "it needs torchrun's contiguous layout (global rank = node * LOCAL_WORLD_SIZE + LOCAL_RANK)"
            )
        self.chunk_bytes = max(_ALIGN, int(chunk_mb * 2**20) // _ALIGN * _ALIGN)
        self._pinned = False
        self._closed = False
        self._failure: str | None = None  # why an all-reduce failed; set once, then every call refuses
        self._side_stream: torch.cuda.Stream | None = None

        ranks = [self._global(r) for r in range(self.world_size)]
        # On the default group every rank must call new_group for every group, in the same order; on a
        # subgroup only members call, hence local synchronization there.
        local_sync = self.group is not dist.group.WORLD
        self._node_group: dist.ProcessGroup | None = None
        self._rail_group: dist.ProcessGroup | None = None
        for n in range(self.num_nodes):
            members = ranks[n * lws : (n + 1) * lws]
            if local_sync and n != self.node:
                continue
            g = dist.new_group(members, timeout=timeout, backend="gloo", use_local_synchronization=local_sync)
            if n == self.node:
                self._node_group = g
        if self.num_nodes > 1:
            for i in range(lws):
                members = [ranks[n * lws + i] for n in range(self.num_nodes)]
                if local_sync and i != self.local_rank:
                    continue
                g = dist.new_group(
                    members, timeout=timeout, backend="gloo", use_local_synchronization=local_sync
                )
                if i == self.local_rank:
                    self._rail_group = g
        self._leader = ranks[self.node * lws]
        self._epoch = 0  # counter barriers passed; every local rank passes the same ones in order
        self._segment = self._map_segment()
        flags = lws * _FLAG_BYTES
        # [L, 8] int64 view of the ranks' lines, as numpy (one read of all counters per poll).
        self._flags = self._segment[:flags].view(torch.int64).view(lws, _FLAG_BYTES // 8).numpy()
        self._buf = self._segment[flags:]  # the slots and results

    # ---------------------------------------------------------------- set-up and tear-down

    def _global(self, group_rank: int) -> int:
        if self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _map_segment(self) -> torch.Tensor:
        """Create (leader) and map (all) the node's segment; returns it as uint8.

        Layout: L lines of 64 bytes (barrier counter, gave-up mark), slots [L, 2, chunk_bytes] (each
        rank's double-buffered input chunk), then results [2, chunk_bytes] (the summed chunk,
        double-buffered). The file is created zero-filled: every counter starts at 0.
        """
        nbytes = self.local_world_size * _FLAG_BYTES + (self.local_world_size + 1) * 2 * self.chunk_bytes
        fd: int | None = None
        path: str | None = None
        named = not hasattr(os, "memfd_create")
        try:
            if self.local_rank == 0:
                if named:
                    name = f"hfkit-hfreduce-{os.getpid()}-{secrets.token_hex(6)}-n{self.node}"
                    path = os.path.join(_shm_dir(), name)
                    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                else:
                    # Open until every local rank has mapped it; freed by the kernel with its last user.
                    fd = os.memfd_create(f"hfkit-hfreduce-n{self.node}", os.MFD_CLOEXEC)
                    path = f"/proc/{os.getpid()}/fd/{fd}"
                os.ftruncate(fd, nbytes)
            # (segment path, chunk bytes) of every local rank: the leader's path for all, and a check
            # that all slice the segment alike (a different chunk_mb would read another rank's slots).
            gathered: list[Any] = [None] * self.local_world_size
            try:
                dist.all_gather_object(gathered, (path, self.chunk_bytes), group=self._node_group)
            except Exception as e:
                raise RuntimeError(
                    f"HostReduce (rank {self.rank}, node {self.node}): receiving the shared segment from the "
                    f"node leader (rank {self._leader}) failed: a local peer died or did not arrive within "
                    f"the {self.timeout} timeout ({type(e).__name__}: {e})"
                ) from e
            chunks = [c for _, c in gathered]
            if len(set(chunks)) > 1:
                raise ValueError(
                    f"chunk_mb: expected the same on every local rank of node {self.node}, got chunks of "
                    f"{chunks} bytes on local ranks 0..{self.local_world_size - 1}"
                )
            leader_path = gathered[0][0]
            try:
                buf = torch.from_file(leader_path, shared=True, size=nbytes, dtype=torch.uint8)
            except RuntimeError as e:
                raise RuntimeError(
                    f"HostReduce (rank {self.rank}, node {self.node}): cannot map the node leader's shared "
                    f"segment {leader_path} (the leader, rank {self._leader}, died during set-up?): {e}"
                ) from e
            self._barrier("mapping the shared segment")
        finally:
            if fd is not None:
                os.close(fd)
            if named and path is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        return buf

    def _pin(self) -> None:
        """Page-lock the segment so that device↔host copies are true async DMA (CUDA only)."""
        if self._pinned or not torch.cuda.is_available():
            return
        seg = self._segment
        err = torch.cuda.cudart().cudaHostRegister(seg.data_ptr(), seg.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(f"HostReduce: cudaHostRegister failed with error {int(err)}")
        self._pinned = True

    def close(self) -> None:
        """Mark this rank as gone for its local peers (one waiting for it fails at once), unpin and drop
        the shared mapping. Idempotent; an `allreduce_` running on another thread stops at its next poll.
        """
        if self._closed:
            return
        self._closed = True
        if len(self._flags):
            self._flags[self.local_rank, _GAVE_UP] = 1
        if self._pinned:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self._segment.data_ptr())
            self._pinned = False
        self._segment = self._buf = torch.empty(0, dtype=torch.uint8)
        self._flags = self._flags[:0].copy()  # drops the view that kept the mapping alive

    def __enter__(self) -> HostReduce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- synchronization

    def _barrier(self, what: str) -> None:
        try:
            dist.barrier(group=self._node_group)
        except Exception as e:
            raise RuntimeError(
                f"HostReduce (rank {self.rank}, node {self.node}): node barrier failed while {what}: a local "
                f"peer died or did not arrive within the {self.timeout} timeout ({type(e).__name__}: {e})"
            ) from e

    def _chunk_barrier(self, what: str) -> None:
        """The node's ranks meet: each raises its counter to the next epoch and waits until every
        counter has reached it. Spins briefly, then yields the core, then sleeps in growing steps (a
        late peer costs little CPU); raises RuntimeError naming the missing local ranks after `timeout`,
        or at once when one of them gave up (or this HostReduce was closed).
        """
        if not _STORE_ORDERED:
            self._barrier(what)
            return
        self._epoch += 1
        epoch, flags = self._epoch, self._flags
        counters, gave_up = flags[:, _COUNTER], flags[:, _GAVE_UP]
        counters[self.local_rank] = epoch
        start = time.monotonic()
        polls = 0
        while counters.min() < epoch:
            polls += 1
            if polls < 200:
                continue
            waited = time.monotonic() - start
            if waited < 1e-3:
                os.sched_yield()
                continue
            # Past the first millisecond a peer is late: look for one that gave up, then the timeout.
            late = counters < epoch
            if gave_up[late].any() or self._closed:
                gone = [r for r in range(self.local_world_size) if late[r] and gave_up[r]]
                reason = "this HostReduce was closed" if self._closed else f"local rank(s) {gone} gave up"
                raise RuntimeError(
                    f"HostReduce (rank {self.rank}, node {self.node}): node barrier failed while {what}: "
                    f"{reason} (a peer failed, or died, before the {self.timeout} timeout)"
                )
            if waited > self.timeout.total_seconds():
                missing = [r for r in range(self.local_world_size) if late[r]]
                raise RuntimeError(
                    f"HostReduce (rank {self.rank}, node {self.node}): node barrier failed while {what}: "
                    f"local rank(s) {missing} (a dead or late peer) did not arrive within the {self.timeout} "
                    "timeout"
                )
            time.sleep(min(1e-3, waited / 100))

    def _cross_node(self, t: torch.Tensor) -> None:
        try:
            dist.all_reduce(t, group=self._rail_group)
        except Exception as e:
            raise RuntimeError(
                f"HostReduce (rank {self.rank}, node {self.node}): cross-node all-reduce failed: a peer node "
                f"died or did not answer within the {self.timeout} timeout ({type(e).__name__}: {e})"
            ) from e

    # ---------------------------------------------------------------- the all-reduce

    def allreduce_(self, tensor: torch.Tensor, ready_event: torch.cuda.Event | None = None) -> torch.Tensor:
        """Sum `tensor` (any shape, float or int dtype, CPU or CUDA) over the group, in place; returns it.

        ready_event: for a CUDA tensor produced on another thread's stream, the event after which its
        values are final (default: the current stream is waited on). Returns once the result is in
        `tensor` (CUDA: the host waits for the last host→device copy).
        """
        if self._closed:
            raise RuntimeError("HostReduce: allreduce_ after close()")
        if self._failure is not None:
            raise RuntimeError(
                f"HostReduce (rank {self.rank}): an earlier all-reduce failed, so the ranks no longer agree "
                f"on the chunk sequence; make a new process group and HostReduce ({self._failure})"
            )
        if tensor.is_sparse or tensor.is_complex():
            raise ValueError("HostReduce: dense real tensors only")
        if not tensor.is_contiguous():
            tmp = tensor.contiguous()
            self.allreduce_(tmp, ready_event)
            tensor.copy_(tmp)
            return tensor
        try:
            return self._allreduce_contiguous(tensor, ready_event)
        except Exception as e:
            self._failure = f"{type(e).__name__}: {e}"
            if len(self._flags):
                self._flags[self.local_rank, _GAVE_UP] = 1  # local peers waiting for me fail at once
            raise

    def _allreduce_contiguous(
        self, tensor: torch.Tensor, ready_event: torch.cuda.Event | None
    ) -> torch.Tensor:
        """`allreduce_` of a contiguous dense tensor."""
        flat = tensor.view(-1)
        n = flat.numel()
        if n == 0:
            return tensor
        itemsize = flat.element_size()
        cap = self.chunk_bytes // itemsize  # elements per chunk
        L = self.local_world_size
        split = L * 2 * self.chunk_bytes
        # [L, 2, cap] input slots and [2, cap] results, viewed in the tensor's dtype.
        slots = self._buf[:split].view(flat.dtype).view(L, 2, cap)
        results = self._buf[split:].view(flat.dtype).view(2, cap)
        nchunks = math.ceil(n / cap)
        cuda = flat.is_cuda
        side: torch.cuda.Stream | None = None
        if cuda:
            self._pin()
            if self._side_stream is None or self._side_stream.device != flat.device:
                self._side_stream = torch.cuda.Stream(device=flat.device)
            side = self._side_stream
            if ready_event is not None:
                side.wait_event(ready_event)
            else:
                side.wait_stream(torch.cuda.current_stream(flat.device))

        def span(k: int) -> tuple[int, int]:
            return k * cap, min(n, (k + 1) * cap)

        def write(k: int) -> None:  # my chunk k → my slot (device→host on the side stream)
            lo, hi = span(k)
            dst = slots[self.local_rank, k % 2, : hi - lo]
            if side is not None:
                with torch.cuda.stream(side):
                    dst.copy_(flat[lo:hi], non_blocking=True)
            else:
                dst.copy_(flat[lo:hi])

        def read(k: int) -> None:  # summed chunk k → my tensor (host→device on the side stream)
            lo, hi = span(k)
            src = results[k % 2, : hi - lo]
            if side is not None:
                with torch.cuda.stream(side):
                    flat[lo:hi].copy_(src, non_blocking=True)
            else:
                flat[lo:hi].copy_(src)

        def reduce(k: int) -> None:  # my slice of chunk k: sum over local slots, then across nodes
            lo, hi = span(k)
            m = hi - lo
            a, b = self.local_rank * m // L, (self.local_rank + 1) * m // L
            if a == b:
                return
            out = results[k % 2, a:b]
            mine = slots[:, k % 2, a:b]
            if L == 1:
                out.copy_(mine[0])
            else:  # adds: one pass each, faster on the CPU than torch.sum over the slot axis
                torch.add(mine[0], mine[1], out=out)
                for i in range(2, L):
                    out.add_(mine[i])
            if self._rail_group is not None:
                self._cross_node(out)

        # One barrier per step s certifies: every rank's chunk s is in its slot, every slice of chunk
        # s-1 is summed, and every copy issued before it is complete. Hence, with double buffers, after
        # barrier s a rank may read result s-1, overwrite slot (s+1)%2 (last read when summing s-1) and
        # write result s%2 (last read by the copy-back of s-2, finished before this barrier).
        write(0)
        for s in range(nchunks + 1):
            if side is not None:
                side.synchronize()  # my device→host of chunk s and host→device of s-2 are done
            self._chunk_barrier(f"reducing chunk {s} of {nchunks}")
            if s > 0:
                read(s - 1)
            if s + 1 < nchunks:
                write(s + 1)  # overlaps (CUDA) with the reduction of chunk s below
            if s < nchunks:
                reduce(s)
        if side is not None:
            side.synchronize()
        return tensor


# ---------------------------------------------------------------- one-call all-reduce

_CACHE: dict[tuple[int, float, int | None], HostReduce] = {}


def allreduce(
    tensor: torch.Tensor,
    backend: str = "gloo",
    group: dist.ProcessGroup | None = None,
    chunk_mb: float = 4.0,
    local_world_size: int | None = None,
) -> torch.Tensor:
    """Sum `tensor` over `group` in place with backend "nccl" | "gloo" (dist.all_reduce on that group,
    whose backend must match) or "hfreduce" (a HostReduce cached per group/chunk size). Returns it.

    Collective: all ranks call it with the same backend, shape and dtype, in the same order.
    """
    if backend in ("nccl", "gloo"):
        dist.all_reduce(tensor, group=group)
        return tensor
    if backend != "hfreduce":
        raise ValueError(f"backend: expected 'nccl', 'gloo' or 'hfreduce', got {backend!r}")
    key = (id(group), float(chunk_mb), local_world_size)
    reducer = _CACHE.get(key)
    if reducer is None:
        reducer = _CACHE[key] = HostReduce(group, chunk_mb=chunk_mb, local_world_size=local_world_size)
    return reducer.allreduce_(tensor)


def close_cached() -> None:
    """Close the HostReduce objects cached by `allreduce` (call before destroying the process group)."""
    for reducer in _CACHE.values():
        reducer.close()
    _CACHE.clear()


atexit.register(close_cached)
