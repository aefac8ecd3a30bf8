"""ProcessGRPO's data as its card ran it (grpo.envs.processgrpo, recipes/processgrpo_qwen25_05b.py):
mixed sources in every form (dataset ids through `datasets`, JSONL/CSV/Parquet files, the
generator), validation held out of GSM8K + MATH and disjoint from training, the offline error,
and the eval tasks of the card's table (GSM-Symbolic, SVAMP, MATH-500 numeric) on tiny files
in each dataset's own columns."""
import csv
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from grpo.envs import processgrpo
from grpo.envs.processgrpo import (TRAIN_SOURCES, VALIDATION_SOURCES, OneShotMathEnv, heldout, load_sources,
                                   without)
from grpo.envs.tasks import SOURCES, load_task
from grpo.infra.data import DataError
from grpo.rollout import Trajectory

ROOT = Path(__file__).resolve().parents[1]


def recipe():
    spec = importlib.util.spec_from_file_location("processgrpo_recipe", ROOT / "recipes" / "processgrpo_qwen25_05b.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def gsm8k_rows(n: int, start: int = 0) -> list[dict]:
    return [{"question": f"Ana has {i} apples and buys 2 more. How many?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}
            for i in range(start, start + n)]


def math_rows(n: int) -> list[dict]:  # MATH's columns; every third answer is not a number
    return [{"problem": f"Compute ${i} \\cdot 3$.", "answer": "x^2" if i % 3 == 0 else str(3 * i),
             "solution": "...", "level": "Level 1"} for i in range(n)]


def fake_hub(monkeypatch, tables: dict):
    """`datasets.load_dataset` answering from `tables`, keyed (name, config, split); others fail as offline."""
    def load_dataset(name, config, split):
        if (name, config, split) not in tables:
            raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)\ndetails")
        return tables[(name, config, split)]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


# ----------------------------------------------------------------------------- sources


def test_defaults_are_the_cards_mixed_sources_by_public_id():
    cfg = recipe().ProcessGRPOQwen()
    assert cfg.filter_solve_rate is True                  # the card's 1-7 of 8 filter, on by default
    assert cfg.train_data == TRAIN_SOURCES and cfg.eval_data == VALIDATION_SOURCES
    assert TRAIN_SOURCES.split(",") == ["openai/gsm8k:main:train", "nlile/hendrycks-MATH-benchmark::train",
                                        "multistep:train:300"]
    # validation: GSM8K + MATH held out of their train splits; the generator is the benchmark's, not here
    assert VALIDATION_SOURCES.split(",") == ["heldout:openai/gsm8k:main:train",
                                             "heldout:nlile/hendrycks-MATH-benchmark::train"]


@pytest.mark.parametrize("form", ["jsonl", "csv", "parquet", "hub"])
def test_mixed_sources_read_every_form(form, tmp_path, monkeypatch):
    gsm, math = gsm8k_rows(4), math_rows(6)
    if form == "jsonl":
        sources = [write_jsonl(tmp_path / "gsm.jsonl", gsm), write_jsonl(tmp_path / "math.jsonl", math)]
    elif form == "csv":
        sources = []
        for name, rows in (("gsm", gsm), ("math", math)):
            with open(tmp_path / f"{name}.csv", "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
            sources.append(str(tmp_path / f"{name}.csv"))
    elif form == "parquet":
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        sources = []
        for name, rows in (("gsm", gsm), ("math", math)):
            pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
            sources.append(str(tmp_path / f"{name}.parquet"))
    else:
        fake_hub(monkeypatch, {("openai/gsm8k", "main", "train"): gsm,
                               ("nlile/hendrycks-MATH-benchmark", None, "train"): math})
        sources = TRAIN_SOURCES.split(",")[:2]
    got = load_sources(",".join(sources + ["multistep:train:1"]))
    # GSM8K's '#### n' read; MATH's 4 numeric rows of 6 kept, its `problem` the question; 7 generated
    assert [g["answer"] for g in got[:4]] == ["2", "3", "4", "5"]
    assert [g["answer"] for g in got[4:8]] == ["3", "6", "12", "15"]
    assert got[4]["question"] == "Compute $1 \\cdot 3$."
    assert len(got) == 4 + 4 + 7 and all(g.get("num_ops") for g in got[8:])


def test_heldout_slice_is_stable_and_disjoint_from_training(tmp_path):
    rows = gsm8k_rows(400)
    path = write_jsonl(tmp_path / "gsm.jsonl", rows)
    held = load_sources(f"heldout:{path}")
    assert held == [r for r in load_sources(path) if heldout(r["question"])]
    assert 5 <= len(held) <= 40, len(held)                 # ~5% of 400
    # the same rows whatever the order of the source
    write_jsonl(tmp_path / "reversed.jsonl", rows[::-1])
    assert {r["question"] for r in load_sources(f"heldout:{tmp_path / 'reversed.jsonl'}")} == \
        {r["question"] for r in held}
    train = without(load_sources(path), held)
    assert len(train) == 400 - len(held) and not {r["question"] for r in train} & {r["question"] for r in held}


def test_recipe_data_trains_on_what_validation_does_not_hold(tmp_path, monkeypatch, capsys):
    gsm = write_jsonl(tmp_path / "gsm.jsonl", gsm8k_rows(300))
    math = write_jsonl(tmp_path / "math.jsonl", math_rows(300))
    cfg = recipe().ProcessGRPOQwen(train_data=f"{gsm},{math},multistep:train:1",
                                   eval_data=f"heldout:{gsm},heldout:{math}", eval_limit=10)
    train, env, val = recipe().data(cfg)
    questions = {r["question"] for r in val}
    assert val and not questions & {r["question"] for r in train}
    assert not any(r.get("num_ops") for r in val)          # no generated problem: those are the benchmark's
    assert any(r["question"].startswith("Ana") for r in val[:10]) and any(r["question"].startswith("Compute") for r in val[:10])
    assert len(train) == 300 + 200 + 7 - len(val)          # MATH: 200 numeric rows
    assert isinstance(env, OneShotMathEnv) and "held out for validation" in capsys.readouterr().out


def test_offline_default_data_is_one_line_naming_the_local_file_flag(monkeypatch):
    fake_hub(monkeypatch, {})
    monkeypatch.setattr(sys, "argv", ["processgrpo_qwen25_05b.py", "--model_path=/nonexistent"])
    with pytest.raises(SystemExit) as e:
        recipe().main()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("processgrpo recipe: openai/gsm8k:main:train: could not load")
    assert "offline: --train_data=gsm8k_train.jsonl," in msg, msg
    cfg = recipe().ProcessGRPOQwen(train_data="multistep:train:1")   # the training data found, validation not
    with pytest.raises(SystemExit, match="offline: --eval_data=heldout:gsm8k_train.jsonl,heldout:") as e:
        recipe().data(cfg)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- the card's eval tasks

TASK_ROWS = {  # one or two rows each, in the dataset's own columns
    "gsm_symbolic": [{"id": 0, "instance": 3, "question": "Liam has 12 pens and gives away 5. How many are left?",
                      "answer": "12 - 5 = <<12-5=7>>7\n#### 7", "original_id": 9}],
    "svamp": [{"ID": "chal-1", "Body": "Each pack has 6 eggs. Jack bought 4 packs.",
               "Question": "How many eggs did Jack buy?", "Equation": "( 6.0 * 4.0 )", "Answer": 24.0,
               "Type": "Multiplication"}],
    "math500_numeric": [{"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "answer": "\\frac{3}{4}",
                         "subject": "Prealgebra", "level": 1, "unique_id": "a"},
                        {"problem": "Solve for the pair.", "answer": "(3, 4)", "subject": "Algebra", "level": 2,
                         "unique_id": "b"}],
}
QUESTIONS = {"gsm_symbolic": "Liam has 12 pens and gives away 5. How many are left?",
             "svamp": "Each pack has 6 eggs. Jack bought 4 packs. How many eggs did Jack buy?",
             "math500_numeric": "What is $\\frac{1}{2} + \\frac{1}{4}$?"}
RIGHT = {"gsm_symbolic": "12 - 5 = 7.\n\nThe answer is \\boxed{7}.", "svamp": "6 x 4 = 24, so \\boxed{24}.",
         "math500_numeric": "1/2 + 1/4 = 0.75, so \\boxed{0.75}."}


def scored(env, example, text: str) -> float:
    t = Trajectory(example, 0, [], [], [], [], "stop", 1, text=text)
    return env.reward(example, t)["correct"]


@pytest.mark.parametrize("task", sorted(TASK_ROWS))
def test_card_task_prompt_and_score(task, tmp_path, capsys):
    assert SOURCES[task] == {"gsm_symbolic": "apple/GSM-Symbolic:main:test", "svamp": "ChilleD/SVAMP::test",
                             "math500_numeric": "HuggingFaceH4/MATH-500::test"}[task]
    env, examples = load_task(task, write_jsonl(tmp_path / f"{task}.jsonl", TASK_ROWS[task]))
    assert isinstance(env, OneShotMathEnv) and len(examples) == 1   # MATH-500's '(3, 4)' dropped, counted
    if task == "math500_numeric":
        assert "kept 1 of 2 rows" in capsys.readouterr().out
    ex = examples[0]
    assert ex["question"] == QUESTIONS[task]
    messages = env.prompt(ex)   # the card's prompt: the worked example, then the question + suffix
    assert messages[:2] == OneShotMathEnv().prompt({"question": ""})[:2]
    assert messages[-1] == {"role": "user", "content": QUESTIONS[task] + processgrpo.PROMPT_SUFFIX}
    assert scored(env, ex, RIGHT[task]) == 1.0
    assert scored(env, ex, "So \\boxed{8}.") == 0.0 and scored(env, ex, RIGHT[task].replace("\\boxed", "")) == 0.0


def test_card_task_errors_are_one_line(tmp_path):
    with pytest.raises(DataError, match="missing column 'Question'"):
        load_task("svamp", write_jsonl(tmp_path / "s.jsonl", [{"Body": "A story.", "Answer": 3}]))
    with pytest.raises(DataError, match="none of its 1 answers is a number"):
        load_task("math500_numeric", write_jsonl(tmp_path / "m.jsonl", [{"problem": "p", "answer": "x^2"}]))


@pytest.mark.usefixtures("one_thread")
def test_card_task_through_the_eval_command(tmp_path, smollm2_path):
    """`python -m grpo.cli.eval --task svamp --data FILE`: the task is a choice of the command, its
    records carry SVAMP's joined question and its numeric answer (a tiny random model: plumbing)."""
    from test_recipes import make_tiny_chat_model

    from grpo.cli.eval import main
    model = make_tiny_chat_model(tmp_path / "tiny", "qwen2", smollm2_path)
    data, out = write_jsonl(tmp_path / "svamp.jsonl", TASK_ROWS["svamp"]), tmp_path / "out.jsonl"
    r = main(["--model_path", model, "--task", "svamp", "--data", data, "--max_completion_length", "6",
              "--out", str(out)])
    [record] = [json.loads(line) for line in open(out)]
    assert r["questions"] == 1 and record["question"] == QUESTIONS["svamp"] and record["answer"] == "24.0"
    assert record["correct"] == 0.0 and record["finish_reason"] in ("stop", "length")


def test_heldout_generator_is_a_clear_error():
    with pytest.raises(DataError, match="no held-out slice"):
        load_sources("heldout:multistep:train:10")
