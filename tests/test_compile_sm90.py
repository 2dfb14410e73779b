"""hfkit's Triton kernels compile for Hopper (sm_90) without a GPU: tests/compile_sm90.py, run in a
subprocess because this test session runs the interpreter (TRITON_INTERPRET=1), whose kernels cannot
be compiled. Skipped where Triton has no NVIDIA backend."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("compile_sm90.py")


def test_kernels_compile_for_hopper():
    pytest.importorskip("triton.backends.nvidia", reason="this Triton build has no NVIDIA backend")
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    found = re.search(r"compiled (\d+) kernels for sm_90", done.stdout)
    assert found and int(found.group(1)) >= 35, done.stdout
