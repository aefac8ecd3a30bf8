"""Your own task: any prompts (question/answer rows or TRL's conversational `prompt` column) and
reward functions written for TRL, named on the command line.

    python -m grpo.models.smollm2                # prints the packaged SmolLM2's folder: a --model_path
    python recipes/custom_task.py --model_path=PATH --train_data=my.jsonl --eval_data=my_test.jsonl \\
        --reward_funcs=my_rewards.py:correct,custom_task:boxed_format --reward_weights=1,0.2
    torchrun --nproc_per_node=8 recipes/custom_task.py ...   # the same on GPUs

Data: a JSONL, CSV or Parquet file or a dataset id (grpo.infra.data.load_examples) with a question
column (--question_field; the recipe adds --system_prompt and the chat template) or TRL's
conversational `prompt` column of chat messages (used as given); an answer column
(--answer_field) is passed on when there is one. Rewards: `module:function` (the current folder
is importable), `file.py:function` or `path/to/file.py:function`, called as TRL's GRPOTrainer
calls them (grpo.rewards): batched,

    fn(prompts, completions, completion_ids, **columns) -> list[float | None]

with prompts and completions as text (question rows) or chat messages (conversational rows),
every other data column as a list (e.g. `answer`), and None for "not applicable" (left out of
the weighted sum). The first function is the eval's score (mean@k, pass@k); --reward_weights
weighs them (default 1 each). `boxed_answer` (math-verify on the last \\boxed{}) and
`boxed_format` below are examples. The same from Python: `from grpo import GRPOTrainer, GRPOConfig`.
For a multi-turn task with a tool, write an env class: see the README's "Your own task" and
envs/calculator.py.
"""
import os
import sys
from dataclasses import dataclass
from typing import ClassVar

from grpo.config import Config
from grpo.flags import parse_args
from grpo.infra.data import load_or_exit
from grpo.envs.math import is_equiv, last_boxed
from grpo.cli.reward_funcs import import_functions, portable_names
from grpo.rewards import RewardFunctionsEnv, completion_text
from grpo.fit.sizing import run_command
from grpo.trainer import check_inputs, train

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `custom_task:...` and files beside it


@dataclass
class CustomTask(Config):
    required: ClassVar[tuple] = ("model_path", "train_data", "reward_funcs")  # --help lists them first
    output_dir: str = "runs/custom_task"
    system_prompt: str = "Please reason step by step, and put your final answer within \\boxed{}."  # before
                                      # each question (not added to conversational prompts)
    reward_funcs: str = ""            # comma-separated module:function, file.py:function or
                                      # path/file.py:function
    reward_weights: str = ""          # comma-separated weights, one per function; empty = 1 each
    max_steps: int = 100
    learning_rate: float = 1e-6
    loss_type: str = "dr_grpo"


# ----------------------------------------------------------------------------- example rewards

def boxed_answer(prompts: list, completions: list, answer: list, **columns) -> list[float | None]:
    """1 when the last \\boxed{} is equivalent to the answer (math-verify), else 0; None (not
    applicable) for a row without an answer."""
    boxed = [last_boxed(completion_text(c)) for c in completions]
    return [None if a is None else float(b is not None and is_equiv(b, str(a)))
            for b, a in zip(boxed, answer)]


def boxed_format(prompts: list, completions: list, **columns) -> list[float]:
    """1 when the completion ends its reasoning in a \\boxed{} answer."""
    return [float(last_boxed(completion_text(c)) is not None) for c in completions]


def load(cfg: CustomTask, source: str) -> list[dict]:
    return load_or_exit(source, question_field=cfg.question_field, answer_field=cfg.answer_field,
                        require_answer=False)  # a reward function may need none


def eval_setup(cfg: CustomTask) -> tuple:
    """The env and the eval examples (also `python -m grpo.cli.eval --run`)."""
    env = RewardFunctionsEnv(import_functions(cfg.reward_funcs), cfg.system_prompt)
    return env, load(cfg, cfg.eval_data) if cfg.eval_data else []


def main(cls=CustomTask):
    cfg = parse_args(cls)
    # local files as absolute paths: config.json works from anywhere
    for field in ("train_data", "eval_data"):
        if os.path.isfile(getattr(cfg, field)):
            setattr(cfg, field, os.path.abspath(getattr(cfg, field)))
    env, eval_examples = eval_setup(cfg)
    cfg.reward_funcs = portable_names(cfg.reward_funcs)  # config.json: found again by grpo.cli.eval --run
    names = list(env.funcs)
    try:
        weights = ([float(w) for w in cfg.reward_weights.split(",")] if cfg.reward_weights
                   else [1.0] * len(names))
    except ValueError:
        raise SystemExit(f"error: --reward_weights={cfg.reward_weights!r}: "
                         "expected comma-separated numbers") from None
    if len(weights) != len(names):
        raise SystemExit(f"error: {len(weights)} --reward_weights for {len(names)} --reward_funcs")
    train_examples = load(cfg, cfg.train_data)
    try:  # every user error in one line before the model loads and before the output folder is touched
        check_inputs(cfg, env, train_examples, train_examples)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    return train(cfg, env, train_examples, eval_examples, reward_weights=dict(zip(names, weights)))


if __name__ == "__main__":
    run_command(main)  # a run the memory plan refuses: its line and table
