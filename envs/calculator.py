"""Calculator tool environment (the reference run: github.com/Danau5tin/calculator_agent_rl).

The model writes a <calculator> block holding recursive YAML, stops on </calculator>,
gets <output>value</output> back as the next user message, and ends with a last line
`Answer: <number>`. Everything the model writes is hostile input to run_tool: it is
parsed without constructing Python objects, bounded in size, depth and magnitude,
evaluated exactly with Fraction, and every failure comes back as an observation.

What is covered (each is an `<output>Error: ...</output>` within a second, never an exception;
tests/test_hostile.py times them and throws thousands of mutated calls at run_tool):
- Size: more than MAX_CHARS of YAML, MAX_NODES numbers and operations, or MAX_DEPTH levels
  (brackets are counted before PyYAML sees them, as it recurses per bracket, slowly).
- YAML: anchors and aliases are refused outright (a few hundred characters of them describe
  billions of nodes, a mapping key included); no tags beyond the core schema; compose builds
  nodes, never Python objects.
- Numbers: ASCII digits only (Arabic-Indic or fullwidth digits, which int() and Fraction
  accept, are "not a number"); at most MAX_DIGITS digits; the whole exponent, leading zeros
  included, is read as a number and bounded before 10**e is built; every literal and every
  intermediate result is at most MAX_ABS.
- The text around the call: blocks are found with str.find, linear in any number of unclosed
  tags, and the reward regexes have no overlapping quantifiers, so they are linear too.
What is not covered: PyYAML's own time on MAX_CHARS of text (milliseconds) and the memory of
the trajectory text itself; this runs in the trainer's process, with no CPU or memory limit.

Rewards (weights in DEFAULT_WEIGHTS): `correct` (the final answer matches), `tool_use`
(at least one tool call and none failed), `format` (the final turn ends on an Answer
line), and an optional `judge` from an OpenAI-compatible LLM endpoint, off by default: a rubric
over the whole trajectory (JUDGE_RUBRIC), weighted as the reference's (JUDGE_WEIGHTS).
`CalculatorEnv(structure=True)` adds `structure`: partial credit for a last call that computes
some of the question's sub-results (structure_credit), for questions that carry an expression.
"""

import re
import zlib
from collections import Counter
from decimal import Decimal, localcontext
from fractions import Fraction

import yaml

from grpo.envs.calculator_data import (  # noqa: F401  (public API of this env)
    evaluate, generate_questions, load_questions, parse_expression, split_of, to_infix,
)
from grpo.envs.judge import Judge, judge_score, judge_scores  # noqa: F401  (judge_score(s): re-exported)

SYSTEM_PROMPT = """You are a careful assistant with a calculator. Do not work out arithmetic in your head: use the calculator.

To use it, write a <calculator> block holding YAML with an `operation` (add, subtract, multiply or divide) and a list of `operands`. An operand is a number or another block of `operation` and `operands`, nested as deep as you need. Every operation takes two or more operands; subtract and divide work left to right (a - b - c, a / b / c). The calculator replies with <output>value</output>.

For example, asked "What is 12.5 times the sum of 3 and 4?", you write:
<calculator>
operation: multiply
operands:
  - 12.5
  - operation: add
    operands:
      - 3
      - 4
</calculator>
The calculator replies:
<output>87.5</output>
Then you answer the user. The last line of your answer must be "Answer: " followed by the number alone, like this:
Answer: 87.5"""

# A short prompt for a model that has been warm-started on the format (the CPU recipe): the
# full one above is ~250 tokens, which would double the cost of every training forward there.
SHORT_SYSTEM_PROMPT = ("Use the calculator for arithmetic: a <calculator> block of YAML with `operation` "
                       "(add, subtract, multiply, divide) and `operands` (numbers or nested blocks). "
                       "Then end with a line \"Answer: <number>\".")

# The shaping terms teach a cold model the format. Once it has it they can be gamed: among
# wrong answers they prefer a call that parses to one that errs, and SmolLM2 after a
# warm-start learned flat, always-parsing, wrong calls from them (recipes/calculator_smollm2_cpu.py
# trains on `correct` alone for that reason).
DEFAULT_WEIGHTS = {"correct": 1.0, "tool_use": 0.2, "format": 0.1, "judge": 0.0, "judge_failed": 0.0}
# The reference's evaluation (examples/calculator_agent/evaluation in github.com/Danau5tin/agentic_environments,
# branch qwen; data: datasets/basic_calculations_eval.csv, columns prompt, expression, answer): one sample
# at temperature 0.2, at most 1,000 new tokens a turn and 5 calculator calls, right when the last number is
# within an absolute 0.1. The whole completion's budget: 6 turns of 1,000, plus the calculator's outputs.
REFERENCE_EVAL = {"n": 1, "temperature": 0.2, "max_turns": 6, "max_turn_tokens": 1000, "max_tokens": 6 * 1000 + 500,
                  "rel_tol": 0.0, "abs_tol": 0.1}
# The reference's reward (src/environment/calculator_env.py there): the judge 0.8, verification 0.2
JUDGE_WEIGHTS = {"judge": 0.8, "correct": 0.2, "tool_use": 0.0, "format": 0.0, "judge_failed": 0.0}

# limits on one tool call: each error is found in microseconds, long before any of them
# could cost memory or time (the tests time hostile inputs)
MAX_CHARS = 2000  # YAML text, checked before parsing
MAX_NODES = 200  # numbers + operations, counted while walking (aliases would count each time)
MAX_DEPTH = 16
MAX_DIGITS = 40  # digits in one number literal
MAX_EXPONENT = 100  # |e| in a literal such as 1.5e20; the whole exponent, before the number is built
MAX_ABS = 10**100  # any literal or intermediate result
SIG_DIGITS = 10  # non-integer results are rounded to this many significant digits

OPEN, CLOSE = "<calculator>", "</calculator>"
# [0-9], not \d: \d (and int(), Fraction, float) take any Unicode digit, such as '١٢' or '１２'
_LITERAL = re.compile(r"[-+]?([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([-+]?[0-9]+))?")
_THOUSANDS = re.compile(r"[-+]?[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?")


class ToolError(ValueError):
    """A message for the model: what was wrong with its tool call."""


# ----------------------------------------------------------------------------
# the tool


def _number(text: str) -> Fraction:
    s = text.strip().replace("_", "")
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")  # 1,234.5
    m = _LITERAL.fullmatch(s)
    if not m:
        raise ToolError(f"not a number: {text[:40]!r}")
    if len(m.group(1).replace(".", "")) > MAX_DIGITS:
        raise ToolError(f"number has more than {MAX_DIGITS} digits")
    # the whole exponent, not a prefix of it: '1e000000999999999' has 9 digits after its zeros
    exponent = (m.group(2) or "0").lstrip("+-").lstrip("0")
    if len(exponent) > 3 or int(exponent or "0") > MAX_EXPONENT:  # before 10**e is ever built
        raise ToolError(f"exponent out of range (at most {MAX_EXPONENT} either way)")
    return _bounded(Fraction(s))


def _bounded(x: Fraction) -> Fraction:
    if abs(x) > MAX_ABS:
        raise ToolError("number too large")
    return x


def _eval_node(node, depth: int, count: list, steps: list | None = None) -> Fraction:
    """Evaluate a yaml.compose node tree. The count is shared by the whole walk, so even
    a node reached twice (an alias, were _Loader to let one through) counts twice. `steps`,
    if given, collects every intermediate result: one per operand after the first."""
    count[0] += 1
    if count[0] > MAX_NODES:
        raise ToolError(f"expression too big (more than {MAX_NODES} numbers and operations)")
    if depth > MAX_DEPTH:
        raise ToolError(f"expression nested deeper than {MAX_DEPTH} levels")
    if not node.tag.startswith("tag:yaml.org,2002:") or "python" in node.tag:
        raise ToolError(f"unsupported YAML tag {node.tag[:60]}")  # e.g. !!python/object
    if isinstance(node, yaml.ScalarNode):
        return _number(node.value)
    if not isinstance(node, yaml.MappingNode):
        raise ToolError("expected a number or a mapping with 'operation' and 'operands'")
    fields = {}
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode):  # never str() a node: it expands the graph
            raise ToolError("unexpected key (a list or mapping); the keys are 'operation' and 'operands'")
        if key.value not in ("operation", "operands"):
            raise ToolError(f"unexpected key {key.value[:40]!r}")
        fields[key.value] = value
    if set(fields) != {"operation", "operands"}:
        raise ToolError("each operation needs both 'operation' and 'operands'")
    op_node, operands = fields["operation"], fields["operands"]
    op = op_node.value.strip().lower() if isinstance(op_node, yaml.ScalarNode) else None
    if op not in ("add", "subtract", "multiply", "divide"):
        raise ToolError(f"unknown operation {str(op)[:40]!r} (use add, subtract, multiply or divide)")
    if not isinstance(operands, yaml.SequenceNode):
        raise ToolError(f"'operands' of {op} must be a list")
    if len(operands.value) < 2:
        raise ToolError(f"{op} needs at least 2 operands, got {len(operands.value)}")
    values = [_eval_node(child, depth + 1, count, steps) for child in operands.value]
    result = values[0]
    for v in values[1:]:  # left to right: a - b - c, a / b / c
        if op == "add":
            result += v
        elif op == "subtract":
            result -= v
        elif op == "multiply":
            result *= v
        elif v == 0:
            raise ToolError("division by zero")
        else:
            result /= v
        result = _bounded(result)
        if steps is not None:
            steps.append(result)
    return result


def format_number(x: Fraction) -> str:
    """Integers exactly; anything else to SIG_DIGITS significant digits, plain notation
    unless very large or small (then 1.234e-9)."""
    if x.denominator == 1:
        return str(x.numerator)
    with localcontext() as ctx:
        ctx.prec = SIG_DIGITS
        d = (Decimal(x.numerator) / Decimal(x.denominator)).normalize()
    return format(d, "f") if -7 <= d.adjusted() < 16 else format(d, "e").replace("e+", "e")


def _flow_depth(text: str) -> int:
    depth = deepest = 0
    for c in text:
        depth += (c in "[{") - (c in "]}")
        deepest = max(deepest, depth)
    return deepest


class _Loader(yaml.SafeLoader):
    """SafeLoader refusing anchors and aliases: a tool call never needs them, and with them
    a few hundred characters describe a graph of billions of nodes."""

    def compose_node(self, parent, index):
        if getattr(self.peek_event(), "anchor", None) is not None:  # &name, or an alias *name
            raise ToolError("YAML anchors and aliases (&name, *name) are not allowed; write each operand out")
        return super().compose_node(parent, index)


def calculate(yaml_text: str, steps: list | None = None) -> Fraction:
    """The exact value of one tool call's YAML; ToolError says what is wrong. `steps`, if
    given, receives every intermediate result (add: [a, b, c] gives a + b, then a + b + c)."""
    text = yaml_text.strip()
    text = re.sub(r"^```\w*\n|\n?```$", "", text)  # tolerate a markdown fence in the block
    if len(text) > MAX_CHARS:
        raise ToolError(f"tool call too long ({len(text)} characters, at most {MAX_CHARS})")
    if _flow_depth(text) > 2 * MAX_DEPTH + 2:  # PyYAML recurses per bracket, slowly: refuse first
        raise ToolError(f"expression nested deeper than {MAX_DEPTH} levels")
    try:
        # compose, not load: the node graph only, no Python objects and no tags run;
        # numbers are read from their text, so 0.1 is exactly 1/10
        root = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError as e:
        raise ToolError(f"invalid YAML ({getattr(e, 'problem', None) or type(e).__name__})") from None
    if root is None:
        raise ToolError("empty calculator block")
    return _eval_node(root, 0, [0], steps)


def last_block(text: str) -> str | None:
    """The text of the last <calculator>...</calculator> block, the one that
    re.findall(r"<calculator>(.*?)</calculator>", re.DOTALL) would list last, or None.
    str.find keeps it linear: that regex rescans the rest of the text from every
    unclosed tag, so 100k of them never finish."""
    block, pos = None, 0
    while (start := text.find(OPEN, pos)) >= 0 and (end := text.find(CLOSE, start + len(OPEN))) >= 0:
        block, pos = text[start + len(OPEN):end], end + len(CLOSE)
    return block


def run_tool(text: str) -> str:
    """The observation for a turn ending in a tool call: <output>value</output> or
    <output>Error: reason</output>. Never raises."""
    try:
        block = last_block(text)
        if block is None:
            raise ToolError("no <calculator>...</calculator> block found")
        value = format_number(calculate(block))
    except ToolError as e:
        value = f"Error: {e}"
    except RecursionError:  # hostile nesting inside the YAML parser itself
        value = "Error: expression nested too deeply"
    except MemoryError:
        value = "Error: expression too big"
    except Exception as e:  # a bug of ours must not end the rollout either
        value = f"Error: could not evaluate ({type(e).__name__})"
    return f"<output>{value}</output>"


# ----------------------------------------------------------------------------
# supervised warm-start data


def _yaml_lines(tree) -> list[str]:
    op, *operands = tree
    lines = [f"operation: {op}", "operands:"]
    for operand in operands:
        if isinstance(operand, str):
            lines.append(f"  - {operand}")
        else:
            sub = _yaml_lines(operand)
            lines += ["  - " + sub[0]] + ["    " + line for line in sub[1:]]
    return lines


def _block(tree) -> str:
    body = tree if isinstance(tree, str) else "\n".join(_yaml_lines(tree))
    return f"<calculator>\n{body}\n</calculator>"


def gold_call(example: dict) -> str:
    """The <calculator> block for the example's expression."""
    return _block(parse_expression(example["expression"]))


MISTAKES = ("one_operand", "bad_name")
# words a model writes as an operation's name: from the TRAIN and RL phrasebooks only, so a
# correction learned on them is not one learned on the held-out eval's own words (the RL book's
# words thus reach the warm-start, as wrong operation names, never as question wording)
BAD_NAMES = {"add": ("plus", "sum", "addition", "together"),
             "subtract": ("minus", "difference", "deduct", "remove"),
             "multiply": ("times", "multiplication", "groups"),
             "divide": ("quotient", "ratio", "division", "per")}


def mistaken_call(example: dict, kind: str) -> str:
    """The gold call with one mistake that models make: `one_operand` wraps a number in an
    operation of its own with a single operand (SmolLM2's habit after GRPO), `bad_name` names
    the top operation with a word the tool does not know. Both come back as an error."""
    tree = parse_expression(example["expression"])
    if isinstance(tree, str):
        raise ValueError(f"no mistake to make in a bare number: {example['expression']!r}")
    if kind == "bad_name":  # the word depends on the expression only: a gold episode is deterministic
        names = BAD_NAMES[tree[0]]
        wrong = (names[zlib.crc32(example["expression"].encode()) % len(names)],) + tuple(tree[1:])
        return _block(wrong)
    if kind != "one_operand":
        raise ValueError(f"unknown mistake {kind!r}: one of {MISTAKES}")
    def wrap(node):  # the first number met going down the right side gets a one-operand operation
        if isinstance(node[2], str):
            return (node[0], node[1], (tree[0], node[2]))
        if isinstance(node[1], str):
            return (node[0], (tree[0], node[1]), node[2])
        return (node[0], node[1], wrap(node[2]))

    return _block(wrap(tree))


def mistake_turns(example: dict, kind: str) -> list[dict]:
    """The opening of a corrected episode: a mistaken call (one of MISTAKES) and the tool's error."""
    wrong = mistaken_call(example, kind)
    return [{"role": "assistant", "content": wrong},
            {"role": CalculatorEnv.observation_role, "content": run_tool(wrong)}]


def gold_messages(example: dict) -> list[dict]:
    """The ideal episode after the prompt: tool call, observation, final answer. With
    example["mistake"] (one of MISTAKES) the episode opens with that mistaken call and its
    error, marked `learn: False` (the warm-start does not train on it), then the correction:
    a model that has seen a correction tries again instead of answering "Error"."""
    call = gold_call(example)
    observation = run_tool(call)
    value = observation.removeprefix("<output>").removesuffix("</output>")
    head = mistake_turns(example, example["mistake"]) if example.get("mistake") else []
    if head:
        head[0]["learn"] = False
    return head + [
        {"role": "assistant", "content": call},
        {"role": CalculatorEnv.observation_role, "content": observation},
        {"role": "assistant", "content": f"The calculator gives {value}.\nAnswer: {value}"},
    ]


# ----------------------------------------------------------------------------
# rewards


# ASCII digits only, as in the tool: '١٢' or '１２' is not an answer (float() would take it)
_NUMBER = re.compile(r"-?\$?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"
                     r"|-?\$?\.[0-9]+")
_ANSWER_LINE = re.compile(r"answer\s*[:=]\s*(.*)", re.IGNORECASE)
# the format reward's last line: "Answer: 1,234.5", markdown bold and a final period allowed;
# `\s*(?:\*+\s*)?`, not `\s*\**\s*`: two \s* around an empty \** split a run of n spaces n ways
_FORMAT_LINE = re.compile(rf"\**answer\**\s*:\s*(?:\*+\s*)?(?:{_NUMBER.pattern})\s*\**\.?", re.IGNORECASE)


def parse_number(text: str) -> float | None:
    """The first number in text: '1,234.5', '$1,234.50', '-3.2e4', '−7' are understood."""
    text = text.replace("\u2212", "-").replace("*", "")
    m = _NUMBER.search(text)
    if not m:
        return None
    try:
        return float(m.group().replace(",", "").replace("$", ""))
    except (OverflowError, ValueError):
        return None


def final_answer(trajectory) -> float | None:
    """The number on the last 'Answer:' line of the last turn, else its last number.
    A last turn that is still a tool call (cut off by length or turns) has no answer."""
    last = trajectory.turns[-1] if trajectory.turns else ""
    if "<calculator>" in last:
        return None
    answers = _ANSWER_LINE.findall(last)
    if answers:
        return parse_number(answers[-1])
    numbers = _NUMBER.findall(last.replace("\u2212", "-"))
    return parse_number(numbers[-1]) if numbers else None


def is_close(pred: float | None, target: float, rel_tol: float = 1e-6, abs_tol: float = 1e-6) -> bool:
    """rel 1e-6: copying the tool's 10 digits, or rounding to 7, passes; estimating does not."""
    return pred is not None and abs(pred - target) <= max(rel_tol * abs(target), abs_tol)


def gold_steps(tree) -> list[Fraction]:
    """The value of every operation of an expression tree, innermost first."""
    if isinstance(tree, str):
        return []
    return gold_steps(tree[1]) + gold_steps(tree[2]) + [evaluate(tree)]


def structure_credit(example: dict, trajectory) -> float:
    """Partial credit for the last tool call's shape: how many of the expression's sub-results
    it computes, over the larger of its own number of steps and the expression's, so a call that
    computes every sub-result and nothing else scores 1 and piling up extra steps does not pay.
    Values, not text: 12 + 3 matches 3 + 12, 12 - 3 does not match 3 - 12, and add: [a, b, c]
    computes a + b and a + b + c. A flat call of the first two numbers of a nested question
    scores 0 unless they happen to form a sub-result; one that errs scores 0. Where `correct` is
    0 for every sample of a question (most nested ones, for a small model), this term still
    tells a call that got the inner steps right from one that did not."""
    if "expression" not in example:
        return 0.0
    call = next((block for block in map(last_block, reversed(trajectory.turns)) if block is not None), None)
    if call is None:
        return 0.0
    steps = []
    try:
        calculate(call, steps)
    except Exception:  # ToolError or the parser's own: an error scores 0, never raises
        return 0.0
    gold = gold_steps(parse_expression(example["expression"]))
    if not gold:
        return 0.0
    matched = sum((Counter(gold) & Counter(steps)).values())
    return matched / max(len(gold), len(steps))


# ----------------------------------------------------------------------------
# optional LLM judge (grpo.envs.judge): a rubric over the whole trajectory. The reference's judge
# (src/rewards/tool_judge.md in github.com/Danau5tin/calculator_agent_rl, 80% of its reward) scored
# the calculator's use only: whether to call it, the question's arithmetic as operations and
# nesting, the call's syntax and its turn holding nothing else, and the final number against the
# tool's output. This rubric is our own wording of those criteria, scored out of 10.

JUDGE_RUBRIC = """You grade how an assistant used a calculator tool to answer an arithmetic question. Correctness of the final answer is checked by code elsewhere: grade the use of the tool.

The tool is called with a <calculator> block of YAML: an `operation` (add, subtract, multiply or divide) and a list of `operands`, each a number or a nested block of the same form. Its reply comes back as <output>value</output>.

Give points for each of these, 10 in all:
- 1 point: the assistant called the calculator for arithmetic it could not do exactly in its head, and did not call it for nothing.
- 3 points: the calls express the question's arithmetic: the right operations on the right numbers, in the right order, nested where a result feeds another operation and flat where one operation is enough.
- 4 points: every call is well formed: one <calculator> block per turn, valid YAML with `operation` and `operands` at every level, and nothing else in that turn (no prose, no guessed outputs, no placeholders for earlier results). A call whose output is an error, or is missing, was malformed.
- 2 points: the final reply states the number the calculator returned for the intended calculation.

The conversation:
{transcript}

Write one short sentence on what you saw, then a last line of the form "Score: N" with N from 0 to 10."""


def transcript(question: str, trajectory) -> str:
    """The question, each assistant turn and the calculator's reply to it, in order."""
    parts = [f"User: {question}"]
    for i, turn in enumerate(trajectory.turns):
        parts.append(f"Assistant: {turn.strip()}")
        if i < len(trajectory.observations):
            parts.append(f"Calculator: {trajectory.observations[i].strip()}")
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------
# the environment


class CalculatorEnv:
    stop_strings = ["</calculator>"]
    max_turns = 4  # tool calls plus the final answer; one nested call is enough
    observation_role = "user"  # SmolLM2 and Qwen2.5 templates: tool output as a user message

    def __init__(self, rel_tol: float = 1e-6, judge_base_url: str | None = None,
                 judge_model: str | None = None, judge_api_key: str | None = None,
                 judge_timeout: float = 30.0, system_prompt: str = SYSTEM_PROMPT, structure: bool = False,
                 abs_tol: float = 1e-6, judge: Judge | None = None):
        """`rel_tol`, `abs_tol`: the `correct` term's tolerance (is_close; the reference's verification:
        rel_tol 0, abs_tol 0.1). `judge`, or `judge_base_url` and `judge_model`: the `judge` term."""
        self.rel_tol, self.abs_tol, self.system_prompt, self.structure = rel_tol, abs_tol, system_prompt, structure
        if judge is None and judge_base_url:
            judge = Judge(judge_base_url, judge_model, judge_api_key, judge_timeout)
        self.judge = judge

    def prompt(self, example: dict) -> list[dict]:
        messages = [{"role": "system", "content": self.system_prompt},
                    {"role": "user", "content": example["question"]}]
        if example.get("opening_mistake"):  # GRPO practice at recovering: the context already holds
            messages += mistake_turns(example, example["opening_mistake"])  # a mistaken call and its error
        return messages

    def step(self, text: str) -> str | None:
        # a complete block means a tool call; anything else is the final answer
        return run_tool(text) if last_block(text) is not None else None

    def gold_messages(self, example: dict) -> list[dict]:
        return gold_messages(example)  # the supervised warm-start's turns

    def extract(self, trajectory) -> float | None:  # for eval records
        return final_answer(trajectory)

    def answered(self, trajectory) -> bool:
        """The last turn holds an `Answer:` line and no call: a row cut there was answering
        (for keep_truncated_answers; a bare number in cut prose is not an answer yet)."""
        last = trajectory.turns[-1] if trajectory.turns else ""
        return "<calculator>" not in last and _ANSWER_LINE.search(last) is not None

    def reward(self, example: dict, trajectory) -> dict[str, float]:
        pred = final_answer(trajectory)
        calls = [o for o in trajectory.observations if o.startswith("<output>")]
        last = trajectory.turns[-1] if trajectory.turns else ""
        lines = [line for line in last.strip().splitlines() if line.strip()]
        rewards = {
            "correct": float(is_close(pred, float(example["answer"]), self.rel_tol, self.abs_tol)),
            "tool_use": float(bool(calls) and not any(o.startswith("<output>Error") for o in calls)),
            "format": float(bool(lines) and "<calculator>" not in last and
                            _FORMAT_LINE.fullmatch(lines[-1].strip()) is not None),
        }
        if self.structure:
            rewards["structure"] = structure_credit(example, trajectory)
        if self.judge is not None:
            score = self.judge(JUDGE_RUBRIC.format(transcript=transcript(example["question"], trajectory)))
            # no score (the judge failed, counted): the row is judged by its verification instead, not by
            # a 0 that would rank it below its group for the server's fault
            rewards["judge"] = rewards["correct"] if score is None else score
            rewards["judge_failed"] = float(score is None)  # weight 0: a rate in the logs (reward/judge_failed)
        return rewards
