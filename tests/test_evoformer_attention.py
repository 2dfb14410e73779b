"""hfkit.ops.evoformer_attention and hfkit.nn.{Attention, EvoformerAttention} against their references.

Op: forward and the gradients of q, k, v and the pair bias (summed over the MSA rows it is broadcast
over) on odd sizes, head dims 16-128, masked keys and fully masked rows, float32 / bfloat16 / float16,
against `evoformer_attention_reference` evaluated in float32. Modules: `EvoformerAttention` gives
`Attention`'s output and gradients, and `to_hfkit` / `to_torch` swap them. On CPU the kernels run
under TRITON_INTERPRET=1 (conftest.py); a GPU machine also runs them on CUDA.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from torch import nn

from hfkit.nn import Attention, EvoformerAttention, to_hfkit, to_torch
from hfkit.ops import evoformer_attention, evoformer_attention_reference
from hfkit.ops.evoformer_attention import uses_triton

DEVICES = (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []) + (
    ["cuda"] if torch.cuda.is_available() else []
)
# Relative L2 error against the float32 reference: bf16/fp16 round p and ds before the matmuls.
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(actual).all(), "non-finite values in the result"
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def run_both(q, k, v, bias=None, mask=None):
    """Fused op and float32 reference on the same inputs; returns (name, actual, expected) triples."""
    assert uses_triton(q)
    names = [n for n, t in zip("qkv", (q, k, v), strict=True)] + (["bias"] if bias is not None else [])
    params = [t.requires_grad_(True) for t in (q, k, v, bias) if t is not None]
    o = evoformer_attention(q, k, v, bias, mask)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, params, do)
    ref = [t.detach().float().requires_grad_(True) for t in params]
    o_ref = evoformer_attention_reference(*ref[:3], ref[3] if bias is not None else None, mask)
    ref_grads = torch.autograd.grad(o_ref, ref, do.float())
    assert o.dtype == q.dtype and o.shape == q.shape
    for g, p in zip(grads, params, strict=True):
        assert g.dtype == p.dtype and g.shape == p.shape
    return [("o", o, o_ref)] + list(zip([f"d{n}" for n in names], grads, ref_grads, strict=True))


def qkv(b, s, h, n_q, n_k, d, dtype, device):
    q = torch.randn(b, s, h, n_q, d, device=device, dtype=dtype)
    k = torch.randn(b, s, h, n_k, d, device=device, dtype=dtype)
    v = torch.randn(b, s, h, n_k, d, device=device, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "b, s, h, n, d, dtype",
    [
        (1, 2, 2, 37, 16, torch.float32),
        (2, 3, 1, 33, 32, torch.bfloat16),  # one key past a 32-wide block
        (1, 2, 2, 37, 64, torch.float32),
        (1, 2, 1, 17, 128, torch.float32),
        (1, 2, 1, 37, 64, torch.bfloat16),
        (1, 2, 1, 20, 32, torch.float16),
        (1, 2, 2, 64, 32, torch.bfloat16),  # whole tiles: the unmasked (EVEN) loads and stores
        (1, 3, 2, 64, 8, torch.bfloat16),  # whole tiles of a head dim padded to 16 (EVEN_MN only)
    ],
    ids=str,
)
def test_msa_row_attention_with_pair_bias(b, s, h, n, d, dtype, device, seed):
    q, k, v = qkv(b, s, h, n, n, d, dtype, device)
    bias = torch.randn(b, 1, h, n, n, device=device, dtype=dtype)  # summed over S in the gradient
    mask = torch.rand(b, s, n, device=device) > 0.25
    mask[0, s - 1] = False  # a fully masked MSA row: uniform weights, not NaN
    for name, actual, expected in run_both(q, k, v, bias, mask):
        assert rel_err(actual, expected) < TOL[dtype], name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "bias_shape, mask_kind",
    [
        ((2, 3, 2, 19, 37), "5d"),  # a bias per MSA row: no reduction
        ((1, 1, 2, 19, 37), "3d"),  # broadcast over B and S: summed over both
        ((2, 1, 1, 1, 37), None),  # a key bias broadcast over S, H, Q
        (None, "bool5d"),
    ],
    ids=str,
)
def test_bias_broadcasts_masks_and_unequal_lengths(bias_shape, mask_kind, device, seed):
    q, k, v = qkv(2, 3, 2, 19, 37, 16, torch.float32, device)
    bias = torch.randn(bias_shape, device=device) if bias_shape else None
    mask = None
    if mask_kind == "3d":
        mask = (torch.rand(2, 3, 37, device=device) > 0.3).float()
    elif mask_kind == "5d":
        mask = (torch.rand(2, 3, 1, 1, 37, device=device) > 0.3).float()
    elif mask_kind == "bool5d":
        mask = torch.rand(1, 3, 1, 1, 37, device=device) > 0.3
    for name, actual, expected in run_both(q, k, v, bias, mask):
        assert rel_err(actual, expected) < TOL[torch.float32], name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias_shape", [(2, 3, 2, 19, 37), (1, 1, 2, 19, 37)], ids=str)
def test_calls_past_the_grid_limit_run_in_row_blocks(bias_shape, device, seed, monkeypatch):
    """More (batch, row, head) programs than CUDA's grid y limit (MSA column attention at N > 8191)
    run in row blocks: with the limit lowered to 4, B=2, S=3, H=2 runs as four launches per pass,
    sliced along B and S (a bias per row sliced too, a broadcast one not), same results."""
    evo = importlib.import_module("hfkit.ops.evoformer_attention")  # the module, not the op it exports
    monkeypatch.setattr(evo, "MAX_GRID_Y", 4)
    q, k, v = qkv(2, 3, 2, 19, 37, 16, torch.float32, device)
    bias = torch.randn(bias_shape, device=device)
    mask = (torch.rand(2, 3, 37, device=device) > 0.3).float()
    assert len(evo._split_rows(q, k, v, bias, mask[:, :, None, None])) == 4
    for name, actual, expected in run_both(q, k, v, bias, mask):
        assert rel_err(actual, expected) < TOL[torch.float32], name
    monkeypatch.setattr(evo, "MAX_GRID_Y", 1)
    with pytest.raises(ValueError, match="heads"):
        evoformer_attention(q, k, v, bias, mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group_rows", [1, 2, 4], ids=str)
def test_rows_grouped_under_a_shared_bias(group_rows, device, seed, monkeypatch):
    """With a pair bias shared along S, the forward runs rows side by side in groups (its program
    order); B*S = 2*5 = 10 rows in groups of 2 and 4 (a ragged last group of 2), same results."""
    evo = importlib.import_module("hfkit.ops.evoformer_attention")
    monkeypatch.setattr(evo, "GROUP_ROWS", group_rows)
    q, k, v = qkv(2, 5, 3, 19, 37, 16, torch.float32, device)
    bias = torch.randn(2, 1, 3, 19, 37, device=device)
    assert evo._group_rows(10, bias) == group_rows
    assert evo._group_rows(10, torch.randn(2, 5, 3, 19, 37)) == 1  # a bias per row: row after row
    mask = (torch.rand(2, 5, 37, device=device) > 0.3).float()
    for name, actual, expected in run_both(q, k, v, bias, mask):
        assert rel_err(actual, expected) < TOL[torch.float32], name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "bias_shape", [(1, 1, 2, 19, 37), (2, 3, 2, 19, 37), (2, 1, 1, 1, 37), None], ids=str
)
@pytest.mark.parametrize("norm", [1.0, 40.0], ids=["plain", "loose-reference"])
@pytest.mark.parametrize("masked", [True, False], ids=["key-bias", "no-key-bias"])
def test_bounded_forward(masked, bias_shape, norm, dtype, device, seed, monkeypatch):
    """The forward against a fixed reference per row (bounded, from BOUNDED_MIN_KEYS keys; lowered to
    1 here): outputs and gradients equal the reference's with ragged sizes, bias broadcasts and masked
    keys (plain: a fully masked row too). With q scaled by 40 the reference (|q| max|k|, Cauchy-Schwarz)
    sits far above some rows' logits, their sums fall below 2**-60, and those programs redo their rows
    with the running max: their row statistics are then the running-max kernel's, bit for bit. Without
    a key bias the loop subtracts the reference in the scaling's fused multiply-add (SHIFTED)."""
    evo = importlib.import_module("hfkit.ops.evoformer_attention")
    q, k, v = qkv(2, 3, 2, 19, 37, 16, dtype, device)
    q = q * norm
    bias = torch.randn(bias_shape, device=device, dtype=dtype) if bias_shape else None
    mask = (torch.rand(2, 3, 37, device=device) > 0.3).float()
    if norm == 1.0:
        mask[1, 2] = 0  # an all-masked row: uniform weights, as the reference gives them
    mask = mask if masked else None
    monkeypatch.setattr(evo, "BOUNDED_MIN_KEYS", 1)
    if norm == 1.0:
        for name, actual, expected in run_both(q, k, v, bias, mask):
            assert rel_err(actual, expected) < TOL[dtype], name
    key_bias = (mask - 1.0) * 1e9 if masked else None
    o_bounded, mx_bounded, _ = evo._evo_fwd(q, k, v, bias, key_bias)
    monkeypatch.setattr(evo, "BOUNDED_MIN_KEYS", 1 << 30)
    o_running, mx_running, _ = evo._evo_fwd(q, k, v, bias, key_bias)
    same = mx_bounded == mx_running
    if norm == 1.0:
        assert (~same).any()  # rows that kept their fixed reference
    else:
        assert same.any()  # rows redone with the running max: its results, bit for bit
        torch.testing.assert_close(
            o_bounded[same[..., None].expand_as(o_bounded)],
            o_running[same[..., None].expand_as(o_running)],
            rtol=0,
            atol=0,
        )


@pytest.mark.parametrize("device", DEVICES)
def test_zero_key_bias_dropped_where_bounded(device, seed, monkeypatch):
    """A mask keeping every key (a key bias of zeros) reaches the kernels as no key bias from
    BOUNDED_MIN_KEYS keys, with the same output; a mask dropping one key, or fewer keys, keeps it."""
    evo = importlib.import_module("hfkit.ops.evoformer_attention")
    seen = []
    fwd = evo._evo_fwd

    def spy(q, k, v, bias, key_bias):
        seen.append(key_bias)
        return fwd(q, k, v, bias, key_bias)

    monkeypatch.setattr(evo, "_evo_fwd", spy)
    q, k, v = qkv(1, 3, 2, 17, 33, 16, torch.float32, device)
    bias = torch.randn(1, 1, 2, 17, 33, device=device)
    ones = torch.ones(1, 3, 33, device=device)
    dropped = ones.clone()
    dropped[0, 1, 5] = 0
    monkeypatch.setattr(evo, "BOUNDED_MIN_KEYS", 33)
    for mask, kept in ((ones, False), (dropped, True), (None, False)):
        out = evoformer_attention(q, k, v, bias, mask)
        assert (seen.pop() is not None) == kept
        expected = evoformer_attention_reference(q, k, v, bias, mask)
        assert rel_err(out, expected) < TOL[torch.float32]
    monkeypatch.setattr(evo, "BOUNDED_MIN_KEYS", 34)
    evoformer_attention(q, k, v, bias, ones)
    assert seen.pop() is not None


def _backward_inputs(bias_shape, dtype, device):
    """q, k, v [2, 5, 2, 19|37, 16], a bias, a key bias (a fully masked row), the forward's o and row
    statistics, an incoming gradient, and the float32 reference's gradients of q, k, v and the bias."""
    evo = importlib.import_module("hfkit.ops.evoformer_attention")
    q, k, v = qkv(2, 5, 2, 19, 37, 16, dtype, device)
    bias = torch.randn(bias_shape, device=device, dtype=dtype)
    keep = torch.rand(2, 5, 37, device=device) > 0.3
    keep[1, 4] = False
    key_bias = (keep.float() - 1.0) * 1e9
    o, mx, lg = evo._evo_fwd(q, k, v, bias, key_bias)
    do = torch.randn_like(o)
    ref = [t.float().requires_grad_(True) for t in (q, k, v, bias)]
    o_ref = evoformer_attention_reference(*ref, key_bias=key_bias)
    expected = torch.autograd.grad(o_ref, ref, do.float())
    return evo, (do, q, k, v, bias, key_bias, o, mx, lg), expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("splits", [1, 2, 3, 5], ids=str)
@pytest.mark.parametrize("rows", [1, 2], ids=str)
def test_bias_gradient_summed_in_the_dkdv_pass(rows, splits, dtype, device, seed):
    """The fused dk/dv + dbias pass: a pair bias [B, 1, H, Q, K] gets dlogits summed over the S = 5
    rows it is broadcast over, in 1, 2, 3 (ragged: 2 + 2 + 1 rows) or 5 splits of the rows, walked
    one or two at a time (an odd count leaves a lone last row); odd Q and K, masked keys and a fully
    masked row. dq, dk, dv, dbias against the reference, and the same as the three-pass backward's up
    to float32 summation order."""
    evo, args, expected = _backward_inputs((2, 1, 2, 19, 37), dtype, device)
    cfg = evo._config("dkdv_dbias", 16, args[1].device)._replace(rows=rows)
    fused = evo.backward_passes(*args, True, fuse_dbias=True, configs={"dkdv_dbias": cfg}, splits=splits)
    passes = evo.backward_passes(*args, True, fuse_dbias=False, splits=splits)
    assert fused[3].shape == (2, 1, 2, 19, 37) and fused[3].dtype == torch.float32
    for name, got, old, want in zip(("dq", "dk", "dv", "dbias"), fused, passes, expected, strict=True):
        assert rel_err(got, want) < TOL[dtype], name
        # Same math in float32; bf16 dq, dk, dv may round differently where the tiles differ (CUDA).
        assert rel_err(got, old) < (1e-6 if dtype == torch.float32 or name == "dbias" else 4e-3), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias_shape", [(1, 1, 2, 19, 37), (2, 5, 1, 19, 37), (2, 5, 2, 19, 37)], ids=str)
def test_fused_bias_gradient_over_other_broadcasts(bias_shape, device, seed):
    """The fused pass with a bias broadcast over B and S (10 rows, 4 splits), over H only (2 rows),
    or not at all (each program stores its slice once)."""
    evo, args, expected = _backward_inputs(bias_shape, torch.float32, device)
    got = evo.backward_passes(*args, True, fuse_dbias=True, splits=4)
    assert got[3].shape == bias_shape
    for name, g, want in zip(("dq", "dk", "dv", "dbias"), got, expected, strict=True):
        assert rel_err(g, want) < TOL[torch.float32], name


@pytest.mark.parametrize("device", DEVICES)
def test_fused_pass_rejects_an_empty_split(device, seed):
    """5 rows in 4 splits would leave the last split without rows (2 + 2 + 1 + 0) and its partial
    sum unwritten: the launcher refuses it (backward_passes rounds to 3)."""
    evo, (do, q, k, v, bias, key_bias, o, mx, lg), _ = _backward_inputs(
        (2, 1, 2, 19, 37), torch.float32, device
    )
    delta = torch.empty(mx.shape, device=device)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    parts = torch.empty((4, 2, 1, 2, 19, 37), device=device)
    cfg = evo._config("dkdv_dbias", 16, q.device)
    with pytest.raises(ValueError, match="^db: .* 5 rows, got 4"):
        evo.launch_bwd("dkdv_dbias", q, k, v, bias, key_bias, o, do, mx, lg, delta, *grads, parts, cfg)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs_and_fully_masked_rows(device, seed):
    # q, k, v as OpenFold's projections give them: [B, S, N, H, D] viewed as [B, S, H, N, D].
    q, k, v = (t.transpose(2, 3) for t in qkv(1, 2, 21, 3, 3, 32, torch.float32, device))
    assert not q.is_contiguous()
    mask = torch.ones(1, 2, 21, device=device)
    mask[0, 1] = 0
    o = evoformer_attention(q, k, v, None, mask)
    torch.testing.assert_close(o[0, 1], v[0, 1].mean(dim=-2, keepdim=True).expand_as(o[0, 1]))
    for name, actual, expected in run_both(q.detach(), k.detach(), v.detach(), None, mask):
        assert rel_err(actual, expected) < TOL[torch.float32], name


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_and_gradients_keep_the_projection_layout(device, seed):
    # o, dq, dk, dv come back in q, k, v's memory order, so that the model's
    # o.transpose(-2, -3).reshape(..., H * D) and the projections' backward need no copies; a strided
    # incoming gradient is read in place.
    q, k, v = (
        t.transpose(2, 3).detach().requires_grad_() for t in qkv(1, 2, 17, 3, 3, 16, torch.float32, device)
    )
    o = evoformer_attention(q, k, v)
    assert o.stride() == q.stride()
    assert o.transpose(2, 3).is_contiguous()
    do = torch.randn(1, 2, 17, 3, 16, device=device).transpose(2, 3)  # strided like o, not o itself
    grads = torch.autograd.grad(o, (q, k, v), do)
    for name, g, t in zip("qkv", grads, (q, k, v), strict=True):
        assert g.stride() == t.stride(), name
    q0, k0, v0 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    expected = torch.autograd.grad(evoformer_attention_reference(q0, k0, v0), (q0, k0, v0), do)
    for name, g, e in zip("qkv", grads, expected, strict=True):
        assert rel_err(g, e) < TOL[torch.float32], name


@pytest.mark.parametrize("device", DEVICES)
def test_pair_bias_as_a_permuted_projection(device, seed):
    # The Evoformer's pair bias: linear(z) [B, N, N, H] moved to [B, 1, H, N, N], a view with key stride H.
    h, n = 3, 19
    q, k, v = qkv(1, 2, h, n, n, 16, torch.float32, device)
    src = torch.randn(1, n, n, h, device=device, requires_grad=True)
    bias = src.movedim(-1, -3).unsqueeze(1)
    assert bias.stride(-1) == h
    for name, actual, expected in run_both(q, k, v, bias, torch.rand(1, 2, n, device=device) > 0.2):
        assert rel_err(actual, expected) < TOL[torch.float32], name


def test_float64_runs_the_reference(seed):
    q, k, v = qkv(1, 1, 1, 5, 5, 8, torch.float64, "cpu")
    assert not uses_triton(q)
    torch.testing.assert_close(evoformer_attention(q, k, v), evoformer_attention_reference(q, k, v))


def _bad(**kw):
    args = dict(zip("qkv", qkv(1, 2, 2, 5, 5, 16, torch.float32, "cpu"), strict=True))
    args.update(kw)
    return args


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(q=torch.ones(2, 5, 16)), "q"),
        (dict(k=torch.ones(1, 2, 2, 5, 8)), "k"),
        (dict(v=torch.ones(1, 2, 2, 6, 16)), "v"),
        (dict(k=torch.ones(1, 2, 2, 5, 16, dtype=torch.float64)), "k"),
        (dict(bias=torch.ones(1, 2, 2, 5, 4)), "bias"),
        (dict(bias=torch.ones(2, 5, 5)), "bias"),
        (dict(mask=torch.ones(1, 2, 4)), "mask"),
        (dict(mask=torch.ones(1, 2, 2, 1, 5)), "mask"),
        (dict(key_bias=torch.zeros(1, 2, 5, requires_grad=True)), "key_bias"),
        (dict(q="q"), "q"),
    ],
)
def test_bad_inputs_raise(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        evoformer_attention(**_bad(**kwargs))


# --- modules -----------------------------------------------------------------------------------------


def _modules(c=24, c_hidden=16, heads=3, gating=True):
    torch.manual_seed(1234)
    ref = Attention(c, c, c, c_hidden, heads, gating=gating)
    with torch.no_grad():  # OpenFold's init zeroes linear_o and linear_g; use random weights instead
        for p in ref.parameters():
            p.normal_(0, 0.3)
    fused = EvoformerAttention(c, c, c, c_hidden, heads, gating=gating)
    fused.load_state_dict(ref.state_dict())
    return ref, fused


def _compare_modules(ref, fused, q_x, kv_x, biases, tol):
    inputs = [t for t in (q_x, kv_x, *biases) if t.requires_grad]
    outs, grads = [], []
    for m in (ref, fused):
        y = m(q_x, kv_x, biases)
        outs.append(y)
        grads.append(torch.autograd.grad(y, inputs + list(m.parameters()), torch.ones_like(y)))
    assert rel_err(outs[1], outs[0]) < tol
    for i, (a, b) in enumerate(zip(grads[1], grads[0], strict=True)):
        assert rel_err(a, b) < tol, i


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gating", [True, False])
def test_evoformer_attention_module_matches_attention(gating, device, seed):
    # MSA row attention with pair bias: q_x = kv_x = m [B, S, N, c], biases = [mask bias, pair bias].
    ref, fused = (m.to(device) for m in _modules(gating=gating))
    b, s, n = 2, 3, 37
    m = torch.randn(b, s, n, 24, device=device, requires_grad=True)
    mask = (torch.rand(b, s, n, device=device) > 0.2).float()
    mask[1, 0] = 0
    mask_bias = (1e9 * (mask - 1))[..., None, None, :]
    pair_bias = torch.randn(b, 1, 3, n, n, device=device, requires_grad=True)
    _compare_modules(ref, fused, m, m, [mask_bias, pair_bias], 1e-5)


@pytest.mark.parametrize(
    "q_shape, kv_shape, bias_shapes",
    [
        ((17, 24), (9, 24), []),  # no leading dims, cross attention, no bias
        ((3, 17, 24), (3, 17, 24), [(3, 1, 1, 17)]),  # one leading dim, mask bias only
        ((2, 2, 2, 9, 24), (2, 2, 2, 9, 24), [(2, 2, 1, 1, 1, 9)]),  # three leading dims: fallback
    ],
)
def test_evoformer_attention_module_other_layouts(q_shape, kv_shape, bias_shapes, seed):
    ref, fused = _modules()
    q_x = torch.randn(q_shape, requires_grad=True)
    kv_x = torch.randn(kv_shape, requires_grad=True)
    biases = [torch.randn(sh) for sh in bias_shapes]
    _compare_modules(ref, fused, q_x, kv_x, biases, 1e-5)


def test_to_hfkit_round_trip(seed):
    ref, _ = _modules()

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(24, 24)
            self.att = ref

        def forward(self, x, biases):
            h = self.proj(x)
            return self.att(h, h, biases)

    holder = Holder()
    x = torch.randn(1, 2, 11, 24)
    biases = [torch.randn(1, 1, 3, 11, 11)]
    expected = holder(x, biases)
    keys = {k: v.clone() for k, v in holder.state_dict().items()}
    swapped, report = to_hfkit(holder, inplace=False, report=True)
    assert type(swapped.att) is EvoformerAttention and type(holder.att) is Attention
    assert report.counts() == {"Attention": 1}
    assert swapped.state_dict().keys() == keys.keys()
    assert all(torch.equal(swapped.state_dict()[k], v) for k, v in keys.items())
    torch.testing.assert_close(swapped(x, biases), expected, rtol=1e-5, atol=1e-5)
    back = to_torch(swapped)
    assert type(back.att) is Attention


def test_attention_init_and_bad_inputs():
    att = Attention(8, 6, 6, 4, 2)
    assert list(att.state_dict()) == [
        "linear_q.weight",
        "linear_k.weight",
        "linear_v.weight",
        "linear_o.weight",
        "linear_o.bias",
        "linear_g.weight",
        "linear_g.bias",
    ]
    assert torch.all(att.linear_g.bias == 1) and torch.all(att.linear_o.weight == 0)
    assert Attention(8, 6, 6, 4, 2, gating=False).linear_g is None
    x, kv = torch.randn(3, 8), torch.randn(5, 6)
    assert att(x, kv).shape == (3, 8)
    with pytest.raises(ValueError, match="^q_x:"):
        att(torch.randn(3, 7), kv)
    with pytest.raises(ValueError, match="^kv_x:"):
        att(x, torch.randn(5, 8))
    with pytest.raises(ValueError, match="^biases:"):
        att(x, kv, torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="^no_heads:"):
        Attention(8, 6, 6, 4, 0)


def test_compile_on_cpu_runs_the_reference(seed):
    q, k, v = qkv(1, 2, 2, 7, 7, 16, torch.float32, "cpu")
    bias, mask = torch.randn(1, 1, 2, 7, 7), torch.rand(1, 2, 7) > 0.3
    f = torch.compile(lambda a, b, c: evoformer_attention(a, b, c, bias, mask), fullgraph=True)
    torch.testing.assert_close(f(q, k, v), evoformer_attention_reference(q, k, v, bias, mask))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="custom-op checks need CUDA (not the interpreter)")
def test_opcheck_and_compile_cuda():
    q, k, v = (t.requires_grad_(True) for t in qkv(1, 2, 2, 37, 37, 32, torch.bfloat16, "cuda"))
    bias = torch.randn(1, 1, 2, 37, 37, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    key_bias = (torch.rand(1, 2, 37, device="cuda") > 0.3).float() * 1e9 - 1e9
    torch.library.opcheck(torch.ops.hfkit.evoformer_attention_fwd.default, (q, k, v, bias, key_bias))
    loss = lambda *t: evoformer_attention(*t, key_bias=key_bias).float().square().sum()
    f = torch.compile(loss, fullgraph=True)
    got = torch.autograd.grad(f(q, k, v, bias), (q, k, v, bias))
    want = torch.autograd.grad(loss(q, k, v, bias), (q, k, v, bias))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offsets_past_2_to_the_31_cuda():
    """Triangle attention at N = 4100 (q [1, N, 4, N, 32]: 2.15e9 elements, past int32 offsets) and
    MSA column attention with more rows x heads than the grid's y limit: the last rows, where the
    offsets are largest, against the reference computed on those rows alone."""
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2**30:
        pytest.skip(f"needs 40 GiB of free GPU memory, has {free / 2**30:.0f}")
    n, h, d = 4100, 4, 32
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, n, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)
    )
    bias = torch.randn(1, 1, h, n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    o = evoformer_attention(q, k, v, bias)
    rows = slice(n - 3, n)
    want = evoformer_attention_reference(*(t[:, rows].float() for t in (q, k, v)), bias.float())
    assert rel_err(o[:, rows], want) < TOL[torch.bfloat16]
    del q, k, v, bias, o
    s, heads = 70_000, 1  # column attention over 70,000 columns: B*S*H past 65,535
    q, k, v = (torch.randn(1, s, heads, 16, d, device="cuda", generator=gen) for _ in range(3))
    o = evoformer_attention(q, k, v)
    for part in (slice(0, 2), slice(s - 2, s)):
        want = evoformer_attention_reference(q[:, part], k[:, part], v[:, part])
        assert rel_err(o[:, part], want) < TOL[torch.float32]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [8, 32, 40])
def test_row_maxima_key_norm(d, device):
    """The bounded forward's max_j |k_j| per (b, s, h) from its kernel equals torch's on a strided k
    (a permuted projection, as the model passes it) with a key count off the kernel's block."""
    evo = importlib.import_module("hfkit.ops.evoformer_attention")
    k = torch.randn(2, 3, 133, 5, d, device=device).permute(0, 1, 3, 2, 4)
    knorm, kbmax, bmax = evo._row_maxima(k, None, None)
    expected = torch.linalg.vector_norm(k.double(), dim=-1).amax(-1).reshape(-1)
    torch.testing.assert_close(knorm.double(), expected, rtol=1e-6, atol=0)
    assert kbmax is None and bmax is None


def test_int32_slice_check_counts_the_span_of_a_slice():
    """`_int32_slices`: the element span of one (b, s, h) slice against 2**31 (meta tensors: no memory):
    the ending node's q [N, S, H, D] at N = 4096 fits, one residue more does not; dense [B, S, H, N, D]
    always fits."""
    evo = importlib.import_module("hfkit.ops.evoformer_attention")

    def ending_node_q(n, width=128):  # [1, S=n, H=4, N=n, 32] viewed from [n(N), n(S), width]
        return torch.empty_strided((1, n, 4, n, 32), (0, width, 32, n * width, 1), device="meta")

    assert evo._int32_slices(ending_node_q(4096))
    assert not evo._int32_slices(ending_node_q(4097))
    assert not evo._int32_slices(ending_node_q(4096, width=520))
    assert evo._int32_slices(torch.empty((1, 9000, 4, 9000, 32), device="meta"))
    # a bias [1, 1, H, Q, K] viewed from a wider [Q, K, 520] projection: its rows 520 K apart
    assert not evo._int32_slices(
        torch.empty_strided((1, 1, 4, 4096, 4096), (0, 0, 1, 4096 * 520, 520), device="meta")
    )


@pytest.mark.parametrize("device", DEVICES)
def test_slices_past_int32_run_on_dense_copies(device, seed, monkeypatch):
    """Inputs whose slices the Triton kernels cannot index in 32 bits run on dense copies: forward and
    gradients as the direct call's (the check forced on small strided views)."""
    evo = importlib.import_module("hfkit.ops.evoformer_attention")
    wide = torch.randn(1, 37, 3, 2, 3 * 16 + 8, device=device)  # [N, S, H?] -> q, k, v column slices
    q, k, v = (wide[..., i * 16 : (i + 1) * 16].permute(0, 2, 3, 1, 4) for i in range(3))
    bias = torch.randn(1, 1, 2, 37, 37, device=device)
    torch.manual_seed(1)  # run_both draws the output gradient
    want = run_both(*(t.detach().clone() for t in (q, k, v, bias)))
    monkeypatch.setattr(evo, "_int32_slices", lambda *tensors: False)
    torch.manual_seed(1)
    got = run_both(*(t.detach().clone() for t in (q, k, v, bias)))
    for (name, a, _), (_, b, _) in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-6, name
