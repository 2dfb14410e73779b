"""`hfkit.nn.LayerNorm`: a drop-in `torch.nn.LayerNorm` whose forward runs the fused `hfkit.ops.layer_norm`.

It subclasses `torch.nn.LayerNorm`, so the constructor, parameters, `state_dict`, `extra_repr` and
`isinstance` checks are torch's; only `forward` changes. Importing this file registers the swap
`torch.nn.LayerNorm` -> `hfkit.nn.LayerNorm` used by `hfkit.to_hfkit`.

Inside the model's `residual_taps` (the Evoformer's residual blocks), a LayerNorm of a tapped tensor
runs `hfkit.ops.layer_norm_with_residual` and records the pass-through, so that the residual add's
gradient is added inside its backward kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from hfkit.model.primitives import active_residual_taps
from hfkit.nn.convert import register_swap
from hfkit.ops import layer_norm
from hfkit.ops.layer_norm import layer_norm_with_residual

__all__ = ["LayerNorm", "matmul_dtype"]


class LayerNorm(nn.LayerNorm):
    """Layer normalization over the trailing `normalized_shape` dims, computed by `hfkit.ops.layer_norm`.

    Same constructor as `torch.nn.LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True,
    bias=True, device=None, dtype=None)` and the same parameters (`weight`, `bias`, either may be
    None). `forward(input: [*, *normalized_shape], out_dtype=None) -> [*, *normalized_shape]` uses the
    Triton kernel on CUDA (and on CPU under `TRITON_INTERPRET=1`) and the plain-torch reference
    otherwise; the output is in `out_dtype` (default input's dtype, as torch's module).
    """

    def forward(self, input: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        taps = active_residual_taps()
        if taps is not None and taps.wants(input):
            y, passthrough = layer_norm_with_residual(
                input, self.normalized_shape, self.weight, self.bias, self.eps, out_dtype=out_dtype
            )
            if passthrough is not input:
                taps.record(input, passthrough)
            return y
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps, out_dtype=out_dtype)


def matmul_dtype(norm: nn.Module, x: torch.Tensor) -> torch.dtype | None:
    """The `out_dtype` for `norm(x, out_dtype=...)` when the output only feeds matmuls that run under
    autocast (one `hfkit.ops.multi_linear` or `relu_mlp`, which cast their operands to the autocast
    dtype): the autocast dtype where `norm` is hfkit's LayerNorm and autocast is on for x's device
    with a dtype other than x's (the values those matmuls would cast to, without the float32 tensor
    and the casts of it and of its gradient); else None, for a plain `norm(x)`. Callers keep x's
    dtype for anything else they derive from the output (masks), as the output's would have been."""
    kind = x.device.type
    if not isinstance(norm, LayerNorm) or not torch.is_autocast_enabled(kind):
        return None
    dtype = torch.get_autocast_dtype(kind)
    return dtype if dtype != x.dtype else None


register_swap(nn.LayerNorm, LayerNorm)
