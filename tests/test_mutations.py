"""Each loss option, patched out of grpo/loss.py (tests/mutations.py), makes tests/test_loss.py
or tests/test_trl_loss.py fail: proof that those tests check every option, not just that the code runs. A control run
without a patch passes, so the failures come from the patches."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mutations import BY_NAME

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast subset leaves it out)

HERE = Path(__file__).parent
FILES = [str(HERE / "test_loss.py"), str(HERE / "test_trl_loss.py")]  # the tests each patch must fail


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_removing_an_option_fails_a_test(name):
    # a child process: patch grpo.loss first, then let test_loss.py import it (no conftest: it
    # needs none, and importing transformers would double the time)
    script = (f"import sys, pytest, mutations; mutations.apply({name!r}); "
              f"sys.exit(pytest.main([*{FILES!r}, '-x', '-q', '--noconftest', "
              f"'-p', 'no:cacheprovider']))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=HERE,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))})
    # exit code 1: tests ran and one failed (2 and above: an error in the run itself)
    assert out.returncode == 1, f"{name}: exit {out.returncode}\n{out.stdout[-3000:]}{out.stderr[-2000:]}"
    assert " failed" in out.stdout, out.stdout[-3000:]


def test_the_loss_tests_pass_unpatched_in_the_same_harness():
    script = (f"import sys, pytest; sys.exit(pytest.main([*{FILES!r}, '-q', "
              f"'--noconftest', '-p', 'no:cacheprovider']))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=HERE,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
