"""Dynamic Axial Parallelism on gloo (2 and 4 CPU ranks): the autograd collectives' forwards and
backwards equal their single-process equivalents; `to_dap` of an Evoformer block, a 2-block
EvoformerStack and a 2-block ExtraMSAStack gives the outputs and every parameter and input gradient of
the single-process module (float64: 1e-10 relative, float32: 1e-5), with N and S not divisible by the
group size, masked residues and MSA rows (fully masked ones included), chunking, checkpointing, dropout
(same seed on every rank), and a 2 x 2 dp x dap layout; a dead rank gives a clear error within the
group's timeout. Duality async: the asynchronous collectives' forwards and backwards equal the
synchronous ones exactly, and `to_dap(..., overlap=True)` gives bit-identical outputs and gradients to
`overlap=False`."""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_model import perturbed, random_batch

from hfkit.model import AlphaFoldLite, EvoformerBlock, EvoformerStack, ExtraMSAStack, ModelConfig
from hfkit.nn import EvoformerAttention, to_hfkit
from hfkit.parallel import RankError, spawn_local
from hfkit.parallel.dap import (
    OVERLAPPED_WITH,
    Pending,
    all_to_all,
    dap_block_comm,
    dap_groups,
    gather,
    pad_to_multiple,
    reduce_grads,
    scatter,
    start_all_to_all,
    start_gather,
    to_dap,
)


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-300) -> float:
    """max |a - b| relative to max |b|, or to `floor` where that is larger."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(floor))


def _errors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """`_rel` of each entry. A gradient that is zero in exact arithmetic (msa_att_row.layer_norm_z.bias:
    it shifts all of a query's logits alike, and softmax ignores that) holds only rounding noise, so
    each entry is compared against at least 1e-3 of the largest magnitude among all entries."""
    assert got.keys() == expected.keys()
    floor = 1e-3 * max(float(v.abs().max()) for v in expected.values())
    return {key: _rel(got[key], expected[key], floor) for key in expected}


# ---- collectives -------------------------------------------------------------------------------------


def _collective_errors(rank: int) -> dict[str, float]:
    """For each collective: the relative error of its forward and of its input gradient against the
    single-process equivalent (a weighted sum as the loss, the same weights on every rank)."""
    p, torch_dtype = dist.get_world_size(), torch.float64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4 * p, 2 * p, 5, generator=g, dtype=torch_dtype)
    w = torch.randn(3, 4 * p, 2 * p, 5, generator=g, dtype=torch_dtype)
    errors: dict[str, float] = {}

    # scatter: the full tensor on every rank; the loss is the sum over ranks of the local parts' terms,
    # each rank's backward sees only its own part's term: the gathered gradient is the full one, w.
    xs = x.clone().requires_grad_()
    part = scatter(xs, 1, None)
    errors["scatter fwd"] = _rel(part, x.chunk(p, 1)[rank])
    (part * w.chunk(p, 1)[rank]).sum().backward()
    errors["scatter bwd"] = _rel(xs.grad, w)

    # gather, partial: rank r's loss uses the whole result with its own weights w * (r + 1); the
    # single-process gradient of the summed loss is w * sum_r (r + 1), this rank's part of it.
    xl = x.chunk(p, 2)[rank].clone().requires_grad_()
    whole = gather(xl, 2, None, partial=True)
    errors["gather fwd"] = _rel(whole, x)
    (whole * w * (rank + 1)).sum().backward()
    total = sum(r + 1 for r in range(p))
    errors["gather partial bwd"] = _rel(xl.grad, (w * total).chunk(p, 2)[rank])

    # gather, replicated: every rank computes the same loss; its gradient is this rank's part of w.
    xl = x.chunk(p, 2)[rank].clone().requires_grad_()
    (gather(xl, 2, None, partial=False) * w).sum().backward()
    errors["gather replicated bwd"] = _rel(xl.grad, w.chunk(p, 2)[rank])

    # all_to_all: rows (dim 1) sharded -> columns (dim 2) sharded; backward the inverse.
    xr = x.chunk(p, 1)[rank].clone().requires_grad_()
    cols = all_to_all(xr, 2, 1, None)
    errors["all_to_all fwd"] = _rel(cols, x.chunk(p, 2)[rank])
    (cols * w.chunk(p, 2)[rank]).sum().backward()
    errors["all_to_all bwd"] = _rel(xr.grad, w.chunk(p, 1)[rank])
    back = all_to_all(cols.detach(), 1, 2, None)
    errors["all_to_all inverse"] = _rel(back, x.chunk(p, 1)[rank])

    # reduce_grads: identity forward; the gradients summed over ranks (one all-reduce a dtype: a float32
    # tensor beside the float64 one, with integer weights, so its sum is exact too); an unused one's None.
    xp = x.clone().requires_grad_()
    yp = torch.zeros(2, 3, requires_grad=True)
    unused = torch.zeros(4, requires_grad=True)
    xr, yr, _ = reduce_grads((xp, yp, unused), None)
    wy = torch.arange(6.0).view(2, 3)
    ((xr * w).sum() + (yr * wy).sum().double()).mul(rank + 1).backward()
    errors["reduce_grads bwd"] = _rel(xp.grad, w * total)
    errors["reduce_grads bwd float32"] = _rel(yp.grad.double(), wy.double() * total)
    errors["reduce_grads unused"] = float(unused.grad is not None)

    # padding: zeros appended up to the multiple.
    odd = x[:, :5]
    padded = pad_to_multiple(odd, 1, 4)
    errors["pad shape"] = float(padded.shape[1] != 8)
    errors["pad values"] = _rel(padded[:, :5], odd) + float(padded[:, 5:].abs().max())
    return errors


@pytest.mark.parametrize("nprocs", [2, 4])
def test_collectives_forward_and_backward_exact(nprocs: int) -> None:
    for errors in spawn_local(_collective_errors, nprocs, timeout_s=60):
        assert set(errors) >= {"scatter bwd", "gather partial bwd", "all_to_all bwd", "reduce_grads bwd"}
        assert max(errors.values()) <= 1e-12, errors


# ---- Evoformer block -----------------------------------------------------------------------------------


def _config(dropout: bool = False) -> ModelConfig:
    rate = {} if dropout else {"msa_dropout": 0.0, "pair_dropout": 0.0}
    return ModelConfig.tiny().replace(extra_no_blocks=2, **rate)


def _perturbed(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`module` in `dtype` with every parameter perturbed (its zero-initialised output projections would
    otherwise hide most of the computation)."""
    module = module.to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return module


def _block(dtype: torch.dtype, dropout: bool = False, extra: bool = False) -> EvoformerBlock:
    """The tiny config's first Evoformer block (with `extra`: extra-MSA block), perturbed; dropout off
    unless `dropout`."""
    torch.manual_seed(0)
    stack = (ExtraMSAStack if extra else EvoformerStack).from_config(_config(dropout))
    return _perturbed(stack.blocks[0], dtype)


def _inputs(
    n_seq: int,
    n_res: int,
    masked: bool,
    dtype: torch.dtype,
    seed: int = 1,
    c_m: int = 16,
    batch: tuple[int, ...] = (),
) -> tuple:
    """m [*batch, n_seq, n_res, c_m], z, msa_mask, pair_mask (the same on every rank); with `masked`,
    random masked entries plus a padded MSA row and a padded residue (all their entries masked)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(*batch, n_seq, n_res, c_m, generator=g, dtype=dtype)
    z = torch.randn(*batch, n_res, n_res, ModelConfig.tiny().c_z, generator=g, dtype=dtype)
    msa_mask = torch.ones(*batch, n_seq, n_res, dtype=dtype)
    seq_mask = torch.ones(*batch, n_res, dtype=dtype)
    if masked:
        msa_mask = (torch.rand(*batch, n_seq, n_res, generator=g) > 0.2).to(dtype)
        msa_mask[..., -1, :] = 0
        seq_mask[..., -1] = 0
        msa_mask[..., -1] = 0
    pair_mask = seq_mask[..., :, None] * seq_mask[..., None, :]
    return m, z, msa_mask, pair_mask


def _outputs_and_grads(module, m, z, msa_mask, pair_mask, chunk_size=None, seed=None) -> dict:
    """Outputs, input gradients and parameter gradients of a fixed random weighting of the outputs
    (the same weights on every rank). `seed`: the generator's seed just before the forward (dropout)."""
    module.zero_grad()
    m = m.clone().requires_grad_()
    z = z.clone().requires_grad_()
    if seed is not None:
        torch.manual_seed(seed)
    outputs = module(m, z, msa_mask, pair_mask, chunk_size=chunk_size)
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs
    g = torch.Generator().manual_seed(7)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outputs)
    loss.backward()
    out = {f"out {i}": o.detach() for i, o in enumerate(outputs)}
    out.update({"grad m": m.grad, "grad z": z.grad})
    out.update({f"grad {name}": p.grad.clone() for name, p in module.named_parameters()})
    return out


def _compare(module: torch.nn.Module, args: tuple, **kwargs) -> dict[str, float]:
    """Errors of `to_dap(module)` (default group) against `module` itself, after checking that they
    share their parameters and state_dict keys."""
    expected = _outputs_and_grads(module, *args, seed=kwargs.get("seed"))
    dap = to_dap(module, None)
    assert dap.state_dict().keys() == module.state_dict().keys()
    assert all(a is b for a, b in zip(dap.parameters(), module.parameters(), strict=True))
    return _errors(_outputs_and_grads(dap, *args, **kwargs), expected)


def _block_errors(rank: int, case: dict[str, Any]) -> dict[str, float]:
    """Relative error of every output and gradient of the DAP block against the single-process block,
    for `case` (n_seq, n_res, masked, dtype, chunk_size, extra: see the test's table)."""
    dtype, extra = case["dtype"], case["extra"]
    c_m = ModelConfig.tiny().c_e if extra else ModelConfig.tiny().c_m
    args = _inputs(case["n_seq"], case["n_res"], case["masked"], dtype, c_m=c_m)
    return _compare(_block(dtype, extra=extra), args, chunk_size=case["chunk_size"])


def _assert_within(results: list[dict[str, float]], tol: float, min_entries: int) -> None:
    for errors in results:
        assert len(errors) >= min_entries  # outputs, input gradients and every parameter's gradient
        worst = max(errors, key=errors.get)
        assert errors[worst] <= tol, (worst, errors[worst])


_BLOCK_CASE_KEYS = ("nprocs", "n_seq", "n_res", "masked", "dtype", "chunk_size", "extra")


@pytest.mark.parametrize(
    "case",
    [
        dict(zip(_BLOCK_CASE_KEYS, values, strict=True))
        for values in [
            (2, 4, 6, False, torch.float64, None, False),
            (2, 5, 7, True, torch.float64, 2, False),
            (4, 5, 7, True, torch.float64, None, False),
            (2, 5, 7, True, torch.float32, None, False),
            (4, 6, 7, True, torch.float64, 3, True),
        ]
    ],
    ids=lambda case: "-".join(str(v) for v in case.values()),
)
def test_dap_block_equals_single_process(case: dict[str, Any]) -> None:
    tol = 1e-10 if case["dtype"] == torch.float64 else 1e-5
    results = spawn_local(_block_errors, case["nprocs"], case, timeout_s=90)
    _assert_within(results, tol, 4 + 30)


def _batched_errors(rank: int) -> dict[str, float]:
    """A leading batch axis of 2 samples (masked, N and S not divisible by the group)."""
    return _compare(_block(torch.float64), _inputs(5, 7, True, torch.float64, batch=(2,)))


def test_dap_block_with_a_batch_axis_equals_single_process() -> None:
    _assert_within(spawn_local(_batched_errors, 2, timeout_s=90), 1e-10, 4 + 30)


def _dropout_errors(rank: int) -> dict[str, float]:
    """Dropout on (training mode), every rank seeding its generator alike before the forward, as one
    process does: the shared-dimension masks are then one process's (N and S divide by the group)."""
    block = _block(torch.float64, dropout=True).train()
    assert block.msa_dropout_layer.rate > 0 and block.core.ps_dropout_row_layer.rate > 0
    args = _inputs(4, 6, True, torch.float64)
    errors = _compare(block, args, seed=3)
    # The dropout is live: another seed gives another result.
    other = _outputs_and_grads(block, *args, seed=4)
    same = _outputs_and_grads(block, *args, seed=3)
    errors["different seed differs"] = float(torch.equal(other["out 1"], same["out 1"]))
    return errors


def test_dap_block_with_dropout_equals_single_process_given_the_same_seed() -> None:
    _assert_within(spawn_local(_dropout_errors, 2, timeout_s=90), 1e-10, 4 + 30)


def _stack_errors(rank: int, extra: bool, recompute: bool) -> dict[str, float]:
    """A 2-block EvoformerStack (outputs m, z, s) or ExtraMSAStack (output z) against one process."""
    torch.manual_seed(0)
    config = _config().replace(checkpoint=recompute)
    if extra:
        stack = _perturbed(ExtraMSAStack.from_config(config), torch.float64)
        args = _inputs(6, 7, True, torch.float64, c_m=config.c_e)
    else:
        stack = _perturbed(EvoformerStack.from_config(config), torch.float64)
        args = _inputs(5, 7, True, torch.float64)
    assert len(stack.blocks) == 2
    return _compare(stack, args)


@pytest.mark.parametrize(
    ("nprocs", "extra", "recompute"), [(2, False, False), (4, False, True), (2, True, True), (4, True, False)]
)
def test_dap_stacks_equal_single_process(nprocs: int, extra: bool, recompute: bool) -> None:
    results = spawn_local(_stack_errors, nprocs, extra, recompute, timeout_s=120)
    _assert_within(results, 1e-10, 3 + 2 * 30)


def _left_behind(rank: int, overlap: bool) -> int:
    """`Pending` objects still alive after forward+backward of a checkpointed 2-block DAP stack, with the
    garbage collector off (objects in reference cycles stay, holding their buffers, until it runs)."""
    torch.manual_seed(0)
    stack = _perturbed(EvoformerStack.from_config(_config().replace(checkpoint=True)), torch.float64)
    m, z, msa_mask, pair_mask = _inputs(5, 7, True, torch.float64)
    dap = to_dap(stack, None, overlap=overlap)
    gc.collect()
    gc.disable()
    try:
        m_out, z_out, s_out = dap(m.requires_grad_(), z.requires_grad_(), msa_mask, pair_mask)
        (m_out.sum() + z_out.sum() + s_out.sum()).backward()
        del m_out, z_out, s_out
        return sum(isinstance(o, Pending) for o in gc.get_objects())
    finally:
        gc.enable()


@pytest.mark.parametrize("overlap", [True, False])
def test_checkpointed_dap_stack_leaves_no_collective_behind(overlap: bool) -> None:
    # Recomputation runs every block to its end: stopped early, it abandoned collectives in reference
    # cycles, with their buffers and the recomputed activations.
    assert spawn_local(_left_behind, 2, overlap, timeout_s=120) == [0, 0]


def test_to_dap_rejects_other_modules() -> None:
    with pytest.raises(TypeError, match="module: expected an EvoformerBlock"):
        to_dap(torch.nn.Linear(2, 2))


def _dp_dap_errors(rank: int) -> dict[str, float]:
    """2 x 2: two data-parallel replicas, each a DAP group of 2 on its own sample; gradients summed over
    the DAP group (by the block) and averaged over the dp group equal one process's mean-loss gradients."""
    groups = dap_groups(2, timeout=timedelta(seconds=60))
    assert (groups.dap_size, groups.dp_size) == (2, 2)
    assert (groups.dap_rank, groups.dp_rank) == (rank % 2, rank // 2)
    dtype = torch.float64
    block = _block(dtype)
    samples = [_inputs(4, 5, True, dtype, seed=s) for s in (1, 2)]
    expected = [_outputs_and_grads(block, *sample) for sample in samples]
    dap = to_dap(block, groups.dap)
    got = _outputs_and_grads(dap, *samples[groups.dp_rank])
    want = dict(expected[groups.dp_rank])
    for key in got:
        if key.startswith("grad ") and key not in ("grad m", "grad z"):
            dist.all_reduce(got[key], group=groups.dp)
            got[key] /= groups.dp_size
            want[key] = (expected[0][key] + expected[1][key]) / 2
    return _errors(got, want)


def test_dp_times_dap_layout() -> None:
    for errors in spawn_local(_dp_dap_errors, 4, timeout_s=120):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-10, (worst, errors[worst])


def _dead_rank(rank: int, timeout_s: float, how: str) -> tuple[str, str, float]:
    """Rank 0's error type, message and the seconds it took, after rank 1 dies (`how` = "exit") or
    stalls past the group's timeout ("stall") before the forward."""
    groups = dap_groups(2, timeout=timedelta(seconds=timeout_s))
    dap = to_dap(_block(torch.float64), groups.dap)
    args = _inputs(4, 6, False, torch.float64)
    if rank == 1:
        if how == "exit":
            os._exit(3)
        time.sleep(2 * timeout_s)
        return ("stalled", "", 0.0)
    start = time.monotonic()
    try:
        dap(*args)
    except RuntimeError as e:
        return (type(e).__name__, str(e), time.monotonic() - start)
    return ("no error", "", time.monotonic() - start)


@pytest.mark.parametrize("how", ["exit", "stall"])
def test_dead_rank_fails_within_timeout(how: str) -> None:
    timeout_s = 4.0
    results = spawn_local(_dead_rank, 2, timeout_s, how, timeout_s=30, return_exceptions=True)
    kind, message, elapsed = results[0]
    assert kind == "RuntimeError", results
    assert "DAP all_gather failed on rank 0 of a group of 2" in message, message
    assert elapsed < timeout_s + 2.0
    if how == "exit":
        assert isinstance(results[1], RankError) and results[1].type_name == "ProcessDied"


def _alphafold_errors(rank: int) -> dict[str, float]:
    """The tiny AlphaFoldLite (extra-MSA stack, 2 Evoformer blocks, heads) on a batch with padded
    residues: every output, the loss and every parameter gradient equal to one process's."""
    model = perturbed(AlphaFoldLite(_config()).double())
    batch = random_batch(0, num_res=7, num_seq=5, real_res=6, num_extra=6)
    results = {}
    for name, module in (("single", model), ("dap", to_dap(model, None))):
        module.zero_grad()
        outputs = module(batch)
        loss = model.loss(batch, outputs)[0]
        loss.backward()
        results[name] = {f"out {k}": v.detach() for k, v in outputs.items()}
        results[name]["loss"] = loss.detach()
        # Parameters the loss does not reach have no gradient, in one process as with DAP.
        grads = {f"grad {n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[name].update(grads)
    dap = to_dap(model, None)
    assert dap.state_dict().keys() == model.state_dict().keys()
    assert type(dap.evoformer).__name__ == "DAPEvoformerStack"
    assert type(model.evoformer).__name__ == "EvoformerStack"  # the original is left as it was
    return _errors(results["dap"], results["single"])


def test_dap_alphafold_equals_single_process() -> None:
    _assert_within(spawn_local(_alphafold_errors, 2, timeout_s=120), 1e-10, 5 + 60)


def _received_elements(rank: int, n_seq: int, n_res: int, extra: bool) -> tuple[int, int]:
    """Elements this rank received in the forward of `forward_sharded` (counted at the collectives),
    and what `dap_block_comm` says."""
    p = dist.get_world_size()
    block = _block(torch.float64, extra=extra)
    c_m = ModelConfig.tiny().c_e if extra else ModelConfig.tiny().c_m
    m, z, msa_mask, pair_mask = _inputs(n_seq, n_res, True, torch.float64, c_m=c_m)
    dap = to_dap(block, None)
    m, z, msa_mask, pair_mask = (
        pad_to_multiple(pad_to_multiple(t, 0, p), 1, p) for t in (m, z, msa_mask, pair_mask)
    )
    received = [0]
    gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    all_gather, all_to_all_single = getattr(dist, gather_name), dist.all_to_all_single

    def counting_all_gather(out, x, group=None, **kwargs):
        received[0] += out.numel() - x.numel()
        return all_gather(out, x, group=group, **kwargs)

    def counting_all_to_all(out, x, group=None, **kwargs):
        received[0] += x.numel() * (p - 1) // p
        return all_to_all_single(out, x, group=group, **kwargs)

    setattr(dist, gather_name, counting_all_gather)
    dist.all_to_all_single = counting_all_to_all
    try:
        with torch.no_grad():
            dap.forward_sharded(m.chunk(p, 0)[rank], z.chunk(p, 0)[rank], msa_mask, pair_mask, n_seq, n_res)
    finally:
        setattr(dist, gather_name, all_gather)
        dist.all_to_all_single = all_to_all_single
    return received[0], sum(dap_block_comm(n_seq, n_res, _config(), p, extra=extra).values())


@pytest.mark.parametrize(("nprocs", "extra"), [(2, False), (4, True)])
def test_dap_block_comm_counts_what_the_block_receives(nprocs: int, extra: bool) -> None:
    for received, modelled in spawn_local(_received_elements, nprocs, 5, 7, extra, timeout_s=60):
        assert received == modelled > 0


def _fused_errors(rank: int) -> dict[str, float]:
    """A block with hfkit's fused modules swapped in (Triton kernels; the interpreter on CPU): the DAP
    block runs the fused attention, layer norm, outer product, transitions and dropout-add on its shards
    and agrees with the swapped single-process block to float32 rounding."""
    block = to_hfkit(_block(torch.float32))
    assert isinstance(block.msa_att_row.mha, EvoformerAttention)
    return _compare(block, _inputs(3, 5, True, torch.float32))


def test_dap_block_with_fused_ops_equals_single_process() -> None:
    _assert_within(spawn_local(_fused_errors, 2, timeout_s=240), 1e-5, 4 + 30)


# ---- duality async --------------------------------------------------------------------------------------


def _async_collective_differences(rank: int) -> dict[str, float]:
    """max |async - sync| of the forward and the input gradient of each asynchronous collective, with
    independent computation between launch and wait and two collectives in flight at once (launched
    in one order, waited for in the other), overlap on and off. Exactness means 0."""
    p, dtype = dist.get_world_size(), torch.float64
    g = torch.Generator().manual_seed(rank)  # different data on every rank
    x = torch.randn(3, 4 * p, 2 * p, 5, generator=g, dtype=dtype)
    w = torch.randn(3, 4 * p, 2 * p * p, 5, generator=g, dtype=dtype)
    w_t = torch.randn(3, 4, 2 * p * p, 5, generator=g, dtype=dtype)
    diffs: dict[str, float] = {}

    def run(asynchronous: bool, overlap: bool, partial: bool) -> tuple[torch.Tensor, ...]:
        xs = x.clone().requires_grad_()
        if asynchronous:
            gathered = start_gather(xs * 2, 2, None, partial=partial, overlap=overlap)
            transposed = start_all_to_all(xs.sin(), 1, 2, None, overlap=overlap)
            independent = (xs * xs).sum()  # computed while both are in flight
            t = transposed.wait()
            whole = gathered.wait()
        else:
            whole = gather(xs * 2, 2, None, partial=partial)
            t = all_to_all(xs.sin(), 1, 2, None)
            independent = (xs * xs).sum()
        loss = (whole * w).sum() * (1 if not partial else rank + 1) + (t * w_t).sum() + independent
        loss.backward()
        return whole.detach(), t.detach(), xs.grad

    for partial in (True, False):
        expected = run(False, True, partial)
        for overlap in (True, False):
            got = run(True, overlap, partial)
            for name, a, b in zip(("gather fwd", "all_to_all fwd", "grad"), got, expected, strict=True):
                diffs[f"{name} partial={partial} overlap={overlap}"] = float((a - b).abs().max())
    pending = start_gather(x, 1, None)
    pending.wait()
    try:
        pending.wait()
        diffs["second wait refused"] = 1.0
    except RuntimeError as e:
        diffs["second wait refused"] = float("waited for already" not in str(e))
    return diffs


@pytest.mark.parametrize("nprocs", [2, 4])
def test_async_collectives_equal_synchronous_ones(nprocs: int) -> None:
    for diffs in spawn_local(_async_collective_differences, nprocs, timeout_s=60):
        assert len(diffs) == 13
        assert max(diffs.values()) == 0.0, diffs


def _overlap_differences(rank: int, kind: str) -> dict[str, float]:
    """max |overlap on - overlap off| of every output, input gradient and parameter gradient of
    `to_dap` of a block (masked, N and S not divisible by the group, chunked), an extra-MSA block, or
    a 2-block stack under checkpointing (float64), or a block of hfkit's fused modules (float32, the
    interpreter on CPU: triangle multiplication's sharded contraction has collectives of its own); and
    the relative errors against one process."""
    dtype = torch.float32 if kind == "fused" else torch.float64
    if kind == "fused":
        module = to_hfkit(_block(dtype))
        args, chunk = _inputs(5, 7, True, dtype), None
    elif kind == "stack":
        torch.manual_seed(0)
        module = _perturbed(EvoformerStack.from_config(_config().replace(checkpoint=True)), dtype)
        args, chunk = _inputs(5, 7, True, dtype), None
    else:
        extra = kind == "extra"
        c_m = ModelConfig.tiny().c_e if extra else ModelConfig.tiny().c_m
        module = _block(dtype, extra=extra)
        args, chunk = _inputs(5, 7, True, dtype, c_m=c_m), 3
    single = _outputs_and_grads(module, *args, chunk_size=chunk)
    on = _outputs_and_grads(to_dap(module, None, overlap=True), *args, chunk_size=chunk)
    off = _outputs_and_grads(to_dap(module, None, overlap=False), *args, chunk_size=chunk)
    assert to_dap(module, None).blocks[0].overlap if kind == "stack" else to_dap(module, None).overlap
    diffs = {f"on-off {key}": float((on[key] - off[key]).abs().max()) for key in off}
    worst = _errors(on, single)
    diffs["on vs one process (rel)"] = max(worst.values())
    return diffs


@pytest.mark.parametrize(
    ("nprocs", "kind"), [(2, "block"), (4, "block"), (4, "extra"), (2, "stack"), (2, "fused")]
)
def test_dap_overlap_on_and_off_are_bit_identical(nprocs: int, kind: str) -> None:
    for diffs in spawn_local(_overlap_differences, nprocs, kind, timeout_s=240):
        close = diffs.pop("on vs one process (rel)")
        assert close <= (1e-5 if kind == "fused" else 1e-10)
        assert len(diffs) >= 4 + 30
        assert max(diffs.values()) == 0.0, {k: v for k, v in diffs.items() if v}


def _in_flight_counts(rank: int, overlap: bool) -> dict[str, int]:
    """The most collectives in flight at once (launched, not yet waited for) in the forward and in the
    backward of a DAP block, seen by wrapping the asynchronous collectives' work handles."""
    state = {"in_flight": 0, "most": 0, "launched": 0}
    gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    names = (gather_name, "all_to_all_single", "all_reduce")
    originals = {name: getattr(dist, name) for name in names}

    class LoggedWork:
        def __init__(self, work: Any) -> None:
            self.work = work
            state["in_flight"] += 1
            state["launched"] += 1
            state["most"] = max(state["most"], state["in_flight"])

        def wait(self, *args: Any) -> Any:
            state["in_flight"] -= 1
            return self.work.wait(*args)

    def logged(fn: Any) -> Any:
        def call(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
            work = fn(*args, async_op=async_op, **kwargs)
            return LoggedWork(work) if async_op else work

        return call

    block = to_dap(_block(torch.float64), None, overlap=overlap)
    m, z, msa_mask, pair_mask = _inputs(5, 7, True, torch.float64)
    m, z = m.requires_grad_(), z.requires_grad_()
    counts: dict[str, int] = {}
    for name, fn in originals.items():
        setattr(dist, name, logged(fn))
    try:
        out = block(m, z, msa_mask, pair_mask)
        counts["forward most in flight"], counts["forward launched"] = state["most"], state["launched"]
        state.update(most=0, launched=0)
        sum(o.sum() for o in out).backward()
        counts["backward most in flight"], counts["backward launched"] = state["most"], state["launched"]
        counts["left in flight"] = state["in_flight"]
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return counts


@pytest.mark.parametrize("overlap", [True, False])
def test_dap_overlap_keeps_collectives_in_flight(overlap: bool) -> None:
    """With overlap the m transpose stays in flight across the outer product mean and the pair stack's
    gathers (several at once, forward and backward); without, each is waited for where launched."""
    for counts in spawn_local(_in_flight_counts, 2, overlap, timeout_s=60):
        assert counts["forward launched"] >= 11 and counts["backward launched"] >= 11, counts
        assert counts["left in flight"] == 0, counts
        if overlap:
            assert counts["forward most in flight"] >= 3 and counts["backward most in flight"] >= 2, counts
        else:
            assert counts["forward most in flight"] == counts["backward most in flight"] == 1, counts


def test_overlapped_with_names_every_collective_of_a_block() -> None:
    for extra in (False, True):
        assert OVERLAPPED_WITH.keys() == dap_block_comm(5, 7, _config(), 2, extra=extra).keys()
