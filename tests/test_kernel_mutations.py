"""torch.compile's view of what each hfkit Triton launch writes matches what the ops declare:
tests/kernel_mutations.py, run in a subprocess (it needs TTIR, so TRITON_INTERPRET=0, while this
session interprets). A false "write" of an input makes compiled code copy stale data back into it.
Skipped where Triton has no NVIDIA backend."""

from __future__ import annotations

import re

from conftest import run_compiled_triton_script


def test_compile_sees_no_kernel_writing_an_input():
    done = run_compiled_triton_script("kernel_mutations.py")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    found = re.search(r"checked (\d+) launches of (\d+) kernels", done.stdout)
    assert found and int(found.group(2)) >= 18, done.stdout
