"""Where hfkit's Triton kernels run: the one dispatch rule every fused op shares.

Kernels run on CUDA tensors, and on CPU tensors when `TRITON_INTERPRET=1` (Triton's interpreter,
how the tests check kernels without a GPU) — except while `torch.compile` traces a CPU graph, where
each op's plain-torch reference is what Inductor compiles. Without Triton installed, nothing runs it.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on machines without Triton
    HAS_TRITON = False

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """Whether Triton kernels are defined for the interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_can_run(x: torch.Tensor) -> bool:
    """Whether a Triton kernel can take `x`: Triton present, a float32/bfloat16/float16 tensor on CUDA,
    or on the CPU under the interpreter outside `torch.compile` tracing."""
    if not HAS_TRITON or x.dtype not in TRITON_DTYPES:
        return False
    if x.is_cuda:
        return True
    if torch.compiler.is_compiling():
        return False
    return x.device.type == "cpu" and interpreting()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the interpreter runs programs one after
    another, so few persistent programs keep it quick)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def dot_mode(x: torch.Tensor) -> int:
    """The `DOT` constexpr `dot` takes for operands of x's dtype and device: 1 for float32 (full
    precision, no TF32), 2 for bfloat16 under the interpreter (which cannot multiply bfloat16), else 0."""
    if x.dtype == torch.float32:
        return 1
    return 2 if x.dtype == torch.bfloat16 and not x.is_cuda else 0


if HAS_TRITON:

    @triton.jit
    def dot(a, b, DOT: tl.constexpr):
        # a @ b with float32 accumulation. DOT 0: in the input dtype (bf16/fp16 tensor cores); 1:
        # float32 inputs at full precision (not TF32); 2: upcast first, for the interpreter, which
        # cannot multiply bfloat16 (products of bfloat16 are exact in float32).
        if DOT == 2:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif DOT == 1:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)
