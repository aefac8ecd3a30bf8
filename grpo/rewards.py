"""Reward functions written for TRL's GRPOTrainer, run unchanged, and the env they make.

TRL's calling convention (its GRPOTrainer docs, "Using a custom reward function"):
    fn(prompts, completions, completion_ids, **kwargs) -> list[float | None]
- batched: one call for all of a rank's completions of a step (G consecutive per prompt);
- prompts and completions in the dataset's form: text for a standard dataset, chat messages
  for a conversational one (a completion is then [{"role": "assistant", "content": ...}], the
  tool turns included for a multi-turn env);
- every other dataset column as a keyword list, one entry per completion (`answer=[...]`);
- None: "not applicable to this sample"; it is left out of the weighted sum (TRL sums with
  nansum) and of the term's logged mean.
RewardFunctionsEnv is an env (grpo.trainer.train's protocol) over such functions; `base`, an
env of our own protocol, can supply the prompts and the tool (step, stop_strings, ...) while
the functions score. import_functions reads `--reward_funcs` names.
"""
import importlib
import importlib.util
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def is_conversational(prompt) -> bool:
    """TRL's test: a list of {"role", "content"} messages (not text)."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) and "role" in m for m in prompt)


class RewardFunctionsEnv:
    """A single-turn env (or `base`'s multi-turn one) scored by TRL-style reward functions.

    prompt(example): a conversational `prompt` column as given; else the `question` text as the
    user message after `system_prompt` (the recipe's question/answer data); or, with
    raw_text=True (TRL's standard form, as GRPOTrainer takes it), the `prompt` text as is,
    without a chat template."""
    stop_strings: list = []
    max_turns = 1
    observation_role = "user"

    def __init__(self, funcs: dict, system_prompt: str = "", raw_text: bool = False, base=None):
        self.funcs, self.system_prompt, self.raw_text, self.base = funcs, system_prompt, raw_text, base
        self.score_term = next(iter(funcs), None) or getattr(base, "score_term", "correct")  # what grpo.eval reports
        for name in ("stop_strings", "max_turns", "observation_role", "chat_kwargs", "step", "gold_messages",
                     "extract", "answered"):
            if hasattr(base, name):  # the base env's tool protocol, as its own
                setattr(self, name, getattr(base, name))

    def prompt(self, example: dict):
        if self.base is not None:
            return self.base.prompt(example)
        p = example.get("prompt")
        if is_conversational(p):
            return [dict(m) for m in p]
        if self.raw_text:
            return p
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": example["question"]}]

    def reward(self, example: dict, trajectory) -> dict:
        return self.reward_batch([example], [trajectory])[0]

    def reward_batch(self, examples: list, trajectories: list) -> list[dict]:
        """One call per function for the whole batch; -> a dict of terms per trajectory (None: not
        applicable), the base env's own terms first."""
        if hasattr(self.base, "reward"):  # concurrently, as score() calls env.reward (a term may wait on HTTP)
            with ThreadPoolExecutor(16) as pool:
                out = [dict(r) for r in pool.map(self.base.reward, examples, trajectories)]
        else:
            out = [{} for _ in trajectories]
        if not self.funcs:
            return out
        prompts = [self._prompt_value(e) for e in examples]
        conversational = any(is_conversational(p) for p in prompts)
        completions = [completion_messages(t, self.observation_role) if conversational else t.text
                       for t in trajectories]
        # every column any row has (a list of dicts may leave some out: None there, as datasets fills them)
        keys = [k for k in dict.fromkeys(k for e in examples for k in e) if k not in ("prompt", "completion",
                                                                                     "completion_ids")]
        columns = {k: [e.get(k) for e in examples] for k in keys}
        ids = [list(t.completion_ids) for t in trajectories]
        for name, fn in self.funcs.items():
            values = fn(prompts=prompts, completions=completions, completion_ids=ids, **columns)
            if values is None or len(values) != len(trajectories):
                raise ValueError(f"reward function {name} returned {None if values is None else len(values)} "
                                 f"values for {len(trajectories)} completions (one per completion, None = n/a)")
            for terms, v in zip(out, values):
                terms[name] = None if v is None or isinstance(v, float) and math.isnan(v) else float(v)
        return out

    def _prompt_value(self, example: dict):
        """The prompt as the dataset holds it: messages, or text (TRL passes `prompts` so)."""
        p = example.get("prompt")
        if is_conversational(p) or self.raw_text and isinstance(p, str):
            return p
        return example.get("question", p)


def completion_messages(trajectory, role: str = "tool") -> list[dict]:
    """A completion in TRL's conversational form: the assistant turns, with the env's observations
    (as `role` messages) between them for a multi-turn episode."""
    out = []
    for k, turn in enumerate(trajectory.turns or [trajectory.text]):
        out.append({"role": "assistant", "content": turn})
        if k < len(trajectory.observations):
            out.append({"role": role, "content": trajectory.observations[k]})
    return out


def weighted_sum(terms: dict, weights: dict) -> float:
    """sum of weight x term over the terms that apply (None: skipped, as TRL's nansum); weight 1 if unnamed."""
    return sum(weights.get(k, 1.0) * v for k, v in terms.items() if v is not None)


# ----------------------------------------------------------------------------- --reward_funcs names

def import_functions(names: str, flag: str = "--reward_funcs") -> dict:
    """"mod:fn,pkg.mod:fn2,my_rewards.py:fn3,/abs/path/r.py:fn4" -> {fn: callable}; one-line errors.
    A module name is looked up with the current folder importable (as `python -c` would); a name
    ending in .py, or holding a path separator, is that file."""
    funcs = {}
    for name in filter(None, (n.strip() for n in names.split(","))):
        where, _, attr = name.rpartition(":")
        if not where or not attr:
            raise SystemExit(f"error: {flag} {name!r}: expected module:function or file.py:function")
        try:
            module = _load(where)
            fn = getattr(module, attr)
        except (ImportError, AttributeError, OSError, SyntaxError) as e:
            raise SystemExit(f"error: {flag} {name!r}: {type(e).__name__}: {e} "
                             "(expected module:function or file.py:function)") from None
        if not callable(fn):
            raise SystemExit(f"error: {flag} {name!r}: {attr} is not a function")
        funcs[attr] = fn
    if not funcs:
        raise SystemExit(f"error: {flag} names no function")
    return funcs


def portable_names(names: str) -> str:
    """--reward_funcs as a run records it: file paths made absolute, and modules found in the current
    folder named by their file, so that `python -m grpo.eval --run` finds them from anywhere."""
    out = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        where, _, attr = name.rpartition(":")
        if where.endswith(".py") or os.sep in where:
            where = str(Path(where).expanduser().resolve())
        else:
            spec = importlib.util.find_spec(where.split(".")[0])
            origin = getattr(spec, "origin", None)
            if origin and "." not in where and Path(origin).parent == Path.cwd():
                where = str(Path(origin).resolve())
        out.append(f"{where}:{attr}")
    return ",".join(out)


def completion_text(completion) -> str:
    """A completion as text in either of TRL's forms (text, or a list of messages: the last one's)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def _load(where: str):
    if where.endswith(".py") or os.sep in where:
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ImportError(f"no such file {path}")
        sys.path.insert(0, str(path.parent))  # the file's own imports of its neighbours
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(path.stem, module)
        spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # `python recipes/x.py` puts the recipe's folder first, not the current one
    return importlib.import_module(where)
