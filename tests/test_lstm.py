"""hfkit.ops.lstm_layer and hfkit.nn.LSTM against lstm_reference and torch.nn.LSTM.

The op is checked against its plain-torch reference, and the module against a torch module holding
the same weights (random biases, so that their gradients are not trivially zero): outputs, h_n, c_n
and the gradients of the input, h0, c0 and every weight and bias, on odd sizes (hidden 33 and 130,
sequence lengths 1 and 37), in float32 (to 1e-5) and bfloat16 (no worse than torch's own bfloat16
against float32). On CPU the kernels run under `TRITON_INTERPRET=1` (conftest), so sizes stay small.
The recurrence has two paths (`_persistent_tiles` picks): the sequence kernels (one step a launch
under the interpreter, the whole sequence in one launch with a grid barrier on CUDA) and the step
kernels; both are checked against the reference, the one-launch sequence on CUDA (`-m cuda`) and,
with a single program (its barrier passes at once), under the interpreter.
"""

from __future__ import annotations

import copy
import importlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_close
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import hfkit.nn as hnn
from hfkit.bench.cases import lstm as lstm_bench
from hfkit.bench.ceilings import Ceilings
from hfkit.bench.runner import run_benchmark
from hfkit.nn import LSTM, MultiheadAttention, to_hfkit, to_torch
from hfkit.ops import lstm_layer, lstm_reference, reference_on_cpu
from hfkit.ops.lstm import uses_triton

# The module (hfkit.ops re-exports functions named like their modules).
lstm_op = importlib.import_module("hfkit.ops.lstm")

pytestmark = pytest.mark.usefixtures("seed")


@pytest.fixture(autouse=True)
def exact_float32(monkeypatch):
    """The float32 checks here hold the kernels to about float32's accuracy: the recurrence's single
    TF32 products, which `torch.backends.cudnn.allow_tf32` (torch's default, as for cuDNN's own LSTM)
    selects on CUDA, are off for them; `test_float32_follows_cudnn_tf32_cuda` checks those."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


DTYPES = [torch.float32, torch.bfloat16]

# Relative L2 error against a float32 computation on the same bfloat16 inputs and weights: the result
# must be within this, or no worse than torch's own bfloat16 (1.25x + 2e-3).
BF16_REL_TOL = 2e-2


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """L2 error of `actual` against `expected` in float64, relative to the norm of `expected` or of an
    RMS of 1e-2, whichever is larger."""
    assert torch.isfinite(actual).all(), "non-finite values in the result"
    floor = 1e-2 * expected.numel() ** 0.5
    return ((actual.double() - expected.double()).norm() / max(expected.double().norm().item(), floor)).item()


def outputs_and_grads(fn, args: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """`fn(**args)` -> (y, h_n, c_n) on fresh leaf copies of the tensor args, then the backward of a
    fixed random loss over all three; returns the outputs and the gradient of every tensor arg."""
    leaves = {k: v.detach().clone().requires_grad_(True) if v is not None else None for k, v in args.items()}
    y, h_n, c_n = fn(**leaves)
    gen = torch.Generator().manual_seed(1)
    loss = sum((t.float() * torch.randn(t.shape, generator=gen).to(t.device)).sum() for t in (y, h_n, c_n))
    loss.backward()
    result = {"y": y, "h_n": h_n, "c_n": c_n}
    result.update({f"d{k}": v.grad for k, v in leaves.items() if v is not None})
    return result


def layer_args(t_len, batch, n_in, hidden, dtype, state=True, bias=True) -> dict[str, torch.Tensor | None]:
    """Random inputs of one layer: x [T, B, I], h0, c0 [B, H] (or None), weights and biases ~ 0.3·N(0, 1)."""

    def r(*shape):
        return (torch.randn(*shape) * 0.3).to(dtype)

    return {
        "x": torch.randn(t_len, batch, n_in).to(dtype),
        "h0": r(batch, hidden) if state else None,
        "c0": r(batch, hidden) if state else None,
        "w_ih": r(4 * hidden, n_in),
        "w_hh": r(4 * hidden, hidden),
        "b_ih": r(4 * hidden) if bias else None,
        "b_hh": r(4 * hidden) if bias else None,
    }


def check_bf16(actual: dict, expected: dict, truth: dict) -> None:
    """bfloat16 results `actual` and `expected` (torch's or the reference's) against the float32
    `truth` on the same values: hfkit's error within `BF16_REL_TOL`, or no worse than the other's."""
    assert actual.keys() == expected.keys() == truth.keys()
    for name in actual:
        assert actual[name].dtype == expected[name].dtype and actual[name].shape == expected[name].shape, name
        err, other_err = rel_err(actual[name], truth[name]), rel_err(expected[name], truth[name])
        assert err <= max(BF16_REL_TOL, 1.25 * other_err + 2e-3), (name, err, other_err)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "t_len,batch,n_in,hidden,state,bias",
    [
        (1, 1, 5, 33, True, True),
        (37, 3, 7, 33, True, True),
        (6, 3, 4, 33, False, True),
        (6, 2, 4, 33, True, False),
        (3, 3, 9, 130, True, True),
    ],
)
def test_layer_matches_reference(dtype, t_len, batch, n_in, hidden, state, bias):
    args = layer_args(t_len, batch, n_in, hidden, dtype, state, bias)
    assert uses_triton(args["x"])
    actual = outputs_and_grads(lstm_layer, args)
    expected = outputs_and_grads(lstm_reference, args)
    assert actual.keys() == expected.keys()
    if dtype == torch.float32:
        for name in actual:
            assert_close(actual[name], expected[name], msg=name)
        return
    truth = outputs_and_grads(
        lstm_reference, {k: v.float() if v is not None else None for k, v in args.items()}
    )
    check_bf16(actual, expected, truth)


def test_layer_takes_any_strides():
    """Every argument a strided view (every 2nd element of a leaf; x time-major over a batch-first
    leaf): the same outputs and gradients as the reference on contiguous copies."""
    args = layer_args(4, 3, 5, 9, torch.float32)
    bases = {
        k: torch.stack([v, torch.full_like(v, float("nan"))], dim=-1).requires_grad_(True)
        for k, v in args.items()
    }
    bases["x"] = args["x"].transpose(0, 1).contiguous().requires_grad_(True)
    views = {k: b[..., 0] for k, b in bases.items()}
    views["x"] = bases["x"].transpose(0, 1)
    assert not any(v.is_contiguous() for v in views.values())
    y, h_n, c_n = lstm_layer(**views)
    gen = torch.Generator().manual_seed(1)
    sum((t * torch.randn(t.shape, generator=gen)).sum() for t in (y, h_n, c_n)).backward()
    actual = {"y": y, "h_n": h_n, "c_n": c_n, "dx": bases["x"].grad.transpose(0, 1)}
    actual.update({f"d{k}": b.grad[..., 0] for k, b in bases.items() if k != "x"})
    expected = outputs_and_grads(lstm_reference, args)
    assert actual.keys() == expected.keys()
    for name in actual:
        assert_close(actual[name], expected[name], msg=name)


def test_layer_float16_matches_reference():
    """float16 too: within 2e-3 of float64 on the same values, and no worse than the reference in float16."""
    args = layer_args(9, 3, 7, 33, torch.float16)
    actual = outputs_and_grads(lstm_layer, args)
    expected = outputs_and_grads(lstm_reference, args)
    truth = outputs_and_grads(lstm_reference, {k: v.double() for k, v in args.items()})
    for name in actual:
        assert actual[name].dtype == torch.float16, name
        err, ref_err = rel_err(actual[name], truth[name]), rel_err(expected[name], truth[name])
        assert err <= max(2e-3, 1.25 * ref_err), (name, err, ref_err)


def test_persistent_tiles_rule():
    """The sequence kernels' tiles: at hfai's config (B = 4, H = 985, 132 SMs) 124 forward and 124
    backward programs of 8 units, the bfloat16 slices on chip (the backward's with or without SPLIT),
    float32's three-TF32 slices (twice the bytes) streamed from L2, one-TF32 ones on chip; the
    backward's batch tile of 4 rows; every grid fits on the SMs with the smallest power-of-two BLOCK_U
    that does; None (the step kernels) past one batch tile or the largest BLOCK_U."""
    bf16 = lstm_op._persistent_tiles(4, 985, 2, 0, 132)
    assert bf16 is not None
    assert (bf16.fwd_grid, bf16.fwd_block_u, bf16.block_b) == ((124, 1), 8, 16)
    assert bf16.resident and bf16.fwd_block_k == 1024
    assert (bf16.bwd_grid, bf16.bwd_block_u, bf16.bwd_block_b) == ((124, 1), 8, 4)
    assert bf16.bwd_resident and bf16.bwd_block_k == 1024 and bf16.bwd_split == lstm_op.SEQ_BWD_SPLIT
    assert bf16.bwd_num_warps == lstm_op.SEQ_BWD_NUM_WARPS
    for split in (True, False):
        tiles = lstm_op._persistent_tiles(4, 985, 2, 0, 132, bwd_split=split)
        assert tiles is not None and tiles.bwd_split == split and tiles.bwd_resident, split
    fp32 = lstm_op._persistent_tiles(4, 985, 4, 3, 132)
    assert fp32 is not None and not fp32.resident and fp32.fwd_block_k == lstm_op.SEQ_FWD_BLOCK_K
    assert not fp32.bwd_resident and fp32.bwd_block_k == lstm_op.SEQ_BWD_BLOCK_K and not fp32.bwd_split
    one_tf32 = lstm_op._persistent_tiles(4, 985, 4, 4, 132)
    assert one_tf32 is not None and one_tf32.resident and one_tf32.bwd_resident and one_tf32.half
    assert not fp32.half and not lstm_op._persistent_tiles(4, 985, 2, 0, 132).half
    # The forward's float16 operands count 2 bytes: (4*8 + 16) * 1024 * 2 on chip fits 96 KB, not 95.
    assert lstm_op._persistent_tiles(4, 985, 4, 4, 132, resident_bytes=96 * 1024).half
    assert not lstm_op._persistent_tiles(4, 985, 4, 4, 132, resident_bytes=95 * 1024).resident
    with pytest.raises(ValueError, match="bwd_split"):
        lstm_op._persistent_tiles(4, 985, 4, 4, 132, bwd_split=True)
    # B = 64: the backward's dgates operand [1024, 8*64] off chip, streamed in chunks of at most
    # MAX_STREAMED_DGATES elements.
    wide = lstm_op._persistent_tiles(64, 985, 2, 0, 132, bwd_split=True)
    assert wide is not None and not wide.bwd_resident and wide.bwd_block_b == 64
    assert wide.bwd_block_k == max(16, lstm_op.MAX_STREAMED_DGATES // (8 * 64))
    assert not lstm_op._persistent_tiles(4, 985, 2, 0, 132, resident_bytes=64 * 1024).resident
    assert not lstm_op._persistent_tiles(64, 985, 2, 0, 132).resident  # the h tile [1024, 64] too
    assert lstm_op._persistent_tiles(lstm_op.MAX_BLOCK_B + 1, 985, 2, 0, 132) is None
    assert lstm_op._persistent_tiles(4, 132 * lstm_op.MAX_SEQ_FWD_BLOCK_U + 1, 2, 0, 132) is None
    for sms in (1, 4, 132):
        for hidden in (1, 4, 9, 33, 130, 985, 1024, 4000):
            for batch in (1, 5, 64):
                tiles = lstm_op._persistent_tiles(batch, hidden, 2, 0, sms)
                if tiles is None:
                    continue
                for grid, block_u, smallest in (
                    (tiles.fwd_grid, tiles.fwd_block_u, lstm_op.MIN_SEQ_FWD_BLOCK_U),
                    (tiles.bwd_grid, tiles.bwd_block_u, lstm_op.MIN_SEQ_BWD_BLOCK_U),
                ):
                    assert grid == (-(-hidden // block_u), 1) and grid[0] <= sms, (sms, hidden, batch)
                    assert block_u == smallest or -(-hidden // (block_u // 2)) > sms, (sms, hidden, batch)
                assert tiles.block_b >= max(16, batch)
    # On CPU (4 "SMs" for the interpreter) the layer tests above take both paths: H = 33 the sequence
    # kernels, H = 130 the step kernels.
    for hidden, seq in ((33, True), (130, False)):
        x, w_hh = torch.zeros(2, 3, 5), torch.zeros(4 * hidden, hidden)
        assert (lstm_op._seq_tiles(x, w_hh) is not None) == seq
        assert not lstm_op._one_launch(x)


# (dtype, split): the backward's dgates as a 16-bit head and tail or rounded once (16-bit weights only).
DTYPE_SPLITS = [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)]


@pytest.mark.parametrize("dtype,split", DTYPE_SPLITS, ids=["float32", "bfloat16-split", "bfloat16-rounded"])
@pytest.mark.parametrize(
    "t_len,batch,hidden,resident",
    [(1, 1, 33, True), (37, 5, 33, True), (37, 5, 33, False), (7, 1, 130, True), (1, 5, 130, False)],
)
def test_sequence_kernels_match_reference(monkeypatch, dtype, split, resident, t_len, batch, hidden):
    """The sequence kernels (one step a launch under the interpreter) on odd sizes, the w_hh slices on
    chip or streamed, the backward's dgates split or not, outputs and every gradient: float32 within
    1e-5 relative L2 of the reference in float64 (over 37 steps the float32 reference itself drifts
    past assert_close's 1e-5 elementwise); bfloat16 as `check_bf16` against the step kernels (the
    general path, checked against the reference above) on the same values, both against the reference
    in float32. 16 "SMs" put the H = 130 layer on the sequence kernels (9 programs), 1 "SM" every
    layer on the step kernels."""
    args = layer_args(t_len, batch, 7, hidden, dtype)
    monkeypatch.setattr(lstm_op, "num_sms", lambda device: 16)
    monkeypatch.setattr(lstm_op, "SEQ_BWD_SPLIT", split)
    if not resident:
        monkeypatch.setattr(lstm_op, "MAX_RESIDENT_H", 0)
        monkeypatch.setattr(lstm_op, "MAX_RESIDENT_SLICE", 0)
    tiles = lstm_op._seq_tiles(args["x"], args["w_hh"])
    assert tiles is not None and tiles.resident == resident
    assert tiles.bwd_resident == resident and tiles.bwd_split == split
    actual = outputs_and_grads(lstm_layer, args)
    wide = torch.float64 if dtype == torch.float32 else torch.float32
    truth = outputs_and_grads(lstm_reference, {k: v.to(wide) for k, v in args.items()})
    assert actual.keys() == truth.keys()
    if dtype == torch.float32:
        for name in actual:
            assert actual[name].dtype == dtype and actual[name].shape == truth[name].shape, name
            assert rel_err(actual[name], truth[name]) <= 1e-5, (name, rel_err(actual[name], truth[name]))
        return
    monkeypatch.setattr(lstm_op, "num_sms", lambda device: 1)
    assert lstm_op._seq_tiles(args["x"], args["w_hh"]) is None
    check_bf16(actual, outputs_and_grads(lstm_layer, args), truth)


@pytest.mark.parametrize("dtype,split", DTYPE_SPLITS, ids=["float32", "bfloat16-split", "bfloat16-rounded"])
@pytest.mark.parametrize("resident", [True, False], ids=["resident", "streamed"])
def test_sequence_in_one_launch_interpreted(dtype, split, resident):
    """The whole sequence in one launch (PERSISTENT: the time loop inside the kernel, c and dc carried
    in registers, the grid barrier after each step) with a single program, where the barrier passes at
    once: the same buffers as one step a launch."""
    t_len, batch, hidden = 37, 5, 30
    dot = lstm_op.recurrence_dot(torch.empty(0, dtype=dtype))  # the mode the kernels take here
    tiles = lstm_op._persistent_tiles(
        batch, hidden, dtype.itemsize, dot, 1, 1 << 30 if resident else 0, bwd_split=split
    )
    assert tiles is not None and tiles.fwd_grid == tiles.bwd_grid == (1, 1) and tiles.resident == resident
    assert tiles.bwd_resident == resident and tiles.bwd_split == split
    args = layer_args(t_len, batch, 7, hidden, dtype)
    xp = (args["x"] @ args["w_ih"].t()).contiguous()
    bias = args["b_ih"].float() + args["b_hh"].float()
    dy = torch.randn(t_len, batch, hidden).to(dtype)
    dh_n, dc_n = torch.randn(2, batch, hidden)
    results = []
    for persistent in (True, False):
        y = torch.empty(t_len, batch, hidden, dtype=dtype)
        cs = torch.empty(t_len + 1, batch, hidden)
        cs[0] = args["c0"]
        gates = torch.empty(t_len, batch, 4 * hidden)
        lstm_op._fwd_seq(xp, bias, args["h0"], args["w_hh"], cs, y, gates, tiles, persistent)
        dg, dc = torch.empty(t_len, batch, 4 * hidden), dc_n.clone()
        lstm_op._bwd_seq(dy, dh_n.to(dtype), args["w_hh"], gates, cs, dc, dg, tiles, persistent)
        results.append({"y": y, "cs": cs, "gates": gates, "dg": dg, "dc": dc})
    one_launch, per_step = results
    for name in one_launch:
        assert torch.equal(one_launch[name], per_step[name]), name
    if dtype == torch.float32:
        assert_close(one_launch["y"], lstm_reference(**args)[0], msg="y")


def test_pow2_rows_scale_exactly_into_float16_range():
    """`_pow2_rows`: every row's largest |value| lands in [2^14, 2^15) (float16's top binade), the
    factors are powers of two that undo the scaling exactly, and zero rows and extreme rows stay finite."""
    x = torch.randn(6, 40) * torch.tensor([1.0, 1e-30, 1e30, 3e-5, 7e4, 0.0])[:, None]
    scaled, unscale = lstm_op._pow2_rows(x)
    amax = scaled.abs().amax(dim=1)
    assert ((amax[:5] >= 2**14) & (amax[:5] < 2**15)).all() and amax[5] == 0, amax
    assert torch.equal(torch.frexp(unscale)[0], torch.full((6,), 0.5))  # powers of two
    assert torch.equal(scaled * unscale[:, None], x) and torch.isfinite(scaled.half()).all()


@pytest.mark.parametrize(
    "w_range,h0_range,t_len",
    [(1.0, 1.0, 37), (1e-6, 1e6, 37), (1e5, 1e-5, 2)],
    ids=["unit", "w-small", "w-big"],
)
def test_float32_forward_in_float16_operands_interpreted(w_range, h0_range, t_len):
    """float32 weights with one TF32 product (`recurrence_dot` 4, CUDA's default) run the forward's
    product on float16 operands on chip (`half`): rows of w_hh and, at t = 0, batch rows of h0 scaled
    by powers of two into float16's range. With weights and an h0 outside that range (unscaled, w_hh
    1e5 and h0 1e6 overflow float16 to inf, and w_hh 1e-6 keeps 2 bits of 11), y and c_n stay within
    2e-3 relative L2 of the float64 reference, TF32's accuracy (2^-11 a product). (Over many steps
    w_hh 1e5 saturates every gate and amplifies any rounding: 2 steps there.)"""
    batch, hidden = 5, 30
    tiles = lstm_op._persistent_tiles(batch, hidden, 4, 4, 1)
    assert tiles is not None and tiles.resident and tiles.half
    args = layer_args(t_len, batch, 7, hidden, torch.float32)
    args["w_hh"] = args["w_hh"] * w_range
    args["w_hh"][5] *= 1e-3  # rows of different sizes: each row has its own scale
    args["h0"] = args["h0"] * h0_range
    args["h0"][1] *= 1e-3
    xp = (args["x"] @ args["w_ih"].t()).contiguous()
    y = torch.empty(t_len, batch, hidden)
    cs = torch.empty(t_len + 1, batch, hidden)
    cs[0] = args["c0"]
    gates = torch.empty(t_len, batch, 4 * hidden)
    lstm_op._fwd_seq(xp, args["b_ih"] + args["b_hh"], args["h0"], args["w_hh"], cs, y, gates, tiles, False)
    truth_y, _, truth_c = lstm_reference(**{k: v.double() for k, v in args.items()})
    assert rel_err(y, truth_y) <= 2e-3, rel_err(y, truth_y)
    assert rel_err(cs[-1], truth_c) <= 2e-3, rel_err(cs[-1], truth_c)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_prefetch_changes_nothing(dtype):
    """The sequence backward loading each step's inputs from the forward one step ahead (PREFETCH) or
    in the step: the same dgates and dc, bit for bit, in one launch (a single program) and one step a
    launch."""
    t_len, batch, hidden = 9, 3, 30
    dot = lstm_op.recurrence_dot(torch.empty(0, dtype=dtype))  # the mode the kernels take here
    tiles = lstm_op._persistent_tiles(batch, hidden, dtype.itemsize, dot, 1)
    assert tiles is not None and tiles.bwd_grid == (1, 1) and tiles.bwd_prefetch == lstm_op.SEQ_BWD_PREFETCH
    args = layer_args(t_len, batch, 7, hidden, dtype)
    xp = (args["x"] @ args["w_ih"].t()).contiguous()
    bias = args["b_ih"].float() + args["b_hh"].float()
    y, gates = torch.empty(t_len, batch, hidden, dtype=dtype), torch.empty(t_len, batch, 4 * hidden)
    cs = torch.empty(t_len + 1, batch, hidden)
    cs[0] = args["c0"]
    lstm_op._fwd_seq(xp, bias, args["h0"], args["w_hh"], cs, y, gates, tiles, False)
    dy, dh_n, dc_n = torch.randn(t_len, batch, hidden).to(dtype), *torch.randn(2, batch, hidden)
    results = []
    for prefetch, persistent in ((True, True), (False, True), (True, False), (False, False)):
        dg, dc = torch.empty(t_len, batch, 4 * hidden), dc_n.clone()
        step_tiles = tiles._replace(bwd_prefetch=prefetch)
        lstm_op._bwd_seq(dy, dh_n.to(dtype), args["w_hh"], gates, cs, dc, dg, step_tiles, persistent)
        results.append((dg, dc))
    for dg, dc in results[1:]:
        assert torch.equal(dg, results[0][0]) and torch.equal(dc, results[0][1])
    assert results[0][0].abs().sum() > 0


def test_reference_matches_torch_and_float64_runs_it():
    """The reference is the spec: it agrees with one layer of torch.nn.LSTM; float64 and
    `reference_on_cpu()` run it (no kernel), with the same result."""
    torch_lstm = nn.LSTM(5, 33, dtype=torch.float64)
    x, h0, c0 = torch.randn(7, 2, 5, dtype=torch.float64), *torch.randn(2, 1, 2, 33, dtype=torch.float64)
    weights = (torch_lstm.weight_ih_l0, torch_lstm.weight_hh_l0, torch_lstm.bias_ih_l0, torch_lstm.bias_hh_l0)
    y_ref, (h_ref, c_ref) = torch_lstm(x, (h0, c0))
    y, h, c = lstm_reference(x, h0[0], c0[0], *weights)
    assert_close(y, y_ref)
    assert_close(h, h_ref[0])
    assert_close(c, c_ref[0])
    assert not uses_triton(x)
    y64, _, _ = lstm_layer(x, h0[0], c0[0], *weights)
    assert torch.equal(y64, y)
    x32, weights32 = x.float(), [w.float() for w in weights]
    with reference_on_cpu():
        assert not uses_triton(x32)
        y32, _, _ = lstm_layer(x32, None, None, *weights32)
    assert torch.equal(y32, lstm_reference(x32, None, None, *weights32)[0])


def test_compile_on_cpu_matches_reference():
    """Under torch.compile on CPU the reference is what Inductor compiles (no interpreted kernels)."""
    args = layer_args(4, 2, 5, 9, torch.float32)
    weights = [args[k] for k in ("h0", "c0", "w_ih", "w_hh", "b_ih", "b_hh")]
    f = torch.compile(lambda x: lstm_layer(x, *weights)[0] * 2, fullgraph=True)
    assert_close(f(args["x"]), lstm_reference(args["x"], *weights)[0] * 2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="custom-op checks need CUDA (not the interpreter)")
def test_opcheck_cuda():
    args = [t.cuda().requires_grad_(True) for t in layer_args(5, 3, 7, 33, torch.float32).values()]
    torch.library.opcheck(torch.ops.hfkit.lstm_layer_fwd.default, tuple(args))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compile_cuda_fwd_bwd_matches_eager():
    """torch.compile traces the step kernels (no graph replay inside the trace) forward and backward."""
    args = {k: v.cuda() for k, v in layer_args(5, 3, 7, 33, torch.bfloat16).items()}
    dy = torch.randn(5, 3, 33, device="cuda", dtype=torch.bfloat16)
    names = list(args)
    leaves = [args[k].requires_grad_(True) for k in names]

    def first(*tensors):
        return lstm_layer(**dict(zip(names, tensors, strict=True)))[0]

    compiled = torch.autograd.grad(torch.compile(first, fullgraph=True)(*leaves), leaves, dy)
    eager = torch.autograd.grad(first(*leaves), leaves, dy)
    for name, c, e in zip(names, compiled, eager, strict=True):
        assert_close(c, e, msg=name)


def make_pair(
    input_size: int, hidden: int, dtype: torch.dtype = torch.float32, **kwargs
) -> tuple[nn.LSTM, LSTM]:
    """A torch LSTM with random weights and biases, and an hfkit LSTM with a copy of its state."""
    torch_lstm = nn.LSTM(input_size, hidden, dtype=dtype, **kwargs)
    with torch.no_grad():
        for p in torch_lstm.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    hfkit_lstm = LSTM(input_size, hidden, dtype=dtype, **kwargs)
    hfkit_lstm.load_state_dict(torch_lstm.state_dict())
    return torch_lstm, hfkit_lstm


def run_module(module: nn.Module, x: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None):
    """Forward on fresh leaf copies of x and hx, backward of a fixed random loss over output, h_n and
    c_n; returns the outputs and the gradients of x, h0, c0 and every parameter."""
    x = x.detach().clone().requires_grad_(True)
    state = tuple(t.detach().clone().requires_grad_(True) for t in hx) if hx is not None else None
    module.zero_grad(set_to_none=True)
    out, (h_n, c_n) = module(x, state)
    gen = torch.Generator().manual_seed(1)
    loss = sum((t.float() * torch.randn(t.shape, generator=gen).to(t.device)).sum() for t in (out, h_n, c_n))
    loss.backward()
    result = {"output": out, "h_n": h_n, "c_n": c_n, "dinput": x.grad}
    if state is not None:
        result.update({"dh0": state[0].grad, "dc0": state[1].grad})
    result.update({f"d{name}": p.grad for name, p in module.named_parameters()})
    assert all(v is not None for v in result.values()), [k for k, v in result.items() if v is None]
    return result


def compare_modules(torch_lstm, hfkit_lstm, x, hx, dtype) -> None:
    """Output, h_n, c_n and every gradient of the hfkit module against the torch module: float32 to
    1e-5; bfloat16 both against torch in float32 on the same values (`check_bf16`)."""
    expected = run_module(torch_lstm, x, hx)
    actual = run_module(hfkit_lstm, x, hx)
    assert actual.keys() == expected.keys()
    if dtype == torch.float32:
        for name in actual:
            assert_close(actual[name], expected[name], msg=name)
        return
    fp32 = copy.deepcopy(torch_lstm).float()
    truth = run_module(fp32, x.float(), tuple(t.float() for t in hx) if hx is not None else None)
    check_bf16(actual, expected, truth)


def module_inputs(
    batch: int | None, t_len: int, n_in: int, hidden: int, dtype, batch_first, layers, dirs, state
):
    """x ([T, B, I], [B, T, I] with batch_first, [T, I] unbatched) and hx (or None)."""
    if batch is None:
        x = torch.randn(t_len, n_in)
        state_shape = (layers * dirs, hidden)
    else:
        x = torch.randn(batch, t_len, n_in) if batch_first else torch.randn(t_len, batch, n_in)
        state_shape = (layers * dirs, batch, hidden)
    hx = (
        (torch.randn(state_shape).to(dtype) * 0.5, torch.randn(state_shape).to(dtype) * 0.5)
        if state
        else None
    )
    return x.to(dtype), hx


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "batch,t_len,hidden,kwargs,state",
    [
        (3, 37, 33, {}, True),
        (1, 1, 33, {"batch_first": True}, False),
        (3, 5, 33, {"num_layers": 2, "bidirectional": True, "batch_first": True}, True),
        (None, 6, 33, {"num_layers": 2}, True),
        (None, 6, 33, {"bidirectional": True}, False),
        (2, 4, 33, {"bias": False, "bidirectional": True}, True),
        (2, 3, 130, {}, True),
    ],
    ids=[
        "seq37",
        "seq1-batch_first",
        "2layers-bidir",
        "unbatched-2layers",
        "unbatched-bidir",
        "nobias",
        "h130",
    ],
)
def test_module_matches_torch(dtype, batch, t_len, hidden, kwargs, state):
    n_in = 7
    torch_lstm, hfkit_lstm = make_pair(n_in, hidden, dtype, **kwargs)
    layers, dirs = kwargs.get("num_layers", 1), 2 if kwargs.get("bidirectional") else 1
    x, hx = module_inputs(
        batch, t_len, n_in, hidden, dtype, kwargs.get("batch_first", False), layers, dirs, state
    )
    compare_modules(torch_lstm, hfkit_lstm, x, hx, dtype)


def test_dropout_between_layers():
    """In eval the dropout is off and the module matches torch; in training it drops (exact zeros in the
    second layer's input change the output), with zero dropout it matches torch in training too."""
    torch_lstm, hfkit_lstm = make_pair(5, 17, num_layers=2, dropout=0.5)
    x, hx = module_inputs(2, 4, 5, 17, torch.float32, False, 2, 1, True)
    torch_lstm.eval()
    hfkit_lstm.eval()
    with torch.no_grad():
        assert_close(hfkit_lstm(x, hx)[0], torch_lstm(x, hx)[0])
        hfkit_lstm.train()
        torch.manual_seed(3)
        dropped = hfkit_lstm(x, hx)[0]
        torch.manual_seed(3)
        assert torch.equal(hfkit_lstm(x, hx)[0], dropped)
        assert not torch.allclose(dropped, torch_lstm(x, hx)[0], atol=1e-3)
    torch_lstm.dropout = hfkit_lstm.dropout = 0.0
    torch_lstm.train()
    compare_modules(torch_lstm, hfkit_lstm, x, hx, torch.float32)


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
def test_proj_size_and_packed_sequence_run_torchs_forward():
    torch_lstm, hfkit_lstm = make_pair(5, 9, proj_size=4)
    x = torch.randn(6, 2, 5)
    ref, (h_ref, c_ref) = torch_lstm(x)
    out, (h, c) = hfkit_lstm(x)
    assert torch.equal(out, ref) and torch.equal(h, h_ref) and torch.equal(c, c_ref)
    torch_lstm, hfkit_lstm = make_pair(5, 9)
    packed = pack_padded_sequence(torch.randn(6, 2, 5), torch.tensor([6, 3]))
    ref, (h_ref, _) = torch_lstm(packed)
    out, (h, _) = hfkit_lstm(packed)
    assert torch.equal(out.data, ref.data) and torch.equal(h, h_ref)


def test_state_dict_round_trip():
    for kwargs in ({}, {"num_layers": 2, "bidirectional": True}, {"bias": False}, {"proj_size": 4}):
        torch_lstm, hfkit_lstm = make_pair(5, 9, **kwargs)
        ref = torch_lstm.state_dict()
        state = hfkit_lstm.state_dict()
        assert list(state) == list(ref)
        assert all(torch.equal(state[k], ref[k]) for k in ref)
        back = nn.LSTM(5, 9, **kwargs)
        back.load_state_dict(state, strict=True)
        assert all(torch.equal(back.state_dict()[k], ref[k]) for k in ref)
    assert "weight_hh_l1_reverse" in LSTM(5, 9, num_layers=2, bidirectional=True).state_dict()


class Tagger(nn.Module):
    """A model holding an LSTM (shared under two names) and a MultiheadAttention."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(6, 12, batch_first=True, bidirectional=True)
        self.attn = nn.MultiheadAttention(24, 3, batch_first=True)
        self.head = nn.Linear(24, 4)
        self.same_lstm = self.lstm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(a + h)


def test_to_hfkit_and_back_is_exact():
    torch.manual_seed(0)
    model = Tagger()
    x = torch.randn(2, 5, 6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = {name: type(m) for name, m in model.named_modules()}
    ref = model(x)

    swapped, report = to_hfkit(model, inplace=False, report=True, include={"LSTM", "MultiheadAttention"})
    assert report.counts() == {"LSTM": 1, "MultiheadAttention": 1}
    assert type(swapped.lstm) is LSTM and swapped.same_lstm is swapped.lstm
    assert type(swapped.attn) is MultiheadAttention
    assert all(torch.equal(swapped.state_dict()[k], v) for k, v in before.items())
    assert swapped.state_dict().keys() == before.keys()
    assert_close(swapped(x), ref)

    restored = to_torch(pickle.loads(pickle.dumps(swapped)))
    assert {name: type(m) for name, m in restored.named_modules()} == types
    assert restored.same_lstm is restored.lstm
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in before.items())
    assert torch.equal(restored(x), ref)


def test_swap_is_registered_by_importing_hfkit_nn():
    """The LSTM swap is opt-in (its one-launch recurrence needs the whole GPU for its grid barrier):
    `include` names it, else the swap report lists it as skipped with the reason."""
    assert hnn.LSTM is LSTM
    kept, report = to_hfkit(nn.LSTM(4, 8), report=True)
    reason = report.skipped[0].reason
    assert type(kept) is nn.LSTM and "opt-in" in reason and "grid barrier" in reason
    swapped = to_hfkit(nn.LSTM(4, 8), include={"LSTM"})
    assert type(swapped) is LSTM
    assert type(to_torch(swapped)) is nn.LSTM


def call_layer(**overrides):
    """`lstm_layer` on valid inputs (T=3, B=2, I=5, H=4), with some arguments replaced."""
    args = layer_args(3, 2, 5, 4, torch.float32)
    args.update(overrides)
    return lstm_layer(**args)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"x": torch.randn(3, 5)}, "x: expected a 3-d tensor"),
        ({"x": torch.randint(0, 3, (3, 2, 5))}, "x: expected a floating-point"),
        ({"w_hh": torch.randn(16, 5)}, r"w_hh: expected shape \[4H, H\]"),
        ({"w_ih": torch.randn(16, 6)}, r"w_ih: expected shape \[16, 5\]"),
        ({"w_ih": torch.randn(16, 5, dtype=torch.float64)}, "w_ih: expected dtype torch.float32"),
        ({"b_ih": torch.randn(15)}, r"b_ih: expected shape \[16\]"),
        ({"b_hh": torch.randn(16, dtype=torch.bfloat16)}, "b_hh: expected dtype torch.float32"),
        ({"h0": torch.randn(3, 4)}, r"h0: expected shape \[2, 4\]"),
        ({"c0": torch.randn(2, 4, dtype=torch.float64)}, "c0: expected dtype torch.float32"),
        ({"h0": torch.randn(2, 4, device="meta")}, "h0: on meta"),
    ],
)
def test_layer_bad_inputs_raise_value_error(overrides, match):
    with pytest.raises(ValueError, match=match):
        call_layer(**overrides)


@pytest.mark.parametrize(
    "x,hx,match",
    [
        (torch.randn(2, 3, 4, 5), None, "input: expected a 3-d"),
        (torch.randn(3, 2, 6), None, "input: expected 5 features"),
        (torch.randn(3, 2, 5), (torch.randn(2, 4), torch.randn(1, 2, 4)), r"hx\[0\] \(h0\): expected a 3-d"),
        (
            torch.randn(3, 2, 5),
            (torch.randn(1, 2, 4), torch.randn(1, 3, 4)),
            r"hx\[1\] \(c0\): expected shape",
        ),
        (
            torch.randn(3, 5),
            (torch.randn(2, 4), torch.randn(1, 4)),
            r"hx\[0\] \(h0\): expected shape \[1, 4\]",
        ),
        (torch.randn(3, 2, 5), torch.randn(1, 2, 4), "hx: expected a pair"),
    ],
)
def test_module_bad_inputs_raise_value_error(x, hx, match):
    with pytest.raises(ValueError, match=match):
        LSTM(5, 4)(x, hx)


def _flashrnn_like(wx, r, b, function, backend, dtype):
    """FlashRNN's `flashrnn` as `hfkit.bench.peers` documents it, in plain torch: Wx [B, T, 4, 1, D],
    R [4, 1, D, P] (gate g's D outputs from the P inputs), b [4, 1, D], gates i, f, z, o; returns the
    states [2 (h, c), B, T, 1, D] and the last."""
    assert function == "lstm" and backend == "cuda" and dtype == "float32"
    batch, steps, _, _, hidden = wx.shape
    h = c = wx.new_zeros(batch, hidden)
    hs, cs = [], []
    for t in range(steps):
        raw = wx[:, t, :, 0] + torch.einsum("gdp,bp->bgd", r[:, 0], h) + b[None, :, 0]
        i, f, z, o = raw.unbind(1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(z)
        h = torch.sigmoid(o) * torch.tanh(c)
        hs.append(h)
        cs.append(c)
    states = torch.stack([torch.stack(hs, 1), torch.stack(cs, 1)])[:, :, :, None]
    return states, states[:, :, -1:]


def test_flashrnn_peer_takes_torchs_weights_in_its_layout():
    """The benchmark's FlashRNN provider hands an nn.LSTM's own weights to `flashrnn` in its layout:
    with a stand-in that computes what FlashRNN documents, its outputs and every gradient are
    nn.LSTM's. Without a CUDA device the provider skips, with the reason."""
    from hfkit.bench.runner import Skip

    torch_lstm = nn.LSTM(7, 33, batch_first=True)
    peer = lstm_bench._FlashRNNLSTM(torch_lstm, _flashrnn_like)
    x = torch.randn(3, 5, 7, requires_grad=True)
    expected, actual = torch_lstm(x)[0], peer(x)[0]
    assert_close(actual, expected, msg="y")
    dy = torch.randn_like(expected)
    params = list(torch_lstm.parameters())
    for name, a, e in zip(
        ["x", *[n for n, _ in torch_lstm.named_parameters()]],
        torch.autograd.grad(actual, [x, *params], dy),
        torch.autograd.grad(expected, [x, *params], dy),
        strict=True,
    ):
        assert_close(a, e, msg=name)
    with pytest.raises(Skip, match="flashrnn needs a CUDA device"):
        lstm_bench._provider("flashrnn", lstm_bench.lstm_cases("smoke")[0], torch.device("cpu"))


def test_benchmark_rows_on_cpu():
    ceilings = Ceilings(copy_gbps=10.0, matmul_tflops=0.1, device_name="CPU (test)", matmul_dtype="fp32")
    result = run_benchmark(
        lstm_bench.BENCHMARK, lstm_bench.lstm_cases("smoke"), "cpu", dtypes=("fp32",),
        providers=("hfkit", "eager"), progress=False, ceilings=ceilings, warmup=0, reps=1,
    )  # fmt: skip
    assert [(r.shape, r.provider, r.mode) for r in result.rows] == [
        (list(s), p, m)
        for s in lstm_bench.SMOKE_SHAPES
        for p in ("hfkit", "eager")
        for m in ("fwd", "fwd+bwd")
    ]
    for row in result.rows:
        assert row.method != "error", row.extra
        assert row.extra["check_ok"] and row.extra["max_abs_err_vs_fp32_ref"] < 1e-5
        # The hfkit rows ran hfkit's module (the LSTM swap is opt-in: the case names it), eager torch's.
        assert row.extra["runs"] == (
            "hfkit.nn.lstm.LSTM" if row.provider == "hfkit" else "torch.nn.modules.rnn.LSTM"
        )
        assert row.flops == lstm_bench.lstm_flops(row.shape, row.mode == "fwd+bwd")
    with pytest.raises(ValueError, match="shapes"):
        lstm_bench.lstm_cases(shapes=[(2, 5, 12)])


# Compiles both step kernels for sm_90 with every constexpr combination the CUDA path launches, through
# tests/compile_sm90.py's helper (run with TRITON_INTERPRET=0: interpreted kernels cannot be compiled).
_COMPILE_STEP_KERNELS = """
import compile_sm90 as c
from hfkit.ops import _lstm_kernels as k
tiles = {"BLOCK_B": 16, "BLOCK_H": 16, "BLOCK_K": 64}
for dt, dot in (("bf16", 0), ("fp16", 0), ("fp32", 3), ("fp32", 4)):
    fwd = {"XP": dt, "Bias": "fp32", "HPrev": dt, "W": dt, "CS": "fp32", "Y": dt, "G": "fp32"}
    bwd = {"DY": dt, "DHN": dt, "DGNext": "fp32", "W": dt, "G": "fp32", "CS": "fp32", "DC": "fp32"}
    bwd["DG"] = "fp32"
    for flag in (True, False):
        flags = {"HAS_BIAS": flag, "DOT": dot, **tiles}
        assert "cubin" in c.compile_sm90(k.lstm_step_fwd_kernel, fwd, flags)
        flags = {"LAST": flag, "SPLIT": dt != "fp32", "DOT": dot, **tiles}
        assert "cubin" in c.compile_sm90(k.lstm_step_bwd_kernel, bwd, flags)
print(len(c.COMPILED))
"""


def _compiled_count(script: str) -> str:
    """Run a compile script in a fresh interpreter with compiled (not interpreted) Triton and the tests'
    folder on the path; returns the last word it prints (the number of kernels it compiled)."""
    pytest.importorskip("triton.backends.nvidia", reason="this Triton build has no NVIDIA backend")
    tests = Path(__file__).parent
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([str(tests), str(tests.parent)]))
    cmd = [sys.executable, "-c", script]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout.split()[-1]


def test_step_kernels_compile_for_hopper():
    assert _compiled_count(_COMPILE_STEP_KERNELS) == "16"


# Compiles both sequence kernels for sm_90 as the CUDA path launches them (one launch for the sequence)
# at hfai's B = 4, H = 985 on 132 SMs: bfloat16 and float16 with the w_hh slices on chip (the
# backward's dgates split and rounded once), float32 streaming both slices with three TF32 products
# and holding them on chip with one, at the largest the rule allows (shared memory within sm_90's
# 227 KB a block); the grid barrier's release-acquire atomics are in every PTX. ptxas (the one Triton
# runs, with its options) allocates every backward, with and without PREFETCH, at its 4 warps with at
# most 128 bytes of spill stores, the backward (as the CUDA path launches it: SEQ_BWD_SPLIT,
# SEQ_BWD_PREFETCH) with at most 192 (the 4 warps measured 10% faster on the H200 than 8 without
# spills; see SEQ_BWD_NUM_WARPS). With the H200's Triton 3.6 the bfloat16 backward spills 168 bytes
# since the float16 operands of 2bd30d8 (data/results/h200/lstm.json was measured with them); the
# other backwards must compile, and their spills are printed (SPLIT and PREFETCH, off by default: 240).
_COMPILE_SEQ_KERNELS = """
import importlib, re, subprocess, tempfile
import triton
from triton.compiler import ASTSource
from triton.backends.nvidia.compiler import get_ptxas
import compile_sm90 as c
from hfkit.ops import _lstm_kernels as k
op = importlib.import_module("hfkit.ops.lstm")
warps = op.SEQ_NUM_WARPS
def spills(ptx):
    with tempfile.TemporaryDirectory() as tmp:
        open(tmp + "/k.ptx", "w").write(ptx)
        cmd = [get_ptxas(90).path, "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", tmp + "/k.ptx"]
        log = subprocess.run(cmd + ["-o", tmp + "/k.cubin"], capture_output=True, text=True, check=True)
    return re.search(r"(\\d+) bytes spill stores", log.stderr).group(1), log.stderr
def bwd_tiles(tiles):
    ks = -(-985 // tiles.bwd_block_k) * tiles.bwd_block_k
    return {"BLOCK_B": tiles.bwd_block_b, "BLOCK_U": tiles.bwd_block_u, "BLOCK_K": tiles.bwd_block_k,
            "KS": ks}
for dt, size, dot in (("bf16", 2, 0), ("fp16", 2, 0), ("fp32", 4, 3), ("fp32", 4, 4)):
    tiles = op._persistent_tiles(4, 985, size, dot, 132)
    assert tiles.resident == tiles.bwd_resident == (dot != 3), tiles
    half = "fp16" if tiles.half else dt
    fwd = {"XP": dt, "Bias": "fp32", "H0": half, "W": half, "CS": "fp32", "Y": dt, "G": "fp32"}
    fwd.update(WUnscale="fp32", H0Unscale="fp32", HRing="fp16")
    bwd = {"DY": dt, "DHN": dt, "W": dt, "G": "fp32", "CS": "fp32", "DC": "fp32", "DG": "fp32", "DGS": dt}
    fwd["Counter"] = bwd["Counter"] = "i32"
    fwd_tiles = {"BLOCK_B": tiles.block_b, "BLOCK_U": tiles.fwd_block_u, "BLOCK_K": tiles.fwd_block_k}
    for has_bias in (True, False):
        flags = {"HAS_BIAS": has_bias, "PERSISTENT": True, "RESIDENT": tiles.resident, "DOT": dot}
        flags.update(HALF=tiles.half, **fwd_tiles)
        asm = c.compile_sm90(k.lstm_seq_fwd_kernel, fwd, flags, num_warps=warps)
        assert "cubin" in asm and "atom.global.gpu.acq_rel.add" in asm["ptx"]
        spilled, log = spills(asm["ptx"])
        assert int(spilled) <= 128, (dt, dot, has_bias, log)
    for split in ((True, False) if size == 2 else (False,)):
        tiles = op._persistent_tiles(4, 985, size, dot, 132, bwd_split=split)
        for prefetch in (True, False):
            flags = {"PERSISTENT": True, "RESIDENT": tiles.bwd_resident, "SPLIT": split, "PREFETCH": prefetch}
            flags.update(DOT=dot, **bwd_tiles(tiles))
            asm = c.compile_sm90(k.lstm_seq_bwd_kernel, bwd, flags, num_warps=tiles.bwd_num_warps)
            assert "cubin" in asm and "atom.global.gpu.acq_rel.add" in asm["ptx"]
            spilled, log = spills(asm["ptx"])
            if (split, prefetch) == (size == 2 and op.SEQ_BWD_SPLIT, op.SEQ_BWD_PREFETCH):
                assert int(spilled) <= 192, (dt, dot, split, prefetch, log)
            print(dt, dot, "split" * split, "prefetch" * prefetch, spilled, "bytes spilled")
def shared_bytes(fn, pointers, constexprs):
    signature = {}
    for p in fn.params:
        pointer = "*" + pointers[p.name] if p.name in pointers else "i32"
        signature[p.name] = "constexpr" if p.is_constexpr else pointer
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=c.HOPPER, options={"num_warps": warps}).metadata.shared
# fp32, one TF32 product, resident: the forward's operands in float16 (HALF), (4*8 + 16) * 1024 * 2 bytes.
flags = {"HAS_BIAS": True, "PERSISTENT": True, "RESIDENT": True, "DOT": 4, "HALF": True, **fwd_tiles}
assert tiles.resident and tiles.half
assert shared_bytes(k.lstm_seq_fwd_kernel, fwd, flags) <= 227 * 1024
# The backward on chip: float32 with one TF32 product (4*8 + 4*4) * 1024 * 4 bytes, the rule's
# SEQ_RESIDENT_BYTES; bfloat16 with the split (4*8 + 8*4) * 1024 * 2.
flags = {"PERSISTENT": True, "RESIDENT": True, "SPLIT": False, "PREFETCH": True, "DOT": 4, **bwd_tiles(tiles)}
resident_bytes = (4 * tiles.bwd_block_u + 4 * tiles.bwd_block_b) * tiles.bwd_block_k * 4
assert tiles.bwd_resident and resident_bytes == op.SEQ_RESIDENT_BYTES
assert shared_bytes(k.lstm_seq_bwd_kernel, bwd, flags) <= 227 * 1024
tiles = op._persistent_tiles(4, 985, 2, 0, 132, bwd_split=True)
bwd.update({k: "bf16" for k in ("DY", "DHN", "W", "DGS")})
flags = {"PERSISTENT": True, "RESIDENT": True, "SPLIT": True, "PREFETCH": True, "DOT": 0, **bwd_tiles(tiles)}
assert tiles.bwd_resident and shared_bytes(k.lstm_seq_bwd_kernel, bwd, flags) <= 227 * 1024
print(len(c.COMPILED))
"""


def test_sequence_kernels_compile_for_hopper():
    assert _compiled_count(_COMPILE_SEQ_KERNELS) == "20"


def test_recurrence_dot_follows_cudnn_allow_tf32(monkeypatch):
    """float32 on CUDA: one TF32 product (mode 4) under `torch.backends.cudnn.allow_tf32`, as cuDNN's
    LSTM, three (mode 3) without, whatever the float32 matmul precision; elsewhere `dot_mode`'s."""
    from types import SimpleNamespace

    from hfkit.ops._triton import dot_mode

    cuda32 = SimpleNamespace(dtype=torch.float32, is_cuda=True)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert lstm_op.recurrence_dot(cuda32) == 4
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert lstm_op.recurrence_dot(cuda32) == 3
    cuda16 = SimpleNamespace(dtype=torch.bfloat16, is_cuda=True)
    cpu32 = torch.zeros(1)
    assert lstm_op.recurrence_dot(cuda16) == dot_mode(cuda16) == 0
    assert lstm_op.recurrence_dot(cpu32) == dot_mode(cpu32) == 1
    # The op's torch matmuls take TF32 inside `_products_like_cudnn` exactly where the recurrence does.
    cases = ((True, cuda32, True), (False, cuda32, False), (True, cuda16, False), (True, cpu32, False))
    before = torch.backends.cuda.matmul.allow_tf32  # (monkeypatch cannot restore this flag)
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for allow, w, inside in cases:
            monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", allow)
            with lstm_op._products_like_cudnn(w):
                assert torch.backends.cuda.matmul.allow_tf32 is inside
            assert torch.backends.cuda.matmul.allow_tf32 is False
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("t_len,batch,hidden", [(1000, 4, 985), (37, 5, 130)])
def test_float32_follows_cudnn_tf32_cuda(monkeypatch, t_len, batch, hidden):
    """Under torch's default `torch.backends.cudnn.allow_tf32`, cuDNN's float32 nn.LSTM multiplies in
    TF32 and so does hfkit's: outputs and every gradient against float64 no worse than 1.25x cuDNN's
    own error (+ 1e-3), and each of them further from float64 than the exact float32 recurrence
    (which the flag off gives), so that the check could fail."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    torch_lstm, hfkit_lstm = make_pair(hidden, hidden, torch.float64)
    scale = 1 / (0.3 * hidden**0.5)
    with torch.no_grad():
        for p in torch_lstm.parameters():
            p.mul_(scale)
    torch_lstm.cuda()
    hfkit_lstm.load_state_dict(torch_lstm.state_dict())
    x, hx = module_inputs(batch, t_len, hidden, hidden, torch.float64, False, 1, 1, True)
    x, hx = x.cuda(), tuple(t.cuda() for t in hx)
    truth = run_module(torch_lstm, x, hx)
    x32, hx32 = x.float(), tuple(t.float() for t in hx)
    cudnn = run_module(copy.deepcopy(torch_lstm).float(), x32, hx32)
    tf32 = run_module(hfkit_lstm.cuda().float(), x32, hx32)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    exact = run_module(hfkit_lstm, x32, hx32)
    for name in truth:
        err, ref_err = rel_err(tf32[name], truth[name]), rel_err(cudnn[name], truth[name])
        assert err <= 1.25 * ref_err + 1e-3, (name, err, ref_err)
    assert rel_err(tf32["output"], truth["output"]) > rel_err(exact["output"], truth["output"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", [3, 65], ids=["sequence", "steps"])
def test_graph_replay_matches_reference_cuda(dtype, batch):
    """On CUDA, both paths: the sequence kernels' one launch (B = 3) and the step loops replaying
    captured graphs (B = 65, past one batch tile): calls with new inputs (the same shape, so the same
    graphs) give the reference's outputs and gradients each time, and so does a call captured in the
    caller's own graph (the launches go into it)."""
    for _ in range(3):
        layer = layer_args(37, batch, 7, 130, dtype)
        args = {k: v.cuda() if v is not None else None for k, v in layer.items()}
        assert (lstm_op._seq_tiles(args["x"], args["w_hh"]) is None) == (batch > lstm_op.MAX_BLOCK_B)
        actual = outputs_and_grads(lstm_layer, args)
        truth = outputs_and_grads(
            lstm_reference, {k: v.double() if v is not None else None for k, v in args.items()}
        )
        if dtype == torch.float32:
            for name in actual:
                assert rel_err(actual[name], truth[name]) <= 1e-4, name
        else:
            check_bf16(actual, outputs_and_grads(lstm_reference, args), truth)
    args = {k: v.cuda() if v is not None else None for k, v in layer_args(11, batch, 7, 33, dtype).items()}
    expected = lstm_layer(**args)
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        captured = lstm_layer(**args)
    args["x"].copy_(torch.randn_like(args["x"]))
    outer.replay()
    again = lstm_layer(**args)
    for c, a, e in zip(captured, again, expected, strict=True):
        assert_close(c, a)
        assert not torch.allclose(c, e)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "t_len,batch,n_in,hidden",
    [(1000, 4, 985, 985), (1, 1, 7, 33), (37, 5, 7, 33), (37, 1, 7, 130), (1, 5, 7, 130), (37, 5, 7, 985)],
)
def test_persistent_launch_matches_reference_cuda(dtype, t_len, batch, n_in, hidden):
    """On CUDA the sequence kernels run the whole sequence in one launch, the programs meeting at the
    grid barrier after each step: outputs and every gradient against the reference in float64, no
    worse than the reference in the same dtype (float32: within 1e-4 or 1.25x its error; bfloat16 as
    `check_bf16`), at hfai's config (weights at torch's init scale, ~1/sqrt(H)) and odd sizes, twice
    (the barrier's counter starts from zero at each launch)."""
    args = layer_args(t_len, batch, n_in, hidden, dtype)
    if hidden == 985:
        scale = 1 / (0.3 * hidden**0.5)
        args = {k: (v.float() * scale).to(dtype) if k[0] in "wb" else v for k, v in args.items()}
    args = {k: v.cuda() for k, v in args.items()}
    assert lstm_op._seq_tiles(args["x"], args["w_hh"]) is not None and lstm_op._one_launch(args["x"])
    truth = outputs_and_grads(lstm_reference, {k: v.double() for k, v in args.items()})
    expected = outputs_and_grads(lstm_reference, args)
    tol, slack = (1e-4, 1e-6) if dtype == torch.float32 else (BF16_REL_TOL, 2e-3)
    for _ in range(2):
        actual = outputs_and_grads(lstm_layer, args)
        assert actual.keys() == truth.keys()
        for name in actual:
            assert actual[name].dtype == dtype and actual[name].shape == truth[name].shape, name
            err, ref_err = rel_err(actual[name], truth[name]), rel_err(expected[name], truth[name])
            assert err <= max(tol, 1.25 * ref_err + slack), (name, err, ref_err)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("split", [True, False], ids=["split", "rounded"])
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "in-step"])
@pytest.mark.parametrize("t_len,batch,hidden", [(37, 5, 130), (300, 4, 985)])
def test_persistent_backward_variants_cuda(monkeypatch, split, prefetch, t_len, batch, hidden):
    """On CUDA, the one-launch backward's variants (dgates split or rounded once, a step's inputs
    loaded one step ahead or in the step), bfloat16: outputs and every gradient as `check_bf16`
    against the reference in bfloat16, both against the reference in float64."""
    monkeypatch.setattr(lstm_op, "SEQ_BWD_SPLIT", split)
    monkeypatch.setattr(lstm_op, "SEQ_BWD_PREFETCH", prefetch)
    args = layer_args(t_len, batch, 7, hidden, torch.bfloat16)
    scale = 1 / (0.3 * hidden**0.5)
    args = {
        k: ((v.float() * scale).to(torch.bfloat16) if k[0] in "wb" else v).cuda() for k, v in args.items()
    }
    tiles = lstm_op._seq_tiles(args["x"], args["w_hh"])
    assert tiles is not None and (tiles.bwd_split, tiles.bwd_prefetch) == (split, prefetch)
    truth = outputs_and_grads(lstm_reference, {k: v.double() for k, v in args.items()})
    check_bf16(outputs_and_grads(lstm_layer, args), outputs_and_grads(lstm_reference, args), truth)
