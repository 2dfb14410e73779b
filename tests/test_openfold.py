"""hfkit on OpenFold's own code: `to_hfkit` on OpenFold's `EvoformerStack` / `ExtraMSAStack` (every
module type hfkit has a fused version of is swapped, outputs and gradients match OpenFold, `to_torch`
gives OpenFold's classes back bit-identically) and `hfkit.model.load_openfold_state_dict`.

OpenFold's modules come from `hfkit.bench.peers.load_openfold` (its source in `shared/peers/openfold`
beside or above the repository, or `$HFKIT_OPENFOLD_PEERS`; see its NOTICE.md); the tests skip with
the reason where it is absent. OpenFold's `ExtraMSABlock` row attention calls the CUDA
`attention_core` even on CPU: the unswapped reference runs a plain softmax attention there.
"""

from __future__ import annotations

import copy
import types
from pathlib import Path

import pytest
import torch

import hfkit
import hfkit.model
from hfkit.bench.peers import load_openfold
from hfkit.ops._triton import reference_on_cpu


@pytest.fixture(scope="module")
def of() -> types.SimpleNamespace:
    modules, reason = load_openfold()
    if modules is None:
        pytest.skip(reason)
    return modules


def _plain_attention_core(q, k, v, bias_1=None, bias_2=None):
    """OpenFold's `attention_core` (q already scaled, [*, H, Q, C]) as plain torch, for CPU."""
    a = q @ k.transpose(-1, -2)
    for b in (bias_1, bias_2):
        if b is not None:
            a = a + b
    return torch.softmax(a, dim=-1) @ v


SIZES = dict(
    c_m=8,
    c_z=8,
    c_hidden_msa_att=4,
    c_hidden_opm=4,
    c_hidden_mul=4,
    c_hidden_pair_att=4,
    no_heads_msa=2,
    no_heads_pair=2,
    no_blocks=1,
    transition_n=2,
    msa_dropout=0.15,
    pair_dropout=0.25,
    opm_first=False,
    inf=1e9,
    eps=1e-8,
)


def _evoformer_stack(of, fused: bool) -> torch.nn.Module:
    return of.evoformer.EvoformerStack(
        **SIZES,
        c_s=8,
        no_column_attention=False,
        fuse_projection_weights=fused,
        blocks_per_ckpt=None,
    )


def _extra_msa_stack(of, fused: bool) -> torch.nn.Module:
    return of.evoformer.ExtraMSAStack(**SIZES, fuse_projection_weights=fused, ckpt=False)


def _redraw(model: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (OpenFold zero-initialises output projections and gates)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _inputs(seed: int, s: int = 3, n: int = 5, c_m: int = 8, c_z: int = 8):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(s, n, c_m, generator=g)
    z = torch.randn(n, n, c_z, generator=g)
    msa_mask = (torch.rand(s, n, generator=g) > 0.2).float()
    msa_mask[0] = 1.0
    pair_mask = (torch.rand(n, n, generator=g) > 0.2).float()
    return m, z, msa_mask, pair_mask


def _run(model, inputs, extra: bool, mask_trans: bool):
    """Outputs and gradients (inputs m, z and every parameter) of one forward + backward."""
    m, z, msa_mask, pair_mask = (t.clone() for t in inputs)
    m.requires_grad_(True)
    z.requires_grad_(True)
    model.zero_grad(set_to_none=True)
    if extra:
        outs = (model(m, z, msa_mask, pair_mask, chunk_size=None, _mask_trans=mask_trans),)
    else:
        outs = model(m, z, msa_mask, pair_mask, chunk_size=None, _mask_trans=mask_trans)
    g = torch.Generator().manual_seed(7)
    loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
    loss.backward()
    grads = {"m": m.grad, "z": z.grad}
    grads.update({name: p.grad for name, p in model.named_parameters()})
    return [o.detach() for o in outs], grads


# Every OpenFold module type of the two stacks that has an hfkit version (the `nn.LayerNorm` inside
# OuterProductMean is torch's, swapped by the plain `LayerNorm` registration).
EXPECTED_OPS = {
    "openfold.LayerNorm",
    "openfold.Attention",
    "openfold.OuterProductMean",
    "openfold.MSATransition",
    "openfold.PairTransition",
    "openfold.DropoutRowwise",
    "LayerNorm",
}


def _tri_ops(fused: bool) -> set[str]:
    prefix = "openfold.FusedTriangleMultiplication" if fused else "openfold.TriangleMultiplication"
    return {prefix + "Outgoing", prefix + "Incoming"}


@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("stack", ["evoformer", "extra_msa"])
def test_to_hfkit_swaps_openfold_stacks_and_matches_them(of, monkeypatch, stack: str, path: str) -> None:
    extra = stack == "extra_msa"
    fused = path == "triton"  # each stack once with OpenFold's fused-projection triangle updates
    monkeypatch.setattr(of.primitives, "attention_core", _plain_attention_core)
    model = (_extra_msa_stack if extra else _evoformer_stack)(of, fused)
    _redraw(model, seed=3)
    model.eval()
    inputs = _inputs(seed=4)
    mask_trans = not extra  # both of OpenFold's transition settings
    expected, expected_grads = _run(model, inputs, extra, mask_trans)
    types_before = {name: type(mod) for name, mod in model.named_modules()}
    state_before = {k: v for k, v in model.state_dict().items()}

    swapped, report = hfkit.to_hfkit(model, inplace=False, report=True)
    ops = set(report.counts())
    want = EXPECTED_OPS | _tri_ops(fused) | ({"openfold.GlobalAttention"} if extra else set())
    assert want <= ops, f"not swapped: {sorted(want - ops)}\n{report}"
    assert not report.skipped, str(report)
    swapped_types = {type(mod).__name__ for mod in swapped.modules()}
    assert "Attention" not in swapped_types and "HfkitAttention" in swapped_types
    after = swapped.state_dict()
    assert list(after) == list(state_before)
    assert all(torch.equal(after[k], v) for k, v in state_before.items())

    if path == "reference":
        with reference_on_cpu():
            actual, actual_grads = _run(swapped, inputs, extra, mask_trans)
    else:
        actual, actual_grads = _run(swapped, inputs, extra, mask_trans)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    assert actual_grads.keys() == expected_grads.keys()
    for name, e in expected_grads.items():
        a = actual_grads[name]
        assert (a is None) == (e is None), name
        if e is not None:
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=lambda msg, n=name: f"{n}: {msg}")

    back, back_report = hfkit.to_torch(swapped, report=True)
    assert {name: type(mod) for name, mod in back.named_modules()} == types_before
    assert len(back_report.swapped) == len(report.swapped)
    restored = back.state_dict()
    assert list(restored) == list(state_before)
    assert all(torch.equal(restored[k], v) for k, v in state_before.items())


def test_to_hfkit_shares_openfold_parameters_and_round_trips_in_place(of) -> None:
    model = _evoformer_stack(of, fused=False)
    params = {name: p for name, p in model.named_parameters()}
    types_before = [type(mod) for mod in model.modules()]
    swapped = hfkit.to_hfkit(model)
    assert all(p is params[name] for name, p in swapped.named_parameters())
    back = hfkit.to_torch(swapped)
    assert [type(mod) for mod in back.modules()] == types_before
    assert all(p is params[name] for name, p in back.named_parameters())


def test_openfold_module_with_another_layout_is_skipped_with_the_reason(of) -> None:
    dropout = of.evoformer.DropoutRowwise(0.25)
    dropout.batch_dim = [-3, -2]
    attention = of.primitives.Attention(8, 8, 8, 4, 2)
    attention.linear_o.bias = None
    model = torch.nn.Sequential(dropout, attention)
    model, report = hfkit.to_hfkit(model, report=True)
    assert type(model[0]) is of.evoformer.DropoutRowwise and type(model[1]) is of.primitives.Attention
    reasons = {row.op: row.reason for row in report.skipped}
    assert "batch_dim" in reasons["openfold.DropoutRowwise"]
    assert "linear_o.bias" in reasons["openfold.Attention"]
    assert all(r.startswith("skipped: ") for r in reasons.values())


def test_openfold_ops_obey_include_and_exclude(of) -> None:
    model = _evoformer_stack(of, fused=False)
    _, report = hfkit.to_hfkit(model, inplace=False, include={"openfold.Attention"}, report=True)
    assert set(report.counts()) == {"openfold.Attention"}
    _, report = hfkit.to_hfkit(model, inplace=False, exclude={"openfold.Attention"}, report=True)
    assert "openfold.Attention" not in report.counts() and "openfold.Attention" in report.counts("skipped")


def test_swapped_openfold_dropout_shares_its_mask_in_training(of) -> None:
    dropout = hfkit.to_hfkit(of.evoformer.DropoutRowwise(0.5)).train()
    x = torch.ones(4, 6, 5, 3)
    y = dropout(x)
    assert torch.equal(x, torch.ones(4, 6, 5, 3))  # OpenFold's writes x in place; the swap does not
    kept = y != 0
    assert torch.equal(kept, kept[..., :1, :, :].expand_as(kept))  # one mask per row (dim -3)
    assert torch.allclose(y[kept], torch.full_like(y[kept], 2.0))
    assert 0 < kept.sum() < kept.numel()
    assert dropout.eval()(x) is x


# --- checkpoints -------------------------------------------------------------------------------------

HFKIT_SIZES = {k: v for k, v in SIZES.items() if k not in ("opm_first", "eps")}


def _v1_to_v2(key: str) -> str:
    """hfkit's (OpenFold v1) Evoformer key -> OpenFold >= 2.0's, to build v2 checkpoints by hand."""
    for old, new in (
        ("core.msa_transition", "msa_transition"),
        ("core.outer_product_mean", "outer_product_mean"),
        ("core.tri_", "pair_stack.tri_"),
        ("core.pair_transition", "pair_stack.pair_transition"),
    ):
        key = key.replace(old, new)
    return key


# Parts of OpenFold's AlphaFold that hfkit does not have, as they appear in its checkpoints.
OPENFOLD_ONLY = {
    "template_embedder.template_pair_stack.blocks.0.tri_mul_out.linear_z.weight": (4, 4),
    "structure_module.ipa.linear_q.weight": (4, 4),
    "recycling_embedder.layer_norm_m.weight": (4,),
    "aux_heads.plddt.linear_1.weight": (4, 4),
}


@pytest.mark.parametrize("mask_trans", [False, True])
@pytest.mark.parametrize("stack", ["evoformer", "extra_msa"])
def test_openfold_stack_checkpoint_loads_into_hfkit_and_gives_openfold_outputs(
    of, monkeypatch, stack: str, mask_trans: bool
) -> None:
    """OpenFold's own v2-layout stack, saved as a training checkpoint (EMA weights under `module.`),
    loads strictly into hfkit's stack, which then computes OpenFold's outputs (its `_mask_trans` and
    the global attention's eps included)."""
    extra = stack == "extra_msa"
    monkeypatch.setattr(of.primitives, "attention_core", _plain_attention_core)
    theirs = (_extra_msa_stack if extra else _evoformer_stack)(of, False).eval()
    _redraw(theirs, seed=5)
    ours_cls = hfkit.model.ExtraMSAStack if extra else hfkit.model.EvoformerStack
    ours = ours_cls(**HFKIT_SIZES, **({} if extra else {"c_s": 8}), mask_trans=mask_trans).eval()
    part = "extra_msa_stack." if extra else "evoformer."
    weights = {f"module.{part}{k}": v.clone() for k, v in theirs.state_dict().items()}
    weights.update({f"module.{k}": torch.zeros(shape) for k, shape in OPENFOLD_ONLY.items()})
    ckpt = {"ema": {"params": weights, "decay": 0.999}, "state_dict": {}, "epoch": 3}

    report = hfkit.model.load_openfold_state_dict(ours, ckpt, prefix=part)
    assert report.container == "ema"
    assert sorted(report.loaded) == sorted(ours.state_dict())
    assert sorted(report.ignored) == sorted(OPENFOLD_ONLY)
    assert report.missing == [] and report.unexpected == []
    assert report.renamed > 0  # OpenFold's stack is in the v2 layout
    theirs_v1 = hfkit.model.openfold_v2_to_v1_keys(theirs.state_dict())
    assert all(torch.equal(v, theirs_v1[k]) for k, v in ours.state_dict().items())

    m, z, msa_mask, pair_mask = _inputs(seed=6)
    with torch.no_grad():
        expected = theirs(m, z, msa_mask, pair_mask, chunk_size=None, _mask_trans=mask_trans)
        actual = ours(m, z, msa_mask, pair_mask)
    for a, e in zip(actual if not extra else [actual], expected if not extra else [expected], strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stack", ["evoformer", "extra_msa"])
def test_swapped_openfold_stack_matches_in_chunked_inplace_inference(of, monkeypatch, stack: str) -> None:
    """OpenFold's inference settings (chunk_size, inplace_safe: its triangle updates then return z
    overwritten with z + update) give OpenFold's outputs after the swap (reference path)."""
    extra = stack == "extra_msa"
    monkeypatch.setattr(of.primitives, "attention_core", _plain_attention_core)
    model = (_extra_msa_stack if extra else _evoformer_stack)(of, extra).eval()
    _redraw(model, seed=8)
    m, z, msa_mask, pair_mask = _inputs(seed=9)

    def run(module):
        with torch.no_grad():
            out = module(
                m.clone(), z.clone(), msa_mask, pair_mask, chunk_size=2, inplace_safe=True, _mask_trans=False
            )
        return out if isinstance(out, tuple) else (out,)

    expected = run(model)
    swapped = hfkit.to_hfkit(model, inplace=False)
    with reference_on_cpu():
        actual = run(swapped)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_swapped_openfold_model_deepcopies_and_pickles(of, tmp_path) -> None:
    model = hfkit.to_hfkit(_evoformer_stack(of, fused=True))
    types_before = [type(mod) for mod in model.modules()]
    for copied in (copy.deepcopy(model), _save_and_load(model, tmp_path / "model.pt")):
        assert [type(mod) for mod in copied.modules()] == types_before
        state = model.state_dict()
        assert copied.state_dict().keys() == state.keys()
        assert all(torch.equal(v, state[k]) for k, v in copied.state_dict().items())
        assert [type(mod) for mod in hfkit.to_torch(copied).modules()] == [
            type(mod) for mod in hfkit.to_torch(model, inplace=False).modules()
        ]


def _save_and_load(model: torch.nn.Module, path: Path) -> torch.nn.Module:
    torch.save(model, path)
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("stack", ["evoformer", "extra_msa"])
def test_swapped_bfloat16_openfold_stack_matches_to_bfloat16_rounding(of, monkeypatch, stack: str) -> None:
    """OpenFold's stack cast to bfloat16 (its LayerNorm and Linear run bfloat16 inputs with bfloat16
    parameters) keeps its dtype after the swap and agrees to bfloat16 rounding (reference path)."""
    extra = stack == "extra_msa"
    monkeypatch.setattr(of.primitives, "attention_core", _plain_attention_core)
    model = (_extra_msa_stack if extra else _evoformer_stack)(of, False).eval()
    _redraw(model, seed=3)
    model = model.to(torch.bfloat16)
    inputs = [t.to(torch.bfloat16) for t in _inputs(seed=4)]
    with torch.no_grad():
        expected = model(*inputs, chunk_size=None, _mask_trans=False)
        swapped = hfkit.to_hfkit(model, inplace=False)
        with reference_on_cpu():
            actual = swapped(*inputs, chunk_size=None, _mask_trans=False)
    for a, e in zip(*(o if isinstance(o, tuple) else (o,) for o in (actual, expected)), strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=5e-2)


# --- finding OpenFold -------------------------------------------------------------------------------


def test_load_openfold_says_why_when_the_folder_holds_no_openfold(tmp_path, monkeypatch) -> None:
    from hfkit.bench.peers import OPENFOLD_PEERS_ENV, find_openfold_peers

    modules, reason = load_openfold(tmp_path)
    assert modules is None and "peers_dir" in reason and str(tmp_path) in reason
    monkeypatch.setenv(OPENFOLD_PEERS_ENV, str(tmp_path / "elsewhere"))
    folder, reason = find_openfold_peers()
    assert folder is None and OPENFOLD_PEERS_ENV in reason and "elsewhere" in reason
    modules, reason = load_openfold()
    assert modules is None and OPENFOLD_PEERS_ENV in reason


def test_load_openfold_reads_the_environment_variable(of, monkeypatch) -> None:
    from hfkit.bench.peers import OPENFOLD_PEERS_ENV

    peers = Path(of.evoformer.__file__).resolve().parents[2]
    monkeypatch.setenv(OPENFOLD_PEERS_ENV, str(peers))
    modules, reason = load_openfold()
    assert reason is None and modules.evoformer is of.evoformer
    assert modules.primitives.truncnorm is of.primitives.truncnorm
