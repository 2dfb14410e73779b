"""Multi-head attention: the op behind `hfkit.nn.MultiheadAttention`, and its plain-torch reference.

Both functions have the semantics of `torch.nn.MultiheadAttention.forward` (which calls
`torch.nn.functional.multi_head_attention_forward`): packed or separate (`kdim`/`vdim`) input
projections, `bias_k`/`bias_v`, `add_zero_attn`, bool or float `key_padding_mask` and `attn_mask`
(2-D or 3-D), the `is_causal` hint, dropout on the attention probabilities, `need_weights` with or
without averaging over heads, `batch_first`, unbatched input and the output projection.

`multihead_attention` is the fast path. It works in the input's own layout (no transposes of the
activations before the projections), projects q, k and v with one matmul when `query is key is value`
and the weights are packed (k and v with one when `key is value`), takes the heads as strided views of
the projection, and runs the attention through `torch.nn.functional.scaled_dot_product_attention`
(flash or memory-efficient kernels on CUDA, a fused kernel on CPU). SDPA does not return the
attention probabilities, so with `need_weights=True` it computes them explicitly, as torch does. On
CUDA the projections run through `hfkit.ops.linear` (float32 products on the tensor cores at full
precision, where torch's run off them; `F.linear` itself in the other dtypes); on CPU they are
`F.linear`, so that the op stays plain torch there, matching torch's module to float32 rounding.
`multihead_attention_reference` is the specification: separate projections and an explicit softmax.
"""

from __future__ import annotations

import inspect
import math
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from hfkit.ops._checks import check_float, check_matmul_dtype, check_same_device, describe
from hfkit.ops.linear import linear

__all__ = ["multihead_attention", "multihead_attention_reference"]

Tensor = torch.Tensor


def multihead_attention_reference(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """Plain-torch multi-head attention: the specification `multihead_attention` is tested against.

    Takes the arguments of `multihead_attention` (its signature, which `inspect` shows here too) with
    the same shapes. Each of q, k, v is its own projection; the scores `q·kᵀ/sqrt(D) + mask` go through
    an explicit softmax, dropout (when `training`), and a matmul with v, all in the inputs' dtype.
    `is_causal` is only a hint here: the mask given in `attn_mask` is what is applied.
    """
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    a = SimpleNamespace(**bound.arguments)
    p = _check_inputs(
        a.query, a.key, a.value, a.num_heads, a.in_proj_weight, a.in_proj_bias, a.out_proj_weight,
        a.out_proj_bias, a.q_proj_weight, a.k_proj_weight, a.v_proj_weight, a.bias_k, a.bias_v,
        a.key_padding_mask, a.attn_mask, a.is_causal, a.dropout_p, a.batch_first,
    )  # fmt: skip
    e, h = p.embed_dim, a.num_heads
    d = e // h
    # Batch-first [B, L, E] views of every input (an unbatched input is a batch of one).
    q_in, k_in, v_in = (
        t if a.batch_first and p.batched else t.transpose(0, 1) if p.batched else t.unsqueeze(0)
        for t in (a.query, a.key, a.value)
    )
    q_proj_weight, k_proj_weight, v_proj_weight = a.q_proj_weight, a.k_proj_weight, a.v_proj_weight
    if a.in_proj_weight is not None:
        q_proj_weight, k_proj_weight, v_proj_weight = a.in_proj_weight.chunk(3)
    b_q, b_k, b_v = a.in_proj_bias.chunk(3) if a.in_proj_bias is not None else (None, None, None)
    q = F.linear(q_in, q_proj_weight, b_q)
    k = F.linear(k_in, k_proj_weight, b_k)
    v = F.linear(v_in, v_proj_weight, b_v)
    bsz, tgt_len, src_len = q.shape[0], q.shape[1], k.shape[1]
    extra = 0
    if a.bias_k is not None and a.bias_v is not None:
        k = torch.cat([k, a.bias_k.reshape(1, 1, e).expand(bsz, 1, e)], dim=1)
        v = torch.cat([v, a.bias_v.reshape(1, 1, e).expand(bsz, 1, e)], dim=1)
        extra += 1
    if a.add_zero_attn:
        k = torch.cat([k, k.new_zeros(bsz, 1, e)], dim=1)
        v = torch.cat([v, v.new_zeros(bsz, 1, e)], dim=1)
        extra += 1
    q = q.reshape(bsz, tgt_len, h, d).transpose(1, 2)
    k = k.reshape(bsz, src_len + extra, h, d).transpose(1, 2)
    v = v.reshape(bsz, src_len + extra, h, d).transpose(1, 2)
    scores = torch.matmul(q / math.sqrt(d), k.transpose(-2, -1))  # [B, H, L, S]
    mask = _merged_mask(a.key_padding_mask, a.attn_mask, bsz, h, tgt_len, src_len, extra, scores.dtype)
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1)
    if a.training and a.dropout_p > 0.0:
        probs = F.dropout(probs, p=a.dropout_p)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(bsz, tgt_len, e)
    out = F.linear(out, a.out_proj_weight, a.out_proj_bias)
    out = out[0] if not p.batched else out if a.batch_first else out.transpose(0, 1)
    if not a.need_weights:
        return out, None
    weights = probs.mean(dim=1) if a.average_attn_weights else probs
    return out, weights if p.batched else weights[0]


def multihead_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    num_heads: int,
    in_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
    out_proj_weight: Tensor,
    out_proj_bias: Tensor | None,
    *,
    q_proj_weight: Tensor | None = None,
    k_proj_weight: Tensor | None = None,
    v_proj_weight: Tensor | None = None,
    bias_k: Tensor | None = None,
    bias_v: Tensor | None = None,
    add_zero_attn: bool = False,
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
    need_weights: bool = True,
    average_attn_weights: bool = True,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    training: bool = True,
    batch_first: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Multi-head attention as `torch.nn.MultiheadAttention.forward`, through SDPA when no weights are asked.

    query: [L, B, E] ([B, L, E] with `batch_first`, [L, E] unbatched); key: [S, B, Ek], value:
    [S, B, Ev] in the same layout. Projections are either packed, `in_proj_weight` [3E, E] (then
    Ek = Ev = E and the q/k/v weights are None), or separate, `q_proj_weight` [E, E], `k_proj_weight`
    [E, Ek], `v_proj_weight` [E, Ev] (then `in_proj_weight` is None); `in_proj_bias` [3E] or None;
    `out_proj_weight` [E, E], `out_proj_bias` [E] or None; `bias_k`, `bias_v` [1, 1, E] or None
    (appended to the keys and values), `add_zero_attn` appends a zero key and value. E must divide by
    `num_heads`. `key_padding_mask` [B, S] ([S] unbatched) and `attn_mask` [L, S] or [B·H, L, S], bool
    (True = masked out) or float (added to the scores); `is_causal` says that `attn_mask` is the causal
    mask and needs it given, as in torch. Dropout with probability `dropout_p` applies when `training`.
    Returns the output [L, B, E] (layout of query) and, with `need_weights`, the attention
    probabilities [B, L, S'] averaged over heads or [B, H, L, S'] with `average_attn_weights=False`
    (S' counts the appended keys; no batch dim unbatched), else None. Raises ValueError naming the
    argument on a wrong shape, dtype or device.
    """
    p = _check_inputs(
        query, key, value, num_heads, in_proj_weight, in_proj_bias, out_proj_weight, out_proj_bias,
        q_proj_weight, k_proj_weight, v_proj_weight, bias_k, bias_v, key_padding_mask, attn_mask,
        is_causal, dropout_p, batch_first,
    )  # fmt: skip
    self_attention = query is key and key is value
    shared_kv = key is value
    if not p.batched:  # one sequence: a batch of one in the sequence-first layout
        query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        batch_first = False
    e, h = p.embed_dim, num_heads
    d = e // h
    seq_dim = 1 if batch_first else 0
    q, k, v = _project(
        query, key, value, e, in_proj_weight, in_proj_bias, q_proj_weight, k_proj_weight, v_proj_weight,
        self_attention, shared_kv,
    )  # fmt: skip
    bsz, tgt_len, src_len = query.shape[1 - seq_dim], query.shape[seq_dim], key.shape[seq_dim]
    extra = 0
    if bias_k is not None and bias_v is not None:
        k = _append_along(k, bias_k.reshape(1, 1, e), seq_dim)
        v = _append_along(v, bias_v.reshape(1, 1, e), seq_dim)
        extra += 1
    if add_zero_attn:
        k = _append_along(k, k.new_zeros(1, 1, e), seq_dim)
        v = _append_along(v, v.new_zeros(1, 1, e), seq_dim)
        extra += 1
    # [B, H, L, D] views of the projections, whichever the layout: SDPA takes any strides.
    to_heads = (0, 2, 1, 3) if batch_first else (1, 2, 0, 3)
    q, k, v = (t.unflatten(-1, (h, d)).permute(to_heads) for t in (q, k, v))
    # torch drops a causal attn_mask for SDPA's own causal masking when nothing else needs the mask.
    causal_only = is_causal and key_padding_mask is None and not need_weights
    mask = None
    if not causal_only:
        mask = _merged_mask(key_padding_mask, attn_mask, bsz, h, tgt_len, src_len, extra, q.dtype)
    dropout = dropout_p if training else 0.0
    weights = None
    if need_weights:
        n_keys = src_len + extra
        q_scaled = (q * math.sqrt(1.0 / d)).flatten(0, 1)  # [B·H, L, D]
        k_t = k.flatten(0, 1).transpose(1, 2)
        if mask is None:
            scores = torch.bmm(q_scaled, k_t)
        else:
            # baddbmm adds the mask before the scores are rounded to a 16-bit dtype (as torch does).
            mask = mask.expand(bsz, h, tgt_len, n_keys).reshape(bsz * h, tgt_len, n_keys)
            scores = torch.baddbmm(mask, q_scaled, k_t)
        probs = torch.softmax(scores.view(bsz, h, tgt_len, n_keys), dim=-1)
        if dropout > 0.0:
            probs = F.dropout(probs, p=dropout)
        attn = torch.matmul(probs, v)
        weights = probs.mean(dim=1) if average_attn_weights else probs
        weights = weights if p.batched else weights[0]
    else:
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal_only
        )
    # Back to the input's layout: [B, L, E] or [L, B, E] (a free view where SDPA wrote [B, L, H, D]).
    out = attn.permute((0, 2, 1, 3) if batch_first else (2, 0, 1, 3)).reshape(*query.shape[:2], e)
    out = _linear(out, out_proj_weight, out_proj_bias)
    return (out if p.batched else out[:, 0]), weights


# The one signature of both functions: the reference binds its arguments to it, and shows it.
_SIGNATURE = inspect.signature(multihead_attention)
multihead_attention_reference.__signature__ = _SIGNATURE  # type: ignore[attr-defined]


def _project(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    e: int,
    in_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
    q_proj_weight: Tensor | None,
    k_proj_weight: Tensor | None,
    v_proj_weight: Tensor | None,
    self_attention: bool,
    shared_kv: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v projections in the inputs' layout, with as few matmuls as the inputs allow: one for
    self-attention over packed weights, two when only key is value, else three."""
    if in_proj_weight is None:
        b_q, b_k, b_v = in_proj_bias.chunk(3) if in_proj_bias is not None else (None, None, None)
        return (
            _linear(query, q_proj_weight, b_q),
            _linear(key, k_proj_weight, b_k),
            _linear(value, v_proj_weight, b_v),
        )
    if self_attention:
        q, k, v = _linear(query, in_proj_weight, in_proj_bias).split(e, dim=-1)
        return q, k, v
    w_q, w_kv = in_proj_weight[:e], in_proj_weight[e:]
    b_q, b_kv = (in_proj_bias[:e], in_proj_bias[e:]) if in_proj_bias is not None else (None, None)
    q = _linear(query, w_q, b_q)
    if shared_kv:
        k, v = _linear(key, w_kv, b_kv).split(e, dim=-1)
        return q, k, v
    w_k, w_v = w_kv.chunk(2)
    b_k, b_v = b_kv.chunk(2) if b_kv is not None else (None, None)
    return q, _linear(key, w_k, b_k), _linear(value, w_v, b_v)


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """A projection x [*, K] -> [*, N]: `hfkit.ops.linear` on CUDA, `F.linear` on CPU (where linear's
    kernel runs only under Triton's interpreter, slower than torch and summing in another order, while
    the tests compare against torch's module elementwise)."""
    return linear(x, weight, bias) if x.is_cuda else F.linear(x, weight, bias)


def _append_along(t: Tensor, row: Tensor, seq_dim: int) -> Tensor:
    """`t` [L, B, E] or [B, L, E] with `row` [1, 1, E] appended at the end of the sequence dim."""
    shape = list(t.shape)
    shape[seq_dim] = 1
    return torch.cat([t, row.to(t.dtype).expand(shape)], dim=seq_dim)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A mask as scores to add: bool True -> -inf, False -> 0; a float mask as it is, in `dtype`."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def _merged_mask(
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    bsz: int,
    num_heads: int,
    tgt_len: int,
    src_len: int,
    extra: int,
    dtype: torch.dtype,
) -> Tensor | None:
    """The sum of both masks as additive scores broadcastable to [B, H, L, S + extra] (the `extra`
    appended keys are never masked), or None when neither is given."""
    merged = None
    if attn_mask is not None:
        m = _additive(attn_mask, dtype)
        merged = (
            m.reshape(1, 1, tgt_len, src_len) if m.dim() == 2 else m.reshape(bsz, num_heads, tgt_len, src_len)
        )
    if key_padding_mask is not None:
        m = _additive(key_padding_mask, dtype).reshape(bsz, 1, 1, src_len)
        merged = m if merged is None else merged + m
    if merged is not None and extra:
        merged = F.pad(merged, (0, extra))
    return merged


class _Checked(NamedTuple):
    """What the checks learnt about a call: the embedding size and whether the input has a batch dim."""

    embed_dim: int
    batched: bool


def _check_inputs(
    query: object,
    key: object,
    value: object,
    num_heads: object,
    in_proj_weight: Tensor | None,
    in_proj_bias: Tensor | None,
    out_proj_weight: object,
    out_proj_bias: Tensor | None,
    q_proj_weight: Tensor | None,
    k_proj_weight: Tensor | None,
    v_proj_weight: Tensor | None,
    bias_k: Tensor | None,
    bias_v: Tensor | None,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
    dropout_p: object,
    batch_first: bool,
) -> _Checked:
    check_float("query", query)
    assert isinstance(query, Tensor)
    if query.dim() not in (2, 3):
        raise ValueError(
            f"query: expected a 3-d (batched) or 2-d (unbatched) tensor, got shape {list(query.shape)}"
        )
    for name, t in (("key", key), ("value", value)):
        check_float(name, t, query.dim())
        assert isinstance(t, Tensor)
        check_same_device(name, t, "query", query)
        if t.dtype != query.dtype:
            raise ValueError(f"{name}: expected dtype {query.dtype} (query's), got {t.dtype}")
    assert isinstance(key, Tensor) and isinstance(value, Tensor)
    batched = query.dim() == 3
    e = query.shape[-1]
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0 or e % num_heads:
        raise ValueError(f"num_heads: expected a positive int dividing embed_dim {e}, got {num_heads!r}")
    if batched:
        b_dim, s_dim = (0, 1) if batch_first else (1, 0)
        bsz, tgt_len = query.shape[b_dim], query.shape[s_dim]
        for name, t in (("key", key), ("value", value)):
            if t.shape[b_dim] != bsz:
                raise ValueError(
                    f"{name}: expected batch size {bsz} (query's, batch_first={batch_first}), got shape "
                    f"{list(t.shape)}"
                )
        src_len = key.shape[s_dim]
        if value.shape[s_dim] != src_len:
            raise ValueError(
                f"value: expected sequence length {src_len} (key's), got shape {list(value.shape)}"
            )
    else:
        bsz, tgt_len, src_len = 1, query.shape[0], key.shape[0]
        if value.shape[0] != src_len:
            raise ValueError(
                f"value: expected sequence length {src_len} (key's), got shape {list(value.shape)}"
            )

    dtype, kind = query.dtype, query.device.type  # once for every parameter below

    def check_param(name: str, t: object, shape: tuple[int, ...]) -> None:
        if not isinstance(t, Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {describe(t)}")
        check_same_device(name, t, "query", query)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
        check_matmul_dtype(name, t, dtype, kind)

    separate = (q_proj_weight, k_proj_weight, v_proj_weight)
    if in_proj_weight is not None:
        if any(t is not None for t in separate):
            raise ValueError(
                "in_proj_weight: expected None when q_proj_weight, k_proj_weight and v_proj_weight are given"
            )
        check_param("in_proj_weight", in_proj_weight, (3 * e, e))
        for name, t in (("key", key), ("value", value)):
            if t.shape[-1] != e:
                raise ValueError(
                    f"{name}: expected embedding size {e} (packed in_proj_weight), got shape {list(t.shape)}"
                )
    else:
        if any(t is None for t in separate):
            raise ValueError(
                "in_proj_weight: is None, so q_proj_weight, k_proj_weight and v_proj_weight must all be "
                f"given, got {[describe(t) for t in separate]}"
            )
        check_param("q_proj_weight", q_proj_weight, (e, e))
        check_param("k_proj_weight", k_proj_weight, (e, key.shape[-1]))
        check_param("v_proj_weight", v_proj_weight, (e, value.shape[-1]))
    if in_proj_bias is not None:
        check_param("in_proj_bias", in_proj_bias, (3 * e,))
    check_param("out_proj_weight", out_proj_weight, (e, e))
    if out_proj_bias is not None:
        check_param("out_proj_bias", out_proj_bias, (e,))
    if (bias_k is None) != (bias_v is None):
        raise ValueError(
            f"bias_k: expected bias_k and bias_v both given or both None, got {describe(bias_k)} and "
            f"{describe(bias_v)}"
        )
    if bias_k is not None:
        for name, t in (("bias_k", bias_k), ("bias_v", bias_v)):
            if not isinstance(t, Tensor) or t.numel() != e or t.dim() != 3:
                raise ValueError(f"{name}: expected shape [1, 1, {e}], got {describe(t)}")
            check_same_device(name, t, "query", query)
    if key_padding_mask is not None:
        _check_mask("key_padding_mask", key_padding_mask, [(bsz, src_len) if batched else (src_len,)], query)
    if attn_mask is not None:
        _check_mask("attn_mask", attn_mask, [(tgt_len, src_len), (bsz * num_heads, tgt_len, src_len)], query)
    elif is_causal:
        raise ValueError(
            "attn_mask: is_causal=True is a hint that attn_mask is the causal mask, so attn_mask is needed "
            "(e.g. nn.Transformer.generate_square_subsequent_mask(L)), got None"
        )
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p: expected a number in [0, 1], got {dropout_p!r}")
    return _Checked(e, batched)


def _check_mask(name: str, mask: object, shapes: list[tuple[int, ...]], query: Tensor) -> None:
    """`mask` is a bool or floating tensor on query's device, of one of `shapes`."""
    if not isinstance(mask, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor or None, got {describe(mask)}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a bool or floating-point dtype, got {mask.dtype}")
    check_same_device(name, mask, "query", query)
    if tuple(mask.shape) not in shapes:
        options = " or ".join(str(list(s)) for s in shapes)
        raise ValueError(f"{name}: expected shape {options}, got {list(mask.shape)}")
