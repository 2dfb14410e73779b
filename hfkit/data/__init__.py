"""Data pipeline: parsers, features, MSA sampling, cropping, record store, preprocessing, datasets."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hfkit.data.parsers import ParseError

__all__ = ["ParseError", "openfold_test_data_dir"]

# Names exported from submodules, imported on first access so that `import hfkit.data` stays light
# (the parsers pull in numpy; the package itself needs only the standard library).
_LAZY = {"ParseError": "hfkit.data.parsers"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hfkit.data' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def openfold_test_data_dir() -> Path | None:
    """The OpenFold test-data folder (real AlphaFold inputs), or None where this machine has none.

    `HFKIT_OPENFOLD_TEST_DATA` if set, else `shared/data/openfold_test_data` beside the repository
    (where developers and CI have it). The files are never copied into the repository.
    """
    env = os.environ.get("HFKIT_OPENFOLD_TEST_DATA")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2].parent / "shared" / "data" / "openfold_test_data")
    return next((p for p in candidates if p.is_dir()), None)
