"""The run's time budget: every phase estimated from this machine's measured speed, the evals
shrunk when the whole run cannot fit, and the stop rule the RL loop asks after each step.

A run has a budget only when it is given one: `train(..., budget=RunBudget(...))` (the CPU
recipe's), or the Config fields of the same names (a command line's `--run_budget_min`,
`--time_budget_min`: `RunBudget.of`). Without one the trainer runs none of this: the evals take
their configured sizes, nothing is probed and RL has no time limit.

`run_budget_min` covers the whole process: the eval before training, the warm-start, its evals,
RL and the last evals. A probe at start (a few seconds) times the sampler's decode and one
training forward + backward; each phase is estimated from those rates and its token counts, and
the phases run so far correct the rest (one factor, measured / estimated): the run's `TimePlan`.
When the plan does not fit, the evals shrink, never below `min_eval_questions` (MIN_EVAL by default),
and the evals after the warm-start and after RL keep the same first questions, so that their
comparison stays paired. RL always runs at least `min_rl_steps` steps; the plan line says when that
takes the run past its budget. `time_budget_min` is a limit on RL alone (no plan, no probe).
"""
import math
import time
from dataclasses import dataclass

import torch

from grpo.engine.cpu import trim
from grpo.infra import dist

MIN_EVAL = 20  # questions: below this a 95% interval spans most of [0, 1]


@dataclass(frozen=True)
class RunBudget:
    """A run's time limits, in minutes (0: none), the one object the trainer's budget code reads."""
    run_budget_min: float = 0.0       # the whole run, its last eval included: a TimePlan fits the evals in
    time_budget_min: float = 0.0      # RL alone
    min_eval_questions: int = MIN_EVAL  # the plan never shrinks an eval below this many questions
    min_rl_steps: int = 1             # RL steps run even when the budget is spent before RL

    def __post_init__(self):
        if min(self.run_budget_min, self.time_budget_min, self.min_eval_questions, self.min_rl_steps) < 0:
            raise ValueError(f"{self}: the time budgets, min_eval_questions and min_rl_steps "
                             "must not be negative")

    @classmethod
    def of(cls, cfg) -> "RunBudget | None":
        """The budget a Config's fields ask for (a command line's --run_budget_min, --time_budget_min,
        --min_eval_questions, --min_rl_steps); None when it sets neither time limit."""
        if not (cfg.run_budget_min or cfg.time_budget_min):
            return None
        return cls(cfg.run_budget_min, cfg.time_budget_min, cfg.min_eval_questions, cfg.min_rl_steps)


@dataclass
class Rates:
    """Seconds per token on this machine, at the precision the run uses."""
    decode: float   # one sampled token of one row, in a wave of gen_batch rows
    train: float    # one token through forward + backward (prefill costs about a third)


def probe(model, sampler, prompt: list[int], rows: int, k: int = 8, train_tokens: int = 128) -> Rates:
    """Rates from a sampler call (`rows` rows of k tokens from one prompt: its prefill is a
    small share, counted in, so the rate errs slow) and one forward + backward of `train_tokens`
    tokens, its gradients discarded; the slowest rank's, the same on every rank. Each is timed
    after one untimed run of the same shapes, which compiles the Triton kernels and captures the
    CUDA graphs a GPU's first call would (seconds, once a run, not a rate), and between device
    synchronizations (a GPU's work is queued: the host clock alone times the queueing)."""
    from grpo.engine.sampler import SamplingParams
    model.eval()
    with dist.gathered(model):
        params = SamplingParams(n=rows, temperature=1.0, max_tokens=k, stop_token_ids=[], seed=0)
        sampler.generate([prompt], params)  # warm-up, untimed: the same call, so the same cache and graphs
        decode_s = timed(lambda: sampler.generate([prompt], params)) / (k * rows)
        sampler.release()
    ids = torch.tensor([(prompt * (1 + train_tokens // max(len(prompt), 1)))[:train_tokens]],
                       device=dist.device())
    model.train()
    step = lambda: model(ids, labels=ids).sum().backward()  # noqa: E731
    step()  # warm-up, untimed
    train_s = timed(step) / train_tokens
    model.zero_grad(set_to_none=True)
    if dist.device().type == "cpu":
        trim()  # the probe's activations and gradients back to the OS before the run's first phase
    decode_s, train_s = dist.all_max_floats([decode_s, train_s])  # the slowest rank sets the pace
    return Rates(decode=decode_s, train=train_s)


def timed(fn) -> float:
    """Seconds `fn` takes, its device work included: synchronized before and after on a GPU."""
    sync = torch.cuda.synchronize if dist.device().type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def estimate(cfg, rates: Rates, prompt_len: float, sft_tokens: float, world: int = 1) -> dict:
    """Seconds per unit of each phase: "before", "warmstart", "after" per eval question,
    "warm-start" per step, "rl_step" per RL step. An eval question costs its prompt (prefill)
    and its decoded tokens, per protocol (sampled, and greedy with eval_greedy); the untrained
    model rambles to the token limit, and so may a warm-started one: the CPU recipe's, after its
    15 steps, wrote 195 of its 224 tokens on average (137 of 200 answers cut at the limit, fp32),
    far longer than the gold answers it learned from, so every eval is planned at the limit
    (errs slow). An RL step: B x G rollouts and mu updates over them. Each of the `world` ranks
    takes its share of the questions and rollouts; `sft_tokens` is one rank's."""
    n = (2 if cfg.eval_greedy and cfg.eval_temperature else 1) * cfg.eval_n / world
    question = lambda length: n * (length * rates.decode + prompt_len * rates.train / 3)  # noqa: E731
    trained_len = cfg.eval_max_completion_length or cfg.max_completion_length
    rows = cfg.prompts_per_step * cfg.num_generations / world
    L = cfg.max_completion_length
    return {"before": question(trained_len), "warmstart": question(trained_len),
            "after": question(trained_len), "warm-start": sft_tokens * rates.train,
            "rl_step": rows * (L * rates.decode + cfg.num_iterations * (prompt_len + L) * rates.train)}


def fit(left_s: float, per_q: float, per_before_q: float, eval_q: int, before_q: int,
        floor: int = MIN_EVAL) -> tuple[int, int]:
    """(eval questions, before-eval questions): the configured sizes, or both scaled down alike
    until their evals take `left_s` seconds (what the budget leaves after the other phases), never
    below `floor` (4 for the before-eval) nor above what was configured."""
    cost = eval_q * per_q + before_q * per_before_q
    scale = min(1.0, max(left_s, 0.0) / cost) if cost > 0 else 1.0
    return (max(math.floor(scale * eval_q), min(floor, eval_q)),
            max(math.floor(scale * before_q), min(4, before_q)))


class TimePlan:
    """One run's plan under run_budget_min: the eval sizes it chose, its estimates, and the
    phases measured so far (`done(phase, seconds, units)`), whose measured / estimated ratio
    corrects every later estimate."""

    def __init__(self, cfg, budget: RunBudget, unit: dict, eval_q: int, before_q: int):
        self.cfg, self.budget, self.unit, self.eval_q, self.before_q = cfg, budget, unit, eval_q, before_q
        self.configured_q = eval_q
        self.budget_s = 60 * budget.run_budget_min
        self.measured = self.estimated = 0.0
        self.shrunk = ""

    @classmethod
    def plan(cls, cfg, budget: RunBudget, unit: dict, eval_q: int, before_q: int) -> "TimePlan":
        """Fits the evals into the budget left after the warm-start and min_rl_steps of RL."""
        self = cls(cfg, budget, unit, eval_q, before_q)
        left = self.budget_s - cfg.sft_steps * unit["warm-start"] - budget.min_rl_steps * unit["rl_step"]
        self.eval_q, self.before_q = fit(left, self.per_eval_q(), unit["before"], eval_q, before_q,
                                         budget.min_eval_questions)
        if not cfg.eval_before_limit:  # before and after on the same questions: a paired comparison
            self.before_q = self.eval_q
        self.note(eval_q, before_q)
        return self

    def per_eval_q(self) -> float:
        """Seconds per question of the evals after the warm-start (if any) and after RL."""
        return self.unit["warmstart"] * bool(self.cfg.sft_steps) + self.unit["after"]

    def factor(self) -> float:
        return self.measured / self.estimated if self.estimated > 0 else 1.0

    def done(self, phase: str, seconds: float, units: float):
        self.measured, self.estimated = self.measured + seconds, self.estimated + self.unit[phase] * units

    def estimate(self, phase: str, units: float) -> float:
        """Seconds for `units` of a phase, corrected by the phases measured so far."""
        return self.factor() * self.unit.get(phase, 0.0) * units

    def refit(self, spent_s: float) -> bool:
        """Before the evals after the warm-start: their size again, from the configured one, what
        is left and the phases measured so far (which correct a probe that ran slow or fast: the
        start's size was provisional). True if it changed."""
        was = self.eval_q
        left = self.budget_s - spent_s - self.estimate("rl_step", self.budget.min_rl_steps)
        self.eval_q = fit(left, self.factor() * self.per_eval_q(), 0.0, self.configured_q, 0,
                          self.budget.min_eval_questions)[0]
        if self.eval_q != was:
            self.shrunk = (f"after the warm-start: evals of {self.eval_q} questions (planned {was}, "
                           f"configured {self.configured_q})")
        return self.eval_q != was

    def note(self, eval_q: int, before_q: int):
        if (self.eval_q, self.before_q) != (eval_q, before_q):
            self.shrunk = (f"shrunk to fit: evals of {self.eval_q} questions (configured {eval_q}), "
                           f"before-eval {self.before_q} (configured {before_q})")

    def line(self, spent_s: float = 0.0) -> str:
        """The plan line: each phase's estimate, what shrank, and whether the run fits. With
        `spent_s` (after the warm-start), the phases still to run after those seconds."""
        f, u, cfg, min_rl = self.factor(), self.unit, self.cfg, self.budget.min_rl_steps
        phases = [] if spent_s else [("eval before", u["before"] * self.before_q)]
        if cfg.sft_steps:
            phases += [] if spent_s else [("warm-start", u["warm-start"] * cfg.sft_steps)]
            phases += [("its evals", u["warmstart"] * self.eval_q)]
        phases += [("last evals", u["after"] * self.eval_q)]
        fixed = spent_s + f * sum(s for _, s in phases)
        rl_s = self.budget_s - fixed
        steps = min(max(min_rl, int(rl_s // (f * u["rl_step"]))), cfg.max_steps)
        head = f"{spent_s / 60:.1f} min spent; " if spent_s else ""
        text = ("plan, estimated from this machine's speed: " + head
                + ", ".join(f"{name} {f * s / 60:.1f} min" for name, s in phases)
                + f", RL {f * u['rl_step']:.0f} s a step: ~{steps} steps")
        text += f" | run budget {self.budget_s / 60:.1f} min"
        over = fixed + min(min_rl, cfg.max_steps) * f * u["rl_step"]
        if over > self.budget_s:
            text += (f" | does not fit on this machine: with {self.eval_q} eval questions and "
                     f"{min(min_rl, cfg.max_steps)} RL steps (min_rl_steps) the run takes about "
                     f"{over / 60:.0f} min")
        return text + (f" | {self.shrunk}" if self.shrunk else "")


def make_plan(budget: RunBudget, cfg, model, sampler, prompts: list[list[int]], sft_tokens: float,
              eval_q: int, before_q: int) -> TimePlan | None:
    """The run's TimePlan under run_budget_min, from the probe and this run's token counts (`prompts`:
    a few eval prompts' token ids; `sft_tokens`: a warm-start batch's tokens a rank), fitting the
    configured eval sizes (`eval_q`, `before_q`) into it; its line printed. None without run_budget_min
    (time_budget_min alone plans nothing)."""
    if not budget.run_budget_min:
        return None
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    rates = probe(model, sampler, prompts[0], rows=min(cfg.gen_batch, 64))
    unit = estimate(cfg, rates, mean([len(p) for p in prompts]), sft_tokens, dist.world_size())
    plan = TimePlan.plan(cfg, budget, unit, eval_q, before_q)
    dist.print0(f"speed probe: decode {1 / rates.decode:.0f} tokens/s (64 rows), forward + backward "
                f"{1 / rates.train:.0f} tokens/s a rank")
    dist.print0(plan.line())
    return plan


def rl_budget(budget: RunBudget, run_seconds: float, last_eval_seconds: float) -> float | None:
    """Seconds RL may take, the same on every rank (the smallest): time_budget_min, and what
    run_budget_min leaves after the `run_seconds` already spent and a last eval of
    `last_eval_seconds` (as long as the previous eval, or the plan's estimate). None: no limit."""
    limits = [60 * budget.time_budget_min] if budget.time_budget_min else []
    if budget.run_budget_min:
        limits.append(60 * budget.run_budget_min - run_seconds - last_eval_seconds)
    return -dist.all_max_floats([-min(limits)])[0] if limits else None


def stop_reason(stop_requested: bool, budget_s: float | None, t_start: float, steps_run: int,
                min_steps: int = 0) -> str | None:
    """Why RL stops after this step, the same on every rank: SIGTERM on any rank, or the time
    budget by the slowest clock (each rank's own clock would let ranks leave at different steps,
    and the next collective would hang). The budget stops RL before a step that would end past
    it, judged by the mean of the `steps_run` steps so far (stopping only once it was spent ran
    a 6-minute budget to 6.8 minutes), but not before `min_steps` steps."""
    sigterm, elapsed = dist.all_max_floats([float(stop_requested), time.time() - t_start])
    if sigterm:
        return "sigterm"
    next_end = elapsed * (steps_run + 1) / max(steps_run, 1)
    over = budget_s is not None and next_end > budget_s
    return "budget" if over and steps_run >= min_steps else None
