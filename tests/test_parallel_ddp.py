"""hfkit DistributedDataParallel on gloo (2 and 4 CPU ranks): averaged gradients equal single-process
full-batch gradients for backends gloo and hfreduce, overlap on and off, many small buckets, bf16
compression; parameters broadcast from rank 0; mismatched models and settings and dead ranks fail
clearly; a surviving rank's process ends promptly, with its error and a non-zero status."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hfkit.parallel import (
    DistributedDataParallel,
    RankError,
    check_same_model,
    free_port,
    run_worker,
    spawn_local,
)

BATCH = 12  # divisible by 2 and 4 ranks: equal shards, so the mean of shard means is the full mean


def _mlp(out: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, out))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 3, generator=g)


def _full_batch_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _ddp_errors(rank: int, configs: list[tuple[str, bool, str | None]]) -> dict[str, float]:
    """For each (backend, overlap, compress): max |DDP grad - full-batch grad| over two steps."""
    world = dist.get_world_size()
    x, y = _data()
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    errors: dict[str, float] = {}
    for backend, overlap, compress in configs:
        model = _mlp()
        if rank != 0:
            with torch.no_grad():  # rank 0's weights must win: they are broadcast at construction
                for p in model.parameters():
                    p.add_(1.0)
        # 200 bytes per bucket: 50 fp32 elements, so the MLP (435 parameters) spans many buckets.
        ddp = DistributedDataParallel(
            model,
            backend=backend,
            bucket_mb=200 / 2**20,
            overlap=overlap,
            compress=compress,
            timeout=timedelta(seconds=30),
            chunk_mb=0.0001,
        )
        assert len(ddp.bucket_sizes) >= 5
        # Reverse registration order: the last layer's gradients (ready first in backward) go first.
        assert ddp.bucket_sizes[:2] == [3, 3 * 16]
        ref_model = _mlp()
        key = f"{backend} overlap={overlap} compress={compress}"
        errors[key] = 0.0
        for _step in range(2):
            expected = _full_batch_grads(ref_model, x, y)
            ddp.zero_grad()
            loss = nn.functional.mse_loss(ddp(x[shard]), y[shard])
            loss.backward()
            if not overlap:
                # Nothing was communicated during backward: the gradients are still this shard's own.
                local = [p.grad.clone() for p in model.parameters()]
                ddp.sync_grad()
                assert any(not torch.equal(a, p.grad) for a, p in zip(local, model.parameters(), strict=True))
            else:
                # Most buckets were launched while backward was still running.
                assert ddp.overlapped_buckets >= len(ddp.bucket_sizes) // 2
                ddp.sync_grad()  # a no-op after an overlapped backward
            for p, e in zip(model.parameters(), expected, strict=True):
                errors[key] = max(
                    errors[key], float((p.grad - e).abs().max() / e.abs().max().clamp_min(1e-6))
                )
            # Take an SGD step on both so that step 2 checks the state reset between backwards.
            with torch.no_grad():
                for p, q, e in zip(model.parameters(), ref_model.parameters(), expected, strict=True):
                    p.sub_(0.1 * e)
                    q.sub_(0.1 * e)
        ddp.close()
    # PyTorch's own DDP on the same shards, as the reference it is meant to match.
    model = _mlp()
    torch_ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=200 / 2**20)
    expected = _full_batch_grads(_mlp(), x, y)
    nn.functional.mse_loss(torch_ddp(x[shard]), y[shard]).backward()
    errors["torch DDP"] = max(
        float((p.grad - e).abs().max() / e.abs().max())
        for p, e in zip(model.parameters(), expected, strict=True)
    )
    return errors


CONFIGS = [(backend, overlap, None) for backend in ("gloo", "hfreduce") for overlap in (True, False)] + [
    ("gloo", True, "bf16"),
    ("hfreduce", False, "bf16"),
]


@pytest.mark.parametrize("nprocs", [2, 4])
def test_ddp_gradients_match_full_batch(nprocs: int) -> None:
    env = {"HFKIT_LOCAL_WORLD_SIZE": "2"} if nprocs == 4 else None  # 4 ranks: 2 simulated nodes × 2
    for errors in spawn_local(_ddp_errors, nprocs, CONFIGS, timeout_s=60, env=env):
        for key, err in errors.items():
            # fp32: the rounding of summing in another order; bf16: 8 mantissa bits on the wire.
            assert err < (2e-2 if "bf16" in key else 1e-5), (key, err)


def _mismatch(rank: int) -> None:
    DistributedDataParallel(_mlp(out=3 if rank == 0 else 4), backend="gloo")


def test_ddp_mismatched_models_raise() -> None:
    results = spawn_local(_mismatch, 2, timeout_s=30, return_exceptions=True)
    for r in results:
        assert isinstance(r, RankError) and r.type_name == "ValueError", r
        assert "differs between ranks" in r.message and "'4.weight'" in r.message
        assert "(3, 16)" in r.message and "(4, 16)" in r.message and "rank 1" in r.message


def _mismatched_settings(rank: int) -> dict[str, str]:
    """For each case, what DistributedDataParallel's construction raised on this rank ("no error" if
    nothing): the ranks build the same model but differ in one flag or argument."""
    tiny = 200 / 2**20
    cases = {
        "requires_grad": ({}, {}),
        "bucket_mb": ({"bucket_mb": tiny}, {"bucket_mb": 2 * tiny}),
        "overlap": ({"overlap": True}, {"overlap": False}),
        "compress": ({"compress": None}, {"compress": "bf16"}),
        "chunk_mb": ({"backend": "hfreduce", "chunk_mb": 1.0}, {"backend": "hfreduce", "chunk_mb": 2.0}),
        "backend": ({"backend": "gloo"}, {"backend": "hfreduce"}),
    }
    raised = {}
    for case, kwargs in cases.items():
        model = _mlp()
        if case == "requires_grad" and rank == 1:
            model[2].weight.requires_grad_(False)  # e.g. a frozen layer on one rank only
        try:
            ddp = DistributedDataParallel(
                model, timeout=timedelta(seconds=10), **{"backend": "gloo", **kwargs[rank]}
            )
        except ValueError as e:
            raised[case] = str(e)
        else:
            raised[case] = "no error"
            ddp.close()
    return raised


def test_ddp_mismatched_settings_raise_on_every_rank() -> None:
    results = spawn_local(_mismatched_settings, 2, timeout_s=40)
    for raised in results:
        for case, message in raised.items():
            assert "differs between ranks" in message and "rank 1" in message, (case, message)
        assert (
            "parameter '2.weight': requires_grad True on rank 0 but False on rank 1"
            in raised["requires_grad"]
        )
        assert (
            f"setting 'bucket_mb' is {200 / 2**20} on rank 0 but {400 / 2**20} on rank 1"
            in raised["bucket_mb"]
        )
        assert "setting 'overlap' is True on rank 0 but False on rank 1" in raised["overlap"]
        assert "setting 'compress' is None on rank 0 but 'bf16' on rank 1" in raised["compress"]
        assert "setting 'chunk_mb' is 1.0 on rank 0 but 2.0 on rank 1" in raised["chunk_mb"]
        assert "setting 'backend' is 'gloo' on rank 0 but 'hfreduce' on rank 1" in raised["backend"]


def _different_layouts(rank: int) -> str:
    """check_same_model's message when only the derived layout differs (same model and settings)."""
    layout = {"buckets": [(5, "float32")] if rank == 0 else [(5, "float32"), (3, "bfloat16")]}
    try:
        check_same_model(_mlp(), settings={"bucket_mb": 25.0}, layout=layout)
    except ValueError as e:
        return str(e)
    return "no error"


def test_check_same_model_names_layout_difference() -> None:
    for message in spawn_local(_different_layouts, 2, timeout_s=30):
        assert "layout 'buckets' is 1 items on rank 0 but 2 on rank 1" in message, message
        assert "item 1 is nothing on rank 0 but (3, 'bfloat16') on rank 1" in message, message


def _dead_rank(rank: int, backend: str, overlap: bool, timeout_s: float) -> tuple[str, str, float, str]:
    """Rank 0's error, its message, the seconds it took, and what the next step then raised."""
    ddp = DistributedDataParallel(
        _mlp(), backend=backend, overlap=overlap, bucket_mb=200 / 2**20, timeout=timedelta(seconds=timeout_s)
    )
    x, y = _data()
    nn.functional.mse_loss(ddp(x), y).backward()
    ddp.sync_grad()  # one good step
    loss = nn.functional.mse_loss(ddp(x), y)
    if rank == 1:
        os._exit(3)  # dies inside the step, before its backward
    start = time.monotonic()
    try:
        loss.backward()
        ddp.sync_grad()
    except RuntimeError as e:
        elapsed = time.monotonic() - start
        try:  # the next step must not talk to the dead peer again
            nn.functional.mse_loss(ddp(x), y).backward()
            ddp.sync_grad()
        except RuntimeError as again:
            return (type(e).__name__, str(e), elapsed, str(again))
        return (type(e).__name__, str(e), elapsed, "no error")
    return ("no error", "", time.monotonic() - start, "")


@pytest.mark.parametrize(("backend", "overlap"), [("gloo", True), ("hfreduce", True), ("hfreduce", False)])
def test_ddp_dead_rank_fails_within_timeout(backend: str, overlap: bool) -> None:
    timeout_s = 5.0
    results = spawn_local(_dead_rank, 2, backend, overlap, timeout_s, timeout_s=30, return_exceptions=True)
    kind, message, elapsed, again = results[0]
    assert kind == "RuntimeError", results
    assert "peer" in message and "timeout" in message
    assert "an earlier gradient all-reduce failed" in again, again
    assert elapsed < timeout_s + 2.0
    assert isinstance(results[1], RankError) and results[1].type_name == "ProcessDied"


# A torchrun worker as users write it: rank 1 dies inside the second step; rank 0's error ends its main.
# argv: backend, overlap (0/1), timeout in s, wrapped (0/1: through run_worker, or plain interpreter exit).
WORKER = """
import os, sys
from datetime import timedelta

import torch
from torch import nn

from hfkit.parallel import DistributedDataParallel, init_distributed


def main(backend, overlap, timeout_s):
    timeout = timedelta(seconds=timeout_s)
    init_distributed(backend, timeout)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    # About 1 KB per bucket: 16 buckets, so that many are queued behind the one that fails.
    ddp = DistributedDataParallel(
        model, backend=backend, overlap=overlap, bucket_mb=1100 / 2**20, timeout=timeout
    )
    x = torch.randn(4, 16)
    ddp(x).sum().backward()
    ddp.sync_grad()  # one good step
    loss = ddp(x).sum()
    if int(os.environ["RANK"]) == 1:
        os._exit(3)
    loss.backward()
    ddp.sync_grad()


backend, overlap, timeout_s, wrapped = sys.argv[1], sys.argv[2] == "1", float(sys.argv[3]), sys.argv[4] == "1"
if wrapped:
    from hfkit.parallel import run_worker

    sys.exit(run_worker(main, backend, overlap, timeout_s))
main(backend, overlap, timeout_s)
"""


def _survivor_exit(
    tmp_path: Path, backend: str, overlap: bool, wrapped: bool, timeout_s: float
) -> tuple[int | None, float, str]:
    """Run WORKER as two torchrun-like processes; return rank 0's exit status (None: still running
    `timeout_s` + 5 s after rank 1 died, then killed), the seconds from rank 1's death to rank 0's
    exit, and rank 0's stderr."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    args = [backend, str(int(overlap)), str(timeout_s), str(int(wrapped))]
    procs = []
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.err", "w") as err:
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            cmd = [sys.executable, str(script), *args]
            procs.append(subprocess.Popen(cmd, env=rank_env, stdout=subprocess.DEVNULL, stderr=err))
    try:
        procs[1].wait(timeout=120)  # start-up and one good step on a busy machine
        died = time.monotonic()
        try:
            status: int | None = procs[0].wait(timeout=timeout_s + 5)
        except subprocess.TimeoutExpired:
            status = None
        return status, time.monotonic() - died, (tmp_path / "rank0.err").read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_ddp_hfreduce_overlap_survivor_exits_promptly(tmp_path: Path) -> None:
    # Plain interpreter exit: the buckets queued behind the failed one must not each wait the timeout.
    timeout_s = 5.0
    status, elapsed, stderr = _survivor_exit(tmp_path, "hfreduce", True, False, timeout_s)
    assert status is not None, f"rank 0 still running {elapsed:.1f} s after its peer died:\n{stderr[-2000:]}"
    assert status != 0 and "gradient all-reduce failed" in stderr and "peer" in stderr, stderr[-2000:]
    assert elapsed < timeout_s + 5


def test_run_worker_gloo_failure_exits_with_error_not_sigabrt(tmp_path: Path) -> None:
    timeout_s = 5.0
    status, elapsed, stderr = _survivor_exit(tmp_path, "gloo", True, True, timeout_s)
    assert status == 1, (status, stderr[-2000:])  # not -6 (SIGABRT) nor 0
    assert "RuntimeError: DistributedDataParallel (gloo): gradient all-reduce failed" in stderr, stderr[
        -2000:
    ]
    assert "terminate called" not in stderr
    assert elapsed < timeout_s + 5


def test_run_worker_returns_the_status_of_a_main_that_succeeds() -> None:
    assert run_worker(lambda: None) == 0
    assert run_worker(lambda code: code, 3) == 3
    assert run_worker(sys.exit, 0) == 0


def test_ddp_requires_initialized_group() -> None:
    with pytest.raises(RuntimeError, match="not initialized"):
        DistributedDataParallel(_mlp())


def _cuda_errors(rank: int, backend: str) -> dict[str, float]:
    """Like `_ddp_errors`, on CUDA: DDP grads vs full-batch grads, overlap on and off."""
    world = dist.get_world_size()
    x, y = (t.cuda() for t in _data())
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    errors = {}
    for overlap in (True, False):
        model = _mlp().cuda()
        ddp = DistributedDataParallel(model, backend=backend, bucket_mb=200 / 2**20, overlap=overlap)
        expected = _full_batch_grads(_mlp().cuda(), x, y)
        nn.functional.mse_loss(ddp(x[shard]), y[shard]).backward()
        ddp.sync_grad()
        errors[f"{backend} {overlap=}"] = max(
            float((p.grad - e).abs().max() / e.abs().max())
            for p, e in zip(model.parameters(), expected, strict=True)
        )
        ddp.close()
    return errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["nccl", "hfreduce"])
def test_ddp_cuda(backend: str) -> None:
    # NCCL needs one GPU per rank; hfreduce (gloo + host memory) lets two ranks share one GPU.
    nprocs = min(2, torch.cuda.device_count()) if backend == "nccl" else 2
    default = "nccl" if backend == "nccl" else "gloo"
    for errors in spawn_local(
        _cuda_errors, nprocs, backend, backend=default, timeout_s=120, start_method="spawn"
    ):
        for key, err in errors.items():
            assert err < 1e-5, (key, err)
