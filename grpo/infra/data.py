"""Examples from anywhere: the one loader behind every recipe, env and `python -m grpo.cli.eval`.

A source is a local file (JSONL, a JSON list, CSV or Parquet) or a Hugging Face dataset id with
an optional config and split, `name[:config[:split]]`:
    load_examples("openai/gsm8k:main:test")          # hub: needs `pip install datasets` and a network
    load_examples("HuggingFaceH4/MATH-500::test")    # no config
    load_examples("my_questions.csv", question_field="prompt_text")
Every example is its row plus `question` (text) and `answer` (text, or None when the row has
none and `prepare` computes it). A `prompt` column of chat messages (TRL's conversational form)
stays as given, and `question` is its last user message. `prepare(example) -> example` applies a task's own
rules (GSM8K's '#### 72' answers: grpo.envs.tasks). Every error is one line naming the file and line (or row).
"""
import csv
import json
from pathlib import Path
from typing import Callable

FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
# used when the question field is left at its default: the names common datasets use (MATH: problem)
QUESTION_FALLBACKS = ("question", "prompt", "problem")
LOCAL_HINT = "pass a local JSONL, CSV or Parquet file with question and answer columns instead"


class DataError(ValueError):
    """A one-line message about a data source: what is wrong and where."""


def load_examples(source: str | Path, split: str | None = None, question_field: str = "question",
                  answer_field: str = "answer", prepare: Callable[[dict], dict] | None = None,
                  require_answer: bool = True) -> list[dict]:
    """Rows of `source` as examples {**row, question, answer}; `split` overrides the id's split.
    Refuses an empty source, and rows without an answer unless require_answer=False (reward
    functions that need none); `prepare`'s ValueErrors come back naming the row's file and line."""
    examples = []
    for where, row in read_rows(source, split):
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object with a {question_field!r} field")
        try:
            example = prepare(_example(row, question_field, answer_field)) if prepare else \
                _example(row, question_field, answer_field)
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
        if require_answer and example["answer"] in (None, ""):
            raise DataError(f"{where}: missing column {answer_field!r} (pass --answer_field NAME)")
        examples.append(example)
    if not examples:
        raise DataError(f"{source}: no examples")
    return examples


def epoch_steps(rows: int, prompts_per_step: int) -> int:
    """GRPO steps in one epoch of `rows` prompts: whole batches only, the last partial one dropped
    (no prompt twice in an epoch; DAPO-Math's 17.4k problems at 64 a step made the ReTool card's
    271 rollouts), and at least one step."""
    if rows < 1 or prompts_per_step < 1:
        raise ValueError(f"an epoch of {rows} prompts at {prompts_per_step} a step")
    return max(1, rows // prompts_per_step)


def load_or_exit(source: str | Path, prefix: str = "error", hint: str = "", **kwargs) -> list[dict]:
    """load_examples for a command line: a DataError ends the program with one line
    ("{prefix}: {message}{hint}"), not a traceback."""
    try:
        return load_examples(source, **kwargs)
    except DataError as e:
        raise SystemExit(f"{prefix}: {e}{hint}") from None


def _example(row: dict, question_field: str, answer_field: str) -> dict:
    names = QUESTION_FALLBACKS if question_field == "question" else (question_field,)
    question = next((row[k] for k in names if row.get(k) not in (None, "")), None)
    if question is None:
        also = f" (or {', '.join(repr(k) for k in names[1:])})" if len(names) > 1 else ""
        raise ValueError(f"missing column {question_field!r}{also}; the row has {sorted(row)[:10]}"
                         f" (pass --question_field NAME)")
    if _is_messages(question):  # TRL's conversational form: the messages are the prompt, as given
        user = [m.get("content") for m in question if m.get("role") == "user"]
        return _example({**row, "prompt": question, "question": str(user[-1] if user else "")},
                        "question", answer_field) | {"prompt": question}
    if not isinstance(question, str):
        also = " nor chat messages [{'role': ..., 'content': ...}, ...]" if isinstance(question, list) else ""
        raise ValueError(f"column {question_field!r} is not text{also}: {str(question)[:60]!r}")
    answer = row.get(answer_field)
    answer = None if answer is None or str(answer).strip() == "" else str(answer).strip()
    return {**row, "question": question.strip(), "answer": answer}


def _is_messages(value) -> bool:
    """A conversational prompt: a list of {"role", "content"} messages (TRL's test)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value)


# ----------------------------------------------------------------------------- reading rows

def read_rows(source: str | Path, split: str | None = None) -> list[tuple[str, object]]:
    """(where, row) pairs, where = 'file:line' (or 'source row i') for error messages."""
    path = Path(source).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".csv":
            return _csv_rows(path)
        if suffix == ".parquet":
            return _parquet_rows(path)
        if suffix in (".jsonl", ".json"):
            return _json_rows(path)
        raise DataError(f"{path}: unknown file type {suffix!r} (use {', '.join(FILE_SUFFIXES)})")
    if path.suffix.lower() in FILE_SUFFIXES or str(source).startswith((".", "/", "~")) or path.is_dir():
        raise DataError(f"{source}: no such file (a Hugging Face dataset id looks like "
                        f"openai/gsm8k:main:test)")
    return _hub_rows(str(source), split)


def _json_rows(path: Path) -> list[tuple[str, object]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):  # one JSON list of objects
        try:
            return [(f"{path} item {i}", row) for i, row in enumerate(json.loads(text))]
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    rows = []
    for i, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                rows.append((f"{path}:{i}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i}: not valid JSON ({e.msg})") from None
    return rows


def _csv_rows(path: Path) -> list[tuple[str, object]]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, skipinitialspace=True)
        # line_num after a row is read: its last line in the file (a quoted field may span lines)
        return [(f"{path}:{reader.line_num}", row) for row in reader]


def _parquet_rows(path: Path) -> list[tuple[str, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow), "
                        f"or convert the file to JSONL or CSV") from None
    return [(f"{path} row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist())]


def parse_dataset_id(source: str) -> tuple[str, str | None, str | None]:
    """'openai/gsm8k:main:test' -> ('openai/gsm8k', 'main', 'test'); empty parts are None."""
    name, config, split = (source.split(":") + [None, None])[:3]
    return name, config or None, split or None


def _hub_rows(source: str, split: str | None) -> list[tuple[str, object]]:
    name, config, id_split = parse_dataset_id(source)
    split = split or id_split or "train"
    try:
        import datasets
    except ImportError:
        raise DataError(f"{source}: not a local file, and reading it as a Hugging Face dataset needs "
                        f"`pip install datasets`; or {LOCAL_HINT}") from None
    try:
        rows = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # offline, no such dataset / config / split: the library's messages vary
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise DataError(f"{source}: could not load Hugging Face dataset {name!r} (config {config}, "
                        f"split {split}): {type(e).__name__}: {reason}; offline? {LOCAL_HINT}") from None
    return [(f"{source} row {i}", dict(row)) for i, row in enumerate(rows)]
