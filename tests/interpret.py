"""Triton kernels on a CPU: under the interpreter, which TRITON_INTERPRET=1 turns on only if it is
set before triton is imported at all (triton.language's own helpers are decorated at import), and
conftest.py imports transformers, which imports triton. So a kernel test module re-runs itself in
a fresh pytest process with it set:

    test_kernels_under_interpreter = rerun_under_interpreter(__file__)   # the parent's one test
    @interpreted                                                          # the child's tests
    def test_a_kernel(): ...
"""
import importlib.util
import os
import subprocess
import sys

import pytest
from parallel import at_once

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SHARD_ENV = "GRPO_TEST_SHARD"  # "k/n": a child runs every n-th test from the k-th (tests/conftest.py)
interpreted = pytest.mark.skipif(not INTERPRET, reason="runs in the module's TRITON_INTERPRET=1 child process")


def rerun_under_interpreter(path: str, slow: bool = True):
    """A test that re-runs the test module at `path` in a fresh process with TRITON_INTERPRET=1. `slow`
    (it starts a process: tests/conftest.py's fast subset leaves it out); tests/test_kernels_fast.py's
    is not, so that the fast subset runs a Triton kernel too. A slow one runs its module in two such
    processes at once, each every other test (SHARD_ENV): the interpreter runs one thread, and a
    2-core machine runs two of them in the time of one."""
    shards = 2 if slow else 1

    @pytest.mark.skipif(INTERPRET, reason="already under the interpreter")
    @pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
    def test_under_interpreter():
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        command = [sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider"]
        outs = at_once(*(lambda k=k: subprocess.run(command, capture_output=True, text=True, env={
            **env, **({SHARD_ENV: f"{k}/{shards}"} if shards > 1 else {})}) for k in range(shards)))
        for out in outs:
            print(out.stdout[-2000:])
            assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]
    return pytest.mark.slow(test_under_interpreter) if slow else test_under_interpreter
