"""Every fused op under hostile inputs: any strides, wrong devices and dtypes, degenerate shapes, non-finite
values.

Each op's fast path must equal its plain-torch reference (the spec, which is right for any strides) with
weights and biases that are every 2nd element of a larger tensor or expanded from one element (stride
0), on empty and zero-row inputs, and in its gradients where an input holds inf; every tensor argument on
another device or of an integer, bool or complex dtype raises a ValueError that names it. On CPU the
kernels run under the interpreter (conftest.py); a GPU machine also runs them compiled on CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

from hfkit.ops import (
    bias_dropout_add,
    bias_dropout_add_reference,
    evoformer_attention,
    evoformer_attention_reference,
    gated_linear,
    gated_linear_reference,
    layer_norm,
    layer_norm_reference,
    linear,
    linear_reference,
    multihead_attention,
    multihead_attention_reference,
    outer_product_linear,
    outer_product_linear_reference,
    reference_on_cpu,
    relu_mlp,
    relu_mlp_reference,
    sigmoid_gate,
    sigmoid_gate_reference,
    softmax,
    softmax_reference,
    triangle_multiplication,
    triangle_multiplication_reference,
)
from hfkit.ops.layer_norm import layer_norm_with_residual
from hfkit.ops.multi_linear import multi_linear, multi_linear_reference

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICES = (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []) + (
    ["cuda"] if torch.cuda.is_available() else []
)
LAYOUTS = ("strided", "expanded")


def close(actual: torch.Tensor | None, expected: torch.Tensor | None, name: str) -> None:
    """actual ≈ expected (NaN where expected has NaN), float32 rounding relative to expected's scale."""
    assert (actual is None) == (expected is None), name
    if expected is None:
        return
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
    scale = expected.detach().abs().nan_to_num(0.0, 0.0, 0.0).max().item() if expected.numel() else 1.0
    torch.testing.assert_close(
        actual, expected, rtol=1e-4, atol=1e-4 * max(1.0, scale), equal_nan=True, msg=lambda m: f"{name}: {m}"
    )


def param(shape: tuple[int, ...], layout: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the argument, the leaf its gradient lands on): a tensor of `shape` that is every 2nd element
    of a larger leaf along its last dim ('strided'), the last dim expanded from one element with stride
    0 ('expanded'), or a plain leaf ('plain')."""
    if layout == "strided":
        leaf = torch.randn(*shape[:-1], 2 * shape[-1], device=device).requires_grad_(True)
        return leaf[..., ::2], leaf
    if layout == "expanded":
        leaf = torch.randn(*shape[:-1], 1, device=device).requires_grad_(True)
        return leaf.expand(shape), leaf
    leaf = torch.randn(shape, device=device).requires_grad_(True)
    return leaf, leaf


def compare(run: Callable[[bool], torch.Tensor], leaves: dict[str, torch.Tensor]) -> None:
    """run(False) (the op) equals run(True) (its reference), forward and every leaf's gradient."""
    out, ref = run(False), run(True)
    close(out, ref, "output")
    dout = torch.randn_like(ref)
    names = list(leaves)
    grads = torch.autograd.grad(out, [leaves[n] for n in names], dout, allow_unused=True)
    ref_grads = torch.autograd.grad(ref, [leaves[n] for n in names], dout, allow_unused=True)
    for name, g, r in zip(names, grads, ref_grads, strict=True):
        close(g, r, f"grad of {name}")


# ----------------------------------------------------------------------------- strided and expanded


def layer_norm_case(layout: str, device: str):
    x = torch.randn(5, 3, 24, device=device, requires_grad=True)
    (w, w_leaf), (b, b_leaf) = param((24,), layout, device), param((24,), layout, device)

    def run(reference: bool) -> torch.Tensor:
        return (layer_norm_reference if reference else layer_norm)(x, (24,), w, b, 1e-5)

    return run, {"x": x, "weight": w_leaf, "bias": b_leaf}


def softmax_case(layout: str, device: str):
    x = torch.randn(2, 3, 4, 20, device=device, requires_grad=True)
    bias, b_leaf = param((1, 3, 4, 20), layout, device)
    mask = torch.rand(2, 1, 1, 20, device=device) > 0.3

    def run(reference: bool) -> torch.Tensor:
        return (softmax_reference if reference else softmax)(x, bias, mask)

    return run, {"x": x, "bias": b_leaf}


def attention_case(layout: str, device: str):
    q, q_leaf = param((1, 2, 2, 9, 16), layout if layout == "strided" else "plain", device)
    k, k_leaf = param((1, 2, 2, 11, 16), layout if layout == "strided" else "plain", device)
    v, v_leaf = param((1, 2, 2, 11, 16), layout if layout == "strided" else "plain", device)
    bias, b_leaf = param((1, 1, 2, 9, 11), layout, device)
    key_bias = param((1, 2, 11), layout, device)[0].detach() * 3
    mask = torch.rand(1, 2, 11, device=device) > 0.2

    def run(reference: bool) -> torch.Tensor:
        fn = evoformer_attention_reference if reference else evoformer_attention
        return fn(q, k, v, bias, mask, key_bias=key_bias)

    return run, {"q": q_leaf, "k": k_leaf, "v": v_leaf, "bias": b_leaf}


def triangle_case(layout: str, device: str):
    c_z, c_h, n = 16, 8, 7
    z = torch.randn(1, n, n, c_z, device=device, requires_grad=True)
    mask = torch.rand(1, n, n, device=device) > 0.2
    names = ("ln_in_weight", "ln_in_bias", "proj_weight", "proj_bias")
    names += ("ln_out_weight", "ln_out_bias", "out_weight", "out_bias")
    shapes = [(c_z,), (c_z,), (4 * c_h + c_z, c_z), (4 * c_h + c_z,), (c_h,), (c_h,), (c_z, c_h), (c_z,)]
    params = [param(shape, layout, device) for shape in shapes]
    args = [p for p, _ in params]

    def run(reference: bool) -> torch.Tensor:
        fn = triangle_multiplication_reference if reference else triangle_multiplication
        return fn(z, mask, *args, outgoing=True, eps=1e-5)

    return run, {"z": z, **{name: leaf for name, (_, leaf) in zip(names, params, strict=True)}}


def sigmoid_gate_case(layout: str, device: str):
    g, g_leaf = param((6, 4, 16), layout if layout == "strided" else "plain", device)
    o = torch.randn(6, 4, 16, device=device, requires_grad=True)
    bias, b_leaf = param((4, 16), layout, device)

    def run(reference: bool) -> torch.Tensor:
        return (sigmoid_gate_reference if reference else sigmoid_gate)(g, o, bias)

    return run, {"g": g_leaf, "o": o, "bias": b_leaf}


def bias_dropout_add_case(layout: str, device: str):
    x, x_leaf = param((3, 5, 16), layout if layout == "strided" else "plain", device)
    residual = torch.randn(3, 5, 16, device=device, requires_grad=True)
    bias, b_leaf = param((16,), layout, device)

    def run(reference: bool) -> torch.Tensor:
        fn = bias_dropout_add_reference if reference else bias_dropout_add
        return fn(x, residual, bias, 0.25, False)

    return run, {"x": x_leaf, "residual": residual, "bias": b_leaf}


def gated_linear_case(layout: str, device: str):
    g = torch.randn(3, 5, 16, device=device, requires_grad=True)
    o = torch.randn(3, 5, 16, device=device, requires_grad=True)
    (w, w_leaf), (b, b_leaf) = param((8, 16), layout, device), param((8,), layout, device)

    def run(reference: bool) -> torch.Tensor:
        return (gated_linear_reference if reference else gated_linear)(g, o, w, b)

    return run, {"g": g, "o": o, "weight": w_leaf, "bias": b_leaf}


def relu_mlp_case(layout: str, device: str):
    x = torch.randn(3, 5, 8, device=device, requires_grad=True)
    (w1, w1_leaf), (b1, b1_leaf) = param((32, 8), layout, device), param((32,), layout, device)
    (w2, w2_leaf), (b2, b2_leaf) = param((8, 32), layout, device), param((8,), layout, device)

    def run(reference: bool) -> torch.Tensor:
        return (relu_mlp_reference if reference else relu_mlp)(x, w1, b1, w2, b2)

    return run, {"x": x, "w1": w1_leaf, "b1": b1_leaf, "w2": w2_leaf, "b2": b2_leaf}


def outer_product_linear_case(layout: str, device: str):
    a = torch.randn(2, 3, 5, 4, device=device, requires_grad=True)
    b = torch.randn(2, 3, 6, 2, device=device, requires_grad=True)
    (w, w_leaf), (bias, b_leaf) = param((7, 8), layout, device), param((7,), layout, device)

    def run(reference: bool) -> torch.Tensor:
        fn = outer_product_linear_reference if reference else outer_product_linear
        return fn(a, b, w, bias)

    return run, {"a": a, "b": b, "weight": w_leaf, "bias": b_leaf}


def relu_mlp_scale_case(layout: str, device: str):
    # The transitions' call: a mask per row applied inside the op (a [*, 1] view of a wider tensor).
    x, x_leaf = param((3, 5, 8), layout if layout == "strided" else "plain", device)
    (w1, w1_leaf), (b1, b1_leaf) = param((32, 8), layout, device), param((32,), layout, device)
    (w2, w2_leaf), (b2, b2_leaf) = param((8, 32), layout, device), param((8,), layout, device)
    scale = (torch.rand(3, 5, 3, device=device) > 0.3).float()[..., 1:2]

    def run(reference: bool) -> torch.Tensor:
        if reference:
            return relu_mlp_reference(x, w1, b1, w2, b2) * scale
        return relu_mlp(x, w1, b1, w2, b2, scale=scale)

    return run, {"x": x_leaf, "w1": w1_leaf, "b1": b1_leaf, "w2": w2_leaf, "b2": b2_leaf}


def multi_linear_case(layout: str, device: str):
    x, x_leaf = param((3, 5, 8), layout if layout == "strided" else "plain", device)
    (w1, w1_leaf), (b1, b1_leaf) = param((6, 8), layout, device), param((6,), layout, device)
    w2, w2_leaf = param((4, 8), layout, device)

    def run(reference: bool) -> torch.Tensor:
        outs = (multi_linear_reference if reference else multi_linear)(x, [w1, w2], [b1, None])
        return torch.cat([out.flatten() for out in outs])

    return run, {"x": x_leaf, "w1": w1_leaf, "b1": b1_leaf, "w2": w2_leaf}


def layer_norm_with_residual_case(layout: str, device: str):
    # The pass-through carries the residual's gradient into the LayerNorm's backward kernel.
    x, x_leaf = param((5, 3, 24), layout if layout == "strided" else "plain", device)
    (w, w_leaf), (b, b_leaf) = param((24,), layout, device), param((24,), layout, device)

    def run(reference: bool) -> torch.Tensor:
        if reference:
            y, passthrough = layer_norm_reference(x, (24,), w, b, 1e-5), x
        else:
            y, passthrough = layer_norm_with_residual(x, (24,), w, b, 1e-5)
        return torch.cat([y.flatten(), (2 * passthrough).flatten()])

    return run, {"x": x_leaf, "weight": w_leaf, "bias": b_leaf}


def linear_case(layout: str, device: str):
    x, x_leaf = param((3, 5, 8), layout if layout == "strided" else "plain", device)
    (w, w_leaf), (b, b_leaf) = param((6, 8), layout, device), param((6,), layout, device)

    def run(reference: bool) -> torch.Tensor:
        return (linear_reference if reference else linear)(x, w, b)

    return run, {"x": x_leaf, "weight": w_leaf, "bias": b_leaf}


def multihead_attention_case(layout: str, device: str):
    q, q_leaf = param((5, 2, 8), layout if layout == "strided" else "plain", device)
    (w_in, w_in_leaf), (b_in, b_in_leaf) = param((24, 8), layout, device), param((24,), layout, device)
    (w_out, w_out_leaf), (b_out, b_out_leaf) = param((8, 8), layout, device), param((8,), layout, device)

    def run(reference: bool) -> torch.Tensor:
        fn = multihead_attention_reference if reference else multihead_attention
        return fn(q, q, q, 2, w_in, b_in, w_out, b_out, need_weights=False)[0]

    leaves = {"query": q_leaf, "in_proj_weight": w_in_leaf, "in_proj_bias": b_in_leaf}
    return run, {**leaves, "out_proj_weight": w_out_leaf, "out_proj_bias": b_out_leaf}


CASES = {
    "layer_norm": layer_norm_case,
    "softmax": softmax_case,
    "evoformer_attention": attention_case,
    "triangle_multiplication": triangle_case,
    "sigmoid_gate": sigmoid_gate_case,
    "bias_dropout_add": bias_dropout_add_case,
    "gated_linear": gated_linear_case,
    "relu_mlp": relu_mlp_case,
    "outer_product_linear": outer_product_linear_case,
    "relu_mlp_scale": relu_mlp_scale_case,
    "multi_linear": multi_linear_case,
    "layer_norm_with_residual": layer_norm_with_residual_case,
    "linear": linear_case,
    "multihead_attention": multihead_attention_case,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", list(CASES))
def test_weights_and_biases_of_any_strides(op, layout, device, seed):
    run, leaves = CASES[op](layout, device)
    compare(run, leaves)


# ----------------------------------------------------------------------------- devices and dtypes


def valid_arguments(op: str) -> dict[str, torch.Tensor | None]:
    """Small valid CPU arguments of `op`, by name (tensor arguments only)."""
    r = torch.randn
    if op == "layer_norm":
        return {"x": r(3, 8), "weight": r(8), "bias": r(8)}
    if op == "softmax":
        return {"x": r(2, 3, 8), "bias": r(3, 8), "mask": torch.ones(2, 1, 8, dtype=torch.bool)}
    if op == "evoformer_attention":
        return {
            "q": r(1, 2, 2, 4, 16),
            "k": r(1, 2, 2, 5, 16),
            "v": r(1, 2, 2, 5, 16),
            "bias": r(1, 1, 2, 4, 5),
            "mask": torch.ones(1, 2, 5),
            "key_bias": r(1, 2, 5),
        }
    if op == "triangle_multiplication":
        c_z, c_h = 8, 4
        return {
            "z": r(5, 5, c_z),
            "mask": torch.ones(5, 5),
            "ln_in_weight": r(c_z),
            "ln_in_bias": r(c_z),
            "proj_weight": r(4 * c_h + c_z, c_z),
            "proj_bias": r(4 * c_h + c_z),
            "ln_out_weight": r(c_h),
            "ln_out_bias": r(c_h),
            "out_weight": r(c_z, c_h),
            "out_bias": r(c_z),
        }
    if op == "sigmoid_gate":
        return {"g": r(3, 8), "o": r(3, 8), "bias": r(8)}
    if op == "bias_dropout_add":
        return {"x": r(3, 8), "residual": r(3, 8), "bias": r(8)}
    if op == "gated_linear":
        return {"g": r(3, 8), "o": r(3, 8), "weight": r(5, 8), "bias": r(5)}
    if op == "relu_mlp":
        return {"x": r(3, 8), "w1": r(16, 8), "b1": r(16), "w2": r(8, 16), "b2": r(8)}
    assert op == "outer_product_linear"
    return {"a": r(3, 4, 2), "b": r(3, 5, 3), "weight": r(6, 6), "bias": r(6)}


OPS = {
    "layer_norm": lambda x, weight, bias: layer_norm(x, (x.shape[-1],), weight, bias),
    "softmax": softmax,
    "evoformer_attention": evoformer_attention,
    "triangle_multiplication": triangle_multiplication,
    "sigmoid_gate": sigmoid_gate,
    "bias_dropout_add": bias_dropout_add,
    "gated_linear": gated_linear,
    "relu_mlp": relu_mlp,
    "outer_product_linear": outer_product_linear,
}
# The argument every other one is checked against (its device is the op's).
PRIMARY = {"x", "q", "z", "g", "a"}
BAD_DTYPES = (torch.int64, torch.bool, torch.complex64)


def argument_cases() -> list[tuple[str, str]]:
    return [(op, name) for op in OPS for name in valid_arguments(op)]


@pytest.mark.parametrize("op, name", argument_cases(), ids=lambda v: str(v))
def test_every_argument_on_another_device_or_of_a_bad_dtype_names_itself(op, name):
    args = valid_arguments(op)
    OPS[op](**args)  # valid as given
    for dtype in BAD_DTYPES:
        if name == "mask" and dtype != torch.complex64:
            continue  # masks may be bool or integer 0/1
        bad = dict(args, **{name: args[name].to(dtype)})
        with pytest.raises(ValueError, match=f"^{name}:"):
            OPS[op](**bad)
    if name not in PRIMARY:
        bad = dict(args, **{name: args[name].to("meta")})
        with pytest.raises(ValueError, match=f"^{name}:"):
            OPS[op](**bad)


LINEAR_OPS = ("gated_linear", "relu_mlp", "outer_product_linear")


@pytest.mark.parametrize(
    "op, name",
    # g and o may differ in dtype: the gate's output has their promoted one.
    [(op, name) for op in LINEAR_OPS for name in valid_arguments(op) if name not in PRIMARY | {"o"}],
)
def test_matmul_operands_of_another_float_dtype_name_themselves(op, name):
    # As nn.Linear: outside autocast the weights, biases and the other operand have the activations'
    # dtype (the reference raises a RuntimeError inside F.linear otherwise); under autocast any float
    # dtype is cast, and the op matches its reference there.
    args = valid_arguments(op)
    bad = dict(args, **{name: args[name].to(torch.bfloat16)})
    with pytest.raises(ValueError, match=f"^{name}:"):
        OPS[op](**bad)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = OPS[op](**bad)
        ref = {"gated_linear": gated_linear_reference, "relu_mlp": relu_mlp_reference}.get(
            op, outer_product_linear_reference
        )(**bad)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


# ----------------------------------------------------------------------------- degenerate shapes


@pytest.mark.parametrize("device", DEVICES)
def test_zero_dim_gate_matches_the_reference(device, seed):
    g = torch.randn((), device=device, requires_grad=True)
    o = torch.randn((), device=device, requires_grad=True)
    compare(lambda ref: (sigmoid_gate_reference if ref else sigmoid_gate)(g, o), {"g": g, "o": o})


def test_zero_dim_inputs_raise_a_value_error():
    s = torch.tensor(1.0)
    with pytest.raises(ValueError, match="^x:"):
        relu_mlp(s, torch.ones(4, 1), None, torch.ones(1, 4), None)
    with pytest.raises(ValueError, match="^g, o:"):
        gated_linear(s, s, torch.ones(2, 1))
    with pytest.raises(ValueError, match="^x:"):
        softmax(s)
    with pytest.raises(ValueError, match="^x:"):
        bias_dropout_add(s, s)


def empty_cases(device: str) -> dict[str, tuple[Callable[[bool], torch.Tensor], dict[str, torch.Tensor]]]:
    """Per op, a call on zero rows (or zero MSA rows, zero keys) and the leaves to differentiate."""

    def leaf(*shape):
        return torch.randn(*shape, device=device, requires_grad=True)

    x, w, b = leaf(0, 3, 8), leaf(8), leaf(8)
    cases = {
        "layer_norm": (
            lambda ref: (layer_norm_reference if ref else layer_norm)(x, (8,), w, b),
            {"x": x, "weight": w, "bias": b},
        )
    }
    xs, bias = leaf(0, 4, 8), leaf(4, 8)
    cases["softmax"] = (
        lambda ref: (softmax_reference if ref else softmax)(xs, bias),
        {"x": xs, "bias": bias},
    )
    q, k, v, pb = leaf(1, 0, 2, 4, 16), leaf(1, 0, 2, 5, 16), leaf(1, 0, 2, 5, 16), leaf(1, 1, 2, 4, 5)
    attn = lambda ref: (evoformer_attention_reference if ref else evoformer_attention)(q, k, v, pb)  # noqa: E731
    cases["evoformer_attention"] = (attn, {"q": q, "k": k, "v": v, "bias": pb})
    z = leaf(0, 5, 5, 8)
    tri = [leaf(8), leaf(8), leaf(24, 8), leaf(24), leaf(4), leaf(4), leaf(8, 4), leaf(8)]
    cases["triangle_multiplication"] = (
        lambda ref: (triangle_multiplication_reference if ref else triangle_multiplication)(z, None, *tri),
        {"z": z, "proj_bias": tri[3], "out_bias": tri[7]},
    )
    g, o, gb = leaf(0, 8), leaf(0, 8), leaf(8)
    cases["sigmoid_gate"] = (
        lambda ref: (sigmoid_gate_reference if ref else sigmoid_gate)(g, o, gb),
        {"g": g, "o": o, "bias": gb},
    )
    cases["bias_dropout_add"] = (
        lambda ref: (bias_dropout_add_reference if ref else bias_dropout_add)(g, o, gb, 0.0, False),
        {"x": g, "residual": o, "bias": gb},
    )
    lw, lb = leaf(5, 8), leaf(5)
    cases["gated_linear"] = (
        lambda ref: (gated_linear_reference if ref else gated_linear)(g, o, lw, lb),
        {"g": g, "o": o, "weight": lw, "bias": lb},
    )
    mx, w1, b1, w2, b2 = leaf(0, 8), leaf(16, 8), leaf(16), leaf(8, 16), leaf(8)
    cases["relu_mlp"] = (
        lambda ref: (relu_mlp_reference if ref else relu_mlp)(mx, w1, b1, w2, b2),
        {"x": mx, "w1": w1, "b1": b1, "w2": w2, "b2": b2},
    )
    # Zero MSA rows: the outer product sums nothing, so the output is the bias at every pair.
    a, bb, ow, ob = leaf(0, 4, 2), leaf(0, 5, 3), leaf(6, 6), leaf(6)
    cases["outer_product_linear"] = (
        lambda ref: (outer_product_linear_reference if ref else outer_product_linear)(a, bb, ow, ob),
        {"a": a, "b": bb, "weight": ow, "bias": ob},
    )
    a0, b0 = leaf(2, 3, 0, 2), leaf(2, 3, 5, 3)
    cases["outer_product_linear, no residues"] = (
        lambda ref: (outer_product_linear_reference if ref else outer_product_linear)(a0, b0, ow, ob),
        {"a": a0, "b": b0, "weight": ow, "bias": ob},
    )
    return cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(empty_cases("cpu")))
def test_empty_inputs_match_the_reference(op, device, seed):
    run, leaves = empty_cases(device)[op]
    compare(run, leaves)


# ----------------------------------------------------------------------------- non-finite values


@pytest.mark.parametrize("device", DEVICES)
def test_relu_mlp_gradient_through_an_inf_weight_of_an_off_unit(device, seed):
    # Unit 3 is off for every row (a large negative bias), and its outgoing weights are inf: autograd
    # of the reference passes no gradient through an off unit, so x's gradient stays finite.
    x = torch.randn(6, 8, device=device, requires_grad=True)
    w1, w2 = torch.randn(16, 8, device=device), torch.randn(8, 16, device=device)
    b1 = torch.zeros(16, device=device)
    b1[3] = -1e4
    w2[:, 3] = float("inf")
    leaves = {"x": x}

    def run(reference: bool) -> torch.Tensor:
        return (relu_mlp_reference if reference else relu_mlp)(x, w1, b1, w2, None)

    grads = torch.autograd.grad(relu_mlp_reference(x, w1, b1, w2, None).sum(), x)
    assert torch.isfinite(grads[0]).all()
    compare(run, leaves)


@pytest.mark.parametrize("device", DEVICES)
def test_gate_and_softmax_gradients_with_infinite_inputs(device, seed):
    g = torch.randn(4, 8, device=device)
    g[0, 1], g[2, 5] = float("inf"), float("-inf")
    g.requires_grad_(True)
    o = torch.randn(4, 8, device=device, requires_grad=True)
    compare(lambda ref: (sigmoid_gate_reference if ref else sigmoid_gate)(g, o), {"g": g, "o": o})
    x = torch.randn(3, 5, 12, device=device)
    x[0, 0, 3] = x[1, 2, :5] = float("-inf")  # masked logits: probability 0, gradient 0
    x.requires_grad_(True)
    compare(lambda ref: (softmax_reference if ref else softmax)(x), {"x": x})


# ----------------------------------------------------------------------------- mixed parameter dtypes


@pytest.mark.parametrize("device", DEVICES)
def test_triangle_multiplication_with_mixed_layer_norm_dtypes(device, seed):
    # LayerNorm parameters of any float dtype are allowed: the fast path, the CPU dispatch and the
    # reference accept the same arguments and agree.
    c_z, c_h, n = 16, 8, 6
    z = torch.randn(1, n, n, c_z, device=device, requires_grad=True)
    dtypes = (torch.bfloat16, torch.float16, torch.float64, torch.bfloat16)
    ln = [
        (torch.randn(size, device=device) * 0.5 + 1).to(dt).requires_grad_(True)
        for size, dt in zip((c_z, c_z, c_h, c_h), dtypes, strict=True)
    ]
    proj_w, proj_b = torch.randn(4 * c_h + c_z, c_z, device=device), torch.randn(4 * c_h + c_z, device=device)
    out_w, out_b = torch.randn(c_z, c_h, device=device), torch.randn(c_z, device=device)
    args = (ln[0], ln[1], proj_w, proj_b, ln[2], ln[3], out_w, out_b)
    leaves = {
        "z": z,
        "ln_in_weight": ln[0],
        "ln_in_bias": ln[1],
        "ln_out_weight": ln[2],
        "ln_out_bias": ln[3],
    }

    def run(reference: bool) -> torch.Tensor:
        fn = triangle_multiplication_reference if reference else triangle_multiplication
        return fn(z, None, *args).float()

    out, ref = run(False), run(True)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    grads = torch.autograd.grad(out.sum(), list(leaves.values()))
    ref_grads = torch.autograd.grad(ref.sum(), list(leaves.values()))
    for name, g, r in zip(leaves, grads, ref_grads, strict=True):
        assert g.dtype == r.dtype == leaves[name].dtype, name
        scale = r.float().abs().max().item()
        torch.testing.assert_close(g.float(), r.float(), rtol=2e-2, atol=2e-2 * scale, msg=name)
    if device == "cpu":
        with reference_on_cpu():
            torch.testing.assert_close(run(False), ref)
