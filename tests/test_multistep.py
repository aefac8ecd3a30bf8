"""The fresh multi-step generator (grpo.envs.multistep) and the ProcessGRPO reference's prompt,
scorer and data (grpo.envs.processgrpo): determinism, splits, exact answers recomputed from each
chain, ASCII-only numbers, the worked-example layout, the sources and the solve-rate filter."""
import hashlib
import json
import os
import re
import subprocess
import sys
from fractions import Fraction

import pytest

from grpo.engine.sampler import Completion
from grpo.envs import multistep
from grpo.envs.processgrpo import (PROMPT_SUFFIX, WORKED_QUESTION, WORKED_SOLUTION, OneShotMathEnv,
                                   filter_by_solve_rate, load_sources, parse_number, score)
from grpo.infra.data import DataError
from grpo.process import step_ends
from grpo.rollout import Trajectory

DIGEST = ("import hashlib, json; from grpo.envs.multistep import test_set; "
          "print(hashlib.sha256(json.dumps(test_set()).encode()).hexdigest())")


@pytest.mark.slow  # a process of its own
def test_deterministic_under_a_seed_in_any_process():
    a, b = multistep.generate("train", 6, seed=3), multistep.generate("train", 6, seed=3)
    assert a == b and a != multistep.generate("train", 6, seed=4)
    # str seeds and SHA-256 routing: the same set whatever the interpreter's hash seed
    here = hashlib.sha256(json.dumps(multistep.test_set()).encode()).hexdigest()
    there = subprocess.run([sys.executable, "-c", DIGEST], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345", "PATH": "",   # PYTHONPATH kept: where grpo is
                                **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}}).stdout.strip()
    assert here == there


def test_split_by_operation_count():
    problems = multistep.test_set()
    assert len(problems) == 700
    groups = multistep.by_ops(problems)
    assert list(groups) == list(range(2, 9)) and all(len(idx) == 100 for idx in groups.values())
    assert [p["num_ops"] for p in problems[:14]] == list(range(2, 9)) * 2   # round-robin: prefixes mix them
    assert {p["domain"] for p in problems} == set(multistep.DOMAINS)
    for p in problems:
        assert len(p["steps"]) == p["num_ops"], p
        # one operation per sentence: start + operations + question (the rates' last one is in the question)
        sentences = re.split(r"(?<=[.?])\s+", p["question"])
        assert len(sentences) == p["num_ops"] + (1 if p["domain"] == "rates" else 2), p["question"]


def test_train_validation_test_never_share_a_text():
    sets = {split: [p["question"] for seed in (0, 1, 2) for p in multistep.generate(split, 20, seed)]
            for split in multistep.SPLITS}
    for split, texts in sets.items():
        assert all(multistep.route(t) == split for t in texts), split      # the stated rule
    train, validation, test = (set(sets[s]) for s in multistep.SPLITS)
    assert not (train & validation) and not (train & test) and not (validation & test)
    one = [p["question"] for p in multistep.generate("validation", 50)]
    assert len(set(one)) == len(one)                                          # distinct within a set


def _money(x: Fraction) -> str:
    cents = int(x * 100)
    return f"${cents // 100}" if cents % 100 == 0 else f"${cents // 100}.{cents % 100:02d}"


def test_answers_are_exact_recomputed_from_each_chain():
    for p in multistep.test_set() + multistep.generate("train", 30, seed=7):
        money = multistep.DOMAINS[p["domain"]]["kind"] == "money"
        values = [Fraction(p["start"])]                 # recomputed here, not with chain_values
        for op, x in p["steps"]:
            y = values[int(x[1:])] if x.startswith("v") else Fraction(x)
            v = values[-1]
            values.append({"add": v + y, "sub": v - y, "mul": v * y, "div": v / y}[op])
            if op in ("add", "sub") and not x.startswith("v"):   # the text states the operand
                assert (_money(y) if money else str(y)) in p["question"], (x, p["question"])
        unit = Fraction(1, 100) if money else 1          # whole cents or whole counts at every step
        assert all(v > 0 and (v / unit).denominator == 1 for v in values), (p, values)
        assert Fraction(p["answer"]) == values[-1], p    # a decimal string: exact, so terminating
        assert p["answer"] == multistep.exact_decimal(values[-1])
        assert score(f"so \\boxed{{{p['answer']}}}", p["answer"]) == 1.0


def test_scorer_reads_exact_ascii_numbers_only():
    assert parse_number("1,234") == 1234 and parse_number("$12.50") == Fraction(25, 2)
    assert parse_number("\\$1{,}234.5") == Fraction(2469, 2) and parse_number("1\\,000") == 1000
    assert parse_number("3/4") == parse_number("\\frac{3}{4}") == parse_number("0.75") == Fraction(3, 4)
    assert parse_number("-\\dfrac{3}{4}") == Fraction(-3, 4) and parse_number("\u22125") == -5
    assert parse_number("\\frac43") == Fraction(4, 3) and parse_number("\\frac123") != Fraction(1, 23)
    assert parse_number("13 \\text{ boxes}") == 13 and parse_number("78 / 6 = 13") == 13
    # MATH's brace-less \frac43 and degrees (MATH-500 answers such as '90^\circ')
    assert parse_number("\\frac43") == Fraction(4, 3) and parse_number("-\\dfrac12") == Fraction(-1, 2)
    assert parse_number("90^\\circ") == parse_number("90^{\\circ}") == 90 and parse_number("\\frac{4}3") is None
    for bad in ("١٢", "１２", "12²", "1,23", "5 or 6", "12 + 3", "2/0", "", "x"):   # not digits we read
        assert parse_number(bad) is None, bad
    assert score("\\boxed{١٣}", "13") == 0.0 and score("\\boxed{１３}", "13") == 0.0
    assert score("\\boxed{13.00}", "13") == 1.0 and score("\\boxed{0.3333}", "1/3") == 0.0
    assert score("\\boxed{12} then \\boxed{13}", "13") == 1.0 and score("13", "13") == 0.0   # the last box
    traj = Trajectory({}, 0, [], [], [], [], "stop", 1, text="no box: 13")
    assert OneShotMathEnv().reward({"answer": "13"}, traj) == {"correct": 0.0, "format": 0.0}


def test_worked_example_prompt_layout(smollm2_path):
    env, ex = OneShotMathEnv(), multistep.test_set()[3]
    messages = env.prompt(ex)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert PROMPT_SUFFIX == "\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert messages[0]["content"] == WORKED_QUESTION + PROMPT_SUFFIX
    assert messages[2]["content"] == ex["question"] + PROMPT_SUFFIX
    solution = messages[1]["content"]
    assert solution == WORKED_SOLUTION and solution.endswith("\\boxed{13}.")
    assert len(step_ends(list(solution))) == 3           # paragraphs: the steps grpo.process credits
    worked = Trajectory({}, 0, [], [], [], [], "stop", 1, text=solution)
    assert env.reward({"answer": "13"}, worked) == {"correct": 1.0, "format": 1.0}
    from transformers import AutoTokenizer

    from grpo.rollout import render_prompt
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    text = tok.decode(render_prompt(tok, messages))
    assert text.index(WORKED_QUESTION) < text.index(WORKED_SOLUTION) < text.index(ex["question"])
    assert text.endswith(PROMPT_SUFFIX + "<|im_end|>\n<|im_start|>assistant\n"), text[-120:]


def test_sources(tmp_path):
    assert len(load_sources("multistep:train:2")) == 14
    data = tmp_path / "mixed.jsonl"
    rows = [{"question": "q1", "answer": "Work.\n#### 1,234"}, {"problem": "q2", "answer": "\\frac{3}{4}"},
            {"problem": "q3", "answer": "x^2 + 1"}]                 # GSM8K, a MATH number, a MATH expression
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_sources(f"{data},multistep:test:1")
    assert [g["answer"] for g in got[:2]] == ["1234", "\\frac{3}{4}"] and len(got) == 2 + 7
    with pytest.raises(DataError, match="multistep:SPLIT:N"):
        load_sources("multistep:dev:3")


class ScriptedSampler:
    """Problem p's n samples: the first solves[p] box the right answer, the rest a wrong one."""
    def __init__(self, tok, examples, solves):
        self.tok, self.examples, self.solves = tok, examples, solves

    def generate(self, prompts, params, tool=None, progress=False, prompt_ids=None):
        out = []
        for i, p in enumerate(prompt_ids):
            for j in range(params.n):
                right = j < self.solves[p]
                answer = self.examples[p]["answer"] if right else "-1"
                ids = self.tok.encode(f"Step.\n\nSo \\boxed{{{answer}}}.", add_special_tokens=False)
                out.append(Completion(i, j, ids, [1] * len(ids), [0.0] * len(ids), "stop"))
        return out


def test_filter_keeps_problems_solved_1_to_7_times_in_8(smollm2_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    examples = multistep.generate("train", 2)[:10]
    solves = [0, 1, 4, 7, 8, 3, 8, 0, 2, 6]
    sampler = ScriptedSampler(tok, examples, solves)
    # chunks of 4: the prompt offsets carry across chunks
    kept, solved, cost = filter_by_solve_rate(sampler, tok, OneShotMathEnv(), examples, chunk=4)
    assert solved == solves
    assert kept == [ex for ex, s in zip(examples, solves) if 1 <= s <= 7]
    assert len(kept) == 6 and examples[1] in kept and examples[3] in kept   # 1 and 7 kept
    assert not any(examples[i] in kept for i in (0, 4, 6, 7))              # 0 and 8 dropped
    # its cost: 8 samples a problem, every sampled token counted, one prompt prefill a problem
    ids = lambda answer: tok.encode(f"Step.\n\nSo \\boxed{{{answer}}}.", add_special_tokens=False)
    want = sum(len(ids(ex["answer"])) * s + len(ids("-1")) * (8 - s) for ex, s in zip(examples, solves))
    assert cost["samples"] == 80 and cost["completion_tokens"] == want
    assert cost["prompt_tokens"] > 10 * 50 and cost["seconds"] >= 0
