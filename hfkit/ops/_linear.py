"""What the ops built on `nn.Linear`-style matmuls (`gated_linear`, `relu_mlp`) share: their operands
cast as `nn.Linear` casts them under autocast, and bias gradients as column sums."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from hfkit.ops._triton import direct_call


def autocast_operands(device_type: str, *tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """`tensors` in the autocast dtype when autocast is on for `device_type` (None stays None), else
    unchanged: the operands `nn.Linear` would multiply there. The casts are differentiable, so the
    gradients reach fp32 parameters in their own dtype."""
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None else None for t in tensors)


# Vectors of ones for `column_sums`, one per (device, dtype), grown to the longest asked for: a slice
# of one costs the host a view where a new vector costs an allocation and a fill kernel, on every bias
# gradient. Never written after it is filled, so CUDA graphs and every stream may read it.
_ONES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

# True inside `no_kept_ones()`: a context variable, so each thread and task has its own setting.
_NO_KEPT_ONES: contextvars.ContextVar[bool] = contextvars.ContextVar("hfkit_no_kept_ones", default=False)


@contextlib.contextmanager
def no_kept_ones() -> Iterator[None]:
    """Inside this context `column_sums` makes a new vector of ones each call and keeps none. For the
    bodies of custom ops that compiled code calls opaquely: under `torch.compile(mode="reduce-overhead")`
    they run in the CUDA-graph tree's memory pool, where a vector kept past the call is an allocation
    the tree does not track (it raises "tensor(s) in the cudagraph pool not tracked as outputs")."""
    token = _NO_KEPT_ONES.set(True)
    try:
        yield
    finally:
        _NO_KEPT_ONES.reset(token)


def _ones(g: torch.Tensor, m: int) -> torch.Tensor:
    """m ones in g's dtype on g's device: a slice of the kept vector, made or grown where needed. A new
    vector, as before, while torch.compile, export or a dispatch mode (fake tensors) traces, for tensor
    subclasses (`direct_call`), while a CUDA graph captures, and inside `no_kept_ones()`."""
    if not direct_call((g,)) or _NO_KEPT_ONES.get():
        return g.new_ones(m)
    key = (g.device, g.dtype)
    ones = _ONES.get(key)
    if ones is not None and ones.shape[0] >= m:
        return ones[:m]
    if g.is_cuda and torch.cuda.is_current_stream_capturing():
        return g.new_ones(m)
    with torch.inference_mode(False):  # a normal tensor, usable outside inference mode too
        ones = torch.ones(max(4096, 1 << (m - 1).bit_length()), dtype=g.dtype, device=g.device)
    if g.is_cuda:
        torch.cuda.current_stream(g.device).synchronize()  # filled before another stream reads it
    _ONES[key] = ones
    return ones[:m]


def column_sums(g: torch.Tensor) -> torch.Tensor:
    """g [M, N] -> [N] (a bias gradient, or the sum of per-program float32 partials) as a matrix-vector
    product with ones: one read of g with float32 accumulation (cuBLAS gemv, which float32 matmul
    precision settings leave alone: no TF32). torch's column sum of a [65536, 128] bf16 matrix ran at
    ~250 GB/s in the H200 block profile, and of a [2112, 256] float32 one took ~9 us."""
    return torch.mv(g.t(), _ones(g, g.shape[0]))
