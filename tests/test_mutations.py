"""Each loss option, patched out of grpo/loss.py (tests/mutations.py), makes tests/test_loss.py
or tests/test_trl_loss.py fail: proof that those tests check every option, not just that the code runs. A control run
without a patch passes, so the failures come from the patches."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mutations import BY_NAME
from parallel import at_once

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast subset leaves it out)

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def runs(request) -> dict:
    """name -> {code, out} of the loss tests under every patch this session's tests ask for, and of the
    control run (no patch). tests/mutants.py runs them, a fork each; two of it at once, each half the
    names (one thread each: a 2-core machine runs two in the time of one)."""
    names = [item.callspec.params["name"] for item in request.session.items
             if getattr(item, "originalname", "") == "test_removing_an_option_fails_a_test"] + ["control"]
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}

    def half(k):
        out = subprocess.run([sys.executable, str(HERE / "mutants.py"), *names[k::2]], capture_output=True,
                             text=True, cwd=HERE, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["name"]: r for rows in at_once(lambda: half(0), lambda: half(1)) for r in rows}


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_removing_an_option_fails_a_test(name, runs):
    r = runs[name]
    # exit code 1: tests ran and one failed (2 and above: an error in the run itself)
    assert r["code"] == 1, f"{name}: exit {r['code']}\n{r['out']}"
    assert " failed" in r["out"], r["out"]


def test_the_loss_tests_pass_unpatched_in_the_same_harness(runs):
    r = runs["control"]
    assert r["code"] == 0 and " passed" in r["out"], r["out"]
