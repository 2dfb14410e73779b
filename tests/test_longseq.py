"""The memory-lean inference path (`hfkit.model.inference.lean_forward`) against the modules' own
forward, its chunk-size choice from free memory, MSA offload on a CPU, and `hfkit bench longseq`."""

from __future__ import annotations

import json

import pytest
import torch

from hfkit.bench.runner import randomize_parameters
from hfkit.model import EvoformerStack, ExtraMSAStack, ModelConfig, inference
from hfkit.model.inference import (
    DEFAULT_CHUNK_SIZE,
    LEAN_OPS,
    BlockWidths,
    choose_chunk_size,
    holds_attention_logits,
    lean_forward,
    lean_working_set_bytes,
    resolve_chunk_sizes,
)

TINY = ModelConfig.tiny().replace(msa_dropout=0.0, pair_dropout=0.0)
S, N = 5, 11  # odd on purpose: chunks of 2, 3, 4 do not divide them
# Relative tolerance of the lean path against the module's forward, by dtype (task: float64 1e-10).
REL_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def _randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter random (AlphaFold's zero "final" and gating inits would hide most paths)."""
    return randomize_parameters(module, seed).eval()


def _stack(blocks: int = 1, mask_trans: bool = True, dtype=torch.float64, seed: int = 0) -> EvoformerStack:
    config = TINY.replace(no_blocks=blocks, _mask_trans=mask_trans)
    return _randomize(EvoformerStack.from_config(config), seed).to(dtype)


def _inputs(c_m: int, dtype=torch.float64, seed: int = 1, s: int = S, n: int = N):
    """m, z and masks with the last MSA row, the last two residues and a few pairs masked out."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(1, s, n, c_m, generator=gen, dtype=torch.float64).to(dtype)
    z = torch.randn(1, n, n, TINY.c_z, generator=gen, dtype=torch.float64).to(dtype)
    msa_mask = torch.ones(1, s, n, dtype=dtype)
    msa_mask[:, -1] = 0
    msa_mask[:, :, -2:] = 0
    pair_mask = msa_mask[:, 0, :, None] * msa_mask[:, 0, None, :]
    pair_mask[:, 0, 3] = 0
    return m, z, msa_mask, pair_mask


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("mask_trans", [True, False])
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 16, None])
def test_lean_block_equals_forward_float64(chunk_size, mask_trans) -> None:
    block = _stack(mask_trans=mask_trans).blocks[0]
    m, z, msa_mask, pair_mask = _inputs(TINY.c_m)
    with torch.no_grad():
        m_ref, z_ref = block(m, z, msa_mask, pair_mask)
    m_in, z_in = m.clone(), z.clone()
    m_out, z_out = lean_forward(block, m_in, z_in, msa_mask, pair_mask, chunk_size=chunk_size)
    assert m_out is m_in and z_out is z_in  # updated in place
    assert _rel(m_out, m_ref) <= REL_TOL[torch.float64]
    assert _rel(z_out, z_ref) <= REL_TOL[torch.float64]
    # The block does change both representations: equality is not trivial.
    assert _rel(m_ref, m) > 1e-2 and _rel(z_ref, z) > 1e-2


@pytest.mark.parametrize("chunk_size", [2, 5])
def test_lean_stack_equals_forward_float32(chunk_size) -> None:
    stack = _stack(blocks=2, dtype=torch.float32)
    m, z, msa_mask, pair_mask = _inputs(TINY.c_m, torch.float32)
    with torch.no_grad():
        ref = stack(m, z, msa_mask, pair_mask)
    out = lean_forward(stack, m.clone(), z.clone(), msa_mask, pair_mask, chunk_size=chunk_size)
    assert len(out) == 3
    for actual, expected in zip(out, ref, strict=True):
        assert _rel(actual, expected) <= REL_TOL[torch.float32]


def test_lean_extra_msa_stack_equals_forward_float64() -> None:
    config = TINY.replace(_mask_trans=False)
    stack = _randomize(ExtraMSAStack.from_config(config)).to(torch.float64)
    a, z, msa_mask, pair_mask = _inputs(config.c_e, s=7)
    with torch.no_grad():
        z_ref = stack(a, z, msa_mask, pair_mask)
    z_out = lean_forward(stack, a.clone(), z.clone(), msa_mask, pair_mask, chunk_size=3)
    assert _rel(z_out, z_ref) <= REL_TOL[torch.float64]


@pytest.mark.parametrize("chunk_size", [4, None])
def test_lean_with_fused_modules_equals_forward(chunk_size) -> None:
    """`to_hfkit` swaps every fused module in; lean_forward calls them (their references on a CPU), in
    chunks or (None) whole, where the triangle updates and attentions run the modules themselves."""
    import hfkit.nn  # noqa: F401 - registers every swap
    from hfkit.nn.convert import to_hfkit
    from hfkit.ops import reference_on_cpu

    stack = _stack(blocks=1, dtype=torch.float32)
    m, z, msa_mask, pair_mask = _inputs(TINY.c_m, torch.float32)
    fused, report = to_hfkit(stack, inplace=False, report=True)
    assert report.summary()  # something was swapped
    with torch.no_grad(), reference_on_cpu():
        ref = fused(m, z, msa_mask, pair_mask)
        out = lean_forward(fused, m.clone(), z.clone(), msa_mask, pair_mask, chunk_size=chunk_size)
    for actual, expected in zip(out, ref, strict=True):
        assert _rel(actual, expected) <= REL_TOL[torch.float32]


def test_offload_and_auto_chunk_give_the_same_result() -> None:
    block = _stack().blocks[0]
    m, z, msa_mask, pair_mask = _inputs(TINY.c_m)
    with torch.no_grad():
        m_ref, z_ref = block(m, z, msa_mask, pair_mask)
    for kwargs in ({"chunk_size": 3, "offload_msa": True}, {"chunk_size": "auto"}):
        m_out, z_out = lean_forward(block, m.clone(), z.clone(), msa_mask, pair_mask, **kwargs)
        assert _rel(m_out, m_ref) <= REL_TOL[torch.float64], kwargs
        assert _rel(z_out, z_ref) <= REL_TOL[torch.float64], kwargs


@pytest.mark.parametrize("offload_msa", [True, False])
def test_offload_releases_the_msa_during_the_pair_ops(offload_msa) -> None:
    """With offload_msa, m's storage is empty while the triangle ops run (seen from a hook on a
    LayerNorm they call), and m holds its values again after each of two blocks."""
    stack = _stack(blocks=2)
    m, z, msa_mask, pair_mask = _inputs(TINY.c_m)
    with torch.no_grad():
        m_ref, z_ref, s_ref = stack(m, z, msa_mask, pair_mask)
    m_in = m.clone()
    seen: list[int] = []
    hooks = [
        block.core.tri_mul_out.layer_norm_in.register_forward_pre_hook(
            lambda *_: seen.append(m_in.untyped_storage().nbytes())
        )
        for block in stack.blocks
    ]
    out = lean_forward(stack, m_in, z.clone(), msa_mask, pair_mask, chunk_size=4, offload_msa=offload_msa)
    for hook in hooks:
        hook.remove()
    full = m.numel() * m.element_size()
    assert set(seen) == ({0} if offload_msa else {full}) and len(seen) > 2
    assert m_in.untyped_storage().nbytes() == full
    for actual, expected in zip(out, (m_ref, z_ref, s_ref), strict=True):
        assert _rel(actual, expected) <= REL_TOL[torch.float64]


def test_offload_needs_m_to_own_its_storage() -> None:
    block = _stack().blocks[0]
    m, z, msa_mask, pair_mask = _inputs(TINY.c_m)
    wide = torch.cat([m, m], dim=0)  # m as a view of a larger tensor
    with pytest.raises(ValueError, match="own its storage"):
        lean_forward(block, wide[:1], z, msa_mask, pair_mask, offload_msa=True)


def test_bad_arguments_raise() -> None:
    stack = _stack()
    m, z, msa_mask, pair_mask = _inputs(TINY.c_m)
    with pytest.raises(ValueError, match="chunk_size"):
        lean_forward(stack, m, z, msa_mask, pair_mask, chunk_size=0)
    with pytest.raises(ValueError, match="eval mode"):
        lean_forward(stack.train(), m, z, msa_mask, pair_mask)
    with pytest.raises(ValueError, match="m, z"):
        lean_forward(stack.eval(), m[..., :-1, :], z, msa_mask, pair_mask)
    with pytest.raises(ValueError, match="module"):
        lean_forward(stack.linear, m, z, msa_mask, pair_mask)


AF2_WIDTHS = BlockWidths.from_block(
    EvoformerStack.from_config(ModelConfig.af2_initial().replace(no_blocks=1)).blocks[0]
)


def test_block_widths_read_from_the_block() -> None:
    assert BlockWidths(
        c_m=256, c_z=128, heads_msa=8, c_hidden_msa=32, heads_pair=4, c_hidden_pair=32,
        c_hidden_mul=128, c_hidden_opm=32, transition_n=4,
    ) == AF2_WIDTHS  # fmt: skip


@pytest.mark.parametrize("budget", [0, 9 * 26, 4 * 9 * 26, 10**9])  # 1 (at least), 1, 4 and 9 rows a chunk
def test_chunked_bias_equals_the_whole_bias(budget) -> None:
    """The pair/triangle bias made a budget of rows at a time (N (C_z + H) elements a row) equals
    linear(layer_norm(z)) of the whole z, for a batch of 2 and a last chunk shorter than the others."""
    torch.manual_seed(0)
    layer_norm, linear = torch.nn.LayerNorm(24).double(), torch.nn.Linear(24, 2).double()
    z = torch.randn(2, 9, 9, 24, dtype=torch.float64)
    with torch.no_grad():
        got = inference._chunked_bias(layer_norm, linear, z, 2, budget)
        want = linear(layer_norm(z)).permute(0, 3, 1, 2).unsqueeze(1)
    assert got.shape == (2, 1, 2, 9, 9)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_working_set_formula() -> None:
    """Terms worked by hand at N = 4096, S = 128, chunk 32, bf16: the row attention's
    H_m N² + c N (2 C_m + 5 H_m d_m) + 2 c H_m N² and the triangle multiplication's
    C_h N² + c N (4 C_z + 6 C_h); with batch 2, twice each."""
    n, s, c = 4096, 128, 32
    row_att = 8 * n * n + c * n * (2 * 256 + 5 * 8 * 32) + 2 * c * 8 * n * n
    tri_mul = 128 * n * n + c * n * (4 * 128 + 6 * 128)
    sizes = lean_working_set_bytes(AF2_WIDTHS, s, n, c, 2)
    assert tuple(sizes) == LEAN_OPS
    assert sizes["msa_row_attention"] == 2 * row_att
    assert sizes["triangle_multiplication"] == 2 * tri_mul
    assert lean_working_set_bytes(AF2_WIDTHS, s, n, c, 2, batch=2)["msa_row_attention"] == 4 * row_att
    # Larger chunks never need less.
    for op in LEAN_OPS:
        by_chunk = [lean_working_set_bytes(AF2_WIDTHS, s, n, k, 2)[op] for k in (1, 2, 8, 64, 512, 4096)]
        assert by_chunk == sorted(by_chunk), op


def test_auto_chunk_choice_from_free_memory() -> None:
    n, s = 4096, 128
    free = 40 * 2**30
    chosen = choose_chunk_size(AF2_WIDTHS, s, n, 2, free)
    assert tuple(chosen) == LEAN_OPS
    for op, chunk in chosen.items():
        assert chunk & (chunk - 1) == 0, op  # a power of two
        assert lean_working_set_bytes(AF2_WIDTHS, s, n, chunk, 2)[op] <= 0.9 * free, op
        axis = s if op in ("msa_row_attention", "msa_transition") else n
        if chunk < axis:  # the next power of two would not fit
            assert lean_working_set_bytes(AF2_WIDTHS, s, n, 2 * chunk, 2)[op] > 0.9 * free, op
    # The attention's logits limit its chunk, not the triangle multiplication's.
    assert chosen["msa_row_attention"] < chosen["triangle_multiplication"]
    more = choose_chunk_size(AF2_WIDTHS, s, n, 2, 10 * free)
    assert all(more[op] >= chosen[op] for op in LEAN_OPS)
    # All the memory in the world: one chunk per op (the first power of two >= its axis).
    assert set(choose_chunk_size(AF2_WIDTHS, s, n, 2, 2**60).values()) == {128, 4096}
    with pytest.raises(torch.OutOfMemoryError, match="chunk 1"):
        choose_chunk_size(AF2_WIDTHS, s, n, 2, 2**20)


def test_working_set_without_logits() -> None:
    """logits=False drops exactly the attention logits and their softmax (2 c H L²); the other ops and
    the held pair biases stay. With fused attention, 'auto' at N = 4096 on 40 GiB runs the triangle
    attention in one chunk, where counting logits cut it to a few rows."""
    n, s, c = 4096, 128, 32
    with_logits = lean_working_set_bytes(AF2_WIDTHS, s, n, c, 2)
    without = lean_working_set_bytes(AF2_WIDTHS, s, n, c, 2, logits=False)
    assert with_logits["triangle_attention"] - without["triangle_attention"] == 2 * (2 * c * 4 * n * n)
    assert with_logits["msa_row_attention"] - without["msa_row_attention"] == 2 * (2 * c * 8 * n * n)
    assert with_logits["msa_column_attention"] - without["msa_column_attention"] == 2 * (2 * c * 8 * s * s)
    for op in ("msa_transition", "outer_product_mean", "triangle_multiplication", "pair_transition"):
        assert with_logits[op] == without[op], op
    free = 40 * 2**30
    counted = choose_chunk_size(AF2_WIDTHS, s, n, 2, free)
    fused = choose_chunk_size(AF2_WIDTHS, s, n, 2, free, logits=False)
    assert all(fused[op] >= counted[op] for op in LEAN_OPS)
    assert fused["triangle_attention"] == n > counted["triangle_attention"]


def test_holds_attention_logits() -> None:
    """A plain block's attention holds its logits; hfkit's fused attention does not where its kernels
    run (the interpreter on CPU in CI; not CPU tensors on a GPU machine, where the kernels are
    compiled), and does where they do not (float64 runs the reference)."""
    from hfkit.nn import to_hfkit
    from hfkit.ops.evoformer_attention import uses_triton

    block = _stack().blocks[0]
    m, z, _, _ = _inputs(TINY.c_m, dtype=torch.float32)
    assert holds_attention_logits(block, m, z)
    fused = to_hfkit(_stack(dtype=torch.float32).blocks[0])
    assert holds_attention_logits(fused, m, z) == (not uses_triton(m))
    assert holds_attention_logits(fused, m.double(), z.double())


def test_resolve_chunk_sizes() -> None:
    stack = _stack()
    m, z, _, _ = _inputs(TINY.c_m)
    assert resolve_chunk_sizes(stack, m, z, "auto") == dict.fromkeys(LEAN_OPS, DEFAULT_CHUNK_SIZE)
    assert resolve_chunk_sizes(stack, m, z, 3) == dict.fromkeys(LEAN_OPS, 3)
    whole = resolve_chunk_sizes(stack.blocks[0], m, z, None)
    assert whole["msa_row_attention"] == S and whole["triangle_attention"] == N


@pytest.mark.parametrize("chunk_size", [4, None])
def test_lean_with_fused_kernels_under_the_interpreter(chunk_size) -> None:
    """The Triton kernels (compiled on a GPU, interpreted on a CPU) on the strided chunks the lean path
    hands them: transposed views for column and ending-node attention, incoming triangle updates; and
    (None) on the whole axes, through the modules."""
    import hfkit.nn  # noqa: F401 - registers every swap
    from hfkit.nn.convert import to_hfkit

    stack = to_hfkit(_stack(blocks=1, dtype=torch.float32), inplace=False)
    m, z, msa_mask, pair_mask = _inputs(TINY.c_m, torch.float32, s=3, n=6)
    with torch.no_grad():
        ref = stack(m, z, msa_mask, pair_mask)
    out = lean_forward(stack, m.clone(), z.clone(), msa_mask, pair_mask, chunk_size=chunk_size)
    for actual, expected in zip(out, ref, strict=True):
        assert _rel(actual, expected) <= REL_TOL[torch.float32]


@pytest.mark.parametrize(
    ("threshold", "start", "limit", "resolution"),
    [(1000, 256, 32768, 32), (1000, 4096, 32768, 64), (100, 8, 64, 4), (50, 64, 64, 1)],
)
def test_largest_fitting_n_doubles_then_bisects(threshold, start, limit, resolution) -> None:
    from hfkit.bench.longseq import largest_fitting_n

    tried: list[int] = []

    def fits(n: int) -> bool:
        tried.append(n)
        return n <= threshold

    best = largest_fitting_n(fits, start, limit, resolution)
    expected = min(threshold, limit)
    assert best is not None and expected - resolution < best <= expected
    assert len(tried) == len(set(tried))  # never the same N twice
    assert all(n <= limit for n in tried)
    # Doubling first: the N tried before the first failure are start, 2 start, 4 start, ...
    first_fail = next((i for i, n in enumerate(tried) if n > threshold), len(tried))
    assert tried[:first_fail] == [min(start * 2**i, limit) for i in range(first_fail)]


def test_largest_fitting_n_stops_at_the_limit_and_reports_none() -> None:
    from hfkit.bench.longseq import largest_fitting_n

    tried: list[int] = []
    assert largest_fitting_n(lambda n: tried.append(n) is None, 8, 24, 4) == 24
    assert tried == [8, 16, 24]
    assert largest_fitting_n(lambda n: False, 64, 1024, 16) is None
    with pytest.raises(ValueError, match="resolution"):
        largest_fitting_n(lambda n: True, 8, 24, 0)


@pytest.mark.usefixtures("one_thread")
def test_bench_longseq_smoke_writes_rows(tmp_path) -> None:
    from hfkit.cli import main

    out = tmp_path / "longseq.json"
    argv = ["bench", "longseq", "--profile", "smoke", "--device", "cpu", "--out", str(out), "--no-progress"]
    argv += ["--sizes", "9", "--providers", "hfkit_unchunked,hfkit_chunked,hfkit_lean", "--stack-n", "10"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert "partial" not in doc["meta"]
    blocks = [r for r in rows if r["op"] == "longseq_block"]
    # unchunked once, chunked at 4 and 5 (not "auto"), lean at 4, 5 and auto
    assert sorted((r["provider"], str(r["extra"]["chunk_size"])) for r in blocks) == [
        ("hfkit_chunked", "4"),
        ("hfkit_chunked", "5"),
        ("hfkit_lean", "4"),
        ("hfkit_lean", "5"),
        ("hfkit_lean", "auto"),
        ("hfkit_unchunked", "None"),
    ]
    for r in blocks:
        assert r["method"] == "wall" and r["p50_ms"] > 0 and r["shape"] == [4, 9], r
        assert r["extra"]["check_ok"] is True, r["extra"]
        assert r["extra"]["rel_err_z_vs_unchunked"] <= 0.05
    lean_auto = next(r for r in blocks if r["extra"]["chunk_size"] == "auto")
    assert lean_auto["extra"]["chunks"] == dict.fromkeys(LEAN_OPS, DEFAULT_CHUNK_SIZE)
    estimates = [r for r in rows if r["op"] == "longseq_stack_estimate"]
    assert len(estimates) == len(blocks) + 1  # every block row and the largest N
    n_blocks = TINY.no_blocks
    for est in estimates:
        source = next(
            r
            for r in rows
            if r["op"] in ("longseq_block", "longseq_max_n")
            and (r["provider"], r["shape"], r["extra"].get("chunk_size"))
            == (est["provider"], est["shape"], est["extra"].get("chunk_size"))
        )
        assert est["p50_ms"] == pytest.approx(n_blocks * source["p50_ms"])
        assert est["extra"]["n_blocks"] == n_blocks and "not measured" in est["extra"]["estimate"]
    (max_n,) = [r for r in rows if r["op"] == "longseq_max_n"]
    # A CPU never runs out of memory: the search stops at the smoke profile's limit.
    assert max_n["shape"] == [4, 24] and max_n["extra"]["capped"] is True
    assert [a["n"] for a in max_n["extra"]["attempts"]] == [8, 16, 24]
    # The real stack run: every block of the preset, through lean_forward.
    (stack,) = [r for r in rows if r["op"] == "longseq_stack"]
    assert stack["method"] == "wall" and stack["shape"] == [4, 10] and "error" not in stack["extra"]
    assert stack["extra"]["n_blocks"] == n_blocks


@pytest.mark.usefixtures("one_thread")
def test_bench_longseq_openfold_provider(monkeypatch) -> None:
    """OpenFold's own block runs as its inference does (int chunks only, no error check against
    hfkit's weights); without OpenFold its rows are skipped rows that say why."""
    from hfkit.bench import longseq
    from hfkit.bench.peers import load_openfold

    if load_openfold()[0] is None:
        pytest.skip(f"OpenFold source not found: {load_openfold()[1]}")
    kw = dict(profile="smoke", sizes=[9], providers=["openfold_chunked"], search=False, progress=False)
    rows = [r for r in longseq.run_longseq_benchmark("cpu", **kw) if r.op == "longseq_block"]
    assert sorted(r.extra["chunk_size"] for r in rows) == [4, 5]
    for r in rows:
        assert r.method == "wall" and r.p50_ms > 0 and "inplace_safe=True" in r.extra["inference"], r
        assert "check_ok" not in r.extra
    monkeypatch.setattr(longseq, "load_openfold", lambda: (None, "no OpenFold here"))
    rows = [r for r in longseq.run_longseq_benchmark("cpu", **kw) if r.op == "longseq_block"]
    assert len(rows) == 2 and all(r.extra["error"] == "skipped: no OpenFold here" for r in rows)
