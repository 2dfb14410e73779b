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


# Rows from which `rows_linear` splits a linear with a bias into chunks of this many rows: cuBLAS runs
# F.linear(x, w, b) on x [4096 * 4096, 128], w [128, 128] (bf16, H200) in 3.9 ms with its bias
# epilogue, in 2.4 ms as 2**20-row chunks (the time of the product without a bias); chunks of 2**22
# rows were 3.9 ms again (.gpu diagnostics, not a benchmark).
LINEAR_CHUNK_ROWS = 1 << 20
# Outputs below which `rows_linear` pads the weight with zero rows to this many: x [4096 * 4096, 128]
# times a [4, 128] weight (triangle attention's bias projection) took 2.5 ms, times [8, 128] 1.2 ms.
LINEAR_MIN_OUTPUTS = 8


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, steered around two slow cuBLAS choices on many rows (more than
    `LINEAR_CHUNK_ROWS`): with a bias, the rows run in chunks of `LINEAR_CHUNK_ROWS` into one output;
    with fewer than `LINEAR_MIN_OUTPUTS` outputs, the weight is padded with zero rows and the result
    sliced back (a dense copy). Other calls, operands of mixed dtypes, a non-contiguous x and calls
    that torch.compile traces are F.linear's. Same values either way (each row the same products)."""
    k, n_out = x.shape[-1], weight.shape[0]
    rows = x.numel() // max(k, 1)
    same = x.dtype == weight.dtype and (bias is None or bias.dtype == x.dtype)
    if rows <= LINEAR_CHUNK_ROWS or not same or not x.is_contiguous() or torch.compiler.is_compiling():
        return torch.nn.functional.linear(x, weight, bias)
    if n_out < LINEAR_MIN_OUTPUTS:
        pad = weight.new_zeros(LINEAR_MIN_OUTPUTS - n_out, k)
        padded_bias = None if bias is None else torch.cat([bias, bias.new_zeros(LINEAR_MIN_OUTPUTS - n_out)])
        wide = rows_linear(x, torch.cat([weight, pad]), padded_bias)
        return wide[..., :n_out].contiguous()
    if bias is None:
        return torch.nn.functional.linear(x, weight, bias)
    x2 = x.view(rows, k)
    out = torch.empty((rows, n_out), dtype=x.dtype, device=x.device)
    w_t = weight.t()
    for start in range(0, rows, LINEAR_CHUNK_ROWS):
        stop = min(start + LINEAR_CHUNK_ROWS, rows)
        torch.addmm(bias, x2[start:stop], w_t, out=out[start:stop])
    return out.view(*x.shape[:-1], n_out)
