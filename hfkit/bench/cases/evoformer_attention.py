"""Evoformer attention benchmark: `hfkit.ops.evoformer_attention` (flash-style) against eager, compile,
SDPA and the peers.

Two ops, one math (`softmax(q·kᵀ/√D + pair_bias + mask_bias)·v` over each of S rows): triangle attention
over the N×N pair representation (S = N rows, H=4, D=32) and MSA row attention with pair bias (S MSA
rows, H=8, D=32). Inputs: q/k/v [B, S, H, N, D], a pair bias [B, 1, H, N, N] that requires grad, and a
key mask [B, S, 1, 1, N] of ones with the last few keys zero (padding). Providers:

- `hfkit`: `hfkit.ops.evoformer_attention(q, k, v, bias, mask)`;
- `hfkit_three_pass`: the same forward, its backward with a separate dbias pass
  (`backward_passes(fuse_dbias=False)`) whatever `fuses_dbias` picks: the comparison that sets it;
- `eager`: OpenFold's attention in the input dtype, the [B, S, H, N, N] logits materialized;
- `compile`: `torch.compile` of `eager`;
- `sdpa`: `F.scaled_dot_product_attention` on [B·S, H, N, D] views with an additive float mask: the
  pair bias plus the mask bias, which SDPA needs materialized at [B·S, H, N, N] (counted in its memory);
- `trifast` and `cuequivariance` (when installed; see `hfkit.bench.peers`), each given its inputs in its
  own layout and dtype (trifast: [B, H, S, N, D] and a True-is-masked boolean mask, S must equal N;
  cuEquivariance: a float32 bias and a True-is-kept boolean mask), prepared outside the timed step.

FLOPs: 4·B·S·H·N·N·D forward (two matmuls), 2.5 times that for the backward; bytes: the minimum
traffic (q, k, v, o, bias once; the backward also reads q, k, v, o, do and writes dq, dk, dv, dbias).

`TILES` (`hfkit bench evoformer_attention --tiles`) times each kernel pass alone (the forward, and the
backward's dq, dk/dv and dbias passes) at every (BLOCK_M, BLOCK_N, num_warps, num_stages) of its grid:
the data behind `hfkit.ops.evoformer_attention.CONFIGS_SMALL_D`.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from hfkit.bench.peers import load_cuequivariance, load_trifast
from hfkit.bench.results import check_choice
from hfkit.bench.runner import (
    DTYPES,
    Option,
    Prepared,
    Skip,
    Steps,
    TileSweep,
    max_abs_err,
    op_benchmark,
    pick_profile,
)
from hfkit.bench.timing import rotating
from hfkit.ops.softmax import MASK_INF

__all__ = [
    "AttentionCase",
    "BENCHMARK",
    "CHECK_TOL",
    "MSA_ROW_SHAPES",
    "OPS",
    "TILES",
    "TRIANGLE_SIZES",
    "attention_cases",
    "eager_attention",
    "sdpa_attention",
]

OPS = {"triangle": "triangle_attention", "msa_row": "msa_row_attention"}
TRIANGLE_SIZES = (256, 384, 512, 1024, 2048)
MSA_ROW_SHAPES = ((128, 256), (132, 256), (256, 384), (128, 512))  # (S, N)
TRIANGLE_HEADS, MSA_ROW_HEADS, HEAD_DIM = 4, 8, 32
# Max abs error against the float32 reference above which a provider's row is flagged (check_ok False):
# a few bf16 roundings of outputs of size ~1 pass, a wrong mask or bias (errors of order 1) does not.
CHECK_TOL = {"bf16": 0.06, "fp16": 0.01, "fp32": 1e-3}
_CHECK_ROWS = 16  # rows of S the float32 reference is computed for (it materializes the logits)


@dataclass(frozen=True)
class AttentionCase:
    """One attention problem: q/k/v [batch, rows, heads, n, head_dim] for op `op`."""

    op: str
    batch: int
    rows: int
    heads: int
    n: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.batch, self.rows, self.heads, self.n, self.head_dim)

    def flops(self, backward: bool) -> int:
        fwd = 4 * self.batch * self.rows * self.heads * self.n * self.n * self.head_dim
        return int(fwd * 3.5) if backward else fwd

    def bytes(self, backward: bool, itemsize: int) -> int:
        qkv = self.batch * self.rows * self.heads * self.n * self.head_dim * itemsize
        bias = self.batch * self.heads * self.n * self.n * itemsize
        fwd = 4 * qkv + bias  # read q, k, v, bias; write o
        return fwd + 8 * qkv + 2 * bias if backward else fwd

    @property
    def label(self) -> str:
        return f"{self.op} {'x'.join(map(str, self.shape))}"


def attention_cases(
    profile: str = "full", ops: Sequence[str] | None = None, sizes: Sequence[int] | None = None
) -> list[AttentionCase]:
    """Triangle attention at `TRIANGLE_SIZES` and MSA row attention at `MSA_ROW_SHAPES` (profile
    "full"), keeping only N in `sizes` when given; tiny odd sizes for "smoke" (where `sizes`, when
    given, are the N values used as they are). `ops`: "triangle", "msa_row" (default: both)."""
    ops = check_choice("ops", ops or list(OPS), list(OPS))
    if pick_profile(profile, {"full": True, "smoke": False}):
        tri = [(n, n) for n in TRIANGLE_SIZES]
        msa = list(MSA_ROW_SHAPES)
        if sizes is not None:
            tri = [(s, n) for s, n in tri if n in sizes] or [(n, n) for n in sizes]
            msa = [(s, n) for s, n in msa if n in sizes]
    else:
        tri = [(n, n) for n in (sizes or (12, 17))]
        msa = [(max(2, n // 3), n) for n in (sizes or (19,))]
    cases = []
    if "triangle" in ops:
        cases += [AttentionCase(OPS["triangle"], 1, s, TRIANGLE_HEADS, n, HEAD_DIM) for s, n in tri]
    if "msa_row" in ops:
        cases += [AttentionCase(OPS["msa_row"], 1, s, MSA_ROW_HEADS, n, HEAD_DIM) for s, n in msa]
    return cases


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """OpenFold-style attention in the input dtype: q/k/v [*, H, N, D], bias and mask broadcastable to
    the logits [*, H, N, N] (mask 1 = keep). The logits are materialized, as in OpenFold's `Attention`."""
    a = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2))
    a = a + bias + (mask - 1.0) * MASK_INF
    return torch.matmul(torch.softmax(a, dim=-1), v)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` on q/k/v [B, S, H, N, D] seen as [B·S, H, N, D], with the pair
    bias plus the mask bias as one additive float mask (materialized at [B·S, H, N, N])."""
    b, s, h, n, d = q.shape
    n_k = k.shape[3]
    attn = (bias + (mask - 1.0) * MASK_INF).expand(b, s, h, n, n_k).reshape(b * s, h, n, n_k)
    out = F.scaled_dot_product_attention(
        q.reshape(b * s, h, n, d), k.reshape(b * s, h, n_k, d), v.reshape(b * s, h, n_k, d), attn_mask=attn
    )
    return out.reshape(b, s, h, n, d)


class _Set(NamedTuple):
    """One input set in hfkit's layout: q/k/v/dout [B, S, H, N, D], bias [B, 1, H, N, N], mask
    [B, S, 1, 1, N] (0/1 in the input dtype)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: torch.Tensor
    mask: torch.Tensor
    dout: torch.Tensor


class _Native(NamedTuple):
    """A provider's inputs: the forward's arguments, the tensors the backward differentiates, and the
    upstream gradient in the layout of the provider's output."""

    args: tuple[Any, ...]
    leaves: tuple[torch.Tensor, ...]
    dout: torch.Tensor


class _Impl(NamedTuple):
    forward: Callable[..., torch.Tensor]
    prepare: Callable[[_Set, bool], _Native]
    to_bshnd: Callable[[torch.Tensor], torch.Tensor]  # output -> [B, S, H, N, D]
    note: dict[str, Any]


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    return t.detach().requires_grad_(grad)


def _same_layout(s: _Set, grad: bool) -> _Native:
    q, k, v, bias = (_leaf(t, grad) for t in (s.q, s.k, s.v, s.bias))
    return _Native((q, k, v, bias, s.mask), (q, k, v, bias), s.dout)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class _ThreePass(torch.autograd.Function):
    """hfkit's attention op whose backward always takes the three passes (dq, dk/dv, dbias)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, key_bias):
        o, mx, lg = torch.ops.hfkit.evoformer_attention_fwd(q, k, v, bias, key_bias)
        ctx.save_for_backward(q, k, v, bias, key_bias, o, mx, lg)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, bias, key_bias, o, mx, lg = ctx.saved_tensors
        passes = _kernels().backward_passes
        dq, dk, dv, db = passes(do, q, k, v, bias, key_bias, o, mx, lg, True, fuse_dbias=False)
        return dq, dk, dv, db.to(bias.dtype), None


def three_pass_attention(q, k, v, bias, mask):
    """`hfkit.ops.evoformer_attention(q, k, v, bias, mask)` (bias [B, 1, H, N, N], mask [B, S, 1, 1, N]
    of 0/1) with the three-pass backward on CUDA (`_kernels().backward_passes`)."""
    key_bias = (mask[:, :, 0, 0, :].detach().float() - 1.0) * MASK_INF
    return _ThreePass.apply(q, k, v, bias, key_bias)


def _provider(provider: str, case: AttentionCase, device: torch.device) -> _Impl:
    if provider == "hfkit":
        from hfkit.ops import evoformer_attention

        return _Impl(evoformer_attention, _same_layout, _identity, {})
    if provider == "hfkit_three_pass":
        if device.type != "cuda":
            raise Skip("the three-pass backward is compared with the default on CUDA")
        return _Impl(three_pass_attention, _same_layout, _identity, {"backward": "three_pass"})
    if provider == "eager":
        return _Impl(eager_attention, _same_layout, _identity, {})
    if provider == "compile":
        # A fresh Dynamo cache per case, as in the LayerNorm benchmark: every shape gets the kernels a
        # model compiled at that size gets, not shape-generic ones.
        torch._dynamo.reset()
        return _Impl(torch.compile(eager_attention, dynamic=False), _same_layout, _identity, {})
    if provider == "sdpa":
        return _Impl(sdpa_attention, _same_layout, _identity, {"attn_mask": "bias + mask bias, materialized"})
    if provider == "trifast":
        fn, reason = load_trifast(device)
        if fn is None:
            raise Skip(f"trifast {reason}")
        if case.rows != case.n:
            raise Skip(f"trifast needs as many query rows as keys (S == N), got S={case.rows}, N={case.n}")
        return _Impl(fn, _trifast_layout, lambda o: o.transpose(1, 2), {"layout": "[B, H, S, N, D]"})
    if provider == "cuequivariance":
        fns, reason = load_cuequivariance(device)
        if fns is None:
            raise Skip(f"cuequivariance {reason}")
        scale = case.head_dim**-0.5

        def cueq(q, k, v, bias, mask):
            return fns.triangle_attention(q, k, v, bias, mask, scale)

        return _Impl(cueq, _cueq_layout, _identity, {"bias_dtype": "fp32"})
    raise ValueError(f"providers: unknown provider {provider!r}")


def _trifast_layout(s: _Set, grad: bool) -> _Native:
    # trifast: q/k/v [B, H, S, N, D], bias [B, H, N, N], mask bool [B, S, N] with True = masked.
    q, k, v = (_leaf(t.transpose(1, 2).contiguous(), grad) for t in (s.q, s.k, s.v))
    bias = _leaf(s.bias[:, 0].contiguous(), grad)
    masked = (s.mask[:, :, 0, 0, :] == 0).contiguous()
    return _Native((q, k, v, bias, masked), (q, k, v, bias), s.dout.transpose(1, 2).contiguous())


def _cueq_layout(s: _Set, grad: bool) -> _Native:
    # cuEquivariance: hfkit's layout, a float32 bias (what its Hopper kernel reads), mask True = keep.
    q, k, v = (_leaf(t, grad) for t in (s.q, s.k, s.v))
    bias = _leaf(s.bias.float(), grad)
    keep = s.mask != 0
    return _Native((q, k, v, bias, keep), (q, k, v, bias), s.dout)


def _make_set(case: AttentionCase, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> _Set:
    b, s, h, n, d = case.shape

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=device, dtype=dtype, generator=gen)

    mask = torch.ones(b, s, 1, 1, n, device=device, dtype=dtype)
    mask[..., n - max(1, n // 64) :] = 0  # padding: the last few keys of every row
    return _Set(
        randn(*case.shape),
        randn(*case.shape),
        randn(*case.shape),
        randn(b, 1, h, n, n),
        mask,
        randn(*case.shape),
    )


def _check(impl: _Impl, native: _Native, s: _Set, dtype_name: str) -> dict[str, Any]:
    """Max abs error of the provider's forward against hfkit's float32 reference on the first rows."""
    from hfkit.ops import evoformer_attention_reference

    out = impl.to_bshnd(impl.forward(*native.args))
    r = min(_CHECK_ROWS, s.q.shape[1])
    with torch.no_grad():
        ref = evoformer_attention_reference(
            s.q[:, :r].float(), s.k[:, :r].float(), s.v[:, :r].float(), s.bias.float(), s.mask[:, :r].float()
        )
    err = max_abs_err(out[:, :r], ref)
    return {"max_abs_err_vs_fp32_ref": err, "check_rows": r, "check_ok": err <= CHECK_TOL[dtype_name]}


def _prepare(case: AttentionCase, dtype_name: str, device: torch.device) -> Prepared:
    dtype = DTYPES[dtype_name]
    gen = torch.Generator(device=device).manual_seed(0)
    per_set = case.bytes(True, dtype.itemsize)
    make = lambda: _make_set(case, dtype, device, gen)  # noqa: E731
    sets = rotating(make, per_set, 256 << 20, 4, device=device)
    return Prepared(sets, {"rotating_sets": len(sets)})


def _build(case: AttentionCase, impl: _Impl, prepared: Prepared, mode: str, dtype_name: str) -> Steps:
    backward = mode == "fwd+bwd"
    sets = prepared.inputs
    natives = [impl.prepare(s, backward) for s in sets]

    def run(batch: list[_Native]):
        def step() -> None:
            for nat in batch:
                out = impl.forward(*nat.args)
                if backward:
                    torch.autograd.grad(out, nat.leaves, nat.dout)

        return step

    return Steps(
        run(natives), run(natives[:1]), len(natives), lambda: _check(impl, natives[0], sets[0], dtype_name)
    )


def _cost(case: AttentionCase, dtype_name: str, mode: str) -> tuple[int, int]:
    itemsize = DTYPES[dtype_name].itemsize
    return case.bytes(mode == "fwd+bwd", itemsize), case.flops(mode == "fwd+bwd")


def _kernels() -> Any:
    # hfkit.ops re-exports the function `evoformer_attention`, which shadows the module of the same name.
    return importlib.import_module("hfkit.ops.evoformer_attention")


def _tile_inputs(case: AttentionCase, dtype_name: str, device: torch.device) -> dict[str, Any]:
    # One set: the op's own forward gives o and the row statistics every backward pass reads.
    b, s, h, n, d = case.shape
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(case.shape, device=device, dtype=DTYPES[dtype_name], generator=gen) for _ in "qkv")
    bias = torch.randn((b, 1, h, n, n), device=device, dtype=q.dtype, generator=gen)
    keep = torch.rand((b, s, n), device=device, generator=gen) > 0.05
    key_bias = (keep.float() - 1.0) * MASK_INF
    o, mx, lg = torch.ops.hfkit.evoformer_attention_fwd(q, k, v, bias, key_bias)
    delta = torch.empty(o.shape[:-1], dtype=torch.float32, device=device)
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    bwd = (q, k, v, bias, key_bias, o, torch.randn_like(o), mx, lg, delta, *grads)
    return {"fwd": (q, k, v, bias, key_bias, torch.empty_like(o), mx.clone(), lg.clone()), "bwd": bwd}


def _tile_launch(inputs: dict[str, Any], pass_: str, tiles: tuple) -> Callable[[], torch.Tensor]:
    kernels, (q, _, _, bias, *_, dq, dk, _) = _kernels(), inputs["bwd"]
    b, s, h, n, d = q.shape
    cfg = kernels.Config(tiles[0], tiles[1], max(16, 1 << (d - 1).bit_length()), tiles[2], tiles[3])
    if pass_ == "fwd":
        return lambda: (kernels.launch_fwd(*inputs["fwd"], cfg), inputs["fwd"][5])[1]
    # dk/dv and dbias read delta, which the dq pass writes: the default dq first, outside the timing.
    none = torch.empty((0,), dtype=torch.float32, device=q.device)
    kernels.launch_bwd("dq", *inputs["bwd"], none, kernels._config("dq", d, q.device))
    if pass_ != "dbias":
        out = dq if pass_ == "dq" else dk
        return lambda: (kernels.launch_bwd(pass_, *inputs["bwd"], none, cfg), out)[1]
    nb = list(bias.shape[:3])
    tiles_per_rep = -(-n // cfg.block_m) * -(-n // cfg.block_n) * nb[0] * nb[1] * nb[2]
    splits = kernels.dbias_splits(b * s * h // (nb[0] * nb[1] * nb[2]), tiles_per_rep, q.device)
    parts = torch.empty((splits, *nb, n, n), dtype=torch.float32, device=q.device)
    return lambda: (kernels.launch_bwd("dbias", *inputs["bwd"], parts, cfg), parts.sum(0))[1]


def _tile_default(case: AttentionCase, dtype_name: str, pass_: str, device: torch.device) -> tuple:
    cfg = _kernels()._config(pass_, case.head_dim, device)
    return cfg.block_m, cfg.block_n, cfg.warps, cfg.stages


# Matmuls per pass: fwd q·kᵀ and p·v; dk/dv recomputes q·kᵀ, do·vᵀ, then pᵀ·do and dsᵀ·q; dq recomputes
# two and adds ds·k; dbias recomputes two.
_MATMULS = {"fwd": 2, "dkdv": 4, "dq": 3, "dbias": 2}
_TILE_GRIDS = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    "fwd": list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))),
    "dq": list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))),
    "dkdv": list(itertools.product((32, 64, 128), (64, 128), (4, 8), (2, 3))),
    "dbias": list(itertools.product((64, 128), (32, 64, 128), (4, 8), (1, 2))),
}
TILES = TileSweep(
    passes=tuple(_TILE_GRIDS),
    fields=dict.fromkeys(_TILE_GRIDS, ("block_m", "block_n", "warps", "stages")),
    grid=lambda case, pass_: _TILE_GRIDS[pass_],
    default=_tile_default,
    prepare=_tile_inputs,
    launch=_tile_launch,
    calls=lambda inputs: 1,
    # 2·B·S·H·N·N·D FLOPs a matmul (the forward's `case.flops` counts two).
    cost=lambda case, dtype_name, pass_: (0, _MATMULS[pass_] * case.flops(False) // 2),
)

BENCHMARK = op_benchmark(
    "evoformer_attention",
    "triangle / MSA-row attention: hfkit vs eager, compile, SDPA, trifast, cuEquivariance",
    attention_cases,
    (_prepare, _provider, _build, _cost),
    providers=("hfkit", "hfkit_three_pass", "eager", "compile", "sdpa", "trifast", "cuequivariance"),
    default_dtypes=("bf16",),
    options=(
        Option("ops", "names", "which attention", tuple(OPS)),
        Option("sizes", "ints", "keep these N, e.g. 256,512 (default: all)"),
    ),
    tiles=TILES,
)
