"""Compile hfkit's Triton kernels for Hopper (sm_90: H100, H200) on a machine without a GPU.

Run as a script with TRITON_INTERPRET unset or 0 (`python tests/compile_sm90.py`; the interpreter's
kernels cannot be compiled): tests/test_compile_sm90.py does so in a subprocess.

The interpreter tests check what the kernels compute, but not that Triton's compiler accepts them:
the compiler types every value and rejects what the interpreter lets through (a loop-carried value
that changes dtype, operands of mismatched types, an unsupported random-number call). Here
each kernel is compiled through Triton's NVIDIA backend all the way to a cubin for sm_90, with the
constexpr combinations the CUDA path launches, so a kernel that would fail to compile on the GPU
fails in CI first. Nothing is run.
"""

from __future__ import annotations

import os
import sys
import time

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("compile_sm90: run with TRITON_INTERPRET=0 (interpreted kernels cannot be compiled)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import hfkit.ops  # noqa: E402, F401  (imports every op module)
from hfkit.ops import _evoformer_attention_kernels as eak  # noqa: E402
from hfkit.ops import _triangle_multiplication_kernels as tmk  # noqa: E402
from hfkit.ops import elementwise as ew  # noqa: E402

# hfkit.ops re-exports functions named like their modules; take the modules (tiles live there).
ea = sys.modules["hfkit.ops.evoformer_attention"]
ln = sys.modules["hfkit.ops.layer_norm"]
sm = sys.modules["hfkit.ops.softmax"]
tm = sys.modules["hfkit.ops.triangle_multiplication"]
gl = sys.modules["hfkit.ops.gated_linear"]
HOPPER = GPUTarget("cuda", 90, 32)
FLOAT_ARGS = {"p", "scale", "qk_scale", "sm_scale", "eps", "mask_inf"}


def compile_sm90(
    fn,
    pointers: dict[str, str],
    constexprs: dict[str, object],
    num_warps: int = 4,
    maxnreg: int | None = None,
) -> dict:
    """Compile the @triton.jit `fn` for sm_90: `pointers` maps pointer arguments to element types
    ('bf16', 'fp32', 'i64', ...), `constexprs` gives every constexpr; other arguments are float32 when
    named in FLOAT_ARGS, else int32. Returns the compiled kernel's assembly by stage."""
    signature = {}
    for param in fn.params:
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    assert not missing, f"constexprs missing for {fn.__name__}: {missing}"
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    options = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    kernel = triton.compile(source, target=HOPPER, options=options)
    COMPILED.append(fn.__name__)
    return kernel.asm


COMPILED: list[str] = []


def elementwise_kernels() -> None:
    data = {"G": "bf16", "O": "bf16", "Bias": "bf16", "Y": "bf16", "DY": "bf16", "DG": "bf16", "DO": "bf16"}
    for has_bias in (True, False):
        tiles = {"HAS_BIAS": has_bias, "BLOCK_M": 8, "BLOCK_N": 256}
        assert "cubin" in compile_sm90(ew._gate_fwd_kernel, data, tiles)
        assert "cubin" in compile_sm90(ew._gate_bwd_kernel, data, tiles)
    for divide, accumulate in ((True, False), (False, False), (True, True)):
        tiles = {"DIVIDE": divide, "BLOCK_M": 16, "BLOCK_N": 128, "ACCUMULATE": accumulate}
        rows = {"X": "bf16", "Scale": "bf16", "Y": "bf16"}
        assert "cubin" in compile_sm90(ew._row_scale_kernel, rows, tiles)
    block_m, warps = gl.ADD_TILE
    for has_bias, dtype, dot in ((True, "bf16", 0), (False, "fp32", 3)):
        add = {"Z": dtype, "G": dtype, "O": dtype, "W": dtype, "Bias": dtype}
        tiles = {"HAS_BIAS": has_bias, "DOT": dot, "BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": 128}
        assert "cubin" in compile_sm90(gl._gated_linear_add_kernel, add, tiles, warps)
    drop = {
        "X": "bf16",
        "Res": "bf16",
        "Bias": "bf16",
        "Seed": "i64",
        "Y": "bf16",
        "DY": "bf16",
        "DX": "bf16",
    }
    for row_shared, block_m in ((True, 16), (False, 8)):
        for mask64 in (False, True):
            tiles = {"MASK64": mask64, "ROW_SHARED": row_shared, "BLOCK_M": block_m, "BLOCK_N": 128}
            flags = {"HAS_BIAS": True, "DROPOUT": True, **tiles}
            assert "cubin" in compile_sm90(ew._bias_dropout_add_kernel, drop, flags)
            assert "cubin" in compile_sm90(ew._dropout_bwd_kernel, drop, tiles)
    eval_mode = {
        "HAS_BIAS": True,
        "DROPOUT": False,
        "MASK64": False,
        "ROW_SHARED": False,
        "BLOCK_M": 8,
        "BLOCK_N": 256,
    }
    assert "cubin" in compile_sm90(ew._bias_dropout_add_kernel, drop, eval_mode)
    keep = {"MASK64": False, "BLOCK": 1024}
    assert "cubin" in compile_sm90(ew._keep_mask_kernel, {"Seed": "i64", "Mask": "fp32"}, keep)


def attention_kernels(even: bool, dtype: str = "bf16", dot: int = 0) -> None:
    """The forward and the four backward passes with the tuned tiles (D = 32), ragged or whole; bf16
    on the tensor cores (DOT 0) or float32 as 3xTF32 / TF32 (DOT 3 / 4)."""
    ptrs = {k: dtype for k in ("Q", "K", "V", "Bias", "O", "DO", "DQ", "DK", "DV")}
    ptrs.update({k: "fp32" for k in ("KeyBias", "Mx", "Lg", "Delta", "DB", "KNorm", "KBMax", "BMax")})
    flags = {"HAS_BIAS": True, "HAS_KEY_BIAS": True, "DOT": dot, "EVEN": even, "EVEN_MN": even, "BLOCK_D": 32}
    bm, bn, warps, stages = ea.CONFIGS_SMALL_D["fwd"]
    for bounded in (False, True):  # the running max, and the fixed reference (as `launch_fwd` caps it)
        tiles = {**flags, "BLOCK_M": bm, "BLOCK_N": bn, "BOUNDED": bounded}
        regs = ea.BOUNDED_MAXNREG if bounded else None
        assert "cubin" in compile_sm90(eak._evo_fwd_kernel, ptrs, tiles, warps, maxnreg=regs)
    # The bounded forward without a key bias (the reference subtracted in the scaling, SHIFTED).
    no_key_bias = {**flags, "HAS_KEY_BIAS": False, "BLOCK_M": bm, "BLOCK_N": bn, "BOUNDED": True}
    assert "cubin" in compile_sm90(eak._evo_fwd_kernel, ptrs, no_key_bias, warps, maxnreg=ea.BOUNDED_MAXNREG)
    for mode, pass_ in ((1, "dq"), (0, "dkdv"), (2, "dbias"), (3, "dkdv_dbias")):
        bm, bn, warps, stages, *rows = ea.CONFIGS_SMALL_D[pass_]
        tiles = {**flags, "MODE": mode, "BLOCK_M": bm, "BLOCK_N": bn, "ROWS": rows[0] if rows else 1}
        assert "cubin" in compile_sm90(eak._evo_bwd_kernel, ptrs, tiles, warps)
    # The fused pass walking one row at a time.
    assert "cubin" in compile_sm90(eak._evo_bwd_kernel, ptrs, {**tiles, "ROWS": 1}, warps)
    # The bounded forward's max_j |k_j| (as `_row_maxima` launches it).
    norms = {"BLOCK_N": 128, "BLOCK_D": 32}
    assert "cubin" in compile_sm90(eak._key_norm_kernel, {"K": dtype, "Out": "fp32"}, norms, 4)


def norm_and_softmax_kernels() -> None:
    """LayerNorm and the fused softmax at the AlphaFold sizes (128-wide pair rows, 256-key logits)."""
    ptrs = {"X": "bf16", "Y": "bf16", "W": "fp32", "B": "fp32", "Mean": "fp32", "Rstd": "fp32"}
    bm, bn, warps = ln._fwd_config(128, 2)
    flags = {"HAS_W": True, "HAS_B": True, "BLOCK_M": bm, "BLOCK_N": bn}
    compile_sm90(ln._layer_norm_fwd_kernel, ptrs, flags, warps)
    ptrs = {
        "X": "bf16",
        "DY": "bf16",
        "DX": "bf16",
        "W": "fp32",
        "Mean": "fp32",
        "Rstd": "fp32",
        "DWB": "fp32",
        "DRES": "bf16",
    }
    bm, bn, warps = ln._bwd_config(128, 2)
    for prefetch in (True, False):
        flags = {
            "HAS_W": True,
            "HAS_DW": True,
            "HAS_RES": prefetch,  # with and without the residual's gradient
            "PREFETCH": prefetch,
            "ACC2D": True,
            "BLOCK_M": bm,
            "BLOCK_N": bn,
        }
        compile_sm90(ln._layer_norm_bwd_kernel, ptrs, flags, warps)
    for pass_, fn in (("fwd", sm._softmax_fwd_kernel), ("bwd", sm._softmax_bwd_kernel)):
        bm, warps = sm._config(256, pass_)
        flags = {"BLOCK_M": bm, "BLOCK_K": sm._block_k(256)}
        if pass_ == "fwd":
            flags.update(HAS_BIAS=True, HAS_MASK=True)
        ptrs = {k: "bf16" for k in ("X", "Bias", "Mask", "Y", "DY", "DX")}
        compile_sm90(fn, ptrs, flags, warps)


def triangle_multiplication_kernels(dtype: str = "bf16", dot: int = 0) -> None:
    """Every kernel of the fused triangle update at c_z = c_hidden = 128, bf16 (statistics and the
    per-block partial sums in float32), or float32 with 3xTF32 projections (DOT 3)."""
    c = 128
    fp32 = ("Mean", "Rstd", "Part")
    names = (
        "ZN",
        "W",
        "Bias",
        "Mask",
        "A",
        "B",
        "DA",
        "DB",
        "P",
        "DP",
        "X",
        "Y",
        "DY",
        "DX",
        "O",
        "OUT",
        "DO",
        "DOUT",
        "WZ",
        "BZ",
        "WG",
        "BG",
    )
    ptrs = {**{k: dtype for k in names}, **{k: "fp32" for k in fp32}}
    for tiles in (tm.PROJ_TILES, tm.PROJ_TILES_LARGE):
        block_p, block_c, block_k, warps, _stages = tiles
        proj = {"HAS_BIAS": True, "HAS_MASK": True, "DOT": dot, "BLOCK_P": block_p, "BLOCK_C": block_c}
        proj["BLOCK_K"] = block_k
        compile_sm90(tmk._proj_gate_fwd_kernel, ptrs, proj, warps)
        if tiles is tm.PROJ_TILES:
            compile_sm90(tmk._proj_gate_bwd_kernel, ptrs, proj, warps)
    block_p, block_c, warps = tm._gate_config(c)
    gate = {"HAS_MASK": True, "BLOCK_P": block_p, "BLOCK_C": block_c}
    compile_sm90(tmk._gate_ab_fwd_kernel, ptrs, gate, warps)
    compile_sm90(tmk._gate_ab_bwd_kernel, ptrs, gate, warps)
    block_p, block_c, warps = tm._ln_out_config(c)
    tiles = {"HAS_W": True, "BLOCK_P": block_p, "BLOCK_C": block_c}
    compile_sm90(tmk._ln_out_t_fwd_kernel, ptrs, {**tiles, "HAS_B": True}, warps)
    compile_sm90(tmk._ln_out_t_bwd_kernel, ptrs, {**tiles, "HAS_DW": True}, warps)
    block_m, block_c, warps = tm._elementwise_config(c)
    compile_sm90(tmk._out_gate_fwd_kernel, ptrs, {"BLOCK_M": block_m, "BLOCK_C": block_c}, warps)
    compile_sm90(tmk._out_gate_bwd_kernel, ptrs, {"BLOCK_M": block_m, "BLOCK_C": block_c}, warps)
    flags = {"HAS_W": True, "HAS_B": True, "HAS_BZ": True, "HAS_BG": True, "DOT": dot}
    for way in ("fwd", "bwd"):
        tiles = tm._out_config(c, c, way)
        warps = tiles.pop("num_warps")
        for accumulate in (False, True) if way == "fwd" else (False,):
            way_flags = {**flags, **tiles, "BWD": way == "bwd", "ACCUMULATE": accumulate}
            compile_sm90(tmk._out_kernel, ptrs, way_flags, warps)


def gluon_attention_kernel() -> None:
    """The Gluon attention forward (sm_90 only; no interpreter) with the tiles and registers `forward`
    launches, its TMA descriptors typed as `forward` makes them: a Triton whose Gluon API moved (a
    renamed barrier or TMA load) fails here instead of falling back to the Triton kernel at run time.
    Skipped (printed) where this Triton has no Gluon Hopper API."""
    from hfkit.ops import _evoformer_attention_gluon as ga

    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon._runtime import GluonASTSource
    except ImportError:
        print("gluon: not in this Triton, skipped")
        return
    if not ga.HAS_GLUON:
        print("gluon: no Hopper API in this Triton, skipped")
        return
    bm, bn, d = ga.BLOCK_M, ga.BLOCK_N, ga.HEAD_DIM
    blocks = {"q_desc": [bm, d], "k_desc": [bn, d], "v_desc": [bn, d], "b_desc": [bm, bn]}
    constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "D": d, "STAGES": ga.STAGES}
    signature, attrs = {}, {}
    for i, param in enumerate(ga._fwd_kernel.params):
        name = param.name
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in blocks:
            layout = repr(gl.NVMMASharedLayout.get_default_for(blocks[name], gl.bfloat16))
            signature[name] = f"tensordesc<bf16{blocks[name]},{layout}>".replace(" ", "")
        elif name in ("O", "Mx", "Lg", "KNorm", "BMax"):
            signature[name] = "*bf16" if name == "O" else "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    source = GluonASTSource(fn=ga._fwd_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(source, target=HOPPER, options={"num_warps": 4, "maxnreg": ga.MAX_REGS})
    assert "cubin" in kernel.asm
    COMPILED.append("gluon " + ga._fwd_kernel.__name__)


def main() -> int:
    start = time.perf_counter()
    gluon_attention_kernel()
    triangle_multiplication_kernels()
    norm_and_softmax_kernels()
    elementwise_kernels()
    for even in (True, False):
        attention_kernels(even)
    # float32 on CUDA: 3xTF32 (torch's default "highest" matmul precision) and TF32.
    triangle_multiplication_kernels("fp32", 3)
    attention_kernels(False, "fp32", 3)
    attention_kernels(False, "fp32", 4)
    print(f"compiled {len(COMPILED)} kernels for sm_90 in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
