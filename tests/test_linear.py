"""hfkit.ops.linear against `F.linear` in float64: outputs and the gradients of x, weight and bias.

Odd sizes (tiles cut at every edge), 3-D x, strided views of every argument, no bias, the split-K
path and every candidate tiling in `CONFIGS`; bfloat16, float64, autocast and the CPU without the
interpreter are `F.linear` itself, value for value; the custom-op route agrees with the direct one. On
CPU the GEMM kernel runs under TRITON_INTERPRET=1 (IEEE float32 products); on CUDA its products are
three TF32 products each (about 1e-6 relative), and torch's precision "high" hands the call to
`F.linear`.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from conftest import output_and_grads

from hfkit.ops import linear, linear_reference, reference_on_cpu
from hfkit.ops.linear import (
    CONFIGS,
    CUDA_CONFIG,
    SMALL_OUTPUT_CONFIG,
    _matmul,
    _split_k,
    _transposed,
    default_config,
    uses_triton,
)

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICES = (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []) + (
    ["cuda"] if torch.cuda.is_available() else []
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Max abs error over the max abs of the float64 result: IEEE float32 under the interpreter sums at
# most a few hundred products; three TF32 products on CUDA keep about 1e-6 per product.
REL_TOL = {"cpu": 2e-6, "cuda": 1e-5}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    expected = expected.double()
    return ((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def check_against_float64(x, weight, bias, dy=None) -> None:
    """linear's output and gradients (x, weight, bias) within REL_TOL of F.linear's in float64, on the
    same values; the kernel path is what ran, on the arguments' own strides (detached leaves keep them,
    where a clone of a sliced view would be contiguous)."""
    assert uses_triton(x, weight, bias)
    n = weight.shape[0]
    if dy is None:
        dy = torch.randn(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    leaves = [t.detach().requires_grad_(True) for t in (x, weight, bias) if t is not None]
    assert [t.stride() for t in leaves] == [t.stride() for t in (x, weight, bias) if t is not None]
    out = linear(*leaves, *([None] if bias is None else []))
    grads = torch.autograd.grad(out, leaves, dy)
    f64 = lambda t: t.double() if t is not None else None  # noqa: E731
    ref, ref_grads = output_and_grads(F.linear, [f64(x), f64(weight), f64(bias)], dy.double())
    assert out.shape == ref.shape == (*x.shape[:-1], n) and out.dtype == x.dtype
    tol = REL_TOL[x.device.type]
    assert rel_err(out, ref) <= tol, f"output: {rel_err(out, ref)}"
    for name, actual, expected in zip(["x", "weight", "bias"], grads, ref_grads, strict=False):
        assert actual.shape == expected.shape and actual.dtype == x.dtype, name
        assert rel_err(actual, expected) <= tol, f"d{name}: {rel_err(actual, expected)}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 37, 130])
@pytest.mark.parametrize("k", [33, 65])
@pytest.mark.parametrize("n", [17, 96])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_odd_sizes_match_float64(device, m, k, n, with_bias, seed):
    x = torch.randn(m, k, device=device)
    weight = torch.randn(n, k, device=device) / k**0.5
    bias = torch.randn(n, device=device) if with_bias else None
    check_against_float64(x, weight, bias)


@pytest.mark.parametrize("device", DEVICES)
def test_3d_and_strided_views_match_float64(device, seed):
    k, n = 33, 17
    # x: a transposed view [2, 37, 33] (no [M, K] view of it exists: linear copies it), weight: a
    # transposed view (column-major, read in place), bias: every other element.
    x = torch.randn(2, k, 37, device=device).transpose(1, 2)
    weight = torch.randn(k, n, device=device).t()
    bias = torch.randn(2 * n, device=device)[::2]
    dy = torch.randn(2, n, 37, device=device).transpose(1, 2)
    check_against_float64(x, weight, bias, dy)
    # Slices: rows of x and weight with strides past their widths, read in place.
    x = torch.randn(37, 80, device=device)[:, 5 : 5 + k]
    weight = torch.randn(n, 70, device=device)[:, 3 : 3 + k]
    check_against_float64(x, weight, None)
    # 1-D x: F.linear's [K] -> [N].
    check_against_float64(torch.randn(k, device=device), torch.randn(n, k, device=device), None)


@pytest.mark.parametrize("device", DEVICES)
def test_expanded_upstream_gradient_matches_float64(device, seed):
    # A sum's gradient reaches linear's backward as an expanded tensor (all strides 0).
    x, weight, bias = (torch.randn(s, device=device) for s in [(3, 37, 33), (17, 33), (17,)])
    dy = torch.ones((), device=device).expand(3, 37, 17)
    check_against_float64(x, weight, bias, dy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_matmul_split_k_and_strides(device, split_k, seed):
    # a [M, K] transposed (column-major, as dyᵀ in the weight gradient), b a row slice, out strided.
    m, k, n = 45, 200, 23
    a = torch.randn(k, m, device=device).t()
    b = torch.randn(k, 2 * n, device=device)[:, ::2]
    bias = torch.randn(n, device=device)
    full = torch.full((m, n + 5), float("nan"), device=device)
    out = full[:, :n]
    _matmul(a, b, out, bias, CONFIGS[0] if device == "cuda" else CONFIGS[-1], split_k=split_k)
    expected = a.double() @ b.double() + bias.double()
    assert rel_err(out, expected) <= REL_TOL[device]
    assert torch.isnan(full[:, n:]).all(), "wrote past the output's columns"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,n", [(1, 1), (5, 130), (129, 3), (70, 65)])
@pytest.mark.parametrize("layout", ["rows", "columns", "strided"])
def test_transposed_copy_is_exact(device, m, n, layout, seed):
    # The backward's transposing copies: aᵀ, contiguous, value for value, from any strides.
    if layout == "rows":
        a = torch.randn(m, n, device=device)
    elif layout == "columns":
        a = torch.randn(n, m, device=device).t()
    else:
        a = torch.randn(2 * m, 3 * n, device=device)[::2, 1::3]
    out = _transposed(a)
    assert out.shape == (n, m) and out.is_contiguous() and out.dtype == a.dtype
    assert torch.equal(out, a.t())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_every_candidate_config_matches_float64(device, config, seed):
    m, k, n = 130, 65, 96
    a, b, bias = (
        torch.randn(m, k, device=device),
        torch.randn(k, n, device=device),
        torch.randn(n, device=device),
    )
    out = torch.empty(m, n, device=device)
    _matmul(a, b, out, bias, config)
    assert rel_err(out, a.double() @ b.double() + bias.double()) <= REL_TOL[device]


@pytest.mark.parametrize("device", DEVICES)
def test_custom_op_route_matches_the_direct_call(device, seed):
    # Under the profiler an hfkit op takes the registered custom op (autograd registered on it).
    x = torch.randn(3, 7, 33, device=device)
    weight, bias = torch.randn(17, 33, device=device), torch.randn(17, device=device)
    dy = torch.randn(3, 7, 17, device=device)
    direct, direct_grads = output_and_grads(linear, [x, weight, bias], dy)
    with torch.profiler.profile() as prof:
        routed, routed_grads = output_and_grads(linear, [x, weight, bias], dy)
    names = {e.name for e in prof.events()}
    assert "hfkit::linear_fwd" in names and "hfkit::linear_mm" in names, sorted(names)[:20]
    for a, b in zip([direct, *direct_grads], [routed, *routed_grads], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_other_dtypes_are_f_linear(device, dtype, seed):
    if dtype == torch.float16 and device == "cpu":
        pytest.skip("float16 matmuls on CPU: not every torch build has them")
    x = torch.randn(5, 37, 33, device=device, dtype=dtype)
    weight, bias = (
        torch.randn(17, 33, device=device, dtype=dtype),
        torch.randn(17, device=device, dtype=dtype),
    )
    assert not uses_triton(x, weight, bias)
    dy = torch.randn(5, 37, 17, device=device, dtype=dtype)
    out, grads = output_and_grads(linear, [x, weight, bias], dy)
    ref, ref_grads = output_and_grads(F.linear, [x, weight, bias], dy)
    # The output and the gradients of x and weight are F.linear's value for value; the bias gradient is
    # a gemv with ones (column_sums), another summation order than autograd's sum(0).
    for a, b in zip([out, *grads[:2]], [ref, *ref_grads[:2]], strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert grads[2].dtype == dtype
    exact = dy.double().sum(dim=(0, 1))
    assert rel_err(grads[2], exact) <= (1e-12 if dtype == torch.float64 else 1e-2)


def test_column_sums_keep_one_vector_of_ones_and_none_traced(seed):
    """column_sums reads a slice of one kept vector of ones per device and dtype, grown past its length
    (sums stay right across the growth); under fake tensors (what opcheck and export trace) it makes a
    new vector and keeps nothing, so real calls after it still get real ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hfkit.ops import _linear

    _linear._ONES.clear()
    for rows in (3, 5000, 17, 9000):
        g = torch.randn(rows, 6, dtype=torch.float64)
        torch.testing.assert_close(_linear.column_sums(g), g.sum(0))
    kept = _linear._ONES[(torch.device("cpu"), torch.float64)]
    assert kept.shape[0] >= 9000 and bool((kept == 1).all())
    with FakeTensorMode():
        _linear.column_sums(torch.empty(20000, 4))
    assert set(_linear._ONES) == {(torch.device("cpu"), torch.float64)}
    assert _linear._ONES[(torch.device("cpu"), torch.float64)] is kept
    g = torch.randn(7, 3, dtype=torch.float64)
    torch.testing.assert_close(_linear.column_sums(g), g.sum(0))


@pytest.mark.parametrize("device", DEVICES)
def test_bias_gradient_is_column_sums_under_autocast(device, seed):
    """Outside the kernel path a bias that needs a gradient runs the column-sum function, under autocast
    too: outputs in the autocast dtype, gradients in the parameters' dtypes, all near float64's."""
    x, weight = torch.randn(3, 41, 33, device=device), torch.randn(17, 33, device=device)
    bias = torch.randn(17, device=device)
    leaves = [t.clone().requires_grad_(True) for t in (x, weight, bias)]
    with torch.autocast(device, dtype=torch.bfloat16):
        out = linear(*leaves)
    assert out.dtype == torch.bfloat16 and "ColumnSums" in type(out.grad_fn).__name__
    dy = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dy)
    ref, ref_grads = output_and_grads(F.linear, [t.double() for t in (x, weight, bias)], dy.double())
    assert rel_err(out, ref) <= 1e-2
    for t, actual, expected in zip(leaves, grads, ref_grads, strict=True):
        assert actual.dtype == t.dtype == torch.float32
        assert rel_err(actual, expected) <= 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_is_f_linear(device, seed):
    x, weight, bias = torch.randn(37, 33, device=device), torch.randn(17, 33, device=device), torch.randn(17)
    bias = bias.to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        assert not uses_triton(x, weight, bias)
        out, ref = linear(x, weight, bias), F.linear(x, weight, bias)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_cpu_without_the_interpreter_is_f_linear(seed):
    x, weight, bias = torch.randn(37, 33), torch.randn(17, 33), torch.randn(17)
    with reference_on_cpu():
        assert not uses_triton(x, weight, bias)
        out = linear(x, weight, bias)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=0, atol=0)


def test_empty_and_wrong_inputs_behave_as_f_linear():
    weight = torch.randn(17, 33)
    assert linear(torch.randn(0, 33), weight).shape == (0, 17)
    out = linear(torch.randn(4, 0), torch.randn(17, 0), torch.ones(17))
    torch.testing.assert_close(out, torch.ones(4, 17), rtol=0, atol=0)
    for x, w, b in [
        (torch.randn(4, 32), weight, None),  # K mismatch
        (torch.randn(4, 33), weight, torch.randn(16)),  # bias of the wrong size
        (torch.randn(4, 33), weight.double(), None),  # dtype mismatch
    ]:
        with pytest.raises(RuntimeError) as ours:
            linear(x, w, b)
        with pytest.raises(RuntimeError) as torchs:
            F.linear(x, w, b)
        assert str(ours.value) == str(torchs.value)


def test_reference_is_float64_accurate(seed):
    x, weight, bias = torch.randn(37, 300), torch.randn(17, 300), torch.randn(17)
    ref = linear_reference(x, weight, bias)
    exact = F.linear(x.double(), weight.double(), bias.double())
    assert ref.dtype == torch.float32
    torch.testing.assert_close(ref, exact.float(), rtol=0, atol=0)


@needs_cuda
@pytest.mark.parametrize("mkn", [(1024, 1024, 1024), (1, 33, 17), (130, 65, 96), (4097, 1000, 513)], ids=str)
def test_tf32x3_on_cuda_matches_float64(mkn, seed):
    assert torch.get_float32_matmul_precision() == "highest"
    m, k, n = mkn
    x = torch.randn(m, k, device="cuda")
    weight = torch.randn(n, k, device="cuda") / k**0.5
    bias = torch.randn(n, device="cuda")
    check_against_float64(x, weight, bias)


@needs_cuda
def test_weight_gradient_over_many_rows_on_cuda_splits_k(seed):
    # [512, 512] over 65536 rows: 16 output tiles, split over K to fill the SMs.
    x = torch.randn(65536, 512, device="cuda")
    weight = torch.randn(512, 512, device="cuda") / 512**0.5
    assert _split_k(512, 512, 65536, default_config(x.device, 512, 512), x.device) > 1
    assert default_config(x.device, 512, 512) == SMALL_OUTPUT_CONFIG  # 16 output tiles
    assert default_config(x.device, 65536, 512) == CUDA_CONFIG
    check_against_float64(x, weight, torch.randn(512, device="cuda"))


@needs_cuda
@pytest.mark.parametrize("precision", ["high", "medium"])
def test_tf32_precision_on_cuda_is_f_linear(precision, seed):
    x, weight, bias = (torch.randn(s, device="cuda") for s in [(130, 65), (96, 65), (96,)])
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        assert not uses_triton(x, weight, bias)
        out, ref = linear(x, weight, bias), F.linear(x, weight, bias)
    finally:
        torch.set_float32_matmul_precision(before)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_linear_is_f_linear_without_graph_breaks(device, seed):
    x, weight, bias = (torch.randn(s, device=device) for s in [(37, 33), (17, 33), (17,)])
    compiled = torch.compile(linear, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, weight, bias), F.linear(x, weight, bias), rtol=0, atol=0)


@needs_cuda
def test_opcheck_cuda(seed):
    x = torch.randn(2, 37, 65, device="cuda", requires_grad=True)
    weight = torch.randn(96, 65, device="cuda", requires_grad=True)
    bias = torch.randn(96, device="cuda", requires_grad=True)
    torch.library.opcheck(torch.ops.hfkit.linear_fwd.default, (x, weight, bias))
    torch.library.opcheck(torch.ops.hfkit.linear_fwd.default, (x, weight, None))
    torch.library.opcheck(torch.ops.hfkit.linear_mm.default, (x[0].detach(), weight.detach().t()))
