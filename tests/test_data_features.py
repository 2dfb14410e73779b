"""Tests of raw features (features.py), training-time transforms (msa_sampling.py) and crops (crop.py).

Synthetic MSAs (random ids, built as aligned strings) check the invariants and compare clustering and
cluster profiles with dense, loop-based references written here from OpenFold's definitions; the real
2q2k chain A inputs (OpenFold's test data, four alignments and the mmCIF) check shapes and masks at
AlphaFold's training sizes.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from conftest import real_data

from hfkit.data.crop import choose_crop, crop_contiguous, crop_spatial
from hfkit.data.features import (
    RAW_FEATURE_DTYPES,
    deletion_dtype,
    hhblits_profile,
    make_msa_features,
    make_raw_features,
    make_sequence_features,
    make_structure_features,
)
from hfkit.data.msa_sampling import (
    FEATURE_SHAPES,
    STRUCTURE_FEATURES,
    FeatureConfig,
    assign_clusters,
    block_delete_rows,
    deletion_value,
    feature_shapes,
    mask_msa,
    process_features,
)
from hfkit.data.residue_constants import (
    GAP_ID,
    MASK_ID,
    MSA_NUM_CLASSES,
    RESTYPES,
    encode_msa,
    sequence_to_aatype,
)

MSA_FILES = ("bfd_uniclust_hits.a3m", "mgnify_hits.sto", "uniprot_hits.sto", "uniref90_hits.sto")
LETTERS = np.frombuffer(("".join(RESTYPES) + "X-").encode(), dtype=np.uint8)  # index = MSA id 0..21
PROFILE = slice(MSA_NUM_CLASSES + 2, 2 * MSA_NUM_CLASSES + 2)  # cluster_profile channels of msa_feat


@dataclass
class FakeMsa:
    """Stand-in for parsers.Msa: aligned rows, int deletion counts, descriptions."""

    sequences: list[str]
    deletion_matrix: np.ndarray
    descriptions: list[str] = field(default_factory=list)


@dataclass
class FakeChain:
    aatype: np.ndarray
    atom_positions: np.ndarray
    atom_mask: np.ndarray


def random_msa(rng: np.random.Generator, depth: int, length: int, alphabet: int = 22) -> FakeMsa:
    """`depth` random aligned rows (ids < alphabet, row 0 gap-free) with sparse integer deletions."""
    ids = rng.integers(0, alphabet, size=(depth, length))
    ids[0] = rng.integers(0, 20, size=length)
    rows = [r.tobytes().decode() for r in LETTERS[ids]]
    deletions = np.where(rng.random((depth, length)) < 0.1, rng.integers(1, 20, (depth, length)), 0)
    deletions[0] = 0
    return FakeMsa(rows, deletions.astype(np.int32), [f"row{i}" for i in range(depth)])


def random_chain(rng: np.random.Generator, sequence: str) -> FakeChain:
    length = len(sequence)
    positions = np.cumsum(rng.normal(0, 2.2, size=(length, 37, 3)), axis=0).astype(np.float32)
    mask = (rng.random((length, 37)) < 0.5).astype(np.float32)
    mask[:, 1] = rng.random(length) < 0.9  # most residues have a CA
    return FakeChain(sequence_to_aatype(sequence), positions, mask)


def synthetic_raw(seed: int, depth: int, length: int, structure: bool = True) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    msa = random_msa(rng, depth, length)
    query = msa.sequences[0]
    chain = random_chain(rng, query) if structure else None
    return make_raw_features(query, [msa], chain=chain, resolution=2.5, description="synthetic")


def real_raw() -> dict[str, np.ndarray]:
    from hfkit.data.mmcif import parse_mmcif
    from hfkit.data.parsers import read_msa

    structure = parse_mmcif(real_data("mmcifs", "2q2k.cif"))
    chain = structure.chains["A"]
    msas = [read_msa(real_data("alignments", "2q2k_A", name)) for name in MSA_FILES]
    return make_raw_features(chain.sequence, msas, chain, structure.resolution, "2q2k_A")


def agreement_reference(centres: np.ndarray, extra: np.ndarray) -> np.ndarray:
    """OpenFold's weighted Hamming agreement, by its definition: same id at a column, id < 21."""
    same = extra[:, None, :] == centres[None, :, :]
    return (same & (centres[None, :, :] < GAP_ID)).sum(-1)


# ----------------------------------------------------------------------------- raw features


def test_sequence_features() -> None:
    f = make_sequence_features("ACDXB", "chain 1")
    np.testing.assert_array_equal(f["aatype"], [0, 4, 3, 20, 20])
    np.testing.assert_array_equal(f["residue_index"], np.arange(5))
    np.testing.assert_array_equal(f["between_segment_residues"], 0)
    assert int(f["seq_length"]) == 5 and str(f["domain_name"]) == "chain 1"
    for key in ("aatype", "between_segment_residues", "residue_index", "seq_length"):
        assert f[key].dtype == RAW_FEATURE_DTYPES[key]
    with pytest.raises(ValueError, match="sequence"):
        make_sequence_features("")


def test_msa_features_deduplicate_across_sources_keeping_first() -> None:
    a = FakeMsa(["ACD-", "AC-E", "AC-E", "GGGG"], np.array([[0] * 4, [0, 1, 0, 0], [0, 2, 0, 0], [0] * 4]))
    b = FakeMsa(["ACD-", "GGGG", "ACDE", "AC-E"], np.array([[0] * 4, [0] * 4, [3, 0, 0, 0], [0] * 4]))
    f = make_msa_features([a, b])
    expected_rows = ["ACD-", "AC-E", "GGGG", "ACDE"]
    assert int(f["num_alignments"]) == 4
    assert f["msa"].dtype == np.int8 and f["deletion_matrix"].dtype == np.uint8
    np.testing.assert_array_equal(f["msa"], encode_msa(expected_rows))
    # The first occurrence's deletions are kept (row "AC-E" of source a, not its later duplicates).
    np.testing.assert_array_equal(f["deletion_matrix"], [[0] * 4, [0, 1, 0, 0], [0] * 4, [3, 0, 0, 0]])
    np.testing.assert_allclose(f["hhblits_profile"].sum(-1), 1.0, rtol=1e-6)


def test_msa_features_errors_name_the_alignment() -> None:
    good = FakeMsa(["ACD"], np.zeros((1, 3), np.int32))
    with pytest.raises(ValueError, match="at least one"):
        make_msa_features([])
    with pytest.raises(ValueError, match=r"msas\[1\]: must contain"):
        make_msa_features([good, FakeMsa([], np.zeros((0, 3)))])
    with pytest.raises(ValueError, match=r"msas\[1\]\.deletion_matrix"):
        make_msa_features([good, FakeMsa(["ACDE"], np.zeros((1, 4)))])
    with pytest.raises(ValueError, match="length"):
        make_raw_features("ACDE", [good])
    with pytest.raises(ValueError, match=r"msas\[0\]: query row differs .* residue 1"):
        make_raw_features("AGD", [good])


def test_hhblits_profile_is_mean_one_hot() -> None:
    rng = np.random.default_rng(0)
    msa = rng.integers(0, 22, size=(37, 11)).astype(np.int8)
    expected = np.eye(22)[msa].mean(0)
    np.testing.assert_allclose(hhblits_profile(msa), expected, rtol=1e-6)


def assert_raw_dtypes(raw: dict[str, np.ndarray]) -> None:
    """`RAW_FEATURE_DTYPES`, with uint16 deletion counts where one exceeds 255."""
    for key, dtype in RAW_FEATURE_DTYPES.items():
        if key == "deletion_matrix" and raw[key].max(initial=0) > 255:
            dtype = np.dtype(np.uint16)
        assert raw[key].dtype == dtype, key


def test_raw_features_dtypes_and_query_only() -> None:
    raw = synthetic_raw(1, depth=9, length=13)
    assert_raw_dtypes(raw)
    alone = make_raw_features("ACDEF", [])
    assert alone["msa"].shape == (1, 5) and int(alone["num_alignments"]) == 1
    rng = np.random.default_rng(2)
    chain = random_chain(rng, "ACDEF")
    s = make_structure_features(chain, 1.5)
    assert s["all_atom_positions"].shape == (5, 37, 3) and float(s["resolution"]) == 1.5
    with pytest.raises(ValueError, match="chain"):
        make_raw_features("ACDEFG", [FakeMsa(["ACDEFG"], np.zeros((1, 6)))], chain=chain)


# ----------------------------------------------------------------------------- transforms


def test_presets_and_validation() -> None:
    assert (FeatureConfig.af2_initial().crop_size, FeatureConfig.af2_initial().max_msa_clusters) == (256, 128)
    assert FeatureConfig.af2_initial().max_extra_msa == 1024
    fine = FeatureConfig.af2_finetune()
    assert (fine.crop_size, fine.max_msa_clusters, fine.max_extra_msa) == (384, 512, 5120)
    assert FeatureConfig.tiny().crop_size < 64
    assert math.isclose(FeatureConfig().masked_msa_mask_prob, 0.7)
    with pytest.raises(ValueError, match="masked_msa_replace_fraction"):
        FeatureConfig(masked_msa_replace_fraction=1.5)
    with pytest.raises(ValueError, match="uniform"):
        FeatureConfig(masked_msa_uniform_prob=0.5, masked_msa_profile_prob=0.4, masked_msa_same_prob=0.2)
    with pytest.raises(ValueError, match="crop_size"):
        FeatureConfig(crop_size=0)


def test_deletion_value() -> None:
    d = torch.tensor([0.0, 1.0, 3.0, 10.0, 1e6])
    expected = torch.tensor([2 / math.pi * math.atan(x / 3) for x in d.tolist()])
    torch.testing.assert_close(deletion_value(d), expected)
    assert deletion_value(torch.tensor(3.0)).item() == pytest.approx(0.5)


def check_sample(
    out: dict[str, torch.Tensor], config: FeatureConfig, res: int, clust: int, extra: int
) -> None:
    """Shapes against the schema and the invariants every sample obeys (`res` real residues etc.)."""
    shapes = feature_shapes(config, num_res=out["aatype"].shape[0])
    for key, value in out.items():
        assert tuple(value.shape) == shapes[key], key
    assert set(out) == set(FEATURE_SHAPES) - (set() if "all_atom_positions" in out else STRUCTURE_FEATURES)
    assert int(out["seq_length"]) == res and out["seq_mask"].sum() == res
    assert torch.equal(out["seq_mask"][:res], torch.ones(res)) and out["seq_mask"][res:].sum() == 0

    real = torch.zeros_like(out["msa_mask"])
    real[:clust, :res] = 1
    assert torch.equal(out["msa_mask"], real)
    feat = out["msa_feat"]
    torch.testing.assert_close(feat[..., :MSA_NUM_CLASSES].sum(-1), real)  # one-hot: 1 real, 0 padding
    torch.testing.assert_close(feat[..., PROFILE].sum(-1), real)  # cluster profile sums to 1
    assert feat[real == 0].abs().sum() == 0  # padding is zero in all 49 channels
    assert ((feat >= 0) & (feat <= 1)).all()
    real_res = out["seq_mask"]
    torch.testing.assert_close(out["target_feat"][:, 1:].sum(-1), real_res)
    assert out["target_feat"][:, 0].sum() == 0

    extra_real = torch.zeros_like(out["extra_msa_mask"])
    extra_real[:extra, :res] = 1
    assert torch.equal(out["extra_msa_mask"], extra_real)
    for key in ("extra_msa", "extra_has_deletion", "extra_deletion_value"):
        assert out[key][extra_real == 0].abs().sum() == 0, key
    assert (out["extra_msa"] < MASK_ID).all()  # the extra MSA is never masked

    # BERT: unmasked real positions keep their residue; masked ones are recorded in bert_mask.
    centre = feat[..., :MSA_NUM_CLASSES].argmax(-1)
    keep = (out["bert_mask"] == 0) & (real == 1)
    assert torch.equal(centre[keep], out["true_msa"][keep])
    assert out["bert_mask"][real == 0].sum() == 0 and out["true_msa"][real == 0].sum() == 0
    assert (out["true_msa"] < MASK_ID).all()


@pytest.mark.parametrize(
    ("length", "depth", "config"),
    [
        (20, 5, FeatureConfig.tiny()),  # L < crop, depth < clusters: no extra MSA
        (20, 30, FeatureConfig.tiny()),  # depth between clusters and clusters + extra
        (50, 100, FeatureConfig.tiny()),  # L > crop, depth > clusters + extra
        (50, 100, FeatureConfig(crop_size=32, max_msa_clusters=8, max_extra_msa=16, cluster_all_extra=False)),
        (40, 1, FeatureConfig.tiny()),  # the query alone
        (40, 60, FeatureConfig(crop_size=24, max_msa_clusters=8, max_extra_msa=0)),
    ],
)
def test_process_features_invariants(length: int, depth: int, config: FeatureConfig) -> None:
    # The whole MSA is sampled (block deletion, which changes the depth, is tested on its own).
    config = dataclasses.replace(config, block_delete_msa=False)
    raw = synthetic_raw(length * 1000 + depth, depth, length)
    for seed in range(4):
        out = process_features(raw, config, seed)
        res = min(length, config.crop_size)
        clust = min(depth, config.max_msa_clusters)
        check_sample(out, config, res, clust, min(max(depth - clust, 0), config.max_extra_msa))
        # The query is row 0 of the sampled MSA; rows come from the raw MSA (cropped columns).
        cols = out["residue_index"][:res]
        msa = torch.from_numpy(raw["msa"]).long()[:, cols]
        assert torch.equal(out["true_msa"][0, :res], msa[0])
        assert torch.equal(out["aatype"][:res], torch.from_numpy(raw["aatype"]).long()[cols])
        # Sampled rows are distinct rows of the raw MSA (whose rows are unique after deduplication).
        n_extra = min(max(depth - clust, 0), config.max_extra_msa)
        rows = {tuple(r) for r in torch.from_numpy(raw["msa"]).long().tolist()}
        assert len(rows) == depth
        sampled = out["true_msa"][:clust, :res].tolist() + out["extra_msa"][:n_extra, :res].tolist()
        if res == length:
            assert all(tuple(r) in rows for r in sampled) and len({tuple(r) for r in sampled}) == len(sampled)
        positions = torch.from_numpy(raw["all_atom_positions"])[cols]
        assert torch.equal(out["all_atom_positions"][:res], positions)
        assert out["all_atom_positions"][res:].abs().sum() == 0 and out["all_atom_mask"][res:].sum() == 0


def test_eval_mode_keeps_whole_chain() -> None:
    config = FeatureConfig.tiny()
    raw = synthetic_raw(5, depth=40, length=50)
    out = process_features(raw, config, seed=0, train=False)
    check_sample(out, config, 50, 8, 16)
    assert torch.equal(out["residue_index"], torch.arange(50))
    shapes = feature_shapes(config, num_res=50)
    assert all(tuple(out[k].shape) == shapes[k] for k in out)


def test_determinism_and_seed_dependence() -> None:
    config = FeatureConfig.tiny()
    raw = synthetic_raw(7, depth=60, length=50)
    a, b = process_features(raw, config, 123), process_features(raw, config, 123)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = process_features(raw, config, 124)
    assert not torch.equal(a["true_msa"], c["true_msa"])  # different rows sampled (60 > 8 clusters)
    # The global RNG is neither used nor disturbed.
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    process_features(raw, config, 5)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_precomputed_profile_matches_computed() -> None:
    config = FeatureConfig.tiny()
    raw = synthetic_raw(8, depth=40, length=45)
    without = {k: v for k, v in raw.items() if k != "hhblits_profile"}
    for seed in range(3):
        a, b = process_features(raw, config, seed), process_features(without, config, seed)
        for key in a:
            torch.testing.assert_close(a[key], b[key], msg=key)


def test_read_only_inputs_warn_nothing() -> None:
    raw = synthetic_raw(9, depth=12, length=20)
    for value in raw.values():
        value.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        process_features(raw, FeatureConfig.tiny(), 0)


# ----------------------------------------------------------------------------- clustering


@pytest.mark.parametrize("alphabet", [3, 23])
def test_assign_clusters_is_nearest_centre(alphabet: int) -> None:
    """Small alphabets make many ties: the lowest-index centre must win them, as argmax does."""
    rng = np.random.default_rng(alphabet)
    # Up to L ~ 4000 two centres share a float32 lane of the agreement table; past it, one does.
    for num_centres, num_extra, length in [(1, 5, 7), (7, 50, 13), (33, 200, 40), (5, 9, 4100)]:
        centres = rng.integers(0, alphabet, size=(num_centres, length))
        extra = rng.integers(0, min(alphabet, 22), size=(num_extra, length))  # never the mask token
        got = assign_clusters(torch.from_numpy(centres), torch.from_numpy(extra))
        agreement = agreement_reference(centres, extra)
        expected = [int(np.flatnonzero(row == row.max())[0]) for row in agreement]
        assert got.tolist() == expected
    assert (
        assign_clusters(torch.zeros(3, 4, dtype=torch.int64), torch.zeros(0, 4, dtype=torch.int64)).numel()
        == 0
    )


@pytest.mark.parametrize("cluster_all_extra", [True, False])
def test_cluster_profile_and_deletion_mean_match_reference(cluster_all_extra: bool) -> None:
    """Rebuild summarize_clusters from the sample itself: centres (masked), extra rows, raw deletions."""
    config = FeatureConfig(
        crop_size=32, max_msa_clusters=6, max_extra_msa=40, cluster_all_extra=cluster_all_extra
    )
    raw = synthetic_raw(11, depth=30, length=25)  # all 24 extra rows are kept: both settings agree
    msa, deletions = raw["msa"].astype(np.int64), raw["deletion_matrix"]
    row_of = {tuple(r): i for i, r in enumerate(msa.tolist())}
    for seed in range(3):
        out = process_features(raw, config, seed, train=False)
        n_extra = 24
        feat = out["msa_feat"][:6].numpy()
        centres = feat[..., :MSA_NUM_CLASSES].argmax(-1)
        extra = out["extra_msa"][:n_extra].numpy()
        centre_rows = [row_of[tuple(r)] for r in out["true_msa"][:6].tolist()]
        extra_rows = [row_of[tuple(r)] for r in extra.tolist()]
        assert sorted(centre_rows + extra_rows) == list(range(30)) and centre_rows[0] == 0
        agreement = agreement_reference(centres, extra)
        assignment = [int(np.flatnonzero(row == row.max())[0]) for row in agreement]
        for c in range(6):
            members = [e for e, a in enumerate(assignment) if a == c]
            counts = np.eye(MSA_NUM_CLASSES)[centres[c]] + np.eye(MSA_NUM_CLASSES)[extra[members]].sum(0)
            np.testing.assert_allclose(feat[c, :, PROFILE], counts / (1 + len(members)), rtol=1e-6, atol=1e-6)
            mean = (deletions[centre_rows[c]] + deletions[[extra_rows[e] for e in members]].sum(0)) / (
                1 + len(members)
            )
            np.testing.assert_allclose(feat[c, :, -1], 2 / np.pi * np.arctan(mean / 3), rtol=1e-5, atol=1e-6)
            d = deletions[centre_rows[c]]
            np.testing.assert_allclose(feat[c, :, MSA_NUM_CLASSES], np.clip(d, 0, 1))
            np.testing.assert_allclose(
                feat[c, :, MSA_NUM_CLASSES + 1], 2 / np.pi * np.arctan(d / 3), rtol=1e-5
            )
        d = deletions[extra_rows]
        np.testing.assert_allclose(out["extra_has_deletion"][:n_extra].numpy(), np.clip(d, 0, 1))
        np.testing.assert_allclose(
            out["extra_deletion_value"][:n_extra].numpy(), 2 / np.pi * np.arctan(d / 3), rtol=1e-5, atol=1e-7
        )


def test_cluster_all_extra_uses_rows_beyond_the_kept_ones() -> None:
    config = FeatureConfig(crop_size=32, max_msa_clusters=4, max_extra_msa=4)
    raw = synthetic_raw(12, depth=200, length=20)
    capped = FeatureConfig(crop_size=32, max_msa_clusters=4, max_extra_msa=4, cluster_all_extra=False)
    a, b = process_features(raw, config, 0), process_features(raw, capped, 0)
    assert torch.equal(a["true_msa"], b["true_msa"]) and torch.equal(a["extra_msa"], b["extra_msa"])
    assert not torch.equal(a["msa_feat"][..., PROFILE], b["msa_feat"][..., PROFILE])


def assert_samples_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: object) -> None:
    """Same keys, dtypes and bits (floats compared as raw bytes, so -0.0 != 0.0 and NaN == NaN)."""
    assert a.keys() == b.keys(), what
    for key in a:
        x, y = a[key], b[key]
        assert x.dtype == y.dtype and x.shape == y.shape, (what, key)
        if x.dtype.is_floating_point:
            x, y = x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)
        assert torch.equal(x, y), (what, key)


def test_column_gather_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spatial crops gathered run by run, by numpy's column take, or windows: the same samples."""
    from hfkit.data import msa_sampling

    raw = synthetic_raw(21, depth=300, length=90)
    config = FeatureConfig(crop_size=48, max_msa_clusters=16, max_extra_msa=64, spatial_crop_prob=1.0)
    positions, mask = torch.from_numpy(raw["all_atom_positions"]), torch.from_numpy(raw["all_atom_mask"])
    runs = [
        msa_sampling._column_runs(choose_crop(90, 48, torch.Generator().manual_seed(s), 1.0, positions, mask))
        for s in range(4)
    ]
    assert max(len(r) for r in runs) > 1  # the crops are not all one window
    expected = [process_features(raw, config, seed) for seed in range(4)]
    for max_runs in (0, 1, 1000):
        monkeypatch.setattr(msa_sampling, "_MAX_RUNS", max_runs)
        for seed in range(4):
            assert_samples_equal(process_features(raw, config, seed), expected[seed], (max_runs, seed))


@pytest.mark.parametrize("cluster_all_extra", [True, False])
def test_deletion_dtype_does_not_change_samples(cluster_all_extra: bool) -> None:
    """uint8, uint16 and float32 copies of the same deletion counts (exact integer sums whatever the
    order) give bitwise equal samples."""
    raw = dict(synthetic_raw(22, depth=700, length=30))
    assert raw["deletion_matrix"].dtype == np.uint8 == deletion_dtype(raw["deletion_matrix"])
    assert deletion_dtype(np.array([[0, 256]])) == np.uint16
    config = FeatureConfig(
        crop_size=24, max_msa_clusters=2, max_extra_msa=16, cluster_all_extra=cluster_all_extra
    )
    for dtype in (np.uint16, np.float32):
        other = dict(raw, deletion_matrix=raw["deletion_matrix"].astype(dtype))
        for seed in range(3):
            assert_samples_equal(
                process_features(raw, config, seed), process_features(other, config, seed), (dtype, seed)
            )


def test_msa_dtype_does_not_change_samples() -> None:
    """int8 ids (the raw schema) or wider ones, through window, run-by-run and numpy column gathers."""
    raw = synthetic_raw(25, depth=300, length=90)
    config = FeatureConfig(crop_size=48, max_msa_clusters=16, max_extra_msa=64, spatial_crop_prob=0.5)
    for dtype in (np.int64, np.uint8):
        other = dict(raw, msa=raw["msa"].astype(dtype))
        for seed in range(4):
            assert_samples_equal(
                process_features(raw, config, seed), process_features(other, config, seed), (dtype, seed)
            )


def test_deletion_sums_past_float_precision_keep_row_order() -> None:
    """Sums past 2**24 round in float32 by summation order: they must be those of the raw row order."""
    from hfkit.data.msa_sampling import _deletion_sums

    rng = np.random.default_rng(0)
    num_seq, num_res, num_clust = 800, 12, 2
    deletions = torch.from_numpy(rng.integers(40001, 65536, (num_seq, num_res)).astype(np.uint16))
    vote_rows = torch.from_numpy(rng.permutation(num_seq))  # gathered order differs from row order
    assignment = torch.from_numpy(rng.integers(0, num_clust, num_seq))
    cols = torch.arange(3, 11)
    vote_del = deletions.float()[vote_rows][:, cols]
    got = _deletion_sums(deletions, vote_del, vote_rows, assignment, num_clust, cols)
    target = torch.empty(num_seq, dtype=torch.int64)
    target[vote_rows] = assignment
    row_order = torch.zeros(num_clust, num_res).index_add_(0, target, deletions.float())[:, cols]
    gathered_order = torch.zeros(num_clust, len(cols)).index_add_(0, assignment, vote_del)
    assert float(row_order.max()) > 2**24 and not torch.equal(gathered_order, row_order)  # order matters
    assert torch.equal(got, row_order)


@pytest.mark.parametrize("crop", ["window", "few_runs", "many_runs"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.float32])
def test_row_order_deletion_sums_match_one_index_add(crop: str, dtype: torch.dtype) -> None:
    """Block-streamed deletion sums equal, bit for bit, one index_add_ of the cropped float32 matrix."""
    from hfkit.data import msa_sampling
    from hfkit.data.msa_sampling import _column_runs, _row_order_deletion_sums

    rng = np.random.default_rng(1)
    num_seq, num_res, num_clust = 1300, 40, 2  # more rows than a block: sums carry across blocks
    if dtype == torch.float32:  # fractional values: float32 rounding depends on the order
        values = rng.random((num_seq, num_res)).astype(np.float32) * 1e6
    elif dtype == torch.uint16:  # sums past 2**24: float32 rounding depends on the order
        values = rng.integers(40001, 65536, (num_seq, num_res)).astype(np.uint16)
    else:
        values = rng.integers(0, 256, (num_seq, num_res)).astype(np.uint8)
    deletions = torch.from_numpy(values)
    cols = {
        "window": torch.arange(5, 37),
        "few_runs": torch.tensor([0, 1, 2, 7, 8, 20, 21, 22, 23, 39]),
        "many_runs": torch.arange(0, num_res, 2),
    }[crop]
    cluster = torch.from_numpy(rng.integers(0, num_clust, num_seq))
    want = torch.zeros(num_clust, cols.numel()).index_add_(0, cluster, deletions.float()[:, cols])
    got = _row_order_deletion_sums(deletions, cluster, num_clust, cols, _column_runs(cols))
    assert num_seq > msa_sampling._DELETION_BLOCK_ROWS
    assert got.dtype == torch.float32 and torch.equal(got, want)
    if dtype != torch.uint8:  # the order matters for these: a different one gives other sums
        shuffled = torch.from_numpy(rng.permutation(num_seq))
        other = torch.zeros(num_clust, cols.numel()).index_add_(
            0, cluster[shuffled], deletions.float()[shuffled][:, cols]
        )
        assert not torch.equal(other, want)


def test_deep_msa_samples_match_unblocked_deletion_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """Samples of an MSA deeper than a deletion block do not depend on the block size."""
    from hfkit.data import msa_sampling

    rng = np.random.default_rng(3)
    num_seq, num_res = 700, 48
    raw = {
        "aatype": rng.integers(0, 21, num_res).astype(np.int8),
        "msa": rng.integers(0, 22, (num_seq, num_res)).astype(np.int8),
        "deletion_matrix": (
            rng.integers(0, 3, (num_seq, num_res)) * (rng.random((num_seq, num_res)) < 0.1)
        ).astype(np.uint8),
    }
    config = FeatureConfig(crop_size=32, max_msa_clusters=8, max_extra_msa=64)
    small = {seed: process_features(raw, config, seed) for seed in range(3)}
    monkeypatch.setattr(msa_sampling, "_DELETION_BLOCK_ROWS", 10**9)
    for seed in range(3):
        assert_samples_equal(small[seed], process_features(raw, config, seed), seed)


def test_samples_do_not_alias_reused_buffers() -> None:
    """Intermediates live in per-thread buffers reused across calls; no output may share them."""
    config = FeatureConfig.tiny()
    first = process_features(synthetic_raw(23, depth=200, length=60), config, 0)
    saved = {k: v.clone() for k, v in first.items()}
    process_features(synthetic_raw(24, depth=300, length=70), config, 1)
    process_features(synthetic_raw(23, depth=200, length=60), config, 2, train=False)
    assert_samples_equal(first, saved, "after later calls")


# ----------------------------------------------------------------------------- masked MSA


def test_mask_msa_probabilities() -> None:
    g = torch.Generator().manual_seed(0)
    msa = torch.randint(0, 22, (200, 300), generator=g)
    profile = torch.full((300, 22), 1 / 22)
    base = {"masked_msa_uniform_prob": 0.0, "masked_msa_profile_prob": 0.0, "masked_msa_same_prob": 0.0}

    out, bert = mask_msa(msa, profile, FeatureConfig(), g)
    assert abs(bert.float().mean().item() - 0.15) < 0.01
    assert torch.equal(out[~bert], msa[~bert])
    new = out[bert]
    assert abs((new == MASK_ID).float().mean().item() - 0.7) < 0.02  # 1 - 0.1 - 0.1 - 0.1

    all_mask = FeatureConfig(**base, masked_msa_replace_fraction=1.0)
    out, bert = mask_msa(msa, profile, all_mask, g)
    assert bert.all() and (out == MASK_ID).all()
    same = FeatureConfig(**{**base, "masked_msa_same_prob": 1.0}, masked_msa_replace_fraction=1.0)
    assert torch.equal(mask_msa(msa, profile, same, g)[0], msa)
    uniform = FeatureConfig(**{**base, "masked_msa_uniform_prob": 1.0}, masked_msa_replace_fraction=1.0)
    out = mask_msa(msa, profile, uniform, g)[0]
    assert out.max() < 20 and len(out.unique()) == 20
    peaked = torch.zeros(300, 22)
    peaked[:, 7] = 1.0
    by_profile = FeatureConfig(**{**base, "masked_msa_profile_prob": 1.0}, masked_msa_replace_fraction=1.0)
    assert (mask_msa(msa, peaked, by_profile, g)[0] == 7).all()


def mask_msa_reference(
    msa: torch.Tensor, profile: torch.Tensor, config: FeatureConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row: one [23] probability vector per replaced position, the first class whose CDF
    exceeds u counted by comparison (the formula `mask_msa` computes per column, by searchsorted)."""
    msa = msa.long()
    bert_mask = torch.rand(msa.shape, generator=generator) < config.masked_msa_replace_fraction
    rows, cols = bert_mask.nonzero().unbind(1)
    corrupted = msa.clone()
    if rows.numel() == 0:
        return corrupted, bert_mask
    probs = torch.zeros(rows.numel(), MSA_NUM_CLASSES)
    probs[:, :20] = config.masked_msa_uniform_prob / 20
    probs[:, :22] += config.masked_msa_profile_prob * profile[cols].float()
    probs[torch.arange(rows.numel()), msa[rows, cols]] += config.masked_msa_same_prob
    probs[:, MASK_ID] = config.masked_msa_mask_prob
    cdf = probs.cumsum(dim=1)
    u = torch.rand((rows.numel(), 1), generator=generator) * cdf[:, -1:]
    corrupted[rows, cols] = (cdf <= u).sum(dim=1).clamp(max=MSA_NUM_CLASSES - 1)
    return corrupted, bert_mask


def test_mask_msa_matches_row_by_row_reference() -> None:
    """Bitwise the same draws as the row-by-row formula, for odd sizes and several probabilities."""
    g = torch.Generator().manual_seed(3)
    for num_seq, num_res, probs in [
        (1, 1, (0.1, 0.1, 0.1)),
        (7, 33, (0.3, 0.5, 0.2)),
        (129, 61, (0.1, 0.1, 0.1)),
    ]:
        msa = torch.randint(0, 22, (num_seq, num_res), generator=g).to(torch.int8)
        profile = torch.rand(num_res, 22, generator=g)
        profile /= profile.sum(-1, keepdim=True)
        config = FeatureConfig(
            masked_msa_uniform_prob=probs[0],
            masked_msa_profile_prob=probs[1],
            masked_msa_same_prob=probs[2],
            masked_msa_replace_fraction=0.4,
        )
        for seed in range(3):
            got = mask_msa(msa, profile, config, torch.Generator().manual_seed(seed))
            expected = mask_msa_reference(msa, profile, config, torch.Generator().manual_seed(seed))
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (
                num_seq,
                num_res,
                seed,
            )


# ----------------------------------------------------------------------------- crops


def test_crop_contiguous() -> None:
    g = torch.Generator().manual_seed(0)
    starts = set()
    for _ in range(200):
        idx = crop_contiguous(50, 20, g, uniform_start=True)
        assert idx.numel() == 20 and torch.equal(idx, torch.arange(int(idx[0]), int(idx[0]) + 20))
        starts.add(int(idx[0]))
    assert starts == set(range(31))  # every window start in [0, 50 - 20] occurs
    assert torch.equal(crop_contiguous(10, 20, g), torch.arange(10))


def test_crop_spatial_takes_nearest_residues() -> None:
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ca = torch.from_numpy(np.cumsum(rng.normal(0, 2.2, size=(60, 3)), axis=0)).float()
        has_ca = torch.from_numpy(rng.random(60) < 0.8)
        idx = crop_spatial(ca, has_ca.float(), 25, g)
        assert idx.numel() == 25 and torch.equal(idx, idx.sort().values) and has_ca[idx].all()
        dist = torch.cdist(ca, ca)
        outside = torch.ones(60, dtype=torch.bool)
        outside[idx] = False
        outside &= has_ca
        # Some chosen residue (the target) is at least as near to every chosen one as to any other.
        assert any(dist[t, idx].max() <= dist[t, outside].min() for t in idx.tolist())
    positions = torch.zeros(30, 37, 3)
    positions[:, 1, 0] = torch.arange(30.0) * 3.8  # a straight line: crops are windows
    mask = torch.zeros(30, 37)
    mask[:, 1] = 1
    idx = crop_spatial(positions, mask, 10, g)
    assert torch.equal(idx, torch.arange(int(idx[0]), int(idx[0]) + 10))
    assert torch.equal(
        crop_spatial(positions, torch.zeros(30, 37), 10, g).diff(), torch.ones(9, dtype=torch.int64)
    )


def test_crop_spatial_prefers_interface() -> None:
    g = torch.Generator().manual_seed(0)
    ca = torch.zeros(40, 3)
    ca[:20, 0] = torch.arange(20.0) * 3.8  # chain 0 along x, chain 1 parallel far away but for its end
    ca[20:, 0] = torch.arange(20.0) * 3.8
    ca[20:, 1] = 50.0
    ca[39] = ca[0] + torch.tensor([0.0, 5.0, 0.0])  # chain 1's last residue touches chain 0's first
    chain = torch.tensor([0] * 20 + [1] * 20)
    for _ in range(10):
        idx = crop_spatial(ca, torch.ones(40), 6, g, chain_index=chain, interface_threshold=8.0)
        assert 0 in idx.tolist() or 39 in idx.tolist()


def test_choose_crop_probability() -> None:
    g = torch.Generator().manual_seed(0)
    positions = torch.zeros(50, 37, 3)
    positions[:, 1] = torch.randn(50, 3, generator=g) * 10
    mask = torch.ones(50, 37)
    spatial = [choose_crop(50, 20, g, 1.0, positions, mask) for _ in range(20)]
    assert any(int(s[-1] - s[0]) != 19 for s in spatial)  # random blobs are rarely windows
    windows = [choose_crop(50, 20, g, 0.0, positions, mask) for _ in range(20)]
    assert all(int(w[-1] - w[0]) == 19 for w in windows)
    assert all(int(w[-1] - w[0]) == 19 for w in (choose_crop(50, 20, g, 1.0) for _ in range(5)))


# ----------------------------------------------------------------------------- real data (2q2k A)


def test_real_2q2k_raw_features() -> None:
    from hfkit.data.parsers import read_msa

    raw = real_raw()
    msas = [read_msa(real_data("alignments", "2q2k_A", name)) for name in MSA_FILES]
    unique = list(dict.fromkeys(s for m in msas for s in m.sequences))
    assert raw["msa"].shape == (len(unique), 70) and int(raw["num_alignments"]) == len(unique)
    assert len(unique) < sum(len(m.sequences) for m in msas)  # the query, at least, repeats
    np.testing.assert_array_equal(raw["msa"][0], raw["aatype"])
    assert raw["all_atom_positions"].shape == (70, 37, 3) and float(raw["resolution"]) == pytest.approx(3.0)
    assert_raw_dtypes(raw)


def test_real_2q2k_af2_initial_shapes_and_masks() -> None:
    raw = real_raw()
    config = FeatureConfig.af2_initial()
    for seed in range(3):
        out = process_features(raw, config, seed)
        assert out["msa_feat"].shape == (128, 256, 49)
        assert out["extra_msa"].shape == (1024, 256)
        assert out["target_feat"].shape == (256, 22)
        # 70 residues are not cropped (nothing drawn), so block deletion makes the first draws.
        depth = block_delete_rows(
            int(raw["num_alignments"]), config, torch.Generator().manual_seed(seed)
        ).numel()
        check_sample(out, config, res=70, clust=min(depth, 128), extra=max(depth - 128, 0))
        assert out["seq_mask"].sum() == 70 and out["msa_mask"][depth:].sum() == 0
        assert torch.equal(out["residue_index"][:70], torch.arange(70))
        assert torch.equal(out["all_atom_mask"][:70], torch.from_numpy(raw["all_atom_mask"]))


def test_real_2q2k_clusters_when_deeper_than_clusters() -> None:
    """Few clusters so that 2q2k's MSA (~40 rows) has an extra MSA; spatial crops on its structure."""
    raw = real_raw()
    depth = int(raw["num_alignments"])
    has_ca = torch.from_numpy(raw["all_atom_mask"][:, 1]) > 0  # 45 of 70 residues are resolved
    config = FeatureConfig(
        crop_size=30, max_msa_clusters=8, max_extra_msa=16, spatial_crop_prob=1.0, block_delete_msa=False
    )
    crops = set()
    for seed in range(8):
        out = process_features(raw, config, seed)
        check_sample(out, config, res=30, clust=8, extra=min(depth - 8, 16))
        cols = out["residue_index"][:30]
        assert has_ca[cols].all()  # a spatial crop takes residues with a CA first
        crops.add(tuple(cols.tolist()))
    assert len(crops) > 1
