"""The CPU default end to end at smoke size: SmolLM2 warm-start, GRPO with the multi-turn
sampler, three evals, and an export that transformers loads and generates from."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast subset leaves it out)

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_recipe_smoke_end_to_end(tmp_path, smollm2_path):
    out = tmp_path / "run"
    # fp32, as on most CPUs (auto would pick bf16 on an AVX512-BF16 machine): the figures and the time
    # of this test do not depend on the CPU kind
    r = subprocess.run([sys.executable, "recipes/calculator_smollm2_cpu.py", "--smoke", f"--output_dir={out}",
                        "--autocast_bf16", "false"],
                       cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    run = out  # an explicit --output_dir is honoured (only the default folder gets a _smoke suffix)
    assert not Path(str(out) + "_smoke").exists()
    summary = json.loads((run / "summary.json").read_text())  # the run's end: before/after, gains, export
    assert {"before", "warmstart", "after"} <= set(summary["evals"]) and "after - before" in summary["gains"]
    assert summary["export"] == str(run / "export") and summary["steps"] == 2
    for phase in ("before", "warmstart", "after"):  # the untrained model on 4 questions, the others on 8
        for protocol in ("", "_greedy"):  # one sample at T 1.0, and greedy
            records = [json.loads(line) for line in open(run / f"eval_{phase}{protocol}.jsonl")]
            assert len(records) == (4 if phase == "before" else 8)
            assert all({"question", "completion", "correct"} <= set(x) for x in records)
        assert f"| {phase}" in r.stdout
    assert "GRPO gain over warm-start" in r.stdout and "| ops 1 |" in r.stdout and "| family " in r.stdout
    steps = [x for x in map(json.loads, open(run / "metrics.jsonl")) if "reward/mean" in x]
    assert [x["step"] for x in steps] == [1, 2]
    # `python -m grpo.cli.eval --run` reproduces the final eval exactly: the same records, the same figure
    rerun = subprocess.run([sys.executable, "-m", "grpo.cli.eval", "--run", str(run)], cwd=ROOT, capture_output=True,
                           text=True, timeout=1200)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    after = [json.loads(line) for line in open(run / "eval_after.jsonl")]
    again = [json.loads(line) for line in open(run / "eval_rerun.jsonl")]
    assert [(x["question"], x["completion"], x["correct"]) for x in again] == \
        [(x["question"], x["completion"], x["correct"]) for x in after]
    mean = sum(x["correct"] for x in after) / len(after)
    assert f"| {mean:.4f} |" in rerun.stdout, rerun.stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(run / "export", dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(run / "export")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 2?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    gen = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] == ids["input_ids"].shape[1] + 5 or tok.eos_token_id in gen[0].tolist()


def test_the_table_reads_the_questions_the_budget_left(tmp_path, monkeypatch, capsys, smollm2_path):
    """On a slow machine the run budget shrinks the evals: the recipe's table and its breakdown
    by operation count and phrasing read the questions evaluated (its breakdown indexed all 200
    and raised IndexError after a full fp32 run that evaluated 104)."""
    sys.path.insert(0, str(ROOT / "recipes"))
    import calculator_smollm2_cpu as recipe
    scores = {"questions": 5, "mean": 0.4, "ci95": 0.4, "per_question": [1.0, 0.0, 1.0, 0.0, 0.0]}
    fake = {name: dict(scores) for name in ("warmstart", "warmstart_greedy", "after", "after_greedy")}
    monkeypatch.setattr(recipe, "train", lambda *a, **k: fake)
    monkeypatch.setattr(sys, "argv", ["calculator_smollm2_cpu.py", "--smoke", f"--output_dir={tmp_path / 'run'}"])
    recipe.main()
    out = capsys.readouterr().out
    assert "\n5 held-out questions" in out
    ops_rows = [line for line in out.splitlines() if line.startswith("| ops ")]
    assert ops_rows and sum(int(line.split("|")[2]) for line in ops_rows) == 5
