"""Competition math with a final \\boxed{} answer: MATH-500, AIME 2024 and AIME 2025.

Equivalence is math-verify's (LaTeX and expressions parsed to SymPy). It bounds its own
time with signal.alarm, which only works in the main thread. Rewards are scored in a thread
pool (grpo/rollout.py), where a model's \\boxed{9^{9^{9^9}}} would keep SymPy busy for hours
and stall the run; so off the main thread the check runs in a child process (its main thread:
the timeout works there), which is also killed if it does not answer soon after (the answer
then counts as wrong) and restarted on the next call.
"""

import json
import os
import select
import subprocess
import sys
import threading

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
    """True if two final answers are the same mathematical object. Never raises, never hangs:
    past timeout_s the answer counts as wrong."""
    a, b = _plain_number(pred), _plain_number(target)
    if a is not None and b is not None:  # fast path: AIME integers, plain numbers
        return a == b
    if threading.current_thread() is threading.main_thread():
        return _math_verify(pred, target, timeout_s)
    return _CHILD.check(pred, target, timeout_s)


def _math_verify(pred: str, target: str, timeout_s: int | None) -> bool:
    try:
        gold = parse(f"${target}$", parsing_timeout=timeout_s)
        answer = parse(f"${pred}$", parsing_timeout=timeout_s)
        return bool(gold and answer and verify(gold, answer, timeout_seconds=timeout_s))
    except (Exception, TimeoutException):  # TimeoutException is a BaseException
        return False


def serve():  # the child's loop, in its main thread (so math-verify's own timeout works there too):
    for line in sys.stdin:  # a JSON [pred, target, timeout_s] per line in, "1" or "0" per line out
        print(int(_math_verify(*json.loads(line))), flush=True)


class _Child:
    """One child process for math-verify off the main thread; calls take turns (a check is
    milliseconds). A fresh interpreter, not multiprocessing: fork would copy a training process
    with threads, and spawn would re-run the user's script in the child."""
    def __init__(self):
        self.lock, self.proc = threading.Lock(), None

    def check(self, pred: str, target: str, timeout_s: float) -> bool:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                code = f"import {__name__} as m; m.serve()"  # this module, under the name it was imported as
                env = os.environ | {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
                self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, text=True, env=env)
                # the first answer waits for python and sympy to import
                if self._ask("1", "1", 5, wait_s=120) is None:
                    return False
            return bool(self._ask(pred, target, timeout_s, wait_s=timeout_s + 2))

    def _ask(self, pred: str, target: str, timeout_s: float, wait_s: float) -> bool | None:
        try:
            self.proc.stdin.write(json.dumps([pred, target, timeout_s]) + "\n")
            self.proc.stdin.flush()
            if select.select([self.proc.stdout], [], [], wait_s)[0]:  # wait_s: for work that no signal stops
                line = self.proc.stdout.readline()
                if line:
                    return line.strip() == "1"
        except OSError:  # the child died
            pass
        self.proc.kill()  # still busy (stuck in C), or gone: the next call starts a fresh one
        self.proc.wait()
        self.proc = None
        return None


_CHILD = _Child()


# ----------------------------------------------------------------------------
# data (rows come from grpo.infra.data.load_examples; MATH-500's `problem` column is its question)


def aime_example(example: dict) -> dict:
    """AIME rows as load_examples gives them -> answer '25', not a file's '025'. The aime25 file
    (and HF math-ai/aime25) has three problems whose '\\f' and '\\t' were decoded as control
    characters (\\frac as form feed + 'rac'): restored here."""
    question = example["question"].replace("\x0c", "\\f").replace("\t", "\\t")
    answer = example["answer"]
    try:
        answer = answer if answer is None else str(int(answer))  # None: load_examples says which column
    except ValueError:
        raise ValueError(f"an AIME answer is an integer, got {answer!r}") from None
    return {**example, "question": question, "answer": answer}


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
