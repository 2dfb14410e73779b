"""hfreduce: `HostReduce`, an all-reduce staged through pinned host memory shared by a node's ranks.

After the Fire-Flyer AI-HPC paper (arXiv 2408.14158): a tensor is cut into chunks; each rank copies a
chunk device→host into its slot of a node-wide shared-memory segment; every local rank sums its 1/L
slice of the chunk over all L local slots (a reduce-scatter on the CPU); the node sums are all-reduced
across nodes over gloo; every rank copies the summed chunk host→device. One PCIe crossing each way and
no GPU kernels. The pipeline: device→host and host→device copies run on two CUDA streams (both copy
engines), so chunk k+1's download and chunk k-1's upload overlap the host sum of chunk k; slots and
results are double-buffered. The host sum is torch adds on the preallocated slots, one pass per slot, run
by one host worker thread per rank whose torch ops use `threads` intra-op (OpenMP) threads: one op per
pass over the whole slice. A pool of Python threads each adding a part ran 3x slower on the H200 host (2
ranks, 16 cores): every worker opened an OpenMP team of its own, and the parts were too small for the
hand-offs. The thread count is the worker's own (OpenMP keeps it per thread), so the training's ops
keep theirs. bf16/fp16 are summed in a float32
accumulator (also across nodes) and rounded once. The node's ranks meet once per chunk; on x86 that is
a barrier of counters in the shared segment (a few microseconds), elsewhere a gloo barrier (~0.1 ms),
since the counters rely on x86's store ordering. CPU tensors skip the device copies: their data is
copied to and from the shared slots by the same worker. Messages of at most `small_kb` on one node
take a path with one barrier instead of two: each rank sums all L slots into its own tensor.

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(minutes=10)
# Pipeline chunk. Fewer, larger chunks pay the per-chunk barrier, stream waits and launches less often;
# larger ones fill the pipeline longer. An H200 shared by 2 ranks: 64 MB took 7.9/4.7/4.6/6.3 ms and
# 1 GB 106/67/56/60 ms with 4/8/16/32 MB chunks; by 4 ranks, 1 GB took 178/122/104/123 ms. Another run
# (data/results/h200/tuning/hfreduce_chunk_*.json), 64 MB with 16/8 MB chunks: 4.6/5.2 ms by 2 ranks,
# 8.9/9.2 ms by 4.
DEFAULT_CHUNK_MB = 16.0
# Messages up to this size on one node take the one-barrier small path. On the 2-core CPU machine (2
# ranks, interleaved medians) it took 0.63/0.33/0.42/0.92 ms at 4 KB/64 KB/256 KB/1 MB against
# 1.27/0.66/0.78/1.36 ms for the two-barrier pipeline; the limit stays at 256 KB because each rank sums
# all L slots of the message there, L times the host traffic of its 1/L slice in the pipeline.
DEFAULT_SMALL_KB = 256.0
# Ops over at most this many elements run on the calling thread: ATen splits an op over at most one
# intra-op thread per 32768 elements (4 here), and a hand-off to the host worker cost more (64 KB on an
# H200 shared by 2 ranks: 0.32 ms through the worker, 0.15 ms without).
_INLINE_NUMEL = 1 << 17
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


def default_threads(local_world_size: int) -> int:
    """Intra-op threads of each rank's host worker: half the cores this process may run on, shared
    evenly by the node's `local_world_size` ranks (at least 1). Half: an OpenMP team spins between its
    parallel regions, and teams as large as a rank's whole share competed with the ranks' main threads
    and the CUDA driver (2 ranks on the H200 host's 16 cores, 64 MB: 6.3 ms with 4 threads a rank,
    7.7 ms with 8)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // (2 * max(1, local_world_size)))


def _set_intra_op_threads(threads: int) -> None:
    # Under ATen's OpenMP backend the count is the calling thread's own; under its native pool it is
    # process-wide, so there the worker keeps the process's setting.
    if "parallel backend: OpenMP" in torch.__config__.parallel_info():
        torch.set_num_threads(threads)


def host_worker(threads: int) -> ThreadPoolExecutor:
    """One thread for hfreduce's host sums and copies, its torch ops on `threads` intra-op threads
    (run a call there with `run_on`)."""
    if threads < 1:
        raise ValueError(f"threads: expected >= 1, got {threads}")
    return ThreadPoolExecutor(
        1, thread_name_prefix="hfreduce-host", initializer=_set_intra_op_threads, initargs=(threads,)
    )


def run_on(worker: ThreadPoolExecutor | None, fn: Callable[[], object], numel: int) -> None:
    """Run `fn()`, torch ops over `numel` elements, on `worker` (a `host_worker`) and wait for it; here
    when `worker` is None or the ops are small (`_INLINE_NUMEL`)."""
    if worker is None or numel <= _INLINE_NUMEL:
        fn()
    else:
        worker.submit(fn).result()


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

    Tuning: `chunk_mb` (default `DEFAULT_CHUNK_MB`; `hfkit.parallel.cost_model.best_chunk_bytes` picks
    one from the stage rates `hfkit bench comms` measures and a per-chunk cost); `threads`, the host
    worker's intra-op threads (default `default_threads`: half this process's cores over the node's
    ranks); `small_kb`, the largest message (capped at one chunk) that takes the one-barrier small path
    on one node.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        chunk_mb: float = DEFAULT_CHUNK_MB,
        local_world_size: int | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        threads: int | None = None,
        small_kb: float = DEFAULT_SMALL_KB,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("HostReduce: torch.distributed is not initialized (call init_distributed)")
        if chunk_mb <= 0:
            raise ValueError(f"chunk_mb: expected > 0, got {chunk_mb}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads: expected >= 1 or None, got {threads}")
        if small_kb < 0:
            raise ValueError(f"small_kb: expected >= 0, got {small_kb}")
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
        # The small path keeps a message in one slot: at most one chunk.
        self.small_bytes = min(self.chunk_bytes, int(small_kb * 2**10))
        self.threads = threads or default_threads(lws)
        self._pinned = False
        self._closed = False
        self._failure: str | None = None  # why an all-reduce failed; set once, then every call refuses
        self._copy_streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        self._worker: ThreadPoolExecutor | None = None  # the host worker (`host_worker`), made on first use
        self._acc = torch.empty(0, dtype=torch.float32)  # bf16/fp16 accumulator
        self._private = torch.empty(0, dtype=torch.uint8)  # the small path's result for CUDA tensors
        self._turn = 0  # chunks (small messages count one) passed: their slot parity alternates

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
            # (segment path, chunk bytes, small bytes) of every local rank: the leader's path for all,
            # and a check that all slice the segment alike (a different chunk_mb would read another
            # rank's slots) and take the same path for a message (a different small_kb would deadlock).
            gathered: list[Any] = [None] * self.local_world_size
            try:
                dist.all_gather_object(
                    gathered, (path, self.chunk_bytes, self.small_bytes), group=self._node_group
                )
            except Exception as e:
                raise RuntimeError(
                    f"HostReduce (rank {self.rank}, node {self.node}): receiving the shared segment from the "
                    f"node leader (rank {self._leader}) failed: a local peer died or did not arrive within "
                    f"the {self.timeout} timeout ({type(e).__name__}: {e})"
                ) from e
            chunks = [c for _, c, _ in gathered]
            if len(set(chunks)) > 1:
                raise ValueError(
                    f"chunk_mb: expected the same on every local rank of node {self.node}, got chunks of "
                    f"{chunks} bytes on local ranks 0..{self.local_world_size - 1}"
                )
            smalls = [b for _, _, b in gathered]
            if len(set(smalls)) > 1:
                raise ValueError(
                    f"small_kb: expected the same on every local rank of node {self.node}, got small-path "
                    f"limits of {smalls} bytes on local ranks 0..{self.local_world_size - 1}"
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
        if self._worker is not None:
            self._worker.shutdown(wait=False)
            self._worker = None

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
        """`allreduce_` of a contiguous dense tensor: the one-barrier small path, or the pipeline."""
        flat = tensor.view(-1)
        n = flat.numel()
        if n == 0:
            return tensor
        d2h: torch.cuda.Stream | None = None
        h2d: torch.cuda.Stream | None = None
        if flat.is_cuda:
            self._pin()
            d2h, h2d = self._streams(flat.device)
            if ready_event is not None:
                d2h.wait_event(ready_event)
            else:
                d2h.wait_stream(torch.cuda.current_stream(flat.device))
        if self.num_nodes == 1 and n * flat.element_size() <= self.small_bytes:
            return self._allreduce_small(tensor, d2h, h2d)
        return self._allreduce_pipelined(tensor, d2h, h2d)

    def _streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The device→host and host→device streams of `device`: two streams, so that the GPU's two
        copy engines run chunk k+1's download and chunk k-1's upload at once."""
        if self._copy_streams is None or self._copy_streams[0].device != device:
            self._copy_streams = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
        return self._copy_streams

    def _next_turn(self, count: int) -> int:
        """The slot parity of the next `count` chunks (small calls count one): parities alternate over
        all chunks of all calls, so that a slot is rewritten only two chunks, hence one barrier, after
        every local rank last read it, whichever path either call took."""
        base = self._turn
        self._turn += count
        return base

    def _allreduce_small(
        self, tensor: torch.Tensor, d2h: torch.cuda.Stream | None, h2d: torch.cuda.Stream | None
    ) -> torch.Tensor:
        """A message of at most `small_bytes` on one node, with one barrier instead of two: every rank
        writes it to its slot, meets the others, and sums all L slots into its own tensor itself."""
        flat = tensor.view(-1)
        n = flat.numel()
        parity = self._next_turn(1) % 2
        slots = self._slots(flat.dtype)
        mine = slots[self.local_rank, parity, :n]
        if d2h is not None:
            with torch.cuda.stream(d2h):
                mine.copy_(flat, non_blocking=True)
            d2h.synchronize()
        else:
            mine.copy_(flat)
        self._chunk_barrier("reducing a small message")
        inputs = slots[:, parity, :n]
        if h2d is None:
            self._sum_slots(inputs, flat)
            return tensor
        host = self._host_out(flat.dtype, n)
        self._sum_slots(inputs, host)
        with torch.cuda.stream(h2d):
            flat.copy_(host, non_blocking=True)
        h2d.synchronize()
        return tensor

    def _allreduce_pipelined(
        self, tensor: torch.Tensor, d2h: torch.cuda.Stream | None, h2d: torch.cuda.Stream | None
    ) -> torch.Tensor:
        """The chunked pipeline: chunk s+1's device→host copy (stream d2h) and chunk s-1's host→device
        copy (stream h2d) run while the host sums this rank's 1/L slice of chunk s over the local slots
        (on `threads` threads, bf16/fp16 in fp32), then all-reduces it across nodes."""
        flat = tensor.view(-1)
        n = flat.numel()
        L = self.local_world_size
        cap = self.chunk_bytes // flat.element_size()  # elements per chunk
        slots = self._slots(flat.dtype)  # [L, 2, cap]
        results = self._buf[L * 2 * self.chunk_bytes :].view(flat.dtype).view(2, cap)
        nchunks = math.ceil(n / cap)
        base = self._next_turn(nchunks)

        def span(k: int) -> tuple[int, int]:
            return k * cap, min(n, (k + 1) * cap)

        def write(k: int) -> None:  # my chunk k → my slot (device→host on its stream)
            lo, hi = span(k)
            dst = slots[self.local_rank, (base + k) % 2, : hi - lo]
            if d2h is not None:
                with torch.cuda.stream(d2h):
                    dst.copy_(flat[lo:hi], non_blocking=True)
            else:
                self._on_worker(lambda: dst.copy_(flat[lo:hi]), hi - lo)

        def read(k: int) -> None:  # summed chunk k → my tensor (host→device on its stream)
            lo, hi = span(k)
            src = results[(base + k) % 2, : hi - lo]
            if h2d is not None:
                with torch.cuda.stream(h2d):
                    flat[lo:hi].copy_(src, non_blocking=True)
            else:
                self._on_worker(lambda: flat[lo:hi].copy_(src), hi - lo)

        def reduce(k: int) -> None:  # my slice of chunk k: sum over local slots, then across nodes
            lo, hi = span(k)
            m = hi - lo
            a, b = self.local_rank * m // L, (self.local_rank + 1) * m // L
            if a < b:
                self._sum_slots(slots[:, (base + k) % 2, a:b], results[(base + k) % 2, a:b])

        # One barrier per step s certifies: every rank's chunk s is in its slot, every slice of chunk
        # s-1 is summed, and every copy issued before it is complete. Hence, with double buffers, after
        # barrier s a rank may read result s-1, overwrite slot (s+1)%2 (last read when summing s-1) and
        # write result s%2 (last read by the copy-back of s-2, finished before this barrier).
        write(0)
        for s in range(nchunks + 1):
            if d2h is not None and h2d is not None:
                d2h.synchronize()  # my device→host of chunk s is done
                h2d.synchronize()  # my host→device of chunk s-2 is done
            self._chunk_barrier(f"reducing chunk {s} of {nchunks}")
            if s > 0:
                read(s - 1)
            if s + 1 < nchunks:
                write(s + 1)  # overlaps (CUDA) with the reduction of chunk s below
            if s < nchunks:
                reduce(s)
        if h2d is not None:
            h2d.synchronize()
        return tensor

    # ---------------------------------------------------------------- the host sum

    def _slots(self, dtype: torch.dtype) -> torch.Tensor:
        """The input slots [L, 2, chunk elements] viewed in `dtype`."""
        L = self.local_world_size
        return self._buf[: L * 2 * self.chunk_bytes].view(dtype).view(L, 2, -1)

    def _host_out(self, dtype: torch.dtype, n: int) -> torch.Tensor:
        """This rank's own pinned host buffer of `n` elements of `dtype` (the small path's sum for a
        CUDA tensor, which the other ranks must not see)."""
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        if self._private.numel() < nbytes:
            self._private = torch.empty(self.small_bytes, dtype=torch.uint8, pin_memory=True)
        return self._private[:nbytes].view(dtype)

    def _accumulator(self, m: int) -> torch.Tensor:
        """A float32 scratch of `m` elements (bf16/fp16 sums are accumulated in it, then rounded once)."""
        if self._acc.numel() < m:
            self._acc = torch.empty(m, dtype=torch.float32)
        return self._acc[:m]

    def _on_worker(self, fn: Callable[[], object], numel: int) -> None:
        """`run_on` this HostReduce's host worker (made on first use, when an op is not small)."""
        if self._worker is None and numel > _INLINE_NUMEL:
            self._worker = host_worker(self.threads)
        run_on(self._worker, fn, numel)

    def _sum_slots(self, inputs: torch.Tensor, out: torch.Tensor) -> None:
        """out = the sum of `inputs` [L, m] over its first axis, then across nodes (rail group);
        bf16/fp16 accumulate in a float32 scratch (also across nodes) and are rounded once into `out`.
        Adds, one pass per slot, on the host worker (faster on the CPU than torch.sum over the slot
        axis)."""
        L = inputs.shape[0]
        widen = out.dtype in (torch.bfloat16, torch.float16)
        acc = self._accumulator(inputs.shape[1]) if widen else out
        cross = self._rail_group is not None

        def local() -> None:
            if L == 1 or widen:
                acc.copy_(inputs[0])
                rest = range(1, L)
            else:
                torch.add(inputs[0], inputs[1], out=acc)
                rest = range(2, L)
            for i in rest:
                acc.add_(inputs[i])
            if widen and not cross:
                out.copy_(acc)

        self._on_worker(local, acc.numel())
        if cross:
            self._cross_node(acc)
            if widen:
                self._on_worker(lambda: out.copy_(acc), acc.numel())


# ---------------------------------------------------------------- one-call all-reduce

_CACHE: dict[tuple[int, float, int | None], HostReduce] = {}


def allreduce(
    tensor: torch.Tensor,
    backend: str = "gloo",
    group: dist.ProcessGroup | None = None,
    chunk_mb: float = DEFAULT_CHUNK_MB,
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
