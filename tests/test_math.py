"""Math: \\boxed extraction, math-verify equivalence, MATH-500 and AIME rows (grpo.infra.data.load_examples)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo.envs.math import MathEnv, aime_example, is_equiv, last_boxed
from grpo.envs.tasks import load_task
from grpo.infra.data import load_examples

DATA = Path(__file__).parents[2] / "shared" / "data"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"{DATA} absent")


def traj(text):
    return SimpleNamespace(text=text, turns=[text], observations=[], finish_reason="stop", num_turns=1)


@pytest.mark.parametrize("text, boxed", [
    ("so $\\boxed{5}$.", "5"),
    ("first \\boxed{1}, then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last one
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("\\fbox{x^{2}}", "x^{2}"),
    ("$\\boxed 7$", "7"),
    ("\\boxed{\\frac{1}{2}", None),  # unbalanced
    ("no box", None),
])
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


def test_is_equiv():
    assert is_equiv("0.5", "\\frac{1}{2}")
    assert is_equiv("(3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)")
    assert is_equiv("\\dfrac{14}{3}", "\\frac{14}{3}")
    assert is_equiv("25", "025") and is_equiv("1,000", "1000")
    assert not is_equiv("3", "4") and not is_equiv("", "4") and not is_equiv("\\frac{", "1")
    # in a worker thread math-verify's signal timeout cannot work: it must still answer
    out = []
    worker = threading.Thread(target=lambda: out.append(is_equiv("\\frac{2}{4}", "\\frac{1}{2}")))
    worker.start()
    worker.join(30)
    assert out == [True]


def test_is_equiv_in_a_thread_never_hangs():
    # a reward thread: SymPy would compute 9^(9^(9^9)) for hours; the child process gives up
    # at the timeout, the answer counts as wrong, and the next call gets a fresh child
    with ThreadPoolExecutor(1) as pool:
        start = time.time()
        assert pool.submit(is_equiv, "9^{9^{9^{9}}}", "\\frac{1}{2}", 2).result(timeout=60) is False
        assert time.time() - start < 30
        assert pool.submit(is_equiv, "\\frac{2}{4}", "\\frac{1}{2}").result(timeout=60) is True


@needs_data
def test_math500_rows():
    env, rows = load_task("math500", str(DATA / "math500" / "test.jsonl"))
    assert len(rows) == 500 and isinstance(env, MathEnv)
    assert env.stop_strings == [] and env.max_turns == 1
    assert "\\boxed{}" in env.prompt(rows[0])[0]["content"]
    for row in rows[:20]:
        assert env.reward(row, traj(row["solution"]))["correct"] == 1.0, row["unique_id"]
        assert env.reward(row, traj("The answer is \\boxed{-987654321}."))["correct"] == 0.0


@needs_data
def test_aime():
    a24 = load_examples(DATA / "aime" / "aime24.jsonl", prepare=aime_example)
    a25 = load_examples(DATA / "aime" / "aime25.jsonl", prepare=aime_example)
    assert len(a24) == len(a25) == 30 and load_task("aime25", str(DATA / "aime" / "aime25.jsonl"))[1] == a25
    assert all(r["answer"] == str(int(r["answer"])) for r in a24 + a25)  # '025' -> '25'
    assert not any("\x0c" in r["question"] or "\t" in r["question"] for r in a25)
    assert "\\frac" in next(r for r in a25 if r["id"] == "18")["question"]
    assert "\\triangle" in next(r for r in a25 if r["id"] == "19")["question"]
    env = MathEnv()
    row = a24[0]
    assert env.reward(row, traj(f"... so $\\boxed{{{int(row['answer']):03d}}}$"))["correct"] == 1.0
