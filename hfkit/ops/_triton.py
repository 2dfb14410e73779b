"""Where hfkit's Triton kernels run: the one dispatch rule every fused op shares.

Kernels run on CUDA tensors, and on CPU tensors when `TRITON_INTERPRET=1` (Triton's interpreter,
how the tests check kernels without a GPU) — except while `torch.compile` traces a CPU graph, where
each op's plain-torch reference is what Inductor compiles. Without Triton installed, nothing runs it.
"""

from __future__ import annotations

import os

import torch

try:
    import triton  # noqa: F401

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
