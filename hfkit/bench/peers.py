"""Peer kernel libraries the benchmarks compare against, imported only if present: trifast and cuEquivariance.

Neither is a dependency of hfkit. Each loader returns `(functions, None)` when the library imports and
can run on the device, else `(None, reason)` with a reason fit for a log line and a results file
("not installed", "needs a CUDA device", the import error). Both need a CUDA device: trifast reads the
GPU's name when it is imported, and cuEquivariance's kernels are CUDA binaries.

- trifast (PyPI `trifast`): `triangle_attention(q, k, v, b, mask)` with q/k/v [B, H, N, N, D], bias
  [B, H, N, N] and a boolean mask [B, N, N] whose True entries are *masked* (its kernels do
  `where(mask, -inf, scores)`); the query-row count must equal N (its grid walks N rows).
- cuEquivariance (PyPI `cuequivariance-torch` + `cuequivariance-ops-torch-cu13`):
  `triangle_attention(q, k, v, bias, mask, scale)` with q/k/v [B, S, H, Q, D], bias [B, 1, H, Q, K]
  (float32 for the Hopper kernels), boolean mask [B, S, 1, 1, K] with True = *keep*; and
  `triangle_multiplicative_update(x, direction, mask, norm_in_weight, ...)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache
from typing import NamedTuple

import torch

__all__ = ["CueqFunctions", "PEERS", "load_cuequivariance", "load_trifast", "peer_status"]

PEERS = ("trifast", "cuequivariance")


class CueqFunctions(NamedTuple):
    """cuEquivariance's two Evoformer ops."""

    triangle_attention: Callable[..., torch.Tensor]
    triangle_multiplicative_update: Callable[..., torch.Tensor]


def _device_reason(device: torch.device | str) -> str | None:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"needs a CUDA device (running on {device.type})"
    return None


def _import_reason(err: BaseException, package: str, pip_name: str) -> str:
    if isinstance(err, ModuleNotFoundError) and err.name and err.name.split(".")[0] == package:
        return f"not installed (pip install {pip_name})"
    text = " ".join(str(err).split())[:200]
    return f"import failed ({type(err).__name__}: {text})"


@cache
def _trifast() -> tuple[Callable[..., torch.Tensor] | None, str | None]:
    try:
        module = importlib.import_module("trifast")
    except Exception as err:  # noqa: BLE001 - any import failure (a missing dependency too) is a reason
        return None, _import_reason(err, "trifast", "trifast")
    return module.triangle_attention, None


@cache
def _cueq() -> tuple[CueqFunctions | None, str | None]:
    try:
        importlib.import_module("cuequivariance_ops_torch")
        module = importlib.import_module("cuequivariance_torch")
    except Exception as err:  # noqa: BLE001 - any import failure (a missing CUDA library too) is a reason
        package = getattr(err, "name", None) or "cuequivariance_torch"
        pip_name = (
            "cuequivariance-ops-torch-cu13"
            if package.startswith("cuequivariance_ops")
            else "cuequivariance-torch"
        )
        return None, _import_reason(err, package.split(".")[0], pip_name)
    return CueqFunctions(module.triangle_attention, module.triangle_multiplicative_update), None


def load_trifast(device: torch.device | str) -> tuple[Callable[..., torch.Tensor] | None, str | None]:
    """trifast's `triangle_attention`, or None and why it cannot run on `device`."""
    reason = _device_reason(device)
    return (None, reason) if reason else _trifast()


def load_cuequivariance(device: torch.device | str) -> tuple[CueqFunctions | None, str | None]:
    """cuEquivariance's triangle attention and triangle multiplication, or None and why not."""
    reason = _device_reason(device)
    return (None, reason) if reason else _cueq()


def peer_status(device: torch.device | str) -> dict[str, str]:
    """Each peer's state on `device`: "available" or the reason it is not (for results files)."""
    status = {}
    for name, load in (("trifast", load_trifast), ("cuequivariance", load_cuequivariance)):
        fn, reason = load(device)
        status[name] = "available" if fn is not None else str(reason)
    return status
