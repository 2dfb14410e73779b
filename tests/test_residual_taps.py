"""Residual taps (`hfkit.model.primitives.residual_taps`) and the gradients an Evoformer block's
representations receive.

A residual connection `x + block(x)` reads x twice, so autograd adds two gradients of x; gated
attention reads its normalized input four or five times. After `to_hfkit` the fused LayerNorm passes
x through (its backward kernel adds the residual's gradient) and the projections are one
`multi_linear`: the swapped block's autograd graph holds only the adds no fused op removes, and its
outputs and gradients equal the plain block's. The kernels run under the interpreter on CPU.
The fused triangle multiplication passes z through the same way (its LayerNorm-in is inside the op).
"""

from __future__ import annotations

import collections
import os

import pytest
import torch
from torch import nn

import hfkit.nn as hnn
from hfkit.model import EvoformerBlock
from hfkit.model.primitives import ResidualTaps, active_residual_taps, residual_taps

pytestmark = pytest.mark.usefixtures("one_thread")

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


def test_taps_pass_through_what_a_layer_norm_recorded():
    x, y = torch.randn(3), torch.randn(3)
    assert active_residual_taps() is None
    with residual_taps(x, y) as tap:
        assert active_residual_taps() is tap
        assert tap.wants(x) and tap.wants(y) and not tap.wants(x.clone())
        alias = x.view_as(x)
        tap.record(x, alias)
        assert not tap.wants(x)
        with pytest.raises(ValueError, match="not a tapped tensor"):
            tap.record(x, alias)
        with residual_taps(y) as inner:  # an inner context hides the outer one
            assert active_residual_taps() is inner
        assert active_residual_taps() is tap
    assert active_residual_taps() is None
    assert tap(x) is alias and tap(y) is y and tap(alias) is alias
    assert isinstance(tap, ResidualTaps)


def test_plain_layer_norm_records_nothing():
    x = torch.randn(2, 5, requires_grad=True)
    with residual_taps(x) as tap:
        nn.LayerNorm(5)(x)
    assert tap(x) is x


def _block() -> EvoformerBlock:
    block = EvoformerBlock(
        c_m=16, c_z=8, c_hidden_msa_att=4, c_hidden_opm=3, c_hidden_mul=5, c_hidden_pair_att=4,
        no_heads_msa=2, no_heads_pair=2, transition_n=2, msa_dropout=0.0, pair_dropout=0.0,
    )  # fmt: skip
    with torch.no_grad():
        for p in block.parameters():  # OpenFold's zero "final" inits would hide every update
            p.normal_(0.0, 0.3)
    return block


def _inputs():
    m = torch.randn(1, 5, 11, 16, requires_grad=True)
    z = torch.randn(1, 11, 11, 8, requires_grad=True)
    msa_mask = (torch.rand(1, 5, 11) > 0.2).float()
    pair_mask = (torch.rand(1, 11, 11) > 0.2).float()
    return m, z, msa_mask, pair_mask


def _gradient_adds(outputs: tuple[torch.Tensor, ...]) -> collections.Counter:
    """The adds autograd makes where a node's input slot receives more than one gradient (one per
    extra gradient), by the names of the nodes sending them; parameters' accumulators excluded."""
    incoming = collections.defaultdict(list)
    seen, stack = set(), [o.grad_fn for o in outputs]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, slot in node.next_functions:
            if nxt is not None:
                incoming[(nxt, slot)].append(node.name())
                stack.append(nxt)
    adds: collections.Counter = collections.Counter()
    for (node, _), names in incoming.items():
        if len(names) > 1 and "AccumulateGrad" not in node.name():
            adds[tuple(sorted(names))] += len(names) - 1
    return adds


@pytest.mark.skipif(not INTERPRETER, reason="the fused ops run Triton under TRITON_INTERPRET=1 only")
def test_swapped_block_makes_no_gradient_adds(seed):
    plain = _block()
    swapped = hnn.to_hfkit(plain, inplace=False)
    m, z, msa_mask, pair_mask = _inputs()
    assert sum(_gradient_adds(plain(m, z, msa_mask, pair_mask)).values()) > 20
    assert _gradient_adds(swapped(m, z, msa_mask, pair_mask)) == {}


@pytest.mark.skipif(not INTERPRETER, reason="the fused ops run Triton under TRITON_INTERPRET=1 only")
def test_swapped_block_matches_the_plain_block(seed):
    plain = _block()
    swapped = hnn.to_hfkit(plain, inplace=False)
    m, z, msa_mask, pair_mask = _inputs()
    got = swapped(m, z, msa_mask, pair_mask)
    want = plain(m, z, msa_mask, pair_mask)
    dm, dz = torch.randn_like(m), torch.randn_like(z)
    # A copy's parameters, in the same order (`to_hfkit(inplace=False)` swaps a deep copy).
    g_got = torch.autograd.grad(got, [m, z, *swapped.parameters()], [dm, dz])
    g_want = torch.autograd.grad(want, [m, z, *plain.parameters()], [dm, dz])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# The swapped block's LayerNorms whose output only one fused matmul reads (`matmul_dtype`).
MATMUL_FED_NORMS = {
    "msa_att_col._msa_att.layer_norm_m",
    "core.msa_transition.layer_norm",
    "core.outer_product_mean.layer_norm",
    "core.tri_att_start.layer_norm",
    "core.tri_att_end.layer_norm",
    "core.pair_transition.layer_norm",
}


@pytest.mark.skipif(not INTERPRETER, reason="the fused ops run Triton under TRITON_INTERPRET=1 only")
def test_autocast_layer_norms_write_the_matmul_dtype(seed, monkeypatch):
    """Under autocast, the swapped block's LayerNorms that feed one fused matmul write bfloat16, the
    others keep float32; outputs and gradients are as close to the float32 block's as those of the
    block whose LayerNorms all write float32 (which the matmuls then cast to the same values, up to
    the interpreter's bfloat16 rounding, which may truncate)."""
    swapped = hnn.to_hfkit(_block(), inplace=False)
    m, z, msa_mask, pair_mask = _inputs()
    dm, dz = torch.randn_like(m), torch.randn_like(z)
    written: dict[str, torch.dtype] = {}
    for name, module in swapped.named_modules():
        if isinstance(module, hnn.LayerNorm):
            module.register_forward_hook(lambda _m, _a, out, name=name: written.__setitem__(name, out.dtype))

    def run(autocast: bool = True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = swapped(m, z, msa_mask, pair_mask)
        return (*out, *torch.autograd.grad(out, [m, z, *swapped.parameters()], [dm, dz]))

    got = run()
    assert {name for name, dtype in written.items() if dtype == torch.bfloat16} == MATMUL_FED_NORMS
    assert all(written[name] == torch.float32 for name in written.keys() - MATMUL_FED_NORMS)
    exact = run(autocast=False)
    forward = hnn.LayerNorm.forward
    monkeypatch.setattr(hnn.LayerNorm, "forward", lambda self, x, out_dtype=None: forward(self, x))
    want = run()
    assert set(written.values()) == {torch.float32}

    # Relative errors, skipping gradients that are zero in exact arithmetic (row attention's pair-bias
    # LayerNorm bias shifts every logit of a row alike: only rounding noise reaches it).
    kept = [i for i, e in enumerate(exact) if e.norm() > 1e-4]
    assert len(kept) > len(exact) - 3

    def errors(values):
        return torch.tensor([((values[i].float() - exact[i]).norm() / exact[i].norm()).item() for i in kept])

    assert all(a.dtype == b.dtype for a, b in zip(got, want, strict=True))
    err_got, err_want = errors(got), errors(want)
    assert err_want.max() < 0.1  # bfloat16 matmuls on a tiny block
    assert err_got.mean() < 1.25 * err_want.mean() and err_got.max() < 1.5 * err_want.max()
