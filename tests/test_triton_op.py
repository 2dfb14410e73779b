"""hfkit.ops._triton.TritonOp: the two routes every fused op can take give the same results.

In eager mode with plain tensors an op runs its body directly (no custom-op dispatch: the custom op
is replaced by a stub that fails, and every op still runs forward and backward); under a
`TorchDispatchMode` (as under torch.compile's tracing, fake tensors or flop counters) it goes through
the registered `torch.ops.hfkit.*` custom ops, forward and backward (the mode records them). Outputs
and gradients of the two routes are identical: the same kernels run on the same inputs. On CPU the
kernels run under TRITON_INTERPRET=1 (conftest.py).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hfkit.ops as hops
from hfkit.ops._triton import TritonOp, direct_call

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
        reason="the Triton path needs CUDA or TRITON_INTERPRET=1",
    ),
]

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
MODULES = [
    "layer_norm",
    "softmax",
    "evoformer_attention",
    "elementwise",
    "triangle_multiplication",
    "gated_linear",
]


def all_ops() -> list[TritonOp]:
    ops = []
    for name in MODULES:
        module = importlib.import_module(f"hfkit.ops.{name}")
        ops += [v for v in vars(module).values() if isinstance(v, TritonOp)]
    return ops


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "hfkit":
            self.ops.add(func._opname)
        return func(*args, **(kwargs or {}))


def _randn(*shape, grad=True):
    return torch.randn(*shape, device=DEVICE).requires_grad_(grad)


def _divide_rows(x, scale):
    return hops.row_scale(x, scale, divide=True)


def _cases():
    """(name, inputs, call, the hfkit custom ops it must dispatch under a mode)."""
    c_z, c_h = 6, 5
    tri = [_randn(c_z), _randn(c_z), _randn(4 * c_h + c_z, c_z), _randn(4 * c_h + c_z)]
    tri += [_randn(c_h), _randn(c_h), _randn(c_z, c_h), _randn(c_z)]
    return [
        (
            "layer_norm",
            [_randn(3, 7, 10), _randn(10), _randn(10)],
            lambda x, w, b: hops.layer_norm(x, (10,), w, b),
            {"layer_norm_fwd", "layer_norm_bwd"},
        ),
        (
            "softmax",
            [_randn(2, 3, 5, 9), _randn(1, 3, 5, 9)],
            lambda x, b: hops.softmax(x, b, torch.ones(2, 1, 1, 9, device=DEVICE)),
            {"softmax_fwd", "softmax_bwd"},
        ),
        (
            "evoformer_attention",
            [_randn(1, 2, 2, 5, 16), _randn(1, 2, 2, 7, 16), _randn(1, 2, 2, 7, 16), _randn(1, 1, 2, 5, 7)],
            lambda q, k, v, b: hops.evoformer_attention(q, k, v, b),
            {"evoformer_attention_fwd", "evoformer_attention_bwd"},
        ),
        (
            "sigmoid_gate",
            [_randn(3, 4, 6), _randn(3, 4, 6), _randn(6)],
            hops.sigmoid_gate,
            {"sigmoid_gate_fwd", "sigmoid_gate_bwd"},
        ),
        (
            "bias_dropout_add",
            [_randn(2, 5, 6), _randn(2, 5, 6), _randn(6)],
            lambda x, r, b: hops.bias_dropout_add(x, r, b, p=0.3, shared_dim=-2, seed=7),
            {"bias_dropout_add_fwd", "dropout_bwd"},
        ),
        (
            "row_scale",
            [_randn(2, 5, 6)],
            functools.partial(_divide_rows, scale=_randn(2, 5, 1, grad=False).abs() + 0.5),
            {"row_scale"},
        ),
        (
            "triangle_multiplication",
            [_randn(1, 5, 5, c_z), *tri],
            lambda z, *w: hops.triangle_multiplication(z, None, *w),
            {"tri_mul_ln_in_fwd", "tri_mul_out_fwd", "tri_mul_out_bwd", "tri_mul_ln_in_bwd"},
        ),
    ]


def _run(inputs, call):
    out = call(*inputs)
    grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
    return [out.detach(), *grads]


@pytest.mark.parametrize("case", range(len(_cases())), ids=[c[0] for c in _cases()])
def test_direct_and_dispatched_routes_agree(case, monkeypatch):
    torch.manual_seed(case)
    _name, inputs, call, expected_ops = _cases()[case]
    recorder = _Recorder()
    with recorder:
        dispatched = _run(inputs, call)
    assert expected_ops <= recorder.ops, f"custom ops dispatched: {sorted(recorder.ops)}"

    def no_dispatch(*args):
        raise AssertionError("eager call went through the custom op")

    for op in all_ops():
        monkeypatch.setattr(op, "op", no_dispatch)
    direct = _run(inputs, call)
    for a, b in zip(direct, dispatched, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_kernels_take_float_arguments_as_float32(monkeypatch):
    # torch.compile hands a user-defined Triton kernel Python floats as float64 scalars: a kernel that
    # computed with one would run float64 arithmetic there (slower, and unlike eager, e.g. dropout's
    # threshold). Every kernel the cases launch with a float argument casts it to float32 on entry.
    import hfkit.ops._triton as triton_module

    real = triton_module.launch
    floats: dict[object, set[str]] = {}

    def spy(kernel, grid, *args, **meta):
        for name, arg in zip(inspect.signature(kernel.fn).parameters, args, strict=False):
            if isinstance(arg, float):
                floats.setdefault(kernel, set()).add(name)
        return real(kernel, grid, *args, **meta)

    for name in MODULES:
        module = importlib.import_module(f"hfkit.ops.{name}")
        if getattr(module, "launch", None) is real:
            monkeypatch.setattr(module, "launch", spy)
    for _name, inputs, call, _ops in _cases():
        _run(inputs, call)
    launched = {kernel.fn.__name__ for kernel in floats}
    assert {"_layer_norm_fwd_kernel", "_evo_fwd_kernel", "_bias_dropout_add_kernel"} <= launched, launched
    for kernel, names in floats.items():
        source = inspect.getsource(kernel.fn)
        for name in names:
            assert f"{name} = tl.cast({name}, tl.float32)" in source, f"{kernel.fn.__name__}: {name}"


def test_direct_call_rule():
    x = torch.randn(3)
    assert direct_call((x, torch.nn.Parameter(torch.randn(3)), 4, None))
    with _Recorder():
        assert not direct_call((x,))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
    assert not direct_call((fake,))


def test_direct_bodies_launch_unwrapped_and_the_flag_is_restored(monkeypatch):
    # A body run directly (forward and backward) starts its kernels itself; outside any body launches
    # go through wrap_triton (what tracing needs), also after a body raised.
    from hfkit.ops import _triton

    module = importlib.import_module("hfkit.ops.layer_norm")
    real, seen = module.launch, []

    def spy(kernel, grid, *args, **meta):
        seen.append((kernel.fn.__name__, _triton.wraps_launches()))
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(module, "launch", spy)
    x, w = _randn(3, 8), _randn(8)
    torch.autograd.grad(hops.layer_norm(x, (8,), w, None).sum(), [x, w])
    assert [name for name, _ in seen] == ["_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel"]
    assert not any(wrapped for _, wrapped in seen)
    assert _triton.wraps_launches()

    def broken(*args, **meta):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(module, "launch", broken)
    with pytest.raises(RuntimeError, match="launch failed"):
        hops.layer_norm(x, (8,), w, None)
    assert _triton.wraps_launches() and not _triton._DIRECT.active


@pytest.mark.skipif(DEVICE != "cuda", reason="fake tensors through wrap_triton need compiled kernels")
def test_the_custom_op_route_inside_a_direct_body_still_traces(monkeypatch):
    # A call inside a direct body that must take the custom op (fake tensors here; compiled autograd
    # tracing a backward) lets torch's setting decide: its launches go through wrap_triton.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hfkit.ops import _triton

    monkeypatch.setattr(_triton._DIRECT, "active", True)
    with FakeTensorMode() as mode:
        x, w = mode.from_tensor(_randn(3, 8)), mode.from_tensor(_randn(8))
        y = hops.layer_norm(x, (8,), w, None)
    assert y.shape == (3, 8) and _triton._DIRECT.active


def test_nothing_is_mutated_while_compiling(monkeypatch):
    # Dynamo traces the fused ops' autograd.Functions, whose forwards call TritonOps: a global
    # mutation there (the direct-call flag) breaks the graph, as it did 38 times in a swapped block.
    from hfkit.ops import _triton

    class Frozen:
        active = False

        def __setattr__(self, name, value):
            raise AssertionError("the direct-call flag was set while compiling")

    monkeypatch.setattr(_triton, "_DIRECT", Frozen())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    op = importlib.import_module("hfkit.ops.layer_norm")._layer_norm_fwd
    x = _randn(3, 8, grad=False)
    y, _mean, _rstd = op(x, None, None, 8, 1e-5, x.dtype)
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (8,)), rtol=1e-5, atol=1e-5)


def test_unwrapped_apply_is_the_functions_apply():
    from hfkit.ops._triton import _unwrapped_apply

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scale):
            ctx.scale = scale
            return x * 2 * scale

        @staticmethod
        def backward(ctx, g):
            return g * 2 * ctx.scale, None

    apply = _unwrapped_apply(Double)
    assert apply.__self__ is Double and inspect.isbuiltin(apply)  # torch's C++ apply, no Python wrapper
    x = torch.randn(4, requires_grad=True)
    y = apply(x, 3.0)
    assert y.grad_fn is not None and type(y.grad_fn).__name__ == "DoubleBackward"
    (grad,) = torch.autograd.grad(y.sum(), [x])
    torch.testing.assert_close(grad, torch.full((4,), 6.0))


def test_every_op_is_registered_with_torch():
    ops = all_ops()
    assert len(ops) == 25
    for op in ops:
        assert getattr(torch.ops.hfkit, op.name).default is not None


# --- binding each kernel's launch once per specialization (hfkit.ops._triton.launch) ------------------


def _bound_launches(kernel) -> dict:
    from hfkit.ops import _triton

    return _triton._BOUND.get(id(kernel), {})


def test_launch_binds_once_per_specialization_and_matches_the_reference(monkeypatch):
    from hfkit.ops import _triton

    monkeypatch.setattr(_triton, "_BOUND", {})  # no bindings from earlier tests
    ln = importlib.import_module("hfkit.ops.layer_norm")
    kernel = ln._layer_norm_fwd_kernel
    ln_ref = ln.layer_norm_reference
    torch.manual_seed(0)
    before = 0
    w, b = _randn(24, grad=False), _randn(24, grad=False)
    for _ in range(3):  # fresh inputs of one specialization: one binding, right results every call
        x = _randn(5, 24, grad=False)
        torch.testing.assert_close(hops.layer_norm(x, (24,), w, b), ln_ref(x, (24,), w, b))
    assert len(_bound_launches(kernel)) == before + 1
    # Another row length of the same tile and divisibility (25: BLOCK_N 32, not a multiple of 16) is
    # the same specialization; a multiple of 16 (32) and a 16-byte-misaligned view are others
    # (Triton compiles separate kernels for them): each of those gets its own binding.
    for n in (25, 32):
        x, wn, bn = _randn(5, n, grad=False), _randn(n, grad=False), _randn(n, grad=False)
        torch.testing.assert_close(hops.layer_norm(x, (n,), wn, bn), ln_ref(x, (n,), wn, bn))
    misaligned = _randn(5 * 24 + 1, grad=False)[1:].view(5, 24)
    torch.testing.assert_close(hops.layer_norm(misaligned, (24,), w, b), ln_ref(misaligned, (24,), w, b))
    assert len(_bound_launches(kernel)) == before + 3
    # Without weight and bias the HAS_W/HAS_B constexprs differ: another binding, still right.
    x = _randn(5, 24, grad=False)
    torch.testing.assert_close(hops.layer_norm(x, (24,)), ln_ref(x, (24,)))
    assert len(_bound_launches(kernel)) == before + 4


def test_bind_arguments_orders_keywords_and_defaults_and_refuses_positional_constexprs():
    from hfkit.ops._triton import bind_arguments

    ln = importlib.import_module("hfkit.ops.layer_norm")
    kernel = ln._layer_norm_fwd_kernel
    meta = {"BLOCK_N": 32, "HAS_W": True, "HAS_B": False, "BLOCK_M": 4, "num_warps": 1}
    names, defaults, options = bind_arguments(kernel, 11, meta)
    assert names == ("HAS_W", "HAS_B", "BLOCK_M", "BLOCK_N")  # the kernel's order, not the call's
    assert defaults == () and options == {"num_warps": 1}
    with pytest.raises(ValueError, match="HAS_W.*by keyword"):
        bind_arguments(kernel, 12, {"HAS_B": False, "BLOCK_M": 4, "BLOCK_N": 32})
    with pytest.raises(ValueError, match="BLOCK_N"):
        bind_arguments(kernel, 11, {"HAS_W": True, "HAS_B": False, "BLOCK_M": 4})


def test_profiler_sees_each_op_by_name_with_shapes():
    x, w, b = _randn(3, 7, 10), _randn(10), _randn(10)
    with torch.profiler.profile(record_shapes=True) as prof:
        out = hops.layer_norm(x, (10,), w, b)
        out.sum().backward()
    events = {e.key: e for e in prof.key_averages(group_by_input_shape=True)}
    assert "hfkit::layer_norm_fwd" in events and "hfkit::layer_norm_bwd" in events
    assert events["hfkit::layer_norm_fwd"].input_shapes[0] == [3, 7, 10]
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x, (10,), w, b))


def test_launch_hooks_count_only_when_they_would_call_something() -> None:
    """The bound launch builds launch metadata only for hooks that would read it: a set hook or a
    non-empty `HookChain` (torch's profiler adds to the chain), not None or an empty chain."""
    from hfkit.ops._triton import _arg_key, _hooked

    assert not _hooked(None)
    assert _hooked(lambda metadata: None)
    knobs = pytest.importorskip("triton.knobs")
    chain = knobs.HookChain()
    assert not _hooked(chain)
    chain.add(lambda metadata: None)
    assert _hooked(chain)
    # Specialization keys: bools and ints apart, ints by Triton's value classes, tensors by dtype.
    assert _arg_key(True) is True and _arg_key(1) != _arg_key(True)
    assert _arg_key(32) == _arg_key(48) != _arg_key(33)
    assert _arg_key(2**40) != _arg_key(2**4)
    assert _arg_key(torch.zeros(4)) == (torch.float32, True)


def test_inductor_launches_hfkit_kernels_statically_unless_told_otherwise():
    # Importing hfkit's ops turns on Inductor's static launcher for user-defined Triton kernels (15%
    # of a checkpointed compiled step on the H200); a value the user set stays, and so does torch's
    # environment override. Each case runs in a fresh interpreter: the setting is made at import.
    import subprocess
    import sys

    pytest.importorskip("triton")
    code = (
        "import sys, torch._inductor.config as c\n"
        "if sys.argv[1] == 'user-off': c.static_launch_user_defined_triton_kernels = False\n"
        "import hfkit.ops\n"
        "from hfkit.ops._triton import launch_statically_under_compile as f\n"
        "print(c.static_launch_user_defined_triton_kernels, f())\n"
    )
    force = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"
    env = {k: v for k, v in os.environ.items() if k != force}

    def setting(case: str, **extra: str) -> list[str]:
        argv = [sys.executable, "-c", code, case]
        done = subprocess.run(argv, env={**env, **extra}, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()

    assert setting("default") == ["True", "True"]
    assert setting("user-off") == ["False", "False"]
    assert setting("default", **{force: "0"}) == ["False", "False"]
