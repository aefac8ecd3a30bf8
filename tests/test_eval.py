"""`python -m grpo.cli.eval` end to end: the real SmolLM2 on a few GSM8K test questions,
and the `--data` path with JSONL and CSV files (on a tiny random model: only the plumbing counts).
The loader's own cases are in test_data.py."""
import csv
import json
import types
from pathlib import Path

import pytest
from test_recipes import make_tiny_chat_model

from grpo.cli.eval import main
from grpo.envs.tasks import load_task
from grpo.eval import summarize
from grpo.infra.stats import mean_ci95, paired_gain

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
FIELDS = {"question", "answer", "completion", "extracted", "correct"}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def read_records(path) -> list[dict]:
    records = [json.loads(line) for line in open(path)]
    for r in records:
        assert FIELDS <= set(r), r
        assert r["correct"] in (0.0, 1.0) and isinstance(r["completion"], str)
        assert r["finish_reason"] in ("stop", "length", "turns"), r  # "error": the sampler refused the prompt
    return records


@pytest.mark.skipif(not (DATA / "gsm8k" / "test.jsonl").exists(), reason="../shared/data/gsm8k not found")
def test_eval_gsm8k_on_smollm2(smollm2_path, tmp_path, capsys):
    out = tmp_path / "gsm8k.jsonl"
    test_file = str(DATA / "gsm8k" / "test.jsonl")
    r = main(["--model_path", smollm2_path, "--task", "gsm8k", "--data", test_file, "--eval_limit", "3",
              "--max_completion_length", "32", "--out", str(out)])
    records = read_records(out)
    _, test = load_task("gsm8k", test_file)
    assert [x["question"] for x in records] == [x["question"] for x in test[:3]]
    assert [x["answer"] for x in records] == [x["answer"] for x in test[:3]]
    assert all(x["completion"] and x["finish_reason"] in ("stop", "length") for x in records)
    assert all(x["extracted"] is None or isinstance(x["extracted"], str) for x in records)
    assert r["questions"] == 3
    assert (r["mean"], r["ci95"]) == pytest.approx(mean_ci95([x["correct"] for x in records]))
    assert "| gsm8k | 3 | 1 |" in capsys.readouterr().out


@pytest.mark.parametrize("task,fmt", [("calculator", "csv"), ("gsm8k", "jsonl"), ("math500", "jsonl"),
                                      ("aime24", "parquet")])
def test_eval_data_file(task, fmt, tmp_path, smollm2_path):
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    model = make_tiny_chat_model(tmp_path / "tiny", "qwen2", smollm2_path)
    rows = {"calculator": [{"question": "What is 2 plus 3?", "answer": "5"},
                           {"question": "What is 1,200 times 3?", "answer": "3,600"}],
            # GSM8K's own format: the answer column is the worked solution ending in '#### 18'
            "gsm8k": [{"prompt": "Janet has 16 eggs and eats 3. How many are left?",
                       "answer": "16 - 3 = 13\n#### 13"},
                      {"question": "What is 9 times 2?", "answer": "18"}],
            "math500": [{"question": "What is 1/2 + 1/3?", "answer": "\\frac{5}{6}"}],
            # other column names, given as flags; AIME answers as integers ('025' -> '25')
            "aime24": [{"problem_text": "Find 5 squared.", "gold": "025"}]}[task]
    fields = ["--question_field", "problem_text", "--answer_field", "gold"] if task == "aime24" else []
    data = tmp_path / f"questions.{fmt}"
    if fmt == "csv":
        with open(data, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["question", "answer"])
            w.writeheader()
            w.writerows(rows)
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), data)
    else:
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    r = main(["--model_path", model, "--task", task, "--data", str(data), "--max_completion_length", "6", "--eval_n", "2",
              "--out", str(out), *fields])
    records = read_records(out)
    assert len(records) == 2 * len(rows) and r["questions"] == len(rows) and r["n"] == 2
    questions = [x.get("question") or x.get("prompt") or x["problem_text"] for x in rows]
    assert [x["question"] for x in records] == [q for q in questions for _ in range(2)]
    want = {"calculator": ["5.0", "3600.0"], "gsm8k": ["13", "18"], "math500": ["\\frac{5}{6}"],
            "aime24": ["25"]}[task]
    assert [x["answer"] for x in records] == [a for a in want for _ in range(2)]


def test_several_samples_pair_by_question():
    # 2 questions x 3 samples: the interval and the paired gain are over questions, not the 6
    # samples (samples of one question are correlated; treating them as independent narrows both)
    records = [{"correct": c} for c in (1, 0, 0, 1, 1, 1)]
    r = summarize(records, 3)
    assert r["per_question"] == pytest.approx([1 / 3, 1.0]) and r["questions"] == 2
    assert (r["mean"], r["ci95"]) == pytest.approx(mean_ci95([1 / 3, 1.0]))
    assert r["pass"] == 1.0
    after = summarize([{"correct": c} for c in (1, 1, 0, 1, 1, 1)], 3)["per_question"]
    assert paired_gain(r["per_question"], after) == pytest.approx(mean_ci95([1 / 3, 0.0]))


def test_paired_bootstrap():
    """The percentile interval of the mean paired gain: close to the normal one on many
    questions, exactly 0 when nothing changed, and deterministic under its seed."""
    import random

    from grpo.infra.stats import paired_bootstrap, paired_gain
    rng = random.Random(0)
    before = [float(rng.random() < 0.4) for _ in range(500)]
    after = [b if rng.random() < 0.8 else float(rng.random() < 0.6) for b in before]
    gain, lo, hi = paired_bootstrap(before, after)
    mean, ci = paired_gain(before, after)
    assert gain == mean and lo < gain < hi
    assert abs((hi - lo) / 2 - ci) < 0.15 * ci, (lo, hi, ci)   # bootstrap vs normal half-width
    assert paired_bootstrap(before, after) == (gain, lo, hi)
    assert paired_bootstrap([1.0, 0.0], [1.0, 0.0]) == (0.0, 0.0, 0.0)


def test_the_library_names_the_command():
    """`python -m grpo.eval` (the library, which never imports grpo.cli) says the command is
    `python -m grpo.cli.eval` and exits 2; the command itself answers --help."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "grpo.eval", "--run", "x"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "the command is python -m grpo.cli.eval" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "grpo.cli.eval", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m grpo.cli.eval"), r.stderr[-2000:]


def test_kernels_and_cuda_graphs_flags_reach_the_eval(tmp_path, smollm2_path, monkeypatch):
    # --kernels torch: the eval runs inside grpo.kernels' references(); --cuda_graphs false: its sampler
    # is built without graphs (a CPU takes both ways anyway: what is checked is that the flags arrive)
    import grpo.cli.eval as cli
    from grpo.kernels import target
    seen, real = [], cli.evaluate
    monkeypatch.setattr(cli, "evaluate", lambda *a, **kw: seen.append((target._references, kw["cuda_graphs"]))
                        or real(*a, **kw))
    model = make_tiny_chat_model(tmp_path / "tiny", "qwen2", smollm2_path)
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"question": "What is 2 plus 3?", "answer": "5"}) + "\n")
    flags = ["--model_path", model, "--task", "calculator", "--data", str(data), "--max_completion_length", "4",
             "--out", str(tmp_path / "out.jsonl")]
    main(flags + ["--kernels", "torch", "--cuda_graphs", "false"])
    main(flags)
    assert seen == [(True, False), (False, True)] and target._references is False


def test_calculator_reference_protocol_on_its_csv_shape(tmp_path, smollm2_path, monkeypatch, capsys):
    """--protocol reference reads the reference's eval CSV (prompt, expression, answer) and evaluates
    as it did: one sample at T 0.2, 5 calls (6 turns), 1,000 tokens a turn, right within an absolute
    0.1; the calculator recipes' own evals use the same settings."""
    import grpo.cli.eval as cli
    from grpo.envs.calculator import REFERENCE_EVAL
    seen, real = [], cli.evaluate

    def spy(model, tokenizer, env, examples, **kw):
        seen.append((env, examples, dict(kw)))
        return real(model, tokenizer, env, examples, **{**kw, "max_tokens": 6})  # the settings, not the time

    monkeypatch.setattr(cli, "evaluate", spy)
    model = make_tiny_chat_model(tmp_path / "tiny", "qwen2", smollm2_path)
    data = tmp_path / "basic_calculations_eval.csv"
    rows = [{"prompt": "What is 7429 multiplied by 836?", "expression": "7429*836", "answer": "6210644.0"},
            {"prompt": "Calculate 58392 divided by 76", "expression": "58392/76", "answer": "768.3157894736842"}]
    with open(data, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["prompt", "expression", "answer"])
        w.writeheader()
        w.writerows(rows)
    out = tmp_path / "out.jsonl"
    r = main(["--model_path", model, "--task", "calculator", "--protocol", "reference", "--data", str(data),
              "--eval_n", "4", "--eval_temperature", "1.0", "--out", str(out)])  # the protocol wins over these
    (env, examples, kw), = seen
    assert (kw["n"], kw["temperature"], kw["max_tokens"], kw["max_turns"], kw["max_turn_tokens"]) == (1, 0.2, 6500, 6, 1000)
    assert (env.rel_tol, env.abs_tol) == (0.0, 0.1)
    assert [x["question"] for x in read_records(out)] == [x["prompt"] for x in rows] and r["questions"] == 2
    assert "protocol: the reference's (1 sample at T 0.2, 5 calls, 1000 tokens a turn, right within 0.1)" in capsys.readouterr().out
    right = lambda answer, text: env.reward({"question": "q", "answer": answer}, types.SimpleNamespace(  # noqa: E731
        turns=[text], observations=[], text=text))["correct"]
    assert right(768.3157894736842, "Answer: 768.4") == 1.0 and right(768.3157894736842, "Answer: 768.2") == 0.0
    with pytest.raises(SystemExit, match="calculator's, not gsm8k's"):
        main(["--model_path", model, "--task", "gsm8k", "--protocol", "reference", "--data", str(data)])
    import sys
    sys.path.insert(0, str(Path(__file__).parents[1] / "recipes"))
    import calculator_qwen25_3b as recipe

    from grpo.eval import run_eval_settings
    s = run_eval_settings(recipe.CalculatorQwen())
    assert (s["n"], s["temperature"], s["max_tokens"], s["max_turns"], s["max_turn_tokens"]) == tuple(
        REFERENCE_EVAL[k] for k in ("n", "temperature", "max_tokens", "max_turns", "max_turn_tokens"))
