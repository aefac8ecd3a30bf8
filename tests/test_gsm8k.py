"""GSM8K: the benchmark's scorer, the format reward, loading and the (10-shot) prompts."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo.envs.gsm8k import (
    MATH_PROMPT_TEMPLATE,
    GSM8KEnv,
    fewshot_examples,
    fewshot_messages,
    format_reward,
    load,
    score,
)

DATA = Path(__file__).parents[2] / "shared" / "data" / "gsm8k"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"{DATA} absent")


@pytest.mark.parametrize("completion, target, expected", [
    ("She makes 9 * 2 = $18 every day.\nANSWER: 18", "18", 1.0),
    ("ANSWER: $1,234.", "1234", 1.0),  # currency, thousands comma, trailing period
    ("ANSWER: £1,000,000", "1,000,000", 1.0),  # commas stripped from the target too
    ("ANSWER: **42**", "42", 1.0),  # markdown emphasis
    ("ANSWER: 12 apples in total", "12", 1.0),  # words after the number are skipped
    ("The answer is 12, not 13.", "12", 0.0),  # the LAST number counts
    ("I do not know.", "7", 0.0),  # no number at all
    ("", "7", 0.0),
    ("ANSWER: 123456", "123459", 1.0),  # 5 significant figures: both are 1.2346e+05
    ("ANSWER: 123456", "123470", 0.0),
    ("ANSWER: 0.33333", "0.333333", 1.0),
    ("ANSWER: 18.0", "18", 1.0),
    ("ANSWER: -5", "-5", 1.0),
    ("ANSWER: nan", "5", 0.0),
    ("ANSWER: 5%", "5", 0.0),  # '5%' is not a number token
    ("ANSWER: \u0661\u0668", "18", 0.0),  # ASCII digits only (the module header): not Arabic-Indic 18
    ("ANSWER: \uff11\uff18", "18", 0.0),  # nor fullwidth 18
])
def test_score(completion, target, expected):
    assert score(completion, target) == expected


@pytest.mark.parametrize("completion, expected", [
    ("Reasoning...\nANSWER: 18", 1.0),
    ("Reasoning...\nANSWER: $1,234.50\n\n", 1.0),
    ("**ANSWER: 18**", 1.0),
    ("ANSWER: 18\nHope that helps!", 0.0),
    ("The answer is 18", 0.0),
    ("ANSWER: eighteen", 0.0),
    ("ANSWER: \u0661\u0668", 0.0),  # Arabic-Indic digits
])
def test_format_reward(completion, expected):
    assert format_reward(completion) == expected


@needs_data
def test_load_and_prompts():
    train, test = load(DATA / "train.jsonl"), load(DATA / "test.jsonl")
    assert len(train) == 7473 and len(test) == 1319
    assert train[0]["answer"] == "72" and train[0]["solution"].endswith("#### 72")
    assert all("," not in ex["answer"] and ex["answer"] for ex in train + test)
    env = GSM8KEnv()
    assert env.stop_strings == [] and env.max_turns == 1
    (msg,) = env.prompt(test[0])
    assert msg["role"] == "user" and msg["content"] == MATH_PROMPT_TEMPLATE.format(prompt=test[0]["question"])
    assert msg["content"].startswith("Solve the following math problem step by step.") and msg["content"].endswith("Reasoning:")
    # 10-shot: a system message of 10 worked train examples, the same for every call
    shots = fewshot_messages(train)
    assert shots == fewshot_messages(train) and shots[0]["role"] == "system"
    assert shots[0]["content"].count("\n\nReasoning:\n") == 10 and shots[0]["content"].count("ANSWER: ") == 10
    assert "####" not in shots[0]["content"]
    assert fewshot_examples(train) == fewshot_examples(train, k=10, seed=42) != fewshot_examples(train, seed=0)
    msgs = GSM8KEnv(fewshot=fewshot_examples(train)).prompt(test[0])
    assert msgs[0] == shots[0] and msgs[1] == env.prompt(test[0])[0]
    # the reference solution, written in the asked format, scores full marks
    ex = test[0]
    reasoning = ex["solution"].split("####")[0].strip()
    r = env.reward(ex, SimpleNamespace(text=f"{reasoning}\nANSWER: {ex['answer']}", turns=[], observations=[],
                                       finish_reason="stop", num_turns=1))
    assert r == {"correct": 1.0, "format": 1.0}
    assert sum(score(f"ANSWER: {ex['answer']}", ex["answer"]) for ex in test) == len(test)
