"""Tests of `hfkit.nn.LayerNorm` and of `to_hfkit` / `to_torch`: types, sharing, state_dict, outputs, grads.

Runs on CPU; under `TRITON_INTERPRET=1` (set by conftest) the swapped LayerNorms run the Triton kernels
in the interpreter, which is slow, so the inputs are small.
"""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_close
from torch import nn

import hfkit
import hfkit.nn.layer_norm as hfkit_ln_module
from hfkit.nn import LayerNorm, SwapReport, register_swap, to_hfkit, to_torch
from hfkit.nn.convert import ORIGINAL_CLS_ATTR, register_foreign_swap, registered_ops, unregister_swap
from hfkit.ops.layer_norm import uses_triton

D = 8


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.linear = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(self.norm(x))


class SubclassedLayerNorm(nn.LayerNorm):
    """A user's LayerNorm with its own forward: to_hfkit must leave it alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class Net(nn.Module):
    """Seven distinct LayerNorms in every kind of place, one of them reachable under two names."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.pre = nn.LayerNorm(d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.seq = nn.Sequential(
            nn.Linear(d, d),
            nn.LayerNorm(d, elementwise_affine=False),
            nn.ReLU(),
            nn.LayerNorm(d, bias=False),
        )
        self.shared = nn.LayerNorm(d)
        self.also_shared = self.shared
        self.pair = nn.LayerNorm((2, d // 2), eps=1e-3)  # two normalized dims
        self.custom = SubclassedLayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        for block in self.blocks:
            x = block(x)
        x = self.seq(x)
        x = self.also_shared(self.shared(x))
        x = self.pair(x.unflatten(-1, (2, D // 2))).flatten(-2)
        return self.custom(x)


N_LAYER_NORMS = 7  # distinct exact nn.LayerNorm instances in Net (the subclass not counted)


def make_net(**kwargs: object) -> Net:
    """A Net whose affine parameters are random, so that a dropped weight or bias changes outputs."""
    net = Net(**kwargs)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p))
    return net


def types_by_name(model: nn.Module) -> dict[str, type]:
    return {name: type(m) for name, m in model.named_modules(remove_duplicate=False)}


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in after.items():
        assert value.dtype == before[key].dtype, key
        assert value.device == before[key].device, key
        assert torch.equal(value, before[key]), key


# -- hfkit.nn.LayerNorm as a drop-in ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"elementwise_affine": False}, {"bias": False}, {"eps": 1e-3}, {"dtype": torch.float64}],
)
def test_layer_norm_is_a_drop_in(seed: int, kwargs: dict) -> None:
    torch.manual_seed(seed)
    ref = nn.LayerNorm((3, D), **kwargs)
    torch.manual_seed(seed)
    ours = LayerNorm((3, D), **kwargs)
    assert isinstance(ours, nn.LayerNorm)
    assert ours.extra_repr() == ref.extra_repr()
    assert [(n, p.shape, p.dtype) for n, p in ours.named_parameters()] == [
        (n, p.shape, p.dtype) for n, p in ref.named_parameters()
    ]
    ours.load_state_dict(ref.state_dict(), strict=True)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p))
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, 3, D, dtype=kwargs.get("dtype", torch.float32))
    assert_close(ours(x), ref(x))


def test_layer_norm_forward_calls_the_hfkit_op(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(args)
        return hfkit.ops.layer_norm(*args, **kwargs)

    monkeypatch.setattr(hfkit_ln_module, "layer_norm", spy)
    model = to_hfkit(make_net())
    model(torch.randn(2, D))
    # Each distinct LayerNorm runs once, except the shared one which runs twice.
    assert len(calls) == N_LAYER_NORMS + 1


# -- to_hfkit / to_torch: structure ---------------------------------------------------------------------


def test_to_hfkit_swaps_exact_layer_norms_and_keeps_sharing(seed: int) -> None:
    model = make_net()
    params_before = {name: p for name, p in model.named_parameters()}
    original_types = types_by_name(model)

    out = to_hfkit(model)

    assert out is model  # the root is not a LayerNorm, so it stays the same object
    for name, cls in types_by_name(model).items():
        if original_types[name] is nn.LayerNorm:
            assert cls is LayerNorm, name
        else:
            assert cls is original_types[name], name  # Linear, ReLU, containers, the subclass
    assert model.shared is model.also_shared
    # The very same Parameter objects: an optimizer built before the swap still trains the model.
    for name, p in model.named_parameters():
        assert p is params_before[name], name


def test_round_trip_restores_every_type(seed: int) -> None:
    model = make_net()
    original_types = types_by_name(model)
    back = to_torch(to_hfkit(model))
    assert types_by_name(back) == original_types
    assert back.shared is back.also_shared
    assert all(ORIGINAL_CLS_ATTR not in m.__dict__ for m in back.modules())


def test_state_dict_is_identical_in_both_directions(seed: int) -> None:
    model = make_net()
    before = snapshot(model)
    to_hfkit(model)
    assert_same_state(model, before)
    to_torch(model)
    assert_same_state(model, before)


def test_inplace_false_leaves_the_original_untouched(seed: int) -> None:
    model = make_net()
    original_types = types_by_name(model)
    before = snapshot(model)
    params = list(model.parameters())

    swapped = to_hfkit(model, inplace=False)

    assert swapped is not model
    assert types_by_name(model) == original_types
    assert_same_state(model, before)
    assert all(p is q for p, q in zip(model.parameters(), params, strict=True))
    assert isinstance(swapped.pre, LayerNorm) and swapped.pre.weight is not model.pre.weight
    assert_same_state(swapped, before)

    back = to_torch(swapped, inplace=False)
    assert types_by_name(back) == original_types
    assert isinstance(swapped.pre, LayerNorm)  # to_torch(inplace=False) left its input alone too


def test_root_layer_norm_is_replaced_and_returned(seed: int) -> None:
    ln = nn.LayerNorm(D)
    new = to_hfkit(ln)
    assert type(new) is LayerNorm and new is not ln
    assert new.weight is ln.weight and new.bias is ln.bias
    assert type(ln) is nn.LayerNorm  # the old root object keeps its class
    # Same tensors, separate containers: changing the old module's structure leaves the new one alone.
    ln.register_buffer("stale", torch.zeros(1))
    assert list(new.state_dict()) == ["weight", "bias"]
    back = to_torch(new)
    assert type(back) is nn.LayerNorm and back.weight is ln.weight


def test_training_flags_are_kept(seed: int) -> None:
    model = make_net().eval()
    model.blocks[1].norm.train()
    to_hfkit(model)
    assert not model.pre.training
    assert model.blocks[1].norm.training
    assert isinstance(model.blocks[1].norm, LayerNorm)
    to_torch(model)
    assert not model.pre.training and model.blocks[1].norm.training


def test_hooks_are_carried_and_old_handles_still_remove_them(seed: int) -> None:
    model = make_net()
    seen: list[str] = []
    pre_handle = model.pre.register_forward_pre_hook(lambda m, args: seen.append("pre"))
    handle = model.pre.register_forward_hook(lambda m, args, out: seen.append(type(m).__name__))

    to_hfkit(model)
    model(torch.randn(1, D))
    assert seen == ["pre", "LayerNorm"]
    assert type(model.pre) is LayerNorm

    handle.remove()
    pre_handle.remove()
    model(torch.randn(1, D))
    assert seen == ["pre", "LayerNorm"]


def test_subclass_is_skipped_and_reported(seed: int) -> None:
    model, report = to_hfkit(make_net(), report=True)
    assert type(model.custom) is SubclassedLayerNorm
    (row,) = report.skipped
    assert row.name == "custom" and row.from_type == row.to_type == "test_nn_convert.SubclassedLayerNorm"
    assert "subclass of LayerNorm" in row.reason


def test_already_converted_modules_are_left_alone(seed: int) -> None:
    model = to_hfkit(make_net())
    pre = model.pre
    model, report = to_hfkit(model, report=True)
    assert model.pre is pre
    assert report.swapped == []


def test_to_torch_converts_directly_built_hfkit_modules() -> None:
    model = nn.Sequential(LayerNorm(D), nn.Linear(D, D))
    assert ORIGINAL_CLS_ATTR not in model[0].__dict__
    to_torch(model)
    assert type(model[0]) is nn.LayerNorm


def test_rejects_a_non_module() -> None:
    with pytest.raises(TypeError, match="model"):
        to_hfkit(torch.zeros(3))
    with pytest.raises(TypeError, match="model"):
        to_torch("not a module")


def test_package_to_hfkit_is_hfkit_nn_to_hfkit() -> None:
    assert hfkit.to_hfkit is to_hfkit and hfkit.to_torch is to_torch
    assert {"to_hfkit", "to_torch", "__version__"} <= set(dir(hfkit))
    with pytest.raises(AttributeError, match="no_such_name"):
        hfkit.no_such_name  # noqa: B018


def test_package_to_hfkit_registers_every_fused_module() -> None:
    """In a fresh interpreter that imported only `hfkit` and `hfkit.model`, `hfkit.to_hfkit` swaps every
    module of the plain model that has a fused form: its first use imports all of `hfkit.nn`."""
    code = (
        "import hfkit, hfkit.model\n"
        "model = hfkit.model.AlphaFoldLite(hfkit.model.ModelConfig.tiny())\n"
        "print(sorted(hfkit.to_hfkit(model, report=True)[1].counts()))\n"
    )
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert run.stdout.strip() == str(
        sorted(
            [
                "Attention",
                "DropoutColumnwise",
                "DropoutRowwise",
                "LayerNorm",
                "MSAColumnAttention",
                "MSATransition",
                "OuterProductMean",
                "PairTransition",
                "TriangleAttentionEndingNode",
                "TriangleAttentionStartingNode",
                "TriangleMultiplicationIncoming",
                "TriangleMultiplicationOutgoing",
            ]
        )
    )


# -- include / exclude and the report --------------------------------------------------------------------


def test_report_counts_and_renders(seed: int) -> None:
    model, report = to_hfkit(make_net(), report=True)
    assert isinstance(report, SwapReport)
    assert len(report.swapped) == N_LAYER_NORMS
    assert report.counts() == {"LayerNorm": N_LAYER_NORMS}
    names = {r.name for r in report.swapped}
    assert names == {"pre", "blocks.0.norm", "blocks.1.norm", "seq.1", "seq.3", "shared", "pair"}
    (shared,) = [r for r in report.rows if r.name == "shared"]
    assert "also_shared" in shared.reason

    text = str(report)
    assert f"swapped {N_LAYER_NORMS} modules: LayerNorm ×{N_LAYER_NORMS}" in text
    assert "skipped 1 module: LayerNorm ×1" in text
    lines = text.splitlines()
    assert len(lines) == 2 + len(report.rows) + 2  # header, rule, rows, two summary lines
    # Aligned: each row's "from" and "status" cells start where the header's do.
    for line in lines[2 : 2 + len(report.swapped)]:
        assert line.index("torch.nn.LayerNorm") == lines[0].index("from"), line
        assert line.index("s", lines[0].index("status")) == lines[0].index("status"), line
    assert report.swapped[0].from_type == "torch.nn.LayerNorm"
    assert report.swapped[0].to_type == "hfkit.nn.LayerNorm"

    _, back = to_torch(model, report=True)
    assert back.counts() == {"LayerNorm": N_LAYER_NORMS} and back.skipped == []
    assert {(r.from_type, r.to_type) for r in back.swapped} == {("hfkit.nn.LayerNorm", "torch.nn.LayerNorm")}


def test_exclude_and_include_take_op_names(seed: int) -> None:
    model, report = to_hfkit(make_net(), exclude={"LayerNorm"}, report=True)
    assert not any(type(m) is LayerNorm for m in model.modules())
    assert report.swapped == []
    assert sum(r.reason.startswith("in exclude") for r in report.skipped) == N_LAYER_NORMS

    model, report = to_hfkit(make_net(), include="LayerNorm", report=True)
    assert len(report.swapped) == N_LAYER_NORMS

    with pytest.raises(ValueError, match="include.*Layernorm"):
        to_hfkit(make_net(), include={"Layernorm"})
    with pytest.raises(ValueError, match="exclude"):
        to_hfkit(make_net(), exclude=["nope"])


def test_report_false_returns_only_the_model() -> None:
    assert isinstance(to_hfkit(nn.Linear(2, 2)), nn.Linear)
    assert isinstance(to_torch(nn.Linear(2, 2)), nn.Linear)


# -- registry ---------------------------------------------------------------------------------------------


class HfkitGroupNorm(nn.GroupNorm):
    pass


@pytest.fixture
def group_norm_registered():
    register_swap(nn.GroupNorm, HfkitGroupNorm)
    yield
    unregister_swap(nn.GroupNorm)


def test_register_swap_adds_an_op(group_norm_registered: None) -> None:
    assert registered_ops()["GroupNorm"] == (nn.GroupNorm, HfkitGroupNorm)
    register_swap(nn.GroupNorm, HfkitGroupNorm)  # same pair again: no-op
    with pytest.raises(ValueError, match="torch_cls"):
        register_swap(nn.GroupNorm, LayerNorm)
    with pytest.raises(ValueError, match="name"):
        register_swap(nn.BatchNorm1d, HfkitGroupNorm, name="GroupNorm")

    model = nn.Sequential(nn.GroupNorm(2, 4), nn.LayerNorm(4))
    before = snapshot(model)
    model, report = to_hfkit(model, include={"GroupNorm"}, report=True)
    assert [type(m) for m in model] == [HfkitGroupNorm, nn.LayerNorm]
    assert report.counts() == {"GroupNorm": 1} and report.counts("skipped") == {"LayerNorm": 1}
    assert_same_state(model, before)
    to_torch(model)
    assert [type(m) for m in model] == [nn.GroupNorm, nn.LayerNorm]


class OtherLayerNorm(nn.LayerNorm):
    """Stands for a third-party LayerNorm class (e.g. a model library's own) with torch's semantics."""


def test_two_torch_classes_mapping_to_one_hfkit_class_come_back_exactly() -> None:
    register_swap(OtherLayerNorm, LayerNorm)
    try:
        model = nn.Sequential(OtherLayerNorm(D), nn.LayerNorm(D))
        model, report = to_hfkit(model, report=True)
        assert [type(m) for m in model] == [LayerNorm, LayerNorm]
        assert report.counts() == {"OtherLayerNorm": 1, "LayerNorm": 1}
        to_torch(model)
        assert [type(m) for m in model] == [OtherLayerNorm, nn.LayerNorm]
    finally:
        unregister_swap(OtherLayerNorm)
    assert to_torch(LayerNorm(D)).__class__ is nn.LayerNorm  # the first registration stays the default


def test_unregistered_op_is_gone() -> None:
    assert "GroupNorm" not in registered_ops()
    with pytest.raises(ValueError, match="not registered"):
        unregister_swap(nn.GroupNorm)


# -- numerics: outputs, gradients, dtype ------------------------------------------------------------------


def test_swapped_model_matches_torch(seed: int) -> None:
    model = make_net()
    swapped = to_hfkit(model, inplace=False)
    x = torch.randn(2, 3, D)
    # Under the interpreter this exercises the Triton kernels, not the reference they are checked against.
    assert uses_triton(x, D) == (os.environ.get("TRITON_INTERPRET") == "1")
    assert_close(swapped(x), model(x))


def test_gradients_match_torch(seed: int) -> None:
    model = make_net()
    swapped = to_hfkit(model, inplace=False)
    x = torch.randn(3, 5, D)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad_out = torch.randn(3, 5, D)
    model(x_ref).backward(grad_out)
    swapped(x_ours).backward(grad_out)

    assert_close(x_ours.grad, x_ref.grad)
    ref_grads = dict(model.named_parameters())
    for name, p in swapped.named_parameters():
        assert p.grad is not None, name
        assert_close(p.grad, ref_grads[name].grad, msg=f"grad of {name}")
    assert swapped.pre.weight.grad.abs().sum() > 0 and swapped.pre.bias.grad.abs().sum() > 0


def test_bfloat16_model_keeps_dtype_and_matches(seed: int) -> None:
    model = make_net().to(torch.bfloat16)
    before = snapshot(model)
    swapped = to_hfkit(model, inplace=False)
    assert_same_state(swapped, before)
    x = torch.randn(2, D, dtype=torch.bfloat16)
    out = swapped(x)
    assert out.dtype == torch.bfloat16
    # The network stacks nine LayerNorms with linears between: compare in fp32 with bf16 slack.
    torch.testing.assert_close(out.float(), model(x).float(), rtol=5e-2, atol=5e-2)


# -- compile, copy, save ----------------------------------------------------------------------------------


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = LayerNorm(D)
        self.linear = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x)).relu()


def test_torch_compile_matches_eager(seed: int) -> None:
    torch._dynamo.reset()
    model = Small()
    with torch.no_grad():
        model.norm.weight.normal_()
        model.norm.bias.normal_()
    x = torch.randn(4, D)
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    assert_close(out, model(x))
    out.sum().backward()
    compiled_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for got, want in zip(compiled_grads, [p.grad for p in model.parameters()], strict=True):
        assert_close(got, want)


def test_deepcopy_keeps_types_and_values(seed: int) -> None:
    model = to_hfkit(make_net())
    clone = copy.deepcopy(model)
    assert types_by_name(clone) == types_by_name(model)
    assert clone.shared is clone.also_shared
    assert clone.pre.weight is not model.pre.weight
    assert_same_state(clone, snapshot(model))
    x = torch.randn(2, D)
    assert_close(clone(x), model(x))
    assert types_by_name(to_torch(clone)) == types_by_name(make_net())


def test_save_and_load_whole_module_and_state_dict(seed: int) -> None:
    model = to_hfkit(make_net())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert types_by_name(loaded) == types_by_name(model)
    assert_same_state(loaded, snapshot(model))
    # The remembered original classes survive pickling, so the way back still works.
    assert types_by_name(to_torch(loaded)) == types_by_name(make_net())

    # A state_dict saved from the swapped model loads strictly into a plain torch model and back.
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    plain = make_net()
    plain.load_state_dict(torch.load(buffer, weights_only=True), strict=True)
    assert_same_state(plain, snapshot(model))
    x = torch.randn(2, D)
    assert_close(model(x), plain(x))


# A class of a package hfkit does not import, registered by qualified name (as OpenFold's are).
ForeignNorm = type(
    "ForeignNorm",
    (nn.LayerNorm,),
    {"__module__": "foreignpkg.layers", "forward": lambda self, x: nn.LayerNorm.forward(self, x)},
)


def _foreign_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return 2 * nn.functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


@pytest.fixture
def foreign_registered():
    check = lambda m: "" if m.weight is not None else "weight: expected a parameter, got None"
    register_foreign_swap(
        "foreignpkg.layers.ForeignNorm", "foreign.Norm", check, {"forward": _foreign_forward}
    )
    yield
    unregister_swap("foreignpkg.layers.ForeignNorm")


def test_foreign_class_is_swapped_by_qualified_name_and_restored(foreign_registered: None) -> None:
    model = nn.Sequential(ForeignNorm(D), ForeignNorm(D, elementwise_affine=False), nn.Linear(D, D))
    before = snapshot(model)
    x = torch.randn(3, D)
    model, report = to_hfkit(model, report=True)
    adapter = type(model[0])
    assert adapter is not ForeignNorm and issubclass(adapter, ForeignNorm)
    assert type(model[1]) is ForeignNorm  # its layout check failed
    assert report.counts() == {"foreign.Norm": 1}
    assert report.skipped[0].reason == "skipped: weight: expected a parameter, got None"
    torch.testing.assert_close(
        model[0](x), 2 * nn.functional.layer_norm(x, (D,), model[0].weight, model[0].bias)
    )
    assert_same_state(model, before)
    again = to_hfkit(nn.Sequential(ForeignNorm(D)))
    assert type(again[0]) is adapter  # one adapter per class
    model = to_torch(model)
    assert [type(m) for m in model] == [ForeignNorm, ForeignNorm, nn.Linear]
    assert_same_state(model, before)
    _, report = to_hfkit(nn.Sequential(ForeignNorm(D)), exclude={"foreign.Norm"}, report=True)
    assert report.counts("skipped") == {"foreign.Norm": 1}


def test_unregistered_foreign_class_is_left_alone(foreign_registered: None) -> None:
    unregister_swap("foreignpkg.layers.ForeignNorm")
    model = to_hfkit(nn.Sequential(ForeignNorm(D)))
    assert type(model[0]) is ForeignNorm
    with pytest.raises(ValueError, match="qualified name"):
        unregister_swap("foreignpkg.layers.ForeignNorm")
    register_foreign_swap("foreignpkg.layers.ForeignNorm", "foreign.Norm", lambda m: "", {})  # for teardown
