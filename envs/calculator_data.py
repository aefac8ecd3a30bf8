"""Calculator questions: a seeded generator, an infix parser, and a CSV/JSONL loader.

An expression tree is either a number literal (a str such as "17.5", kept as written so
that it renders exactly) or a tuple (op, left, right) with op in OPS. Every operation
is binary here; the tool itself also accepts longer operand lists.

Generated questions copy the shape of the reference run's data (the dataset section of the
README of github.com/Danau5tin/calculator_agent_rl): the four operations, 1 to 6 of them nested
(mostly 2 to 5), numbers a person cannot multiply in their head, and many phrasings of the
question (grpo.envs.calculator_phrasing: a training book, a GRPO-only one and a held-out one).
"""

import csv
import hashlib
import json
import random
import re
from fractions import Fraction
from pathlib import Path

from grpo.envs.calculator_phrasing import BOOKS, question_text

OPS = ("add", "subtract", "multiply", "divide")
SYMBOL = {"add": "+", "subtract": "-", "multiply": "*", "divide": "/"}
PRECEDENCE = {"add": 1, "subtract": 1, "multiply": 2, "divide": 2}
# how many operations a question has: most 2 to 5, as in real nested questions; the
# one-operation kind is kept rare (a warm-start on one-operation calls alone taught SmolLM2 the
# format and solved only the one-operation questions: it learned no nesting)
OPS_WEIGHTS = {1: 0.08, 2: 0.20, 3: 0.26, 4: 0.22, 5: 0.16, 6: 0.08}
EVAL_FRACTION = 0.25  # share of all expressions that the hash routes to the eval split
MAX_ANSWER = 10**13  # answers larger than this, or nonzero and below 1e-3, are redrawn

# ----------------------------------------------------------------------------
# exact evaluation and infix text


def evaluate(tree) -> Fraction:
    """Exact value of a tree; ZeroDivisionError on a zero divisor."""
    if isinstance(tree, str):
        return Fraction(tree)
    op, left, right = tree
    a, b = evaluate(left), evaluate(right)
    if op == "add":
        return a + b
    if op == "subtract":
        return a - b
    if op == "multiply":
        return a * b
    return a / b  # Fraction raises ZeroDivisionError


def to_infix(tree) -> str:
    """Plain infix with the fewest parentheses (Python's eval gives the same value)."""
    if isinstance(tree, str):
        return tree
    op, left, right = tree
    l, r = to_infix(left), to_infix(right)
    if not isinstance(left, str) and PRECEDENCE[left[0]] < PRECEDENCE[op]:
        l = f"({l})"
    # a right child of equal precedence needs parentheses under - and /: a - (b + c)
    if not isinstance(right, str) and (PRECEDENCE[right[0]] < PRECEDENCE[op] or
                                       (PRECEDENCE[right[0]] == PRECEDENCE[op] and op in ("subtract", "divide"))):
        r = f"({r})"
    return f"{l} {SYMBOL[op]} {r}"


_TOKEN = re.compile(r"\s*(?:([0-9]+(?:\.[0-9]*)?|\.[0-9]+)|(.))")  # ASCII digits only, as the tool reads them


def parse_expression(text: str):
    """Infix text (+ - * / x × ÷, parentheses, unary minus) -> tree, by recursive descent."""
    tokens = []
    for number, char in _TOKEN.findall(text.replace(",", "")):
        if char.isspace():
            continue
        tokens.append(number or {"x": "*", "×": "*", "÷": "/"}.get(char, char))
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def take():
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def binary(parse_operand, symbols):  # left-associative chain: a - b - c = (a - b) - c
        tree = parse_operand()
        while peek() is not None and peek() in symbols:
            op = {"+": "add", "-": "subtract", "*": "multiply", "/": "divide"}[take()]
            tree = (op, tree, parse_operand())
        return tree

    def atom():
        token = take() if peek() is not None else None
        if token == "(":
            tree = binary(term, ("+", "-"))
            if peek() != ")":
                raise ValueError(f"missing ')' in {text!r}")
            take()
            return tree
        if token == "-":  # unary minus: fold into a literal, else write 0 - x
            inner = atom()
            if isinstance(inner, str):
                return inner[1:] if inner.startswith("-") else "-" + inner
            return ("subtract", "0", inner)
        if token is None or token[0] not in "0123456789.":
            raise ValueError(f"unexpected {token!r} in expression {text!r}")
        return token

    def term():
        return binary(atom, ("*", "/"))

    tree = binary(term, ("+", "-"))
    if peek() is not None:
        raise ValueError(f"unexpected {peek()!r} in expression {text!r}")
    return tree


# ----------------------------------------------------------------------------
# random trees and their questions


def _number(rng: random.Random) -> str:
    """A number that is tedious by hand: 2 to 5 digits, sometimes with decimals."""
    kind = rng.random()
    if kind < 0.70:
        return str(rng.randint(12, 99999) if rng.random() < 0.5 else rng.randint(101, 9999))
    if kind < 0.90:
        return f"{rng.randint(1, 9999)}.{rng.randint(1, 99):02d}".rstrip("0")
    return f"{rng.randint(1, 999)}.{rng.randint(1, 9)}"


def _tree(rng: random.Random, n_ops: int):
    if n_ops == 0:
        return _number(rng)
    left_ops = rng.randint(0, n_ops - 1)  # the other n_ops - 1 - left_ops go right
    return (rng.choice(OPS), _tree(rng, left_ops), _tree(rng, n_ops - 1 - left_ops))


def count_ops(tree) -> int:
    return 0 if isinstance(tree, str) else 1 + count_ops(tree[1]) + count_ops(tree[2])


def split_of(expression: str) -> str:
    """'train' or 'eval', a pure function of the expression: the splits cannot overlap."""
    h = int.from_bytes(hashlib.sha256(expression.encode()).digest()[:8], "big")
    return "eval" if h < EVAL_FRACTION * 2**64 else "train"


def generate_questions(n: int, seed: int = 0, split: str = "train", phrasing: str = "train",
                       min_ops: int = 1, max_ops: int | None = None) -> list[dict]:
    """n distinct questions {question, expression, answer, ops, family, phrasing}, deterministic
    in (n, seed, split, phrasing, min_ops, max_ops). `split` picks the expressions (a hash of the expression:
    the two splits never share one); `phrasing` the wording, "train", "heldout" or "rl"
    (grpo.envs.calculator_phrasing: the books share no template). `min_ops` drops smaller
    trees (the eval's one-operation questions can be 1-in-12 at most otherwise), `max_ops` larger
    ones."""
    assert split in ("train", "eval"), f"{split=}"
    assert phrasing in BOOKS, f"{phrasing=}"
    suffix = "" if phrasing == "train" else f"-{phrasing}"
    rng = random.Random(f"calculator-{split}-{seed}{suffix}")  # str seeds hash the same in every process
    sizes, weights = list(OPS_WEIGHTS), list(OPS_WEIGHTS.values())
    out, seen = [], set()
    while len(out) < n:
        tree = _tree(rng, rng.choices(sizes, weights)[0])
        if not min_ops <= count_ops(tree) <= (max_ops or count_ops(tree)):
            continue
        expression = to_infix(tree)
        if expression in seen or split_of(expression) != split:
            continue
        try:
            value = evaluate(tree)
        except ZeroDivisionError:
            continue
        if abs(value) > MAX_ANSWER or (value and abs(value) < Fraction(1, 1000)):
            continue
        seen.add(expression)
        question, family = question_text(rng, tree, expression, phrasing)
        out.append({"question": question, "expression": expression, "answer": float(value),
                    "ops": count_ops(tree), "family": family, "phrasing": phrasing})
    return out


# ----------------------------------------------------------------------------
# a user's own questions


def load_questions(path) -> list[dict]:
    """Rows of a CSV or JSONL with `question` (or `prompt`), optional `expression`, and
    `answer` (computed from `expression` when absent). ValueError names the bad line."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        with open(path, newline="") as f:
            rows = [(i + 2, row) for i, row in enumerate(csv.DictReader(f, skipinitialspace=True))]
    else:
        rows = []
        for i, line in enumerate(open(path), start=1):
            if line.strip():
                try:
                    rows.append((i, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
    out = []
    for line, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line}: expected an object with a 'question' field")
        question = row.get("question") or row.get("prompt")
        if not question:
            raise ValueError(f"{path}:{line}: missing column 'question' (or 'prompt')")
        expression = (row.get("expression") or "").strip() or None
        answer = row.get("answer")
        if answer in (None, "") and not expression:
            raise ValueError(f"{path}:{line}: missing column 'answer' (and no 'expression' to compute it)")
        try:
            if answer in (None, ""):
                answer = float(evaluate(parse_expression(expression)))
            else:
                answer = float(str(answer).replace(",", "").replace("$", "").strip())
        except (ValueError, ZeroDivisionError) as e:
            raise ValueError(f"{path}:{line}: bad answer or expression: {e}") from None
        out.append({**row, "question": question.strip(), "expression": expression, "answer": answer})
    return out
