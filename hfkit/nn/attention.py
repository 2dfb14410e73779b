"""`hfkit.nn.EvoformerAttention`: OpenFold's gated multi-head attention (`hfkit.model.primitives.Attention`)
whose attention core runs the fused, memory-efficient `hfkit.ops.evoformer_attention` and whose gate
and output projection run `hfkit.ops.gated_linear`.

It subclasses the model's `Attention`, so constructor, parameters and state_dict are the model's; only
the attention core and the gated output projection change. Importing this file registers the swap
`Attention` -> `EvoformerAttention` used by `hfkit.to_hfkit`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hfkit.model.primitives import Attention, mask_bias
from hfkit.nn.convert import register_swap
from hfkit.nn.layer_norm import matmul_dtype
from hfkit.ops.evoformer_attention import evoformer_attention, uses_triton
from hfkit.ops.gated_linear import gated_linear, gated_linear_add_
from hfkit.ops.linear import linear
from hfkit.ops.multi_linear import multi_linear

__all__ = [
    "EvoformerAttention",
    "attend_axis",
    "fusable_linears",
    "fused_gated_attention",
    "gated_output",
    "linears_of",
    "map_attention_biases",
    "project",
]


class EvoformerAttention(Attention):
    """`Attention` whose attention core runs the fused, memory-efficient `hfkit.ops.evoformer_attention`.

    Same constructor, parameters and state_dict as `Attention`; `forward` maps OpenFold's biases onto
    the op for inputs `q_x`, `kv_x`: [*, Q|K, c] with at most two leading dims [B, S] shared by both:
    every bias of shape [*, 1, 1, K] (a mask bias `inf * (mask - 1)`) is summed into the op's additive
    key bias, every other bias (a pair bias [*, 1, H, Q, K], with its gradient) into `bias`. Anything
    else (more leading dims, biases with more dims than the logits, a mask bias that requires grad)
    runs `Attention`'s plain-torch path.
    """

    def forward(
        self, q_x: torch.Tensor, kv_x: torch.Tensor, biases: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        biases = self._check(q_x, kv_x, biases)
        mapped = map_attention_biases(q_x, kv_x, biases)
        if mapped is None:
            q, k, v = self._project(q_x, kv_x)
            return self._wrap_up(self._attend_reference(q, k, v, biases), q_x)
        return fused_gated_attention(self, q_x, kv_x, mapped)

    def holds_logits(self, x: torch.Tensor) -> bool:
        """Whether a call on inputs like x holds the logits: only where the op runs its reference
        (`hfkit.ops.evoformer_attention.uses_triton` false for x's device and dtype), or where its
        biases do not map (see the class docstring; the lean path's always do)."""
        return not uses_triton(x, self.c_hidden)

    def _wrap_up(self, o: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
        """`Attention._wrap_up` as `hfkit.ops.gated_linear` (see `gated_output`)."""
        g = None if self.linear_g is None else linear(q_x, self.linear_g.weight, self.linear_g.bias)
        return gated_output(self, o, g)


def map_attention_biases(
    q_x: torch.Tensor, kv_x: torch.Tensor, biases: list[torch.Tensor]
) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """OpenFold's attention biases for q_x [*, Q, c], kv_x [*, K, c] as `evoformer_attention`'s
    (pair bias [B, S, H, Q, K] or None, key bias [B, S, K] or None); None when they do not map (more
    than two leading dims, leading dims of q_x and kv_x that differ, a bias with more dims than the
    logits, a mask bias that requires grad)."""
    lead = q_x.dim() - 2
    if lead > 2 or q_x.shape[:-2] != kv_x.shape[:-2]:
        return None
    return _map_biases(biases, lead)


def fused_gated_attention(
    module: nn.Module,
    q_x: torch.Tensor,
    kv_x: torch.Tensor,
    mapped: tuple[torch.Tensor | None, torch.Tensor | None],
    *,
    transposed: bool = False,
    projections: tuple[torch.Tensor, ...] | None = None,
    add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """OpenFold's gated attention of `module` (an `Attention` of hfkit or of OpenFold: `linear_q`,
    `linear_k`, `linear_v`, `linear_g` or None, `linear_o`, `no_heads`) on q_x [*, Q, c_q],
    kv_x [*, K, c_k] with the biases `mapped` by `map_attention_biases`, through
    `hfkit.ops.evoformer_attention` and `gated_output` -> [*, Q, c_q]. `projections`: the
    (q, k, v, g) that `project` gave for these inputs, where the caller has them (default: made here).

    With `transposed`, q_x [*, R, N, c_q] and kv_x [*, R, N, c_k] (at most one leading dim) are
    attended within columns: the result equals the call on `q_x.transpose(-2, -3)` and
    `kv_x.transpose(-2, -3)` (biases mapped for those views: pair bias [B, N, H, R, R], key bias
    [B, N, R]), transposed back, but no input is copied: the projections and the gated output run on
    the inputs as laid out, the op reads strided views of them, and the result [*, R, N, c_q] is
    laid out like q_x (contiguous for a contiguous q_x).

    With `add_to` (the result's shape, inference only), the result is added to it in place by the
    output projection itself (`gated_output`), and `add_to` is returned.
    """
    if transposed and q_x.dim() not in (3, 4):
        raise ValueError(f"q_x: expected [*, R, N, c] with at most one leading dim, got {list(q_x.shape)}")
    h = module.no_heads
    q, k, v, g = project(module, q_x, kv_x) if projections is None else projections[:4]
    q, k, v = (t.unflatten(-1, (h, -1)) for t in (q, k, v))
    lead = q_x.dim() - 2
    pair, key = mapped
    pad = (1,) * (2 - lead)
    # Strided views, no copies (the kernels take any strides, and the op lays its output and the
    # gradients of q, k, v out like them, so the views back are dense again):
    # rows [*, N, H, C] -> [B, S, H, N, C]; columns [*, R, N, H, C] -> [B, N, H, R, C].
    if transposed:
        to5 = lambda t: t.reshape(pad + tuple(t.shape)).permute(0, 2, 3, 1, 4)
        from5 = lambda o: o.permute(0, 3, 1, 2, 4)
    else:
        to5 = lambda t: t.reshape(pad + tuple(t.shape)).transpose(-2, -3)
        from5 = lambda o: o.transpose(-2, -3)
    o = evoformer_attention(to5(q), to5(k), to5(v), pair, key_bias=key)
    o = from5(o).reshape(q.shape)
    return gated_output(module, o, g, add_to)


def project(
    module: nn.Module, q_x: torch.Tensor, kv_x: torch.Tensor, extra: Sequence[nn.Module] = ()
) -> tuple[torch.Tensor | None, ...]:
    """(q, k, v, g, *(e(q_x) for e in extra)) of gated attention `module`: its `linear_q(q_x)`,
    `linear_k(kv_x)`, `linear_v(kv_x)`, `linear_g(q_x)` (None without a gate) and the `extra` linear
    layers of q_x (e.g. triangle attention's bias projection), each [*, Q|K, out].

    For self-attention (q_x is kv_x) whose layers are all plain linears (`nn.Linear` or a subclass
    such as OpenFold's `Linear` without a `precision`, no forward hooks, weights in q_x's dtype or
    autocast on) they are one `hfkit.ops.multi_linear` of q_x: one gradient of q_x instead of four or
    five summed by autograd; the layers' parameters are read directly. Otherwise each layer is called
    (linear_g through `hfkit.ops.linear`)."""
    layers = [module.linear_q, module.linear_k, module.linear_v, module.linear_g, *extra]
    used = [layer for layer in layers if layer is not None]
    if q_x is kv_x and fusable_linears(q_x, used):
        outs = iter(multi_linear(q_x, [lyr.weight for lyr in used], [lyr.bias for lyr in used]))
        return tuple(None if layer is None else next(outs) for layer in layers)
    gate = module.linear_g
    g = None if gate is None else linear(q_x, gate.weight, gate.bias)
    q, k, v = module.linear_q(q_x), module.linear_k(kv_x), module.linear_v(kv_x)
    return (q, k, v, g, *(layer(q_x) for layer in extra))


def linears_of(x: torch.Tensor, layers: Sequence[nn.Module]) -> tuple[torch.Tensor, ...]:
    """(layer(x) for each layer): one `hfkit.ops.multi_linear` where `fusable_linears` (one gradient
    of x, the layers' parameters read directly), else each layer called."""
    if fusable_linears(x, layers):
        return multi_linear(x, [layer.weight for layer in layers], [layer.bias for layer in layers])
    return tuple(layer(x) for layer in layers)


def fusable_linears(x: torch.Tensor, layers: Sequence[nn.Module]) -> bool:
    """Whether `hfkit.ops.multi_linear` of x with `layers`' parameters computes what calling each layer
    on x does: plain linears (`nn.Linear` or a subclass such as OpenFold's `Linear` without a
    `precision`), no forward hooks, weights in x's dtype or autocast on."""
    autocast = torch.is_autocast_enabled(x.device.type)
    return all(
        isinstance(layer, nn.Linear)
        and getattr(layer, "precision", None) is None
        and not layer._forward_hooks
        and not layer._forward_pre_hooks
        and (autocast or layer.weight.dtype == x.dtype)
        for layer in layers
    )


def attend_axis(
    mha: nn.Module,
    layer_norm: nn.Module,
    x: torch.Tensor,
    mask: torch.Tensor | None,
    inf: float,
    bias_projection: nn.Module | None = None,
    chunk_size: int | None = None,
    *,
    columns: bool = True,
    add_to: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The update of gated self-attention `mha` within the columns (`columns`) or the rows of
    `layer_norm(x)`, x [*, R, N, C] (at most one leading dim), mask [*, R, N] (None: all kept), with the
    key mask bias `inf * (mask - 1)` and, with `bias_projection` (C -> heads), the triangle bias: along
    columns the ending node's (the bias of query row i and key row k in column j is
    `bias_projection(layer_norm(x))[k, i]`), along rows the starting node's (`bias_projection(
    layer_norm(x))` [*, N, N, H] shared by all rows). The projections, the bias projection among them,
    are one `project` (one gradient of the normalized x). Returns the update [*, R, N, C] laid out like
    x (contiguous for a contiguous x); along columns it equals the row attention on the transposed x,
    transposed back, through `fused_gated_attention` with `transposed`, with no transposing copy (the
    caller has checked that the op runs Triton for x). None where the biases do not map (more leading
    dims, a mask that requires grad) or `chunk_size` is below the rows or columns attended (chunks
    would only bound the [*, R, N, C] projections: the fused op keeps no logits): the caller runs its
    plain forward then, and nothing has been computed or written. With `add_to` (x itself for a
    residual update, inference only) the update is added to it in place (`gated_output`) and it is
    returned."""
    if x.dim() not in (3, 4) or (mask is not None and mask.requires_grad):
        return None
    if chunk_size is not None and chunk_size < x.shape[-2 if columns else -3]:
        return None
    extra = () if bias_projection is None else (bias_projection,)
    used = [
        lyr for lyr in (mha.linear_q, mha.linear_k, mha.linear_v, mha.linear_g, *extra) if lyr is not None
    ]
    # Where one multi_linear is all that reads the normalized x (`project`), under autocast it is
    # written in the autocast dtype; the masks keep the dtype the LayerNorm's output has otherwise.
    out_dtype = matmul_dtype(layer_norm, x) if fusable_linears(x, used) else None
    xn = layer_norm(x) if out_dtype is None else layer_norm(x, out_dtype=out_dtype)
    dtype = xn.dtype if out_dtype is None else x.dtype
    if mask is None:
        mask = x.new_ones(x.shape[:-1], dtype=dtype)
    projections = project(mha, xn, xn, extra)
    # The biases of the model's row attention (on the transposed x for columns): views, no copies.
    along = (lambda t: t.transpose(-2, -3)) if columns else (lambda t: t)  # [*, R, N, ...] tensors
    mask = mask.to(dtype)
    biases = [mask_bias(mask.transpose(-1, -2) if columns else mask, inf)]
    if bias_projection is not None:
        biases.append(along(projections[4]).movedim(-1, -3).unsqueeze(-4))
    rows = along(xn)
    mapped = map_attention_biases(rows, rows, biases)
    if mapped is None:
        return None
    return fused_gated_attention(
        mha, xn, xn, mapped, transposed=columns, projections=projections, add_to=add_to
    )


def gated_output(
    module: nn.Module, o: torch.Tensor, g: torch.Tensor | None, add_to: torch.Tensor | None = None
) -> torch.Tensor:
    """`linear_o(sigmoid(g) * o)` for o [*, Q, H, c_hidden] and the gate projection g = linear_g(q_x)
    [*, Q, H * c_hidden] (None: no gate, `linear_o(o)`) as `hfkit.ops.gated_linear`: the gate is one
    fused kernel, and the backward recomputes it instead of keeping it for linear_o's weight gradient.
    linear_o's parameters are read directly (its forward hooks, if any, do not run). With `add_to`
    ([*, Q, c_out], no autograd) the output is added to it in place and it is returned: with a gate
    through `hfkit.ops.gated_linear_add_`, one pass over the rows instead of three."""
    o = o.flatten(-2)
    if add_to is not None:
        if g is None:
            return add_to.add_(module.linear_o(o))
        return gated_linear_add_(add_to, g, o, module.linear_o.weight, module.linear_o.bias)
    if g is None:
        return module.linear_o(o)
    return gated_linear(g, o, module.linear_o.weight, module.linear_o.bias)


def _map_biases(
    biases: list[torch.Tensor], lead: int
) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """Split biases for logits [*lead, H, Q, K] into (pair bias [B, S, H, Q, K] or None, key bias
    [B, S, K] or None), both with 1 where broadcast; None when some bias does not fit."""
    pair = key = None
    for b in biases:
        if b.dim() > lead + 3:
            return None
        b5 = b.reshape((1,) * (5 - b.dim()) + tuple(b.shape))
        if b5.shape[2] == 1 and b5.shape[3] == 1:
            if b.requires_grad:
                return None
            kb = b5[:, :, 0, 0, :].float()
            key = kb if key is None else key + kb
        else:
            pair = b5 if pair is None else pair + b5
    return pair, key


register_swap(Attention, EvoformerAttention)
