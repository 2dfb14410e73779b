"""hfkit.nn.MultiheadAttention and hfkit.ops.multihead_attention against torch.nn.MultiheadAttention.

Each test builds a torch module and an hfkit module holding the same weights (random biases too, so
that their gradients are not trivially zero) and compares the outputs, the attention weights and the
gradients of the inputs and of every parameter, on odd sizes (embed 33 with 3 heads, sequence lengths
1 and 37), in float32 and bfloat16. All of it is plain torch, so it runs on CPU.
"""

from __future__ import annotations

import copy
import importlib
import os
import pickle

import pytest
import torch
from conftest import assert_close, tolerance
from torch import nn

import hfkit.nn as hnn
from hfkit.bench.cases import multihead_attention as mha_bench
from hfkit.bench.ceilings import Ceilings
from hfkit.bench.runner import run_benchmark
from hfkit.nn import MultiheadAttention, to_hfkit, to_torch
from hfkit.ops import linear as hfkit_linear
from hfkit.ops import multihead_attention, multihead_attention_reference
from hfkit.ops._triton import HAS_TRITON
from hfkit.ops.linear import uses_triton as uses_linear_kernel

pytestmark = pytest.mark.usefixtures("seed")

# The op's module (`hfkit.ops.multihead_attention` the attribute is the function).
mha_op_module = importlib.import_module("hfkit.ops.multihead_attention")

DTYPES = [torch.float32, torch.bfloat16]
EMBED, HEADS = 33, 3


def make_pair(
    embed: int = EMBED, heads: int = HEADS, dtype: torch.dtype = torch.float32, **kwargs
) -> tuple[nn.MultiheadAttention, MultiheadAttention]:
    """A torch module with random weights and biases, and an hfkit module with a copy of its state."""
    torch_mha = nn.MultiheadAttention(embed, heads, dtype=dtype, **kwargs)
    with torch.no_grad():
        for p in torch_mha.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    hfkit_mha = MultiheadAttention(embed, heads, dtype=dtype, **kwargs)
    hfkit_mha.load_state_dict(torch_mha.state_dict())
    return torch_mha, hfkit_mha


def inputs(
    batch: int | None,
    tgt: int,
    src: int,
    dtype: torch.dtype,
    batch_first: bool,
    kdim: int = EMBED,
    vdim=EMBED,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query [L, B, E], key [S, B, kdim], value [S, B, vdim] (batch first with `batch_first`; no batch
    dim when `batch` is None)."""

    def shape(n: int, e: int) -> tuple[int, ...]:
        if batch is None:
            return (n, e)
        return (batch, n, e) if batch_first else (n, batch, e)

    return (
        torch.randn(shape(tgt, EMBED), dtype=dtype),
        torch.randn(shape(src, kdim), dtype=dtype),
        torch.randn(shape(src, vdim), dtype=dtype),
    )


def run(module: nn.Module, query, key, value, self_attention: bool = False, **kwargs):
    """Forward on fresh leaf copies of the inputs, then backward of a fixed random loss over the output
    and the weights; returns (output, weights, {name: gradient}) for inputs and parameters."""
    gen = torch.Generator().manual_seed(1)
    if self_attention:
        q = query.detach().clone().requires_grad_(True)
        leaves = {"query": q}
        k = v = q
    else:
        q, k, v = (t.detach().clone().requires_grad_(True) for t in (query, key, value))
        leaves = {"query": q, "key": k, "value": v}
    module.zero_grad(set_to_none=True)
    out, weights = module(q, k, v, **kwargs)
    loss = (out.float() * torch.randn(out.shape, generator=gen).to(out.device)).sum()
    if weights is not None:
        loss = loss + (weights.float() * torch.randn(weights.shape, generator=gen).to(weights.device)).sum()
    loss.backward()
    grads = {name: t.grad for name, t in leaves.items()}
    grads.update({name: p.grad for name, p in module.named_parameters()})
    return out, weights, grads


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """L2 error of `actual` against `expected`, in float64, relative to the norm of `expected` or of
    an RMS of 1e-2, whichever is larger (a gradient that is zero in exact arithmetic, e.g. the query's
    with one key, is bf16 noise on both sides)."""
    assert torch.isfinite(actual).all(), "non-finite values in the result"
    floor = 1e-2 * expected.numel() ** 0.5
    return ((actual.double() - expected.double()).norm() / max(expected.double().norm().item(), floor)).item()


# Relative L2 error against a float32 computation on the same bfloat16 inputs and weights: bf16
# rounding of each matmul's output dominates; the result must also be no worse than torch's own bf16.
BF16_REL_TOL = 2e-2


def compare(torch_mha, hfkit_mha, query, key, value, dtype, self_attention=False, **kwargs) -> None:
    """The hfkit module agrees with the torch module: output, weights and every gradient. In float32
    to 1e-5; in bfloat16 both are measured against torch in float32 on the same (bf16-valued) inputs
    and weights, and hfkit's error must be within `BF16_REL_TOL`, or else no worse than torch's own
    (1.25× + 2e-3) where bf16 rounding alone exceeds that."""
    ref = run(torch_mha, query, key, value, self_attention, **kwargs)
    out, w, grads = run(hfkit_mha, query, key, value, self_attention, **kwargs)
    assert out.shape == ref[0].shape and out.dtype == ref[0].dtype
    assert (w is None) == (ref[1] is None)
    assert grads.keys() == ref[2].keys()
    for name, g in grads.items():
        assert g is not None and ref[2][name] is not None, name
        assert g.dtype == ref[2][name].dtype and g.shape == ref[2][name].shape, name
    pairs = [("output", out, ref[0]), ("weights", w, ref[1])] + [
        (f"d{n}", g, ref[2][n]) for n, g in grads.items()
    ]
    if dtype == torch.float32:
        rtol, atol = tolerance(dtype)
        for name, actual, expected in pairs:
            if actual is not None:
                # A gradient element sums many products: its float32 rounding scales with the largest
                # values, and the CPU's vector width (AVX2 or AVX-512) picks the summation order.
                scale = max(1.0, expected.abs().max().item())
                torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * scale, msg=name)
        return
    fp32_mha = copy.deepcopy(torch_mha).float()
    fp32_kwargs = {
        k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in kwargs.items()
    }
    truth = run(fp32_mha, query.float(), key.float(), value.float(), self_attention, **fp32_kwargs)
    truths = [truth[0], truth[1]] + [truth[2][n] for n in grads]
    for (name, actual, expected), exact in zip(pairs, truths, strict=True):
        if actual is None:
            continue
        err, torch_err = rel_err(actual, exact), rel_err(expected, exact)
        assert err <= max(BF16_REL_TOL, 1.25 * torch_err + 2e-3), (name, err, torch_err)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("tgt,src", [(37, 37), (1, 37), (37, 1), (5, 8)])
def test_cross_attention_matches_torch(dtype, batch_first, need_weights, tgt, src):
    torch_mha, hfkit_mha = make_pair(dtype=dtype, batch_first=batch_first)
    q, k, v = inputs(2, tgt, src, dtype, batch_first)
    compare(torch_mha, hfkit_mha, q, k, v, dtype, need_weights=need_weights)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("seq", [1, 37])
def test_self_attention_matches_torch(dtype, batch_first, need_weights, seq):
    torch_mha, hfkit_mha = make_pair(dtype=dtype, batch_first=batch_first)
    q, _, _ = inputs(3, seq, seq, dtype, batch_first)
    compare(torch_mha, hfkit_mha, q, q, q, dtype, self_attention=True, need_weights=need_weights)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("need_weights", [False, True])
def test_key_is_value_matches_torch(dtype, need_weights):
    torch_mha, hfkit_mha = make_pair(dtype=dtype, batch_first=True)
    q, k, _ = inputs(2, 7, 11, dtype, True)
    compare(torch_mha, hfkit_mha, q, k, k, dtype, need_weights=need_weights)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("average", [False, True])
def test_unbatched_matches_torch(dtype, need_weights, average):
    torch_mha, hfkit_mha = make_pair(dtype=dtype, batch_first=True)
    q, k, v = inputs(None, 9, 37, dtype, True)
    kpm = torch.zeros(37, dtype=dtype)  # float, as the float attn_mask (torch warns on mixed kinds)
    kpm[-5:] = float("-inf")
    per_head_mask = attn_mask("float", 3, 1, 9, 37, dtype)  # [H, L, S] for one sequence
    compare(
        torch_mha,
        hfkit_mha,
        q,
        k,
        v,
        dtype,
        key_padding_mask=kpm,
        attn_mask=per_head_mask,
        need_weights=need_weights,
        average_attn_weights=average,
    )


def key_padding_mask(kind: str, batch: int, src: int, dtype: torch.dtype) -> torch.Tensor:
    """A [B, S] mask that hides the last few keys of every row but one: bool, or float (0 / -inf plus
    a random bias on the kept keys)."""
    hidden = torch.zeros(batch, src, dtype=torch.bool)
    hidden[1:, src - 3 :] = True
    if kind == "bool":
        return hidden
    return (torch.randn(batch, src) * 0.5).masked_fill(hidden, float("-inf")).to(dtype)


def attn_mask(kind: str, dims: int, batch: int, tgt: int, src: int, dtype: torch.dtype) -> torch.Tensor:
    """A 2-D [L, S] or 3-D [B·H, L, S] mask that leaves each query at least its first key: bool, or
    float (random scores with -inf where masked)."""
    shape = (tgt, src) if dims == 2 else (batch * HEADS, tgt, src)
    hidden = torch.rand(shape) < 0.3
    hidden[..., 0] = False
    if kind == "bool":
        return hidden
    return torch.randn(shape).masked_fill(hidden, float("-inf")).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_key_padding_mask_matches_torch(dtype, need_weights, kind, batch_first):
    torch_mha, hfkit_mha = make_pair(dtype=dtype, batch_first=batch_first)
    q, k, v = inputs(3, 6, 37, dtype, batch_first)
    kpm = key_padding_mask(kind, 3, 37, dtype)
    compare(torch_mha, hfkit_mha, q, k, v, dtype, key_padding_mask=kpm, need_weights=need_weights)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("dims", [2, 3])
@pytest.mark.parametrize("with_padding", [False, True])
def test_attn_mask_matches_torch(dtype, need_weights, kind, dims, with_padding):
    torch_mha, hfkit_mha = make_pair(dtype=dtype, batch_first=True)
    q, k, v = inputs(2, 5, 37, dtype, True)
    kwargs = {"attn_mask": attn_mask(kind, dims, 2, 5, 37, dtype), "need_weights": need_weights}
    if with_padding:
        kwargs["key_padding_mask"] = key_padding_mask(kind, 2, 37, dtype)
    compare(torch_mha, hfkit_mha, q, k, v, dtype, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("need_weights", [False, True])
def test_per_head_weights_match_torch(dtype, need_weights):
    torch_mha, hfkit_mha = make_pair(dtype=dtype)
    q, k, v = inputs(2, 37, 13, dtype, False)
    compare(torch_mha, hfkit_mha, q, k, v, dtype, need_weights=True, average_attn_weights=False)
    _, weights = hfkit_mha(q, k, v, need_weights=True, average_attn_weights=False)
    assert weights.shape == (2, HEADS, 37, 13)
    assert_close(weights.float().sum(-1), torch.ones(2, HEADS, 37), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_kdim_vdim_match_torch(dtype, need_weights, batch_first):
    torch_mha, hfkit_mha = make_pair(dtype=dtype, kdim=20, vdim=7, batch_first=batch_first)
    assert hfkit_mha.in_proj_weight is None and hfkit_mha.k_proj_weight.shape == (EMBED, 20)
    q, k, v = inputs(2, 11, 37, dtype, batch_first, kdim=20, vdim=7)
    kpm = key_padding_mask("bool", 2, 37, dtype)
    compare(torch_mha, hfkit_mha, q, k, v, dtype, need_weights=need_weights, key_padding_mask=kpm)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("add_bias_kv,add_zero_attn", [(True, False), (False, True), (True, True)])
def test_bias_kv_and_zero_attn_match_torch(need_weights, add_bias_kv, add_zero_attn):
    torch_mha, hfkit_mha = make_pair(batch_first=True, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn)
    q, k, v = inputs(2, 5, 37, torch.float32, True)
    kwargs = {
        "key_padding_mask": key_padding_mask("bool", 2, 37, torch.float32),
        "attn_mask": attn_mask("bool", 3, 2, 5, 37, torch.float32),
        "need_weights": need_weights,
    }
    compare(torch_mha, hfkit_mha, q, k, v, torch.float32, **kwargs)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("with_padding", [False, True])
def test_is_causal_matches_torch(need_weights, with_padding):
    torch_mha, hfkit_mha = make_pair(batch_first=True)
    q, _, _ = inputs(2, 37, 37, torch.float32, True)
    kwargs = {
        "attn_mask": nn.Transformer.generate_square_subsequent_mask(37),
        "is_causal": True,
        "need_weights": need_weights,
    }
    if with_padding:
        kwargs["key_padding_mask"] = key_padding_mask("float", 2, 37, torch.float32)
    compare(torch_mha, hfkit_mha, q, q, q, torch.float32, self_attention=True, **kwargs)


def test_dropout_in_eval_is_identity():
    torch_mha, hfkit_mha = make_pair(batch_first=True, dropout=0.4)
    hfkit_mha.eval()
    torch_mha.eval()
    no_dropout = copy.deepcopy(hfkit_mha)
    no_dropout.dropout = 0.0
    q, k, v = inputs(2, 13, 37, torch.float32, True)
    for need_weights in (False, True):
        out, w = hfkit_mha(q, k, v, need_weights=need_weights)
        ref, ref_w = no_dropout(q, k, v, need_weights=need_weights)
        assert torch.equal(out, ref)
        assert (w is None and ref_w is None) or torch.equal(w, ref_w)
        compare(torch_mha, hfkit_mha, q, k, v, torch.float32, need_weights=need_weights)


def test_dropout_zero_in_training_is_exact():
    torch_mha, hfkit_mha = make_pair(batch_first=True, dropout=0.0)
    assert torch_mha.training and hfkit_mha.training
    q, k, v = inputs(2, 13, 37, torch.float32, True)
    out, _ = hfkit_mha(q, k, v, need_weights=False)
    again, _ = hfkit_mha(q, k, v, need_weights=False)
    assert torch.equal(out, again)
    compare(torch_mha, hfkit_mha, q, k, v, torch.float32, need_weights=False)


def test_dropout_in_training_drops_probabilities_as_torch():
    """With need_weights, both draw one dropout mask over [B, H, L, S] probabilities: same seed, same
    mask, so the outputs and the returned (dropped) weights agree; dropped entries are exactly 0."""
    torch_mha, hfkit_mha = make_pair(batch_first=True, dropout=0.5)
    q, k, v = inputs(2, 13, 37, torch.float32, True)
    torch.manual_seed(7)
    ref, ref_w = torch_mha(q, k, v, average_attn_weights=False)
    torch.manual_seed(7)
    out, w = hfkit_mha(q, k, v, average_attn_weights=False)
    assert_close(out, ref)
    assert_close(w, ref_w)
    assert (w == 0).float().mean().item() > 0.3
    hfkit_mha.eval()
    assert not torch.allclose(hfkit_mha(q, k, v)[0], out)


@pytest.mark.parametrize("batch_first", [False, True])
def test_dropout_in_training_through_sdpa_matches_torch(batch_first):
    """Without weights both run SDPA's dropout: same seed, same output; another seed, another output."""
    torch_mha, hfkit_mha = make_pair(batch_first=batch_first, dropout=0.5)
    q, k, v = inputs(2, 13, 37, torch.float32, batch_first)
    torch.manual_seed(7)
    ref, _ = torch_mha(q, k, v, need_weights=False)
    torch.manual_seed(7)
    out, _ = hfkit_mha(q, k, v, need_weights=False)
    assert_close(out, ref)
    torch.manual_seed(8)
    assert not torch.allclose(hfkit_mha(q, k, v, need_weights=False)[0], out)


def test_reference_matches_torch():
    """The reference is the spec: it agrees with torch for packed and separate weights, both masks,
    bias_kv, zero attention and per-head weights."""
    for kdim in (EMBED, 20):
        torch_mha, _ = make_pair(
            batch_first=False, kdim=kdim, vdim=kdim, add_bias_kv=True, add_zero_attn=True
        )
        q, k, _ = inputs(2, 6, 37, torch.float32, False, kdim=kdim)
        masks = {
            "key_padding_mask": key_padding_mask("bool", 2, 37, torch.float32),
            "attn_mask": attn_mask("bool", 2, 2, 6, 37, torch.float32),
        }
        ref_out, ref_w = torch_mha(q, k, k, average_attn_weights=False, **masks)
        for fn in (multihead_attention_reference, multihead_attention):
            out, w = fn(
                q,
                k,
                k,
                HEADS,
                torch_mha.in_proj_weight,
                torch_mha.in_proj_bias,
                torch_mha.out_proj.weight,
                torch_mha.out_proj.bias,
                q_proj_weight=torch_mha.q_proj_weight,
                k_proj_weight=torch_mha.k_proj_weight,
                v_proj_weight=torch_mha.v_proj_weight,
                bias_k=torch_mha.bias_k,
                bias_v=torch_mha.bias_v,
                add_zero_attn=True,
                average_attn_weights=False,
                **masks,
            )
            assert_close(out, ref_out, msg=fn.__name__)
            assert_close(w, ref_w, msg=fn.__name__)


def test_state_dict_round_trip():
    for kwargs in ({}, {"kdim": 20, "vdim": 7}, {"add_bias_kv": True, "bias": False}):
        torch_mha, hfkit_mha = make_pair(**kwargs)
        ref = torch_mha.state_dict()
        state = hfkit_mha.state_dict()
        assert list(state) == list(ref)
        assert all(torch.equal(state[k], ref[k]) for k in ref)
        back = nn.MultiheadAttention(EMBED, HEADS, **kwargs)
        back.load_state_dict(state, strict=True)
        assert all(torch.equal(back.state_dict()[k], ref[k]) for k in ref)


class Block(nn.Module):
    """A model holding MultiheadAttention directly, in a Sequential, inside a TransformerEncoderLayer,
    and once shared under two names."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(EMBED, HEADS, batch_first=True)
        self.stack = nn.Sequential(nn.Linear(EMBED, EMBED), nn.LayerNorm(EMBED))
        self.inner = nn.ModuleList([nn.MultiheadAttention(EMBED, HEADS, batch_first=True, kdim=20, vdim=20)])
        self.encoder = nn.TransformerEncoderLayer(EMBED, HEADS, dim_feedforward=40, batch_first=True)
        self.shared = self.attn

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, x, x, need_weights=False)[0]
        x = self.stack(x)
        x = x + self.inner[0](x, memory, memory)[0]
        return self.encoder(x)


def test_to_hfkit_and_back_is_exact():
    torch.manual_seed(0)
    model = Block().eval()
    x, memory = torch.randn(2, 9, EMBED), torch.randn(2, 37, 20)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = {name: type(m) for name, m in model.named_modules()}
    with torch.no_grad():
        ref = model(x, memory)

    swapped, report = to_hfkit(model, inplace=False, report=True)
    assert report.counts()["MultiheadAttention"] == 3
    assert type(swapped.attn) is MultiheadAttention and swapped.shared is swapped.attn
    assert type(swapped.inner[0]) is MultiheadAttention
    assert type(swapped.encoder.self_attn) is MultiheadAttention
    assert swapped.state_dict().keys() == before.keys()
    assert all(torch.equal(swapped.state_dict()[k], v) for k, v in before.items())
    with torch.no_grad():
        assert_close(swapped(x, memory), ref)
    # Training mode with gradients runs the hfkit forward in every attention (torch's encoder fast path
    # is off), and agrees with the torch model.
    model.train()
    swapped.train()
    for m in (model, swapped):
        for mod in m.modules():
            if isinstance(mod, nn.Dropout):
                mod.p = 0.0
        m.encoder.self_attn.dropout = 0.0
    assert_close(swapped(x, memory), model(x, memory))

    restored = to_torch(pickle.loads(pickle.dumps(swapped)))
    assert {name: type(m) for name, m in restored.named_modules()} == types
    assert restored.shared is restored.attn
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in before.items())
    assert not any(isinstance(m, MultiheadAttention) for m in restored.modules())


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensor_input_runs_torchs_forward():
    torch_mha, hfkit_mha = make_pair(32, 4, batch_first=True)
    torch_mha.eval()
    hfkit_mha.eval()
    x = torch.nested.nested_tensor([torch.randn(5, 32), torch.randn(3, 32)])
    with torch.no_grad():
        ref, _ = torch_mha(x, x, x, need_weights=False)
        out, _ = hfkit_mha(x, x, x, need_weights=False)
    assert out.is_nested
    for actual, expected in zip(out.unbind(), ref.unbind(), strict=True):
        assert torch.equal(actual, expected)


def test_swap_is_registered_by_importing_hfkit_nn():
    assert hnn.MultiheadAttention is MultiheadAttention
    swapped = to_hfkit(nn.MultiheadAttention(8, 2))
    assert type(swapped) is MultiheadAttention
    assert type(to_torch(swapped)) is nn.MultiheadAttention


def call(**overrides):
    """`multihead_attention` on valid batched self-attention inputs, with some arguments replaced."""
    e = 6
    args = {
        "query": torch.randn(4, 2, e),
        "key": torch.randn(5, 2, e),
        "value": torch.randn(5, 2, e),
        "num_heads": 2,
        "in_proj_weight": torch.randn(3 * e, e),
        "in_proj_bias": torch.randn(3 * e),
        "out_proj_weight": torch.randn(e, e),
        "out_proj_bias": torch.randn(e),
    }
    args.update(overrides)
    return multihead_attention(**args)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"query": torch.randn(2, 4, 2, 6)}, "query: expected a 3-d"),
        ({"query": torch.randint(0, 3, (4, 2, 6))}, "query: expected a floating-point"),
        ({"key": torch.randn(5, 2, 6, dtype=torch.float64)}, "key: expected dtype torch.float32"),
        ({"key": torch.randn(5, 3, 6), "value": torch.randn(5, 3, 6)}, "key: expected batch size 2"),
        ({"value": torch.randn(4, 2, 6)}, "value: expected sequence length 5"),
        ({"num_heads": 4}, "num_heads: expected a positive int dividing embed_dim 6"),
        ({"in_proj_weight": torch.randn(18, 5)}, r"in_proj_weight: expected shape \[18, 6\]"),
        ({"in_proj_weight": torch.randn(18, 6, dtype=torch.float64)}, "in_proj_weight: expected dtype"),
        ({"in_proj_bias": torch.randn(6)}, r"in_proj_bias: expected shape \[18\]"),
        ({"out_proj_weight": torch.randn(6, 5)}, r"out_proj_weight: expected shape \[6, 6\]"),
        ({"in_proj_weight": None}, "in_proj_weight: is None"),
        ({"q_proj_weight": torch.randn(6, 6)}, "in_proj_weight: expected None"),
        (
            {"key_padding_mask": torch.zeros(2, 4, dtype=torch.bool)},
            r"key_padding_mask: expected shape \[2, 5\]",
        ),
        ({"key_padding_mask": torch.zeros(2, 5, dtype=torch.int64)}, "key_padding_mask: expected a bool"),
        ({"attn_mask": torch.zeros(4, 4)}, r"attn_mask: expected shape \[4, 5\] or \[4, 4, 5\]"),
        ({"attn_mask": torch.zeros(1, 4, 5)}, "attn_mask: expected shape"),
        ({"is_causal": True}, "attn_mask: is_causal=True"),
        ({"bias_k": torch.randn(1, 1, 6)}, "bias_k: expected bias_k and bias_v both"),
        ({"dropout_p": 1.5}, r"dropout_p: expected a number in \[0, 1\]"),
        ({"key": torch.randn(5, 2, 7), "value": torch.randn(5, 2, 7)}, "key: expected embedding size 6"),
    ],
)
def test_bad_inputs_raise_value_error(overrides, match):
    with pytest.raises(ValueError, match=match):
        call(**overrides)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mismatch_raises_value_error_cuda():
    with pytest.raises(ValueError, match="in_proj_weight: on cpu, but query is on cuda"):
        call(query=torch.randn(4, 2, 6, device="cuda"), key=torch.randn(5, 2, 6, device="cuda"),
             value=torch.randn(5, 2, 6, device="cuda"))  # fmt: skip


def test_device_mismatch_raises_value_error_meta():
    with pytest.raises(ValueError, match="key: on meta"):
        call(key=torch.randn(5, 2, 6, device="meta"))


def test_benchmark_rows_on_cpu():
    ceilings = Ceilings(copy_gbps=10.0, matmul_tflops=0.1, device_name="CPU (test)", matmul_dtype="fp32")
    result = run_benchmark(
        mha_bench.BENCHMARK, mha_bench.multihead_attention_cases("smoke"), "cpu", dtypes=("fp32",),
        providers=("hfkit", "eager"), progress=False, ceilings=ceilings, warmup=0, reps=1,
    )  # fmt: skip
    assert [(r.shape, r.provider, r.mode) for r in result.rows] == [
        (list(s), p, m)
        for s in mha_bench.SMOKE_SHAPES
        for p in ("hfkit", "eager")
        for m in ("fwd", "fwd+bwd")
    ]
    for row in result.rows:
        assert row.method != "error", row.extra
        assert row.extra["check_ok"] and row.extra["max_abs_err_vs_fp32_ref"] < 1e-5
        # The hfkit rows ran hfkit's module (the LSTM swap is opt-in: the case names it), eager torch's.
        assert row.extra["runs"] == (
            "hfkit.nn.multihead_attention.MultiheadAttention"
            if row.provider == "hfkit"
            else "torch.nn.modules.activation.MultiheadAttention"
        )
        assert row.flops == mha_bench.mha_flops(row.shape, row.mode == "fwd+bwd")
    with pytest.raises(ValueError, match="shapes"):
        mha_bench.multihead_attention_cases(shapes=[(2, 5, 12, 5)])


# --- the projections through hfkit.ops.linear ---------------------------------------------------------


def float64_error(hfkit_mha: MultiheadAttention, torch_mha: nn.MultiheadAttention, q, k, v, **kwargs) -> dict:
    """{name: max abs error / max abs of the float64 result} of the hfkit module's output and every
    gradient, against the torch module run in float64 on the same values."""
    exact_mha = copy.deepcopy(torch_mha).double()
    out, _, grads = run(hfkit_mha, q, k, v, **kwargs)
    exact, _, exact_grads = run(exact_mha, q.double(), k.double(), v.double(), **kwargs)
    pairs = [("output", out, exact)] + [(f"d{n}", grads[n], exact_grads[n]) for n in grads]
    return {n: ((a.double() - e).abs().max() / e.abs().max()).item() for n, a, e in pairs}


@pytest.mark.skipif(
    not (HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"),
    reason="linear's kernel on CPU needs TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("self_attention", [True, False])
def test_projections_through_linears_kernel_match_float64(self_attention, monkeypatch):
    # On CPU the op's projections are F.linear (torch's own sums, compared elementwise above); here they
    # take hfkit.ops.linear, whose kernel runs under the interpreter, and every result is checked against
    # float64 (the kernel sums in its own order, as torch's float32 does in another).
    calls = []

    def counting_linear(x, weight, bias):
        calls.append(uses_linear_kernel(x, weight, bias))
        return hfkit_linear(x, weight, bias)

    monkeypatch.setattr(mha_op_module, "_linear", counting_linear)
    torch_mha, hfkit_mha = make_pair(batch_first=True)
    q, k, v = inputs(2, 37, 37 if self_attention else 5, torch.float32, True)
    if self_attention:
        k = v = q
    errors = float64_error(hfkit_mha, torch_mha, q, k, v, self_attention=self_attention, need_weights=False)
    assert calls == [True] * (2 if self_attention else 4)
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", [(4, 64, 128, 8), (3, 37, 99, 3)], ids=str)
def test_float32_projections_on_cuda_run_linears_kernel(shape):
    # On CUDA in float32 at precision "highest" the projections are linear's tf32x3 GEMMs (seen as
    # hfkit::linear_fwd while the profiler records), accurate to float32 rounding against float64.
    b, seq, e, h = shape
    torch_mha, hfkit_mha = make_pair(e, h, batch_first=True)
    torch_mha, hfkit_mha = torch_mha.cuda(), hfkit_mha.cuda()
    q = torch.randn(b, seq, e, device="cuda")
    with torch.profiler.profile() as prof:
        hfkit_mha(q, q, q, need_weights=False)[0].sum().backward()
    names = {event.name for event in prof.events()}
    assert "hfkit::linear_fwd" in names and "hfkit::linear_mm" in names
    errors = float64_error(hfkit_mha, torch_mha, q, q, q, self_attention=True, need_weights=False)
    assert max(errors.values()) <= 1e-5, errors
