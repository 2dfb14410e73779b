"""The data pipeline against OpenFold's: each place hfkit's data used to differ from OpenFold's
`initial_training` pipeline (issue 17) has a test here.

Where OpenFold's function runs on CPU without its heavy dependencies, the test calls it: OpenFold's
package imports `ml_collections`, `dm-tree` and Biopython, which this environment lacks, so the
functions are compiled from their unchanged source text in `../shared/peers/openfold` (read, never
copied) with the few names they use supplied; the tests skip with a reason where that folder is
absent. The arginine renaming lives in OpenFold's Biopython-based `get_atom_coords`, so it is
tested on a written-out mmCIF instead.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import OPENFOLD_TEST_DATA
from mmcif_cases import ATOM_SITE_COLUMNS, atom_site_loop

import hfkit.data
from hfkit.data.crop import choose_crop, crop_contiguous
from hfkit.data.mmcif import parse_mmcif
from hfkit.data.msa_sampling import (
    FeatureConfig,
    block_delete_rows,
    process_features,
    process_features_recycling,
)
from hfkit.data.parsers import ParseError
from hfkit.data.residue_constants import ATOM_ORDER

CD, NH1, NH2 = ATOM_ORDER["CD"], ATOM_ORDER["NH1"], ATOM_ORDER["NH2"]


def _peers_dir() -> Path | None:
    """OpenFold's source (`shared/peers`): `HFKIT_OPENFOLD_PEERS`, beside the repository, or beside
    the OpenFold test data (`shared/data/openfold_test_data`)."""
    candidates = [Path(os.environ["HFKIT_OPENFOLD_PEERS"])] if "HFKIT_OPENFOLD_PEERS" in os.environ else []
    candidates.append(Path(__file__).resolve().parents[2] / "shared" / "peers")
    if OPENFOLD_TEST_DATA is not None:
        candidates.append(OPENFOLD_TEST_DATA.parent.parent / "peers")
    return next((p for p in candidates if (p / "openfold").is_dir()), None)


PEERS = _peers_dir()
PEERS_REASON = (
    "OpenFold's source not found: point HFKIT_OPENFOLD_PEERS at the folder holding openfold/ "
    "(../shared/peers beside the repository)"
)


def openfold_functions(relative: str, names: Sequence[str], namespace: dict[str, Any]) -> dict[str, Any]:
    """The top-level functions and assignments `names` of OpenFold's `openfold/<relative>`, compiled
    from the file's text into `namespace` (which supplies what they use); skips without the source."""
    if PEERS is None:
        pytest.skip(PEERS_REASON)
    path = PEERS / "openfold" / relative
    tree = ast.parse(path.read_text())
    wanted = set(names)
    body = [
        node
        for node in tree.body
        if (isinstance(node, ast.FunctionDef) and node.name in wanted)
        or (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id in wanted for t in node.targets)
        )
    ]
    found = {node.name if isinstance(node, ast.FunctionDef) else node.targets[0].id for node in body}
    assert found == wanted, f"{path}: missing {sorted(wanted - found)}"
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


@functools.cache
def openfold_data_transforms() -> dict[str, Any]:
    """OpenFold's `curry1`, `block_delete_msa` and `random_crop_to_size` (data/data_transforms.py)."""
    namespace = {"torch": torch, "np": np, "wraps": functools.wraps, "NUM_RES": "num residues placeholder"}
    names = ("MSA_FEATURE_NAMES", "curry1", "block_delete_msa", "random_crop_to_size")
    return openfold_functions("data/data_transforms.py", names, namespace)


@functools.cache
def openfold_get_header() -> Callable[[dict[str, list[str]]], dict[str, Any]]:
    """OpenFold's `_get_header` (data/mmcif_parsing.py), which reads a Biopython MMCIF2Dict."""
    namespace = {
        "logging": logging,
        "Any": Any,
        "Mapping": dict,
        "Sequence": Sequence,
        "MmCIFDict": dict,
        "PdbHeader": dict,
    }
    names = ("mmcif_loop_to_list", "get_release_date", "_get_header")
    return openfold_functions("data/mmcif_parsing.py", names, namespace)["_get_header"]


# ------------------------------------------------------------------------ 1. arginine NH1/NH2

ARGININE_CIF = """data_ARGS
_entry.id ARGS
loop_
_entity_poly_seq.entity_id
_entity_poly_seq.num
_entity_poly_seq.mon_id
1 1 ARG
1 2 ARG
1 3 ARG
1 4 GLY
loop_
_chem_comp.id
_chem_comp.type
ARG 'L-peptide linking'
GLY 'peptide linking'
""" + atom_site_loop(
    """\
ATOM 1 CA . ARG A 1 1 0.0 0.0 0.0 1.0 A 1
ATOM 2 CD . ARG A 1 1 1.0 0.0 0.0 1.0 A 1
ATOM 3 NH1 . ARG A 1 1 4.5 0.0 0.0 1.0 A 1
ATOM 4 NH2 . ARG A 1 1 3.3 0.0 0.0 1.0 A 1
ATOM 5 CA . ARG A 1 2 10.0 0.0 0.0 1.0 A 1
ATOM 6 CD . ARG A 1 2 11.0 0.0 0.0 1.0 A 1
ATOM 7 NH1 . ARG A 1 2 13.3 0.0 0.0 1.0 A 1
ATOM 8 NH2 . ARG A 1 2 14.5 0.0 0.0 1.0 A 1
ATOM 9 CA . ARG A 1 3 20.0 0.0 0.0 1.0 A 1
ATOM 10 CD . ARG A 1 3 21.0 0.0 0.0 1.0 A 1
ATOM 11 NH1 . ARG A 1 3 24.5 0.0 0.0 1.0 A 1
ATOM 12 CA . GLY A 1 4 30.0 0.0 0.0 1.0 A 1
"""
)


def test_arginine_nh1_farther_from_cd_than_nh2_is_renamed() -> None:
    """OpenFold's `get_atom_coords` swaps NH1/NH2 of an arginine whose NH1 is the farther from CD."""
    chain = parse_mmcif("args.cif", text=ARGININE_CIF).chains["A"]
    pos, mask = chain.atom_positions, chain.atom_mask
    np.testing.assert_array_equal(pos[0, NH1], np.float32([3.3, 0.0, 0.0]))  # misnamed in the file: swapped
    np.testing.assert_array_equal(pos[0, NH2], np.float32([4.5, 0.0, 0.0]))
    np.testing.assert_array_equal(pos[1, NH1], np.float32([13.3, 0.0, 0.0]))  # named right: kept
    np.testing.assert_array_equal(pos[1, NH2], np.float32([14.5, 0.0, 0.0]))
    np.testing.assert_array_equal(pos[2, NH1], np.float32([24.5, 0.0, 0.0]))  # no NH2: nothing to compare
    assert mask[2, NH1] == 1 and mask[2, NH2] == 0
    as_filed = parse_mmcif("args.cif", text=ARGININE_CIF, fix_arginine_naming=False).chains["A"]
    np.testing.assert_array_equal(as_filed.atom_positions[0, NH1], np.float32([4.5, 0.0, 0.0]))
    np.testing.assert_array_equal(as_filed.atom_positions[0, NH2], np.float32([3.3, 0.0, 0.0]))
    np.testing.assert_array_equal(as_filed.atom_mask, mask)


def test_real_arginines_have_nh1_nearer_cd() -> None:
    if OPENFOLD_TEST_DATA is None:
        pytest.skip("real AlphaFold inputs not found (HFKIT_OPENFOLD_TEST_DATA)")
    checked = 0
    for path in sorted((OPENFOLD_TEST_DATA / "mmcifs").glob("*.cif")):
        for chain in parse_mmcif(path).chains.values():
            pos, mask = chain.atom_positions, chain.atom_mask
            arg = (np.array(list(chain.sequence)) == "R") & (mask[:, [CD, NH1, NH2]] > 0).all(axis=1)
            d1 = np.linalg.norm(pos[arg, NH1] - pos[arg, CD], axis=-1)
            d2 = np.linalg.norm(pos[arg, NH2] - pos[arg, CD], axis=-1)
            assert (d1 <= d2).all(), (path.name, chain.chain_id)
            checked += int(arg.sum())
    assert checked > 0


# ------------------------------------------------------------------------ 5. resolution

_HEADER = """data_RES
_entry.id RES
{fields}
loop_
_entity_poly_seq.entity_id
_entity_poly_seq.num
_entity_poly_seq.mon_id
1 1 GLY
""" + atom_site_loop(
    "ATOM 1 CA GLY A 1 1 0.0 0.0 0.0 A\n",
    [c for c in ATOM_SITE_COLUMNS if c not in ("label_alt_id", "occupancy", "pdbx_PDB_model_num")],
)


@pytest.mark.parametrize(
    "fields",
    [
        {"_refine.ls_d_res_high": "2.10", "_reflns.d_resolution_high": "2.05"},
        {"_refine.ls_d_res_high": "?", "_reflns.d_resolution_high": "2.05"},
        {
            "_refine.ls_d_res_high": "?",
            "_em_3d_reconstruction.resolution": "3.4",
            "_reflns.d_resolution_high": "2.05",
        },
        {"_em_3d_reconstruction.resolution": "3.4", "_reflns.d_resolution_high": "2.05"},
        {"_refine.ls_d_res_high": ".", "_em_3d_reconstruction.resolution": "?"},
        {},
    ],
)
def test_resolution_is_the_first_key_that_parses(fields: dict[str, str]) -> None:
    """OpenFold's `_get_header`, on what Biopython reads from the same fields (strings, '?' kept)."""
    text = _HEADER.format(fields="\n".join(f"{k} {v}" for k, v in fields.items()))
    parsed_info = {k: [v] for k, v in fields.items()} | {"_entry.id": ["RES"]}
    expected = openfold_get_header()(parsed_info)["resolution"]
    assert parse_mmcif("res.cif", text=text).resolution == pytest.approx(expected)


# ------------------------------------------------------------------------ 2. block deletion


@pytest.mark.parametrize("randomize_num_blocks", [False, True])
def test_block_delete_rows_matches_openfold(randomize_num_blocks: bool) -> None:
    """Same rows kept as OpenFold's `block_delete_msa` whose global RNG is seeded as our generator."""
    block_delete_msa = openfold_data_transforms()["block_delete_msa"]
    config = dataclasses.replace(FeatureConfig.af2_initial(), randomize_num_blocks=randomize_num_blocks)
    openfold_config = type("BlockDeleteConfig", (), {})()
    for name in ("msa_fraction_per_block", "num_blocks", "randomize_num_blocks"):
        setattr(openfold_config, name, getattr(config, name))
    deleted_some = 0
    for num_seq in (1, 3, 4, 7, 20, 131, 1000, 5120):
        for seed in range(5):
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                rows = block_delete_msa(openfold_config)({"msa": torch.arange(num_seq)[:, None]})["msa"]
            keep = block_delete_rows(num_seq, config, torch.Generator().manual_seed(seed))
            assert torch.equal(keep, rows.view(-1)), (num_seq, seed)
            assert int(keep[0]) == 0
            deleted_some += keep.numel() < num_seq
    assert deleted_some > 20


def test_af2_initial_deletes_blocks_before_sampling() -> None:
    """OpenFold's initial_training: 5 blocks of 30% of the rows; the extra MSA loses rows."""
    config = FeatureConfig.af2_initial()
    assert (config.block_delete_msa, config.msa_fraction_per_block) == (True, 0.3)
    assert (config.num_blocks, config.randomize_num_blocks) == (5, False)
    small = dataclasses.replace(FeatureConfig.tiny(), max_extra_msa=512)
    assert small.block_delete_msa  # the default, as in OpenFold's training mode
    depth, length = 300, 24  # not cropped (length <= crop 32): block deletion draws first
    rng = np.random.default_rng(0)
    msa = np.concatenate([np.zeros((1, length)), rng.integers(0, 21, (depth - 1, length))]).astype(np.int8)
    raw = {
        "aatype": msa[0].copy(),
        "msa": msa,
        "deletion_matrix": np.zeros((depth, length), np.uint8),
        "residue_index": np.arange(length, dtype=np.int32),
    }
    row_of = {tuple(r): i for i, r in enumerate(msa.tolist())}
    for seed in range(3):
        keep = set(block_delete_rows(depth, small, torch.Generator().manual_seed(seed)).tolist())
        assert len(keep) < depth - 90  # at least one block of 90 rows is gone
        out = process_features(raw, small, seed)
        num_extra = int(out["extra_msa_mask"][:, 0].sum())
        sampled = out["true_msa"][:8, :length].tolist() + out["extra_msa"][:num_extra, :length].tolist()
        assert len(sampled) == len(keep)  # every kept row is sampled, no deleted one
        assert {row_of[tuple(r)] for r in sampled} == keep
        whole = process_features(raw, dataclasses.replace(small, block_delete_msa=False), seed)
        assert int(whole["extra_msa_mask"][:, 0].sum()) == depth - 8
        unchanged = process_features(raw, small, seed, train=False)  # evaluation: no deletion
        assert int(unchanged["extra_msa_mask"][:, 0].sum()) == depth - 8


# ------------------------------------------------------------------------ 3. the crop's start


@pytest.mark.filterwarnings("ignore:Using a non-tuple sequence for multidimensional indexing")
def test_contiguous_crop_start_matches_openfold() -> None:
    """`crop_contiguous` on a generator seeded as OpenFold's crop seed gives its start."""
    random_crop_to_size = openfold_data_transforms()["random_crop_to_size"]
    schema = {"residue_index": ["num residues placeholder"]}
    for num_res, crop_size in ((257, 256), (300, 256), (400, 256), (1000, 384), (50, 7)):
        for seed in range(20):
            protein = {"seq_length": torch.tensor(num_res), "residue_index": torch.arange(num_res)}
            cropped = random_crop_to_size(crop_size, 0, schema, seed=seed)(protein)["residue_index"]
            ours = crop_contiguous(num_res, crop_size, torch.Generator().manual_seed(seed))
            assert torch.equal(ours, cropped), (num_res, crop_size, seed)


def test_contiguous_crop_start_favours_early_starts() -> None:
    """Two-step start: mean (n/4 =) 36 at L=400, crop 256; `uniform_start` gives the old mean 72."""
    g = torch.Generator().manual_seed(0)
    two_step = [int(crop_contiguous(400, 256, g)[0]) for _ in range(4000)]
    uniform = [int(crop_contiguous(400, 256, g, uniform_start=True)[0]) for _ in range(4000)]
    assert abs(np.mean(two_step) - 36) < 3 and abs(np.mean(uniform) - 72) < 3
    assert min(two_step) == 0 and max(two_step) <= 144
    # choose_crop and the config pass the switch on.
    g = torch.Generator().manual_seed(1)
    starts = [int(choose_crop(400, 256, g, 0.0, uniform_start=True)[0]) for _ in range(2000)]
    assert abs(np.mean(starts) - 72) < 4
    assert not FeatureConfig.af2_initial().uniform_crop_start


# ------------------------------------------------------------------------ 4. no spatial crop


def test_af2_initial_crops_are_contiguous() -> None:
    """OpenFold's monomer training never crops spatially; the old af2_initial did half the time."""
    assert FeatureConfig.af2_initial().spatial_crop_prob == 0.0
    assert FeatureConfig.af2_finetune().spatial_crop_prob == 0.0
    length, crop = 300, 256
    rng = np.random.default_rng(1)
    positions = rng.normal(scale=30.0, size=(length, 37, 3)).astype(np.float32)
    raw = {
        "aatype": np.zeros(length, np.int8),
        "msa": np.zeros((1, length), np.int8),
        "deletion_matrix": np.zeros((1, length), np.uint8),
        "all_atom_positions": positions,
        "all_atom_mask": np.ones((length, 37), np.float32),
        "resolution": np.array(2.0, np.float32),
    }
    for seed in range(12):
        index = process_features(raw, FeatureConfig.af2_initial(), seed)["residue_index"]
        assert torch.equal(index, torch.arange(int(index[0]), int(index[0]) + crop)), seed


# ------------------------------------------------------------------------ 6. recycling samples


def test_recycling_samples_share_the_crop_and_resample_the_msa() -> None:
    """OpenFold's `max_recycling_iters + 1` sets: one crop, independent MSA draws, stacked (first axis)."""
    config = FeatureConfig.tiny()
    length, depth = 60, 120
    rng = np.random.default_rng(2)
    msa = np.concatenate([np.zeros((1, length)), rng.integers(0, 21, (depth - 1, length))]).astype(np.int8)
    raw = {
        "aatype": msa[0].copy(),
        "msa": msa,
        "deletion_matrix": rng.integers(0, 3, (depth, length)).astype(np.uint8),
        "residue_index": np.arange(length, dtype=np.int32),
    }
    stacked = process_features_recycling(raw, config, seed=5)
    single = process_features(raw, config, seed=5)
    assert set(stacked) == set(single)
    for key, value in single.items():
        assert stacked[key].shape == (4, *value.shape), key
        assert torch.equal(stacked[key][0], value), key
    for r in range(1, 4):
        assert torch.equal(stacked["residue_index"][r], stacked["residue_index"][0])  # the same crop
        assert not torch.equal(stacked["msa_feat"][r], stacked["msa_feat"][0])  # resampled MSA
    assert not torch.equal(stacked["true_msa"][1], stacked["true_msa"][2])
    assert process_features_recycling(raw, config, seed=5, max_recycling_iters=0)["msa_feat"].shape[0] == 1
    with pytest.raises(ValueError, match="max_recycling_iters"):
        process_features_recycling(raw, config, seed=5, max_recycling_iters=-1)


# ------------------------------------------------------------------------ 7. ParseError


def test_parse_error_is_exported_from_hfkit_data_lazily() -> None:
    from hfkit.data import ParseError as exported

    assert exported is ParseError and "ParseError" in hfkit.data.__all__
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        _ = hfkit.data.Nothing
    code = "import sys, hfkit.data; print(sorted(m for m in ('numpy', 'torch', 'gemmi') if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == "[]"  # the package import stays light
