"""Runs tests/test_loss.py and tests/test_trl_loss.py once per loss mutation named on the command line
(tests/mutations.py; "control": no patch), each run in a forked copy of this process, which imported
torch, pytest and grpo.loss once: a run costs its tests, not a second of imports. The patch is applied in
the fork before the test modules are imported (they are imported in the fork only). Prints one JSON line
per run: its name, pytest's exit code and the end of its output (tests/test_mutations.py reads them).
Forking is safe here: one intra-op thread (OMP_NUM_THREADS=1, set by the caller) and no torch work done
before the fork."""
import json
import os
import sys
import tempfile

import pytest

import mutations

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = [os.path.join(HERE, "test_loss.py"), os.path.join(HERE, "test_trl_loss.py")]


def run(name: str) -> dict:
    with tempfile.TemporaryFile("w+") as log:
        pid = os.fork()
        if pid == 0:  # the fork: patch, test, leave without running the parent's exit handlers
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            stop = []
            if name != "control":
                mutations.apply(name)
                stop = ["-x"]  # a patched run ends at its first failure
            code = pytest.main([*FILES, *stop, "-q", "--noconftest", "-p", "no:cacheprovider"])
            sys.stdout.flush()
            os._exit(int(code))
        _, status = os.waitpid(pid, 0)
        log.seek(0)
        return {"name": name, "code": os.waitstatus_to_exitcode(status), "out": log.read()[-3000:]}


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(json.dumps(run(name)), flush=True)
