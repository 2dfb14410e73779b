"""hfkit's Triton kernels compile for Hopper (sm_90) without a GPU: tests/compile_sm90.py, run in a
subprocess because this test session runs the interpreter (TRITON_INTERPRET=1), whose kernels cannot
be compiled. Skipped where Triton has no NVIDIA backend."""

from __future__ import annotations

import re

from conftest import run_compiled_triton_script


def test_kernels_compile_for_hopper():
    done = run_compiled_triton_script("compile_sm90.py")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    found = re.search(r"compiled (\d+) kernels for sm_90", done.stdout)
    assert found and int(found.group(1)) >= 35, done.stdout
