"""The input checks every fused op shares: tensors, their dtype family, device and shape, and eps.

Each raises a `ValueError` whose message starts with the argument's name, then says what was expected
and what was given, so that a wrong call fails at the op's boundary and never inside a kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "broadcasts_to",
    "check_eps",
    "check_float",
    "check_matmul_dtype",
    "check_no_autograd",
    "check_optional",
    "check_same_device",
    "describe",
]


def describe(x: object) -> str:
    """A short account of x for an error message: shape, dtype and device of a tensor, else its type."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)}, dtype {x.dtype} on {x.device}"
    return f"a {type(x).__name__}"


def check_float(name: str, t: object, dims: int | None = None) -> None:
    """`t` is a real floating-point tensor (float16/bfloat16/float32/float64), with `dims` dims if given."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {describe(t)}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating-point dtype, got {t.dtype}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name}: expected a {dims}-d tensor, got shape {list(t.shape)}")


def check_no_autograd(op: str, *tensors: torch.Tensor | None) -> None:
    """An in-place inference op (`op`) gets no autograd: RuntimeError where grad mode is on and one of
    `tensors` (None skipped) requires grad."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(
            f"{op} updates its output in place without autograd: call it under torch.no_grad()"
        )


def check_same_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """`t` lives on `ref`'s device."""
    if t.device != ref.device:
        raise ValueError(f"{name}: on {t.device}, but {ref_name} is on {ref.device}; put them on one device")


def check_optional(
    name: str,
    t: object,
    shape: Sequence[int] | None,
    ref_name: str,
    ref: torch.Tensor,
    *,
    floating: bool = True,
) -> None:
    """`t` is None or a tensor on `ref`'s device, of exactly `shape` (when given), floating-point when
    `floating` (a mask may be bool or any real dtype: then only complex is refused)."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor or None, got {describe(t)}")
    if floating and not t.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating-point dtype, got {t.dtype}")
    if not floating and t.dtype.is_complex:
        raise ValueError(f"{name}: expected a bool or real dtype, got {t.dtype}")
    check_same_device(name, t, ref_name, ref)
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")


def check_matmul_dtype(name: str, t: torch.Tensor | None, dtype: torch.dtype, device_type: str) -> None:
    """`t` (None, or a weight, bias or operand multiplied with activations of `dtype`) has that dtype,
    as `nn.Linear` needs, unless autocast is on for `device_type`, which casts every operand."""
    # The dtype compare first: the common case returns without asking autocast (a call into torch).
    if t is None or t.dtype == dtype or torch.is_autocast_enabled(device_type):
        return
    raise ValueError(
        f"{name}: expected dtype {dtype} (the activations'; or run under torch.autocast), got {t.dtype}"
    )


def broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether a tensor of `shape` broadcasts to `target` (aligned on the right, no more dims)."""
    if len(shape) > len(target):
        return False
    trailing = list(target)[len(target) - len(shape) :]
    return all(s in (1, t) for s, t in zip(shape, trailing, strict=True))


def check_eps(eps: object) -> None:
    """`eps` is a finite non-negative number."""
    if isinstance(eps, bool) or not (isinstance(eps, (int, float)) and eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"eps: expected a finite non-negative number, got {eps!r}")
