"""hfkit.nn.{TriangleAttentionEndingNode, MSAColumnAttention}: attention along columns without
transposing copies, against the model's modules.

Outputs and the gradients of the input and of every parameter equal the plain module's (float32,
odd sizes, masks with zeros, a fully masked row, no mask, chunked and unchunked, with and without a
batch dim); the update comes back contiguous in the input's layout; the profiler sees no copy of an
input-sized tensor any more (it does without these swaps); inputs the fast path does not take run
the model's forward; `to_hfkit` / `to_torch` swap the classes and keep the state_dict; OpenFold's own
ending-node and column attentions likewise (skipped where OpenFold's source is absent). On CPU the
kernels run under TRITON_INTERPRET=1 (conftest.py); a GPU machine also runs them on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import hfkit.nn as hnn
from hfkit.bench.peers import load_openfold
from hfkit.model import (
    EvoformerBlock,
    MSAColumnAttention,
    TriangleAttentionEndingNode,
    TriangleAttentionStartingNode,
)
from hfkit.nn.attention import attend_axis, fused_gated_attention
from hfkit.ops._triton import reference_on_cpu

DEVICES = (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []) + (
    ["cuda"] if torch.cuda.is_available() else []
)
# Relative L2 error of float32 results against the plain module's (float32 on both sides: the
# projections see the rows in another order, the attention runs the fused op instead of torch).
TOL = {torch.float32: 2e-5, torch.float64: 1e-12}
C, C_HIDDEN, HEADS = 12, 5, 3  # heads * c_hidden != C: q/k/v are never input-sized


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(actual).all(), "non-finite values in the result"
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def randomized(module: torch.nn.Module, device: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """module with every parameter random (the model's init zeroes linear_o and the gate's weight,
    which would hide every attention gradient)."""
    module = module.to(device, dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.4)
    return module


def make_mask(shape: tuple[int, ...], kind: str, device: str) -> torch.Tensor | None:
    """None, or a 0/1 mask with about a fifth zeros, and with `kind` "row" one row all zeros."""
    if kind == "none":
        return None
    mask = (torch.rand(shape, device=device) > 0.2).float()
    if kind == "row":
        mask[..., 1, :] = 0.0
    return mask


def outputs_and_grads(module, x, mask, chunk_size, dy):
    """module(x, mask, chunk_size) and the gradients of x and of every parameter for dy."""
    x = x.detach().clone().requires_grad_(True)
    out = module(x, mask, chunk_size=chunk_size)
    grads = torch.autograd.grad(out, [x, *module.parameters()], dy)
    return out, grads


def assert_matches_plain(plain, x, mask, chunk_size=None, fast=True):
    """The swapped copy of `plain` gives plain's output and gradients; its update is contiguous in x's
    layout where `fast` (the fast path ran), a transposed view where not (the model's forward ran)."""
    swapped = hnn.to_hfkit(plain, inplace=False)
    dy = torch.randn(x.shape, device=x.device, dtype=x.dtype)
    want, want_grads = outputs_and_grads(plain, x, mask, chunk_size, dy)
    got, got_grads = outputs_and_grads(swapped, x, mask, chunk_size, dy)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.is_contiguous() is fast and not want.is_contiguous()
    tol = TOL[x.dtype]
    assert rel_err(got, want) < tol
    names = ["x", *(n for n, _ in plain.named_parameters())]
    assert len(got_grads) == len(want_grads) == len(names)
    for name, g, w in zip(names, got_grads, want_grads, strict=True):
        assert rel_err(g, w) < tol, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "n, batch, mask_kind",
    [
        (13, True, "zeros"),
        (13, False, "row"),
        (13, True, "none"),
        pytest.param(37, True, "zeros", marks=pytest.mark.slow),  # a minute under the interpreter
    ],
)
def test_ending_node_matches_the_model(n, batch, mask_kind, device, seed):
    plain = randomized(TriangleAttentionEndingNode(C, C_HIDDEN, HEADS), device)
    lead = (1,) if batch else ()
    x = torch.randn(*lead, n, n, C, device=device)
    assert_matches_plain(plain, x, make_mask(x.shape[:-1], mask_kind, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "n, batch, mask_kind, chunk_size",
    [(13, True, "zeros", None), (13, False, "row", None), (11, True, "none", 64), (11, True, "zeros", 4)],
)
def test_starting_node_matches_the_model(n, batch, mask_kind, chunk_size, device, seed):
    """The swapped starting node (its bias projection beside q, k, v and the gate; chunks below N run
    the model's forward) gives the model's output and every gradient."""
    plain = randomized(TriangleAttentionStartingNode(C, C_HIDDEN, HEADS), device)
    swapped = hnn.to_hfkit(plain, inplace=False)
    assert type(swapped) is hnn.TriangleAttentionStartingNode
    x = torch.randn(*((1,) if batch else ()), n, n, C, device=device)
    mask = make_mask(x.shape[:-1], mask_kind, device)
    dy = torch.randn(x.shape, device=device)
    want, want_grads = outputs_and_grads(plain, x, mask, chunk_size, dy)
    got, got_grads = outputs_and_grads(swapped, x, mask, chunk_size, dy)
    assert got.shape == want.shape and rel_err(got, want) < TOL[torch.float32]
    names = ["x", *(name for name, _ in plain.named_parameters())]
    for name, g, w in zip(names, got_grads, want_grads, strict=True):
        assert rel_err(g, w) < TOL[torch.float32], name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "s, n, batch, mask_kind", [(5, 13, True, "zeros"), (5, 13, False, "row"), (5, 37, True, "none")]
)
def test_msa_column_attention_matches_the_model(s, n, batch, mask_kind, device, seed):
    plain = randomized(MSAColumnAttention(C, C_HIDDEN, HEADS), device)
    lead = (1,) if batch else ()
    m = torch.randn(*lead, s, n, C, device=device)
    assert_matches_plain(plain, m, make_mask(m.shape[:-1], mask_kind, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk_size, fast", [(4, False), (13, True), (64, True)])
def test_chunked_calls(chunk_size, fast, device, seed):
    """Chunks below the attended columns run the model's (chunked) forward; larger ones, the fast path."""
    tri = randomized(TriangleAttentionEndingNode(C, C_HIDDEN, HEADS), device)
    x = torch.randn(1, 13, 13, C, device=device)
    assert_matches_plain(tri, x, make_mask(x.shape[:-1], "zeros", device), chunk_size, fast)
    col = randomized(MSAColumnAttention(C, C_HIDDEN, HEADS), device)
    m = torch.randn(1, 5, 13, C, device=device)
    assert_matches_plain(col, m, make_mask(m.shape[:-1], "zeros", device), chunk_size, fast)


def input_sized_copies(module: torch.nn.Module, x: torch.Tensor) -> list[tuple[str, list]]:
    """The copies of tensors shaped like x or its transpose that the profiler sees in one forward and
    backward of module(x)."""
    x = x.detach().clone().requires_grad_(True)
    sizes = {tuple(x.shape), tuple(x.transpose(-2, -3).shape)}
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        module(x).backward(torch.ones_like(x))
    copies = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy")
    return [
        (e.name, e.input_shapes)
        for e in prof.events()
        if e.name in copies and any(tuple(s) in sizes for s in e.input_shapes)
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_fast_path_makes_no_input_sized_copy(device, seed):
    """The profiler sees input-sized copies (of x or its transpose) in the model's ending-node and
    column attention after `to_hfkit` without these swaps, and none with them (forward and backward)."""
    cases = [
        (
            TriangleAttentionEndingNode(C, C_HIDDEN, HEADS),
            torch.randn(1, 13, 13, C, device=device),
            "TriangleAttentionEndingNode",
        ),
        (
            MSAColumnAttention(C, C_HIDDEN, HEADS),
            torch.randn(1, 5, 13, C, device=device),
            "MSAColumnAttention",
        ),
    ]
    for plain, x, op in cases:
        plain = randomized(plain, device)
        without = hnn.to_hfkit(plain, inplace=False, exclude={op})
        assert type(without) is type(plain)
        assert input_sized_copies(without, x), op  # the check sees the copies it looks for
        swapped = hnn.to_hfkit(plain, inplace=False)
        assert type(swapped) is not type(plain)
        assert input_sized_copies(swapped, x) == [], op


def test_inputs_the_fast_path_does_not_take_run_the_model(seed):
    """float64, the op's reference on CPU, an `mha` that is not hfkit's, two leading dims and a mask
    that requires grad: the model's forward (its transposed view back), same values."""
    tri = randomized(TriangleAttentionEndingNode(C, C_HIDDEN, HEADS), "cpu")
    x = torch.randn(1, 13, 13, C)
    mask = make_mask(x.shape[:-1], "zeros", "cpu")
    assert_matches_plain(randomized(TriangleAttentionEndingNode(C, C_HIDDEN, HEADS), "cpu", torch.float64),
                         x.double(), mask.double(), fast=False)  # fmt: skip
    assert_matches_plain(randomized(MSAColumnAttention(C, C_HIDDEN, HEADS), "cpu", torch.float64),
                         torch.randn(1, 5, 13, C, dtype=torch.float64), None, fast=False)  # fmt: skip
    swapped = hnn.to_hfkit(tri, inplace=False)
    with torch.no_grad():
        want = tri(x, mask)
        with reference_on_cpu():
            got = swapped(x, mask)
        assert not got.is_contiguous() and rel_err(got, want) < TOL[torch.float32]
        only = hnn.to_hfkit(tri, inplace=False, include={"TriangleAttentionEndingNode"})
        assert type(only.mha) is hnn.Attention
        got = only(x, mask)
        assert not got.is_contiguous() and rel_err(got, want) < TOL[torch.float32]
        x2 = torch.randn(2, 1, 7, 7, C)
        got = swapped(x2)
        assert not got.is_contiguous() and rel_err(got, tri(x2)) < TOL[torch.float32]
    assert attend_axis(swapped.mha, swapped.layer_norm, x, mask.requires_grad_(True), 1e9) is None


def test_fused_gated_attention_transposed_checks_q_x():
    att = hnn.EvoformerAttention(C, C, C, C_HIDDEN, HEADS)
    x = torch.randn(1, 2, 3, 4, C)
    with pytest.raises(ValueError, match="q_x: expected"):
        fused_gated_attention(att, x, x, (None, None), transposed=True)


def test_to_hfkit_round_trip_keeps_types_and_state(seed):
    block = EvoformerBlock(
        c_m=C, c_z=8, c_hidden_msa_att=4, c_hidden_opm=3, c_hidden_mul=5, c_hidden_pair_att=4,
        no_heads_msa=2, no_heads_pair=2, transition_n=2, msa_dropout=0.0, pair_dropout=0.0,
    )  # fmt: skip
    before = {k: v.clone() for k, v in block.state_dict().items()}
    swapped, report = hnn.to_hfkit(block, inplace=False, report=True)
    assert report.counts()["TriangleAttentionEndingNode"] == 1
    assert report.counts()["MSAColumnAttention"] == 1
    assert type(swapped.core.tri_att_end) is hnn.TriangleAttentionEndingNode
    assert type(swapped.msa_att_col) is hnn.MSAColumnAttention
    # The starting node attends along rows already; swapped for its bias projection (`project`).
    assert report.counts()["TriangleAttentionStartingNode"] == 1
    assert type(swapped.core.tri_att_start) is hnn.TriangleAttentionStartingNode
    assert swapped.state_dict().keys() == before.keys()
    assert all(torch.equal(swapped.state_dict()[k], v) for k, v in before.items())
    fresh = hnn.to_hfkit(
        EvoformerBlock(
            c_m=C, c_z=8, c_hidden_msa_att=4, c_hidden_opm=3, c_hidden_mul=5, c_hidden_pair_att=4,
            no_heads_msa=2, no_heads_pair=2, transition_n=2, msa_dropout=0.0, pair_dropout=0.0,
        )
    )  # fmt: skip
    fresh.load_state_dict(swapped.state_dict(), strict=True)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())
    back = hnn.to_torch(swapped)
    assert type(back.core.tri_att_end) is TriangleAttentionEndingNode
    assert type(back.core.tri_att_start) is TriangleAttentionStartingNode
    assert type(back.msa_att_col) is MSAColumnAttention
    assert [type(m) for m in back.modules()] == [type(m) for m in block.modules()]
    assert all(torch.equal(back.state_dict()[k], v) for k, v in before.items())


@pytest.mark.parametrize("device", DEVICES)
def test_block_matches_the_model(device, seed):
    """A whole Evoformer block after `to_hfkit`: the contiguous updates meet the residual adds."""
    block = EvoformerBlock(
        c_m=C, c_z=8, c_hidden_msa_att=4, c_hidden_opm=3, c_hidden_mul=5, c_hidden_pair_att=4,
        no_heads_msa=2, no_heads_pair=2, transition_n=2, msa_dropout=0.0, pair_dropout=0.0,
    )  # fmt: skip
    block = randomized(block, device).eval()
    swapped = hnn.to_hfkit(block, inplace=False)
    m, z = torch.randn(1, 5, 11, C, device=device), torch.randn(1, 11, 11, 8, device=device)
    msa_mask = make_mask(m.shape[:-1], "zeros", device)
    pair_mask = make_mask(z.shape[:-1], "zeros", device)
    with torch.no_grad():
        want = block(m, z, msa_mask, pair_mask)
        got = swapped(m, z, msa_mask, pair_mask)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["triangle", "column"])
def test_openfold_column_attentions(kind, device, seed):
    """OpenFold's ending-node `TriangleAttention(starting=False)` and `MSAColumnAttention` after
    `to_hfkit`: OpenFold's output and gradients, the update contiguous, no input-sized copy (there is
    one without these swaps), and `to_torch` gives OpenFold's class back."""
    of, reason = load_openfold()
    if of is None:
        pytest.skip(reason)
    if kind == "triangle":
        plain, x, op = (
            of.evoformer.TriangleAttention(C, C_HIDDEN, HEADS, starting=False),
            (1, 13, 13, C),
            "TriangleAttention",
        )
    else:
        plain, x, op = (
            of.evoformer.MSAColumnAttention(C, C_HIDDEN, HEADS),
            (1, 5, 13, C),
            "MSAColumnAttention",
        )
    plain = randomized(plain, device)
    x = torch.randn(x, device=device)
    assert_matches_plain(plain, x, make_mask(x.shape[:-1], "zeros", device))
    swapped, report = hnn.to_hfkit(plain, inplace=False, report=True)
    assert report.counts()[f"openfold.{op}"] == 1
    assert input_sized_copies(swapped, x) == []
    assert input_sized_copies(hnn.to_hfkit(plain, inplace=False, exclude={f"openfold.{op}"}), x)
    assert type(hnn.to_torch(swapped)) is type(plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "cls", [TriangleAttentionStartingNode, TriangleAttentionEndingNode], ids=["start", "end"]
)
@pytest.mark.parametrize("mask_kind", ["zeros", "none"])
def test_add_update_in_place_equals_x_plus_forward(cls, mask_kind, device, seed, monkeypatch):
    """`add_update_` (the lean path's in-place residual update) gives x + forward(x) in x's storage, its
    output projection adding into x (`gated_linear_add_` called once) on the fast path."""
    import hfkit.nn.attention as attention_module

    plain = randomized(cls(C, C_HIDDEN, HEADS), device)
    swapped = hnn.to_hfkit(plain, inplace=False)
    x = torch.randn(1, 11, 11, C, device=device)
    mask = make_mask(x.shape[:-1], mask_kind, device)
    calls = []
    add = attention_module.gated_linear_add_
    monkeypatch.setattr(attention_module, "gated_linear_add_", lambda *a: calls.append(1) or add(*a))
    with torch.no_grad():
        expected = x + swapped(x, mask)
        before = x.data_ptr()
        out = swapped.add_update_(x, mask)
    assert out is x and x.data_ptr() == before
    assert rel_err(x, expected) < TOL[torch.float32]
    assert len(calls) == 1
