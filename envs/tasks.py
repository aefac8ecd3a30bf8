"""The tasks `python -m grpo.cli.eval --task NAME` knows: each name gives its env and its examples.

Default data are Hugging Face dataset ids, read through the optional `datasets` library (one
download into its cache); offline, pass a local JSONL, CSV or Parquet file as `data` (`--data`).
A task's rows go through grpo.infra.data.load_examples plus that task's own rules below.

The ProcessGRPO card's table (zaydsyed/TactLM-Math-ProcessGRPO-Qwen2.5-0.5B) is `gsm_symbolic`,
`svamp` and `math500_numeric`: its one-shot prompt and exact-number score
(grpo.envs.processgrpo.OneShotMathEnv), greedy, 3,072 new tokens (--max_completion_length 3072).
A local file for one of them has the dataset's own columns: GSM-Symbolic `question` and an
`answer` ending '#### n' (as GSM8K); SVAMP `Body`, `Question` and a numeric `Answer`;
MATH-500 `problem` and `answer` (rows whose answer is not a number are dropped, counted).
"""
from grpo.infra.data import load_examples
from grpo.envs import calculator, gsm8k
from grpo.envs import math as math_env

TASKS = ("gsm8k", "math500", "aime24", "aime25", "calculator", "gsm_symbolic", "svamp", "math500_numeric")
SOURCES = {  # name[:config[:split]]
    "gsm8k": "openai/gsm8k:main:test",
    "math500": "HuggingFaceH4/MATH-500::test",
    "aime24": "HuggingFaceH4/aime_2024::train",  # the 30 problems of 2024 AIME I and II
    "aime25": "math-ai/aime25::test",            # the same rows as the math-evaluation-harness file
    "gsm_symbolic": "apple/GSM-Symbolic:main:test",   # 5,000: 50 variants of 100 GSM8K test questions
    "svamp": "ChilleD/SVAMP::test",                   # 300 of SVAMP's 1,000 (700 train)
    "math500_numeric": "HuggingFaceH4/MATH-500::test",  # the rows whose answer is a number
}
GSM8K_TRAIN = "openai/gsm8k:main:train"  # where the k-shot prompt's examples come from


def gsm8k_example(example: dict) -> dict:
    """GSM8K's answer column is the worked solution ending in '#### 72': the solution is kept
    (the few-shot prompt shows it), the answer becomes '72' (thousands commas dropped)."""
    answer = example["answer"]
    if answer is None or "####" not in answer:  # a file that already holds the bare number
        return example
    return {**example, "solution": answer, "answer": answer.split("####")[-1].strip().replace(",", "")}


def svamp_example(example: dict) -> dict:
    """SVAMP's story (`Body`) and its question (`Question`) as one question; `Answer` is a float
    ('27.0'), read as the exact number it states."""
    body, question = (str(example.get(k) or "").strip() for k in ("Body", "Question"))
    if not question:
        raise ValueError("missing column 'Question' (SVAMP rows have Body, Question and Answer)")
    return {**example, "question": f"{body} {question}".strip()}


def calculator_example(example: dict) -> dict:
    """A number as the answer ('1,234.5' and '$3' read too), computed from an `expression` column
    (infix, e.g. '(3 + 4) * 12.5') when the answer is empty."""
    expression = (example.get("expression") or "").strip() or None
    answer = example["answer"]
    if answer is None and not expression:
        raise ValueError("missing column 'answer' (and no 'expression' to compute it)")
    try:
        if answer is None:
            value = float(calculator.evaluate(calculator.parse_expression(expression)))
        else:
            value = float(answer.replace(",", "").replace("$", "").strip())
    except (ValueError, ZeroDivisionError) as e:
        raise ValueError(f"bad answer or expression: {e}") from None
    return {**example, "expression": expression, "answer": value}


def load_task(task: str, data: str | None = None, shots: int = 0, question_field: str = "question",
              answer_field: str = "answer", fewshot_data: str | None = None) -> tuple[object, list[dict]]:
    """(env, examples) for a task name; `data` (a file or a dataset id) replaces the default
    source. GSM8K's `shots` examples come from `fewshot_data` (default: the hub's train split)."""
    fields = {"question_field": question_field, "answer_field": answer_field}
    if task == "gsm8k":
        examples = load_examples(data or SOURCES[task], prepare=gsm8k_example, **fields)
        train = load_examples(fewshot_data or GSM8K_TRAIN, prepare=gsm8k_example) if shots else []
        return gsm8k.GSM8KEnv(fewshot=gsm8k.fewshot_examples(train, shots) if shots else ()), examples
    if task in ("math500", "aime24", "aime25"):
        prepare = math_env.aime_example if task.startswith("aime") else None
        return math_env.MathEnv(), load_examples(data or SOURCES[task], prepare=prepare, **fields)
    if task in ("gsm_symbolic", "svamp", "math500_numeric"):  # the ProcessGRPO card's protocol
        from grpo.envs.processgrpo import OneShotMathEnv, numeric_only
        source = data or SOURCES[task]
        if task == "svamp":   # its own columns: Body + Question, Answer
            examples = load_examples(source, question_field="Body", answer_field="Answer", prepare=svamp_example)
        else:  # GSM-Symbolic's answers end '#### n' as GSM8K's; MATH-500's are as they are
            examples = load_examples(source, prepare=gsm8k_example if task == "gsm_symbolic" else None, **fields)
        return OneShotMathEnv(), numeric_only(examples, source)
    if task == "calculator":  # generated questions unless a file is given (the reference's CSVs: the 3B recipe's docstring)
        examples = (load_examples(data, prepare=calculator_example, **fields) if data
                    else calculator.generate_questions(200, seed=0, split="eval"))
        return calculator.CalculatorEnv(), examples
    raise ValueError(f"unknown task {task!r}: one of {', '.join(TASKS)}")
