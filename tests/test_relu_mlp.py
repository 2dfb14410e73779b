"""hfkit.ops.relu_mlp and the transition swaps (hfkit.nn.MSATransition / PairTransition).

relu_mlp equals `linear_2(relu(linear_1(x)))` forward and in every gradient (odd sizes, float32 and
bfloat16, with and without biases, under autocast) while keeping only its input, not the 4x-wide hidden
layer, for the backward; the swapped transitions equal the model's, keep the state_dict and swap back;
bad inputs name the argument.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, output_and_grads
from torch import nn

import hfkit
import hfkit.nn as hnn
from hfkit.model import EvoformerStack, ModelConfig, MSATransition, PairTransition
from hfkit.ops import relu_mlp, relu_mlp_reference

pytestmark = pytest.mark.usefixtures("one_thread")


def params(c, h, n, dtype, with_bias):
    w1, w2 = torch.randn(h, c, dtype=dtype) / c**0.5, torch.randn(n, h, dtype=dtype) / h**0.5
    b1 = torch.randn(h, dtype=dtype) if with_bias else None
    b2 = torch.randn(n, dtype=dtype) if with_bias else None
    return [w1, b1, w2, b2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 5, 9)], ids=["2d", "4d"])
def test_matches_reference(dtype, with_bias, shape, seed):
    c, h, n = shape[-1], 4 * shape[-1] + 1, 6
    x = torch.randn(shape, dtype=dtype)
    ps = params(c, h, n, dtype, with_bias)
    dy = torch.randn(*shape[:-1], n, dtype=dtype)
    out, grads = output_and_grads(relu_mlp, [x, *ps], dy)
    f32 = [t.float() if t is not None else None for t in ps]
    ref, ref_grads = output_and_grads(relu_mlp_reference, [x.float(), *f32], dy.float())
    assert out.dtype == dtype and out.shape == (*shape[:-1], n)
    assert_close(out.float(), ref, dtype=dtype, msg="output")
    for i, (actual, expected) in enumerate(zip(grads, ref_grads, strict=True)):
        scale = expected.abs().max().clamp_min(1e-12)
        assert actual.dtype == dtype
        assert_close(actual.float() / scale, expected / scale, dtype=dtype, msg=f"gradient {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scale_matches_the_reference(dtype, seed):
    # A factor per row (the transitions' mask, here with fractional values too) applied inside the op.
    x = torch.randn(3, 5, 9, dtype=dtype)
    ps = params(9, 37, 7, dtype, True)
    scale = torch.rand(3, 5, 1, dtype=dtype).masked_fill(torch.rand(3, 5, 1) > 0.6, 0.0)
    dy = torch.randn(3, 5, 7, dtype=dtype)
    out, grads = output_and_grads(lambda *a: relu_mlp(*a, scale=scale), [x, *ps], dy)
    f32 = [t.float() for t in ps]
    ref, ref_grads = output_and_grads(
        lambda *a: relu_mlp_reference(*a, scale=scale.float()), [x.float(), *f32], dy.float()
    )
    assert out.dtype == dtype
    assert_close(out.float(), ref, dtype=dtype, msg="output")
    assert (out[scale.expand_as(out) == 0] == 0).all()  # masked rows are zero, not just small
    for i, (actual, expected) in enumerate(zip(grads, ref_grads, strict=True)):
        norm = expected.abs().max().clamp_min(1e-12)
        assert_close(actual.float() / norm, expected / norm, dtype=dtype, msg=f"gradient {i}")


def test_scale_that_needs_a_gradient_or_broadcasts_is_applied_after(seed):
    x = torch.randn(2, 3, 4, requires_grad=True)
    ps = params(4, 9, 5, torch.float32, True)
    for scale in (torch.rand(2, 3, 1, requires_grad=True), torch.rand(1, 3, 1)):
        out = relu_mlp(x, *ps, scale=scale)
        ref = relu_mlp_reference(x, *ps, scale=scale)
        torch.testing.assert_close(out, ref)
        wrt = [x, scale] if scale.requires_grad else [x]
        got, want = torch.autograd.grad(out.sum(), wrt), torch.autograd.grad(ref.sum(), wrt)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)


def test_autocast_matches_linear_modules(seed):
    lin1, lin2 = nn.Linear(8, 32), nn.Linear(32, 8)
    x = torch.randn(4, 5, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = relu_mlp(x, lin1.weight, lin1.bias, lin2.weight, lin2.bias)
        ref = lin2(torch.relu(lin1(x)))
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # the same bf16 matmuls, the same order
    got = torch.autograd.grad(out.float().sum(), [x, lin1.weight, lin2.bias])
    want = torch.autograd.grad(ref.float().sum(), [x, lin1.weight, lin2.bias])
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        assert_close(a / b.abs().max(), b / b.abs().max(), dtype=torch.bfloat16, msg="autocast gradient")


def test_keeps_the_input_not_the_hidden_layer(seed):
    x = torch.randn(3, 7, 10, requires_grad=True)
    ps = [p.requires_grad_() if p is not None else None for p in params(10, 40, 10, torch.float32, True)]
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        relu_mlp(x, *ps)
    assert sorted(shapes) == sorted([(3, 7, 10), (40, 10), (40,), (10, 40)])  # x, w1, b1, w2
    shapes.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        relu_mlp_reference(x, *ps)
    assert (3, 7, 40) in shapes  # the plain composition keeps the hidden layer


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(w1=torch.ones(12, 5)), "w1"),
        (dict(w2=torch.ones(4, 11)), "w2"),
        (dict(b1=torch.ones(3)), "b1"),
        (dict(b2=torch.ones(3)), "b2"),
        (dict(x=torch.ones(2, 4, dtype=torch.int64)), "x"),
        (dict(scale=[1.0, 0.0]), "scale"),
        (dict(scale=torch.ones(2, 3)), "scale"),
    ],
)
def test_bad_inputs_name_the_argument(kwargs, name):
    args = {"x": torch.ones(2, 4), "w1": torch.ones(12, 4), "b1": None, "w2": torch.ones(4, 12), "b2": None}
    with pytest.raises(ValueError, match=name):
        relu_mlp(**{**args, **kwargs})


@pytest.mark.parametrize(
    "plain_cls, fused_cls", [(MSATransition, hnn.MSATransition), (PairTransition, hnn.PairTransition)]
)
def test_swapped_transition_matches_the_model(plain_cls, fused_cls, seed):
    plain = plain_cls(6, 4)
    with torch.no_grad():
        for p in plain.parameters():
            p.copy_(torch.randn_like(p))  # the model's init zeroes linear_2, hiding wrong gradients
    fused = hfkit.to_hfkit(plain_cls(6, 4))
    fused.load_state_dict(plain.state_dict())
    assert type(fused) is fused_cls and fused.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(2, 5, 7, 6, requires_grad=True)
    mask = (torch.rand(2, 5, 7) > 0.3).float()
    out, ref = fused(x, mask), plain(x, mask)
    torch.testing.assert_close(out, ref)
    for a, b in zip(
        torch.autograd.grad(out.sum(), [x, *fused.parameters()]),
        torch.autograd.grad(ref.sum(), [x, *plain.parameters()]),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert type(hfkit.to_torch(fused)) is plain_cls


@pytest.mark.parametrize("plain_cls", [MSATransition, PairTransition])
def test_add_transition_in_place_matches_the_model(plain_cls, seed):
    """`add_transition_` (the lean path's masked residual update): x + the model's masked update, in
    x's storage, for the model's module and hfkit's (relu_mlp, then the masked add in one pass)."""
    plain = plain_cls(6, 4)
    with torch.no_grad():
        for p in plain.parameters():
            p.copy_(torch.randn_like(p))
    fused = hfkit.to_hfkit(plain_cls(6, 4))
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(2, 5, 7, 6)
    mask = (torch.rand(2, 5, 7, 1) > 0.3).float()
    with torch.no_grad():
        expected = x + plain._transition(plain.layer_norm(x), mask)
        for module in (plain, fused):
            y = x.clone()
            assert module.add_transition_(y, module.layer_norm(y), mask) is y
            torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_evoformer_swaps_both_transitions():
    stack = hfkit.to_hfkit(EvoformerStack.from_config(ModelConfig.tiny()))
    kinds = {type(m) for m in stack.modules()}
    assert hnn.MSATransition in kinds and hnn.PairTransition in kinds
