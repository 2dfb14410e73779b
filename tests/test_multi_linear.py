"""hfkit.ops.multi_linear against its plain-torch reference `[F.linear(x, w_i, b_i) for each i]`.

Outputs and every gradient on odd sizes in float64, float32 and bfloat16, some biases None, some
outputs unused; under autocast; the one gradient of x (no autograd adds); bad inputs name the
argument; gated attention's projections through it (`hfkit.nn.attention.project`). Plain torch: it runs
on every device, CUDA too on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from conftest import assert_close

from hfkit.model.primitives import Attention
from hfkit.nn.attention import project
from hfkit.ops import _linear as linear_ops
from hfkit.ops.multi_linear import multi_linear, multi_linear_reference

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _leaves(tensors):
    return [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]


def _run(fn, x, weights, biases, dys):
    """fn's outputs and the gradients of x, weights and the biases that exist, for output gradients
    dys (None: that output unused)."""
    x, *params = _leaves([x, *weights, *biases])
    n = len(weights)
    outs = fn(x, params[:n], params[n:])
    loss = sum((o * dy).sum() for o, dy in zip(outs, dys, strict=True) if dy is not None)
    wrt = [x, *[p for p in params if p is not None]]
    return outs, torch.autograd.grad(loss, wrt, allow_unused=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lead", [(7,), (3, 5, 2)], ids=["2d", "4d"])
def test_matches_reference(device, dtype, lead, seed):
    k, sizes = 13, (5, 1, 9, 4)
    x = torch.randn(*lead, k, device=device, dtype=dtype)
    weights = [torch.randn(n, k, device=device, dtype=dtype) / k**0.5 for n in sizes]
    biases = [
        None,
        torch.randn(1, device=device, dtype=dtype),
        torch.randn(9, device=device, dtype=dtype),
        None,
    ]
    # The third output unused: its weight and bias get no gradient, as with separate linears.
    dys = [torch.randn(*lead, n, device=device, dtype=dtype) for n in sizes]
    dys[2] = None
    outs, grads = _run(multi_linear, x, weights, biases, dys)
    ref_outs, ref_grads = _run(multi_linear_reference, x, weights, biases, dys)
    tol = torch.float32 if dtype is torch.float64 else dtype
    for i, (o, r) in enumerate(zip(outs, ref_outs, strict=True)):
        assert o.shape == (*lead, sizes[i]) and o.dtype == dtype
        assert_close(o, r, dtype=tol, msg=f"output {i}")
    names = ["x", "w0", "w1", "w2", "w3", "b1", "b2"]
    for name, g, r in zip(names, grads, ref_grads, strict=True):
        if r is None:
            assert g is None, name
            continue
        scale = r.abs().max()
        assert_close(g / scale, r / scale, dtype=tol, msg=f"d{name}")


def test_float64_gradcheck(seed):
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    w = [torch.randn(n, 6, dtype=torch.float64, requires_grad=True) for n in (3, 2)]
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w0, w1, b1: multi_linear(x, [w0, w1], [None, b1]), (x, *w, b))


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_casts_like_linear(device, seed):
    x = torch.randn(4, 6, 16, device=device)
    lins = [torch.nn.Linear(16, n, bias=n != 3).to(device) for n in (8, 3)]
    with torch.autocast(device, dtype=torch.bfloat16):
        outs = multi_linear(x, [lin.weight for lin in lins], [lin.bias for lin in lins])
        refs = [lin(x) for lin in lins]
    for o, r in zip(outs, refs, strict=True):
        assert o.dtype == r.dtype == torch.bfloat16
        assert_close(o.float(), r.float(), dtype=torch.bfloat16)
    grads = torch.autograd.grad(sum(o.float().sum() for o in outs), [lins[0].weight, lins[0].bias])
    assert all(g.dtype == torch.float32 for g in grads)


def test_x_gets_one_gradient_and_no_autograd_add(seed):
    """Separate linears send x one gradient each, which autograd adds; multi_linear sends one."""
    x = torch.randn(5, 8, requires_grad=True)
    weights = [torch.randn(n, 8, requires_grad=True) for n in (4, 4, 4)]
    biases = [None, None, None]
    for fn, consumers in ((multi_linear_reference, 3), (multi_linear, 1)):
        h = x * 1.0  # a non-leaf: its grad_fn counts the gradients it receives
        outs = fn(h, weights, biases)
        nodes = {o.grad_fn for o in outs}  # multi_linear's outputs share one node
        edges = [e for node in nodes for e in node.next_functions if e[0] is h.grad_fn]
        assert len(edges) == consumers


def test_bad_inputs_name_the_argument():
    x = torch.randn(3, 4)
    w = torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"weights\[1\]: expected \[N, 4\]"):
        multi_linear(x, [w, torch.randn(2, 5)], [None, None])
    with pytest.raises(ValueError, match=r"biases\[0\]"):
        multi_linear(x, [w], [torch.randn(3)])
    with pytest.raises(ValueError, match="one bias"):
        multi_linear(x, [w], [])
    with pytest.raises(ValueError, match=r"weights\[0\]"):
        multi_linear(x, [w.double()], [None])
    with pytest.raises(ValueError, match="x: expected"):
        multi_linear(torch.tensor(1.0), [w], [None])


def test_project_fuses_self_attention_only(seed):
    """Gated attention's q, k, v, gate and an extra projection: one multi_linear for self-attention with
    plain linears, equal to the layers called one by one; separate calls for cross-attention and for a
    layer with a forward hook (which then runs)."""
    att = Attention(12, 12, 12, 4, 3)
    for p in att.parameters():
        torch.nn.init.normal_(p)
    extra = torch.nn.Linear(12, 3, bias=False)
    x = torch.randn(2, 7, 12)
    outs = project(att, x, x, (extra,))
    want = [att.linear_q(x), att.linear_k(x), att.linear_v(x), att.linear_g(x), extra(x)]
    assert type(outs[0].grad_fn).__name__ == "_MultiLinearBackward"
    for o, w in zip(outs, want, strict=True):
        assert_close(o, w)
    y = torch.randn(2, 7, 12)
    assert type(project(att, x, y)[0].grad_fn).__name__ != "_MultiLinearBackward"
    calls = []
    handle = att.linear_k.register_forward_hook(lambda *a: calls.append(1))
    outs = project(att, x, x)
    handle.remove()
    assert calls == [1] and type(outs[0].grad_fn).__name__ != "_MultiLinearBackward"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_linear_chunks_and_pads_like_linear(device, dtype, seed, monkeypatch):
    """rows_linear past LINEAR_CHUNK_ROWS (lowered to 5 rows here): a bias runs 5-row chunks (the
    last one short), fewer than 8 outputs a zero-padded weight sliced back dense; F.linear's values,
    and F.linear itself for a non-contiguous x."""
    monkeypatch.setattr(linear_ops, "LINEAR_CHUNK_ROWS", 5)
    x = torch.randn(3, 7, 13, device=device, dtype=dtype)
    calls = []
    addmm = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: calls.append(a[1].shape[0]) or addmm(*a, **k))
    for n_out, with_bias in [(9, True), (9, False), (3, True), (3, False)]:
        w = torch.randn(n_out, 13, device=device, dtype=dtype) / 13**0.5
        b = torch.randn(n_out, device=device, dtype=dtype) if with_bias else None
        calls.clear()
        out = linear_ops.rows_linear(x, w, b)
        assert out.shape == (3, 7, n_out) and out.is_contiguous() and out.dtype == dtype
        assert_close(out, F.linear(x, w, b), dtype=dtype, msg=f"{n_out} outputs, bias {with_bias}")
        assert calls == ([5, 5, 5, 5, 1] if with_bias else [])
    w, b = torch.randn(9, 13, device=device, dtype=dtype), torch.randn(9, device=device, dtype=dtype)
    calls.clear()
    assert_close(
        linear_ops.rows_linear(x.transpose(0, 1), w, b), F.linear(x.transpose(0, 1), w, b), dtype=dtype
    )
    assert calls == []
