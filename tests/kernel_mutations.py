"""Which tensors torch.compile believes each hfkit Triton launch writes, checked on a CPU machine.

Inductor decides what a user Triton kernel writes by walking the kernel's TTIR
(`torch._higher_order_ops.triton_kernel_wrap`), and it copies every tensor it believes written back
into that tensor's owner after the kernel. A false positive on an input (a weight, a saved
activation) therefore makes compiled code overwrite that input, silently. This happened: a helper
that took the weight pointers also returned the tile indices used in store addresses, so the weights
of `triangle_multiplication` were "written", and a compiled backward corrupted them.

This script runs every hfkit custom op forward and backward on small CPU tensors with the Triton path
forced on and each launch recorded instead of run, then asks torch's own analysis (TTIR built for
sm_90, no GPU needed) which arguments each launch writes. A written argument that shares storage with
an input of the custom op being run, and is not declared in the op's `mutates_args`, is an error.
Run with TRITON_INTERPRET=0 (the analysis needs compiled, not interpreted, kernels); it prints
"checked N launches" and exits non-zero on any error.
"""

from __future__ import annotations

import os
import sys
from typing import Any

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("kernel_mutations: run with TRITON_INTERPRET=0 (the analysis needs TTIR)")

import torch  # noqa: E402
import triton  # noqa: E402
from torch._higher_order_ops import triton_kernel_wrap as tkw  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import hfkit.ops  # noqa: E402, F401  (registers every op)
from hfkit.ops._triton import TRITON_DTYPES  # noqa: E402

MODULES = [
    sys.modules[f"hfkit.ops.{name}"]
    for name in (
        "layer_norm",
        "softmax",
        "evoformer_attention",
        "triangle_multiplication",
        "elementwise",
        "gated_linear",
    )
]


class _Hopper:
    """The one driver method the TTIR builder asks for: the target to build for."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


def _storages(values: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_leaves(values) if isinstance(t, torch.Tensor)}


class _Ops(TorchDispatchMode):
    """Tracks the hfkit custom op being run: its input storages and the arguments it may mutate."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[tuple[str, set[int], set[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "hfkit":
            return func(*args, **kwargs)
        schema = func._schema
        bound = dict(zip([a.name for a in schema.arguments], args, strict=False)) | kwargs
        mutable = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        inputs = _storages([v for k, v in bound.items() if k not in mutable])
        self.stack.append((str(func), inputs, _storages([bound[k] for k in mutable if k in bound])))
        try:
            return func(*args, **kwargs)
        finally:
            self.stack.pop()


LAUNCHES: list[tuple[str, Any, dict[str, Any], set[int], set[int]]] = []


def _recording_launch(ops: _Ops):
    """A stand-in for `hfkit.ops._triton.launch` that records each launch instead of running it."""

    def launch(kernel, grid, *args, **kwargs):
        op, inputs, mutable = ops.stack[-1] if ops.stack else ("<no op>", set(), set())
        named = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
        LAUNCHES.append((op, kernel, named, inputs, mutable))

    return launch


def written_args(kernel, kwargs: dict[str, Any]) -> list[str]:
    """The argument names torch's analysis says the launch writes (across torch versions)."""
    if hasattr(tkw, "identify_accessed_tensors"):
        accesses = tkw.identify_accessed_tensors(kernel, dict(kwargs), {})
        return [dep.name for dep in accesses.read_writes.writes]
    return list(tkw.identify_mutated_tensors(kernel, dict(kwargs), {}))


def drive() -> None:
    """Every op's forward and backward on small inputs (outputs are garbage: nothing is launched)."""
    f32, bf16 = torch.float32, torch.bfloat16
    r = lambda *s, dtype=bf16: torch.randn(*s, dtype=dtype, requires_grad=True)  # noqa: E731
    from hfkit.ops import (
        bias_dropout_add,
        evoformer_attention,
        gated_linear_add_,
        layer_norm,
        row_scale_add_,
        sigmoid_gate,
        softmax,
        triangle_multiplication,
    )

    def backward(out: torch.Tensor) -> None:
        out.float().sum().backward()

    backward(layer_norm(r(6, 40), (40,), r(40, dtype=f32), r(40, dtype=f32)))
    backward(softmax(r(2, 3, 5, 24), r(1, 3, 5, 24), torch.rand(2, 1, 1, 24) > 0.2))
    for bias in (True, False):
        q, k, v = r(1, 3, 2, 40, 32), r(1, 3, 2, 40, 32), r(1, 3, 2, 40, 32)
        pair = r(1, 1, 2, 40, 40) if bias else None
        backward(evoformer_attention(q, k, v, pair, torch.rand(1, 3, 1, 1, 40) > 0.2))
    c_z, c_h, n = 32, 16, 9
    params = [r(c_z, dtype=f32), r(c_z, dtype=f32), r(4 * c_h + c_z, c_z), r(4 * c_h + c_z)]
    params += [r(c_h, dtype=f32), r(c_h, dtype=f32), r(c_z, c_h), r(c_z)]
    for fuse in (True, False):
        for outgoing in (True, False):
            z, mask = r(1, n, n, c_z), torch.rand(1, n, n) > 0.2
            backward(triangle_multiplication(z, mask, *params, outgoing=outgoing, fuse_projection=fuse))
    backward(sigmoid_gate(r(4, 7, 16), r(4, 7, 16), r(16)))
    backward(bias_dropout_add(r(4, 7, 16), r(4, 7, 16), r(16), p=0.25, training=True, shared_dim=0))
    # The in-place inference ops (no autograd): z is their declared mutation, nothing else is written.
    d = lambda *s, dtype=bf16: torch.randn(*s, dtype=dtype)  # noqa: E731
    with torch.no_grad():
        frozen = [p.detach() for p in params]
        triangle_multiplication(d(1, n, n, c_z), torch.rand(1, n, n) > 0.2, *frozen, add_to_z=True)
        gated_linear_add_(d(4, 7, 16), d(4, 7, 32), d(4, 7, 32), d(16, 32), d(16))
        row_scale_add_(d(4, 7, 16), d(4, 7, 16), d(4, 7, 1) + 3, divide=True)


def main() -> int:
    triton.runtime.driver.set_active(_Hopper())
    ops = _Ops()
    for module in MODULES:
        module.triton_can_run = lambda x: x.dtype in TRITON_DTYPES
        module.launch = _recording_launch(ops)
    with ops:
        drive()
    errors = []
    kernels = set()
    for op, kernel, named, inputs, mutable in LAUNCHES:
        kernels.add(kernel.fn.__name__)
        for name in written_args(kernel, named):
            t = named.get(name)
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in inputs and ptr not in mutable:
                errors.append(f"{op}: {kernel.fn.__name__} is believed to write its input `{name}`")
    for e in sorted(set(errors)):
        print("ERROR", e)
    print(f"checked {len(LAUNCHES)} launches of {len(kernels)} kernels: {sorted(kernels)}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
