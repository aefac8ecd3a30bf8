"""GSM8K as the reference run trains and scores it (model card: cmpatino/qwen-grpo-r5).

The prompt is inspect_evals' GSM8K `MATH_PROMPT_TEMPLATE` (UKGovernmentBEIS/inspect_evals,
src/inspect_evals/gsm8k/gsm8k.py), as the card quotes it. `score` re-implements the
benchmark's scorer, inspect_ai's `match(numeric=True, location="end")`, the way the card
describes it. The 10-shot evaluation prompt picks its examples as that harness does.

Completions are hostile input, so scoring them stays linear in their length: the regexes have
no overlapping quantifiers (`[0-9]+[.]?[0-9]*` tried 20k digits n^2 ways: 7 s a completion).
A number is made of ASCII digits only: '١٢' or '１２' is not an answer. Here we differ from
the harness, whose str.isnumeric() takes them (and '½', on which its float() then raises).
"""

import json
import re
from pathlib import Path

import numpy as np

MATH_PROMPT_TEMPLATE = """Solve the following math problem step by step. The last line of your response should be of the form "ANSWER: $ANSWER" (without quotes) where $ANSWER is the answer to the problem.

{prompt}

Remember to put your answer on its own line at the end in the form "ANSWER: $ANSWER" (without quotes) where $ANSWER is the answer to the problem, and you do not need to use a \\boxed command.

Reasoning:"""

DEFAULT_WEIGHTS = {"correct": 1.0, "format": 0.2}  # the card: 0.2 for ending on an ANSWER line


def load(path) -> list[dict]:
    """GSM8K jsonl -> {question, answer (the text after '#### ', commas stripped), solution}."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out.append({"question": row["question"], "solution": row["answer"],
                        "answer": row["answer"].split("####")[-1].strip().replace(",", "")})
    return out


# ----------------------------------------------------------------------------
# the benchmark's scorer

_STRIP = re.compile(r"[$,£€*_]")  # currency, thousands commas, markdown emphasis
_PERIOD = re.compile(r"\.(?![0-9])")  # a period not followed by a digit: "18." -> "18"
_NUMBER = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[-+]?[0-9]+)?")  # 18, 18., 18.5, .5, 1e3


def _normalize(token: str) -> str | None:
    """A token's number at 5 significant figures ('1.2346e+05'), or None if not a number."""
    if not _NUMBER.fullmatch(token):  # float() alone would take 'nan' and 'inf'
        return None
    return format(float(token), ".5g")


def extract(completion: str) -> str | None:
    """The number the scorer reads: strip `$ , £ € * _` and periods not followed by a
    digit, split on whitespace, scan tokens from the end, take the first that is a number."""
    words = _PERIOD.sub("", _STRIP.sub("", completion.strip().casefold())).split()
    return next((w for w in reversed(words) if _normalize(w) is not None), None)


def score(completion: str, target: str) -> float:
    """1.0 if the extracted number equals the target at 5 significant figures."""
    got = extract(completion)
    want = _normalize(_PERIOD.sub("", _STRIP.sub("", str(target).strip())))
    return float(got is not None and _normalize(got) == want)


# 'ANSWER: $1,234.50.': [0-9,]* then a digit or a decimal part, so no digit can go either way
_ANSWER_LINE = re.compile(r"answer:\s*[-+]?[$£€]?[0-9,]*(?:[0-9]|\.[0-9]+)\.?", re.IGNORECASE)


def format_reward(completion: str) -> float:
    """1.0 if the last non-empty line is 'ANSWER: <number>' (markdown emphasis allowed)."""
    lines = [line for line in completion.strip().splitlines() if line.strip()]
    return float(bool(lines) and _ANSWER_LINE.fullmatch(lines[-1].replace("*", "").strip()) is not None)


# ----------------------------------------------------------------------------
# prompts


def fewshot_examples(train_examples: list[dict], k: int = 10, seed: int = 42) -> list[dict]:
    """The k train examples of inspect_evals' k-shot GSM8K (defaults fewshot=10,
    fewshot_seed=42). The harness shuffles the Hugging Face train split with
    `datasets.Dataset.shuffle(seed)`, which is `np.random.default_rng(seed).permutation(n)`,
    and takes the first k rows; the openai jsonl is that split in the same order, so the
    same examples come out."""
    return [train_examples[i] for i in np.random.default_rng(seed).permutation(len(train_examples))[:k]]


def fewshot_system(examples: list[dict]) -> str:
    """The harness's few-shot system message: 'question, Reasoning:, worked solution,
    ANSWER: x' per example, blank lines between."""
    shots = []
    for ex in examples:
        reasoning, target = ex["solution"].rsplit("####", 1)
        shots.append(f"{ex['question']}\n\nReasoning:\n{reasoning.strip()}\n\nANSWER: {target.strip()}")
    return "\n\n".join(shots)


def fewshot_messages(train_examples: list[dict], k: int = 10, seed: int = 42) -> list[dict]:
    return [{"role": "system", "content": fewshot_system(fewshot_examples(train_examples, k, seed))}]


class GSM8KEnv:
    stop_strings: list[str] = []
    max_turns = 1

    def __init__(self, fewshot: list[dict] = ()):
        # fewshot: train examples (fewshot_examples(...)) for the 10-shot evaluation; training is zero-shot
        self.system = [{"role": "system", "content": fewshot_system(fewshot)}] if fewshot else []

    def prompt(self, example: dict) -> list[dict]:
        return self.system + [{"role": "user", "content": MATH_PROMPT_TEMPLATE.format(prompt=example["question"])}]

    def extract(self, trajectory) -> str | None:  # the answer the scorer reads, for eval records
        return extract(trajectory.text)

    def reward(self, example: dict, trajectory) -> dict[str, float]:
        return {"correct": score(trajectory.text, example["answer"]), "format": format_reward(trajectory.text)}
