"""Runs the interpreter tests in a fresh process when this one cannot interpret.

Triton reads TRITON_INTERPRET when it is imported; in a whole-suite run another module may
have imported it first without the variable, and then tests/test_kernels.py and
tests/test_compute_interpret.py skip. This test runs them in a subprocess with the variable
set, so they are never silently lost.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.launch import interpreter_ready

INTERPRETER_TESTS = ["tests/test_kernels.py", "tests/test_compute_interpret.py"]
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(interpreter_ready(), reason="this process interprets: the tests ran here")
def test_interpreter_tests_in_a_fresh_process() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *INTERPRETER_TESTS]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]
