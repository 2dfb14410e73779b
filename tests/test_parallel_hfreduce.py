"""HostReduce (hfreduce) against dist.all_reduce on gloo: odd sizes, chunks that don't divide the
tensor, dtypes, the simulated 2 nodes × 2 layout, dead, late and closing ranks, no reuse after a failure,
and no /dev/shm leaks (also when the node leader dies during set-up)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hfkit.parallel import HostReduce, RankError, allreduce, close_cached, hfreduce, spawn_local

SIZES = (1, 7, 1000003)


def _shm_entries() -> set[str]:
    return (
        {n for n in os.listdir("/dev/shm") if n.startswith("hfkit-")} if os.path.isdir("/dev/shm") else set()
    )


@pytest.fixture(autouse=True)
def no_shm_leak() -> Iterator[None]:
    """Every test leaves /dev/shm as it found it."""
    before = _shm_entries()
    yield
    assert _shm_entries() == before, "HostReduce left shared-memory segments behind"


def _inputs(n: int, world: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """The same per-rank inputs on every rank, from a seed that depends on n only."""
    g = torch.Generator().manual_seed(n)
    if dtype.is_floating_point:
        return [torch.randn(n, generator=g).to(dtype) for _ in range(world)]
    return [torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype) for _ in range(world)]


def _compare(rank: int, local_world_size: int | None) -> list[tuple[str, float]]:
    """Max |hfreduce - dist.all_reduce| for each case, relative to the result's max magnitude."""
    world = dist.get_world_size()
    errors = []
    # 0.01 MB = 2560 fp32 elements: no size above is a multiple of it; 1 MB leaves a 3-element tail.
    for chunk_mb in (0.01, 1.0):
        with HostReduce(chunk_mb=chunk_mb, local_world_size=local_world_size) as hr:
            for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
                for n in SIZES if dtype == torch.float32 else (7, 5003):
                    x = _inputs(n, world, dtype)[rank].clone()
                    ref = x.clone()
                    assert hr.allreduce_(x) is x
                    dist.all_reduce(ref)
                    scale = max(1.0, float(ref.abs().max()))
                    errors.append((f"{chunk_mb=} {dtype} {n=}", float((x - ref).abs().max()) / scale))
            # Non-contiguous input: reduced through a contiguous copy, written back in place.
            base = _inputs(35, world, torch.float32)[rank].view(5, 7)
            x, ref = base.clone().t(), base.clone().t()
            hr.allreduce_(x)
            dist.all_reduce(ref)
            errors.append(("transposed", float((x - ref).abs().max())))
    # The benchmark's one-call API: gloo and hfreduce agree.
    a = _inputs(1001, world, torch.float32)[rank].clone()
    b = a.clone()
    allreduce(a, "gloo")
    allreduce(b, "hfreduce", chunk_mb=0.001, local_world_size=local_world_size)
    close_cached()
    errors.append(("allreduce()", float((a - b).abs().max())))
    return errors


def test_hfreduce_matches_allreduce_two_ranks() -> None:
    # One node of two ranks: each element is summed in the same order as gloo, so results agree to
    # fp32 rounding of a 2-term sum (in practice bit for bit).
    for rank_errors in spawn_local(_compare, 2, None, timeout_s=60):
        for case, err in rank_errors:
            assert err <= 1e-6 if "bfloat16" not in case else err <= 1e-2, (case, err)


def _compare_with_gloo_barriers(rank: int) -> list[tuple[str, float]]:
    hfreduce._STORE_ORDERED = False  # as on Arm: every chunk's barrier through gloo
    return _compare(rank, None)


def test_hfreduce_with_gloo_barriers() -> None:
    for rank_errors in spawn_local(_compare_with_gloo_barriers, 2, timeout_s=60):
        for case, err in rank_errors:
            assert err <= 1e-6 if "bfloat16" not in case else err <= 1e-2, (case, err)


def test_hfreduce_simulated_two_nodes() -> None:
    # 4 ranks as 2 nodes × 2 (env HFKIT_LOCAL_WORLD_SIZE, as a test harness would set it): local sums on
    # the host, then cross-node sums over gloo. Summation order differs from gloo's: fp32 rounding.
    results = spawn_local(_compare, 4, None, timeout_s=60, env={"HFKIT_LOCAL_WORLD_SIZE": "2"})
    for rank_errors in results:
        for case, err in rank_errors:
            assert err <= 1e-6 if "bfloat16" not in case else err <= 2e-2, (case, err)


def _layout(rank: int) -> tuple[int, int, int]:
    hr = HostReduce(local_world_size=2)
    try:
        with pytest.raises(ValueError, match="does not divide"):
            HostReduce(local_world_size=3)
        return hr.node, hr.local_rank, hr.num_nodes
    finally:
        hr.close()


def test_hfreduce_layout() -> None:
    assert spawn_local(_layout, 4, timeout_s=30) == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]


def _different_chunks(rank: int) -> str:
    try:
        HostReduce(chunk_mb=1.0 + rank, timeout=timedelta(seconds=10))
    except ValueError as e:
        return str(e)
    return "no error"


def test_hfreduce_different_chunk_sizes_raise_on_every_rank() -> None:
    for message in spawn_local(_different_chunks, 2, timeout_s=30):
        assert "chunk_mb: expected the same on every local rank" in message, message
        assert f"[{2**20}, {2 * 2**20}]" in message, message


def _dead_or_late(rank: int, mode: str, timeout_s: float) -> tuple[str, str, float, str]:
    """Rank 0's error, its message, the seconds it took, and what a second all-reduce then raised."""
    hr = HostReduce(chunk_mb=0.01, timeout=timedelta(seconds=timeout_s))
    x = torch.ones(10000)
    hr.allreduce_(x)  # one good step
    if rank == 1:
        if mode == "dead":
            os._exit(3)  # dies mid-training without a word
        time.sleep(timeout_s + 1)  # alive but late: the others must give up at the timeout
        return ("late", "", 0.0, "")
    start = time.monotonic()
    try:
        hr.allreduce_(x)
    except RuntimeError as e:
        elapsed = time.monotonic() - start
        try:  # the ranks no longer agree on the chunk sequence: no second try
            hr.allreduce_(x)
        except RuntimeError as again:
            return (type(e).__name__, str(e), elapsed, str(again))
        return (type(e).__name__, str(e), elapsed, "no error")
    finally:
        hr.close()
    return ("no error", "", time.monotonic() - start, "")


@pytest.mark.parametrize("mode", ["dead", "late"])
def test_hfreduce_dead_or_late_rank_fails_within_timeout(mode: str) -> None:
    timeout_s = 3.0
    results = spawn_local(_dead_or_late, 2, mode, timeout_s, timeout_s=30, return_exceptions=True)
    kind, message, elapsed, again = results[0]
    assert kind == "RuntimeError", results
    assert "an earlier all-reduce failed" in again and "local rank(s) [1]" in again, again
    assert "HostReduce" in message and "timeout" in message and "peer" in message
    if hfreduce._STORE_ORDERED:  # the counter barrier names the local rank that did not arrive
        assert "local rank(s) [1]" in message, message
    assert elapsed < timeout_s + 2.0
    if mode == "dead":
        assert isinstance(results[1], RankError) and results[1].type_name == "ProcessDied"


def _peer_closes(rank: int, timeout_s: float) -> tuple[str, str, float]:
    """Rank 1 closes its HostReduce instead of joining the second all-reduce (its own loop failed):
    rank 0's error, its message and the seconds it took."""
    hr = HostReduce(chunk_mb=0.01, timeout=timedelta(seconds=timeout_s))
    x = torch.ones(10000)
    hr.allreduce_(x)  # one good step
    if rank == 1:
        hr.close()
        return ("closed", "", 0.0)
    start = time.monotonic()
    try:
        hr.allreduce_(x)
    except RuntimeError as e:
        return (type(e).__name__, str(e), time.monotonic() - start)
    finally:
        hr.close()
    return ("no error", "", time.monotonic() - start)


@pytest.mark.skipif(not hfreduce._STORE_ORDERED, reason="the gave-up mark is read by the counter barrier")
def test_hfreduce_peer_that_gives_up_fails_the_others_at_once() -> None:
    timeout_s = 20.0  # far longer than the wait allowed below: the mark, not the timeout, ends it
    kind, message, elapsed = spawn_local(_peer_closes, 2, timeout_s, timeout_s=40)[0]
    assert kind == "RuntimeError" and "local rank(s) [1] gave up" in message, (kind, message)
    assert elapsed < 5.0


def _leader_dies_in_setup(rank: int, timeout_s: float) -> tuple[str, str, float]:
    """The node leader (rank 0) dies at its first node barrier of the set-up, its segment made but
    not yet mapped by its late peer; the peer's error, message and the seconds it took."""
    if rank == 0:
        HostReduce._barrier = lambda self, what: os._exit(3)  # this forked rank only
    else:
        time.sleep(1.0)  # the late peer
    start = time.monotonic()
    try:
        HostReduce(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        return (type(e).__name__, str(e), time.monotonic() - start)
    return ("no error", "", time.monotonic() - start)


def test_hfreduce_leader_dead_in_setup_leaves_no_segment() -> None:
    before = _shm_entries()
    timeout_s = 5.0
    results = spawn_local(_leader_dies_in_setup, 2, timeout_s, timeout_s=30, return_exceptions=True)
    assert isinstance(results[0], RankError) and results[0].type_name == "ProcessDied", results
    kind, message, elapsed = results[1]
    assert kind == "RuntimeError" and "HostReduce" in message, results
    assert elapsed < timeout_s + 2.0
    assert _shm_entries() == before


def _raise(rank: int) -> None:
    if rank == 1:
        raise KeyError("boom")


def _hang(rank: int) -> None:
    time.sleep(60)


def test_spawn_local_reports_errors_and_kills_hung_ranks() -> None:
    with pytest.raises(RuntimeError, match="rank 1: KeyError"):
        spawn_local(_raise, 2, backend=None, timeout_s=10)
    start = time.monotonic()
    results = spawn_local(_hang, 2, backend=None, timeout_s=1.0, startup_s=1.0, return_exceptions=True)
    assert time.monotonic() - start < 6
    assert all(isinstance(r, RankError) and r.type_name == "Timeout" for r in results)


def _cuda_compare(rank: int) -> list[tuple[str, float]]:
    """HostReduce on CUDA tensors (device→host→device through the pinned shared slots) vs gloo on CPU."""
    world = dist.get_world_size()
    errors = []
    with HostReduce(chunk_mb=1.0) as hr:
        for n in SIZES:
            cpu = _inputs(n, world, torch.float32)[rank].clone()
            x = cpu.cuda()
            hr.allreduce_(x)
            dist.all_reduce(cpu)
            errors.append((f"cuda {n=}", float((x.cpu() - cpu).abs().max())))
    return errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hfreduce_cuda_tensors() -> None:
    # Two ranks may share one GPU: HostReduce's transport is gloo plus host memory.
    for rank_errors in spawn_local(_cuda_compare, 2, timeout_s=120, start_method="spawn"):
        for case, err in rank_errors:
            assert err <= 1e-6, (case, err)


def _rounded_once(n: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    """The float32 sum of every rank's input, rounded once to `dtype`."""
    return torch.stack([x.float() for x in _inputs(n, world, dtype)]).sum(0).to(dtype)


def _threads_and_fp32_accumulation(rank: int, local_world_size: int | None) -> list[tuple[str, float]]:
    """Two host-sum threads, odd sizes on both paths (small: one barrier; pipelined: chunks that do not
    divide the tensor), calls of either path in turn on one HostReduce: max |error| per case against
    dist.all_reduce (fp32, int64) or the float32 sum rounded once (bf16, fp16; 0 expected)."""
    world = dist.get_world_size()
    errors = []
    with HostReduce(chunk_mb=1.0, threads=2, small_kb=64, local_world_size=local_world_size) as hr:
        assert hr.threads == 2 and hr.small_bytes == 64 << 10
        for n in (7, 5003, 1000003, 11, 300007):
            for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.float16):
                x = _inputs(n, world, dtype)[rank].clone()
                if dtype in (torch.bfloat16, torch.float16):
                    ref = _rounded_once(n, world, dtype)
                else:
                    ref = x.clone()
                    dist.all_reduce(ref)
                hr.allreduce_(x)
                assert x.dtype == dtype
                scale = max(1.0, float(ref.float().abs().max())) if dtype == torch.float32 else 1.0
                errors.append((f"{dtype} {n=}", float((x.float() - ref.float()).abs().max()) / scale))
        # The sums ran on the host worker.
        errors.append(("host worker used", 0.0 if hr._worker is not None else 1.0))
    return errors


@pytest.mark.parametrize("nodes", [1, 2], ids=["one_node", "two_nodes"])
def test_hfreduce_threads_and_fp32_accumulation(nodes: int) -> None:
    # bf16/fp16 are summed in fp32 (also across nodes) and rounded once: they equal the float32 sum of
    # the inputs rounded once, whatever the order of the adds (sums of 4 bf16/fp16 inputs are exact in
    # fp32). fp32 sums of 2 terms equal gloo's; over 2 nodes × 2 the order differs: fp32 rounding.
    env = {"HFKIT_LOCAL_WORLD_SIZE": "2"} if nodes == 2 else None
    results = spawn_local(_threads_and_fp32_accumulation, 2 * nodes, None, timeout_s=120, env=env)
    for rank_errors in results:
        for case, err in rank_errors:
            if "float32" in case:
                assert err <= 1e-6, (case, err)
            else:
                assert err == 0.0, (case, err)


def _bad_arguments(rank: int) -> list[str]:
    messages = []
    for kwargs in ({"threads": 0}, {"small_kb": -1.0}):
        try:
            HostReduce(**kwargs)
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_hfreduce_rejects_bad_threads_and_small_kb() -> None:
    for messages in spawn_local(_bad_arguments, 2, timeout_s=30):
        assert messages == ["threads: expected >= 1 or None, got 0", "small_kb: expected >= 0, got -1.0"]


def test_default_threads_share_the_cores() -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert hfreduce.default_threads(1) == max(1, cores // 2)
    assert hfreduce.default_threads(10**6) == 1


def test_host_worker_runs_torch_ops_on_its_own_threads() -> None:
    """The host worker's torch ops use the intra-op thread count it was made with (OpenMP keeps it per
    thread), run_on waits for the call, and the caller's own count is left as it was."""
    before = torch.get_num_threads()
    openmp = "parallel backend: OpenMP" in torch.__config__.parallel_info()
    worker = hfreduce.host_worker(1)
    seen: list[tuple[int, str]] = []
    big = hfreduce._INLINE_NUMEL + 1

    def record() -> None:
        seen.append((torch.get_num_threads(), threading.current_thread().name))

    try:
        hfreduce.run_on(worker, record, big)
        assert len(seen) == 1  # run_on returned after the call ran
        hfreduce.run_on(worker, record, hfreduce._INLINE_NUMEL)  # small ops: here, not on the worker
    finally:
        worker.shutdown()
    assert torch.get_num_threads() == before
    assert seen[0][1].startswith("hfreduce-host") and seen[1][1] == threading.current_thread().name
    if openmp:
        assert seen[0][0] == 1
    hfreduce.run_on(None, record, big)  # no worker: runs here
    assert seen[-1][1] == threading.current_thread().name
    with pytest.raises(ValueError, match="threads: expected >= 1, got 0"):
        hfreduce.host_worker(0)


def _cuda_streams(rank: int) -> list[tuple[str, float]]:
    """CUDA tensors through both paths, fp32 and bf16, with a producer on another stream (ready_event):
    errors against gloo's fp32 sum and the float32 sum rounded once; and whether two copy streams ran."""
    world = dist.get_world_size()
    errors = []
    with HostReduce(chunk_mb=1.0, small_kb=64) as hr:
        producer = torch.cuda.Stream()
        for n in SIZES:
            for dtype in (torch.float32, torch.bfloat16):
                cpu = _inputs(n, world, dtype)[rank].clone()
                with torch.cuda.stream(producer):
                    x = cpu.cuda(non_blocking=False) * 1  # written on the producer stream
                    ready = torch.cuda.Event()
                    ready.record(producer)
                hr.allreduce_(x, ready_event=ready)
                if dtype == torch.float32:
                    dist.all_reduce(cpu)
                    ref = cpu
                else:
                    ref = _rounded_once(n, world, dtype)
                errors.append((f"cuda {dtype} {n=}", float((x.cpu().float() - ref.float()).abs().max())))
        d2h, h2d = hr._copy_streams
        errors.append(("two copy streams", 0.0 if d2h != h2d else 1.0))
    return errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the copy streams are CUDA streams")
def test_hfreduce_cuda_separate_copy_streams() -> None:
    for rank_errors in spawn_local(_cuda_streams, 2, timeout_s=120, start_method="spawn"):
        for case, err in rank_errors:
            assert err <= (1e-6 if "float32" in case else 0.0), (case, err)


def _different_small_kb(rank: int) -> str:
    try:
        HostReduce(small_kb=64.0 * (1 + rank), timeout=timedelta(seconds=10))
    except ValueError as e:
        return str(e)
    return "no error"


def test_hfreduce_different_small_kb_raise_on_every_rank() -> None:
    # Ranks that disagree on the small path's limit would take different paths for one message.
    for message in spawn_local(_different_small_kb, 2, timeout_s=30):
        assert "small_kb: expected the same on every local rank" in message, message
        assert f"[{64 << 10}, {128 << 10}]" in message, message


def _late_every_time(rank: int) -> list[float]:
    """Rank 1 arrives 0.05 s late at each all-reduce, so rank 0 waits past its spin in every barrier:
    max |error| against gloo for each call."""
    world = dist.get_world_size()
    errors = []
    with HostReduce(chunk_mb=0.01, timeout=timedelta(seconds=20)) as hr:
        for n in (7, 5003, 30011):
            if rank == 1:
                time.sleep(0.05)
            x = _inputs(n, world, torch.float32)[rank].clone()
            ref = x.clone()
            hr.allreduce_(x)
            dist.all_reduce(ref)
            errors.append(float((x - ref).abs().max()))
    return errors


def test_hfreduce_late_peer_each_call_is_waited_for() -> None:
    for rank_errors in spawn_local(_late_every_time, 2, timeout_s=60):
        assert rank_errors == [0.0, 0.0, 0.0], rank_errors
