"""The ProcessGRPO reference's prompt, scorer and data (model card:
zaydsyed/TactLM-Math-ProcessGRPO-Qwen2.5-0.5B).

Prompt, in training and eval alike (the reference trained with it): one worked example as an
earlier user/assistant exchange, its solution in blank-line paragraphs (the steps that
grpo.process credits) ending in \\boxed{}, then the question + PROMPT_SUFFIX.
Reward: `correct` = the last \\boxed{} and the answer are the same exact number (Fractions, no
float rounding: 0.75 == 3/4 == \\frac{3}{4}, 12.50 == 12); `format` = a \\boxed{} is present,
logged with weight 0. Numbers are ASCII digits only ('١٢' or '１２' is not 12), with optional
thousands commas in groups of three, a leading $, a trailing % or unit words.

Data: `load_sources(TRAIN_SOURCES)`, the rows whose answer is a number, from GSM8K
(openai/gsm8k, '#### 72' read by grpo.envs.tasks.gsm8k_example), MATH (its 12,000 problems
outside MATH-500, nlile/hendrycks-MATH-benchmark; rows with non-numeric answers dropped,
counted) and the generator (grpo.envs.multistep); each id can be a local JSONL, CSV or Parquet
file instead. `filter_by_solve_rate` keeps the problems a model solves 1 to 7 times in 8, as
the reference filtered its sources. Validation (checkpoint choice) is VALIDATION_SOURCES:
`heldout:SOURCE` is the slice of SOURCE that `heldout()` sets aside by question hash (GSM8K
and MATH have no validation split), dropped from training by `without`; the generator's
problems are kept for the final benchmark.

    python -m grpo.envs.processgrpo --model_path PATH [--base Qwen/Qwen2.5-0.5B-Instruct] [--data SOURCE]
evaluates the 700 fresh multi-step problems (or SOURCE) greedily with up to 3,072 new tokens,
by operation count, with the paired gain over --base and its paired bootstrap 95% interval
(grpo.infra.stats.paired_bootstrap, as the reference reports).
"""
import hashlib
import re
import sys
import time
from fractions import Fraction

from grpo.infra.data import DataError, load_examples
from grpo.envs import multistep
from grpo.envs.math import last_boxed
from grpo.envs.tasks import gsm8k_example

PROMPT_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
WORKED_QUESTION = ("A bakery makes 48 muffins in the morning and 30 more in the afternoon. It packs all of "
                   "them into boxes of 6. How many boxes does it fill?")
WORKED_SOLUTION = ("In the morning and the afternoon together, the bakery makes 48 + 30 = 78 muffins.\n\n"
                   "Each box holds 6 muffins, so the bakery fills 78 / 6 = 13 boxes.\n\n"
                   "The answer is \\boxed{13}.")
DEFAULT_WEIGHTS = {"correct": 1.0, "format": 0.0}   # format: logged, not rewarded (the reference's reward)
# the reference's sources with a public id each (NuminaMath left out: see the recipe's deviations)
TRAIN_SOURCES = "openai/gsm8k:main:train,nlile/hendrycks-MATH-benchmark::train,multistep:train:300"
VALIDATION_SOURCES = "heldout:openai/gsm8k:main:train,heldout:nlile/hendrycks-MATH-benchmark::train"
HELDOUT_PERCENT = 5   # of a source's questions, by hash: ~370 of GSM8K train, ~450 of MATH's numeric rows

# ----------------------------------------------------------------------------- exact numbers

# [0-9], never \d: in a str pattern \d also matches '١' or '１', and Fraction() would read them
_NUMBER = r"[-+]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|[-+]?\.[0-9]+"
_FRACTION = r"[-+]?[0-9]+\s*/\s*[0-9]+"
_TEX_FRACTION = re.compile(r"([-+]?)\\[dt]?frac\s*\{\s*([-+]?[0-9]+)\s*\}\s*\{\s*([0-9]+)\s*\}")
_TEX_SHORT_FRACTION = re.compile(r"([-+]?)\\[dt]?frac([0-9])([0-9])(?![0-9])")   # TeX's \frac43: one digit each
_DEGREES = re.compile(r"\^\s*(?:\\circ|\{\s*\\circ\s*\})")            # 90^\circ is the number 90
# a number, then at most unit words ('12 apples', '4.5 km.'): no other expression is an answer
_ANSWER = re.compile(rf"\s*(?P<n>{_FRACTION}|{_NUMBER})\s*(?:[A-Za-z][A-Za-z ]*)?\.?\s*")


def parse_number(text: str) -> Fraction | None:
    """The exact number a final answer states, or None: '1,234', '$12.50', '-3', '75%', '3/4',
    '\\frac{3}{4}', '\\frac43', '90^\\circ', '12 \\text{ apples}', 'x = 5' (the part after the last '=')."""
    s = re.sub(r"\\(?:text|mathrm|textbf|mbox)\s*\{([^{}]*)\}", r" \1", str(text))
    s = _TEX_FRACTION.sub(lambda m: f"{m[1]}{m[2]}/{m[3]}", s)
    s = _TEX_SHORT_FRACTION.sub(lambda m: f"{m[1]}{m[2]}/{m[3]}", _DEGREES.sub("", s))
    # TeX's thousands separators '1\\,000' and '1{,}000' as commas (the group rule then decides);
    # U+2212, the typeset minus, as '-'
    s = re.sub(r"(?<=[0-9])(?:\\,|\{,\})(?=[0-9])", ",", s)
    for junk, by in (("\\$", ""), ("$", ""), ("\\%", ""), ("%", ""), ("\\!", ""), ("\\,", " "), ("\\ ", " "),
                     ("\u2212", "-")):
        s = s.replace(junk, by)
    s = s.rsplit("=", 1)[-1]
    m = _ANSWER.fullmatch(s)
    if m is None:
        return None
    n = m["n"].replace(",", "").replace(" ", "")
    if "/" in n:
        num, den = n.split("/")
        return Fraction(int(num), int(den)) if int(den) else None
    return Fraction(n)


def score(completion: str, answer) -> float:
    """1.0 when the last \\boxed{} holds exactly the answer's number."""
    boxed, gold = last_boxed(completion), parse_number(str(answer))
    return float(boxed is not None and gold is not None and parse_number(boxed) == gold)

# ----------------------------------------------------------------------------- the env


class OneShotMathEnv:
    """Single-turn math with a numeric answer, prompted and scored as the reference."""
    stop_strings: list[str] = []
    max_turns = 1
    score_term = "correct"

    def prompt(self, example: dict) -> list[dict]:
        return [{"role": "user", "content": WORKED_QUESTION + PROMPT_SUFFIX},
                {"role": "assistant", "content": WORKED_SOLUTION},
                {"role": "user", "content": example["question"] + PROMPT_SUFFIX}]

    def extract(self, trajectory) -> str | None:  # for eval records
        return last_boxed(trajectory.text)

    def reward(self, example: dict, trajectory) -> dict[str, float]:
        return {"correct": score(trajectory.text, example["answer"]),
                "format": float(last_boxed(trajectory.text) is not None)}

# ----------------------------------------------------------------------------- data


def heldout(question: str) -> bool:
    """True for the HELDOUT_PERCENT of questions set aside for validation, by the SHA-256 of the
    text: the same rows in every process, whatever order a source gives them in."""
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") % 100 < HELDOUT_PERCENT


def load_sources(spec: str, question_field: str = "question", answer_field: str = "answer") -> list[dict]:
    """Comma-separated sources, concatenated: files and dataset ids (grpo.infra.data.load_examples),
    `heldout:SOURCE` (only SOURCE's heldout() rows), or `multistep:SPLIT:N[:SEED]`, N generated
    problems per operation count 2..8 of SPLIT. Rows whose answer is not a number are dropped,
    with a count; a source left with none is an error."""
    out = []
    for source in filter(None, (s.strip() for s in spec.split(","))):
        if source.startswith("heldout:multistep:"):
            raise DataError(f"{source}: the generator has no held-out slice (its splits are disjoint by seed: "
                            f"multistep:SPLIT:N)")
        if source.startswith("multistep:"):
            _, split, n, *seed = source.split(":")
            if split not in multistep.SPLITS or not n.isdigit() or len(seed) > 1:
                raise DataError(f"{source}: expected multistep:SPLIT:N[:SEED], SPLIT one of "
                                f"{', '.join(multistep.SPLITS)}")
            out += multistep.generate(split, int(n), int(seed[0]) if seed else 0)
            continue
        held = source.startswith("heldout:")
        name = source.removeprefix("heldout:")
        rows = load_examples(name, question_field=question_field, answer_field=answer_field,
                             prepare=gsm8k_example)   # '#### 72' -> '72'; other answers as they are
        out += numeric_only([r for r in rows if heldout(r["question"])] if held else rows, source)
    if not out:
        raise DataError(f"{spec!r} names no source")
    return out


def numeric_only(rows: list[dict], source: str) -> list[dict]:
    """The rows whose answer is a number (exact-number scoring), saying how many were dropped."""
    numeric = [r for r in rows if parse_number(r["answer"]) is not None]
    if not numeric:
        raise DataError(f"{source}: none of its {len(rows)} answers is a number")
    if len(numeric) < len(rows):
        print(f"{source}: kept {len(numeric)} of {len(rows)} rows (the others' answers are not numbers)")
    return numeric


def without(examples: list[dict], others: list[dict]) -> list[dict]:
    """`examples` less every question that `others` holds (training less validation): disjoint
    by construction, whatever sources each came from."""
    drop = {ex["question"] for ex in others}
    return [ex for ex in examples if ex["question"] not in drop]


def filter_by_solve_rate(sampler, tokenizer, env, examples: list[dict], n: int = 8, lo: int = 1, hi: int = 7,
                         temperature: float = 1.0, max_tokens: int = 3072, seed: int = 0,
                         chat_kwargs: dict | None = None, chunk: int = 512) -> tuple[list[dict], list[int], dict]:
    """(the examples solved lo..hi times in n samples, each example's solve count, the pass's
    cost): the reference kept problems its base model solves 1 to 7 times in 8, the ones whose
    groups have a reward spread. `sampler` runs the model (e.g. the frozen copy's
    grpo.engine.sampler.Sampler). cost = {samples, completion_tokens (sampled), prompt_tokens (one
    prefill per problem), seconds}."""
    from grpo.rollout import assign_rewards, rollout, sampling_params
    params = sampling_params(env, tokenizer, n, temperature, max_tokens, seed)
    solved, cost, start_time = [], dict(samples=0, completion_tokens=0, prompt_tokens=0), time.perf_counter()
    for start in range(0, len(examples), chunk):   # chunks: a progress line, and bounded trajectory memory
        part = examples[start:start + chunk]
        trajs = assign_rewards(env, rollout(sampler, tokenizer, env, part, params, prompt_offset=start,
                                            chat_kwargs=chat_kwargs))
        solved += [int(sum(t.rewards["correct"] for t in trajs[i * n:(i + 1) * n])) for i in range(len(part))]
        cost["samples"] += len(trajs)
        cost["completion_tokens"] += sum(len(t.completion_ids) for t in trajs)
        cost["prompt_tokens"] += sum(len(t.prompt_ids) for t in trajs[::n])
        print(f"filter: {start + len(part)}/{len(examples)} problems sampled {n} times")
    kept = [ex for ex, s in zip(examples, solved) if lo <= s <= hi]
    return kept, solved, cost | {"seconds": time.perf_counter() - start_time}


def accuracy_by_ops(examples: list[dict], per_question: list[float]) -> dict[int, float]:
    """Operation count -> mean score, for generated problems (rows with `num_ops`)."""
    return {k: sum(per_question[i] for i in idx) / len(idx) for k, idx in multistep.by_ops(examples).items()}


if __name__ == "__main__":  # the command line lives above the envs, in grpo/cli/processgrpo.py
    from grpo.cli.processgrpo import main
    main(sys.argv[1:])
