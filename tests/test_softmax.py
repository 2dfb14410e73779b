"""hfkit.ops.softmax against its reference: forward, dx and the broadcast bias gradient, masks, errors.

On CPU the Triton kernels run under TRITON_INTERPRET=1 (set in conftest.py); on a GPU machine the
same tests also run the compiled kernels on CUDA. The reference is evaluated in float32 on the same
inputs: that is the precision that defines fully masked rows (see `softmax_reference`).
"""

from __future__ import annotations

import os

import pytest
import torch

from hfkit.ops import softmax, softmax_reference
from hfkit.ops.softmax import uses_triton

DEVICES = (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []) + (
    ["cuda"] if torch.cuda.is_available() else []
)
# Relative L2 error allowed against the float32 reference: the result's own rounding dominates.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(actual).all(), "non-finite values in the result"
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def run_both(x, bias, mask):
    """Fused op and float32 reference on the same inputs; returns (name, actual, expected) triples."""
    assert uses_triton(x)
    params = [t for t in (x, bias) if t is not None]
    for t in params:
        t.requires_grad_(True)
    y = softmax(x, bias, mask)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, params, dy)
    ref = [t.detach().float().requires_grad_(True) for t in params]
    y_ref = softmax_reference(ref[0], ref[1] if bias is not None else None, mask)
    ref_grads = torch.autograd.grad(y_ref, ref, dy.float())
    assert y.dtype == x.dtype and y.shape == x.shape
    for g, p in zip(grads, params, strict=True):
        assert g.dtype == p.dtype and g.shape == p.shape
    return [("y", y, y_ref)] + list(zip(["dx", "dbias"], grads, ref_grads, strict=False))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_msa_row_bias_and_mask(dtype, device, seed):
    # [B, S, H, Q, K] logits, pair bias broadcast over S, key mask over (H, Q), one row fully masked.
    b, s, h, n = 2, 3, 2, 37
    x = torch.randn(b, s, h, n, n, device=device, dtype=dtype) * 2
    bias = torch.randn(b, 1, h, n, n, device=device, dtype=dtype)
    mask = torch.rand(b, s, 1, 1, n, device=device) > 0.3
    mask[1, 2] = False
    for name, actual, expected in run_both(x, bias, mask):
        assert rel_err(actual, expected) < TOL[dtype], name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "x_shape, bias_shape, mask_shape",
    [
        ((7, 129), None, None),  # one row above a power of two, no extras
        ((5, 1), (5, 1), None),  # a single key
        ((3, 4, 65), (65,), (3, 1, 65)),  # bias broadcast over every leading dim
        ((2, 2, 2, 2, 3, 17), (1, 2, 1, 2, 1, 17), (2, 1, 2, 1, 1, 17)),  # too many patterns: materialized
    ],
)
def test_shapes_and_broadcasts(x_shape, bias_shape, mask_shape, device, seed):
    x = torch.randn(x_shape, device=device)
    bias = torch.randn(bias_shape, device=device) if bias_shape else None
    mask = (torch.rand(mask_shape, device=device) > 0.3).float() if mask_shape else None
    for name, actual, expected in run_both(x, bias, mask):
        assert rel_err(actual, expected) < TOL[torch.float32], name


@pytest.mark.parametrize("device", DEVICES)
def test_fully_masked_rows_are_uniform(device, seed):
    x = torch.randn(2, 4, 37, device=device)
    mask = torch.ones(2, 1, 37, device=device, dtype=torch.bool)
    mask[1] = False
    y = softmax(x, None, mask)
    assert torch.allclose(y[1], torch.full_like(y[1], 1 / 37))
    assert torch.allclose(y[0], torch.softmax(x[0], -1), atol=1e-6)


def test_float64_runs_the_reference(seed):
    x = torch.randn(3, 9, dtype=torch.float64)
    assert not uses_triton(x)
    torch.testing.assert_close(softmax(x), torch.softmax(x, -1))


@pytest.mark.parametrize(
    "args, name",
    [
        ((torch.ones(2, 3, dtype=torch.int32),), "x"),
        ((torch.ones(2, 3), torch.ones(4, 3)), "bias"),
        ((torch.ones(2, 3), torch.ones(2, 3, dtype=torch.int64)), "bias"),
        ((torch.ones(2, 3), None, torch.ones(2, 5)), "mask"),
        ((torch.ones(3), torch.ones(2, 3)), "bias"),
        (("not a tensor",), "x"),
    ],
)
def test_bad_inputs_raise(args, name):
    with pytest.raises(ValueError, match=f"^{name}:"):
        softmax(*args)


def test_empty_and_compile_on_cpu(seed):
    x = torch.randn(0, 5, 9, requires_grad=True)
    assert softmax(x, torch.randn(5, 9)).shape == (0, 5, 9)
    bias, mask = torch.randn(1, 9), torch.rand(3, 1, 9) > 0.5
    f = torch.compile(lambda t: softmax(t, bias, mask) * 2, fullgraph=True)
    x = torch.randn(3, 4, 9)
    torch.testing.assert_close(f(x), softmax_reference(x, bias, mask) * 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="custom-op checks need CUDA (not the interpreter)")
def test_opcheck_and_compile_cuda():
    x = torch.randn(2, 3, 2, 5, 37, device="cuda", requires_grad=True)
    bias = torch.randn(2, 1, 2, 5, 37, device="cuda", requires_grad=True)
    mask = (torch.rand(2, 3, 1, 1, 37, device="cuda") > 0.3).float()
    torch.library.opcheck(torch.ops.hfkit.softmax_fwd.default, (x, bias, mask))
    f = torch.compile(lambda t, b: softmax(t, b, mask).square().sum(), fullgraph=True)
    got = torch.autograd.grad(f(x, bias), (x, bias))
    want = torch.autograd.grad(softmax(x, bias, mask).square().sum(), (x, bias))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
