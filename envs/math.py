"""Competition math with a final \\boxed{} answer: MATH-500, AIME 2024 and AIME 2025.

Equivalence is math-verify's (LaTeX and expressions parsed to SymPy). It bounds its own
time with signal.alarm, which only works in the main thread; elsewhere (a reward thread
pool) we call it without a timeout, and the reference answers here are short.
"""

import json
import threading
from pathlib import Path

from math_verify import parse, verify
from math_verify.errors import TimeoutException

PROMPT_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} or \\fbox{...} (nested braces kept), or the
    token after '\\boxed ' in the brace-less form; None if absent or unbalanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    if text.startswith(" ", i):  # \boxed 5$
        rest = text[i:].strip()
        return rest.split("$")[0].split()[0] if rest and rest[0] != "$" else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += (text[j] == "{") - (text[j] == "}")
        if depth == 0:
            return text[i + 1:j]
    return None


def _plain_number(s: str) -> float | None:
    try:
        return float(s.replace(",", "").strip())
    except ValueError:
        return None


def is_equiv(pred: str, target: str, timeout_s: int = 5) -> bool:
    """True if two final answers are the same mathematical object. Never raises."""
    a, b = _plain_number(pred), _plain_number(target)
    if a is not None and b is not None:  # fast path: AIME integers, plain numbers
        return a == b
    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(f"${target}$", parsing_timeout=timeout)
        answer = parse(f"${pred}$", parsing_timeout=timeout)
        return bool(gold and answer and verify(gold, answer, timeout_seconds=timeout))
    except (Exception, TimeoutException):  # TimeoutException is a BaseException
        return False


# ----------------------------------------------------------------------------
# data


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def load_math500(path) -> list[dict]:
    """{question, answer (LaTeX), solution, subject, level, unique_id}."""
    return [{**row, "question": row["problem"]} for row in _jsonl(path)]


def load_aime(path) -> list[dict]:
    """AIME24/25 -> {question, answer ('25', not the file's '025'), id}. aime25 has three
    problems whose '\\f' and '\\t' were decoded as control characters (data/aime/SOURCE.md)."""
    out = []
    for row in _jsonl(path):
        question = row["problem"].replace("\x0c", "\\f").replace("\t", "\\t")
        out.append({"question": question, "answer": str(int(row["answer"])), "id": row["id"]})
    return out


def load(path, task: str = "math500") -> list[dict]:
    """load_aime for 'aime24' / 'aime25', else load_math500."""
    return load_aime(path) if task.startswith("aime") else load_math500(path)


class MathEnv:
    stop_strings: list[str] = []
    max_turns = 1

    def prompt(self, example: dict) -> list[dict]:
        return [{"role": "user", "content": example["question"] + PROMPT_SUFFIX}]

    def extract(self, trajectory) -> str | None:  # for eval records
        return last_boxed(trajectory.text)

    def reward(self, example: dict, trajectory) -> dict[str, float]:
        boxed = last_boxed(trajectory.text)
        return {"correct": float(boxed is not None and is_equiv(boxed, str(example["answer"])))}
