"""grpo.infra.data.load_examples, the one loader: local JSONL, JSON, CSV and Parquet files,
Hugging Face ids (through a stand-in `datasets` module: no hub is reachable here), errors that
name the file and line, each task's rules (grpo.envs.tasks), and no package code reading shared/."""
import csv
import json
import re
import sys
import types
from pathlib import Path

import pytest

from grpo.envs import calculator, gsm8k
from grpo.envs.math import aime_example
from grpo.envs.tasks import calculator_example, gsm8k_example, load_task
from grpo.infra.data import DataError, load_examples, parse_dataset_id

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"  # tests may read ../shared; package code may not
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"{DATA} absent")

ROWS = [{"question": "What is 2 plus 3?", "answer": "5", "level": "1"},
        {"question": " Half of 7? ", "answer": "3.5", "level": "2"}]
WANT = [{"question": "What is 2 plus 3?", "answer": "5", "level": "1"},
        {"question": "Half of 7?", "answer": "3.5", "level": "2"}]  # question stripped, answers text


def write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    else:
        path.write_text("".join(json.dumps(r) + "\n\n" for r in rows))  # blank lines are skipped
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_every_format_gives_the_same_examples(tmp_path, suffix):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    assert load_examples(write(tmp_path / f"q{suffix}", ROWS)) == WANT


def test_numbers_become_text_and_fields_can_be_renamed(tmp_path):
    path = write(tmp_path / "q.jsonl", [{"prompt_text": "Six times seven?", "gold": 42, "answer": "no"}])
    assert load_examples(path, question_field="prompt_text", answer_field="gold") == \
        [{"prompt_text": "Six times seven?", "gold": 42, "answer": "42", "question": "Six times seven?"}]
    # the default question field falls back to `prompt`, then `problem` (MATH's column)
    path = write(tmp_path / "p.jsonl", [{"problem": "1+1?", "answer": 2}, {"prompt": "2+2?", "answer": 4}])
    assert [(e["question"], e["answer"]) for e in load_examples(path)] == [("1+1?", "2"), ("2+2?", "4")]


@pytest.mark.parametrize("name, text, message", [
    ("bad.jsonl", '{"question": "a", "answer": 1}\n\n{"question": "b", "answer": 1\n',
     "bad.jsonl:3: not valid JSON"),
    ("list.json", '[{"question": "a", "answer": 1},\n {"question": "b" "answer": 1}]',
     "list.json:2: not valid JSON"),
    ("noq.csv", "prompt_text,answer\nhi,3\n",
     "noq.csv:2: missing column 'question' (or 'prompt', 'problem')"),
    ("noa.csv", "question,answer\nhi,3\nho,\n", "noa.csv:3: missing column 'answer'"),
    ("obj.jsonl", '[1, 2]\n', "obj.jsonl:1: expected an object"),
    ("text.jsonl", '{"question": ["a"], "answer": 1}\n', "text.jsonl:1: column 'question' is not text"),
    ("empty.jsonl", "\n\n", "empty.jsonl: no examples"),
    ("empty.csv", "question,answer\n", "empty.csv: no examples"),
    ("q.txt", "question,answer\nhi,3\n", "q.txt: unknown file type '.txt'"),
])
def test_errors_name_the_file_and_line(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match=re.escape(message)) as e:
        load_examples(tmp_path / name)
    assert "\n" not in str(e.value)


def test_missing_file_is_not_taken_for_a_dataset_id(tmp_path):
    for source in (tmp_path / "nope.jsonl", "data/train.csv", "./questions"):
        with pytest.raises(DataError, match="no such file"):
            load_examples(source)


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "q.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow...` now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    message = f"{path}: reading Parquet needs pyarrow (pip install pyarrow)"
    with pytest.raises(DataError, match=re.escape(message)):
        load_examples(path)


# ----------------------------------------------------------------------------- Hugging Face ids

@pytest.mark.parametrize("source, parts", [
    ("openai/gsm8k:main:test", ("openai/gsm8k", "main", "test")),
    ("HuggingFaceH4/MATH-500::test", ("HuggingFaceH4/MATH-500", None, "test")),
    ("HuggingFaceH4/aime_2024", ("HuggingFaceH4/aime_2024", None, None)),
    ("openai/gsm8k:main", ("openai/gsm8k", "main", None)),
])
def test_parse_dataset_id(source, parts):
    assert parse_dataset_id(source) == parts


def fake_datasets(monkeypatch, load_dataset):
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))


def test_dataset_id_goes_through_datasets(monkeypatch):
    calls = []

    def load_dataset(name, config, split):
        calls.append((name, config, split))
        return [{"question": "Q", "answer": "A #### 1,000"}]

    fake_datasets(monkeypatch, load_dataset)
    assert load_examples("openai/gsm8k:main:test", prepare=gsm8k_example) == \
        [{"question": "Q", "answer": "1000", "solution": "A #### 1,000"}]
    load_examples("HuggingFaceH4/MATH-500::test")
    load_examples("org/name", split="validation")  # the argument gives the split the id leaves out
    load_examples("org/name")                      # neither: train
    assert calls == [("openai/gsm8k", "main", "test"), ("HuggingFaceH4/MATH-500", None, "test"),
                     ("org/name", None, "validation"), ("org/name", None, "train")]


def test_dataset_id_offline_or_without_datasets_is_one_clear_line(monkeypatch):
    def offline(name, config, split):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)\nmore details")

    fake_datasets(monkeypatch, offline)
    with pytest.raises(DataError) as e:
        load_examples("openai/gsm8k:main:test")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("openai/gsm8k:main:test: could not load Hugging Face dataset")
    assert "ConnectionError: Couldn't reach" in msg
    assert "offline? pass a local JSONL, CSV or Parquet file" in msg

    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(DataError) as e:
        load_examples("openai/gsm8k:main:test")
    msg = str(e.value)
    assert "\n" not in msg and "pip install datasets" in msg and "local JSONL" in msg


def test_eval_cli_without_data_says_how_to_pass_a_file(monkeypatch, capsys):
    # the default source of every hub task, offline: exits with one line before any model is loaded
    from grpo.cli.eval import main
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(SystemExit) as e:
        main(["--model_path", "/nonexistent", "--task", "math500"])
    assert str(e.value).startswith("python -m grpo.cli.eval: HuggingFaceH4/MATH-500::test: not a local file")
    assert "local JSONL, CSV or Parquet file" in str(e.value)


# ----------------------------------------------------------------------------- each task's rules

@needs_data
def test_gsm8k_file_gives_the_final_number_and_keeps_the_solution():
    rows = load_examples(DATA / "gsm8k" / "test.jsonl", prepare=gsm8k_example)
    assert len(rows) == 1319 and rows[0]["answer"] == "18" and rows[0]["solution"].endswith("#### 18")
    assert rows == gsm8k.load(DATA / "gsm8k" / "test.jsonl")  # the env's own loader agrees
    assert all("," not in r["answer"] and "####" not in r["answer"] for r in rows)
    # load_task: the few-shot prompt's examples from a local train file
    env, examples = load_task("gsm8k", str(DATA / "gsm8k" / "test.jsonl"), shots=3,
                              fewshot_data=str(DATA / "gsm8k" / "train.jsonl"))
    assert examples == rows and env.system and env.system[0]["content"].count("ANSWER:") == 3


def test_gsm8k_rule_keeps_a_bare_number():
    assert gsm8k_example({"question": "q", "answer": "72"}) == {"question": "q", "answer": "72"}


@needs_data
def test_math500_and_aime_files():
    math500 = load_examples(DATA / "math500" / "test.jsonl")
    assert len(math500) == 500 and all(r["question"] == r["problem"].strip() for r in math500)
    a24 = load_examples(DATA / "aime" / "aime24.jsonl", prepare=aime_example)
    a25 = load_examples(DATA / "aime" / "aime25.jsonl", prepare=aime_example)
    assert len(a24) == len(a25) == 30 and a24[0]["answer"] == "204"
    assert all(r["answer"] == str(int(r["answer"])) for r in a24 + a25)  # '025' -> '25'
    with pytest.raises(DataError, match="an AIME answer is an integer"):
        load_examples(DATA / "math500" / "test.jsonl", prepare=aime_example)


CALC = [  # (file name, text, the error or None)
    ("ok.csv", 'question,expression,answer\n"What is 4829 multiplied by 736?", 4829*736,3554144.0\n'
               '"Sum of 1,000 and 2?",1000 + 2,"1,002"\n"Half of 3?",3/2,\n', None),
    ("ok.jsonl", '{"prompt": "What is 2+2?", "answer": 4}\n\n{"question": "3*3?", "answer": "$9"}\n', None),
    ("a.csv", "prompt_text,answer\nhi,3\n", "a.csv:2: missing column 'question'"),
    ("b.csv", "question,expression\nhi,\n", "b.csv:2: missing column 'answer'"),
    ("c.jsonl", '{"question": "a", "answer": 1}\n{"question": "b", "answer": 1\n',
     "c.jsonl:2: not valid JSON"),
    ("d.jsonl", '{"question": "a", "answer": "twelve"}\n', "d.jsonl:1: bad answer"),
    ("e.csv", "question,expression\nhi,1/(2-2)\n", "e.csv:2: bad answer or expression"),
    ("f.jsonl", '[1, 2]\n', "f.jsonl:1: expected an object"),
]


@pytest.mark.parametrize("name, text, error", CALC)
def test_calculator_rule_matches_the_envs_loader(tmp_path, name, text, error):
    (tmp_path / name).write_text(text)
    if error is None:  # numbers, computed from the expression where the answer is empty
        rows = load_examples(tmp_path / name, prepare=calculator_example)
        assert rows == calculator.load_questions(tmp_path / name)
        assert [r["answer"] for r in rows] in ([3554144.0, 1002.0, 1.5], [4.0, 9.0])
    else:
        with pytest.raises(DataError, match=re.escape(error)):
            load_examples(tmp_path / name, prepare=calculator_example)


def test_load_task_calculator_and_unknown():
    env, examples = load_task("calculator")  # generated: there is no public calculator data set
    assert isinstance(env, calculator.CalculatorEnv) and len(examples) == 200
    assert examples == calculator.generate_questions(200, seed=0, split="eval")
    with pytest.raises(ValueError, match="unknown task 'gsm9k'"):
        load_task("gsm9k")


# ----------------------------------------------------------------------------- no shared/ at run time

def test_no_package_code_or_recipe_reads_shared():
    # a clone of the repository has no ../shared folder: only tests may look there
    pattern = re.compile(r"""\.\./shared|["']shared["']""")
    found = [f"{p.relative_to(ROOT)}:{i}" for folder in ("grpo", "envs", "kernels", "recipes", "bench")
             for p in sorted((ROOT / folder).rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found


def test_epoch_steps_counts_whole_batches():
    from grpo.infra.data import epoch_steps
    assert epoch_steps(17_400, 64) == 271  # DAPO-Math-17k's 17.4k problems at 64 a step: the ReTool card's 271
    assert epoch_steps(1500, 64) == 23 and epoch_steps(1536, 64) == 24  # a partial batch is dropped
    assert epoch_steps(10, 64) == 1  # fewer prompts than a step: still one step
    with pytest.raises(ValueError):
        epoch_steps(0, 64)
