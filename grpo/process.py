"""ProcessGRPO: each reasoning step credited by how much it raised a frozen copy's chance of
finishing the problem correctly (shared/seeds/processgrpo_qwen25_05b.md).

For a sampled solution split into steps 1..S (its paragraphs), with boundaries k = 0..S:
    p_k          success rate of K continuations of the frozen model from the prefix ending at
                 boundary k (before step 1, after step 1, ...); p_S is the solution's own outcome
    progress_k = p_k - p_(k-1)                      k = 1..S; they sum to outcome - p_0
    A_t        = A_outcome + weight * progress_k    for every token t of step k
Only where the credit lands changes: progress telescopes. Controls (`mode`): "outcome" leaves
the outcome advantage alone (plain GRPO), "shuffled" permutes a solution's progress values
across its steps (same total, placement destroyed).

The continuations are sampled by a grpo.sampler.Sampler over the frozen model: each prefix is
a prompt of K samples (prefilled once and forked into its K rows). Not yet done: forking one
prefill of the whole solution at each boundary (DESIGN decision 2); today the prefixes of a
solution are separate prompts, so its shared prefix is prefilled once per boundary (`stats`
counts those prefix tokens). The cost is capped by the boundaries per solution (later steps
merged) and the continuation length.
"""
import random
from dataclasses import dataclass, field

import torch

from grpo.rollout import Trajectory
from grpo.sampler import SamplingParams

# ----------------------------------------------------------------------------- the math


def step_ends(pieces: list[str], max_steps: int = 0) -> list[int]:
    """Token pieces of a completion (each token decoded alone) -> the exclusive end index of each
    step. Steps are paragraphs, split at blank lines; a text without a blank line is split at
    lines. A token holding a separator ends its step; separators with nothing before them
    (leading or repeated blank lines) end none; the last step ends at len(pieces), and
    max_steps > 0 merges the last steps into one."""
    full = "".join(pieces)
    sep = "\n\n" if "\n\n" in full.strip() else "\n"
    text, ends, start = "", [], 0                # start: where the current step's text begins
    for i, piece in enumerate(pieces):
        before = len(text)
        text += piece
        hit = text.find(sep, max(start, before - len(sep) + 1))
        if hit >= 0 and text[start:hit].strip():
            ends.append(i + 1)
            start = len(text)
    if not ends or text[start:].strip():
        ends.append(len(pieces))                 # the last step (unless only blanks follow the last end)
    ends[-1] = len(pieces)
    if max_steps > 0 and len(ends) > max_steps:
        ends = ends[:max_steps - 1] + [len(pieces)]
    return ends


def step_progress(rates: list[float], outcome: float) -> list[float]:
    """p_0..p_(S-1) and the outcome (p_S) -> progress_1..progress_S."""
    p = list(rates) + [float(outcome)]
    return [p[k] - p[k - 1] for k in range(1, len(p))]


def credit_tokens(num_tokens: int, ends: list[int], outcome_advantage: float, progress: list[float],
                  weight: float) -> torch.Tensor:
    """(C,) per-token advantage: A_outcome + weight * progress of the step the token belongs to."""
    assert len(ends) == len(progress) and ends[-1] == num_tokens, f"{ends=} {len(progress)=} {num_tokens=}"
    out = torch.full((num_tokens,), float(outcome_advantage))
    start = 0
    for end, prog in zip(ends, progress):
        out[start:end] += weight * prog
        start = end
    return out


def shuffled(progress: list[float], rng: random.Random) -> list[float]:
    """The shuffled-credit control: the same values, permuted across the steps."""
    out = list(progress)
    rng.shuffle(out)
    return out

# ----------------------------------------------------------------------------- Monte Carlo


@dataclass
class ProcessCredit:
    """Token advantages for a batch of trajectories from a frozen model's continuations.
    `env.reward(example, trajectory)["correct"]` scores a continued solution."""
    sampler: object                   # a grpo.sampler.Sampler over the frozen model
    tokenizer: object
    env: object
    num_continuations: int = 16       # K
    weight: float = 3.0               # progress weight
    mode: str = "process"             # process | outcome (plain GRPO) | shuffled (control)
    temperature: float = 1.0
    max_continuation_tokens: int = 512
    max_steps: int = 8                # boundaries per solution (later steps merged)
    seed: int = 0
    split: object = step_ends         # (token pieces, max_steps) -> step ends; paragraphs by default
    stats: dict = field(default_factory=dict)   # the last call's costs, for logging

    def __post_init__(self):
        if self.mode not in ("process", "outcome", "shuffled"):
            raise ValueError(f"mode={self.mode!r}: process | outcome | shuffled")

    def __call__(self, trajs: list[Trajectory], advantages: torch.Tensor, step: int = 0) -> torch.Tensor:
        """(N,) outcome advantages -> (N, C_max) token advantages (0 past each completion)."""
        if self.mode == "outcome":
            return advantages
        C = max(len(t.completion_ids) for t in trajs)
        out = torch.zeros(len(trajs), C)
        pieces = [[self.tokenizer.decode([x]) for x in t.completion_ids] for t in trajs]
        ends = [self.split(p, self.max_steps) for p in pieces]
        rates = self.success_rates(trajs, ends, step)
        rng = random.Random(f"shuffle-{self.seed}-{step}")
        for i, t in enumerate(trajs):
            progress = step_progress(rates[i], t.rewards.get("correct", 0.0))
            if self.mode == "shuffled":
                progress = shuffled(progress, rng)
            C_i = len(t.completion_ids)
            out[i, :C_i] = credit_tokens(C_i, ends[i], float(advantages[i]), progress, self.weight)
        return out.to(advantages.device)

    def success_rates(self, trajs: list[Trajectory], ends: list[list[int]], step: int) -> list[list[float]]:
        """p_0..p_(S-1) per trajectory: K continuations from each boundary before its last step."""
        prefixes, owners = [], []
        for i, (t, e) in enumerate(zip(trajs, ends)):
            for k, boundary in enumerate([0] + e[:-1]):
                prefixes.append(t.prompt_ids + t.completion_ids[:boundary])
                owners.append((i, k, boundary))
        K = self.num_continuations
        params = SamplingParams(n=K, temperature=self.temperature, max_tokens=self.max_continuation_tokens,
                                seed=self.seed * 1_000_003 + step)
        completions = self.sampler.generate(prefixes, params)       # prompt j's samples at j*K .. j*K+K-1
        rates = [[0.0] * len(e) for e in ends]
        for j, (i, k, boundary) in enumerate(owners):
            t = trajs[i]
            wins = 0.0
            for c in completions[j * K:(j + 1) * K]:
                ids = t.completion_ids[:boundary] + c.token_ids
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                cont = Trajectory(example=t.example, prompt_index=t.prompt_index, prompt_ids=t.prompt_ids,
                                  completion_ids=ids, loss_mask=[], sampler_logprobs=[],
                                  finish_reason=c.finish_reason, num_turns=1, text=text, turns=[text])
                wins += self.env.reward(t.example, cont).get("correct", 0.0)
            rates[i][k] = wins / K
        self.stats = {"boundaries": len(prefixes), "continuations": len(completions),
                      "continuation_tokens": sum(len(c.token_ids) for c in completions),
                      "prefix_tokens": sum(len(p) for p in prefixes)}
        return rates
