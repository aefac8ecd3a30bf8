"""ProcessGRPO: each reasoning step credited by how much it raised a frozen copy's chance of
finishing the problem correctly (model card: zaydsyed/TactLM-Math-ProcessGRPO-Qwen2.5-0.5B).

For a sampled solution split into steps 1..S (its paragraphs), with boundaries k = 0..S:
    p_k          success rate of K continuations of the frozen model from the prefix ending at
                 boundary k (before step 1, after step 1, ...); p_S is the solution's own outcome;
                 p_0 (the prompt alone) is one estimate per prompt, shared by its G solutions
    progress_k = p_k - p_(k-1)                      k = 1..S; they sum to outcome - p_0
    A_t        = A_outcome + weight * progress_k    for every token t of step k
Only where the credit lands changes: progress telescopes. Controls (`mode`): "outcome" leaves
the outcome advantage alone (plain GRPO), "shuffled" permutes a solution's progress values
across its steps (same total, placement destroyed).

The continuations are sampled by a grpo.engine.sampler.Sampler over the frozen model with
`continue_from` (the sampler's one prefix-reuse primitive, which also forks a prompt into its G
samples): prompt + solution is prefilled once, up to its last boundary, and each boundary's K
rows fork that KV cache truncated at the boundary (a causal prefix's KV does not depend on what
follows), so prefill costs one pass per solution, not one per boundary; the continuations of
every boundary of the batch share continuous batching, and are token for token what a fresh
prefill of each prefix would give under the same seeds.

Cost caps: `max_steps` boundaries per solution (later steps merged), `max_continuation_tokens`
per continuation, and `max_total_tokens` on a step's worst case (boundaries x K x continuation
length): over it, whole solutions are left out, longest first (`within_budget`), and their steps
get the outcome advantage only. `stats` holds the last call's costs: boundaries, continuation
tokens, prefill tokens computed vs what re-prefilling every prefix would cost, and seconds
spent (the trainer divides by its rollout time for the share spent on continuations).
"""
import random
import time
from dataclasses import dataclass, field

import torch

from grpo.engine.sampler import SamplingParams
from grpo.env import as_env
from grpo.rollout import Trajectory

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


def step_pieces(tokenizer, ids: list[int]) -> list[str]:
    """Each token decoded alone, as the text the model wrote: special tokens (the closing
    <|im_end|>) are empty pieces, so a solution that ends in a blank line gets no extra step of
    the end token alone (K continuations each, for no credit)."""
    return tokenizer.batch_decode([[x] for x in ids], skip_special_tokens=True)  # one call a solution


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


def within_budget(lengths: list[int], boundaries: list[int], cost: int, max_total: int) -> list[bool]:
    """Which solutions keep their continuations under a cap on a step's worst-case continuation
    tokens, each boundary costing `cost` (K x max continuation tokens). While over the cap, the
    longest solution left is dropped (ties: the later one): it has the most boundaries and the
    longest prefixes to attend over. A dropped solution's steps get the outcome advantage only.
    max_total <= 0: no cap."""
    keep, total = [True] * len(lengths), cost * sum(boundaries)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], -i)):
        if max_total <= 0 or total <= max_total:
            break
        keep[i], total = False, total - cost * boundaries[i]
    return keep


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
    sampler: object                   # a grpo.engine.sampler.Sampler over the frozen model
    tokenizer: object
    env: object
    num_continuations: int = 16       # K
    weight: float = 3.0               # progress weight
    mode: str = "process"             # process | outcome (plain GRPO) | shuffled (control)
    temperature: float = 1.0
    max_continuation_tokens: int = 512
    max_steps: int = 8                # boundaries per solution (later steps merged)
    max_total_tokens: int = 0         # cap on boundaries x K x max_continuation_tokens per call; 0 = none
    seed: int = 0
    split: object = step_ends         # (token pieces, max_steps) -> step ends; paragraphs by default
    stats: dict = field(default_factory=dict)   # the last call's costs, for logging

    def __post_init__(self):
        if self.mode not in ("process", "outcome", "shuffled"):
            raise ValueError(f"mode={self.mode!r}: process | outcome | shuffled")
        self.term = as_env(self.env).score_term   # the reward term that means "solved"

    def memory_terms(self, cfg) -> list:
        """What the frozen copy and its sampler hold through the run, for the trainer's memory plan."""
        if self.sampler is None:
            return []
        from grpo.fit.memory import frozen_copy_terms
        s, args = self.sampler, self.sampler.model.args
        length = cfg.max_prompt_length + cfg.max_completion_length + self.max_continuation_tokens
        return frozen_copy_terms(args, next(s.model.parameters()).element_size(), s.runner.gen_batch, length,
                                 s.runner.kv_budget_bytes)

    def __call__(self, trajs: list[Trajectory], advantages: torch.Tensor, step: int = 0) -> torch.Tensor:
        """(N,) outcome advantages -> (N, C_max) token advantages (0 past each completion)."""
        if self.mode == "outcome":
            return advantages
        C = max(len(t.completion_ids) for t in trajs)
        out = torch.zeros(len(trajs), C)
        ends = [self.split(step_pieces(self.tokenizer, t.completion_ids), self.max_steps) for t in trajs]
        rates = self.success_rates(trajs, ends, step)
        rng = random.Random(f"shuffle-{self.seed}-{step}")
        for i, t in enumerate(trajs):
            if rates[i] is None:      # over max_total_tokens: no progress, the outcome advantage only
                progress = [0.0] * len(ends[i])
            else:
                progress = step_progress(rates[i], t.rewards[self.term])
            if self.mode == "shuffled":
                progress = shuffled(progress, rng)
            C_i = len(t.completion_ids)
            out[i, :C_i] = credit_tokens(C_i, ends[i], float(advantages[i]), progress, self.weight)
        return out.to(advantages.device)

    def success_rates(self, trajs: list[Trajectory], ends: list[list[int]],
                      step: int) -> list[list[float] | None]:
        """p_0..p_(S-1) per trajectory: K continuations from each boundary before its last step
        (None for a solution left out by max_total_tokens). p_0, the prompt alone, is one estimate
        per prompt shared by its solutions (the same prefix: G estimates would cost G times as
        much and give step 1's credit G different baselines), sampled on the first kept one."""
        K, t0 = self.num_continuations, time.perf_counter()
        keep = within_budget([len(t.completion_ids) for t in trajs], [len(e) for e in ends],
                             K * self.max_continuation_tokens, self.max_total_tokens)
        kept = [i for i in range(len(trajs)) if keep[i]]
        carrier = {}                                       # prompt index -> the solution that samples p_0
        for i in kept:
            carrier.setdefault(trajs[i].prompt_index, i)
        # boundary k (0 = the prompt) of solution i, for the boundaries it samples
        own = {i: [(k, b) for k, b in enumerate([0] + ends[i][:-1])
                   if k or carrier[trajs[i].prompt_index] == i]
               for i in kept}
        sequences = [trajs[i].prompt_ids + trajs[i].completion_ids for i in kept]
        cuts = [[len(trajs[i].prompt_ids) + b for _, b in own[i]] for i in kept]
        # one random stream per (solution, boundary), whichever other solutions are kept and
        # whichever rank holds them: the solution's global id (prompt index, sample within group),
        # and for p_0 the prompt's (refill prompts have indices past 2^40: folded into 47 bits,
        # so that the ids fit an int64)
        nth = [sum(t.prompt_index == trajs[i].prompt_index for t in trajs[:i]) for i in range(len(trajs))]
        fold = lambda prompt, n: (prompt * 1_000_003 + n) & ((1 << 47) - 1)  # noqa: E731
        gid = [fold(t.prompt_index, n) for t, n in zip(trajs, nth)]
        request_ids = [(fold(trajs[i].prompt_index, 1_000_002) if k == 0 else gid[i]) << 16 | k
                       for i in kept for k, _ in own[i]]
        params = SamplingParams(n=K, temperature=self.temperature, max_tokens=self.max_continuation_tokens,
                                seed=self.seed * 1_000_003 + step)
        before = self.sampler.tokens_prefilled
        completions = (self.sampler.continue_from(sequences, cuts, params, prompt_ids=request_ids)
                       if kept else [])
        prefilled = self.sampler.tokens_prefilled - before
        t1 = time.perf_counter()
        rates, j, p0 = [None] * len(trajs), 0, {}          # boundary j's samples at j*K .. j*K+K-1
        for i in kept:
            t, rates[i] = trajs[i], []
            for k, boundary in own[i]:
                wins = 0.0
                for c in completions[j * K:(j + 1) * K]:
                    ids = t.completion_ids[:boundary] + c.token_ids
                    text = self.tokenizer.decode(ids, skip_special_tokens=True)
                    cont = Trajectory(example=t.example, prompt_index=t.prompt_index, prompt_ids=t.prompt_ids,
                                      completion_ids=ids, loss_mask=[], sampler_logprobs=[],
                                      finish_reason=c.finish_reason, num_turns=1, text=text, turns=[text])
                    wins += self.env.reward(t.example, cont)[self.term]
                if k == 0:
                    p0[t.prompt_index] = wins / K
                else:
                    rates[i].append(wins / K)
                j += 1
        for i in kept:
            rates[i] = [p0[trajs[i].prompt_index]] + rates[i]
        reprefill = sum(sum(c) for c in cuts)              # every prefix prefilled as its own prompt
        self.stats = {"boundaries": sum(map(len, cuts)), "continuations": len(completions),
                      "continuation_tokens": sum(len(c.token_ids) for c in completions),
                      "dropped_solutions": len(trajs) - len(kept),
                      "prefill_tokens": prefilled, "prefix_tokens": reprefill,
                      "prefill_tokens_saved": reprefill - prefilled,
                      "sample_seconds": t1 - t0, "score_seconds": time.perf_counter() - t1}
        return rates
