"""bench/gpu_check.py's dry run, the part of the GPU check that runs on a CPU: every parity check and
figure on the tiny model, the table, the JSON report and the exit code; and --perturb, which breaks one
side of every parity check, must fail each of them and exit 1 (run as on a GPU, each part in its own
process). And the sampler check's rule for
near-ties, on fixed logits.

The two runs go in parallel, one thread each (the dry run is small and mostly Python). The passing
one runs the Triton kernels under TRITON_INTERPRET=1, the script's GPU branch for the kernels, as a
bare GPU box would: tqdm, transformers, tokenizers and flash_attn cannot be imported in it (a
sitecustomize on its PYTHONPATH blocks them, for any child it starts too); the perturbed one runs
the torch kernels, the branch a CPU without the interpreter takes.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast subset leaves it out)

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
PARITY_PARTS = {"kernels", "update", "sampler"}


BARE_BOX = ("tqdm", "transformers", "tokenizers", "flash_attn")  # what a box with torch and triton only lacks


def blocker(names: tuple) -> str:
    """A sitecustomize.py under which `names` cannot be imported, in the process and any child it starts."""
    return f"""import importlib.machinery, sys
class _BareBox:  # tests/test_gpu_check.py: these packages are absent here, as on a bare GPU box
    def find_spec(self, name, path=None, target=None):  # a spec with no file (torch._dynamo probes with
        if name.split(".")[0] in {names!r}:          # importlib.util.find_spec), whose import fails
            return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {{spec.name!r}} (blocked: a bare GPU box)", name=spec.name)
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, _BareBox())
"""


BLOCKER = blocker(BARE_BOX)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    (tmp / "bare").mkdir()
    (tmp / "bare" / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    bare = {"TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(tmp / "bare"), env.get("PYTHONPATH", "")])}
    procs = {}
    # the perturbed run also takes the GPU's default path: each part in its own process
    for name, flags, extra in (("ok", [], bare),
                               ("perturbed", ["--perturb", "--isolate"], {})):
        out = tmp / f"{name}.json"
        procs[name] = (subprocess.Popen([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *flags],
                                        env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True), out)
    results = {}
    for name, (p, out) in procs.items():
        stdout, stderr = p.communicate(timeout=600)
        results[name] = (p.returncode, stdout, stderr, json.loads(out.read_text()) if out.exists() else None)
    return results


def table_rows(stdout: str) -> list[list[str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| part | model | check or figure | value | target | result |"), lines[:1]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def test_the_bare_box_blocker_blocks(tmp_path):
    """The check above is only as good as its blocker: a child under it cannot import tqdm."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    probe = ("import importlib.util; assert importlib.util.find_spec('tqdm').origin is None\n"
             "try:\n    import tqdm\nexcept ImportError as e:\n    print(e)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0 and "blocked: a bare GPU box" in r.stdout, r.stderr[-500:]


def test_dry_run_passes(runs):
    rc, stdout, stderr, report = runs["ok"]
    assert rc == 0, stdout[-4000:] + stderr[-4000:]
    assert report["ok"] and report["dry_run"] and report["backend"] == "triton"  # TRITON_INTERPRET=1
    rows = report["rows"]
    assert {r["part"] for r in rows} == PARITY_PARTS | {"figures"}
    assert not [r for r in rows if r["status"] in ("fail", "error")]
    parity = [r for r in rows if r["part"] in PARITY_PARTS and r["status"] not in ("skip", "info")]
    assert len(parity) == 2 + 4 + 1 and all(r["status"] == "pass" for r in parity)  # T 1 and 0.9; 4; graphs
    assert [r["what"] for r in rows if r["status"] == "info" and r["part"] == "sampler"] == [
        "greedy bfloat16, cuda graphs vs eager SDPA: rows parted off a tie"]  # fp32 is checked, bf16 shown
    figures = " ".join(r["what"] for r in rows if r["part"] == "figures")
    for what in ("peak memory / naive", "time / naive", "decode tokens/s", "roofline", "generation share",
                 "update MFU", "preflight rollouts: measured peak / planned", "preflight update: measured peak"):
        assert what in figures, what
    preflight = [r for r in rows if r["what"].startswith("preflight")]
    assert all(0 < r["value"] < 2 and "planned" in r["note"] for r in preflight), preflight  # measured, not assumed
    # one table row per report row, in the same order, and the summary line
    table = table_rows(stdout)
    assert [(t[0], t[2], t[5]) for t in table] == [(r["part"], r["what"], r["status"]) for r in rows]
    summary = stdout.strip().splitlines()[-1]
    assert summary.startswith(f"gpu_check: {len(parity)}/{len(parity)} parity checks passed, 0 parts raised")


def test_perturbed_parity_fails(runs):
    rc, stdout, stderr, report = runs["perturbed"]
    assert rc == 1, stdout[-4000:] + stderr[-4000:]
    assert not report["ok"] and not report["partial"] and report["backend"] == "torch"
    # isolated: kernels, fused, decode kernels, attention launches, update, sampler, decode, rollout, preflight,
    # step
    assert stdout.count("== part ") == 10
    assert not [r for r in report["rows"] if r["status"] == "error"], stdout[-4000:]
    assert {r["part"] for r in report["rows"] if r["status"] == "fail"} == PARITY_PARTS
    assert any(t[5] == "fail" for t in table_rows(stdout))


def test_greedy_ties():
    """A row may part from the reference only where both tokens are within TIE_REL of the top logit
    (grpo.parity, the sampler check's rule)."""
    from grpo.parity import TIE_REL, greedy_rows

    class FixedLogits(torch.nn.Module):  # the same logits at every position
        def __init__(self):
            super().__init__()
            self.z = torch.nn.Parameter(torch.tensor([10.0, 9.9, 5.0, 1.0]))  # tokens 0 and 1: a near-tie

        def forward(self, ids):
            return self.z.expand(*ids.shape, -1)

    ref = [[0, 0, 0]] * 4
    out = [[0, 0, 0],   # equal
           [0, 1, 3],   # parts at a near-tie (10 vs 9.9), whatever follows
           [2, 0, 0],   # parts where the reference's top logit is far above the tested token's
           [0, 0]]      # shorter
    assert TIE_REL * 10 > 0.1
    assert greedy_rows(FixedLogits(), [[1]] * 4, ref, out) == (1, 1, 2)


def test_decode_profile_dry_run():
    """bench/decode_profile.py on the CPU's tiny model: its three timed variants and the profile."""
    script = SCRIPT.with_name("decode_profile.py")
    r = subprocess.run([sys.executable, str(script), "--dry-run"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("[{")))
    assert [(x["sync_every"], x["temperature"]) for x in rows] == [(8, 1.0), (32, 1.0), (8, 0.0)]
    assert all(x["decode_tok_s"] > 0 and x["decode_s"] > 0 for x in rows)
    assert "profiled call (sync_every 8, temperature 1): wall" in r.stdout


def test_it_starts_on_a_box_with_torch_and_triton_only(tmp_path):
    """A bare GPU box has torch and triton: the script must start (its imports, then --help) with
    every other dependency blocked (bench/sampler.py and bench/step.py imported transformers at the top)."""
    blocked = ("transformers", "tokenizers", "safetensors", "tqdm", "numpy", "yaml", "tensorboard", "math_verify")
    (tmp_path / "sitecustomize.py").write_text(blocker(blocked))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.startswith("usage: gpu_check.py"), r.stderr[-2000:]


def test_only_runs_the_named_parts(tmp_path):
    """--only: the named parts alone, also when each runs in its own process (which must pick the
    same part from the same shortened list); an unknown name is a usage error naming the parts."""
    out = tmp_path / "only.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--isolate", "--only", "rollout_figures,kernel_figures",
                        "--out", str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert r.stdout.count("== part ") == 2 and {x["part"] for x in rows} == {"figures"}
    assert any(x["what"].startswith("rollout of") for x in rows) and any("decode kernels" in x["what"] for x in rows)
    assert len(rows) == 3  # the rollout's two rows, the kernels' CUDA-only skip
    bad = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "not a part" in bad.stderr and "rollout_figures" in bad.stderr
