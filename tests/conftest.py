"""Shared pytest setup: where Triton kernels run, a per-test seed, per-dtype tolerances, the `slow`
marker, and where the real AlphaFold inputs are.

Kernels are compiled where a CUDA device exists and run under Triton's CPU interpreter elsewhere;
`TRITON_INTERPRET=1` or `=0` set by the caller wins. The variable must be set before anything
imports triton or hfkit (Triton reads it when the `@triton.jit` kernels are defined), so this file
decides it before any other hfkit import; importing torch first does not import triton.
"""

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

from hfkit.data import openfold_test_data_dir  # noqa: E402

# Real AlphaFold inputs (mmCIF, a3m/Stockholm MSAs, hhr) from OpenFold's test data; never copied
# into the repository. Tests that need them skip with this reason where they are absent.
OPENFOLD_TEST_DATA = openfold_test_data_dir()
REAL_DATA_REASON = (
    "real AlphaFold inputs not found: point HFKIT_OPENFOLD_TEST_DATA at OpenFold's test data folder "
    "(openfold/tests/test_data: mmcifs/, alignments/), or place it at ../shared/data/openfold_test_data "
    "beside the repository (see README, 'Real inputs')"
)

# (rtol, atol) for comparing a fused op against its fp32-accumulating reference, by the dtype of the
# compared tensors: bf16 keeps 8 mantissa bits, fp16 11, fp32 24.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """Return `(rtol, atol)` for results computed in `dtype`."""
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype: no tolerance for {dtype}; known: {list(TOLERANCES)}")
    return TOLERANCES[dtype]


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, msg: str = ""
) -> None:
    """Assert `actual` ≈ `expected` with the tolerance of `dtype` (default: `expected.dtype`).

    Dtypes and devices must match as well; use in tests as `from conftest import assert_close`.
    """
    rtol, atol = tolerance(dtype or expected.dtype)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=msg or None)


def output_and_grads(fn, args, dy: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """`fn(*args)` on fresh leaf copies of `args` (None stays None), and its gradients with respect to
    every tensor argument, in order, for the output gradient `dy`."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in args]
    out = fn(*leaves)
    return out, torch.autograd.grad(out, [t for t in leaves if t is not None], dy)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long test (deselect with -m 'not slow')")
    config.addinivalue_line(
        "markers", "cuda: runs on a CUDA device (`pytest -m cuda` is the GPU subset; marked by name too)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The GPU subset: tests marked `cuda`, and every test whose name or parameters say cuda (the op
    # tests parametrize `device` over "cuda" where a device exists).
    for item in items:
        if "cuda" in item.nodeid.lower():
            item.add_marker(pytest.mark.cuda)


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """Seed torch's RNGs (CPU and CUDA) from the test's id: reproducible, yet different in each test."""
    value = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(value)
    return value


@pytest.fixture(scope="module")
def one_thread():
    """Run a test module's torch ops on one thread: small models on a busy 2-core machine run several
    times faster than with torch's default thread count, and timings stop depending on other jobs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def real_data(*parts: str) -> Path:
    """The path `parts` inside the real-input folder; skips the calling test (naming
    HFKIT_OPENFOLD_TEST_DATA) where that folder or the path is missing. Use as
    `from conftest import real_data`."""
    if OPENFOLD_TEST_DATA is None or not OPENFOLD_TEST_DATA.joinpath(*parts).exists():
        pytest.skip(REAL_DATA_REASON)
    return OPENFOLD_TEST_DATA.joinpath(*parts)


def run_compiled_triton_script(name: str) -> subprocess.CompletedProcess:
    """Run tests/<name> in a subprocess with TRITON_INTERPRET=0 (this session interprets; scripts that
    compile kernels or read their TTIR cannot), after skipping where Triton has no NVIDIA backend.
    Use as `from conftest import run_compiled_triton_script`."""
    pytest.importorskip("triton.backends.nvidia", reason="this Triton build has no NVIDIA backend")
    script = Path(__file__).with_name(name)
    env = dict(os.environ, TRITON_INTERPRET="0")
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
