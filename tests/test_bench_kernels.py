"""Tests of the Evoformer kernel benchmarks on CPU: evoformer_attention, softmax, triangle_multiplication.

The benchmark functions run at tiny shapes with the wall-clock timer, so every code path the GPU run
takes (input layouts, checks, peak memory, error rows, tables, figures, the CLI) is exercised; peers
that need a GPU are skipped with their reason. The peers' own semantics (trifast's True-is-masked mask
and [B, H, S, N, D] layout, cuEquivariance's packed [a; b] projections) are stood in for by small
plain-torch functions written from their documentation, so the adapters are checked here too. No test
asserts a speed.
"""

from __future__ import annotations

import importlib.metadata
import json
import math

import pytest
import torch

from hfkit.bench import Ceilings, ResultRow, peers
from hfkit.bench.cases import evoformer_attention as attn_bench
from hfkit.bench.cases import softmax as softmax_bench
from hfkit.bench.cases import triangle_multiplication as trimul_bench
from hfkit.bench.cases.softmax import softmax_bytes, softmax_cases
from hfkit.bench.cases.triangle_multiplication import TrimulCase, cueq_trimul, make_trimul_module
from hfkit.bench.kernels import best_peer_table, kernel_frame, load_kernel_results
from hfkit.bench.peers import _import_reason, load_cuequivariance, load_flashrnn, load_trifast, peer_status
from hfkit.bench.runner import Steps, measure_case, run_benchmark
from hfkit.cli import main
from hfkit.viz.kernels import kernel_goals

CPU = torch.device("cpu")
CEILINGS = Ceilings(copy_gbps=10.0, matmul_tflops=0.1, device_name="CPU (test)", matmul_dtype="fp32")
ENV = dict(gpu="CPU (test)", torch="x", triton=None, python="3", commit=None, command="test", timestamp="t")


# --- stand-ins for the peers, written from their documentation -----------------------------------------


def fake_trifast(q, k, v, b, mask):
    """trifast's semantics: q/k/v [B, H, S, N, D], bias [B, H, N, N], mask bool [B, S, N], True = masked."""
    logits = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + b[:, :, None]
    logits = logits.masked_fill(mask[:, None, :, None, :], float("-inf"))
    return torch.softmax(logits.float(), -1).to(q.dtype) @ v


def fake_cueq_trimul(x, direction, mask, norm_in_weight, norm_in_bias, p_in_weight, p_in_bias, g_in_weight,
                     g_in_bias, norm_out_weight, norm_out_bias, p_out_weight, p_out_bias, g_out_weight,
                     g_out_bias, eps=1e-5, precision=None):  # fmt: skip
    """cuEquivariance's documented formula: p_in / g_in are [2D, C] with rows [a; b]."""
    f = torch.nn.functional
    x_in = f.layer_norm(x, x.shape[-1:], norm_in_weight, norm_in_bias, eps)
    gated = f.linear(x_in, p_in_weight, p_in_bias) * torch.sigmoid(f.linear(x_in, g_in_weight, g_in_bias))
    a, b = (gated * mask[..., None]).chunk(2, dim=-1)
    eq = "bikc,bjkc->bijc" if direction == "outgoing" else "bkic,bkjc->bijc"
    u = f.layer_norm(torch.einsum(eq, a, b), a.shape[-1:], norm_out_weight, norm_out_bias, eps)
    return f.linear(u, p_out_weight, p_out_bias) * torch.sigmoid(f.linear(x_in, g_out_weight, g_out_bias))


# --- attention -----------------------------------------------------------------------------------------


def test_attention_benchmark_rows_on_cpu():
    case = attn_bench.AttentionCase("msa_row_attention", 1, 3, 2, 9, 16)
    seen = []
    result = run_benchmark(
        attn_bench.BENCHMARK, [case], CPU, modes=("fwd+bwd",),
        providers=("hfkit", "eager", "sdpa", "trifast", "cuequivariance"), progress=False, ceilings=CEILINGS,
        warmup=0, reps=1, on_row=seen.append,
    )  # fmt: skip
    assert [r.provider for r in result.rows] == ["hfkit", "eager", "sdpa"]
    assert seen == result.rows  # each row handed over as it is measured (the CLI saves it at once)
    assert len(result.skipped) == 2 and all("needs a CUDA device" in s for s in result.skipped)
    fwd_flops = 4 * 3 * 2 * 9 * 9 * 16
    for row in result.rows:
        assert row.op == "msa_row_attention" and row.shape == [1, 3, 2, 9, 16] and row.dtype == "bf16"
        assert row.method == "wall" and row.n_reps == 1 and 0 < row.p20_ms <= row.p50_ms <= row.p80_ms
        assert row.flops == int(3.5 * fwd_flops) and row.tflops == pytest.approx(row.flops / row.p50_ms / 1e9)
        assert row.extra["check_ok"] and row.extra["max_abs_err_vs_fp32_ref"] < attn_bench.CHECK_TOL["bf16"]
        assert row.peak_mem_bytes is None  # CPU


def test_attention_cases_sizes_and_ops():
    cpu = attn_bench.attention_cases("smoke", sizes=(7, 11))
    assert [(c.op, c.rows, c.n) for c in cpu] == [
        ("triangle_attention", 7, 7), ("triangle_attention", 11, 11),
        ("msa_row_attention", 2, 7), ("msa_row_attention", 3, 11),
    ]  # fmt: skip
    assert all(c.op == "msa_row_attention" for c in attn_bench.attention_cases("smoke", ["msa_row"]))
    with pytest.raises(ValueError, match="ops"):
        attn_bench.attention_cases("smoke", ["triangular"])


@pytest.mark.parametrize("rows", [5, 1])
def test_trifast_layout_and_check_catch_a_flipped_mask(rows):
    case = attn_bench.AttentionCase("triangle_attention", 1, rows, 2, 11, 16)
    gen = torch.Generator().manual_seed(1)
    s = attn_bench._make_set(case, torch.float32, CPU, gen)
    to_bshnd = lambda o: o.transpose(1, 2)  # noqa: E731
    right = attn_bench._Impl(fake_trifast, attn_bench._trifast_layout, to_bshnd, {})
    native = right.prepare(s, True)
    assert native.args[0].shape == (1, 2, rows, 11, 16) and native.args[4].dtype == torch.bool
    assert native.args[4][..., -1].all() and not native.args[4][..., 0].any()  # True = masked (padding)
    assert attn_bench._check(right, native, s, "fp32")["check_ok"]

    def flipped(q, k, v, b, mask):
        return fake_trifast(q, k, v, b, ~mask)

    wrong = attn_bench._Impl(flipped, attn_bench._trifast_layout, to_bshnd, {})
    result = attn_bench._check(wrong, wrong.prepare(s, False), s, "fp32")
    assert not result["check_ok"] and result["max_abs_err_vs_fp32_ref"] > 0.1


def test_cueq_layout_uses_fp32_bias_and_keep_mask():
    case = attn_bench.AttentionCase("msa_row_attention", 1, 3, 2, 10, 16)
    s = attn_bench._make_set(case, torch.bfloat16, CPU, torch.Generator().manual_seed(0))
    native = attn_bench._cueq_layout(s, True)
    q, _, _, bias, keep = native.args
    assert bias.dtype == torch.float32 and bias.requires_grad and q.requires_grad
    assert (
        keep.dtype == torch.bool
        and keep.shape == (1, 3, 1, 1, 10)
        and keep[..., 0].all()
        and not keep[..., -1].any()
    )
    # cuEquivariance's documented math on these inputs (mask True = keep) is the float32 reference.
    from hfkit.ops import evoformer_attention_reference

    ref = evoformer_attention_reference(s.q.float(), s.k.float(), s.v.float(), s.bias.float(), s.mask.float())
    got = attn_bench.eager_attention(
        q.detach().float(), s.k.float(), s.v.float(), bias.detach(), keep.float()
    )
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_measure_case_turns_a_failure_into_an_error_row():
    def build():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    with pytest.warns(RuntimeWarning, match="out of memory"):
        row = measure_case(
            env=ENV, ceilings=CEILINGS, device=CPU, op="triangle_attention", provider="eager", mode="fwd+bwd",
            shape=[1, 2048, 4, 2048, 32], dtype="bf16", nbytes=100, flops=1000, build=build, warmup=0, reps=1,
        )  # fmt: skip
    assert row.method == "error" and row.n_reps == 0 and math.isnan(row.p50_ms)
    assert "OutOfMemoryError" in row.extra["error"] and row.flops == 1000


def test_measure_case_flags_a_failed_check_but_keeps_the_row():
    calls = []
    steps = Steps(
        lambda: calls.append(1), lambda: calls.append(0), 1, lambda: {"max_abs_err": 3.0, "check_ok": False}
    )
    with pytest.warns(RuntimeWarning, match="disagrees"):
        row = measure_case(
            env=ENV, ceilings=CEILINGS, device=CPU, op="softmax", provider="eager", mode="fwd", shape=[2],
            dtype="fp32", nbytes=10**6, flops=None, build=lambda: steps, warmup=1, reps=3,
        )  # fmt: skip
    assert row.method == "wall" and row.extra["check_ok"] is False and calls == [0, 1, 1, 1, 1]
    assert row.gbps == pytest.approx(10**6 / row.p50_ms / 1e6) and row.tflops is None


# --- softmax -------------------------------------------------------------------------------------------


def test_softmax_benchmark_rows_on_cpu():
    result = run_benchmark(
        softmax_bench.BENCHMARK, softmax_cases(shapes=[(2, 2, 5, 7)]), CPU, dtypes=("fp32",),
        providers=("hfkit", "eager"), progress=False,
        ceilings=CEILINGS, warmup=0, reps=2,
    )  # fmt: skip
    assert [(r.provider, r.mode) for r in result.rows] == [
        ("hfkit", "fwd"), ("hfkit", "fwd+bwd"), ("eager", "fwd"), ("eager", "fwd+bwd"),
    ]  # fmt: skip
    for row in result.rows:
        assert row.extra["check_ok"] and row.extra["max_abs_err_vs_fp32_ref"] < 1e-5
        assert row.bytes == softmax_bytes((2, 2, 5, 7), 4, row.mode == "fwd+bwd")
        assert row.pct_copy == pytest.approx(100 * row.gbps / CEILINGS.copy_gbps)
    assert softmax_bytes((2, 2, 5, 7), 2, False) == 2 * 140 * 2 + 70 * 2 + 14 * 2
    with pytest.raises(ValueError, match="shapes"):
        softmax_cases(shapes=[(2, 5, 7)])


# --- triangle multiplication ---------------------------------------------------------------------------


@pytest.mark.parametrize("direction", ["outgoing", "incoming"])
def test_cueq_weight_mapping_matches_the_eager_module(direction):
    module = make_trimul_module(TrimulCase(direction, 6, 8, 8), CPU, seed=3)
    z = torch.randn(1, 6, 6, 8)
    mask = torch.ones(1, 6, 6)
    mask[:, -1] = 0
    with torch.no_grad():
        torch.testing.assert_close(cueq_trimul(fake_cueq_trimul, module, z, mask), module(z, mask))
        # The check would catch a swapped order: [b; a] instead of [a; b] transposes the update.
        swapped = lambda *a, p_in_weight, **kw: fake_cueq_trimul(*a, p_in_weight=p_in_weight.roll(8, 0), **kw)  # noqa: E731
        assert (cueq_trimul(swapped, module, z, mask) - module(z, mask)).abs().max() > 1e-2


def test_trimul_benchmark_rows_on_cpu():
    case = TrimulCase("incoming", 5, 8, 8)
    result = run_benchmark(
        trimul_bench.BENCHMARK, [case], CPU, dtypes=("bf16",), providers=("eager", "hfkit", "cuequivariance"),
        progress=False,
        ceilings=CEILINGS, warmup=0, reps=1,
    )  # fmt: skip
    assert [(r.provider, r.mode) for r in result.rows] == [
        ("eager", "fwd"), ("eager", "fwd+bwd"), ("hfkit", "fwd"), ("hfkit", "fwd+bwd"),
    ]  # fmt: skip
    assert result.skipped == ["incoming N=5 bf16: cuequivariance needs a CUDA device (running on cpu)"]
    fwd = 2 * 25 * (4 * 64 + 64 + 64) + 2 * 125 * 8
    for row in result.rows:
        assert row.op == "triangle_multiplication" and row.dtype == "bf16" and row.shape == [1, 5, 5, 8]
        assert row.extra["direction"] == "incoming" and row.extra["rel_err_vs_fp32_eager"] >= 0
        assert row.flops == (3 * fwd if row.mode == "fwd+bwd" else fwd)
    # The eager rows pass their check; hfkit's kernel has its own tests (and another engineer's).
    assert result.rows[0].extra["check_ok"] and result.rows[1].extra["check_ok"]
    assert "swap" in result.rows[2].extra


# --- peers, tables, figures, CLI -----------------------------------------------------------------------


def test_peers_give_reasons_on_cpu():
    assert load_trifast("cpu") == (None, "needs a CUDA device (running on cpu)")
    assert load_cuequivariance("cpu")[0] is None
    assert load_flashrnn("cpu") == (None, "needs a CUDA device (running on cpu)")
    assert set(peer_status("cpu")) == {"trifast", "cuequivariance", "flashrnn"}
    # Where a peer runs, the results file says which release: the versions of its distributions.
    torch_version = importlib.metadata.version("torch")
    assert peers._versions(("torch", "no-such-distribution")) == f"torch {torch_version}"
    assert peers._versions(("no-such-distribution",)) == ""
    missing = ModuleNotFoundError("No module named 'trifast'", name="trifast")
    assert _import_reason(missing, "trifast", "trifast") == "not installed (pip install trifast)"
    # A module the package imports that is missing is the package failing to import, not absent.
    part = ModuleNotFoundError("No module named 'trifast.kernels'", name="trifast.kernels")
    assert "import failed" in _import_reason(part, "trifast", "trifast")
    assert "import failed" in _import_reason(RuntimeError("no GPU"), "trifast", "trifast")


def _row(op, provider, mode, shape, p50, peak=None, **extra):
    return ResultRow(
        **ENV, op=op, provider=provider, mode=mode, shape=shape, dtype="bf16", p20_ms=p50, p50_ms=p50,
        p80_ms=p50, method="cuda_graph", n_reps=1, bytes=1, gbps=1.0, pct_copy=90.0, peak_mem_bytes=peak,
        extra=extra,
    )  # fmt: skip


def test_best_peer_table_skips_failed_and_flagged_peers_and_goals():
    shape = [1, 1024, 4, 1024, 32]
    rows = [
        _row("triangle_attention", "hfkit", "fwd+bwd", shape, 5.0, 2**30, check_ok=True),
        _row("triangle_attention", "trifast", "fwd+bwd", shape, 20.0, 2**31, check_ok=True),
        _row("triangle_attention", "sdpa", "fwd+bwd", shape, 1.0, 2**30, check_ok=False),  # wrong: ignored
        _row("triangle_attention", "eager", "fwd+bwd", shape, math.nan, error="OutOfMemoryError: ..."),
    ]
    table = best_peer_table(rows)
    assert len(table) == 1
    line = table.iloc[0]
    assert (
        line["case"] == "N=1024" and line["best peer"] == "trifast" and line["speed-up"] == pytest.approx(4.0)
    )
    assert line["failed or flagged"] == "eager, sdpa" and line["hfkit MiB"] == 1024
    goals = kernel_goals(rows)
    assert list(goals["met"]) == [True, True]  # 4x >= 3x at N=1024; 1 GiB <= trifast's 2 GiB
    frame = kernel_frame(rows)
    assert list(frame["error"].notna()) == [False, False, False, True]


def test_figures_and_explorer_leave_out_failed_rows():
    from hfkit.viz import kernel_explorer, kernel_memory_figure, kernel_rate_figure, kernel_time_figure

    rows = [
        _row("triangle_attention", p, m, [1, n, 4, n, 32], t, 2**20 * n)
        for n in (256, 512)
        for p, t in (("hfkit", 1.0), ("trifast", 2.0))
        for m in ("fwd", "fwd+bwd")
    ] + [_row("triangle_attention", "eager", "fwd", [1, 512, 4, 512, 32], math.nan, error="OOM")]
    for row in rows:
        row.flops = 10**9
        row.tflops = 1.0
    frame = kernel_frame(rows)
    fig = kernel_time_figure(frame, "triangle_attention", "bf16")
    assert {t.name for t in fig.data} == {"hfkit", "trifast"} and len(fig.data) == 4  # 2 providers x 2 modes
    assert list(fig.data[0].x) == ["N=256", "N=512"]
    assert len(kernel_memory_figure(frame, "triangle_attention", "bf16").data) == 4
    assert len(kernel_rate_figure(frame, "triangle_attention", "bf16").data) == 4
    with pytest.raises(ValueError, match="op/dtype"):
        kernel_time_figure(frame, "softmax", "bf16")
    explorer = kernel_explorer(frame)
    explorer.case.value = "N=512"
    table = explorer.last_table
    assert (
        set(table["provider"]) == {"hfkit", "trifast", "eager"} and table["error"].tolist().count("OOM") == 1
    )


def test_cli_bench_softmax_writes_results_and_load_kernel_results(tmp_path, capsys):
    assert load_kernel_results(tmp_path) is None
    out = tmp_path / "softmax.json"
    argv = ["bench", "softmax", "--device", "cpu", "--shapes", "2x2x3x9", "--dtypes", "fp32"]
    argv += [
        "--providers",
        "hfkit,eager",
        "--modes",
        "fwd",
        "--reps",
        "1",
        "--no-progress",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["command"] == "hfkit " + " ".join(argv) and doc["meta"]["peers"]["trifast"]
    assert len(doc["rows"]) == 2 and "best peer" in capsys.readouterr().out
    assert "partial" not in doc["meta"]  # the rows were saved one by one, then the whole run over them
    frame = load_kernel_results(tmp_path)
    assert list(frame["case"]) == ["2x2x3x9", "2x2x3x9"] and frame["ceiling_copy_gbps"].notna().all()
    # --append: a run of another mode keeps the first run's rows; a repeated configuration replaces its row.
    again = [*argv[:8], "--providers", "hfkit", "--reps", "1", "--no-progress", "--out", str(out), "--append"]
    assert main([*again, "--modes", "fwd+bwd"]) == 0
    doc = json.loads(out.read_text())
    assert sorted((r["provider"], r["mode"]) for r in doc["rows"]) == [
        ("eager", "fwd"),
        ("hfkit", "fwd"),
        ("hfkit", "fwd+bwd"),
    ]
    assert doc["meta"]["earlier_commands"] == ["hfkit " + " ".join(argv)]
    assert main([*again, "--modes", "fwd"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 and (rows[-1]["provider"], rows[-1]["mode"]) == ("hfkit", "fwd")
    with pytest.raises(SystemExit):
        main(["bench", "evoformer_attention", "--providers", "hfkit,flash"])
