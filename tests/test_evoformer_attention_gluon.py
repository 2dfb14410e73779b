"""The Gluon forward of `hfkit.ops.evoformer_attention` (sm_90 GPUs only: Gluon kernels
have no interpreter) against the Triton kernel it stands in for and the float32 reference: outputs, row
statistics and gradients, both projection layouts, the fallback to the Triton kernel when row sums leave
the trusted range, and the calls it leaves to the Triton kernel."""

from __future__ import annotations

import importlib

import pytest
import torch

from hfkit.ops import _evoformer_attention_gluon as gluon_fwd
from hfkit.ops import evoformer_attention, evoformer_attention_reference

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not (SM90 and gluon_fwd.HAS_GLUON), reason="the Gluon forward runs on sm_90 GPUs (H100, H200) only"
    ),
]
H, D = 4, 32


def _evo():
    return importlib.import_module("hfkit.ops.evoformer_attention")


def _qkv(s, n_q, n_k, transposed, scale=1.0, sliced=False):
    """q [1, S, H, Q, D] and k, v [1, S, H, K, D] in bfloat16 as views of projections [S, N, H, D] or, as
    the ending node's attention gets them, of [N, S, H, D]; with `sliced` (Q = K), as column slices of
    one wider projection [S, N, 3 H D + 8] (or its transpose), as `stacked_linear` makes them."""

    def proj(n):
        if transposed:
            return torch.randn(1, n, s, H, D, device="cuda").permute(0, 2, 3, 1, 4)
        return torch.randn(1, s, n, H, D, device="cuda").permute(0, 1, 3, 2, 4)

    if sliced:
        assert n_q == n_k
        wide = torch.randn(1, n_q, s, 3 * H * D + 8, device="cuda") if transposed else None
        wide = wide if transposed else torch.randn(1, s, n_q, 3 * H * D + 8, device="cuda")
        wide[..., : H * D] *= scale
        wide = wide.to(torch.bfloat16)
        heads = [wide[..., i * H * D : (i + 1) * H * D].unflatten(-1, (H, D)) for i in range(3)]
        order = (0, 2, 3, 1, 4) if transposed else (0, 1, 3, 2, 4)
        return tuple(t.permute(*order) for t in heads)
    q = (proj(n_q) * scale).to(torch.bfloat16)
    return q, proj(n_k).to(torch.bfloat16), proj(n_k).to(torch.bfloat16)


def _spy(monkeypatch):
    """Record `forward`'s calls (and results), with the op taking the Gluon forward from 1024 keys."""
    monkeypatch.setattr(_evo(), "GLUON_MIN_KEYS", 1024)
    calls = []
    forward = gluon_fwd.forward

    def spy(*args):
        calls.append(forward(*args))
        return calls[-1]

    monkeypatch.setattr(gluon_fwd, "forward", spy)
    return calls


@pytest.mark.parametrize("transposed", [False, True], ids=["projection", "transposed"])
@pytest.mark.parametrize(
    ("s", "n_q", "n_k", "sliced"),
    [(3, 1024, 1024, False), (2, 256, 1088, False), (3, 1024, 1024, True)],
    ids=str,
)
def test_matches_the_triton_kernel(s, n_q, n_k, sliced, transposed, seed, monkeypatch):
    evo = _evo()
    q, k, v = _qkv(s, n_q, n_k, transposed, sliced=sliced)
    bias = torch.randn(1, 1, H, n_q, n_k, device="cuda", dtype=torch.bfloat16)
    assert gluon_fwd.applies(q, k, v, bias, None)
    calls = _spy(monkeypatch)
    o, mx, lg = evo._evo_fwd(q, k, v, bias, None)
    assert calls == [True]
    monkeypatch.setattr(evo, "GLUON_FWD", False)
    o_triton, mx_triton, lg_triton = evo._evo_fwd(q, k, v, bias, None)
    assert len(calls) == 1
    assert o.stride() == o_triton.stride()
    torch.testing.assert_close(mx, mx_triton, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(lg, lg_triton, rtol=0, atol=1e-3)
    torch.testing.assert_close(o.float(), o_triton.float(), rtol=0, atol=2e-2)
    expected = evoformer_attention_reference(q, k, v, bias).float()
    assert ((o.float() - expected).norm() / expected.norm()).item() < 1e-2


def test_gradients_through_the_op(seed, monkeypatch):
    """The backward reads the Gluon forward's row statistics as it reads the Triton kernel's."""
    evo = _evo()
    q, k, v = _qkv(2, 1024, 1024, transposed=False)
    bias = torch.randn(1, 1, H, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    calls = _spy(monkeypatch)

    def grads():
        params = [t.detach().clone().requires_grad_(True) for t in (q, k, v, bias)]
        o = evoformer_attention(*params)
        o.backward(torch.ones_like(o))
        return [o, *(p.grad for p in params)]

    fused = grads()
    assert calls == [True]
    monkeypatch.setattr(evo, "GLUON_FWD", False)
    for name, a, b in zip(["o", "dq", "dk", "dv", "dbias"], fused, grads(), strict=True):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err < 1e-2, name


def test_rows_out_of_range_are_redone_by_the_triton_kernel(seed, monkeypatch):
    """q scaled by 40: the reference (|q| max|k|) sits far above the logits, sums fall below 2**-60, and
    the call is redone by the Triton kernel (which walks those rows again with the running max): the
    result is the Triton kernel's, bit for bit."""
    evo = _evo()
    q, k, v = _qkv(2, 1024, 1024, transposed=False, scale=40.0)
    bias = torch.randn(1, 1, H, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    calls = _spy(monkeypatch)
    o, mx, lg = evo._evo_fwd(q, k, v, bias, None)
    assert calls == [True]
    monkeypatch.setattr(evo, "GLUON_FWD", False)
    for actual, expected in zip((o, mx, lg), evo._evo_fwd(q, k, v, bias, None), strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_calls_it_leaves_to_the_triton_kernel(seed, monkeypatch):
    q, k, v = _qkv(1, 1024, 1024, transposed=False)
    bias = torch.randn(1, 1, H, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    assert gluon_fwd.applies(q, k, v, bias, None)
    key_bias = torch.zeros(1, 1, 1024, device="cuda")
    assert not gluon_fwd.applies(q, k, v, bias, key_bias)
    assert not gluon_fwd.applies(q, k, v, None, None)
    assert not gluon_fwd.applies(q.float(), k.float(), v.float(), bias.float(), None)
    assert not gluon_fwd.applies(q, k, v, bias[:, :, :1], None)  # broadcast over heads
    assert not gluon_fwd.applies(q.contiguous(), k, v, bias, None)  # rows not a projection's
    q2, k2, v2 = _qkv(1, 1000, 1000, transposed=False)
    assert not gluon_fwd.applies(q2, k2, v2, bias[..., :1000, :1000].contiguous(), None)
    qd = torch.randn(1, 1, 1024, H, 64, device="cuda", dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
    assert not gluon_fwd.applies(qd, qd, qd, bias, None)  # head dim 64
    # Ragged sizes still give the reference's result (through the Triton kernel), as do calls with
    # fewer keys than GLUON_MIN_KEYS, where the Gluon forward is not tried.
    evo = _evo()
    tried = []
    monkeypatch.setattr(gluon_fwd, "forward", lambda *args: tried.append(args) or False)
    monkeypatch.setattr(evo, "GLUON_MIN_KEYS", 1025)
    evo._evo_fwd(q, k, v, bias, None)
    assert not tried
    monkeypatch.setattr(evo, "GLUON_MIN_KEYS", 1024)
    evo._evo_fwd(q, k, v, bias, None)  # tried, declined (False): the Triton kernel runs
    assert len(tried) == 1
    out = evoformer_attention(q2, k2, v2, bias[..., :1000, :1000])
    expected = evoformer_attention_reference(q2, k2, v2, bias[..., :1000, :1000]).float()
    assert ((out.float() - expected).norm() / expected.norm()).item() < 1e-2
