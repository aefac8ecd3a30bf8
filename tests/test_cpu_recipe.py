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
    # of this test do not depend on the CPU kind. Smaller than --smoke's own sizes (the flags given win):
    # every phase still runs, on fewer rows and shorter completions (a warm-start of 1 step of 2
    # episodes, 2 GRPO steps of 2 prompts x G=2, evals of 1 and 2 questions)
    smaller = ["--sft_steps=1", "--sft_batch=2", "--eval_before_limit=1", "--eval_limit=2",
               "--max_completion_length=48", "--num_generations=2"]
    r = subprocess.run([sys.executable, "recipes/calculator_smollm2_cpu.py", "--smoke", f"--output_dir={out}",
                        "--autocast_bf16", "false", *smaller],
                       cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    run = out  # an explicit --output_dir is honoured (only the default folder gets a _smoke suffix)
    assert not Path(str(out) + "_smoke").exists()
    summary = json.loads((run / "summary.json").read_text())  # the run's end: before/after, gains, export
    assert {"before", "warmstart", "after"} <= set(summary["evals"]) and "after - before" in summary["gains"]
    assert summary["export"] == str(run / "export") and summary["steps"] == 2
    recorded = json.loads((run / "config.json").read_text())  # --smoke's sizes, but for the ones given
    assert [recorded[k] for k in ("sft_steps", "num_generations", "max_completion_length")] == [1, 2, 48]
    for phase in ("before", "warmstart", "after"):  # the untrained model on 1 question, the others on 2
        for protocol in ("", "_greedy"):  # one sample at T 1.0, and greedy
            records = [json.loads(line) for line in open(run / f"eval_{phase}{protocol}.jsonl")]
            assert len(records) == (1 if phase == "before" else 2)
            assert all({"question", "completion", "correct"} <= set(x) for x in records)
        assert f"| {phase}" in r.stdout
    assert "GRPO gain over warm-start" in r.stdout and "| ops " in r.stdout and "| family " in r.stdout
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


def load_recipe():
    sys.path.insert(0, str(ROOT / "recipes"))
    import calculator_smollm2_cpu as recipe
    return recipe


def test_a_slow_cpu_gets_the_light_settings_and_keeps_what_the_user_set(monkeypatch):
    recipe = load_recipe()
    from grpo.flags import parse_args
    slow, fast = {"float32": 90.0, "bfloat16": 40.0}, {"float32": 190.0, "bfloat16": 760.0}
    cfg = parse_args(recipe.CalculatorCPU, [])
    line = recipe.fit_to_machine(cfg, slow)  # auto: fp32 chosen (bf16 slower), 90 < 150 GFLOP/s
    assert "fp32" in line and all(getattr(cfg, k) == v for k, v in recipe.LIGHT.items())
    cfg = parse_args(recipe.CalculatorCPU, ["--prompts_per_step", "6"])  # the user's value stays
    recipe.fit_to_machine(cfg, slow)
    assert cfg.prompts_per_step == 6 and cfg.eval_temperature == 0.0 and cfg.max_completion_length == 192
    for argv, rates in (([], fast), (["--autocast_bf16", "false", "--light", "false"], slow)):
        cfg, full = parse_args(recipe.CalculatorCPU, argv), recipe.CalculatorCPU()
        assert "the full settings" in recipe.fit_to_machine(cfg, rates)  # bf16 at 760; or forced off
        assert all(getattr(cfg, k) == getattr(full, k) for k in recipe.LIGHT)
    # forced on: nothing measured. A fast machine with autocast forced off measures fp32: 190 >= 150
    monkeypatch.setattr(recipe, "measure", lambda *a: pytest.fail("measured with --light true"))
    cfg = parse_args(recipe.CalculatorCPU, ["--light", "true"])
    recipe.fit_to_machine(cfg)
    assert cfg.prompts_per_step == recipe.LIGHT["prompts_per_step"]
    cfg = parse_args(recipe.CalculatorCPU, ["--autocast_bf16", "false"])
    assert "190 GFLOP/s" in recipe.fit_to_machine(cfg, fast) and cfg.prompts_per_step == 8
    with pytest.raises(SystemExit, match="--light='maybe'"):
        recipe.fit_to_machine(parse_args(recipe.CalculatorCPU, ["--light", "maybe"]), fast)


def test_greedy_only_evals_fill_the_greedy_column(tmp_path, monkeypatch, capsys, smollm2_path):
    """At eval_temperature 0 (the light settings) each eval is the greedy one and has no sampled
    twin: the table shows it as greedy, with the paired gain, and '-' where nothing was sampled."""
    recipe = load_recipe()
    ws = {"questions": 4, "mean": 0.25, "ci95": 0.5, "per_question": [1.0, 0.0, 0.0, 0.0]}
    after = {"questions": 4, "mean": 0.75, "ci95": 0.5, "per_question": [1.0, 1.0, 1.0, 0.0]}
    monkeypatch.setattr(recipe, "train", lambda *a, **k: {"warmstart": ws, "after": after})
    monkeypatch.setattr(sys, "argv", ["calculator_smollm2_cpu.py", "--smoke", "--eval_temperature", "0",
                                      f"--output_dir={tmp_path / 'run'}"])
    recipe.main()
    out = capsys.readouterr().out
    assert "| warmstart | 0.250 | ± 0.500 | - | - |" in out, out
    assert "| GRPO gain over warm-start (paired) | **+0.500** |" in out and "| - | - |" in out
    ops_rows = [line for line in out.splitlines() if line.startswith("| ops ")]
    assert ops_rows and all(line.endswith("| - | - |") for line in ops_rows)


def test_light_on_resume_a_gpu_torchrun_and_asked_for_samples(tmp_path, monkeypatch):
    """A resumed run keeps what its config.json recorded, whatever a new measurement says; auto
    keeps the full settings on a GPU and under torchrun; asking for samples keeps their temperature;
    --smoke still refuses a bad --light."""
    recipe = load_recipe()
    from grpo.flags import parse_args
    slow, fast = {"float32": 90.0, "bfloat16": 40.0}, {"float32": 190.0, "bfloat16": 760.0}
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"prompts_per_step": 4, "eval_temperature": 0.0,
                                                 "max_completion_length": 192, "_meta": {}}))
    cfg = parse_args(recipe.CalculatorCPU, ["--resume", "--output_dir", str(run)])
    assert "recorded" in recipe.fit_to_machine(cfg, fast)  # fast now: the recorded slow settings stay
    assert (cfg.prompts_per_step, cfg.eval_temperature, cfg.max_completion_length) == (4, 0.0, 192)
    cfg = parse_args(recipe.CalculatorCPU, ["--eval_n", "4"])
    recipe.fit_to_machine(cfg, slow)
    assert cfg.eval_temperature == 1.0 and cfg.prompts_per_step == 4
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = parse_args(recipe.CalculatorCPU, [])
    assert "torchrun" in recipe.fit_to_machine(cfg, slow) and cfg.prompts_per_step == 8
    monkeypatch.setattr(sys, "argv", ["calculator_smollm2_cpu.py", "--smoke", "--light", "sometimes"])
    with pytest.raises(SystemExit, match="--light='sometimes'"):
        recipe.main()
