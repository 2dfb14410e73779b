"""hfkit.ops.gated_linear against its plain-torch reference `F.linear(sigmoid(g) * o, weight, bias)`.

Forward and every gradient on odd sizes, float32 and bfloat16, with and without a bias, under
autocast; what the op keeps for the backward (g and o, not their product); bad inputs name the
argument; the CPU without the interpreter runs the reference. `gated_linear_add_` (in place, no
autograd) against `z + reference`, on row-strided inputs, several column blocks and its fallbacks. On
CPU the gate kernels run under TRITON_INTERPRET=1 (conftest.py); a GPU machine also runs them on CUDA.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_close, output_and_grads

from hfkit.ops import gated_linear, gated_linear_add_, gated_linear_reference

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICES = (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []) + (
    ["cuda"] if torch.cuda.is_available() else []
)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", [(3, 7, 12), (2, 5, 4, 24)], ids=["3d", "4d"])
def test_matches_reference(device, dtype, with_bias, shape, seed):
    g = torch.randn(shape, device=device, dtype=dtype)
    o = torch.randn(shape, device=device, dtype=dtype)
    weight = torch.randn(9, shape[-1], device=device, dtype=dtype) / shape[-1] ** 0.5
    bias = torch.randn(9, device=device, dtype=dtype) if with_bias else None
    dy = torch.randn(*shape[:-1], 9, device=device, dtype=dtype)
    out, grads = output_and_grads(gated_linear, [g, o, weight, bias], dy)
    # The reference in float32 on the same (rounded) inputs: bfloat16 rounds the product and the matmuls.
    f32 = lambda t: t.float() if t is not None else None  # noqa: E731
    ref, ref_grads = output_and_grads(
        gated_linear_reference, [f32(g), f32(o), f32(weight), f32(bias)], dy.float()
    )
    assert out.dtype == dtype and out.shape == (*shape[:-1], 9)
    assert_close(out.float(), ref, dtype=dtype, msg="output")
    for name, actual, expected in zip(["g", "o", "weight", "bias"], grads, ref_grads, strict=False):
        scale = expected.abs().max()
        assert_close(actual.float() / scale, expected / scale, dtype=dtype, msg=f"d{name}")
        assert actual.dtype == dtype


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_matches_the_plain_composition(device, seed):
    g = torch.randn(4, 6, 16, device=device, requires_grad=True)
    o = torch.randn(4, 6, 16, device=device, requires_grad=True)
    linear = torch.nn.Linear(16, 8).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = gated_linear(g.bfloat16(), o.bfloat16(), linear.weight, linear.bias)
        ref = linear(torch.sigmoid(g.bfloat16().float()).bfloat16() * o.bfloat16())
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_close(out.float(), ref.float(), dtype=torch.bfloat16, msg="autocast output")
    gw, gb = torch.autograd.grad(out.float().sum(), [linear.weight, linear.bias])
    rw, rb = torch.autograd.grad(ref.float().sum(), [linear.weight, linear.bias])
    assert gw.dtype == torch.float32 and gb.dtype == torch.float32  # back to the parameters' dtype
    assert_close(gw / rw.abs().max(), rw / rw.abs().max(), dtype=torch.bfloat16, msg="weight grad")
    assert_close(gb, rb, dtype=torch.bfloat16, msg="bias grad")


@pytest.mark.parametrize("device", DEVICES)
def test_keeps_g_and_o_not_their_product(device, seed):
    g = torch.randn(3, 5, 32, device=device, requires_grad=True)
    o = torch.randn(3, 5, 32, device=device, requires_grad=True)
    weight = torch.randn(7, 32, device=device, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = gated_linear(g, o, weight)
    big = {t.data_ptr() for t in saved if t.shape == g.shape}
    assert big == {g.data_ptr(), o.data_ptr()}
    # And the plain composition keeps the product as well: what the op saves.
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        gated_linear_reference(g, o, weight)
    assert len({t.data_ptr() for t in saved if t.shape == g.shape} - {g.data_ptr(), o.data_ptr()}) >= 1
    assert torch.isfinite(torch.autograd.grad(out.sum(), [g, o, weight])[0]).all()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(o=torch.ones(3, 5)), "g, o"),
        (dict(weight=torch.ones(7, 5)), "weight"),
        (dict(bias=torch.ones(3)), "bias"),
        (dict(g=torch.ones(3, 4, dtype=torch.int64)), "g"),
    ],
)
def test_bad_inputs_name_the_argument(kwargs, name):
    args = {"g": torch.ones(3, 4), "o": torch.ones(3, 4), "weight": torch.ones(7, 4), "bias": None, **kwargs}
    with pytest.raises(ValueError, match=name):
        gated_linear(**args)


def test_cpu_without_interpreter_runs_the_reference(monkeypatch, seed):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read at call time by hfkit.ops._triton
    g, o, w, b = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(5, 8), torch.randn(5)
    torch.testing.assert_close(gated_linear(g, o, w, b), gated_linear_reference(g, o, w, b), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize(("rows", "k", "n"), [((3, 37), 48, 40), ((2, 5, 7), 24, 200)], ids=["odd", "wide"])
def test_add_in_place_matches_reference(device, dtype, with_bias, rows, k, n, seed):
    """z += linear(sigmoid(g) * o): g a column slice of a wider projection (rows further apart than K),
    o dense, N over `ADD_MAX_N` (two column blocks) in the second case."""
    proj = torch.randn(*rows, 2 * k + 8, device=device, dtype=dtype)
    g = proj[..., k + 3 : 2 * k + 3]
    o = torch.randn(*rows, k, device=device, dtype=dtype)
    weight = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    bias = torch.randn(n, device=device, dtype=dtype) if with_bias else None
    z = torch.randn(*rows, n, device=device, dtype=dtype)
    f32 = lambda t: t.float() if t is not None else None  # noqa: E731
    expected = z.float() + gated_linear_reference(f32(g), f32(o), f32(weight), f32(bias))
    before = z.data_ptr()
    with torch.no_grad():
        out = gated_linear_add_(z, g, o, weight, bias)
    assert out is z and z.data_ptr() == before and z.dtype == dtype
    assert_close(z.float(), expected, dtype=dtype, msg="z")


@pytest.mark.parametrize("device", DEVICES)
def test_add_in_place_fallbacks_give_the_same_sum(device, seed):
    """A strided z, K over `ADD_MAX_K`, a z of another dtype: `z.add_(gated_linear(...))`, the same sum."""
    g, o = torch.randn(6, 5, 300, device=device), torch.randn(6, 5, 300, device=device)
    weight, bias = torch.randn(7, 300, device=device) / 17, torch.randn(7, device=device)
    expected = gated_linear_reference(g, o, weight, bias)
    z = torch.zeros(5, 6, 7, device=device).transpose(0, 1)  # not contiguous
    with torch.no_grad():
        gated_linear_add_(z, g, o, weight, bias)
    assert_close(z, expected, dtype=torch.float32, msg="strided z, K 300")
    g16, o16, w16 = g[..., :40].bfloat16(), o[..., :40].bfloat16(), weight[:, :40].bfloat16()
    z32 = torch.zeros(6, 5, 7, device=device)  # float32 z, bfloat16 operands
    with torch.no_grad():
        gated_linear_add_(z32, g16, o16, w16)
    ref16 = gated_linear_reference(g16.float(), o16.float(), w16.float())
    assert_close(z32, ref16, dtype=torch.bfloat16, msg="float32 z, bfloat16 operands")


def test_add_in_place_refuses_autograd_and_bad_z():
    g, o, w = torch.randn(3, 4), torch.randn(3, 4), torch.randn(5, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="no_grad"):
        gated_linear_add_(torch.zeros(3, 5), g, o, w)
    with pytest.raises(ValueError, match="z: expected"), torch.no_grad():
        gated_linear_add_(torch.zeros(3, 6), g, o, w)
