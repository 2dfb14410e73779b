"""Data pipeline: parsers, features, MSA sampling, cropping, record store, preprocessing, datasets."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["openfold_test_data_dir"]


def openfold_test_data_dir() -> Path | None:
    """The OpenFold test-data folder (real AlphaFold inputs), or None where this machine has none.

    `HFKIT_OPENFOLD_TEST_DATA` if set, else `shared/data/openfold_test_data` beside the repository
    (where developers and CI have it). The files are never copied into the repository.
    """
    env = os.environ.get("HFKIT_OPENFOLD_TEST_DATA")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2].parent / "shared" / "data" / "openfold_test_data")
    return next((p for p in candidates if p.is_dir()), None)
