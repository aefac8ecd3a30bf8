"""Reward functions written for TRL's GRPOTrainer, run unchanged, and the env they make.

TRL's calling convention (its GRPOTrainer docs, "Using a custom reward function"):
    fn(prompts, completions, completion_ids, **kwargs) -> list[float | None]
- batched: one call for all of a rank's completions of a step (G consecutive per prompt);
- prompts and completions in the dataset's form: text for a standard dataset, chat messages
  for a conversational one (a completion is then [{"role": "assistant", "content": ...}], the
  tool turns included for a multi-turn env);
- every other dataset column as a keyword list, one entry per completion (`answer=[...]`);
- None: "not applicable to this sample"; it is left out of the weighted sum (TRL sums with
  nansum) and of the term's logged mean. A completion that every function returns None for is
  unscorable: its reward is NaN, not 0, so that, as in TRL's GRPOTrainer, it is left out of its
  group's mean and std and gets advantage 0 (grpo.loss.group_advantages), and it is counted
  (`reward/unscorable`).
RewardFunctionsEnv is an env (grpo.trainer.train's protocol) over such functions; `base`, an
env of our own protocol, can supply the prompts and the tool (step, stop_strings, ...) while
the functions score. `--reward_funcs` names become functions in grpo/cli/reward_funcs.py.
"""
import math
from concurrent.futures import ThreadPoolExecutor

from grpo.env import Env, as_env


def is_conversational(prompt) -> bool:
    """TRL's test: a list of {"role", "content"} messages (not text)."""
    return (isinstance(prompt, list) and bool(prompt)
            and all(isinstance(m, dict) and "role" in m for m in prompt))


class RewardFunctionsEnv(Env):
    """A single-turn env (or `base`'s multi-turn one) scored by TRL-style reward functions.

    prompt(example): a conversational `prompt` column as given; else the `question` text as the
    user message after `system_prompt` (the recipe's question/answer data); or, with
    raw_text=True (TRL's standard form, as GRPOTrainer takes it), the `prompt` text as is,
    without a chat template."""
    def __init__(self, funcs: dict, system_prompt: str = "", raw_text: bool = False, base=None):
        self.funcs, self.system_prompt, self.raw_text = funcs, system_prompt, raw_text
        self.base = None if base is None else as_env(base, rewards=False)
        # a base that scores (a plain class without reward() gets a view that gives no terms; an Env subclass
        # that does not override it has none to give)
        self.base_rewards = self.base is not None and not (isinstance(base, Env)
                                                           and type(base).reward is Env.reward)
        self.score_term = next(iter(funcs), None) or (self.base or Env).score_term  # what grpo.eval reports
        if self.base is not None:  # the base env's tool protocol, as its own
            b = self.base
            self.stop_strings, self.max_turns, self.observation_role, self.chat_kwargs = (
                b.stop_strings, b.max_turns, b.observation_role, b.chat_kwargs)
            self.step, self.gold_messages, self.extract, self.answered = (b.step, b.gold_messages, b.extract,
                                                                          b.answered)

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
        if self.base_rewards:  # concurrently, as assign_rewards() calls env.reward (a term may wait on HTTP)
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
                                 f"values for {len(trajectories)} completions "
                                 "(one per completion, None = n/a)")
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


def unscorable(terms: dict | None) -> bool:
    """Every term is None (and there is one): TRL's unscorable completion, whose reward is NaN."""
    return bool(terms) and all(v is None for v in terms.values())


def weighted_sum(terms: dict, weights: dict) -> float:
    """sum of weight x term over the terms that apply (None: skipped, as TRL's nansum); weight 1 if
    unnamed; NaN where none applies (unscorable)."""
    if unscorable(terms):
        return math.nan
    return sum(weights.get(k, 1.0) * v for k, v in terms.items() if v is not None)


def completion_text(completion) -> str:
    """A completion as text in either of TRL's forms (text, or a list of messages: the last one's)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]
