"""Hostile input: every call is answered within a second, with a clear error string, never an exception.

Each timed call runs in a worker process started here, so a regression fails after TIMEOUT_S
instead of hanging CI, and cannot take more than 4 GiB (RLIMIT_AS) even if it tries. The worker
reports each named case's peak Python memory (tracemalloc: it slows PyYAML several times, so the
property test, which throws thousands of generated and mutated calls at run_tool,
CalculatorEnv.step and the reward functions, checks the worker's peak RSS instead).
"""

import json
import operator
import random
import re
import select
import subprocess
import sys
from fractions import Fraction
from types import SimpleNamespace

import pytest

from grpo.envs import gsm8k
from grpo.envs.calculator import (
    MAX_ABS,
    MAX_NODES,
    CalculatorEnv,
    format_number,
    last_block,
    parse_number,
    run_tool,
)
from grpo.envs.calculator_data import parse_expression

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast subset leaves it out)

TIMEOUT_S = 10  # a call still running after this is killed; the bound asserted is 1 s
MAX_SECONDS = 1.0
MAX_PEAK = 32 * 2**20  # bytes of Python memory one call may take; the alias key bomb took 159 MB
MAX_RSS = 512 * 2**20  # the worker's peak resident memory after the property test (~30 MB at start)

WORKER = r"""
import json, resource, sys, time, tracemalloc
from types import SimpleNamespace
from grpo.envs import calculator, gsm8k

resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))  # a regression errs, not the machine

def reward(text):  # the calculator's rewards for a final turn
    trajectory = SimpleNamespace(text=text, turns=[text], observations=[])
    return calculator.CalculatorEnv().reward({"question": "q", "answer": 1.0}, trajectory)

CALLS = {"run_tool": calculator.run_tool, "step": calculator.CalculatorEnv().step, "reward": reward,
         "gsm8k.score": lambda text: gsm8k.score(text, "1"), "gsm8k.format_reward": gsm8k.format_reward}
CALLS["all"] = lambda text, calls=dict(CALLS): {name: call(text) for name, call in calls.items()}
# the peak since this interpreter started: ru_maxrss would include the parent's size, which a
# vfork-started child inherits before its exec (a 1.9 GB pytest process read as 1.9 GB here);
# writing 5 to clear_refs resets the high-water mark VmHWM to now
open("/proc/self/clear_refs", "w").write("5")
def peak_rss(text):
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM"))
    return int(line.split()[1]) * 1024  # KiB
CALLS["rss"] = peak_rss
for line in sys.stdin:
    name, text, trace = json.loads(line)
    if trace:
        tracemalloc.start()
    t0 = time.perf_counter()
    out = CALLS[name](text)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] if trace else 0
    tracemalloc.stop()
    print(json.dumps([out, seconds, peak]), flush=True)
"""


class Worker:
    """A Python process that answers (call, text) lines; killed on a timeout, started again on need."""

    def __init__(self):
        self.proc = None

    def __call__(self, call: str, text: str, trace: bool = True) -> tuple:  # -> (output, seconds, peak bytes)
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.proc.stdin.write(json.dumps([call, text, trace]) + "\n")
        self.proc.stdin.flush()
        if not select.select([self.proc.stdout], [], [], TIMEOUT_S)[0]:
            self.close()
            pytest.fail(f"{call} gave no answer within {TIMEOUT_S} s on {text[:200]!r} ({len(text)} chars)")
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()[-3000:]
            self.close()
            pytest.fail(f"{call} raised on {text[:200]!r} ({len(text)} chars):\n{err}")
        return tuple(json.loads(line))

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def block(yaml_text: str) -> str:
    return f"<calculator>\n{yaml_text}\n</calculator>"


def alias_key_bomb(levels: int) -> str:
    """A mapping whose key is a list of aliases of lists of aliases: 8**levels leaves in ~40*levels
    characters. The key used to be str()-ed in full, expanding every alias, before being cut to 40."""
    node = "&a0 [1, 1, 1, 1, 1, 1, 1, 1]"
    for i in range(1, levels):
        node = f"&a{i} [{node}, " + ", ".join([f"*a{i - 1}"] * 7) + "]"
    return "{? " + node + " : 1}"


def add(operands: str) -> str:
    return block(f"operation: add\noperands: [{operands}]")


BILLION_LAUGHS = ("operation: add\noperands: &a9 [&a8 {operation: add, operands: &a7 [&a6 {operation: add, "
                  "operands: &a5 [1, 1, 1, 1, 1, 1, 1, 1, 1]}, *a6, *a6, *a6, *a6, *a6, *a6, *a6, *a6]}, "
                  "*a8, *a8, *a8, *a8, *a8, *a8, *a8, *a8]")  # 9**3 leaves through aliases
NO_REWARD = {"correct": 0.0, "tool_use": 0.0, "format": 0.0}
DIGITS = "1" * 20_000

# id -> (call, text, check): a str check is a word the error observation must hold; else the exact output.
# "before" gives the time the call took before the fix, on this project's CPU box.
HOSTILE = {
    "billion laughs": ("run_tool", block(BILLION_LAUGHS), "anchors and aliases"),
    "self alias": ("run_tool", block("&a {operation: add, operands: [*a, *a]}"), "Error"),
    "alias key bomb": ("run_tool", block(alias_key_bomb(7)), "anchors and aliases"),  # before: 4.8 s, 159 MB
    "alias key bomb, step": ("step", block(alias_key_bomb(7)), "anchors and aliases"),  # before: 3.8 s
    "block-style key": ("run_tool", block("? [1, 2]\n: 3"), "unexpected key (a list or mapping)"),
    "huge document": ("run_tool", add("1, " * 200_000 + "1"), "too long"),
    "deep flow nesting": ("run_tool", block("[" * 5000 + "]" * 5000), "Error"),
    "deep block nesting": ("run_tool", block("- " * 900 + "1"), "Error"),
    "deep operations": ("run_tool", add("{operation: add, operands: [1, " * 30 + "1" + "]}" * 30),
                        "nested deeper"),
    "huge exponent": ("run_tool", add("1e999999999, 1"), "exponent"),
    "huge float exponent": ("run_tool", add("1.0e+999999999, 1"), "exponent"),
    "exponent 1e000003000000": ("run_tool", add("1e000003000000, 1"), "exponent"),  # before: 1.8 s
    "exponent 1e00000010000000": ("run_tool", add("1e00000010000000, 1"), "exponent"),  # before: 8.9 s
    "exponent 1e000000999999999": ("run_tool", add("1e000000999999999, 1"), "exponent"),  # before: endless
    "exponent 1e-000000999999999": ("run_tool", add("1e-000000999999999, 1"), "exponent"),  # before: endless
    "many digits": ("run_tool", add("9" * 1500 + ", 1"), "digits"),
    "100000 digits": ("run_tool", add("9" * 100_000 + ", 1"), "too long"),
    "growing product": ("run_tool", block(f"operation: multiply\noperands: [{', '.join(['1e99'] * 150)}]"),
                        "too large"),
    "python object": ("run_tool", block("!!python/object/apply:os.system ['echo pwned']"), "tag"),
    "python tag inside": ("run_tool", add("!!python/name:os.system '', 1"), "tag"),
    "infinity": ("run_tool", add(".inf, 1"), "not a number"),
    "nan": ("run_tool", add(".nan, 1"), "not a number"),
    "2000 unclosed tags": ("run_tool", "<calculator>" * 2000, "no <calculator>"),  # 24 KB; before: 0.2 s
    "2000 unclosed tags, step": ("step", "<calculator>" * 2000, None),  # before: 0.2 s
    "100k unclosed tags": ("run_tool", "<calculator>" * 100_000, "no <calculator>"),  # before: never ended
    "100k unclosed tags, step": ("step", "<calculator>" * 100_000, None),  # before: never ended
    # the block opens at the first tag, as re.findall had it
    "100k tags, then a call": ("step", "<calculator>" * 100_000 + add("1, 2"), "too long"),
    "gsm8k score, 20k digits": ("gsm8k.score", f"ANSWER: {DIGITS}x", 0.0),  # before: 6.7 s
    "gsm8k format, 20k digits": ("gsm8k.format_reward", f"ANSWER: {DIGITS}x", 0.0),  # before: 5.0 s
    "gsm8k format, 20k digits.": ("gsm8k.format_reward", f"ANSWER: {DIGITS}.x", 0.0),  # before: 4.9 s
    "gsm8k format, commas": ("gsm8k.format_reward", "ANSWER: " + "1," * 10_000 + ".x", 0.0),
    "gsm8k format, long answer": ("gsm8k.format_reward", f"ANSWER: {DIGITS}", 1.0),
    "answer line, 20k spaces": ("reward", "Answer:" + " " * 20_000 + "x", NO_REWARD),  # before: 22 s
    "answer line, 20k digits": ("reward", f"Answer: {DIGITS}x", NO_REWARD),
    "many answer lines": ("reward", "answer: 1 " * 20_000 + "\nAnswer:" + " " * 10_000, NO_REWARD),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_input_answered_fast(worker, name):
    call, text, check = HOSTILE[name]
    out, seconds, peak = worker(call, text)
    if isinstance(check, str):
        assert out.startswith("<output>Error: ") and out.endswith("</output>") and check in out, out[:300]
    else:
        assert out == check
    assert seconds < MAX_SECONDS, f"{name}: {seconds:.2f} s"
    assert peak < MAX_PEAK, f"{name}: {peak / 2**20:.0f} MB"


# ----------------------------------------------------------------------------
# Unicode digits: only ASCII 0-9 make a number, in the tool and in every reward.
# int(), float() and Fraction take '١٢' as 12; a model paid for them would learn to write them.

ODD_DIGITS = {"arabic-indic": "١٢", "extended arabic-indic": "۱۲", "fullwidth": "１２",
              "devanagari": "१२", "superscript": "¹²", "mathematical bold": "𝟏𝟐"}


@pytest.mark.parametrize("digits", ODD_DIGITS.values(), ids=ODD_DIGITS)
def test_only_ascii_digits_are_numbers(digits):
    assert run_tool(add("12, 1")) == "<output>13</output>"  # the ASCII control
    out = run_tool(add(f"{digits}, 1"))
    assert out.startswith("<output>Error: not a number: ") and digits in out, out
    assert run_tool(add(f"1.{digits}, 1")).startswith("<output>Error: not a number")
    assert parse_number(f"Answer: {digits}") is None
    trajectory = SimpleNamespace(text=f"Answer: {digits}", turns=[f"Answer: {digits}"], observations=[])
    assert CalculatorEnv().reward({"question": "q", "answer": 12.0}, trajectory) == NO_REWARD
    assert gsm8k.score(f"ANSWER: {digits}", "12") == 0.0 and gsm8k.format_reward(f"ANSWER: {digits}") == 0.0
    with pytest.raises(ValueError):
        parse_expression(f"{digits} + 1")


# ----------------------------------------------------------------------------
# property test: calls from the tool's grammar, then mutated


MAX_TURN_CHARS = 100_000  # longer than any turn a sampler writes (16k tokens); mutations compound
APPLY = {"add": operator.add, "subtract": operator.sub, "multiply": operator.mul, "divide": operator.truediv}


def gen_number(rng: random.Random) -> tuple[str, Fraction]:
    text = rng.choice([
        lambda: str(rng.randint(-999, 99999)),
        lambda: f"{rng.randint(0, 9999)}.{rng.randint(0, 99):02d}",
        lambda: f"{rng.choice(['', '-', '+'])}.{rng.randint(1, 99)}",
        lambda: f"{rng.randint(1, 99)}e{rng.randint(-4, 4)}",
        lambda: f"{rng.randint(1, 999)},{rng.randint(0, 999):03d}",
        lambda: f'"{rng.randint(0, 999)}"',
    ])()
    return text, Fraction(text.strip('"').replace(",", ""))


def gen_tree(rng: random.Random, depth: int = 0):
    if depth >= 4 or rng.random() < 0.4:
        return gen_number(rng)
    return (rng.choice(list(APPLY)), [gen_tree(rng, depth + 1) for _ in range(rng.choice([2, 2, 2, 3, 4]))])


def is_number(tree) -> bool:
    return isinstance(tree[1], Fraction)


def size(tree) -> int:
    return 1 if is_number(tree) else 1 + sum(size(c) for c in tree[1])


def value(tree) -> Fraction:
    """Left to right, as the tool; ZeroDivisionError on a zero divisor, OverflowError past MAX_ABS."""
    if is_number(tree):
        return tree[1]
    op, children = tree
    result, *rest = [value(c) for c in children]
    for v in rest:
        result = APPLY[op](result, v)
        if abs(result) > MAX_ABS:
            raise OverflowError
    return result


def render(rng: random.Random, tree, flow: bool) -> list[str]:
    """YAML lines for a tree: flow style, or block style with indented or unindented lists."""
    if is_number(tree):  # '1,234' is two numbers in a flow list: quote it there
        return [f'"{tree[0]}"' if flow and "," in tree[0] else tree[0]]
    op = rng.choice([tree[0], tree[0].capitalize(), tree[0].upper()])
    if flow:
        return ["{operation: %s, operands: [%s]}" % (op, ", ".join(render(rng, c, True)[0] for c in tree[1]))]
    pad = rng.choice(["", "  "])
    lines = [f"operation: {op}", "operands:"]
    for child in tree[1]:
        sub = render(rng, child, rng.random() < 0.2)
        lines += [pad + "- " + sub[0]] + [pad + "  " + line for line in sub[1:]]
    return lines


ODD_CHARS = ["١", "１", "²", "\u200d", "\u202e", "\x00", "\x85", "\ufeff", "\u2028", "\ud800", "😀",
             "\u0301", "\t", "\r", "'", '"', "\\", "#", ":", "-", "?", "&", "*", "!", "|", ">", "%", "@", "`",
             "{", "]"]
YAML_BITS = ["!!python/object/apply:os.system ['x'] ", "!!binary ", "!!float ", "!!int ", "!foo ", "? ",
             "--- ", "\n...\n", "%YAML 1.1\n---\n", "&a ", "*a", "<<: *a\n", "*b ", "&b [1, 2] ", "|\n  ",
             ">-\n  "]


def huge_number(rng: random.Random) -> str:
    zeros = "0" * rng.randint(1, 30)
    return rng.choice([
        "9" * rng.choice([40, 41, 1000, 5000]), f"1e{zeros}{rng.randint(101, 10**9)}",
        f"1e-{zeros}{rng.randint(101, 10**9)}", f"1e{zeros}99", "9" * 40 + "e100", "1e101", ".5e-101",
        ".inf", "-.inf", ".nan", "0x1F", "0o17", "1_000_000", "1" + "0" * 100, "1" + ",000" * 40, "1/3", "1e",
        "--1", "1.2.3", "1,23", "1" + "0" * 5000])


def mutate(rng: random.Random, text: str) -> str:
    i, j = sorted(rng.randrange(len(text) + 1) for _ in range(2))
    kind = rng.randrange(9)
    if kind == 0:  # cut
        return text[:i] if rng.random() < 0.5 else text[i:]
    if kind == 1:  # duplicate a slice
        return text[:j] + text[i:j] * rng.choice([2, 3, 50, 1000]) + text[j:]
    if kind == 2:  # aliases: one number anchored and reused, or a whole bomb
        numbers = list(re.finditer(r"(?<![\w.])[0-9][0-9.e]*", text))
        if len(numbers) >= 2 and rng.random() < 0.5:
            a, b = sorted(rng.sample(numbers, 2), key=lambda m: m.start())
            return text[:a.start()] + "&n " + text[a.start():b.start()] + "*n" + text[b.end():]
        bomb = rng.choice([alias_key_bomb(rng.randint(2, 8)), BILLION_LAUGHS])
        return text[:i] + bomb + text[i:]
    if kind == 3:  # a huge or odd number in place of one
        numbers = list(re.finditer(r"[0-9][0-9.e,]*", text))
        if numbers:
            m = rng.choice(numbers)
            return text[:m.start()] + huge_number(rng) + text[m.end():]
        return text[:i] + huge_number(rng) + text[i:]
    if kind == 4:  # odd unicode and YAML indicators
        return text[:i] + rng.choice(ODD_CHARS) * rng.choice([1, 1, 3, 100]) + text[i:]
    if kind == 5:  # deep nesting
        opener = rng.choice(["[", "{", "- ", "{operation: add, operands: [", "? ", "  "])
        return text[:i] + opener * rng.choice([10, 40, 300, 3000]) + text[i:]
    if kind == 6:  # tags, opened and closed
        tag = rng.choice(["<calculator>", "</calculator>", "<calculator>" * 500, "</calculator><calculator>"])
        return text[:i] + tag + text[i:]
    if kind == 7:  # YAML features: tags, anchors, directives, block scalars
        return text[:i] + rng.choice(YAML_BITS) + text[i:]
    return text[:i] + text[j:] + text[i:j]  # swap two slices


def check_answers(text: str, answers: dict, seconds: float, expected: str | None = None):
    observation = answers["run_tool"]
    assert isinstance(observation, str), observation
    assert observation.startswith("<output>") and observation.endswith("</output>"), observation
    observation.encode("utf-8")  # the observation is tokenized next: no lone surrogates echoed back
    assert "could not evaluate" not in observation, observation  # our catch-all for a bug of ours
    assert answers["step"] == (observation if last_block(text) is not None else None)
    assert set(answers["reward"].values()) <= {0.0, 1.0}
    assert answers["gsm8k.score"] in (0.0, 1.0) and answers["gsm8k.format_reward"] in (0.0, 1.0)
    assert seconds < MAX_SECONDS, f"{seconds:.2f} s"
    if expected is not None:
        assert observation == expected, (observation, expected)


def test_property_generated_and_mutated_calls(worker):
    # ~2 ms a case (most of it PyYAML, twice: run_tool and step): ~6 s of CPU
    rng = random.Random(15)
    findall = re.compile(r"<calculator>(.*?)</calculator>", re.DOTALL)  # what last_block replaces
    for case in range(3000):
        tree = gen_tree(rng)
        body = "\n".join(render(rng, tree, flow=rng.random() < 0.3))
        text = rng.choice(["", "Let me compute.\n"]) + block(body)
        n_mutations = rng.choice([0, 1, 1, 2, 3])
        for _ in range(n_mutations):
            text = mutate(rng, text)[:MAX_TURN_CHARS]
        expected = None
        if n_mutations == 0 and size(tree) <= MAX_NODES:  # a valid call: its exact value, or division by zero
            try:
                expected = f"<output>{format_number(value(tree))}</output>"
            except ZeroDivisionError:
                expected = "<output>Error: division by zero</output>"
            except OverflowError:
                pass
        answers, seconds, _ = worker("all", text, trace=False)
        try:
            check_answers(text, answers, seconds, expected)
            if text.count("<calculator>") < 50:
                blocks = findall.findall(text)
                assert last_block(text) == (blocks[-1] if blocks else None)
        except AssertionError as e:
            raise AssertionError(f"case {case}: {text[:300]!r} ({len(text)} chars): {e}") from None
    rss = worker("rss", "", trace=False)[0]
    assert rss < MAX_RSS, f"the worker's peak RSS: {rss / 2**20:.0f} MB"
