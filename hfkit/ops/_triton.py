"""Where hfkit's Triton kernels run: the one dispatch rule every fused op shares.

Kernels run on CUDA tensors, and on CPU tensors when `TRITON_INTERPRET=1` (Triton's interpreter,
how the tests check kernels without a GPU) — except while `torch.compile` traces a CPU graph, where
each op's plain-torch reference is what Inductor compiles, and inside `reference_on_cpu()`, where CPU
tensors take the references although the interpreter is on. Without Triton installed, nothing runs it.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

try:
    import triton
    import triton.language as tl
    from torch._library.triton import is_wrap_triton_enabled
    from torch.library import triton_op, wrap_triton
    from triton.runtime.interpreter import InterpretedFunction

    try:  # Triton's runtime settings (launch hooks); without them every launch takes the JIT path
        from triton import knobs as _knobs
    except ImportError:  # pragma: no cover - older Triton
        _knobs = None

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on machines without Triton
    HAS_TRITON = False

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def launch_statically_under_compile() -> bool:
    """Let Inductor start hfkit's kernels (user-defined Triton kernels, to it) with its static CUDA
    launcher, as it starts its own, rather than through Triton's Python launcher: a compiled swapped
    block starts about 60 of them forward+backward, and the checkpointed af2_initial step compiled
    per block took 1041 instead of 1221 ms on the H200 (data/results/h200/model.json's note).
    Called once when hfkit's ops are imported. It sets Inductor's
    `static_launch_user_defined_triton_kernels` only while that is at its default, so a value the user
    set in code stays; `TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=0` in the environment
    turns it off (torch's environment override). Kernels the static launcher cannot take fall back to
    Triton's launcher inside Inductor. Returns the setting in force, False where torch lacks it."""
    import torch._inductor.config as inductor_config  # importing hfkit.ops loads Inductor anyway

    name = "static_launch_user_defined_triton_kernels"
    if not hasattr(inductor_config, name):  # pragma: no cover - torch before 2.8
        return False
    if inductor_config._is_default(name):
        setattr(inductor_config, name, True)
    return bool(getattr(inductor_config, name))


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


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for grid sizes on the host (`triton.cdiv` is a constexpr function object in recent
    Triton, several microseconds a call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for tile sizes on the host."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the interpreter runs programs one after
    another, so few persistent programs keep it quick)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNTS.get(index)
    if count is None:
        count = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


_SM_COUNTS: dict[int, int] = {}


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
    launch_statically_under_compile()

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


def _arg_key(arg: Any) -> Any:
    """What Triton specializes a kernel argument on, or finer: a tensor's dtype and 16-byte alignment;
    an int's value class (0, 1, divisible by 16, 32- or 64-bit); a float's type; constexprs by value."""
    kind = type(arg)
    if kind is not int:  # most arguments are plain ints (sizes, strides): straight to their key
        if isinstance(arg, torch.Tensor):
            return arg.dtype, arg.data_ptr() % 16 == 0
        if kind is bool or arg is None or not isinstance(arg, int):
            return float if isinstance(arg, float) else arg
    return arg in (0, 1), arg % 16 == 0, -(2**31) <= arg < 2**31, arg < 2**63


class BoundLaunch(NamedTuple):
    """One kernel bound to one specialization: `launch(grid, stream, args)` starts it.

    `names` are the kernel's keyword arguments this call site passes, in the kernel's parameter order
    after the positional ones; `defaults` the values of the parameters after those; `options` the
    launch options that are not parameters (num_warps, num_stages)."""

    launch: Callable[[tuple[int, int, int], int, tuple[Any, ...]], None]
    names: tuple[str, ...]
    defaults: tuple[Any, ...]
    options: dict[str, Any]


def bind_arguments(
    kernel: Any, n_args: int, meta: dict[str, Any]
) -> tuple[tuple[str, ...], tuple[Any, ...], dict[str, Any]]:
    """How a call `kernel[grid](*args, **meta)` with `n_args` positional arguments maps onto the
    kernel's parameters: (the meta names that fill the parameters after the positional ones, in
    order; the defaults of the parameters after those; the meta entries that are launch options,
    e.g. num_warps). Constexpr parameters must come by keyword (the bound launch tells calls apart by
    the meta's values, and by the positional arguments' `_arg_key` only). Raises ValueError naming
    the kernel and the parameter otherwise, or when a parameter has no value."""
    name = getattr(kernel.fn, "__name__", repr(kernel))
    params = list(inspect.signature(kernel.fn).parameters.values())
    for param in params[:n_args]:
        if "constexpr" in str(param.annotation):
            raise ValueError(f"{name}: pass the constexpr parameter {param.name!r} by keyword")
    names: list[str] = []
    defaults: list[Any] = []
    for param in params[n_args:]:
        if param.name in meta and not defaults:
            names.append(param.name)
        elif param.name in meta or param.default is inspect.Parameter.empty:
            raise ValueError(
                f"{name}: parameter {param.name!r} needs a value by keyword, before any defaulted one"
            )
        else:
            defaults.append(param.default)
    options = {k: v for k, v in meta.items() if k not in names}
    return tuple(names), tuple(defaults), options


def _hooked(hook: Any) -> bool:
    """Whether a Triton launch hook would call anything: set, and not an empty `HookChain` (Triton
    >= 3.4 always installs a chain, empty unless a profiler or user adds to it)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _compiled_launch(compiled: Any) -> Callable[[tuple[int, int, int], int, tuple[Any, ...]], None]:
    # The compiled kernel's own launcher, called as Triton's JIT calls it once its cache found the
    # kernel: grid, stream, function handle, packed metadata, launch metadata and Triton's launch
    # hooks (torch installs one, e.g. for its profiler), every argument.
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata

    def start(grid: tuple[int, int, int], stream: int, args: tuple[Any, ...]) -> None:
        enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
        if not _hooked(enter) and not _hooked(leave):
            # No hook would read the launch metadata: skip building it (the launcher skips None hooks).
            run(grid[0], grid[1], grid[2], stream, function, packed, None, None, None, *args)
            return
        metadata = compiled.launch_metadata(grid, stream, *args)
        run(grid[0], grid[1], grid[2], stream, function, packed, metadata, enter, leave, *args)

    return start


def _interpreted_launch(kernel: Any, options: dict[str, Any]) -> Callable[..., None]:
    def start(grid: tuple[int, int, int], stream: int, args: tuple[Any, ...]) -> None:
        kernel[grid](*args, **options)

    return start


# {id(kernel): {specialization key: BoundLaunch}}: by identity (a JITFunction hashes its source's
# cache key under a lock); the kernels are module-level and live as long as the process.
_BOUND: dict[int, dict[tuple, BoundLaunch]] = {}


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Launch a Triton kernel: `launch(kernel, grid, *args, **meta)` does what `kernel[grid](*args,
    **meta)` does, binding the launch once per specialization.

    While torch traces the call (`torch.compile`, the custom op's dispatch: `wrap_triton` is enabled)
    the kernel goes through `wrap_triton`, so Inductor sees it. Otherwise the first call with a given
    specialization (each argument's `_arg_key`, the meta values, the device) goes through Triton's JIT,
    which compiles or finds the kernel; later calls start that compiled kernel directly, skipping the
    JIT's per-call argument binding and cache lookup (Triton's launch hooks still run). Constexprs come
    by keyword (`bind_arguments`). Under the interpreter the bound launch calls the interpreted kernel
    with the same argument order, so the binding is exercised there too. Without Triton's runtime
    settings (`triton.knobs`, older Triton) every launch takes the JIT.
    """
    if wraps_launches():
        wrap_triton(kernel)[grid](*args, **meta)
        return
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    # Compiled or interpreted is fixed when Triton defines the kernel (TRITON_INTERPRET at import).
    cuda = not isinstance(kernel, InterpretedFunction)
    device = torch.cuda.current_device() if cuda else -1
    key = (device, *map(_arg_key, args), *meta.items())
    table = _BOUND.get(id(kernel))
    bound = table.get(key) if table is not None else None
    if bound is None:
        compiled = kernel[grid3](*args, **meta)
        if cuda and _knobs is None:
            return
        names, defaults, options = bind_arguments(kernel, len(args), meta)
        start = _compiled_launch(compiled) if cuda else _interpreted_launch(kernel, options)
        _BOUND.setdefault(id(kernel), {})[key] = BoundLaunch(start, names, defaults, options)
        return
    full = (*args, *[meta[name] for name in bound.names], *bound.defaults)
    bound.launch(grid3, torch._C._cuda_getCurrentRawStream(device) if cuda else 0, full)


class _DirectState(threading.local):
    """Per thread: whether a `TritonOp` runs its body directly (`TritonOp.__call__`)."""

    active = False


_DIRECT = _DirectState()


def wraps_launches() -> bool:
    """Whether `launch` goes through `wrap_triton`: while torch traces or dispatches the call (the
    custom op's own setting, `torch._library.triton.is_wrap_triton_enabled`), not inside a `TritonOp`
    body run directly (one thread-local flag: cheaper than torch's context manager on every call)."""
    return not _DIRECT.active and is_wrap_triton_enabled()


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


def _unwrapped_apply(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """`function.apply` without torch's Python wrapper around it, which binds arguments for a
    `setup_context` style Function and unwraps functorch's dead wrappers (~4 µs a call): neither
    applies to an old-style Function called outside functorch transforms (`direct_call`). Falls back
    to the wrapped `function.apply` where torch's classes differ from those of torch 2.11-2.13."""
    base = getattr(torch.autograd.function, "_SingleLevelFunction", None)
    if base is None or not issubclass(function, base):  # pragma: no cover - other torch versions
        return function.apply
    try:
        return super(base, function).apply  # the C++ apply: torch._C._FunctionBase.apply
    except AttributeError:  # pragma: no cover
        return function.apply


class TritonOp:
    """One hfkit op built on Triton kernels, callable two ways with the same semantics.

    `op` is the `torch.library.triton_op` custom op (`torch.ops.hfkit.<name>`): what torch.compile
    traces (Inductor sees the kernels), what `opcheck`, export and dispatch modes see. In eager mode
    with plain tensors, calling the `TritonOp` runs `body` directly instead, with autograd through a
    plain `autograd.Function` when `autograd` was given. The custom-op route costs hundreds of
    microseconds of Python per call on the H200 host (the dispatcher, the custom-op autograd wrapper
    and its per-call aliasing checks; data/results/h200/launch_overhead.json), more than many of
    these kernels take on the GPU. Both routes run the same body and the same backward. While a
    profiler records, calls take the custom op, so that they show as `hfkit::<name>` with shapes.
    """

    def __init__(self, name: str, body: Callable[..., Any], mutates_args: Any = ()) -> None:
        self.name = name
        self.body = body
        self.op = triton_op(f"hfkit::{name}", mutates_args=mutates_args)(body)
        self._function: type[torch.autograd.Function] | None = None
        self._apply: Callable[..., Any] | None = None

    def autograd(self, backward: Callable[..., Any], setup_context: Callable[..., None]) -> None:
        """Give the op a backward: `setup_context(ctx, inputs, output)` and `backward(ctx, *grads)`,
        registered on the custom op and used by the eager `autograd.Function`. `backward` should start
        its kernels through other `TritonOp`s (not `torch.ops.hfkit.*`, not `launch` itself) so that
        they take the direct route in eager mode."""
        torch.library.register_autograd(self.op, backward, setup_context=setup_context)
        body = self.body

        # Old-style forward(ctx, ...): an autograd.Function with a separate `setup_context` binds its
        # arguments through `inspect.signature` on every call (~25 µs on the H200 host).
        class _Eager(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, *args: Any) -> Any:
                output = body(*args)
                setup_context(ctx, args, output)
                return output

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                return backward(ctx, *grads)  # its launches are other TritonOps' calls

        _Eager.__name__ = _Eager.__qualname__ = f"{self.name}_function"
        self._function = _Eager
        self._apply = _unwrapped_apply(_Eager)

    def __call__(self, *args: Any) -> Any:
        # While a profiler records, the custom op runs: torch.profiler then shows the call as
        # `hfkit::<name>` with its input shapes (what notebook 03's census counts), at the custom op's
        # CPU cost; the kernels, and so the device times, are the same.
        if torch.compiler.is_compiling():
            # No state touched: Dynamo breaks the graph at a global mutation inside an
            # autograd.Function it traces (the fused ops' Functions call TritonOps in their forwards).
            return self.op(*args)
        direct = direct_call(args) and not torch.autograd._profiler_enabled()
        # The custom op's route clears the flag (a call inside a direct body meeting fake tensors, say):
        # torch's own setting then decides its launches.
        outer, _DIRECT.active = _DIRECT.active, direct
        try:
            if not direct:
                return self.op(*args)
            if self._apply is not None and torch.is_grad_enabled():
                return self._apply(*args)
            return self.body(*args)
        finally:
            _DIRECT.active = outer


def hfkit_op(name: str, mutates_args: Any = ()) -> Callable[[Callable[..., Any]], TritonOp]:
    """Decorator: `@hfkit_op("layer_norm_fwd")` over a body that starts its kernels with `launch`
    makes a `TritonOp` named `hfkit::layer_norm_fwd`."""

    def wrap(body: Callable[..., Any]) -> TritonOp:
        return TritonOp(name, body, mutates_args)

    return wrap


def rows_view(t: torch.Tensor, n: int) -> torch.Tensor:
    """t as [M, n] with unit stride along n: a view where t's rows are equally spaced (t dense, or a
    column slice of a wider tensor, its row stride then `stride(0)`), a dense copy otherwise."""
    t2 = t.reshape(-1, n)
    if t2.stride(1) != 1 and n > 1:
        t2 = t2.contiguous()
    return t2
