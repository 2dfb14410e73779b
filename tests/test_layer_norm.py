"""hfkit.ops.layer_norm against its reference: forward, the three gradients, dtypes, shapes, errors.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (set in conftest.py); on a GPU machine the
same tests also run the compiled kernels on CUDA.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close

from hfkit.ops import layer_norm, layer_norm_reference
from hfkit.ops.layer_norm import MAX_FUSED_SIZE, layer_norm_with_residual, uses_triton

# CPU runs the kernels through the Triton interpreter; a GPU machine runs them compiled on CUDA.
DEVICES = (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []) + (
    ["cuda"] if torch.cuda.is_available() else []
)
# Relative L2 error allowed against a float64 reference: the output's own rounding dominates.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(actual).all(), "non-finite values in the result"
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def run_both(shape, normalized, dtype, device, *, weight=True, bias=True, wdtype=None, noncontig=False):
    """Triton path and float64 reference on the same fresh random inputs; returns pairs to compare."""
    wdtype = wdtype or dtype
    if noncontig:  # rows strided in memory: every other row of a wider buffer, and a transposed view
        base = torch.randn(*shape[:-1], 2 * shape[-1], device=device, dtype=dtype) * 3 + 0.5
        x = base[..., : shape[-1]]
        assert not x.is_contiguous()
    else:
        x = torch.randn(shape, device=device, dtype=dtype) * 3 + 0.5
    x.requires_grad_(True)
    w = torch.randn(normalized, device=device, dtype=wdtype, requires_grad=True) if weight else None
    b = torch.randn(normalized, device=device, dtype=wdtype, requires_grad=True) if bias else None
    dy = torch.randn(shape, device=device, dtype=dtype)
    assert uses_triton(
        x, x.shape[-1] if isinstance(normalized, int) else int(torch.tensor(normalized).prod())
    )

    y = layer_norm(x, normalized, w, b, 1e-5)
    params = [t for t in (x, w, b) if t is not None]
    grads = torch.autograd.grad(y, params, dy)

    ref_params = [t.detach().double().requires_grad_(True) for t in params]
    x64 = ref_params[0]
    w64 = ref_params[1] if weight else None
    b64 = ref_params[-1] if bias else None
    y64 = layer_norm_reference(x64, normalized, w64, b64, 1e-5)
    ref_grads = torch.autograd.grad(y64, ref_params, dy.double())
    assert y.dtype == dtype and y.shape == x.shape
    for g, p in zip(grads, params, strict=True):
        assert g.dtype == p.dtype and g.shape == p.shape
    return [("y", y, y64)] + [
        (name, g, r) for name, g, r in zip(["dx", "dw", "db"][: len(grads)], grads, ref_grads, strict=False)
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(3, 5, 33), (2, 7, 129), (3, 1000), (1, 16), (2, 3, 4, 64)])
def test_matches_reference(shape, dtype, device):
    for name, actual, expected in run_both(shape, shape[-1], dtype, device):
        assert rel_err(actual, expected) < TOL[dtype], name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [8192, 12289])
def test_wide_rows(n, device):
    for name, actual, expected in run_both((3, n), n, torch.float32, device):
        assert rel_err(actual, expected) < TOL[torch.float32], name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefetch, acc2d", [(False, True), (True, True), (False, False)])
def test_many_row_blocks_reduce_weight_grads(device, prefetch, acc2d):
    # More row blocks than persistent programs: each program accumulates several blocks of dw/db,
    # with and without the next block's loads issued early, with per-slot or per-column partials.
    ln = importlib.import_module("hfkit.ops.layer_norm")
    m, n = 301, 128
    x = torch.randn(m, n, device=device) * 3 + 0.5
    w, b, dy = torch.randn(n, device=device), torch.randn(n, device=device), torch.randn(m, n, device=device)
    with torch.no_grad():
        y, mean, rstd = ln._layer_norm_fwd(x, w, b, n, 1e-5, x.dtype)
        cfg = ln._bwd_config(n, x.element_size())
        blocks = -(-m // cfg[0])
        # At most a third of the row blocks: several blocks a program on any device (an H200's 132
        # SMs would otherwise give every block its own program).
        programs = min(ln._bwd_programs(m, cfg, x.device), max(1, blocks // 3))
        assert 1 <= programs < blocks
        dx, dwb = torch.empty_like(x), torch.empty(programs, 2 * n, device=device)
        ln._launch_bwd(x, dy, dx, w, mean, rstd, dwb, True, programs, cfg, prefetch, acc2d)
    ref = [t.double().requires_grad_(True) for t in (x, w, b)]
    y64 = layer_norm_reference(ref[0], n, ref[1], ref[2], 1e-5)
    ref_grads = torch.autograd.grad(y64, ref, dy.double())
    dw, db = dwb.sum(dim=0).view(2, n)
    outputs = zip(["y", "dx", "dw", "db"], [y, dx, dw, db], [y64, *ref_grads], strict=True)
    for name, actual, expected in outputs:
        assert rel_err(actual, expected.detach()) < TOL[torch.float32], name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight,bias", [(False, False), (True, False), (False, True)])
def test_optional_affine(weight, bias, device):
    for name, actual, expected in run_both((4, 9, 48), 48, torch.float32, device, weight=weight, bias=bias):
        assert rel_err(actual, expected) < TOL[torch.float32], name


@pytest.mark.parametrize("device", DEVICES)
def test_multi_dim_normalized_shape(device):
    for name, actual, expected in run_both((3, 4, 9), (4, 9), torch.float32, device):
        assert rel_err(actual, expected) < TOL[torch.float32], name


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_input(device):
    for name, actual, expected in run_both((5, 6, 40), 40, torch.bfloat16, device, noncontig=True):
        assert rel_err(actual, expected) < TOL[torch.bfloat16], name


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_input_and_grad(device):
    x = torch.randn(40, 6, device=device).t().requires_grad_(True)  # [6, 40], column-major
    w = torch.randn(40, device=device, requires_grad=True)
    y = layer_norm(x, (40,), w, None)
    dy = torch.randn(40, 6, device=device).t()
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = layer_norm_reference(x64, (40,), w64, None)
    rx, rw = torch.autograd.grad(y64, (x64, w64), dy.double())
    assert rel_err(y, y64) < 1e-5 and rel_err(gx, rx) < 1e-5 and rel_err(gw, rw) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_input_with_fp32_params(device):
    pairs = run_both((6, 96), 96, torch.bfloat16, device, wdtype=torch.float32)
    for name, actual, expected in pairs:
        assert rel_err(actual, expected) < TOL[torch.bfloat16], name


@pytest.mark.parametrize("device", DEVICES)
def test_agrees_with_torch(device):
    x = torch.randn(7, 3, 130, device=device)
    w, b = torch.randn(130, device=device), torch.randn(130, device=device)
    torch.testing.assert_close(layer_norm(x, (130,), w, b, 1e-6), F.layer_norm(x, (130,), w, b, 1e-6))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("residual", [False, True])
def test_out_dtype_writes_the_cast_values(device, residual, seed):
    """A float32 x normalized into bfloat16 (`out_dtype`): the values of the float32 output cast to
    bfloat16, and the same gradients as that cast's backward gives (x's in float32), with and
    without the residual pass-through."""
    x = (torch.randn(5, 19, 72, device=device) * 2 + 0.4).requires_grad_(True)
    w = torch.randn(72, device=device, requires_grad=True)
    b = torch.randn(72, device=device, requires_grad=True)
    dy = torch.randn(5, 19, 72, device=device, dtype=torch.bfloat16)
    if residual:
        y, r = layer_norm_with_residual(x, 72, w, b, out_dtype=torch.bfloat16)
        assert torch.equal(r, x)
    else:
        y = layer_norm(x, 72, w, b, out_dtype=torch.bfloat16)
    want = layer_norm(x, 72, w, b).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16
    # Compiled kernels round to nearest as the cast does; the interpreter's stores may truncate.
    assert torch.equal(y, want) if device == "cuda" else rel_err(y, want) < TOL[torch.bfloat16]
    got = torch.autograd.grad(y, (x, w, b), dy)
    expected = torch.autograd.grad(want, (x, w, b), dy)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == torch.float32
        assert_close(g, e, dtype=torch.float32)


def test_out_dtype_must_be_a_floating_dtype():
    x = torch.randn(3, 8)
    for bad in (torch.int32, "bfloat16"):
        with pytest.raises(ValueError, match="^out_dtype:"):
            layer_norm(x, 8, out_dtype=bad)
    assert layer_norm(x, 8, out_dtype=torch.float64).dtype == torch.float64


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    x = torch.randn(0, 32, device=device, requires_grad=True)
    w = torch.randn(32, device=device, requires_grad=True)
    y = layer_norm(x, 32, w, None)
    assert y.shape == (0, 32)
    (gw,) = torch.autograd.grad(y.sum(), (w,))
    assert torch.equal(gw, torch.zeros_like(gw))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("used", ["both", "normalized", "passthrough"])
def test_with_residual_adds_the_passthrough_gradient(device, dtype, used, seed):
    """(y, r) = layer_norm_with_residual(x): y as layer_norm, r equal to x, and x's gradient the sum of
    the LayerNorm's and r's (added by the backward kernel; a transposed, strided dr), whichever is used."""
    x = (torch.randn(3, 37, 45, device=device) * 2 + 0.3).to(dtype).requires_grad_(True)
    w = torch.randn(45, device=device, requires_grad=True)
    b = torch.randn(45, device=device, requires_grad=True)
    y, r = layer_norm_with_residual(x, (45,), w, b)
    assert r is not x and r.data_ptr() == x.data_ptr() and torch.equal(r, x)
    dy = torch.randn(3, 37, 45, device=device, dtype=dtype)
    dr = torch.randn(3, 45, 37, device=device, dtype=dtype).transpose(-1, -2)
    terms = {"both": [(y, dy), (r, dr)], "normalized": [(y, dy)], "passthrough": [(r, dr)]}[used]
    loss = sum((t.float() * g.float()).sum() for t, g in terms)
    gx, gw, gb = torch.autograd.grad(loss, (x, w, b), allow_unused=True)
    x64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, w, b))
    y64 = layer_norm_reference(x64, (45,), w64, b64)
    terms64 = {"both": [(y64, dy), (x64, dr)], "normalized": [(y64, dy)], "passthrough": [(x64, dr)]}[used]
    loss64 = sum((t * g.double()).sum() for t, g in terms64)
    rx, rw, rb = torch.autograd.grad(loss64, (x64, w64, b64), allow_unused=True)
    assert rel_err(y, y64) < TOL[dtype]
    assert gx.dtype == dtype and rel_err(gx, rx) < TOL[dtype]
    if used == "passthrough":
        assert gw is None and gb is None
    else:
        assert rel_err(gw, rw) < TOL[dtype] and rel_err(gb, rb) < TOL[dtype]


def test_with_residual_passes_x_itself_where_it_cannot_fuse():
    x = torch.randn(4, 24, requires_grad=True)
    with torch.no_grad():
        assert layer_norm_with_residual(x, 24)[1] is x
    x64 = x.detach().double().requires_grad_(True)
    y, r = layer_norm_with_residual(x64, 24)
    assert r is x64
    torch.testing.assert_close(y, F.layer_norm(x64, (24,)))


def test_reference_path_beyond_fused_size():
    x = torch.randn(2, MAX_FUSED_SIZE + 1)
    assert not uses_triton(x, x.shape[-1])
    torch.testing.assert_close(layer_norm(x, x.shape[-1]), F.layer_norm(x, (x.shape[-1],)))


def test_float64_runs_reference():
    x = torch.randn(3, 17, dtype=torch.float64)
    assert not uses_triton(x, 17)
    torch.testing.assert_close(layer_norm(x, 17), F.layer_norm(x, (17,)))


def test_compile_on_cpu_matches_eager():
    w, b = torch.randn(24), torch.randn(24)
    f = torch.compile(lambda t: layer_norm(t, (24,), w, b) * 2, fullgraph=True)
    x = torch.randn(5, 24)
    torch.testing.assert_close(f(x), F.layer_norm(x, (24,), w, b) * 2)


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"x": torch.randn(4, 8), "normalized_shape": (7,)}, "normalized_shape"),
        ({"x": torch.randn(4, 8), "normalized_shape": (2, 8)}, "normalized_shape"),
        ({"x": torch.randn(8), "normalized_shape": (1, 8)}, "normalized_shape"),
        ({"x": torch.randn(4, 8), "normalized_shape": "eight"}, "normalized_shape"),
        ({"x": torch.randint(0, 5, (4, 8)), "normalized_shape": (8,)}, "x"),
        ({"x": torch.randn(4, 8), "normalized_shape": (8,), "weight": torch.randn(7)}, "weight"),
        (
            {"x": torch.randn(4, 8), "normalized_shape": (8,), "bias": torch.ones(8, dtype=torch.int32)},
            "bias",
        ),
        (
            {"x": torch.randn(4, 8), "normalized_shape": (8,), "weight": torch.randn(8, device="meta")},
            "weight",
        ),
        ({"x": torch.randn(4, 8), "normalized_shape": (8,), "eps": -1.0}, "eps"),
    ],
)
def test_bad_inputs_name_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=rf"^{argument}:"):
        layer_norm(**kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="custom-op checks need CUDA (not the interpreter)")
def test_opcheck_cuda():
    x = torch.randn(9, 64, device="cuda", requires_grad=True)
    w = torch.randn(64, device="cuda", requires_grad=True)
    b = torch.randn(64, device="cuda", requires_grad=True)
    for out_dtype in (torch.float32, torch.bfloat16):
        torch.library.opcheck(torch.ops.hfkit.layer_norm_fwd.default, (x, w, b, 64, 1e-5, out_dtype))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compile_cuda_fwd_bwd_matches_eager(seed):
    x = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(256, device="cuda", requires_grad=True)
    # One upstream gradient for both: a loss computed inside the compiled graph may round its bf16
    # gradient differently from eager autograd, which is not what this test is about.
    dy = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16)
    f = torch.compile(lambda t, w: layer_norm(t, (256,), w, None), fullgraph=True)
    gx, gw = torch.autograd.grad(f(x, w), (x, w), dy)
    ex, ew = torch.autograd.grad(layer_norm(x, (256,), w, None), (x, w), dy)
    assert_close(gx, ex)
    assert_close(gw, ew)
