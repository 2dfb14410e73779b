"""`hfkit bench launch` (hfkit.bench.launch): host time per call of every swappable module of a block,
plain against swapped, with the inputs the block passes them; CPU, tiny preset."""

from __future__ import annotations

import json

import torch

from hfkit.bench.launch import module_inputs, run_launch_benchmark
from hfkit.bench.model import _block_inputs, make_block
from hfkit.model import ModelConfig
from hfkit.ops._triton import reference_on_cpu

TINY = ModelConfig.tiny()


def test_module_inputs_are_what_the_block_passes_its_outermost_matching_children():
    block = make_block(TINY)
    inputs = _block_inputs(TINY, 3, 5, torch.device("cpu"), torch.float32)
    captured = module_inputs(block, inputs, (torch.nn.LayerNorm,))
    assert captured and all(isinstance(m, torch.nn.LayerNorm) for m, _, _ in captured.values())
    for path, (module, args, _) in captured.items():
        assert block.get_submodule(path) is module
        assert args[0].shape[-1] == module.normalized_shape[0] and args[0].requires_grad


def test_module_inputs_keep_masks_out_of_the_gradients():
    block = make_block(TINY)
    inputs = _block_inputs(TINY, 3, 5, torch.device("cpu"), torch.float32)
    captured = module_inputs(block, inputs, (type(block.core.tri_att_start),))
    ((_, args, kwargs),) = captured.values()
    x, mask = args[0], kwargs["mask"]
    assert x.requires_grad and mask.is_floating_point() and not mask.requires_grad


def test_rows_cover_every_module_both_providers_and_modes(tmp_path):
    out = tmp_path / "launch.json"
    with reference_on_cpu():
        rows = run_launch_benchmark("cpu", config=TINY, shape=(3, 5), dtype=torch.float32, calls=2, out=out)
    modules = {r.extra["module"] for r in rows}
    assert "" in modules and any(m.rsplit(".", 1)[-1].startswith("layer_norm") for m in modules)
    assert len(rows) == 4 * len(modules)  # (eager, hfkit) x (fwd, fwd+bwd) per module
    for module in modules:
        mine = [r for r in rows if r.extra["module"] == module]
        assert {(r.provider, r.mode) for r in mine} == {
            (p, m) for p in ("eager", "hfkit") for m in ("fwd", "fwd+bwd")
        }
        assert all(r.op == "launch_cost" and r.p50_ms > 0 for r in mine)
    swapped = {r.extra["class"] for r in rows if r.provider == "hfkit" and r.extra["module"] == ""}
    assert swapped == {"EvoformerBlock"}
    assert len(json.loads(out.read_text())["rows"]) == len(rows)
