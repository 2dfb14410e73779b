"""hfkit.model: OpenFold key layout, forward/backward on `process_features`-shaped inputs, activation
checkpointing and chunking equal to the plain path, dropout, masks, losses, and a few training steps
on real 2q2k features (skipped where OpenFold's test data is absent)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from hfkit.data.msa_sampling import MSA_FEAT_DIM, TARGET_FEAT_DIM, FeatureConfig
from hfkit.model import (
    AlphaFoldLite,
    EvoformerStack,
    ModelConfig,
    distogram_loss,
    load_openfold_state_dict,
    masked_msa_loss,
    openfold_v2_to_v1_keys,
    pseudo_beta,
)

pytestmark = pytest.mark.usefixtures("one_thread")


FIXTURE = Path(__file__).parent / "fixtures" / "openfold_evoformer_keys.txt"
TINY = ModelConfig.tiny()


def random_batch(
    seed: int, num_res: int = 12, num_seq: int = 6, real_res: int | None = None, num_extra: int = 4
) -> dict:
    """Random features with the names, shapes and dtypes of `process_features` (one sample); the
    last num_res - real_res residues are padding."""
    g = torch.Generator().manual_seed(seed)
    real = num_res if real_res is None else real_res
    aatype = torch.randint(0, 20, (num_res,), generator=g)
    seq_mask = (torch.arange(num_res) < real).float()
    true_msa = torch.randint(0, 22, (num_seq, num_res), generator=g)
    msa_feat = torch.rand((num_seq, num_res, MSA_FEAT_DIM), generator=g)
    target_feat = torch.cat([torch.zeros(num_res, 1), F.one_hot(aatype, TARGET_FEAT_DIM - 1).float()], -1)
    positions = torch.cumsum(torch.randn((num_res, 37, 3), generator=g) * 2.0, dim=0)
    atom_mask = (torch.rand((num_res, 37), generator=g) < 0.8).float()
    batch = {
        "aatype": aatype * seq_mask.long(),
        "residue_index": torch.arange(num_res) * seq_mask.long(),
        "seq_mask": seq_mask,
        "target_feat": target_feat * seq_mask[:, None],
        "msa_feat": msa_feat * seq_mask[:, None],
        "msa_mask": seq_mask.expand(num_seq, num_res).clone(),
        "true_msa": true_msa * seq_mask.long(),
        "bert_mask": (torch.rand((num_seq, num_res), generator=g) < 0.3).float() * seq_mask,
        "all_atom_positions": positions * seq_mask[:, None, None],
        "all_atom_mask": atom_mask * seq_mask[:, None],
        "extra_msa": torch.randint(0, 23, (num_extra, num_res), generator=g) * seq_mask.long(),
        "extra_msa_mask": seq_mask.expand(num_extra, num_res).clone(),
        "extra_has_deletion": (torch.rand((num_extra, num_res), generator=g) < 0.2).float() * seq_mask,
        "extra_deletion_value": torch.rand((num_extra, num_res), generator=g) * seq_mask,
    }
    return batch


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Noise on every parameter: the zero-initialised output layers would make many checks trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def tiny_model(seed: int = 0, **changes: object) -> AlphaFoldLite:
    torch.manual_seed(seed)
    return perturbed(AlphaFoldLite(TINY.replace(**changes)), seed)


# ----------------------------------------------------------------------------- parameter names


def test_evoformer_keys_equal_openfold_fixture() -> None:
    expected = [l for l in FIXTURE.read_text().splitlines() if l and not l.startswith("#")]
    stack = EvoformerStack.from_config(TINY.replace(no_blocks=1))
    assert sorted(stack.state_dict()) == sorted(expected)
    assert len(expected) == len(set(expected)) == 95


def test_openfold_v2_keys_load_strict() -> None:
    """OpenFold >= 2.0 names (its convert_deprecated_v1_keys applied) map back and load strictly."""
    source = EvoformerStack.from_config(TINY)
    v2 = {}
    for key, value in source.state_dict().items():
        key = key.replace("core.msa_transition", "msa_transition")
        key = key.replace("core.outer_product_mean", "outer_product_mean")
        key = re.sub(r"core\.(tri_|pair_transition)", r"pair_stack.\1", key)
        v2[key] = value
    assert not any(".core." in k for k in v2)
    target = EvoformerStack.from_config(TINY)
    target.load_state_dict(openfold_v2_to_v1_keys(v2), strict=True)
    for key, value in target.state_dict().items():
        assert torch.equal(value, source.state_dict()[key])


def test_model_submodule_names() -> None:
    keys = set(AlphaFoldLite(TINY).state_dict())
    for key in (
        "input_embedder.linear_tf_z_i.weight",
        "input_embedder.linear_relpos.weight",
        "evoformer.blocks.1.core.tri_mul_out.linear_a_p.weight",
        "evoformer.linear.weight",
        "extra_msa_embedder.linear.weight",
        "extra_msa_stack.blocks.0.msa_att_col.layer_norm_m.weight",
        "extra_msa_stack.blocks.0.msa_att_col.global_attention.linear_k.weight",
        "extra_msa_stack.blocks.0.core.tri_att_end.mha.linear_q.weight",
        "aux_heads.distogram.linear.weight",
        "aux_heads.masked_msa.linear.weight",
    ):
        assert key in keys, key


# ----------------------------------------------------------------------------- forward / backward


def test_tiny_forward_backward_shapes_and_grads() -> None:
    model = tiny_model()
    batch = {k: torch.stack([v, v]) for k, v in random_batch(1).items()}  # a leading batch axis of 2
    out = model(batch)
    c = TINY
    assert out["msa"].shape == (2, 6, 12, c.c_m)
    assert out["pair"].shape == (2, 12, 12, c.c_z)
    assert out["single"].shape == (2, 12, c.c_s)
    assert out["distogram_logits"].shape == (2, 12, 12, c.no_bins)
    assert out["masked_msa_logits"].shape == (2, 6, 12, 23)
    torch.testing.assert_close(out["distogram_logits"], out["distogram_logits"].transpose(1, 2))
    total, parts = model.loss(batch, out)
    assert set(parts) == {"distogram", "masked_msa"} and torch.isfinite(total)
    # No loss reads the single representation (no structure module): give it a gradient too.
    (total + out["single"].square().mean()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_untrained_model_loss_is_uniform() -> None:
    """Zero-initialised heads predict uniform bins: the loss is 0.3 log 64 + 2 log 23."""
    torch.manual_seed(0)
    model = AlphaFoldLite(TINY).eval()
    batch = random_batch(2)
    total, parts = model.loss(batch, model(batch))
    torch.testing.assert_close(parts["distogram"], torch.tensor(64.0).log())
    torch.testing.assert_close(parts["masked_msa"], torch.tensor(23.0).log())
    torch.testing.assert_close(total, 0.3 * torch.tensor(64.0).log() + 2.0 * torch.tensor(23.0).log())


def test_extra_msa_reaches_the_pair_representation() -> None:
    model = tiny_model().eval()
    batch = random_batch(9)
    other = {**batch, "extra_msa": (batch["extra_msa"] + 1) % 23}
    with torch.no_grad():
        assert not torch.allclose(model(batch)["pair"], model(other)["pair"])
    no_extra = AlphaFoldLite(TINY.replace(extra_no_blocks=0))
    assert no_extra.extra_msa_stack is None
    assert not any(k.startswith("extra_msa") for k in no_extra.state_dict())
    no_extra({k: v for k, v in batch.items() if not k.startswith("extra_")})


def test_checkpointed_equals_plain_outputs_and_grads() -> None:
    plain = tiny_model().train()
    ckpt = tiny_model(checkpoint=True).train()
    ckpt.load_state_dict(plain.state_dict())
    assert ckpt.evoformer.checkpoint and not plain.evoformer.checkpoint
    batch = random_batch(3)
    results = []
    for model in (plain, ckpt):
        torch.manual_seed(123)  # same dropout masks; checkpointing replays the RNG state
        out = model(batch)
        total, _ = model.loss(batch, out)
        (total + out["single"].square().mean()).backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (out_a, grads_a), (out_b, grads_b) = results
    for key in out_a:
        torch.testing.assert_close(out_b[key], out_a[key], rtol=1e-5, atol=1e-5)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("chunk_size", [1, 5])
def test_chunked_equals_unchunked(chunk_size: int) -> None:
    model = tiny_model().eval()
    batch = random_batch(4, num_res=11, num_seq=7, real_res=9)
    with torch.no_grad():
        plain = model(batch)
        chunked = model(batch, chunk_size=chunk_size)
    for key in plain:
        torch.testing.assert_close(chunked[key], plain[key], rtol=1e-5, atol=1e-5, msg=key)


def test_chunked_config_default_is_used() -> None:
    plain = tiny_model().eval()
    chunked = tiny_model(chunk_size=4).eval()
    batch = random_batch(5)
    with torch.no_grad():
        torch.testing.assert_close(chunked(batch)["pair"], plain(batch)["pair"], rtol=1e-5, atol=1e-5)


def test_dropout_off_in_eval_on_in_train() -> None:
    model = tiny_model()
    batch = random_batch(6)
    with torch.no_grad():
        model.eval()
        a, b = model(batch)["pair"], model(batch)["pair"]
        assert torch.equal(a, b)
        model.train()
        c, d = model(batch)["pair"], model(batch)["pair"]
    assert not torch.equal(c, d) and not torch.equal(c, a)


def test_rowwise_dropout_shares_mask_along_rows() -> None:
    from hfkit.model.dropout import DropoutColumnwise, DropoutRowwise

    x = torch.ones(3, 5, 6, 4)
    row = DropoutRowwise(0.5).train()(x)
    assert torch.equal(row, row[:, :1].expand_as(row))  # the same for every row index
    col = DropoutColumnwise(0.5).train()(x)
    assert torch.equal(col, col[:, :, :1].expand_as(col))
    assert torch.equal(DropoutRowwise(0.5).eval()(x), x)


def test_padding_does_not_change_real_outputs() -> None:
    """Residues and MSA rows padded with zeros and masked out (as `process_features` pads) leave the
    outputs of the real ones unchanged, and everything stays finite."""
    model = tiny_model().eval()
    real = random_batch(7, num_res=9, num_seq=5)
    padded = {}
    for key, value in real.items():
        pad = []
        for dim, size in enumerate(value.shape):
            if size == 5 and key in ("msa_feat", "msa_mask", "true_msa", "bert_mask") and dim == 0:
                pad.append((dim, 3))
            elif size == 4 and key.startswith("extra_") and dim == 0:
                pad.append((dim, 2))
            elif size == 9 and dim < 2:
                pad.append((dim, 4))
        for dim, extra in pad:
            shape = list(value.shape)
            shape[dim] = extra
            value = torch.cat([value, value.new_zeros(shape)], dim=dim)
        padded[key] = value
    assert padded["msa_feat"].shape == (8, 13, MSA_FEAT_DIM) and padded["seq_mask"].shape == (13,)
    assert padded["extra_msa"].shape == (6, 13)
    with torch.no_grad():
        out_real = model(real)
        out_pad = model(padded)
    for key in out_pad:
        assert torch.isfinite(out_pad[key]).all(), key
    torch.testing.assert_close(out_pad["pair"][:9, :9], out_real["pair"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out_pad["msa"][:5, :9], out_real["msa"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out_pad["single"][:9], out_real["single"], rtol=1e-4, atol=1e-4)
    loss_real, _ = model.loss(real, out_real)
    loss_pad, _ = model.loss(padded, out_pad)
    torch.testing.assert_close(loss_pad, loss_real, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- components vs the algorithms


def test_triangle_multiplication_matches_algorithms_11_12() -> None:
    from hfkit.model import TriangleMultiplicationIncoming, TriangleMultiplicationOutgoing

    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 5, 6, generator=g)
    mask = (torch.rand(5, 5, generator=g) < 0.8).float()
    for cls, equation in (
        (TriangleMultiplicationOutgoing, "ikc,jkc->ijc"),
        (TriangleMultiplicationIncoming, "kic,kjc->ijc"),
    ):
        mod = perturbed(cls(6, 4))
        zn = mod.layer_norm_in(z)
        a = mask[..., None] * torch.sigmoid(mod.linear_a_g(zn)) * mod.linear_a_p(zn)
        b = mask[..., None] * torch.sigmoid(mod.linear_b_g(zn)) * mod.linear_b_p(zn)
        x = mod.linear_z(mod.layer_norm_out(torch.einsum(equation, a, b)))
        expected = torch.sigmoid(mod.linear_g(zn)) * x
        torch.testing.assert_close(mod(z, mask), expected, rtol=1e-5, atol=1e-5)


def test_outer_product_mean_matches_algorithm_10() -> None:
    from hfkit.model import OuterProductMean

    g = torch.Generator().manual_seed(1)
    m = torch.randn(4, 3, 6, generator=g)
    mod = perturbed(OuterProductMean(6, 5, 2))
    ln = mod.layer_norm(m)
    a, b = mod.linear_1(ln), mod.linear_2(ln)
    expected = torch.empty(3, 3, 5)
    for i in range(3):
        for j in range(3):
            # As OpenFold and AF2's code: the projection (bias included) of the sum, then / count.
            outer = sum(torch.outer(a[s, i], b[s, j]) for s in range(4))
            expected[i, j] = mod.linear_out(outer.flatten()) / (mod.eps + 4)
    torch.testing.assert_close(mod(m), expected, rtol=1e-5, atol=1e-5)


def test_ending_node_and_column_attention_are_transposed_row_attention() -> None:
    from hfkit.model import MSAColumnAttention, TriangleAttentionEndingNode, TriangleAttentionStartingNode

    g = torch.Generator().manual_seed(2)
    z = torch.randn(5, 5, 6, generator=g)
    mask = (torch.rand(5, 5, generator=g) < 0.8).float()
    end = perturbed(TriangleAttentionEndingNode(6, 3, 2))
    start = TriangleAttentionStartingNode(6, 3, 2)
    start.load_state_dict(end.state_dict())
    torch.testing.assert_close(end(z, mask), start(z.transpose(0, 1), mask.T).transpose(0, 1))
    col = perturbed(MSAColumnAttention(6, 3, 2))
    m = torch.randn(4, 5, 6, generator=g)
    msa_mask = (torch.rand(4, 5, generator=g) < 0.8).float()
    expected = col._msa_att(m.transpose(0, 1), mask=msa_mask.T).transpose(0, 1)
    torch.testing.assert_close(col(m, msa_mask), expected)


def test_to_hfkit_keeps_keys_and_outputs() -> None:
    from hfkit.nn import to_hfkit

    model = tiny_model().eval()
    batch = random_batch(10)
    keys = list(model.state_dict())
    with torch.no_grad():
        expected = model(batch)["pair"]
        fused = to_hfkit(model, inplace=False)
        assert list(fused.state_dict()) == keys
        torch.testing.assert_close(fused(batch)["pair"], expected, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- losses and config


def test_pseudo_beta_uses_ca_for_glycine() -> None:
    positions = torch.arange(2 * 37 * 3, dtype=torch.float32).reshape(2, 37, 3)
    mask = torch.zeros(2, 37)
    mask[0, 1] = 1.0  # glycine: CA only
    mask[1, 3] = 1.0  # alanine: CB
    pb, pb_mask = pseudo_beta(torch.tensor([7, 0]), positions, mask)
    assert torch.equal(pb[0], positions[0, 1]) and torch.equal(pb[1], positions[1, 3])
    assert pb_mask.tolist() == [1.0, 1.0]


def test_distogram_loss_bins_and_mask() -> None:
    positions = torch.tensor([[0.0, 0.0, 0.0], [5.0, 0.0, 0.0], [0.0, 30.0, 0.0]])
    mask = torch.tensor([1.0, 1.0, 0.0])
    edges = torch.linspace(2.3125, 21.6875, 63)
    true_bin = int((edges < 5.0).sum())  # the bin of the 5 Å pair
    logits = torch.zeros(3, 3, 64)
    logits[0, 1, true_bin] = logits[1, 0, true_bin] = 50.0
    logits[0, 0, 0] = logits[1, 1, 0] = 50.0  # distance 0: first bin
    assert float(distogram_loss(logits, positions, mask)) < 1e-6
    assert float(distogram_loss(torch.zeros(3, 3, 64), positions, mask)) == pytest.approx(
        float(torch.tensor(64.0).log()), rel=1e-5
    )


def test_masked_msa_loss_is_mean_cross_entropy_at_masked_positions() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 23, generator=g)
    true_msa = torch.randint(0, 23, (4, 5), generator=g)
    bert = torch.rand(4, 5, generator=g) < 0.5
    expected = F.cross_entropy(logits[bert], true_msa[bert])
    torch.testing.assert_close(masked_msa_loss(logits, true_msa, bert.float()), expected)


def test_presets() -> None:
    initial, finetune = ModelConfig.af2_initial(), ModelConfig.af2_finetune()
    assert (initial.c_m, initial.c_z, initial.c_s, initial.no_blocks) == (256, 128, 384, 48)
    assert (initial.no_heads_msa, initial.no_heads_pair, initial.c_hidden_mul) == (8, 4, 128)
    assert initial.feature_config() == FeatureConfig.af2_initial()
    assert finetune.feature_config() == FeatureConfig.af2_finetune()
    assert TINY.feature_config() == FeatureConfig.tiny()
    # One AF2-sized block: about 1.8M parameters (48 of them: most of AlphaFold's 93M).
    block = EvoformerStack.from_config(initial.replace(no_blocks=1)).blocks[0]
    assert 1.5e6 < sum(p.numel() for p in block.parameters()) < 2.1e6
    with pytest.raises(ValueError, match="chunk_size"):
        ModelConfig(chunk_size=0)


def test_bad_inputs_name_the_argument() -> None:
    model = AlphaFoldLite(TINY)
    batch = random_batch(8)
    with pytest.raises(ValueError, match="missing features"):
        model({k: v for k, v in batch.items() if k != "msa_feat"})
    with pytest.raises(ValueError, match="msa_feat"):
        model({**batch, "msa_feat": batch["msa_feat"][..., :10]})


# ----------------------------------------------------------------------------- real data


def real_2q2k_sample() -> dict[str, torch.Tensor] | None:
    from hfkit.data import openfold_test_data_dir

    root = openfold_test_data_dir()
    if root is None or not (root / "mmcifs" / "2q2k.cif").is_file():
        return None
    from hfkit.data.features import make_raw_features
    from hfkit.data.mmcif import parse_mmcif
    from hfkit.data.msa_sampling import process_features
    from hfkit.data.parsers import read_msa

    structure = parse_mmcif(root / "mmcifs" / "2q2k.cif")
    chain = structure.chains["A"]
    alignments = root / "alignments" / "2q2k_A"
    msas = [read_msa(p) for p in sorted(alignments.iterdir())]
    raw = make_raw_features(chain.sequence, msas, chain, structure.resolution, "2q2k_A")
    config = FeatureConfig(crop_size=24, max_msa_clusters=8, max_extra_msa=8, spatial_crop_prob=0.0)
    return process_features(raw, config, seed=0)


def test_real_2q2k_training_lowers_loss() -> None:
    sample = real_2q2k_sample()
    if sample is None:
        pytest.skip("OpenFold test data (2q2k) not found; see hfkit.data.openfold_test_data_dir")
    torch.manual_seed(0)
    model = AlphaFoldLite(TINY)
    assert sample["all_atom_mask"].sum() > 0

    def eval_loss() -> float:
        model.eval()
        with torch.no_grad():
            return float(model.loss(sample, model(sample))[0])

    first = eval_loss()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(10):
        optimizer.zero_grad()
        total, _ = model.loss(sample, model(sample))
        total.backward()
        optimizer.step()
    last = eval_loss()
    assert last < first - 0.05, (first, last)


# ----------------------------------------------------------------------------- OpenFold checkpoints


def _openfold_v2_checkpoint(model: AlphaFoldLite, prefix: str) -> dict[str, torch.Tensor]:
    """`model`'s weights as OpenFold >= 2.0 saves them (v2 names, `prefix` before every key), plus
    parts of OpenFold's AlphaFold that hfkit does not have."""
    out = {}
    for key, value in model.state_dict().items():
        key = key.replace("core.msa_transition", "msa_transition")
        key = key.replace("core.outer_product_mean", "outer_product_mean")
        key = re.sub(r"core\.(tri_|pair_transition)", r"pair_stack.\1", key)
        out[prefix + key] = value.clone()
    for key in OPENFOLD_ONLY_KEYS:
        out[prefix + key] = torch.ones(3)
    return out


OPENFOLD_ONLY_KEYS = (
    "template_embedder.template_pointwise_att.mha.linear_q.weight",
    "structure_module.ipa.head_weights",
    "recycling_embedder.linear.weight",
    "aux_heads.plddt.linear_3.bias",
    "aux_heads.experimentally_resolved.linear.weight",
)


@pytest.mark.parametrize(
    ("wrap", "container"),
    [
        (lambda sd: sd, "plain"),
        (lambda sd: {"ema": {"params": sd, "decay": 0.999}, "optimizer_states": []}, "ema"),
        (lambda sd: {"state_dict": sd, "epoch": 1}, "state_dict"),
    ],
    ids=["plain", "ema", "lightning"],
)
@pytest.mark.parametrize("prefix", ["", "module.", "model.", "module.model."])
def test_load_openfold_state_dict_reports_loaded_and_ignored_keys(wrap, container: str, prefix: str) -> None:
    source = tiny_model(seed=1)
    target = tiny_model(seed=2)
    report = load_openfold_state_dict(target, wrap(_openfold_v2_checkpoint(source, prefix)))
    assert sorted(report.loaded) == sorted(source.state_dict())
    assert sorted(report.ignored) == sorted(OPENFOLD_ONLY_KEYS)
    assert report.missing == [] and report.unexpected == []
    assert report.renamed == sum(".core." in k for k in source.state_dict()) > 0
    assert report.container == container
    for key, value in target.state_dict().items():
        assert torch.equal(value, source.state_dict()[key]), key
    assert "loaded" in str(report) and "ignored 5 keys" in str(report)


def test_load_openfold_state_dict_strict_names_missing_and_unexpected_keys() -> None:
    source = tiny_model(seed=1)
    ckpt = _openfold_v2_checkpoint(source, "")
    del ckpt["evoformer.linear.weight"]
    ckpt["evoformer.blocks.0.msa_att_row.mha.linear_q.extra"] = torch.ones(1)
    target = tiny_model(seed=2)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=r"missing 1 keys \['evoformer.linear.weight'\].*unexpected 1"):
        load_openfold_state_dict(target, ckpt)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())  # nothing loaded
    report = load_openfold_state_dict(target, ckpt, strict=False)
    assert report.missing == ["evoformer.linear.weight"]
    assert report.unexpected == ["evoformer.blocks.0.msa_att_row.mha.linear_q.extra"]
    assert torch.equal(target.state_dict()["evoformer.linear.weight"], before["evoformer.linear.weight"])
    ckpt["evoformer.linear.weight"] = torch.ones(2, 2)
    with pytest.raises(ValueError, match="evoformer.linear.weight: expected"):
        load_openfold_state_dict(target, ckpt, strict=False)


def test_load_openfold_state_dict_into_a_part_with_prefix() -> None:
    source = tiny_model(seed=1)
    stack = EvoformerStack.from_config(TINY)
    ckpt = _openfold_v2_checkpoint(source, "module.")
    report = load_openfold_state_dict(stack, ckpt, prefix="evoformer.")
    assert sorted(report.loaded) == sorted(stack.state_dict())
    v1_keys = openfold_v2_to_v1_keys({k.removeprefix("module."): v for k, v in ckpt.items()})
    outside = [k for k in v1_keys if not k.startswith("evoformer.")]
    assert sorted(report.ignored) == sorted(outside) and len(outside) > len(OPENFOLD_ONLY_KEYS)
    for key, value in stack.state_dict().items():
        assert torch.equal(value, source.evoformer.state_dict()[key])


def test_mask_trans_option_has_openfold_meaning() -> None:
    """`_mask_trans=False` (OpenFold's AlphaFold config): transition updates at masked positions are
    not zeroed, except the extra-MSA blocks' MSA transition, which OpenFold always masks."""
    assert ModelConfig()._mask_trans is False and ModelConfig.af2_initial()._mask_trans is False
    for mask_trans in (False, True):
        model = tiny_model(seed=3, _mask_trans=mask_trans)
        for block in model.evoformer.blocks:
            assert block.core.mask_msa_transition is mask_trans
            assert block.core.mask_pair_transition is mask_trans
        for block in model.extra_msa_stack.blocks:
            assert block.core.mask_msa_transition is True
            assert block.core.mask_pair_transition is mask_trans
    core = tiny_model(seed=3, _mask_trans=False).evoformer.blocks[0].core.eval()
    g = torch.Generator().manual_seed(0)
    m, z = torch.randn(3, 5, TINY.c_m, generator=g), torch.randn(5, 5, TINY.c_z, generator=g)
    msa_mask, pair_mask = torch.ones(3, 5), torch.ones(5, 5)
    msa_mask[:, -1] = 0
    pair_mask[-1] = 0
    with torch.no_grad():
        unmasked = core.msa_transition(m) + 0
        m_out, _ = core(m, z, msa_mask, pair_mask)
        expected_m = m + unmasked
    torch.testing.assert_close(m_out, expected_m)
    assert unmasked[:, -1].abs().sum() > 0


def test_global_attention_eps_comes_from_the_config() -> None:
    assert ModelConfig().global_attention_eps == 1e-8  # OpenFold's config
    model = tiny_model(global_attention_eps=1e-3)
    for block in model.extra_msa_stack.blocks:
        assert block.msa_att_col.global_attention.eps == 1e-3
