"""The calculator env: exact tool, hostile YAML, rewards, judge, question generator, loader."""

import collections
import json
import re
import threading
import time
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import pytest

from grpo.envs.calculator import (
    DEFAULT_WEIGHTS,
    CalculatorEnv,
    evaluate,
    final_answer,
    generate_questions,
    gold_call,
    gold_messages,
    judge_score,
    judge_scores,
    load_questions,
    parse_expression,
    parse_number,
    run_tool,
    split_of,
    structure_credit,
)


def call(yaml_text: str) -> str:
    return run_tool(f"<calculator>\n{yaml_text}\n</calculator>")


def traj(*turns: str, observations=()) -> SimpleNamespace:
    return SimpleNamespace(text="".join(turns), turns=list(turns), observations=list(observations),
                           finish_reason="stop", num_turns=len(turns))


# ----------------------------------------------------------------------------
# run_tool


def test_reference_example_nested():
    # the reference run's example (Danau5tin/calculator_agent_rl's README): 987*654 + 987/(321+11),
    # block style with unindented lists
    text = """operation: add
operands:
- operation: multiply
  operands:
  - 987
  - 654
- operation: divide
  operands:
  - 987
  - operation: add
    operands:
    - 321
    - 11"""
    assert call(text) == "<output>645500.9729</output>"


@pytest.mark.parametrize("yaml_text, out", [
    ("operation: multiply\noperands: [4829, 736]", "3554144"),  # integers exact
    ("operation: add\noperands: [0.1, 0.2]", "0.3"),  # exact decimals, not 0.30000000000000004
    ("operation: subtract\noperands: [10, 1, 2, 3]", "4"),  # left to right
    ("operation: divide\noperands: [1, 3]", "0.3333333333"),  # 10 significant digits
    ("operation: divide\noperands: [-2, 3]", "-0.6666666667"),
    ("operation: divide\noperands: [1, 3, 1000000000]", "3.333333333e-10"),
    ("operation: multiply\noperands: [\"1,234.5\", 2]", "2469"),
    ("{operation: Add, operands: [1.5e3, {operation: divide, operands: [7, {operation: multiply, operands: [2, 0.5]}]}]}", "1507"),
    ("operation: multiply\noperands: [99999999999, 99999999999]", "9999999999800000000001"),
    ("```yaml\noperation: add\noperands: [1, 2]\n```", "3"),  # a markdown fence inside the block
])
def test_run_tool_values(yaml_text, out):
    assert call(yaml_text) == f"<output>{out}</output>"


ERRORS = {  # input -> a word the error message must contain
    "missing block": ("<calculator>operation: add", "no <calculator>"),
    "bad yaml": (call("operation: add\noperands: [1, 2"), "invalid YAML"),
    "empty": (call(""), "empty"),
    "unknown op": (call("operation: power\noperands: [2, 3]"), "unknown operation"),
    "one operand": (call("operation: subtract\noperands: [2]"), "at least 2"),
    "operands not a list": (call("operation: add\noperands: 3"), "must be a list"),
    "missing operands": (call("operation: add"), "needs both"),
    "extra key": (call("operation: add\noperands: [1, 2]\nunits: cm"), "unexpected key"),
    "not a mapping": (call("[1, 2]"), "expected a number or a mapping"),
    "word operand": (call("operation: add\noperands: [one, 2]"), "not a number"),
    "bool operand": (call("operation: add\noperands: [true, 2]"), "not a number"),
    "division by zero": (call("operation: divide\noperands: [1, {operation: subtract, operands: [2, 2]}]"), "division by zero"),
}


@pytest.mark.parametrize("name", ERRORS)
def test_run_tool_errors(name):
    text, word = ERRORS[name]
    out = text if text.startswith("<output>") else run_tool(text)
    assert out.startswith("<output>Error: ") and word in out, out


# hostile input (alias bombs, huge numbers, deep nesting, unclosed tags...): tests/test_hostile.py


# ----------------------------------------------------------------------------
# rewards and the env


def test_parse_number_formats():
    assert parse_number("1,234.5") == 1234.5
    assert parse_number("$1,234.50") == 1234.5
    assert parse_number("-3.2e4") == -32000
    assert parse_number("is \u22127 degrees") == -7
    assert parse_number("**42**") == 42
    assert parse_number("none") is None


@pytest.mark.parametrize("final, correct, fmt", [
    ("The total is 3,554,144.\nAnswer: 3554144", 1.0, 1.0),
    ("Answer: $3,554,144.00", 1.0, 1.0),
    ("**Answer:** 3554144", 1.0, 1.0),
    ("Answer: 3.554144e6", 1.0, 1.0),
    ("It is 3554144", 1.0, 0.0),  # no Answer line: the last number still counts for `correct`
    ("Answer: 3554000", 0.0, 1.0),  # an estimate, 4e-5 off, is wrong at rel 1e-6
    ("Answer: 3554144 dollars", 1.0, 0.0),
    ("<calculator>\noperation: add", 0.0, 0.0),  # cut off in a tool call
])
def test_reward_terms(final, correct, fmt):
    env = CalculatorEnv()
    obs = ["<output>3554144</output>"]
    r = env.reward({"question": "q", "answer": 3554144.0},
                   traj("<calculator>\noperation: multiply\noperands: [4829, 736]\n</calculator>", final, observations=obs))
    assert r["correct"] == correct and r["format"] == fmt and r["tool_use"] == 1.0
    assert set(r) <= set(DEFAULT_WEIGHTS)


def test_reward_tool_use_and_near_zero():
    env = CalculatorEnv()
    assert env.reward({"answer": 0.0}, traj("Answer: 0.0000001"))["correct"] == 1.0  # abs 1e-6 near 0
    assert env.reward({"answer": 5}, traj("Answer: 5"))["tool_use"] == 0.0  # no call
    bad = traj("<calculator>x</calculator>", "Answer: 5", observations=["<output>Error: invalid YAML</output>"])
    assert env.reward({"answer": 5}, bad)["tool_use"] == 0.0
    assert final_answer(traj("Answer: 7\nActually, Answer: 8")) == 8


@pytest.mark.parametrize("yaml_text, credit", [
    ("operation: multiply\noperands:\n  - operation: add\n    operands: [4, 3]\n  - 12.5", 1.0),  # gold
    ("operation: multiply\noperands:\n  - 12.5\n  - operation: add\n    operands: [3, 4]", 1.0),  # commuted
    ("operation: add\noperands: [3, 4]", 0.5),                   # the inner step only
    ("operation: multiply\noperands: [3, 12.5]", 0.0),           # flat, wrong operands
    ("operation: subtract\noperands: [4, -3]", 0.5),             # 4 - -3 = 7: values, not text
    ("operation: add\noperands: [3, 4, 0, 0, 0]", 0.25),         # 7 four times: one match over 4 steps
    ("operation: add\noperands: [3]", 0.0),                      # an error scores 0
])
def test_structure_credit(yaml_text, credit):
    example = {"expression": "(3 + 4) * 12.5", "question": "q", "answer": "87.5"}
    assert structure_credit(example, traj(f"<calculator>\n{yaml_text}\n</calculator>", "Answer: 1")) == credit


def test_structure_credit_last_call_and_env_switch():
    example = {"expression": "1 - 2 / 5", "question": "q", "answer": "0.6"}
    right, flat = gold_call(example), "<calculator>\noperation: subtract\noperands: [1, 2]\n</calculator>"
    assert structure_credit(example, traj(right, "Answer: 0.6")) == 1.0
    assert structure_credit(example, traj(right, flat, "Answer: -1")) == 0.0  # the last call counts
    assert structure_credit(example, traj(flat, right, "Answer: 0.6")) == 1.0
    assert structure_credit(example, traj("Answer: 0.6")) == 0.0  # no call
    assert structure_credit({"question": "q", "answer": 0.6}, traj(right)) == 0.0  # no expression
    assert "structure" not in CalculatorEnv().reward(example, traj(right, "Answer: 0.6"))  # off by default
    r = CalculatorEnv(structure=True).reward(example, traj(flat, "Answer: -1"))
    assert r["structure"] == 0.0 and r["correct"] == 0.0


def test_env_step_and_prompt():
    env = CalculatorEnv()
    assert env.stop_strings == ["</calculator>"] and env.observation_role == "user" and env.max_turns >= 2
    msgs = env.prompt({"question": "What is 2 + 2?"})
    assert [m["role"] for m in msgs] == ["system", "user"] and "<calculator>" in msgs[0]["content"]
    assert env.step("Let me compute.\n<calculator>\noperation: add\noperands: [2, 2]\n</calculator>") == "<output>4</output>"
    assert env.step("The answer is 4.\nAnswer: 4") is None


# ----------------------------------------------------------------------------
# the judge, against a local server that speaks chat completions


def _server(reply):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert self.path == "/v1/chat/completions" and body["model"] == "judge" and body["messages"]
            status, payload = reply(body)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(payload.encode())

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}/v1"


def _ok(content):
    return 200, json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]})


def test_judge_success_and_concurrency():
    server, url = _server(lambda body: _ok("8" if "Answer: 4" in body["messages"][0]["content"] else "2"))
    try:
        assert judge_score("2+2?", 4, "Answer: 4", url, "judge") == 0.8
        items = [("2+2?", 4, "Answer: 4"), ("2+2?", 4, "Answer: 5")] * 8
        assert judge_scores(items, url, "judge", max_workers=8) == [0.8, 0.2] * 8
        env = CalculatorEnv(judge_base_url=url, judge_model="judge")
        assert env.reward({"question": "2+2?", "answer": 4}, traj("Answer: 4"))["judge"] == 0.8
    finally:
        server.shutdown()


@pytest.mark.parametrize("reply", [
    lambda body: (500, "oops"),
    lambda body: (200, "not json"),
    lambda body: (200, json.dumps({"choices": []})),
    lambda body: _ok("no score here"),
    lambda body: (time.sleep(1.5), *_ok("9"))[1:],  # slower than the timeout
])
def test_judge_failures_score_zero(reply):
    server, url = _server(reply)
    try:
        assert judge_score("q", 1, "Answer: 1", url, "judge", timeout=0.5) == 0.0
    finally:
        server.shutdown()
    assert judge_score("q", 1, "Answer: 1", "http://127.0.0.1:9", "judge", timeout=0.5) == 0.0  # refused


# ----------------------------------------------------------------------------
# questions


def test_generator_deterministic_and_exact():
    a, b = generate_questions(300, seed=7), generate_questions(300, seed=7)
    assert a == b and a != generate_questions(300, seed=8)
    for q in a:
        assert set(q) == {"question", "expression", "answer", "ops", "family", "phrasing"} and q["question"].strip()
        value = evaluate(parse_expression(q["expression"]))
        assert q["answer"] == float(value)
        assert eval(q["expression"]) == pytest.approx(q["answer"], rel=1e-9)  # plain Python infix
    # the tool, fed the gold call, gives the same answer to its 10 digits
    for q in a[:100]:
        msgs = gold_messages(q)
        assert CalculatorEnv().gold_messages(q) == msgs
        out = run_tool(msgs[0]["content"])
        assert msgs[1] == {"role": "user", "content": out} and msgs[0]["content"] == gold_call(q)
        assert float(out[len("<output>"):-len("</output>")]) == pytest.approx(q["answer"], rel=1e-9)
        assert msgs[2]["content"].splitlines()[-1].startswith("Answer: ")
        assert CalculatorEnv().reward(q, traj(*[m["content"] for m in msgs[::2]], observations=[out])) == \
            {"correct": 1.0, "tool_use": 1.0, "format": 1.0}


def test_heldout_phrasings_unseen_in_training():
    """The three books (warm-start, GRPO, held-out) share no template, and no book's own wording
    (a template's fixed words) shows up in another book's question; each question
    holds exactly its expression's numbers; every family of both books is drawn."""
    from grpo.envs.calculator_phrasing import HELDOUT, RL, TRAIN, templates
    assert not templates(TRAIN) & templates(HELDOUT) and not templates(RL) & (templates(TRAIN) | templates(HELDOUT))

    def fragments(book):  # the fixed words between placeholders, long enough to be distinctive
        parts = set()
        for t in templates(book):
            parts.update(f.strip(" .,;?:") for f in re.split(r"\{\w+\}", t))
        return {f for f in parts if len(f) >= 9}

    books = {"train": TRAIN, "heldout": HELDOUT, "rl": RL}
    questions = {"train": generate_questions(2000, seed=0), "rl": generate_questions(600, seed=0, phrasing="rl"),
                 "heldout": generate_questions(600, seed=1, split="eval", phrasing="heldout")}
    for name, qs in questions.items():  # no question holds another book's own wording
        foreign = set().union(*(fragments(b) for n, b in books.items() if n != name)) - fragments(books[name])
        for q in qs:
            hits = [f for f in foreign if f.lower() in q["question"].lower()]
            assert not hits, (name, q["question"], hits)
    train, held = questions["train"], questions["heldout"]
    assert {q["family"] for q in questions["rl"]} == {"noun", "verb", "steps", "symbols"}
    for q in train[:300] + held[:300] + questions["rl"][:300]:
        numbers = sorted(re.findall(r"[0-9]+(?:\.[0-9]+)?", q["question"]))
        assert numbers == sorted(re.findall(r"[0-9]+(?:\.[0-9]+)?", q["expression"])), q
    assert {q["family"] for q in train} == {"noun", "verb", "steps", "symbols"}
    assert {q["family"] for q in held} == {"noun", "gerund", "steps", "symbols"}
    assert {q["phrasing"] for q in held} == {"heldout"} and all("×" in q["question"] or "*" not in q["question"]
                                                                for q in held)
    assert min(q["ops"] for q in generate_questions(100, seed=0, min_ops=2)) == 2
    capped = generate_questions(100, seed=0, split="eval", phrasing="heldout", max_ops=4)
    assert len(capped) == 100 and {q["ops"] for q in capped} == {1, 2, 3, 4}


def test_generator_splits_disjoint_and_spread():
    train, test = generate_questions(3000, seed=0), generate_questions(1000, seed=0, split="eval")
    assert not {q["expression"] for q in train} & {q["expression"] for q in test}
    assert all(split_of(q["expression"]) == "train" for q in train)
    assert len({q["expression"] for q in train}) == len(train)  # no repeats within a split
    ops = collections.Counter(q["ops"] for q in train)
    assert set(ops) == {1, 2, 3, 4, 5, 6}
    assert sum(ops[k] for k in (2, 3, 4, 5)) / len(train) > 0.75  # mostly 2 to 5 operations
    assert len({q["question"].split()[0] for q in train}) >= 10  # many phrasings
    assert sum(q["answer"] != int(q["answer"]) for q in train) > len(train) / 3  # not only integers


# ----------------------------------------------------------------------------
# a user's file


def test_load_questions(tmp_path):
    csv_path = tmp_path / "q.csv"
    csv_path.write_text('question,expression,answer\n"What is 4829 multiplied by 736?", 4829*736,3554144.0\n'
                        '"Sum of 1,000 and 2?",1000 + 2,"1,002"\n"Half of 3?",3/2,\n')
    rows = load_questions(csv_path)
    assert [r["answer"] for r in rows] == [3554144.0, 1002.0, 1.5]  # the last computed from its expression
    assert gold_call(rows[0]).count("- ") == 2
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text('{"prompt": "What is 2+2?", "answer": 4}\n\n{"question": "3*3?", "answer": "9"}\n')
    assert [(r["question"], r["answer"]) for r in load_questions(jsonl)] == [("What is 2+2?", 4.0), ("3*3?", 9.0)]


@pytest.mark.parametrize("name, text, message", [
    ("a.csv", "prompt_text,answer\nhi,3\n", "a.csv:2: missing column 'question'"),
    ("b.csv", "question,expression\nhi,\n", "b.csv:2: missing column 'answer'"),
    ("c.jsonl", '{"question": "a", "answer": 1}\n{"question": "b", "answer": 1\n', "c.jsonl:2: not valid JSON"),
    ("d.jsonl", '{"question": "a", "answer": "twelve"}\n', "d.jsonl:1: bad answer"),
    ("e.csv", "question,expression\nhi,1/(2-2)\n", "e.csv:2: bad answer or expression"),
    ("f.jsonl", '[1, 2]\n', "f.jsonl:1: expected an object"),
])
def test_load_questions_errors(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_questions(tmp_path / name)


def test_parse_expression():
    assert evaluate(parse_expression("1 - (2 - 3) * -4 / 8")) == Fraction(1, 2)  # 1 - 4/8
    assert evaluate(parse_expression("(987 * 654) + 987 / (321 + 11)")) == Fraction(987 * 654) + Fraction(987, 332)
    for bad in ("(1 + 2", "1 + + 2", "2 ** 3", "import os"):
        with pytest.raises(ValueError):
            parse_expression(bad)
