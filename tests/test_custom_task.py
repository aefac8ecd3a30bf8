"""recipes/custom_task.py: any JSONL of question/answer and TRL-style reward functions named on
the command line, trained two steps on the toy model, with eval and export."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from toy import make_toy_dir

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast subset leaves it out)

ROOT = Path(__file__).resolve().parents[1]


def test_custom_task_trains_two_steps(tmp_path):
    model = make_toy_dir(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1}", "solution": "w3"}) + "\n" for i in range(12)))
    out = tmp_path / "run"
    flags = [f"--model_path={model}", f"--output_dir={out}", f"--train_data={data}", f"--eval_data={data}",
             "--question_field", "prompt", "--answer_field=solution", "--system_prompt=",
             "--reward_funcs=toy:target_words,toy:short", "--reward_weights=1,0.5", "--max_steps=2",
             "--prompts_per_step=2", "--num_generations=4", "--max_prompt_length=16", "--max_completion_length=8",
             "--micro_batch_tokens=256", "--gen_batch=8", "--eval_limit=4", "--profile=none", "--save_steps=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "recipes/custom_task.py", *flags], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [row for row in rows if "reward/mean" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:  # both terms logged, weighted 1 and 0.5 into the reward
        assert {"reward/target_words", "reward/short"} <= set(row)
        assert abs(row["reward/mean"] - row["reward/target_words"] - 0.5 * row["reward/short"]) < 1e-6
    records = [json.loads(line) for line in open(out / "eval_after.jsonl")]
    assert len(records) == 4 and all(r["correct"] == r["rewards"]["target_words"] for r in records)
    assert (out / "export" / "config.json").exists()
    # the run evaluated again from its folder alone: the same records, the same figure
    r = subprocess.run([sys.executable, "-m", "grpo.cli.eval", "--run", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    again = [json.loads(line) for line in open(out / "eval_rerun.jsonl")]
    assert [x["completion"] for x in again] == [x["completion"] for x in records]
    assert [x["correct"] for x in again] == [x["correct"] for x in records]


def test_custom_task_refuses_bad_reward_names(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    r = subprocess.run([sys.executable, "recipes/custom_task.py", f"--train_data={data}", "--profile=none", "--model_path=m",
                        "--reward_funcs=no_such_module:fn"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and r.stderr.strip().startswith("error: --reward_funcs 'no_such_module:fn'"), r.stderr
