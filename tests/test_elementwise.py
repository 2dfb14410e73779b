"""hfkit.ops.sigmoid_gate and bias_dropout_add against their references, the dropout mask's statistics
and sharing, the fused dropout modules and their swap, and the swapped Evoformer end to end.

On CPU the kernels run under TRITON_INTERPRET=1 (set in conftest.py); on a GPU machine the op tests
also run on CUDA. Dropout is compared with the reference on the mask the kernel realised
(`dropout_keep_mask`), since the kernel and `bernoulli_` draw different masks from one seed.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_close

from hfkit.nn import (
    DropoutColumnwise,
    DropoutRowwise,
    FusedDropoutColumnwise,
    FusedDropoutRowwise,
    SharedDropout,
    to_hfkit,
    to_torch,
)
from hfkit.ops import (
    bias_dropout_add,
    bias_dropout_add_reference,
    sigmoid_gate,
    sigmoid_gate_reference,
)
from hfkit.ops._triton import rows_view
from hfkit.ops.elementwise import (
    dropout_keep_mask,
    row_scale,
    row_scale_add_,
    row_scale_reference,
    uses_triton,
)

DEVICES = (["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []) + (
    ["cuda"] if torch.cuda.is_available() else []
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def grads_of(fn, inputs: list[torch.Tensor], dy: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*leaves)
    return y, list(torch.autograd.grad(y, leaves, dy))


# ----------------------------------------------------------------------------- sigmoid_gate


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_sigmoid_gate_matches_reference(device, dtype, with_bias, seed):
    # [*, Q, H, C] as in Attention._wrap_up; odd Q and C, a bias over (H, C).
    g = torch.randn(2, 13, 3, 7, device=device, dtype=dtype) * 3
    o = torch.randn(2, 13, 3, 7, device=device, dtype=dtype)
    bias = torch.randn(3, 7, device=device, dtype=dtype) if with_bias else None
    assert uses_triton(g, o)
    inputs = [g, o] + ([bias] if with_bias else [])
    dy = torch.randn_like(g)
    y, grads = grads_of(sigmoid_gate, inputs, dy)
    y_ref, ref = grads_of(sigmoid_gate_reference, [t.float() for t in inputs], dy.float())
    assert y.dtype == dtype and y.shape == g.shape
    assert_close(y.float(), y_ref, dtype)
    for got, want, t in zip(grads, ref, inputs, strict=True):
        assert got.dtype == t.dtype and got.shape == t.shape
        # the bias gradient sums 26 rows: allow for that many roundings of the half-precision dg
        scale = 8.0 if (t is bias and dtype != torch.float32) else 1.0
        rtol, atol = (scale * v for v in {torch.float32: (1e-5, 1e-5)}.get(dtype, (2e-2, 2e-2)))
        torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("device", DEVICES)
def test_sigmoid_gate_strided_and_mixed_dtypes(device, seed):
    # o a transposed view (as attention outputs are), g bfloat16 and o float32 -> float32 result.
    g = torch.randn(5, 4, 3, device=device, dtype=torch.bfloat16)
    o = torch.randn(5, 3, 4, device=device).transpose(-1, -2)
    assert not o.is_contiguous()
    dy = torch.randn(5, 4, 3, device=device)
    y, (dg, do) = grads_of(sigmoid_gate, [g, o], dy)
    y_ref, (dg_ref, do_ref) = grads_of(sigmoid_gate_reference, [g.float(), o], dy)
    assert y.dtype == torch.float32 and dg.dtype == torch.bfloat16
    assert_close(y, y_ref, torch.float32)
    assert_close(do, do_ref, torch.float32)
    assert_close(dg.float(), dg_ref, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lead", [(3, 5), (1, 4), (6,)], ids=str)
def test_sigmoid_gate_reads_a_column_slice_in_place(device, lead, seed):
    # g a column slice of a wider projection (one GEMM of stacked weights): read with its row
    # stride, no copy; the result is the reference's.
    proj = torch.randn(*lead, 24, device=device, dtype=torch.bfloat16) * 3
    g = proj[..., 8:19]
    o = torch.randn(*lead, 11, device=device, dtype=torch.bfloat16)
    assert not g.is_contiguous() and rows_view(g, 11).stride(0) == 24
    assert rows_view(g, 11).data_ptr() == g.data_ptr()
    y = sigmoid_gate(g, o)
    assert_close(y.float(), sigmoid_gate_reference(g.float(), o.float()), torch.bfloat16)
    # Rows not equally spaced (every other row of 3 x 5): copied first, same result.
    uneven = torch.randn(3, 5, 24, device=device, dtype=torch.bfloat16)[:, ::2, 8:19]
    assert rows_view(uneven, 11).stride(0) == 11 and rows_view(uneven, 11).data_ptr() != uneven.data_ptr()
    o = torch.randn(3, 3, 11, device=device, dtype=torch.bfloat16)
    assert_close(
        sigmoid_gate(uneven, o).float(), sigmoid_gate_reference(uneven.float(), o.float()), torch.bfloat16
    )


def test_sigmoid_gate_cpu_fallback_is_the_reference():
    # float64 never takes the kernels: the result is the reference's, bit for bit.
    g, o = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    assert not uses_triton(g, o)
    assert torch.equal(sigmoid_gate(g, o), torch.sigmoid(g) * o)


# ----------------------------------------------------------------------------- bias_dropout_add


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shared_dim", [None, -3, -2, -1, 0], ids=lambda d: f"shared{d}")
@pytest.mark.parametrize("shape", [(2, 5, 7, 9), (1, 8, 12, 5)], ids=["odd", "rows4"])
def test_bias_dropout_add_matches_reference_on_the_kernel_mask(device, dtype, shared_dim, shape, seed):
    # z-like [B, N_i, N_j, C]; forward and all three gradients on the realised mask. Odd sizes, and
    # shared dims of 8 and 12 rows, where the kernels draw once per tile column (ROW_SHARED).
    p, s = 0.3, 1234 + (shared_dim or 0)
    x = torch.randn(shape, device=device, dtype=dtype)
    residual = torch.randn(shape, device=device, dtype=dtype)
    bias = torch.randn(shape[-1], device=device, dtype=dtype)
    dy = torch.randn(shape, device=device, dtype=dtype)
    keep = dropout_keep_mask(shape, p, shared_dim, s, device)

    def fused(x_, r_, b_):
        return bias_dropout_add(x_, r_, b_, p=p, shared_dim=shared_dim, seed=s)

    def ref(x_, r_, b_):
        return bias_dropout_add_reference(x_, r_, b_, p=p, shared_dim=shared_dim, keep=keep)

    y, grads = grads_of(fused, [x, residual, bias], dy)
    y_ref, ref_grads = grads_of(ref, [x.float(), residual.float(), bias.float()], dy.float())
    assert y.dtype == dtype
    assert_close(y.float(), y_ref, dtype)
    names = ["x", "residual", "bias"]
    for name, got, want, t in zip(names, grads, ref_grads, (x, residual, bias), strict=True):
        assert got.dtype == t.dtype, name
        # the bias gradient sums up to 96 rows of half-precision dx
        half = (1e-1, 1e-1) if name == "bias" else (2e-2, 2e-2)
        rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else half
        torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_bias_dropout_add_eval_is_an_add(device, seed):
    x, residual = torch.randn(3, 11, 6, device=device), torch.randn(3, 11, 6, device=device)
    bias = torch.randn(6, device=device)
    for kwargs in ({"p": 0.5, "training": False}, {"p": 0.0, "training": True}):
        y, (dx, dr, db) = grads_of(
            lambda a, r, b, kw=kwargs: bias_dropout_add(a, r, b, shared_dim=-2, **kw),
            [x, residual, bias],
            torch.ones_like(x),
        )
        assert_close(y, residual + x + bias)
        assert torch.equal(dx, torch.ones_like(x)) and torch.equal(dr, torch.ones_like(x))
        assert_close(db, torch.full((6,), 33.0, device=device))
    assert_close(bias_dropout_add(x, residual, training=False), residual + x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shared_dim", [-3, -2], ids=["rowwise", "columnwise"])
def test_dropout_mask_statistics_and_sharing(device, shared_dim):
    # x = 1, residual = 0: the output is the scaled keep mask itself.
    shape, p = (1, 24, 40, 33), 0.25
    ones = torch.ones(shape, device=device)
    y = bias_dropout_add(ones, torch.zeros_like(ones), p=p, shared_dim=shared_dim, seed=7)
    first = y.narrow(shared_dim, 0, 1)
    assert torch.equal(y, first.expand(shape))  # one decision shared along the dim, exactly
    values = torch.unique(y)
    assert torch.allclose(values, torch.tensor([0.0, 1.0 / (1.0 - p)], device=device))
    kept = (first > 0).float().mean().item()
    n = first.numel()
    assert abs(kept - (1.0 - p)) < 5 * ((p * (1 - p) / n) ** 0.5), kept  # 5 sigma
    # neighbouring mask positions are not correlated (a broken counter would repeat draws)
    flat = (first > 0).float().flatten()
    corr = torch.corrcoef(torch.stack([flat[:-1], flat[1:]]))[0, 1].item()
    assert abs(corr) < 5 / n**0.5, corr
    assert torch.equal(dropout_keep_mask(shape, p, shared_dim, 7, device) / (1 - p), first)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_is_deterministic_given_the_seed(device):
    x, residual = torch.randn(4, 6, 10, device=device), torch.randn(4, 6, 10, device=device)
    run = lambda **kw: bias_dropout_add(x, residual, p=0.5, shared_dim=-3, **kw)
    assert torch.equal(run(seed=3), run(seed=3))
    assert not torch.equal(run(seed=3), run(seed=4))
    seed_t = torch.tensor([3], device=device)
    assert torch.equal(run(seed=seed_t), run(seed=3))
    torch.manual_seed(0)
    a = run()
    torch.manual_seed(0)
    assert torch.equal(run(), a)  # no seed: drawn from the default generator
    assert not torch.equal(run(), a)


def test_bias_dropout_add_cpu_fallback_is_the_reference(seed):
    # float64 runs the reference (the Evoformer's own code), seeded through a generator.
    x, residual = torch.randn(3, 5, 4, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64)
    a = bias_dropout_add(x, residual, p=0.5, shared_dim=-2, seed=11)
    b = bias_dropout_add_reference(
        x, residual, p=0.5, shared_dim=-2, generator=torch.Generator().manual_seed(11)
    )
    assert torch.equal(a, b)
    keep = (a - residual) != 0
    assert torch.equal(keep, keep[:, :1].expand_as(keep))  # shared along dim -2


def test_bad_inputs_name_the_argument():
    x = torch.randn(3, 4, 5)
    cases = [
        (lambda: sigmoid_gate(x, torch.randn(3, 4, 6)), "o"),
        (lambda: sigmoid_gate(x.long(), x), "g"),
        (lambda: sigmoid_gate(x, x, torch.randn(6)), "bias"),
        (lambda: bias_dropout_add(x, torch.randn(3, 4)), "residual"),
        (lambda: bias_dropout_add(x, x, torch.randn(4, 5)), "bias"),
        (lambda: bias_dropout_add(x, x, p=1.0), "p"),
        (lambda: bias_dropout_add(x, x, p=0.1, shared_dim=3), "shared_dim"),
        (lambda: bias_dropout_add(x, x, p=0.1, seed=-1), "seed"),
        (lambda: bias_dropout_add(x, x, p=0.1, seed=torch.tensor([1.0])), "seed"),
    ]
    for call, name in cases:
        with pytest.raises(ValueError, match=f"^{name}:"):
            call()


# ----------------------------------------------------------------------------- modules and the model


def test_fused_dropout_modules_swap_and_match(seed):
    mods = torch.nn.ModuleDict({"row": DropoutRowwise(0.25), "col": DropoutColumnwise(0.25)})
    fused, report = to_hfkit(mods, inplace=False, report=True)
    assert type(fused.row) is FusedDropoutRowwise and type(fused.col) is FusedDropoutColumnwise
    assert report.counts() == {"DropoutRowwise": 1, "DropoutColumnwise": 1}
    assert type(to_torch(fused).row) is DropoutRowwise
    z, u = torch.randn(2, 5, 6, 3), torch.randn(2, 5, 6, 3)
    for name in ("row", "col"):
        eager, mod = mods[name], fused[name]
        mod.eval()
        assert torch.equal(mod.residual_add(z, u), z + u)
        mod.train()
        out = mod.residual_add(z, u)
        keep = (out - z).abs() > 1e-6
        assert torch.equal(keep, keep.narrow(mod.shared_dim, 0, 1).expand_as(keep))
        torch.manual_seed(1)
        plain = eager.train().residual_add(z, u)
        torch.manual_seed(1)
        assert torch.equal(plain, z + eager(u))  # the plain path is the old `z + dropout(u)`
    assert isinstance(SharedDropout(0.1, -1).residual_add(z, u), torch.Tensor)


def _tiny_model(seed: int = 0, **changes):
    from hfkit.model import AlphaFoldLite, ModelConfig

    torch.manual_seed(seed)
    model = AlphaFoldLite(ModelConfig.tiny().replace(**changes))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # noise on every parameter: the zero-initialised layers would hide the gate
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def _batch():
    from test_model import random_batch

    return random_batch(3, num_res=7, num_seq=3, num_extra=2)


OPS = {"Attention", "DropoutRowwise", "DropoutColumnwise"}


@pytest.mark.usefixtures("one_thread")
def test_swapped_evoformer_equals_eager_in_eval():
    model = _tiny_model(no_blocks=1).eval()  # one block: the attention kernels are slow interpreted
    batch = _batch()
    keys = list(model.state_dict())
    with torch.no_grad():
        expected = model(batch)["pair"]
        fused, report = to_hfkit(model, inplace=False, include=OPS, report=True)
        got = fused(batch)["pair"]
    assert list(fused.state_dict()) == keys
    assert report.counts()["DropoutRowwise"] > 0 and report.counts()["DropoutColumnwise"] > 0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.usefixtures("one_thread")
def test_swapped_evoformer_trains_with_dropout():
    # Only the dropout swaps: the attention kernels' backward is slow under the interpreter and
    # tested in test_evoformer_attention.py; the gate's backward is tested above.
    fused = to_hfkit(_tiny_model(), include=OPS - {"Attention"}).train()
    batch = _batch()
    torch.manual_seed(5)
    out = fused(batch)
    loss = out["pair"].square().mean()
    loss.backward()
    grads = [p.grad for p in fused.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        torch.manual_seed(5)
        again = fused(batch)["pair"]
        other = fused(batch)["pair"]
        evaluated = fused.eval()(batch)["pair"]
    assert torch.equal(again, out["pair"].detach())  # the seeds come from torch's generator
    assert not torch.equal(other, again) and not torch.equal(evaluated, again)


@pytest.mark.usefixtures("one_thread")
def test_checkpointed_training_regenerates_the_same_masks():
    # Recomputation under activation checkpointing replays torch's RNG, so the kernel's seeds (and
    # masks) match the first forward: gradients equal those without checkpointing.
    batch = _batch()
    grads = []
    for recompute in (False, True):
        model = to_hfkit(_tiny_model(checkpoint=recompute), include=OPS - {"Attention"}).train()
        torch.manual_seed(9)
        model(batch)["pair"].square().mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_elementwise_benchmark_rows_on_cpu():
    from hfkit.bench.cases.elementwise import BENCHMARK, Case
    from hfkit.bench.ceilings import Ceilings
    from hfkit.bench.runner import run_benchmark

    cases = [
        Case("gate", "sigmoid_gate", (2, 3, 5)),
        Case("drop", "bias_dropout_add", (3, 4, 5), p=0.5, shared_dim=-2),
    ]
    ceilings = Ceilings(copy_gbps=10.0, matmul_tflops=1.0, device_name="cpu")
    rows = run_benchmark(
        BENCHMARK, cases, "cpu", dtypes=["fp32"], modes=["fwd+bwd"], providers=["hfkit", "eager"],
        progress=False, ceilings=ceilings, warmup=1, reps=1,
    ).rows  # fmt: skip
    assert [(r.op, r.provider) for r in rows] == [
        ("sigmoid_gate", "hfkit"),
        ("sigmoid_gate", "eager"),
        ("bias_dropout_add", "hfkit"),
        ("bias_dropout_add", "eager"),
    ]
    # minimum traffic: gate fwd+bwd 8 passes of 30 floats, dropout fwd+bwd 5 passes of 60
    assert [r.bytes for r in rows] == [8 * 4 * 30] * 2 + [5 * 4 * 60] * 2
    assert all(r.p50_ms > 0 and r.extra["max_abs_err"] < 1e-5 for r in rows)
    assert all(0.0 < r.extra["kept_fraction"] < 1.0 for r in rows[2:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("divide", [False, True], ids=["mul", "div"])
def test_row_scale_matches_reference(device, dtype, divide, seed):
    """x * s (x / s) for a factor per row: output and dx on odd sizes, a strided x, and a float32
    factor beside a half-precision x (the promoted dtype, as torch's)."""
    x = torch.randn(3, 7, 2 * 37, device=device, dtype=dtype)[..., ::2].requires_grad_(True)
    for sdtype in {dtype, torch.float32}:
        scale = torch.rand(3, 7, 1, device=device, dtype=sdtype) + 0.25
        y = row_scale(x, scale, divide=divide)
        ref = row_scale_reference(x.detach().double(), scale.double(), divide)
        assert y.dtype == torch.promote_types(dtype, sdtype)
        assert_close(y.double(), ref, dtype=dtype, msg="output")
        dy = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, dy)
        ref_dx = row_scale_reference(dy.double(), scale.double(), divide)
        assert dx.dtype == dtype
        assert_close(dx.double(), ref_dx, dtype=dtype, msg="dx")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("divide", [False, True], ids=["mul", "div"])
def test_row_scale_add_in_place(device, dtype, divide, seed, monkeypatch):
    """z += x * s (x / s) in z's storage, one kernel where z is contiguous in x's dtype (odd sizes, a
    strided x); a strided z or a float32 factor beside a bfloat16 z adds `row_scale`'s result."""
    import hfkit.ops.elementwise as elementwise

    calls = []
    fused = elementwise._row_scale_add
    monkeypatch.setattr(elementwise, "_row_scale_add", lambda *a: calls.append(1) or fused(*a))
    x = torch.randn(3, 7, 2 * 37, device=device, dtype=dtype)[..., ::2]
    scale = torch.rand(3, 7, 1, device=device, dtype=dtype) + 0.25
    for z in (torch.randn(3, 7, 37, device=device, dtype=dtype),
              torch.randn(7, 3, 37, device=device, dtype=dtype).transpose(0, 1)):  # fmt: skip
        expected = z.double() + row_scale_reference(x.double(), scale.double(), divide)
        before = z.data_ptr()
        with torch.no_grad():
            assert row_scale_add_(z, x, scale, divide) is z
        assert z.data_ptr() == before
        assert_close(z.double(), expected, dtype=dtype, msg="z")
    assert len(calls) == 1  # the contiguous z
    with pytest.raises(ValueError, match="z: expected"), torch.no_grad():
        row_scale_add_(torch.zeros(3, 7, 36, device=device, dtype=dtype), x, scale)
    with pytest.raises(RuntimeError, match="no_grad"):
        row_scale_add_(z, x.requires_grad_(), scale)


def test_row_scale_falls_back_and_checks():
    x = torch.randn(2, 5, 4, requires_grad=True)
    s = torch.rand(2, 5, 1, requires_grad=True) + 0.5
    y = row_scale(x, s)  # a factor that needs a gradient: the reference, with one
    (ds,) = torch.autograd.grad(y.sum(), s)
    torch.testing.assert_close(ds, x.detach().sum(-1, keepdim=True))
    torch.testing.assert_close(row_scale(x, torch.full((1, 5, 1), 2.0)), x * 2)  # broadcast: reference
    with pytest.raises(ValueError, match="scale: expected"):
        row_scale(x, torch.ones(2, 5))
    with pytest.raises(ValueError, match="scale"):
        row_scale(x, torch.ones(2, 5, 1, dtype=torch.int64))
