"""Launch helpers: `init_distributed` (env:// as torchrun sets it), `run_worker` (a torchrun worker's
main that ends with its error and a non-zero status, never a hang or SIGABRT at exit), `free_port`, and
`spawn_local`.

`spawn_local` starts N local processes laid out as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/MASTER_PORT), collects each rank's result or exception, and
kills every rank once `timeout_s` has passed, so a distributed test can fail but never hang.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(minutes=10)


def init_distributed(backend: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Initialize the default process group from torchrun's environment (env://), if not done yet.

    backend: "nccl" | "gloo" | None (None: nccl where CUDA is present, gloo otherwise). "hfreduce" is
    accepted and means the transport that HostReduce needs: gloo (its collectives run on host memory).
    Where CUDA is present the current device is set from LOCAL_RANK (modulo the device count, so that
    tests may put several ranks on one GPU) before the group is made, so NCCL binds each rank to its GPU.
    """
    if dist.is_initialized():
        return
    if backend in (None, "hfreduce"):
        backend = "nccl" if backend is None and torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend: expected 'nccl', 'gloo' or 'hfreduce', got {backend!r}")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise RuntimeError(
                f"init_distributed: environment variable {name} is not set (launch with torchrun)"
            )
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)


def _flush_and_exit(code: int) -> NoReturn:
    """Flush the standard streams and logging handlers, then end the process without interpreter
    teardown: no join of threads still waiting on a dead peer, no destructor of a failed process group
    (gloo's can abort the process with SIGABRT, "terminate called without an active exception")."""
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_worker(main: Callable[..., int | None], *args: Any, **kwargs: Any) -> int:
    """Run a torchrun worker's `main(*args, **kwargs)`; return its status (None counts as 0) when it
    succeeds, for `sys.exit(run_worker(main))`.

    When it raises, print the traceback to stderr and end the process at once with status 1 through
    `os._exit`, after flushing stdout, stderr and logging (a SystemExit with a non-zero status ends it
    the same way, with that status): the error and the status reach torchrun, and nothing else runs —
    no atexit handlers, no join of a thread still waiting on a dead peer, no destructor of the failed
    process group (which can end the process with SIGABRT instead of the error's status).
    """
    try:
        status = main(*args, **kwargs)
    except SystemExit as e:
        if e.code in (None, 0):
            return 0
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        _flush_and_exit(e.code if isinstance(e.code, int) else 1)
    except BaseException:  # KeyboardInterrupt included: the process must still end, not hang
        traceback.print_exc()
        _flush_and_exit(1)
    return int(status or 0)


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankError(Exception):
    """What one rank of `spawn_local` raised (type name, message, formatted traceback) or how it died."""

    def __init__(self, rank: int, type_name: str, message: str, traceback: str = "") -> None:
        super().__init__(rank, type_name, message, traceback)
        self.rank, self.type_name, self.message, self.traceback = rank, type_name, message, traceback

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.type_name}: {self.message}"


def _child(
    rank: int,
    nprocs: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    backend: str | None,
    env: dict[str, str],
    timeout_s: float,
    results: mp.Queue,
) -> None:
    """Body of one spawned rank: set torchrun's env, init the group, run `fn(rank, *args)`, report."""
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank % int(env["LOCAL_WORLD_SIZE"])),
        GROUP_RANK=str(rank // int(env["LOCAL_WORLD_SIZE"])),
    )
    # N ranks share the machine's cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    ok = False
    try:
        if backend is not None:
            init_distributed(backend, timedelta(seconds=timeout_s))
        value = fn(rank, *args)
        results.put((rank, True, value))
        ok = True
    except BaseException as e:  # report everything, including SystemExit, to the parent
        results.put((rank, False, RankError(rank, type(e).__name__, str(e), traceback.format_exc())))
    if ok and backend is not None:
        # Keep rank 0 (which hosts the TCP store) alive until every rank is done with the group.
        with contextlib.suppress(Exception):
            dist.barrier()
    results.close()
    results.join_thread()
    _flush_and_exit(0 if ok else 1)


def spawn_local(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str | None = "gloo",
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
    local_world_size: int | None = None,
    return_exceptions: bool = False,
    start_method: str | None = None,
    startup_s: float = 10.0,
) -> list[Any]:
    """Run `fn(rank, *args)` in `nprocs` local processes and return their results, by rank.

    backend: the default group each rank initializes before calling `fn` ("gloo", "nccl", or None for
    none; its timeout is `timeout_s`). env: extra environment for the ranks. local_world_size: ranks
    per simulated node for LOCAL_RANK/LOCAL_WORLD_SIZE/GROUP_RANK (default: all on one node).
    return_exceptions: put a `RankError` in the list for a rank that raised or died, instead of raising
    a RuntimeError that names every failed rank. After `timeout_s` + `startup_s` (the time allowed
    for starting the processes and the group) all ranks still running are killed and reported as
    timed out. start_method: "fork" (default on Linux
    without CUDA: no re-import of torch per rank) or "spawn" (fn and args must
    then be picklable).
    """
    if nprocs < 1:
        raise ValueError(f"nprocs: expected >= 1, got {nprocs}")
    lws = local_world_size or nprocs
    if nprocs % lws:
        raise ValueError(f"local_world_size {lws} does not divide nprocs {nprocs}")
    # A forked child cannot use CUDA once the parent has touched it, and init_distributed does: fork
    # (fast: no re-import of torch) only on machines without CUDA.
    fork_ok = sys.platform.startswith("linux") and not torch.cuda.is_available()
    method = start_method or ("fork" if fork_ok else "spawn")
    ctx = mp.get_context(method)
    child_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(lws),
        **dict(env or {}),
    }
    results: mp.Queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, nprocs, fn, args, backend, child_env, timeout_s, results),
            daemon=True,
            name=f"hfkit-rank{r}",
        )
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    # Start-up (fork/spawn, group init) is not part of the caller's budget: allow some slack.
    deadline = time.monotonic() + timeout_s + startup_s
    try:
        while len(out) < nprocs and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.1)
                out[rank] = value
                continue
            except queue.Empty:
                pass
            # A rank that died without reporting (os._exit, signal) never will: record it.
            for r, p in enumerate(procs):
                if r not in out and p.exitcode is not None:
                    # Give its queued result (if any) a moment to arrive before declaring it dead.
                    try:
                        rank, ok, value = results.get(timeout=0.5)
                        out[rank] = value
                    except queue.Empty:
                        out[r] = RankError(
                            r, "ProcessDied", f"exited with code {p.exitcode} without a result"
                        )
                    break
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(2.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    for r in range(nprocs):
        if r not in out:
            out[r] = RankError(r, "Timeout", f"still running after {timeout_s:.1f} s; killed")
    ordered = [out[r] for r in range(nprocs)]
    failed = [v for v in ordered if isinstance(v, RankError)]
    if failed and not return_exceptions:
        details = "\n".join(f"{e}\n{e.traceback}" for e in failed)
        raise RuntimeError(f"spawn_local: {len(failed)} of {nprocs} ranks failed:\n{details}")
    return ordered
