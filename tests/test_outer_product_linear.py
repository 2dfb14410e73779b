"""hfkit.ops.outer_product_linear and the outer product mean swap (hfkit.nn.OuterProductMean).

outer_product_linear equals `linear(flatten(einsum(a ⊗ b)))` forward and in every gradient (odd sizes,
C != E, I != J, one or two batch dimensions, strided operands, float64, float32, bfloat16 and float16,
with and without a bias, under autocast and under torch.compile) while keeping a and b, not the
[*, I, J, C*E] outer product, for the backward (compiled too: the compiler sees opaque custom ops,
which pass opcheck), and copying nothing of the outer product's size; the swapped module equals the
model's (masked, chunked), keeps the state_dict and swaps back; bad inputs name the argument.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from conftest import assert_close, output_and_grads
from torch import nn

import hfkit
import hfkit.nn as hnn
from hfkit.model import EvoformerStack, ModelConfig, OuterProductMean
from hfkit.ops import _linear, outer_product_linear, outer_product_linear_reference

pytestmark = pytest.mark.usefixtures("one_thread")
opl = importlib.import_module("hfkit.ops.outer_product_linear")


@pytest.fixture(params=["batched", "rows", "projected"])
def layout(request, monkeypatch):
    """Every way the op builds the outer product: stride-0 batched matmuls (S <= STRIDE0_MAX_ROWS, the
    test sizes) and one matmul plus a swapping copy (forced here by a limit of 0 rows); projected: the
    forward projects first and builds none (long sequences; forced here)."""
    if request.param == "rows":
        monkeypatch.setattr(opl, "STRIDE0_MAX_ROWS", 0)
    if request.param == "projected":
        monkeypatch.setattr(opl, "_projects_first", lambda *sizes: True)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("batch", [(), (2,)], ids=["nobatch", "batch"])
@pytest.mark.parametrize("e", [4, 5], ids=["e4", "e5"])
def test_matches_reference(dtype, with_bias, batch, e, layout, seed):
    s, i, j, c, n = 5, 7, 6, 3, 9
    a = torch.randn(*batch, s, i, c, dtype=dtype)
    b = torch.randn(*batch, s, j, e, dtype=dtype)
    w = torch.randn(n, c * e, dtype=dtype) / (c * e) ** 0.5
    bias = torch.randn(n, dtype=dtype) if with_bias else None
    dy = torch.randn(*batch, i, j, n, dtype=dtype)
    out, grads = output_and_grads(outer_product_linear, [a, b, w, bias], dy)
    f32 = [t.float() if t is not None else None for t in (a, b, w, bias)]
    ref, ref_grads = output_and_grads(outer_product_linear_reference, f32, dy.float())
    assert out.dtype == dtype and out.shape == (*batch, i, j, n)
    if layout == "projected":  # rounded in another order (p, then sums over (c, s)): to the output's scale
        top = ref.abs().max()
        assert_close(out.float() / top, ref / top, dtype=dtype, msg="output")
    else:
        assert_close(out.float(), ref, dtype=dtype, msg="output")
    for k, (actual, expected) in enumerate(zip(grads, ref_grads, strict=True)):
        scale = expected.abs().max().clamp_min(1e-12)
        assert actual.dtype == dtype and actual.shape == expected.shape
        assert_close(actual.float() / scale, expected / scale, dtype=dtype, msg=f"gradient {k}")


@pytest.mark.parametrize(
    "batch, s, i, j, c, e",
    [
        ((), 5, 7, 6, 3, 4),
        ((2, 3), 3, 5, 9, 4, 2),  # two batch dimensions, C > E
        ((1,), 1, 1, 1, 1, 1),
        ((2,), 6, 11, 1, 5, 7),  # one column j
        ((3,), 2, 1, 8, 7, 3),  # one row i
    ],
    ids=["odd", "batch2d", "ones", "onecol", "onerow"],
)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_float64_output_and_gradients_equal_the_reference(batch, s, i, j, c, e, with_bias, layout, seed):
    # The outer product is built as [*, I, J, E, C] and its gradient as [*, I, J, E, C] and
    # [*, J, I, C, E]: a mix-up of c and e or of i and j shows at float64 precision whenever C != E or
    # I != J.
    n = 5
    f64 = torch.float64
    a, b = torch.randn(*batch, s, i, c, dtype=f64), torch.randn(*batch, s, j, e, dtype=f64)
    w = torch.randn(n, c * e, dtype=f64)
    bias = torch.randn(n, dtype=f64) if with_bias else None
    dy = torch.randn(*batch, i, j, n, dtype=f64)
    out, grads = output_and_grads(outer_product_linear, [a, b, w, bias], dy)
    ref, ref_grads = output_and_grads(outer_product_linear_reference, [a, b, w, bias], dy)
    assert out.shape == (*batch, i, j, n)
    assert_close(out, ref, msg="output")
    for k, (actual, expected) in enumerate(zip(grads, ref_grads, strict=True)):
        assert actual.shape == expected.shape
        assert_close(actual, expected, msg=f"gradient {k}")


def test_gradcheck(seed):
    f64 = torch.float64
    args = (
        torch.randn(2, 3, 4, 3, dtype=f64),
        torch.randn(2, 3, 5, 2, dtype=f64),
        torch.randn(4, 6, dtype=f64),
        torch.randn(4, dtype=f64),
    )
    assert torch.autograd.gradcheck(outer_product_linear, [t.requires_grad_() for t in args])


def test_strided_operands_equal_the_reference(layout, seed):
    # a as the model's row chunks pass it (a narrow over i), b with e outermost in memory; the weight
    # transposed in memory.
    f64 = torch.float64
    a = torch.randn(2, 4, 9, 3, dtype=f64)[:, :, 2:7]
    b = torch.randn(2, 5, 4, 6, dtype=f64).permute(0, 2, 3, 1)  # [2, S 4, J 6, E 5]
    w = torch.randn(15, 7, dtype=f64).t()
    bias = torch.randn(7, dtype=f64)
    assert not (a.is_contiguous() or b.is_contiguous() or w.is_contiguous())
    dy = torch.randn(2, 5, 6, 7, dtype=f64)
    out, grads = output_and_grads(outer_product_linear, [a, b, w, bias], dy)
    ref, ref_grads = output_and_grads(outer_product_linear_reference, [a, b, w, bias], dy)
    assert_close(out, ref, msg="output")
    for k, (actual, expected) in enumerate(zip(grads, ref_grads, strict=True)):
        assert_close(actual, expected, msg=f"gradient {k}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_no_outer_product_sized_copy(dtype, seed):
    # Up to STRIDE0_MAX_ROWS rows (here 9) the forward and the backward build the outer product and its
    # gradient directly in the layouts their matmuls read: no copy anywhere as large as the [I, J, C*E]
    # outer product (dy's one copy, in the backward, is N / (C*E) of it). The reference's flatten copies
    # it once, as the check must see.
    s, i, j, c, e, n = 9, 16, 12, 4, 3, 4  # S > C, E as in the model: a copy of a or b per pair row is big
    outer_size = i * j * c * e
    for fn, copies_outer in ((outer_product_linear, False), (outer_product_linear_reference, True)):
        a = torch.randn(2, s, i, c, dtype=dtype, requires_grad=True)
        b = torch.randn(2, s, j, e, dtype=dtype, requires_grad=True)
        w = torch.randn(n, c * e, dtype=dtype, requires_grad=True)
        bias = torch.randn(n, dtype=dtype, requires_grad=True)
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
        ) as prof:
            fn(a, b, w, bias).backward(torch.randn(2, i, j, n, dtype=dtype))
        copied = [ev.input_shapes[0] for ev in prof.events() if ev.key == "aten::copy_"]
        assert any(math.prod(shape) >= outer_size for shape in copied) == copies_outer, copied


def test_compiles_as_one_graph(seed):
    # fullgraph: no graph break (Dynamo refuses, among others, a non-contiguous `out=`).
    torch._dynamo.reset()
    args = [torch.randn(2, 3, 5, 4), torch.randn(2, 3, 6, 2), torch.randn(7, 8), torch.randn(7)]
    dy = torch.randn(2, 5, 6, 7)
    compiled = torch.compile(outer_product_linear, backend="aot_eager", fullgraph=True)
    out, grads = output_and_grads(compiled, args, dy)
    ref, ref_grads = output_and_grads(outer_product_linear_reference, args, dy)
    assert_close(out, ref, msg="output")
    for k, (actual, expected) in enumerate(zip(grads, ref_grads, strict=True)):
        assert_close(actual, expected, msg=f"gradient {k}")


def test_only_the_needed_gradients(layout, seed):
    a, b = torch.randn(3, 4, 2, requires_grad=True), torch.randn(3, 5, 2)
    w = torch.randn(6, 4)
    (grad_a,) = torch.autograd.grad(outer_product_linear(a, b, w).sum(), [a])
    (want,) = torch.autograd.grad(outer_product_linear_reference(a, b, w).sum(), [a])
    torch.testing.assert_close(grad_a, want)


def test_autocast_matches_einsum_and_linear(layout, seed):
    lin = nn.Linear(12, 5)
    a, b = torch.randn(4, 6, 3, requires_grad=True), torch.randn(4, 7, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = outer_product_linear(a, b, lin.weight, lin.bias)
        ref = lin(torch.einsum("sic,sje->ijce", a, b).flatten(-2))
    assert out.dtype == ref.dtype == torch.bfloat16
    if layout == "projected":  # other bf16 matmuls: no outer product
        assert_close(out.float() / ref.abs().max(), ref.float() / ref.abs().max(), dtype=torch.bfloat16)
    else:
        torch.testing.assert_close(out, ref, rtol=0, atol=0)  # the same bf16 matmuls, the same order
    got = torch.autograd.grad(out.float().sum(), [a, b, lin.weight, lin.bias])
    want = torch.autograd.grad(ref.float().sum(), [a, b, lin.weight, lin.bias])
    for x, y in zip(got, want, strict=True):
        assert x.dtype == y.dtype
        assert_close(x / y.abs().max(), y / y.abs().max(), dtype=torch.bfloat16, msg="autocast gradient")


def test_keeps_the_projections_not_the_outer_product(seed):
    a, b = torch.randn(3, 7, 4, requires_grad=True), torch.randn(3, 9, 5, requires_grad=True)
    w, bias = torch.randn(6, 20, requires_grad=True), torch.randn(6, requires_grad=True)
    for fn, keeps_outer in ((outer_product_linear, False), (outer_product_linear_reference, True)):
        shapes = []
        keep = lambda t, seen=shapes: seen.append(t.shape) or t  # noqa: E731
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            fn(a, b, w, bias)
        outer_size = 7 * 9 * 20  # [I, J, C*E]; a, b and the weight are all smaller
        assert any(math.prod(s) >= outer_size for s in shapes) == keeps_outer, shapes


def test_compiled_keeps_the_projections_not_the_outer_product(layout, seed):
    # While torch.compile traces, the op is the custom op hfkit::outer_product_linear, opaque to the
    # compiler: traced through, the backward's recomputed outer product was merged with the forward's
    # and kept for the backward.
    torch._dynamo.reset()
    a, b = torch.randn(3, 7, 4, requires_grad=True), torch.randn(3, 9, 5, requires_grad=True)
    w, bias = torch.randn(6, 20, requires_grad=True), torch.randn(6, requires_grad=True)
    dy = torch.randn(7, 9, 6)
    compiled = torch.compile(outer_product_linear, backend="aot_eager", fullgraph=True)
    shapes = []
    keep = lambda t: shapes.append(t.shape) or t  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = compiled(a, b, w, bias)
    assert shapes and all(math.prod(s) < 7 * 9 * 20 for s in shapes), shapes
    grads = torch.autograd.grad(out, [a, b, w, bias], dy)
    ref, ref_grads = output_and_grads(outer_product_linear_reference, [a, b, w, bias], dy)
    assert_close(out, ref, msg="output")
    for k, (actual, expected) in enumerate(zip(grads, ref_grads, strict=True)):
        assert_close(actual, expected, msg=f"gradient {k}")


@pytest.mark.parametrize("by_rows", [False, True], ids=["batched", "rows"])
def test_custom_ops_pass_opcheck(by_rows, seed):
    # Schema, fake tensors and autograd registration of what torch.compile sees, with and without a
    # bias and with gradients left out.
    a, b = torch.randn(2, 3, 5, 4, requires_grad=True), torch.randn(2, 3, 6, 2, requires_grad=True)
    w, bias = torch.randn(7, 8, requires_grad=True), torch.randn(7, requires_grad=True)
    dy = torch.randn(2, 5, 6, 7)
    torch.library.opcheck(torch.ops.hfkit.outer_product_linear.default, (a, b, w, bias, by_rows))
    torch.library.opcheck(torch.ops.hfkit.outer_product_linear.default, (a, b, w, None, by_rows))
    for needs in ((True, True, True, True), (False, True, False, False)):
        args = (a.detach(), b.detach(), w.detach(), dy, *needs, by_rows)
        torch.library.opcheck(torch.ops.hfkit.outer_product_linear_backward.default, args)


@pytest.mark.parametrize("by_rows", [False, True], ids=["stride0", "by_rows"])
def test_backward_op_keeps_no_vector_of_ones(by_rows, seed):
    # Compiled code calls the backward op opaquely, under mode="reduce-overhead" inside a CUDA-graph
    # tree's memory pool, which raises on any allocation kept past the call: the bias gradient's
    # vector of ones must be made for the call, not kept as eager column sums keep it.
    a, b, w, dy = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 6, 2), torch.randn(7, 8), torch.randn(2, 5, 6, 7)
    _linear._ONES.clear()
    grads = torch.ops.hfkit.outer_product_linear_backward(a, b, w, dy, True, True, True, True, by_rows)
    assert not _linear._ONES
    torch.testing.assert_close(grads[3], dy.sum((0, 1, 2)))
    _linear.column_sums(dy.view(-1, 7))  # outside the op the vector is kept again
    assert set(_linear._ONES) == {(torch.device("cpu"), torch.float32)}


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(a=torch.ones(3, 4, 2, dtype=torch.int64)), "a"),
        (dict(b=torch.ones(2, 5, 3)), "a, b"),  # S disagrees
        (dict(b=torch.ones(5, 3)), "a, b"),
        (dict(weight=torch.ones(6, 5)), "weight"),
        (dict(bias=torch.ones(4)), "bias"),
    ],
)
def test_bad_inputs_name_the_argument(kwargs, name):
    args = {"a": torch.ones(3, 4, 2), "b": torch.ones(3, 5, 3), "weight": torch.ones(6, 6), "bias": None}
    with pytest.raises(ValueError, match=name):
        outer_product_linear(**{**args, **kwargs})


@pytest.mark.parametrize("chunk_size", [None, 3], ids=["plain", "chunked"])
def test_swapped_module_matches_the_model(chunk_size, seed):
    plain = OuterProductMean(c_m=6, c_z=5, c_hidden=3)
    with torch.no_grad():
        for p in plain.parameters():
            p.copy_(torch.randn_like(p))  # the model's init zeroes linear_out, hiding wrong gradients
    fused = hfkit.to_hfkit(OuterProductMean(c_m=6, c_z=5, c_hidden=3))
    fused.load_state_dict(plain.state_dict())
    assert type(fused) is hnn.OuterProductMean and fused.state_dict().keys() == plain.state_dict().keys()
    m = torch.randn(2, 5, 7, 6, requires_grad=True)
    mask = (torch.rand(2, 5, 7) > 0.3).float()
    out, ref = fused(m, mask, chunk_size=chunk_size), plain(m, mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for x, y in zip(
        torch.autograd.grad(out.sum(), [m, *fused.parameters()]),
        torch.autograd.grad(ref.sum(), [m, *plain.parameters()]),
        strict=True,
    ):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    assert type(hfkit.to_torch(fused)) is OuterProductMean


def test_evoformer_swaps_the_outer_product_mean():
    stack = hfkit.to_hfkit(EvoformerStack.from_config(ModelConfig.tiny()))
    assert any(type(m) is hnn.OuterProductMean for m in stack.modules())


def test_benchmark_rows_on_cpu():
    # `hfkit bench outer_product_linear` on CPU: every provider gives a row, each layout the same
    # forward as eager within float32 rounding, the costs as the module docstring counts them.
    from hfkit.bench.cases.outer_product_linear import BENCHMARK, OpmCase
    from hfkit.bench.ceilings import Ceilings
    from hfkit.bench.runner import run_benchmark

    case = OpmCase("tiny", 5, 6, 3, 4)
    ceilings = Ceilings(copy_gbps=10.0, matmul_tflops=1.0, device_name="cpu")
    rows = run_benchmark(
        BENCHMARK, [case], "cpu", dtypes=["fp32"], modes=["fwd", "fwd+bwd"],
        providers=["hfkit", "hfkit_batched", "hfkit_rows", "eager"], progress=False, ceilings=ceilings,
        warmup=1, reps=1,
    ).rows  # fmt: skip
    assert [(r.provider, r.mode) for r in rows] == [
        (p, m) for p in ("hfkit", "hfkit_batched", "hfkit_rows", "eager") for m in ("fwd", "fwd+bwd")
    ]
    outer, linear = 2 * 5 * 6 * 6 * 3 * 3, 2 * 6 * 6 * 3 * 3 * 4
    assert [r.flops for r in rows[:2]] == [outer + linear, 4 * outer + 3 * linear]
    assert all(r.p50_ms > 0 and r.extra["max_rel_err"] < 1e-5 for r in rows), [r.extra for r in rows]
