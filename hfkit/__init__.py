"""hfkit: fast AlphaFold-style (Evoformer) training and inference on GPUs.

Fused Triton ops (`hfkit.ops`), the plain Evoformer (`hfkit.model`), its fused drop-in modules and
one-line swapping (`hfkit.nn`, `hfkit.to_hfkit`, `hfkit.to_torch`), and the benchmark harness
(`hfkit.bench`).

`hfkit.to_hfkit` / `hfkit.to_torch` import `hfkit.nn` (and with it every fused module, so that every
swap is registered) on first access, so that `import hfkit.model` alone loads no Triton code.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "to_hfkit", "to_torch"]

_FROM_NN = ("to_hfkit", "to_torch")


def __getattr__(name: str) -> Any:
    """`to_hfkit` / `to_torch` from `hfkit.nn`, imported on first access (PEP 562)."""
    if name in _FROM_NN:
        value = getattr(importlib.import_module("hfkit.nn"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hfkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_FROM_NN})
