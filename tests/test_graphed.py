"""Tests of `hfkit.nn.graphed`: which modules `graph_modules` graphs, that state_dicts, outputs and
gradients are untouched, when calls run eagerly, and (with a CPU stand-in for
`make_graphed_callables` that keeps its static-buffer semantics) caching, eviction and `.grad`
accumulation; the `cuda` tests replay real CUDA graphs against the plain block."""

from __future__ import annotations

import contextlib
import copy
import io
import warnings

import pytest
import torch
from conftest import assert_close
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

import hfkit.nn.graphed as graphed_module
from hfkit.model import EvoformerBlock, EvoformerStack, ExtraMSAStack, ModelConfig
from hfkit.nn import GraphedForward, graph_modules, graphed_forwards, to_hfkit, ungraph_modules

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ModelConfig.tiny()
NOT_ON_CUDA = "a tensor argument is not on CUDA"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _randomize(module: nn.Module, scale: float = 0.3) -> nn.Module:
    """Random parameters: the zero-initialised output projections would leave gradients at zero."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * scale)
    return module


def _stack(**changes) -> EvoformerStack:
    config = TINY.replace(msa_dropout=0.0, pair_dropout=0.0, **changes)
    return _randomize(EvoformerStack.from_config(config))


def _block(dropout: float = 0.0) -> EvoformerBlock:
    config = TINY.replace(msa_dropout=dropout, pair_dropout=dropout, no_blocks=1)
    return _randomize(EvoformerStack.from_config(config).blocks[0])


def _inputs(
    s: int, n: int, device: str = "cpu", dtype: torch.dtype = torch.float32, grad: bool = True, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """m [1, S, N, c_m], z [1, N, N, c_z] (leaves, requiring grad with `grad`), random 0/1 masks."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(1, s, n, TINY.c_m, generator=g)
    z = torch.randn(1, n, n, TINY.c_z, generator=g)
    msa_mask = (torch.rand(1, s, n, generator=g) > 0.2).float()
    pair_mask = (torch.rand(1, n, n, generator=g) > 0.2).float()
    m, z = (t.to(device, dtype).requires_grad_(grad) for t in (m, z))
    return m, z, msa_mask.to(device, dtype), pair_mask.to(device, dtype)


def _leaf_copies(args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)


def _graphed_forwards_of(model: nn.Module) -> dict[str, GraphedForward]:
    return {name: m.__dict__["forward"] for name, m in model.named_modules() if "forward" in m.__dict__}


# ------------------------------------------------------------------------------ which modules, state


def test_graph_modules_graphs_each_block_and_keeps_the_state_dict(seed) -> None:
    stack = _stack()
    before = {k: v.clone() for k, v in stack.state_dict().items()}
    assert graph_modules(stack) is stack
    found = _graphed_forwards_of(stack)
    assert sorted(found) == ["blocks.0", "blocks.1"]
    for name, forward in found.items():
        block = stack.get_submodule(name)
        assert type(block) is EvoformerBlock and forward.module is block
        assert block.forward is forward and forward.captures == 0 and forward.signatures == ()
    assert graphed_forwards(stack) == list(found.values())
    after = stack.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    # Again: the same objects, nothing doubled.
    graph_modules(stack)
    assert _graphed_forwards_of(stack) == found


def test_graph_modules_takes_a_block_itself_extra_msa_blocks_and_classes_by_name() -> None:
    block = _block()
    graph_modules(block)
    assert isinstance(block.__dict__["forward"], GraphedForward)

    extra = ExtraMSAStack.from_config(TINY)
    graph_modules(extra)
    assert len(graphed_forwards(extra)) == TINY.extra_no_blocks

    # OpenFold's block is recognised by its qualified name, without importing OpenFold.
    foreign = type("EvoformerBlock", (nn.Linear,), {"__module__": "openfold.model.evoformer"})
    model = nn.Sequential(foreign(3, 3), nn.Linear(3, 3))
    graph_modules(model)
    assert [f.module for f in graphed_forwards(model)] == [model[0]]

    # Explicit classes replace the default; a graphed module's submodules are inside its graph.
    stack = _stack()
    graph_modules(stack, classes=(EvoformerStack, EvoformerBlock))
    assert [f.module for f in graphed_forwards(stack)] == [stack]
    with pytest.raises(TypeError, match="classes"):
        graph_modules(_stack(), classes=(int,))


def test_graphed_forward_arguments_and_signature() -> None:
    import inspect

    block = graph_modules(_block())
    assert inspect.signature(block.forward) == inspect.signature(EvoformerBlock.forward.__get__(block))
    with pytest.raises(TypeError, match="module"):
        GraphedForward(lambda x: x)
    with pytest.raises(ValueError, match="max_signatures"):
        GraphedForward(block, max_signatures=0)


def test_graph_modules_refuses_a_module_with_another_instance_forward() -> None:
    block = _block()
    block.forward = lambda *args: None
    with pytest.raises(ValueError, match="instance forward"):
        graph_modules(block)


def test_cpu_calls_run_the_class_forward_with_identical_outputs_and_gradients(seed) -> None:
    plain = _stack()
    model = graph_modules(copy.deepcopy(plain))
    args = _inputs(3, 5)
    ours = _leaf_copies(args)
    expected, got = plain(*args), model(*ours)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    dy = [torch.randn_like(o) for o in expected]
    torch.autograd.backward(expected, dy)
    torch.autograd.backward(got, dy)
    for (name, p), q in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(q.grad, p.grad), name
    for a, b in zip(ours[:2], args[:2], strict=True):
        assert torch.equal(a.grad, b.grad)
    for forward in graphed_forwards(model):
        assert forward.fallbacks == {NOT_ON_CUDA: 1} and forward.captures == 0


def test_ungraph_restores_the_class_forward(seed) -> None:
    stack = graph_modules(_stack())
    args = _inputs(3, 5, grad=False)
    expected = stack(*args)
    assert ungraph_modules(stack) is stack
    for block in stack.blocks:
        assert "forward" not in block.__dict__
        assert block.forward.__func__ is EvoformerBlock.forward
    assert graphed_forwards(stack) == []
    for a, b in zip(stack(*args), expected, strict=True):
        assert torch.equal(a, b)


def test_deepcopy_and_pickle_give_fresh_graphed_forwards(seed) -> None:
    stack = graph_modules(_stack(checkpoint=True))
    twin = copy.deepcopy(stack)
    for block, forward in zip(twin.blocks, graphed_forwards(twin), strict=True):
        assert forward.module is block and forward is not stack.blocks[0].forward
    buffer = io.BytesIO()
    torch.save(stack, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert [f.module for f in graphed_forwards(loaded)] == list(loaded.blocks)
    alone = copy.deepcopy(stack.blocks[0])  # without its stack, which is not copied along
    assert alone.forward.module is alone and alone.forward._stacks() == []
    # The copies still know their stack's checkpointing switch.
    for model in (twin, loaded):
        model(*_inputs(3, 5))
        assert all("checkpointing is on (EvoformerStack)" in f.fallbacks for f in graphed_forwards(model))


# ------------------------------------------------------------------------------ eager fallbacks


def test_checkpointing_runs_eagerly(seed) -> None:
    # The stack's switch, found by graph_modules.
    stack = graph_modules(_stack(checkpoint=True))
    m, z, *_ = out = stack(*_inputs(3, 5))
    sum(o.sum() for o in out).backward()
    for forward in graphed_forwards(stack):
        assert set(forward.fallbacks) == {"checkpointing is on (EvoformerStack)"}
    # Without gradients the stack does not checkpoint: only the device keeps it eager here.
    with torch.no_grad():
        stack(*_inputs(3, 5, grad=False))
    assert all(f.fallbacks[NOT_ON_CUDA] == 1 for f in graphed_forwards(stack))

    # A checkpoint the module knows nothing of: non-reentrant (saved-tensor hooks, then the
    # recomputation inside backward) and reentrant (recomputation inside backward).
    block = graph_modules(_block())
    forward = block.forward
    for reentrant in (False, True):
        out = checkpoint(block, *_inputs(3, 5), use_reentrant=reentrant)
        sum(o.sum() for o in out).backward()
    assert forward.fallbacks["saved-tensor hooks (non-reentrant checkpoint or offloading)"] == 2
    assert forward.fallbacks["called inside a backward pass (checkpoint recomputation)"] == 1

    # A module's own switch.
    own = _block()
    own.checkpoint = True
    graph_modules(own)
    own(*_inputs(3, 5))
    assert set(own.forward.fallbacks) == {"checkpointing is on (EvoformerBlock)"}


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: object = 1.0, *, shift: object = 0.0) -> torch.Tensor:
        scale = scale[0] if isinstance(scale, list | tuple) else scale
        shift = shift["v"] if isinstance(shift, dict) else shift
        shift = shift[0] if isinstance(shift, tuple) else shift
        return self.linear(x) * scale + shift


def test_non_constant_arguments_run_eagerly() -> None:
    module = graph_modules(Scaled(), classes=(Scaled,))
    x = torch.randn(2, 4)
    assert torch.equal(module(x, [2.0]), Scaled.forward(module, x, [2.0]))
    module(x, shift={"v": 1.0})
    module(x, shift=(torch.ones(1),))  # a tensor inside a tuple is not a constant
    module(x, float("nan"))
    module(x, (2.0, None), shift=3)  # constants: the device decides
    assert module.forward.fallbacks == {
        "argument 1 is not a constant (list)": 1,
        "argument 'shift' is not a constant (dict)": 1,
        "argument 'shift' is not a constant (tuple)": 1,
        "argument 1 is not a constant (float)": 1,
        NOT_ON_CUDA: 1,
    }


# ---------------------------------------------- caching and gradients, with a CPU stand-in for capture


def _fake_make_graphed(bound: nn.Module, samples: tuple[torch.Tensor, ...]) -> None:
    """`make_graphed_callables`' contract on the CPU, without a graph: each call's tensors are copied
    into the static sample inputs, and the outputs and the input and parameter gradients are static
    buffers that every call overwrites and that are returned detached (as the graph replays do)."""
    params = tuple(bound.parameters())
    surface = (*samples, *params)
    grad_at_capture = torch.is_grad_enabled()
    state: dict = {}

    def run() -> None:
        with torch.set_grad_enabled(grad_at_capture):
            outs, spec = tree_flatten(type(bound).forward(bound, *samples))
        state["live"] = outs
        if "outs" not in state:
            state["outs"], state["spec"] = [o.detach().clone() for o in outs], spec
        for buffer, out in zip(state["outs"], outs, strict=True):
            buffer.copy_(out.detach())

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            for sample, x in zip(samples, inputs, strict=False):
                if sample.data_ptr() != x.data_ptr():
                    sample.copy_(x)
            run()
            return tuple(b.detach() for b in state["outs"])

        @staticmethod
        @once_differentiable
        def backward(ctx, *grads):
            live = [(o, g) for o, g in zip(state["live"], grads, strict=True) if o.requires_grad]
            wanted = [t for t in surface if t.requires_grad]
            got = torch.autograd.grad([o for o, _ in live], wanted, [g for _, g in live], allow_unused=True)
            if "grads" not in state:
                state["grads"] = [None if g is None else torch.empty_like(g) for g in got]
            for buffer, g in zip(state["grads"], got, strict=True):
                if buffer is not None:
                    buffer.copy_(g)
            it = iter(state["grads"])
            return tuple((b.detach() if (b := next(it)) is not None else None) if t.requires_grad else None
                         for t in surface)  # fmt: skip

    run()
    bound.forward = lambda *tensors: tree_unflatten(list(Replay.apply(*tensors, *params)), state["spec"])


@pytest.fixture
def fake_capture(monkeypatch):
    """CPU tensors count as CUDA ones and captures use `_fake_make_graphed`."""
    monkeypatch.setattr(graphed_module, "_all_on_cuda", lambda tensors: bool(tensors))
    monkeypatch.setattr(graphed_module, "_make_graphed", _fake_make_graphed)


def test_replays_match_the_plain_block_and_accumulate_grad(fake_capture, seed) -> None:
    plain = _block()
    block = graph_modules(copy.deepcopy(plain))
    forward = block.forward
    kept = []
    for it in range(3):  # no zero_grad: .grad accumulates over the three calls
        args = _inputs(3, 5, seed=it)
        ours = _leaf_copies(args)
        expected, got = plain(*args), block(*ours)
        for a, b in zip(got, expected, strict=True):
            assert_close(a, b)
        dy = [torch.randn_like(o) for o in expected]
        torch.autograd.backward(expected, dy)
        torch.autograd.backward(got, dy)
        for (name, p), q in zip(plain.named_parameters(), block.parameters(), strict=True):
            assert_close(q.grad, p.grad, msg=f"{name} after call {it}")
        for a, b in zip(ours[:2], args[:2], strict=True):
            assert_close(a.grad, b.grad)
        kept.append((ours[0], ours[0].grad.clone()))
    assert forward.captures == 1 and len(forward.signatures) == 1 and not forward.fallbacks
    for leaf, grad in kept:  # later replays did not overwrite an earlier input's .grad
        assert torch.equal(leaf.grad, grad)


def test_signatures_capture_once_each_and_the_oldest_is_dropped(fake_capture, seed) -> None:
    block = graph_modules(_block(), max_signatures=2)
    forward = block.forward
    shapes = [(3, 5), (4, 6), (3, 5), (2, 7), (4, 6)]
    for s, n in shapes:
        block(*_inputs(s, n))
    # (3, 5) and (4, 6) captured, (3, 5) replayed, (2, 7) evicts (4, 6), which is captured again.
    assert forward.captures == 4 and len(forward.signatures) == 2
    dropped = list(forward._graphs.values())[0].bound
    assert [key[2][0][1] for key in forward.signatures] == [(1, 2, 7, TINY.c_m), (1, 4, 6, TINY.c_m)]
    with torch.no_grad():  # grad mode is part of the signature
        block(*_inputs(4, 6, grad=False))
    assert forward.captures == 5
    # A non-tensor argument's value is part of the signature too.
    block(*_inputs(2, 7), chunk_size=None)
    block(*_inputs(2, 7), chunk_size=4)
    assert forward.captures == 7 and not forward.fallbacks
    assert "forward" not in dropped.__dict__  # an evicted graph lets go of its replay
    kept = [graph.bound for graph in forward._graphs.values()]
    ungraph_modules(block)
    assert forward.signatures == () and all("forward" not in b.__dict__ for b in kept)


def test_mode_changes_run_eagerly_and_moved_parameters_recapture(fake_capture, seed) -> None:
    block = graph_modules(_block())
    forward = block.forward
    args = _inputs(3, 5)
    block(*args)
    block.eval()
    expected = EvoformerBlock.forward(block, *args)
    for a, b in zip(block(*args), expected, strict=True):
        assert torch.equal(a, b)
    block.msa_dropout_layer.train()  # mixed modes differ from the captured ones as well
    block(*args)
    assert forward.fallbacks == {"training mode differs from the captured one": 2}
    forward.reset()
    block(*args)
    assert forward.captures == 2 and len(forward.signatures) == 1
    block.core.pair_transition.linear_1.weight.data = block.core.pair_transition.linear_1.weight.data.clone()
    block(*args)
    assert forward.captures == 3 and len(forward.signatures) == 1


def test_a_failed_capture_warns_once_and_runs_eagerly(monkeypatch, seed) -> None:
    def failing(bound, samples):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphed_module, "_all_on_cuda", lambda tensors: bool(tensors))
    monkeypatch.setattr(graphed_module, "_make_graphed", failing)
    block = graph_modules(_block())
    args = _inputs(3, 5)
    with pytest.warns(UserWarning, match="capturing EvoformerBlock failed"):
        out = block(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block(*args)
    for a, b in zip(out, EvoformerBlock.forward(block, *args), strict=True):
        assert torch.equal(a, b)
    assert block.forward.fallbacks == {"its capture failed": 2} and block.forward.captures == 0


def test_captures_run_with_the_autocast_cache_off_and_restore_it(monkeypatch, seed) -> None:
    seen = []

    def recording(bound, samples, allow_unused_input):
        seen.append(torch.is_autocast_cache_enabled())
        if len(seen) == 2:
            raise RuntimeError("capture failed")
        _fake_make_graphed(bound, samples)

    monkeypatch.setattr(graphed_module, "_all_on_cuda", lambda tensors: bool(tensors))
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", recording)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    block = graph_modules(_block())
    assert torch.is_autocast_cache_enabled()
    block(*_inputs(3, 5))
    assert seen == [False] and torch.is_autocast_cache_enabled()
    with pytest.warns(UserWarning, match="capturing EvoformerBlock failed"):
        block(*_inputs(4, 6))
    assert seen == [False, False] and torch.is_autocast_cache_enabled()
    assert block.forward.captures == 1 and block.forward.fallbacks == {"its capture failed": 1}


# ------------------------------------------------------------------------------ CUDA graphs


def _cuda_pair(ops: str, dtype: torch.dtype, dropout: float = 0.0) -> tuple[nn.Module, nn.Module]:
    """A tiny block on CUDA (swapped to hfkit's ops with `ops` "hfkit") and a graphed copy."""
    plain = _block(dropout).to("cuda", dtype)
    if ops == "hfkit":
        plain = to_hfkit(plain)
    return plain, graph_modules(copy.deepcopy(plain))


def _cuda_tolerance(dtype: torch.dtype) -> dict:
    # fp32: the same kernels, but summation order may differ between a captured and an eager run
    # (atomics, cuBLAS workspaces per stream), so a few float32 ulps of the gradients' sums.
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


def _assert_all_close(got, expected, dtype: torch.dtype) -> None:
    """Each tensor of `got` close to its counterpart in `expected` at `_cuda_tolerance(dtype)`."""
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **_cuda_tolerance(dtype))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("ops", ["torch", "hfkit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_graphed_block_matches_the_plain_block(ops, dtype, seed) -> None:
    plain, block = _cuda_pair(ops, dtype)
    forward = block.forward
    kept = []
    for it in range(3):  # new input values, same shapes; .grad accumulates (no zero_grad)
        args = _inputs(3, 5, "cuda", dtype, seed=it)
        ours = _leaf_copies(args)
        expected, got = plain(*args), block(*ours)
        _assert_all_close(got, expected, dtype)
        dy = [torch.randn_like(o) for o in expected]
        torch.autograd.backward(expected, dy)
        torch.autograd.backward(got, dy)
        for (name, p), q in zip(plain.named_parameters(), block.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, **_cuda_tolerance(dtype), msg=f"{name}, call {it}")
        _assert_all_close([a.grad for a in ours[:2]], [b.grad for b in args[:2]], dtype)
        kept.append((ours[0], ours[0].grad.clone()))
    assert forward.captures == 1 and len(forward.signatures) == 1 and not forward.fallbacks
    for leaf, grad in kept:
        assert torch.equal(leaf.grad, grad)


@pytest.mark.cuda
@cuda
def test_cuda_second_shape_no_grad_and_autocast(seed) -> None:
    plain, block = _cuda_pair("torch", torch.float32)
    forward = block.forward
    for s, n in [(3, 5), (4, 6), (3, 5)]:
        out = block(*_inputs(s, n, "cuda"))
        sum(o.sum() for o in out).backward()
    assert forward.captures == 2 and len(forward.signatures) == 2
    with torch.no_grad():
        for it in range(2):
            args = _inputs(3, 5, "cuda", grad=False, seed=10 + it)
            _assert_all_close(block(*args), plain(*args), torch.float32)
    assert forward.captures == 3
    args = _inputs(3, 5, "cuda", grad=False)
    for cache in (False, True):  # one signature: autocast's cache is off in every capture
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache):
            got, expected = block(*args), plain(*args)
            assert torch.is_autocast_cache_enabled() == cache
        _assert_all_close(got, expected, torch.bfloat16)
    assert forward.captures == 4 and not forward.fallbacks


@pytest.mark.cuda
@cuda
def test_cuda_autocast_with_its_cache_replays_current_weights(seed) -> None:
    # Within one autocast region (cache on) the weights change between two calls: the graphs cast
    # them afresh at each replay, and the first call left no cast of them in the cache.
    plain, block = _cuda_pair("hfkit", torch.float32)
    forward = block.forward
    args = _inputs(3, 5, "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        block(*args)
        with torch.no_grad():
            for p, q in zip(plain.parameters(), block.parameters(), strict=True):
                p.mul_(0.5).add_(0.01)
                q.mul_(0.5).add_(0.01)
        got = [o.clone() for o in block(*args)]
    with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
        expected = plain(*args)
    _assert_all_close(got, expected, torch.bfloat16)
    assert forward.captures == 1 and not forward.fallbacks


@pytest.mark.cuda
@cuda
def test_cuda_compiled_swapped_block_under_reduce_overhead(seed) -> None:
    # torch.compile(mode="reduce-overhead") replays CUDA-graph trees of the swapped block, every hfkit
    # op inside them; an op keeping an allocation made in the tree's pool fails there ("not tracked as
    # outputs"), as the outer product mean's backward op once did with its bias gradient's ones.
    # Gradients by autograd.grad: `.grad` accumulation across replays fails under reduce-overhead for
    # the plain block too (torch 2.11: "accessing tensor output of CUDAGraphs that has been overwritten").
    plain = to_hfkit(_block().to("cuda"))
    compiled = torch.compile(copy.deepcopy(plain), mode="reduce-overhead")
    tolerance = {"rtol": 1e-3, "atol": 1e-3}
    for it in range(4):  # warm-up, recording, then replays
        args = _inputs(3, 5, "cuda", seed=it)
        ours = _leaf_copies(args)
        torch.compiler.cudagraph_mark_step_begin()
        expected, got = plain(*args), compiled(*ours)
        dy = [torch.randn_like(o) for o in expected]
        want = torch.autograd.grad(expected, [*args[:2], *plain.parameters()], dy)
        have = torch.autograd.grad(got, [*ours[:2], *compiled.parameters()], dy)
        names = ["m", "z", "grad m", "grad z", *(f"grad {name}" for name, _ in plain.named_parameters())]
        for name, a, b in zip(names, [*got, *have], [*expected, *want], strict=True):
            where = f"{name}, call {it}"
            torch.testing.assert_close(a, b, **tolerance, msg=lambda text, where=where: f"{where}: {text}")


@pytest.mark.cuda
@cuda
def test_cuda_inside_an_outer_capture_runs_eagerly(seed) -> None:
    plain, block = _cuda_pair("torch", torch.float32)
    args = _inputs(3, 5, "cuda", grad=False)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture (this one graphs the block)
            for _ in range(2):
                block(*args)
        torch.cuda.current_stream().wait_stream(side)
        outer = torch.cuda.CUDAGraph()
        with torch.cuda.graph(outer):
            out = block(*args)
        outer.replay()
        torch.cuda.synchronize()
        expected = plain(*args)
    _assert_all_close(out, expected, torch.float32)
    assert block.forward.fallbacks == {"an outer CUDA graph capture is in progress": 1}
    assert block.forward.captures == 1


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("ops", ["torch", "hfkit"])
def test_cuda_dropout_draws_new_masks_at_each_replay(ops, seed) -> None:
    _, block = _cuda_pair(ops, torch.float32, dropout=0.25)
    args = _inputs(3, 5, "cuda")
    first = [o.detach().clone() for o in block(*args)]
    second = [o.detach().clone() for o in block(*args)]
    assert block.forward.captures == 1 and not block.forward.fallbacks
    assert not torch.equal(first[0], second[0]) and not torch.equal(first[1], second[1])
