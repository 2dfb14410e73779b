"""Where hfkit's Triton kernels run: the one dispatch rule every fused op shares.

Kernels run on CUDA tensors, and on CPU tensors when `TRITON_INTERPRET=1` (Triton's interpreter,
how the tests check kernels without a GPU) — except while `torch.compile` traces a CPU graph, where
each op's plain-torch reference is what Inductor compiles, and inside `reference_on_cpu()`, where CPU
tensors take the references although the interpreter is on. Without Triton installed, nothing runs it.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

try:
    import triton
    import triton.language as tl
    from torch._library.triton import set_wrap_triton_enabled
    from torch.library import triton_op

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on machines without Triton
    HAS_TRITON = False

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """Whether Triton kernels are defined for the interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# True inside `reference_on_cpu()`: a context variable, so each thread and task has its own setting.
_REFERENCE_ON_CPU: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "hfkit_reference_on_cpu", default=False
)


@contextlib.contextmanager
def reference_on_cpu() -> Iterator[None]:
    """Inside this context, ops on CPU tensors run their plain-torch references even under
    `TRITON_INTERPRET=1` (the interpreter runs a model ~1000x slower: fine for checking a kernel, not
    for timing a model on CPU); CUDA tensors are unaffected. The previous setting comes back on exit,
    exceptions included."""
    token = _REFERENCE_ON_CPU.set(True)
    try:
        yield
    finally:
        _REFERENCE_ON_CPU.reset(token)


def triton_can_run(x: torch.Tensor) -> bool:
    """Whether a Triton kernel can take `x`: Triton present, a float32/bfloat16/float16 tensor on CUDA,
    or on the CPU under the interpreter outside `torch.compile` tracing and `reference_on_cpu()`."""
    if not HAS_TRITON or x.dtype not in TRITON_DTYPES:
        return False
    if x.is_cuda:
        return True
    if torch.compiler.is_compiling() or _REFERENCE_ON_CPU.get():
        return False
    return x.device.type == "cpu" and interpreting()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the interpreter runs programs one after
    another, so few persistent programs keep it quick)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def dot_mode(x: torch.Tensor) -> int:
    """The `DOT` constexpr `dot` takes for operands of x's dtype and device.

    0: bfloat16/float16 on the tensor cores. float32 on CUDA follows torch's float32 matmul precision:
    "highest" (torch's default) gives 3: three TF32 products per product on the tensor cores (each
    operand split into a TF32 head and a TF32 tail), accurate to about 1e-6 relative, where IEEE
    float32 `tl.dot` runs off the tensor cores several times slower than cuBLAS; "high" or "medium"
    give 4: one TF32 product, as torch's own matmuls then use. Under the interpreter float32 is 1
    (IEEE) and bfloat16 is 2 (upcast first: the interpreter cannot multiply bfloat16).
    """
    if x.dtype == torch.float32:
        if not x.is_cuda:
            return 1
        return 3 if torch.get_float32_matmul_precision() == "highest" else 4
    return 2 if x.dtype == torch.bfloat16 and not x.is_cuda else 0


if HAS_TRITON:

    @triton.jit
    def dot(a, b, DOT: tl.constexpr):
        # a @ b with float32 accumulation; DOT as `dot_mode` picks it. 2 upcasts first (products of
        # bfloat16 are exact in float32).
        if DOT == 2:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif DOT == 1:
            return tl.dot(a, b, input_precision="ieee")
        elif DOT == 3:
            return tl.dot(a, b, input_precision="tf32x3")
        elif DOT == 4:
            return tl.dot(a, b, input_precision="tf32")
        else:
            return tl.dot(a, b)


_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


def direct_call(args: tuple[Any, ...]) -> bool:
    """Whether an hfkit op called with `args` may run its Python body directly (eager, real tensors):
    not while torch.compile, export or functorch transforms trace or wrap the call, not under a
    `TorchDispatchMode` (fake tensors, flop counters), not on tensor subclasses. Those take the
    registered custom op through the dispatcher."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return False
    if _get_current_dispatch_mode() is not None:
        return False
    return all(type(a) in _PLAIN_TENSORS for a in args if isinstance(a, torch.Tensor))


class TritonOp:
    """One hfkit op built on Triton kernels, callable two ways with the same semantics.

    `op` is the `torch.library.triton_op` custom op (`torch.ops.hfkit.<name>`): what torch.compile
    traces (Inductor sees the kernels), what `opcheck`, export and dispatch modes see. In eager mode
    with plain tensors, calling the `TritonOp` runs `body` directly instead, with autograd through a
    plain `autograd.Function` when `autograd` was given. The custom-op route costs hundreds of
    microseconds of Python per call on the H200 host (the dispatcher, the custom-op autograd wrapper
    and its per-call aliasing checks; data/results/h200/launch_overhead.json), more than many of
    these kernels take on the GPU. Both routes run the same body and the same backward.
    """

    def __init__(self, name: str, body: Callable[..., Any], mutates_args: Any = ()) -> None:
        self.name = name
        self.body = body
        self.op = triton_op(f"hfkit::{name}", mutates_args=mutates_args)(body)
        self._function: type[torch.autograd.Function] | None = None

    def autograd(self, backward: Callable[..., Any], setup_context: Callable[..., None]) -> None:
        """Give the op a backward: `setup_context(ctx, inputs, output)` and `backward(ctx, *grads)`,
        registered on the custom op and used by the eager `autograd.Function`. `backward` should call
        other `TritonOp`s (not `torch.ops.hfkit.*`) so that it takes the direct route in eager mode."""
        torch.library.register_autograd(self.op, backward, setup_context=setup_context)
        body = self.body

        # Old-style forward(ctx, ...): an autograd.Function with a separate `setup_context` binds its
        # arguments through `inspect.signature` on every call (~25 µs on the H200 host).
        class _Eager(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, *args: Any) -> Any:
                with set_wrap_triton_enabled(False):
                    output = body(*args)
                setup_context(ctx, args, output)
                return output

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                return backward(ctx, *grads)

        _Eager.__name__ = _Eager.__qualname__ = f"{self.name}_function"
        self._function = _Eager

    def __call__(self, *args: Any) -> Any:
        if not direct_call(args):
            return self.op(*args)
        if self._function is not None and torch.is_grad_enabled():
            return self._function.apply(*args)
        with set_wrap_triton_enabled(False):
            return self.body(*args)


def hfkit_op(name: str, mutates_args: Any = ()) -> Callable[[Callable[..., Any]], TritonOp]:
    """Decorator: `@hfkit_op("layer_norm_fwd")` over a body that launches its kernels through
    `wrap_triton` makes a `TritonOp` named `hfkit::layer_norm_fwd`."""

    def wrap(body: Callable[..., Any]) -> TritonOp:
        return TritonOp(name, body, mutates_args)

    return wrap
