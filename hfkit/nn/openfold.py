"""Swaps for OpenFold's own modules: `to_hfkit` on an unmodified OpenFold model runs hfkit's ops.

hfkit does not import OpenFold: each OpenFold class is registered by its qualified name
(`register_foreign_swap`) with a layout check and the methods of its adapter, a subclass of that very
OpenFold class made on first use (see `hfkit.nn.convert`). The adapters keep OpenFold's forward
signatures and semantics (its keyword flags, masks, `inplace_safe` results) and override only
`forward`; parameters, buffers and the state_dict are OpenFold's, and `to_torch` restores OpenFold's
classes. Covered (op names as in the swap report):

- `openfold.LayerNorm` (`primitives.LayerNorm`): `hfkit.ops.layer_norm`.
- `openfold.Attention` (`primitives.Attention`, inside MSA row attention with pair bias, MSA column
  attention and both triangle attentions): `hfkit.ops.evoformer_attention` and `gated_linear`. Its
  `use_memory_efficient_kernel` / `use_deepspeed_evo_attention` / `use_lma` flags select other
  implementations of the same function in OpenFold, so all of them run the fused kernel here;
  `use_flash` runs OpenFold's own forward.
- `openfold.TriangleAttention` (the ending node, `starting=False`) and `openfold.MSAColumnAttention`:
  attention along columns without transposing copies (`hfkit.nn.attention.attend_axis`) where
  their `mha` is swapped and its op runs Triton, unchunked (or chunks of at least the columns
  attended), no `use_flash`; otherwise, and for the starting node, OpenFold's forward.
- `openfold.GlobalAttention`: the attention core through `evoformer_attention` (one query per column,
  the shared key/value head broadcast over heads) and the gated output through `gated_linear`.
- `openfold.TriangleMultiplication{Outgoing,Incoming}` and their `Fused...` variants (one
  `linear_ab_p` / `linear_ab_g` projection): `hfkit.ops.triangle_multiplication`.
- `openfold.OuterProductMean`: `hfkit.ops.outer_product_linear`.
- `openfold.MSATransition`, `openfold.PairTransition`: `hfkit.ops.relu_mlp`.
- `openfold.Dropout{,Rowwise,Columnwise}`: identity in eval mode (OpenFold multiplies by a mask of
  ones, in place), `hfkit.ops.bias_dropout_add` with its in-kernel mask in training. The residual add
  is the caller's in OpenFold, so it is not fused here.

Importing this file registers the swaps.
"""

from __future__ import annotations

import torch
from torch import nn

from hfkit.model.outer_product_mean import OuterProductMean as _PlainOuterProductMean
from hfkit.model.pair_transition import Transition as _PlainTransition
from hfkit.nn.attention import attend_axis, fused_gated_attention, linears_of, map_attention_biases
from hfkit.nn.convert import register_foreign_swap
from hfkit.nn.triangle_multiplication import triangle_update_from_parts
from hfkit.ops import layer_norm
from hfkit.ops.elementwise import bias_dropout_add, row_scale
from hfkit.ops.evoformer_attention import evoformer_attention, uses_triton
from hfkit.ops.gated_linear import gated_linear
from hfkit.ops.outer_product_linear import outer_product_linear
from hfkit.ops.relu_mlp import relu_mlp

__all__: list[str] = []

_MODEL = "openfold.model"


def _openfold_forward(module: nn.Module) -> object:
    """The forward of the OpenFold class that `module`'s adapter subclasses, bound to `module`."""
    return type(module).__bases__[0].forward.__get__(module)


# ----------------------------------------------------------------------------- layout checks


def _linear_layout(module: nn.Module, name: str, shape: tuple[int, int] | None, bias: bool | None) -> str:
    """Why `module.<name>` is not a linear layer of `shape` ([out, in]) with a bias [out] (`bias` True)
    or without one (False); the empty string when it is."""
    lin = getattr(module, name, None)
    weight = getattr(lin, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return f"{name}: expected a linear layer with a 2-d weight, got {type(lin).__name__}"
    if shape is not None and tuple(weight.shape) != shape:
        return f"{name}.weight: expected shape {list(shape)}, got {list(weight.shape)}"
    b = getattr(lin, "bias", None)
    if bias is True and (b is None or tuple(b.shape) != (weight.shape[0],)):
        return f"{name}.bias: expected shape [{weight.shape[0]}], got {None if b is None else list(b.shape)}"
    if bias is False and b is not None:
        return f"{name}.bias: expected none, got shape {list(b.shape)}"
    return ""


def _norm_layout(module: nn.Module, name: str, size: int | None) -> str:
    """Why `module.<name>` is not a LayerNorm over one dim (`weight`, `bias` [size], a float `eps`); the
    empty string when it is."""
    ln = getattr(module, name, None)
    w, b, eps = (getattr(ln, attr, None) for attr in ("weight", "bias", "eps"))
    if not (isinstance(w, torch.Tensor) and isinstance(b, torch.Tensor) and isinstance(eps, float)):
        return f"{name}: expected a LayerNorm with weight, bias and eps, got {type(ln).__name__}"
    if w.dim() != 1 or b.shape != w.shape or (size is not None and w.shape[0] != size):
        return f"{name}: expected weight and bias [{size}], got {list(w.shape)} and {list(b.shape)}"
    return ""


def _first(*reasons: str) -> str:
    return next((r for r in reasons if r), "")


def _check_layer_norm(module: nn.Module) -> str:
    c_in = getattr(module, "c_in", None)
    if not (isinstance(c_in, tuple) and len(c_in) == 1 and isinstance(c_in[0], int)):
        return f"c_in: expected a one-int tuple, got {c_in!r}"
    w, b = module._parameters.get("weight"), module._parameters.get("bias")
    if w is None or b is None or tuple(w.shape) != c_in or tuple(b.shape) != c_in:
        return f"weight, bias: expected parameters of shape {list(c_in)}"
    return ""


def _check_attention(module: nn.Module) -> str:
    hc = module.c_hidden * module.no_heads
    return _first(
        _linear_layout(module, "linear_q", (hc, module.c_q), False),
        _linear_layout(module, "linear_k", (hc, module.c_k), False),
        _linear_layout(module, "linear_v", (hc, module.c_v), False),
        _linear_layout(module, "linear_o", (module.c_q, hc), True),
        "" if module.linear_g is None else _linear_layout(module, "linear_g", (hc, module.c_q), True),
    )


def _check_global_attention(module: nn.Module) -> str:
    c, hc = module.c_in, module.c_hidden * module.no_heads
    return _first(
        _linear_layout(module, "linear_q", (hc, c), False),
        _linear_layout(module, "linear_k", (module.c_hidden, c), False),
        _linear_layout(module, "linear_v", (module.c_hidden, c), False),
        _linear_layout(module, "linear_g", (hc, c), True),
        _linear_layout(module, "linear_o", (c, hc), True),
    )


def _check_triangle(module: nn.Module, fused: bool) -> str:
    c_z, c_h = module.c_z, module.c_hidden
    if fused:
        projections = [
            _linear_layout(module, n, (2 * c_h, c_z), True) for n in ("linear_ab_p", "linear_ab_g")
        ]
    else:
        names = ("linear_a_p", "linear_a_g", "linear_b_p", "linear_b_g")
        projections = [_linear_layout(module, n, (c_h, c_z), True) for n in names]
    reason = _first(
        *projections,
        _linear_layout(module, "linear_g", (c_z, c_z), True),
        _linear_layout(module, "linear_z", (c_z, c_h), True),
        _norm_layout(module, "layer_norm_in", c_z),
        _norm_layout(module, "layer_norm_out", c_h),
    )
    if not reason and module.layer_norm_in.eps != module.layer_norm_out.eps:
        reason = (
            f"layer_norm_in.eps ({module.layer_norm_in.eps}) differs from layer_norm_out.eps "
            f"({module.layer_norm_out.eps}); the fused op takes one eps"
        )
    return reason


def _check_outer_product_mean(module: nn.Module) -> str:
    c_m, c_h = module.c_m, module.c_hidden
    return _first(
        _norm_layout(module, "layer_norm", c_m),
        _linear_layout(module, "linear_1", (c_h, c_m), True),
        _linear_layout(module, "linear_2", (c_h, c_m), True),
        _linear_layout(module, "linear_out", (module.c_z, c_h * c_h), True),
    )


def _check_transition(module: nn.Module) -> str:
    c = module.c_m if hasattr(module, "c_m") else module.c_z
    return _first(
        _norm_layout(module, "layer_norm", c),
        _linear_layout(module, "linear_1", (module.n * c, c), True),
        _linear_layout(module, "linear_2", (c, module.n * c), True),
        "" if isinstance(getattr(module, "relu", None), nn.ReLU) else "relu: expected nn.ReLU",
    )


def _check_triangle_attention(module: nn.Module) -> str:
    return _first(
        _norm_layout(module, "layer_norm", module.c_in),
        _linear_layout(module, "linear", (module.no_heads, module.c_in), False),
    )


def _check_msa_column_attention(module: nn.Module) -> str:
    att = module._msa_att
    reason = "_msa_att.pair_bias: expected False" if att.pair_bias else ""
    return _first(reason, _norm_layout(att, "layer_norm_m", module.c_m))


def _check_dropout(module: nn.Module) -> str:
    dims = module.batch_dim
    if dims is not None and len(dims) != 1:
        return f"batch_dim: hfkit's dropout shares its mask along one dim, got {dims!r}"
    if not 0.0 <= module.r < 1.0:
        return f"r: expected a probability in [0, 1), got {module.r}"
    return ""


# ----------------------------------------------------------------------------- adapter forwards


def _layer_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # OpenFold runs bfloat16 inputs with the parameters cast to bfloat16.
    weight, bias = self.weight, self.bias
    if x.dtype is torch.bfloat16:
        weight, bias = weight.to(x.dtype), bias.to(x.dtype)
    return layer_norm(x, self.c_in, weight, bias, self.eps)


def _attention_forward(
    self: nn.Module,
    q_x: torch.Tensor,
    kv_x: torch.Tensor,
    biases: list[torch.Tensor] | None = None,
    use_memory_efficient_kernel: bool = False,
    use_deepspeed_evo_attention: bool = False,
    use_lma: bool = False,
    lma_q_chunk_size: int | None = None,
    lma_kv_chunk_size: int | None = None,
    use_flash: bool = False,
    flash_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    flags = (use_memory_efficient_kernel, use_deepspeed_evo_attention, use_lma, use_flash)
    mapped = None
    if not use_flash and sum(flags) <= 1:
        mapped = map_attention_biases(q_x, kv_x, list(biases or []))
    if mapped is None:  # flash attention, invalid flag sets (OpenFold raises), unmappable biases
        kwargs = {"lma_q_chunk_size": lma_q_chunk_size, "lma_kv_chunk_size": lma_kv_chunk_size}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        return _openfold_forward(self)(
            q_x,
            kv_x,
            biases=biases,
            use_memory_efficient_kernel=use_memory_efficient_kernel,
            use_deepspeed_evo_attention=use_deepspeed_evo_attention,
            use_lma=use_lma,
            use_flash=use_flash,
            flash_mask=flash_mask,
            **kwargs,
        )
    return fused_gated_attention(self, q_x, kv_x, mapped)


def _takes_column_path(mha: nn.Module, x: torch.Tensor, flags: tuple) -> bool:
    """Whether an OpenFold column attention on x [*, R, N, C] tries `attend_axis`: its `mha`
    swapped (`_attention_forward`), the op running Triton for x, at most one of OpenFold's attention
    flags (all run the fused kernel here)."""
    return type(mha).forward is _attention_forward and uses_triton(x, mha.c_hidden) and sum(flags) <= 1


def _triangle_attention_forward(
    self: nn.Module,
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    use_memory_efficient_kernel: bool = False,
    use_deepspeed_evo_attention: bool = False,
    use_lma: bool = False,
    inplace_safe: bool = False,
) -> torch.Tensor:
    """OpenFold's TriangleAttention; the ending node along columns (`attend_axis`) where it can."""
    flags = (use_memory_efficient_kernel, use_deepspeed_evo_attention, use_lma)
    if not self.starting and _takes_column_path(self.mha, x, flags):
        update = attend_axis(
            self.mha, self.layer_norm, x, mask, self.inf, bias_projection=self.linear, chunk_size=chunk_size
        )
        if update is not None:
            return update
    return _openfold_forward(self)(
        x,
        mask,
        chunk_size,
        use_memory_efficient_kernel=use_memory_efficient_kernel,
        use_deepspeed_evo_attention=use_deepspeed_evo_attention,
        use_lma=use_lma,
        inplace_safe=inplace_safe,
    )


def _msa_column_attention_forward(
    self: nn.Module,
    m: torch.Tensor,
    mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    use_deepspeed_evo_attention: bool = False,
    use_lma: bool = False,
    use_flash: bool = False,
) -> torch.Tensor:
    """OpenFold's MSAColumnAttention; along columns (`attend_axis`) where it can."""
    att = self._msa_att
    if not use_flash and _takes_column_path(att.mha, m, (use_deepspeed_evo_attention, use_lma)):
        update = attend_axis(att.mha, att.layer_norm_m, m, mask, att.inf, chunk_size=chunk_size)
        if update is not None:
            return update
    return _openfold_forward(self)(
        m,
        mask,
        chunk_size,
        use_deepspeed_evo_attention=use_deepspeed_evo_attention,
        use_lma=use_lma,
        use_flash=use_flash,
    )


def _global_attention_forward(
    self: nn.Module, m: torch.Tensor, mask: torch.Tensor, use_lma: bool = False
) -> torch.Tensor:
    """m [*, N_res, S, C], mask [*, N_res, S] -> [*, N_res, S, C] (OpenFold's GlobalAttention)."""
    h = self.no_heads
    mask = mask.to(m.dtype)
    q = torch.sum(m * mask.unsqueeze(-1), dim=-2) / (torch.sum(mask, dim=-1)[..., None] + self.eps)
    q = self.linear_q(q).unflatten(-1, (h, -1))  # [*, N_res, H, C]
    k = self.linear_k(m)  # [*, N_res, S, C]
    v = self.linear_v(m)
    n_res, s = m.shape[-3], m.shape[-2]
    # One query per (column, head); the one key/value head broadcast over heads (stride 0, no copy).
    q5 = q.reshape(-1, n_res, h, 1, q.shape[-1])
    k5 = k.reshape(-1, n_res, 1, s, k.shape[-1]).expand(-1, -1, h, -1, -1)
    v5 = v.reshape(-1, n_res, 1, s, v.shape[-1]).expand(-1, -1, h, -1, -1)
    key_bias = (self.inf * (mask - 1.0)).reshape(-1, n_res, s).detach()
    o = evoformer_attention(q5, k5, v5, key_bias=key_bias)  # [B, N_res, H, 1, C]
    o = o.reshape(q.shape)  # [*, N_res, H, C]
    g = self.linear_g(m)  # [*, N_res, S, H * C]
    o = o.unsqueeze(-3).expand(*m.shape[:-1], h, o.shape[-1])  # [*, N_res, S, H, C]
    return gated_linear(g, o.flatten(-2), self.linear_o.weight, self.linear_o.bias)


def _triangle_forward(
    self: nn.Module,
    z: torch.Tensor,
    mask: torch.Tensor | None = None,
    inplace_safe: bool = False,
    _add_with_inplace: bool = False,
    _inplace_chunk_size: int | None = 256,
) -> torch.Tensor:
    if hasattr(self, "linear_ab_p"):
        # OpenFold's fused variant: rows [:C_h] of linear_ab_* project a, rows [C_h:] project b.
        c = self.c_hidden
        p, g = self.linear_ab_p, self.linear_ab_g
        weights = [p.weight[:c], g.weight[:c], p.weight[c:], g.weight[c:], self.linear_g.weight]
        biases = [p.bias[:c], g.bias[:c], p.bias[c:], g.bias[c:], self.linear_g.bias]
    else:
        lins = (self.linear_a_p, self.linear_a_g, self.linear_b_p, self.linear_b_g, self.linear_g)
        weights, biases = [lin.weight for lin in lins], [lin.bias for lin in lins]
    x = triangle_update_from_parts(
        z, mask, self.layer_norm_in, self.layer_norm_out, weights, biases, self.linear_z, self._outgoing
    )
    if x is None:
        return _openfold_forward(self)(z, mask, inplace_safe, _add_with_inplace, _inplace_chunk_size)
    if inplace_safe and _add_with_inplace:
        # OpenFold's inference path returns z, overwritten with z + update.
        return z.add_(x)
    return x


def _outer_product_mean_forward(
    self: nn.Module,
    m: torch.Tensor,
    mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    inplace_safe: bool = False,
) -> torch.Tensor:
    """OpenFold's signature; the model's forward with `_outer_product` as its `_outer`."""
    return _PlainOuterProductMean.forward(self, m, mask, chunk_size)


def _opm_project(self: nn.Module, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # The model's `_project` (layer_norm, then linear_1 and linear_2) as one `multi_linear` where the
    # linears are plain (as `hfkit.nn.OuterProductMean._project`, the LayerNorm writing x's dtype).
    return linears_of(self.layer_norm(m), (self.linear_1, self.linear_2))


def _opm_normalize(self: nn.Module, outer: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    # `hfkit.nn.OuterProductMean._normalize` (not imported, as for `_outer_product`).
    return row_scale(outer, count, divide=True)


def _outer_product(self: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # `hfkit.nn.OuterProductMean._outer`; importing that file here would register its swap before
    # the others, and `registered_ops()` order is the bench waterfall's order.
    out = self.linear_out
    return outer_product_linear(a, b, out.weight, out.bias)


def _transition_forward(
    self: nn.Module, x: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int | None = None
) -> torch.Tensor:
    """OpenFold's MSA/pair transition: x [*, R, N, C], mask [*, R, N] or None (not masked); the model's
    forward with `_hidden` (`relu_mlp`) as its `_transition`."""
    return _PlainTransition.forward(self, x, mask, chunk_size)


def _hidden(self: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # `hfkit.nn.transition`'s `_transition` (not imported, as for `_outer_product`).
    l1, l2 = self.linear_1, self.linear_2
    return relu_mlp(x, l1.weight, l1.bias, l2.weight, l2.bias, mask)


def _dropout_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not self.training or self.r == 0.0:
        return x
    shared = None if self.batch_dim is None else self.batch_dim[0]
    return bias_dropout_add(x, torch.zeros_like(x), p=self.r, training=True, shared_dim=shared)


def _register() -> None:
    prim, tri = f"{_MODEL}.primitives", f"{_MODEL}.triangular_multiplicative_update"
    opm = {
        "forward": _outer_product_mean_forward,
        "_outer": _outer_product,
        "_project": _opm_project,
        "_normalize": _opm_normalize,
    }
    transition = {"forward": _transition_forward, "_transition": _hidden}
    swaps = [
        (f"{prim}.LayerNorm", "LayerNorm", _check_layer_norm, {"forward": _layer_norm_forward}),
        (f"{prim}.Attention", "Attention", _check_attention, {"forward": _attention_forward}),
        (f"{prim}.GlobalAttention", "GlobalAttention", _check_global_attention,
         {"forward": _global_attention_forward}),
        (f"{_MODEL}.outer_product_mean.OuterProductMean", "OuterProductMean", _check_outer_product_mean, opm),
        (f"{_MODEL}.evoformer.MSATransition", "MSATransition", _check_transition, transition),
        (f"{_MODEL}.pair_transition.PairTransition", "PairTransition", _check_transition, transition),
        (f"{_MODEL}.msa.MSAColumnAttention", "MSAColumnAttention", _check_msa_column_attention,
         {"forward": _msa_column_attention_forward}),
    ]  # fmt: skip
    for fused in (False, True):
        for side in ("Outgoing", "Incoming"):
            name = f"{'Fused' if fused else ''}TriangleMultiplication{side}"
            check = lambda module, fused=fused: _check_triangle(module, fused)
            swaps.append((f"{tri}.{name}", name, check, {"forward": _triangle_forward}))
    for name in ("TriangleAttention", "TriangleAttentionEndingNode"):
        methods = {"forward": _triangle_attention_forward}
        swaps.append((f"{_MODEL}.triangular_attention.{name}", name, _check_triangle_attention, methods))
    for name in ("Dropout", "DropoutRowwise", "DropoutColumnwise"):
        swaps.append((f"{_MODEL}.dropout.{name}", name, _check_dropout, {"forward": _dropout_forward}))
    for qualname, name, check, methods in swaps:
        register_foreign_swap(qualname, f"openfold.{name}", check, methods)


_register()
