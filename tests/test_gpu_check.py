"""bench/gpu_check.py's dry run, the part of the GPU check that runs on a CPU: every parity check and
figure on the tiny model, the table, the output folder (each part's rows, the report) and the exit code;
--perturb, which breaks one side of every parity check, must fail each of them and exit 1; a worker
that dies after a part's rows (as in NCCL's teardown) keeps them, and one that hangs is stopped at the
part's time limit, a fresh worker going on with the next part. And the rules grpo/measure/parity.py judges by.

The two dry runs go in parallel, one thread each (they are small and mostly Python). The passing one
runs as a bare GPU box would: from a copy of the tree that was never installed (no editable finder),
the Triton kernels under TRITON_INTERPRET=1 (the script's GPU branch for the kernels), and tqdm,
transformers, tokenizers, flash_attn and setuptools not importable (a sitecustomize on its PYTHONPATH
blocks them, for any child it starts too); the perturbed one runs the torch kernels, the branch a CPU
without the interpreter takes, from the checkout.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

slow = pytest.mark.slow  # starts processes (tests/conftest.py: the fast subset leaves it out)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"
PARITY_PARTS = {"kernels", "sampling", "decode kernels", "update", "sampler", "tool turns", "lora"}
PARTS = 15  # env, 7 parity, decode figures, steps, rollout, preflight, fused, decode kernels' times, launches


BARE_BOX = ("tqdm", "transformers", "tokenizers", "flash_attn", "setuptools")  # what a box with torch and triton lacks


def blocker(names: tuple) -> str:
    """A sitecustomize.py under which `names` cannot be imported, in the process and any child it starts,
    and no editable install's finder maps grpo anywhere (a clone that was never installed)."""
    return f"""import importlib.machinery, sys
class _BareBox:  # tests/test_gpu_check.py: these packages are absent here, as on a bare GPU box
    def find_spec(self, name, path=None, target=None):  # a spec with no file (torch._dynamo probes with
        if name.split(".")[0] in {names!r}:          # importlib.util.find_spec), whose import fails
            return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {{spec.name!r}} (blocked: a bare GPU box)", name=spec.name)
    def exec_module(self, module):
        pass
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in getattr(h, "__module__", "")]
sys.path_importer_cache.clear()
sys.meta_path.insert(0, _BareBox())
"""


BLOCKER = blocker(BARE_BOX)


def never_installed_copy(dest: Path) -> Path:
    """The folders a GPU run needs, copied without caches or earlier output: not on any install's path."""
    for folder in ("grpo", "kernels", "envs", "bench"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__", "gpu_out"))
    return dest / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    (tmp / "bare").mkdir()
    (tmp / "bare" / "sitecustomize.py").write_text(BLOCKER)
    copy = never_installed_copy(tmp / "clone")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    bare = {"TRITON_INTERPRET": "1", "PYTHONPATH": str(tmp / "bare")}  # a clean path: only the blocker
    procs = {}
    # the perturbed run also kills its worker after the sampling part's rows, as a teardown that dies would
    for name, script, flags, extra in (("ok", copy, [], bare),
                                       ("perturbed", SCRIPT, ["--perturb", "--crash-after", "sampling_parity"], {})):
        out = tmp / name
        procs[name] = (subprocess.Popen([sys.executable, str(script), "--dry-run", "--out", str(out), *flags],
                                        env={**env, **extra}, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True), out)
    results = {}
    for name, (p, out) in procs.items():
        stdout, stderr = p.communicate(timeout=600)
        report = out / "report.json"
        results[name] = (p.returncode, stdout, stderr, json.loads(report.read_text()) if report.exists() else None, out)
    results["clone"] = copy.parents[1]
    return results


def table_rows(stdout: str) -> list[list[str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| part | model | check or figure | value | target | result |"), lines[:1]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


@slow
def test_the_bare_box_blocker_blocks(tmp_path):
    """The check above is only as good as its blocker: a child under it cannot import tqdm or setuptools."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    probe = ("import importlib.util; assert importlib.util.find_spec('tqdm').origin is None\n"
             "for name in ('tqdm', 'setuptools'):\n"
             "    try:\n        __import__(name)\n    except ImportError as e:\n        print(e)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0 and r.stdout.count("blocked: a bare GPU box") == 2, r.stderr[-500:]


@slow
def test_dry_run_passes(runs):
    rc, stdout, stderr, report, out = runs["ok"]
    assert rc == 0, stdout[-4000:] + stderr[-4000:] + (out / "log.txt").read_text()[-4000:]
    assert report["ok"] and report["dry_run"] and report["backend"] == "triton"  # TRITON_INTERPRET=1
    env = report["env"]  # the never-installed copy's own grpo and kernels, the bare box's packages
    assert env["grpo"].startswith(str(runs["clone"])) and f"kernels from {runs['clone'] / 'kernels'}" in env["grpo"]
    for name in BARE_BOX:
        assert f"{name} no" in env["optional packages"], env
    assert "mm out_dtype=float32" in env
    rows = report["rows"]
    assert {r["part"] for r in rows} == PARITY_PARTS | {"figures", "env"}
    assert not [r for r in rows if r["status"] in ("fail", "error")]
    parity = [r for r in rows if r["part"] in PARITY_PARTS and r["status"] not in ("skip", "info")]
    counts = {p: sum(r["part"] == p for r in parity) for p in PARITY_PARTS}
    # T 1 and 0.9; 4 draws x 2 dtypes + the fused kernel's 2 x 2 + 2 distributions; 9 outputs + attention;
    # 4; greedy fp32 (graphs); tool turns 2 x 2 dtypes; LoRA 4 + its decode gap and whether it sees the step
    assert counts == {"kernels": 2, "sampling": 14, "decode kernels": 10, "update": 4, "sampler": 1, "tool turns": 4,
                      "lora": 6}, counts
    assert all(r["status"] == "pass" for r in parity)
    assert [r["what"] for r in rows if r["status"] == "info" and r["part"] == "sampler"] == [
        "greedy bfloat16, cuda graphs vs eager SDPA: rows parted off a tie"]  # fp32 is checked, bf16 shown
    figures = " ".join(r["what"] for r in rows if r["part"] == "figures")
    for what in ("peak memory / naive", "time / naive", "decode tokens/s", "decode floors, ms/step: bandwidth / compute",
                 "over its binding floor", "generation share", "update MFU", "preflight rollouts: measured peak / planned",
                 "preflight update: measured peak", "preflight step: measured peak"):
        assert what in figures, what
    preflight = [r for r in rows if r["what"].startswith("preflight")]
    assert all(0 < r["value"] < 2 and "planned" in r["note"] for r in preflight), preflight  # measured, not assumed
    # every part's rows in the output folder, done; one table row per report row, in the same order
    assert len(list((out / "parts").glob("*.json"))) == PARTS and stdout.count("== part ") == PARTS
    assert all(json.loads(f.read_text())["done"] for f in (out / "parts").glob("*.json"))
    assert (out / "table.md").read_text().strip() == "\n".join(
        line for line in stdout.splitlines() if line.startswith("| "))
    table = table_rows(stdout)
    assert [(t[0], t[2], t[5]) for t in table] == [(r["part"], r["what"], r["status"]) for r in rows]
    summary = stdout.strip().splitlines()[-1]
    assert summary.startswith(f"gpu_check: {len(parity)}/{len(parity)} parity checks passed, 0 parts raised")


@slow
def test_perturbed_parity_fails_and_a_dead_worker_keeps_its_rows(runs):
    rc, stdout, stderr, report, out = runs["perturbed"]
    assert rc == 1, stdout[-4000:] + stderr[-4000:]
    assert not report["ok"] and not report["partial"] and report["backend"] == "torch"
    assert stdout.count("== part ") == PARTS
    rows = report["rows"]
    assert {r["part"] for r in rows if r["status"] == "fail"} == PARITY_PARTS
    assert any(t[5] == "fail" for t in table_rows(stdout))
    # the worker killed after the sampling part's rows: they are kept, the death is said, the next parts ran
    sampling = [r for r in rows if r["part"] == "sampling"]
    assert [r["status"] for r in sampling] == ["fail"] * (len(sampling) - 1) + ["error"] and len(sampling) > 8
    assert "died (signal 9) after this part's rows were written" in sampling[-1]["note"]
    assert [r for r in rows if r["status"] == "error"] == sampling[-1:], stdout[-4000:]
    assert any(r["part"] == "decode kernels" for r in rows) and any(r["part"] == "lora" for r in rows)


@slow
def test_a_hung_part_is_stopped_and_the_next_runs(tmp_path):
    """A part that never returns is killed at its time limit; a fresh worker runs the parts after it."""
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", "kernel_parity,sampling_parity",
                        "--hang-in", "kernel_parity", "--part-timeout", "3", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    hung = [x for x in rows if x["part"] == "kernels"]
    assert len(hung) == 1 and hung[0]["status"] == "error" and "timed out after" in hung[0]["note"]
    assert [x["status"] for x in rows if x["part"] == "sampling"] == ["pass"] * 10


def test_greedy_ties():
    """A row may part from the reference only where both tokens are within TIE_REL of the top logit
    (grpo.measure.parity, the sampler check's rule)."""
    from grpo.measure.parity import TIE_REL, greedy_rows

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


@slow
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


@slow
def test_it_starts_on_a_box_with_torch_and_triton_only(tmp_path):
    """A bare GPU box has torch and triton: the script must start (its imports, then --help) with
    every other dependency blocked (bench/sampler.py and bench/step.py imported transformers at the top)."""
    blocked = ("transformers", "tokenizers", "safetensors", "tqdm", "numpy", "yaml", "tensorboard", "math_verify",
               "setuptools")
    (tmp_path / "sitecustomize.py").write_text(blocker(blocked))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.startswith("usage: gpu_check.py"), r.stderr[-2000:]


@slow
def test_only_runs_the_named_parts(tmp_path):
    """--only: the named parts alone (and the environment's), each in the same worker's list of parts as
    the supervisor's; an unknown name is a usage error naming the parts."""
    r = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", "rollout_figures,kernel_figures",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert r.stdout.count("== part ") == 3 and {x["part"] for x in rows} == {"env", "figures"}
    assert any(x["what"].startswith("rollout of") for x in rows) and any("decode kernels" in x["what"] for x in rows)
    assert len([x for x in rows if x["part"] == "figures"]) == 3  # the rollout's two rows, the kernels' CUDA-only skip
    bad = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "not a part" in bad.stderr and "rollout_figures" in bad.stderr


# ----------------------------------------------------------------------------- the rules (grpo/measure/parity.py)

@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.9), (20, 1.0), (20, 0.8)])
def test_the_sampling_reference_is_the_samplers_rule(top_k, top_p):
    """grpo.engine.sampling.sample on a CPU against the float64 reference: nothing off a tie, off the kept set's edge,
    or outside the log-prob tolerance; a moved token is caught."""
    from grpo.engine.sampling import sample
    from grpo.measure.parity import LOGPROB_TOL, sample_reference, sampling_errors
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 997, generator=g) * 3
    key, step = torch.randint(0, 1 << 62, (16,), generator=g), torch.randint(0, 99, (16,), generator=g)
    tokens, lp, thr = sample(logits, key, step, 0.8, top_k, top_p, return_threshold=True)
    ref = sample_reference(logits, key, step, 0.8, top_k, top_p)
    filtered = top_k > 0 or top_p < 1
    e = sampling_errors(tokens, lp, thr if filtered else None, logits, 0.8, ref)
    assert e["token_rows_off_tie"] == 0 and e.get("kept_set_off_edge", 0) == 0 and e["logprob_max_err"] < LOGPROB_TOL
    tokens[3] = (tokens[3] + 1) % 997
    assert sampling_errors(tokens, lp, thr if filtered else None, logits, 0.8, ref)["token_rows_off_tie"] == 1


def test_ulps_at_scale_and_the_draws_tolerance():
    from grpo.measure.parity import bf16_ulp, tv_distance, tv_tolerance, ulps_at_scale
    x = torch.tensor([[1.0, 0.5, -0.25], [3.0, 0.0, 1e-3]]).bfloat16()
    assert bf16_ulp(torch.tensor([1.0, 1.5, 3.0])).tolist() == [2**-7, 2**-7, 2**-6]
    assert ulps_at_scale(x, x) == 0
    y = x.clone()
    y[1, 2] += 2**-6  # one ulp at the second row's scale (3.0), many at the element's own
    assert ulps_at_scale(y, x) == pytest.approx(1.0, abs=0.1)
    probs = torch.tensor([0.5, 0.25, 0.25])
    fair = torch.multinomial(probs, 20000, replacement=True, generator=torch.Generator().manual_seed(0))
    assert tv_distance(fair, probs) < tv_tolerance(3, 20000) < tv_distance(torch.zeros(20000, dtype=torch.long), probs)
