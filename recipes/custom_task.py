"""Your own task: any question/answer data, and reward functions named on the command line.

    python recipes/custom_task.py --model_path=Qwen/Qwen2.5-0.5B-Instruct --train_data=my.jsonl \\
        --eval_data=my_test.jsonl --reward_funcs=custom_task:boxed_answer,custom_task:boxed_format \\
        --reward_weights=1,0.2
    torchrun --nproc_per_node=8 recipes/custom_task.py ...   # the same on GPUs

Data: a JSONL, CSV or Parquet file or a dataset id (grpo.data.load_examples) with a question
and an answer column (--question_field, --answer_field). Rewards, as TRL's GRPOTrainer takes
them: `module:function` names, each called as

    fn(prompts: list[str], completions: list[str], **columns) -> list[float]

with the user messages, the decoded completions and every data column as a list (e.g.
`answer`). `module` is any importable module, or a file beside this recipe. The first function
is the eval's score (mean@k, pass@k); --reward_weights weighs them (default 1 each). The
functions here are examples: `boxed_answer` (math-verify on the last \\boxed{}) and
`boxed_format`. For a multi-turn task with a tool, write an env class instead: see the README's
"Your own task" and envs/calculator.py.
"""
import importlib
import os
import sys
from dataclasses import dataclass

from grpo.config import Config, parse_args
from grpo.data import load_or_exit
from grpo.envs.math import is_equiv, last_boxed
from grpo.trainer import train

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `custom_task:...` and files beside it


@dataclass
class CustomTask(Config):
    output_dir: str = "runs/custom_task"
    train_data: str = ""              # a JSONL, CSV or Parquet file, or a dataset id name[:config[:split]]
    eval_data: str = ""               # the same; empty = no eval
    question_field: str = "question"  # the data column holding the question
    answer_field: str = "answer"      # the data column holding the answer
    system_prompt: str = "Please reason step by step, and put your final answer within \\boxed{}."
    reward_funcs: str = "custom_task:boxed_answer"  # comma-separated module:function names
    reward_weights: str = ""          # comma-separated weights, one per function; empty = 1 each
    max_steps: int = 100
    learning_rate: float = 1e-6
    loss_type: str = "dr_grpo"


# ----------------------------------------------------------------------------- example rewards

def boxed_answer(prompts: list[str], completions: list[str], answer: list, **columns) -> list[float]:
    """1 when the last \\boxed{} is equivalent to the answer (math-verify), else 0."""
    boxed = [last_boxed(c) for c in completions]
    return [float(b is not None and is_equiv(b, str(a))) for b, a in zip(boxed, answer)]


def boxed_format(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """1 when the completion ends its reasoning in a \\boxed{} answer."""
    return [float(last_boxed(c) is not None) for c in completions]

# ----------------------------------------------------------------------------- the env


class RewardFunctionsEnv:
    """A single-turn env over TRL-style reward functions: the protocol every env follows
    (prompt, reward; multi-turn envs add stop_strings, max_turns and step)."""
    stop_strings: list = []
    max_turns = 1
    observation_role = "user"

    def __init__(self, funcs: dict, system_prompt: str = ""):
        self.funcs, self.system_prompt = funcs, system_prompt
        self.score_term = next(iter(funcs))   # what grpo.eval reports

    def prompt(self, example: dict) -> list[dict]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": example["question"]}]

    def reward(self, example: dict, trajectory) -> dict[str, float]:
        columns = {k: [v] for k, v in example.items()}
        return {name: float(fn(prompts=[example["question"]], completions=[trajectory.text], **columns)[0])
                for name, fn in self.funcs.items()}


def import_functions(names: str) -> dict:
    """"pkg.module:fn,other:fn2" -> {fn: callable}; one-line errors."""
    funcs = {}
    for name in filter(None, (n.strip() for n in names.split(","))):
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise SystemExit(f"error: --reward_funcs {name!r}: {type(e).__name__}: {e} "
                             "(expected module:function)")
        funcs[attr] = fn
    if not funcs:
        raise SystemExit("error: --reward_funcs names no function")
    return funcs


def load(cfg: CustomTask, source: str) -> list[dict]:
    return load_or_exit(source, question_field=cfg.question_field, answer_field=cfg.answer_field)


def eval_setup(cfg: CustomTask) -> tuple:
    """The env and the eval examples (also `python -m grpo.eval --run`)."""
    env = RewardFunctionsEnv(import_functions(cfg.reward_funcs), cfg.system_prompt)
    return env, load(cfg, cfg.eval_data) if cfg.eval_data else []


def main(cls=CustomTask):
    cfg = parse_args(cls)
    if not cfg.train_data:
        raise SystemExit("error: --train_data is required (a JSONL, CSV or Parquet file, or a dataset id)")
    env, eval_examples = eval_setup(cfg)
    names = list(env.funcs)
    weights = [float(w) for w in cfg.reward_weights.split(",")] if cfg.reward_weights else [1.0] * len(names)
    if len(weights) != len(names):
        raise SystemExit(f"error: {len(weights)} --reward_weights for {len(names)} --reward_funcs")
    return train(cfg, env, load(cfg, cfg.train_data), eval_examples, reward_weights=dict(zip(names, weights)))


if __name__ == "__main__":
    main()
