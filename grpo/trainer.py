"""GRPO (arXiv 2402.03300), readable top to bottom: rollout > reward > advantage > update.

    train(cfg, env, train_examples, eval_examples)

`grpo_step` is one step on one rank; `_train` the run around it (evals, warm-start, logs, checkpoints);
`start_run` gathers what a run holds into one `Run` (fitted to the machine and built: grpo/fit/).
1. Sampling runs on the very weights being trained (grpo/engine/sampler.py): no second engine, no weight
   sync. The sampler/trainer log-prob gap is logged; truncated importance sampling (tis_cap) corrects it.
2. A prompt's G samples live on one rank: group statistics are local; only the "batch" reward std is gathered.
3. The update (grpo/update.py): packed micro-batches, mu optimizer steps, every loss normalizer counted
   over the whole step, so accumulation and world size never change it.
4. KL to a reference model only when beta > 0 (off by default, as in DAPO and Dr. GRPO).
"""
from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from grpo.config import Config
from grpo.engine.cpu import trim
from grpo.engine.sampler import Sampler, SamplingParams
from grpo.env import Env, as_env
from grpo.eval import evaluate, run_eval_settings, summarize
from grpo.fit.budget import RunBudget, TimePlan, make_plan, rl_budget, stop_reason
from grpo.fit.build import build, check_run, open_run, record_run
from grpo.fit.fallback import kernels_of
from grpo.fit.preflight import preflight
from grpo.fit.sizing import cuda_allocator, fit_to_machine
from grpo.infra import dist
from grpo.infra.checkpoint import Checkpointer, export, note_run
from grpo.infra.metrics import Logger, credit_metrics, step_metrics
from grpo.infra.run_log import log_step, track_gap
from grpo.infra.report import write_summary
from grpo.loss import LossOptions, group_advantages, overlong_penalty
from grpo.models.lora import BaseModel
from grpo.models.model import Transformer
from grpo.process import ProcessCredit
from grpo.rewards import unscorable
from grpo.rollout import assign_rewards, render_prompt, rollout, sampling_params
from grpo.sft import gold_trajectory, warm_start
from grpo.update import loss_options, policy_update

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# ----------------------------------------------------------------------------- the GRPO step

@dataclasses.dataclass
class Run:
    """What a run holds from setup (start_run) to its summary: the settings, the data, the models and
    their sampler, the logs, and the results so far. The step and the evals take it whole."""
    cfg: Config
    env: Env                    # or a plain class with its members (grpo.env.as_env reads either)
    eval_env: Env               # the evals' prompts (e.g. GSM8K's 10-shot protocol): else env
    train_examples: list
    eval_examples: list
    sft_examples: list
    credit: ProcessCredit | None  # per-token credit on top of the outcome advantages, or None
    reward_weights: dict | None   # reward term -> its weight (a term not named weighs 1)
    device: torch.device
    tokenizer: PreTrainedTokenizerBase
    model: Transformer
    ref_model: Transformer | BaseModel | None  # the frozen KL reference (beta > 0; under LoRA the base)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    sampler: Sampler
    params: SamplingParams      # the rollouts' sampling settings (grpo.rollout.sampling_params)
    loss: LossOptions           # once per run (grpo.update.loss_options)
    ckpt: Checkpointer
    logger: Logger | None       # rank 0's; None on the others
    budget: RunBudget | None    # the run's time limits (grpo.fit.budget); None: none, and no budget code runs
    plan: TimePlan | None       # under budget.run_budget_min: the phases' estimates, which size the evals
    eval_q: int                 # questions of the evals after the warm-start and after RL
    before_q: int               # questions of the eval before training
    start: int                  # the first RL step (a resumed run's checkpoint step)
    resumed: bool               # from a checkpoint: the eval before and the warm-start were done
    results: dict               # eval phase -> its summary
    t_run: float                # when the run started
    eval_seconds: dict = dataclasses.field(default_factory=dict)  # eval phase -> seconds (the budget's)

    def log(self, metrics: dict, step: int):
        if self.logger:
            self.logger.log(metrics, step)


def grpo_step(run: Run, step: int) -> tuple[list, torch.Tensor, torch.Tensor, dict, float]:
    """One step on this rank: its share of the step's prompts, G scored rollouts each -> rewards -> advantages
    (-> per-token credit) -> mu policy updates. -> (trajectories, rewards, advantages, metrics, seconds)."""
    cfg, share = run.cfg, run.cfg.prompts_per_step // dist.world_size()  # the prompts each rank samples
    t0 = time.time()
    # 1. rollout: G samples of each of this rank's prompts on the weights being trained, gathered once
    examples, first = prompt_batch(run.train_examples, step, cfg.prompts_per_step, cfg.seed)
    mine = slice(dist.rank() * share, (dist.rank() + 1) * share)
    run.model.eval()
    with dist.gathered(run.model):
        trajs = scored_rollouts(run, examples[mine], first + mine.start)
        if cfg.drop_flat_groups:  # DAPO's dynamic sampling: fresh prompts in place of the flat groups
            more = lambda exs, offset: scored_rollouts(run, exs, offset)  # noqa: E731
            trajs = refill(trajs, share, cfg.num_generations, step, cfg, more, run.train_examples)
        release_sampler(run)
    check_rollouts(trajs, step)
    t1 = time.time()
    # 2. reward: the env's weighted terms (+ DAPO's overlong penalty)
    rewards = final_rewards(trajs, cfg).to(run.device)
    # 3. advantage, group-relative (-> per-token credit: a sequence is left out only if all its tokens get 0)
    advantages = advantages_of(rewards, cfg)
    t_credit = time.time()
    advantages = run.credit(trajs, advantages, step) if run.credit is not None else advantages
    t_credit = time.time() - t_credit
    # 4. update: mu optimizer steps
    update = update_policy(run, trajs, advantages)
    t2 = time.time()
    track_gap(run.results, update)
    flat = flat_groups(rewards.tolist(), cfg.num_generations)
    metrics = step_metrics(trajs, rewards, advantages, flat, update, t1 - t0, t2 - t1 - t_credit,
                           run.scheduler.get_last_lr()[0])
    metrics |= credit_metrics(run.credit, t1 - t0, t_credit)
    return trajs, rewards, advantages, metrics, t2 - t0


def scored_rollouts(run: Run, examples: list, offset: int) -> list:
    """G scored trajectories per example; `offset`, the global index of examples[0], seeds them (rank 0
    shows a bar of rows done and tokens/s)."""
    trajs = rollout(run.sampler, run.tokenizer, run.env, examples, run.params, prompt_offset=offset,
                    chat_kwargs={"enable_thinking": run.cfg.enable_thinking}, progress=dist.is_main())
    return assign_rewards(run.env, trajs, run.reward_weights)


def release_sampler(run: Run):
    """The cache's and decode weights' memory to the update, but where CUDA graphs are kept between steps
    (keep_kv_cache); a CPU has none to keep (its next call packs the weights again: 0.3 s for SmolLM2)."""
    if run.device.type != "cuda" or not run.cfg.keep_kv_cache:
        run.sampler.release()


def check_rollouts(trajs: list, step: int):
    """A step whose every row failed on every rank (finish_reason "error") stops, with why in one line."""
    if dist.all_sum(float(sum(t.finish_reason != "error" for t in trajs))) > 0:
        return
    empty = sum(not t.prompt_ids for t in trajs)
    why = (f"{len(trajs)} rows ended in an error ({empty} of them on an empty prompt); each row's error, a "
           "tool call that raised or a prompt the sampler refused, is printed above as 'rollout: completion "
           "N failed'") if empty < len(trajs) else (
        f"every row's prompt encodes to no tokens ({empty} rows: the env's prompt() and the chat template "
        "give an empty prompt: check the dataset's question field and the template)")
    raise RuntimeError(f"step {step}: every rollout failed, nothing to train on: {why}")


def update_policy(run: Run, trajs: list, advantages: torch.Tensor) -> dict:
    """mu policy updates (grpo/update.py) -> their metrics; a CPU's freed activations go back to the OS."""
    run.model.train()
    update = policy_update(run.model, run.ref_model, run.optimizer, run.scheduler, trajs, advantages, run.cfg,
                           run.device, run.loss)
    if run.device.type == "cpu":
        trim()
    return update


def prompt_batch(examples: list, step: int, B: int, seed: int) -> tuple[list, int]:
    """The step's B prompts: epochs over a seeded permutation, so the data position is a pure
    function of the step (resume restores it exactly). Returns (examples, global index of the first)."""
    out = []
    for k in range(step * B, step * B + B):
        epoch, i = divmod(k, len(examples))
        perm = list(range(len(examples)))
        random.Random(seed * 1000003 + epoch).shuffle(perm)
        out.append(examples[perm[i]])
    return out, step * B


def final_rewards(trajs: list, cfg: Config) -> torch.Tensor:
    """(N,) the rewards advantages come from: the env's weighted terms, plus DAPO's overlong
    penalty when configured (it can make a group of equal env rewards informative). NaN where every
    term is None (unscorable): group_advantages leaves it out of its group and gives it 0, as TRL."""
    rewards = torch.tensor([math.nan if unscorable(getattr(t, "rewards", None)) else t.reward for t in trajs],
                           dtype=torch.float32)
    if cfg.overlong_buffer > 0:
        lengths = torch.tensor([len(t.completion_ids) for t in trajs], dtype=torch.float32)
        rewards = rewards + overlong_penalty(lengths, cfg.max_completion_length, cfg.overlong_buffer)
    return rewards


def flat_groups(rewards, G: int) -> list[bool]:
    """Per group of G consecutive rewards: are its scorable (not NaN) rewards all equal, or fewer than 2, or
    is one infinite? Such a group has zero advantage (grpo.loss.group_advantages) and teaches nothing."""
    rewards = [float(r) for r in rewards]
    scorable = [[r for r in rewards[i:i + G] if not math.isnan(r)] for i in range(0, len(rewards), G)]
    return [len(set(g)) <= 1 or any(math.isinf(r) for r in g) for g in scorable]


def refill(trajs: list, share: int, G: int, step: int, cfg: Config, sample, examples: list) -> list:
    """Dynamic sampling (DAPO, arXiv 2503.14476): flat groups teach nothing; keep the others and roll out
    fresh prompts in their place (`sample(examples, offset)`), at most cfg.max_refills times, judged on the
    final rewards. Refill prompts come from a stream seeded by (seed, step, rank) and their sampler seeds
    from prompt indices past any epoch's, so a resumed run (on as many ranks) draws the same ones."""
    chunks = lambda ts: [ts[i:i + G] for i in range(0, len(ts), G)]   # noqa: E731
    split = lambda ts: list(zip(chunks(ts), flat_groups(final_rewards(ts, cfg), G)))  # noqa: E731
    groups = [g for g, f in split(trajs) if not f]
    rng = random.Random(f"refill-{cfg.seed}-{step}-{dist.rank()}")
    for attempt in range(cfg.max_refills):
        if len(groups) >= share:
            break
        exs = rng.sample(examples, min(share - len(groups), len(examples)))
        # sampler seeds: prompt ids past any epoch's, unique per (step, rank, attempt)
        offset = 1 << 40 | (step * dist.world_size() + dist.rank()) << 16 | attempt << 12
        groups += [g for g, f in split(sample(exs, offset)) if not f]
    # still short: top up with the original flat groups (zero advantage, no gradient), so that
    # every rank holds exactly `share` groups for the collectives that follow
    flat = [g for g, f in split(trajs) if f]
    return [t for g in (groups[:share] + flat)[:share] for t in g]


def advantages_of(rewards: torch.Tensor, cfg: Config) -> torch.Tensor:
    """(N,) final rewards -> (N,) advantages, on the device (the Triton kernel on CUDA)."""
    batch = dist.all_gather_cat(rewards) if cfg.scale_rewards == "batch" else None  # every rank's rewards
    return group_advantages(rewards, cfg.num_generations, cfg.scale_rewards, batch_rewards=batch)

# ----------------------------------------------------------------------------- the run

@dist.fail_together  # an exception on one rank ends every rank with its message, not a hang
def train(cfg: Config, env, train_examples: list, eval_examples: list = (),
          reward_weights: dict | None = None, sft_examples: list | None = None, eval_env=None,
          credit=None, budget: RunBudget | None = None) -> dict:
    """The whole run; returns the eval results ({phase: mean, ci95, pass, per_question scores}).
    `eval_env`: a different prompt for eval (e.g. GSM8K's 10-shot protocol); default `env`.
    `credit(trajs, advantages, step) -> advantages`: per-token credit on top of the outcome advantages
    ((N,) in, (N,) or (N, C) out), e.g. grpo.process.ProcessCredit.
    `budget`: the run's time limits (grpo.fit.budget.RunBudget, as the CPU recipe passes). None: the ones
    a command line set in the config (--run_budget_min, --time_budget_min: RunBudget.of), else none at
    all: the evals at their configured sizes, no probe, no time limit.
    `cfg.kernels == "torch"`: every grpo.kernels call in the run takes its PyTorch reference.
    A run the memory plan refuses raises grpo.fit.sizing.DoesNotFit (a ValueError: its line and table)."""
    budget = budget if budget is not None else RunBudget.of(cfg)
    with kernels_of(cfg):  # a failure inside Triton or a graph capture names the way around (fit/fallback.py)
        return _train(start_run(cfg, env, train_examples, eval_examples, reward_weights, sft_examples,
                                eval_env, credit, budget))


def _train(run: Run) -> dict:
    """The run as a story: the eval before and the warm-start, the GRPO steps with their logs, evals,
    checkpoints and stops (a time budget, SIGTERM), the eval after, the export and the summary."""
    cfg, results = run.cfg, run.results
    # ---- 1. eval before, optional warm-start (a resumed run did both: every checkpoint comes after)
    if not run.resumed:
        run_eval(run, "before", 0)
        if cfg.sft_steps > 0:
            warm_start_phase(run)
    dist.on_rank0(note_run, cfg.output_dir, {"eval_questions": run.eval_q})  # grpo.cli.eval --run asks these
    # ---- 2. RL: grpo_step, then logs, evals, checkpoints and stops
    t_start, steps_done, stop = time.time(), run.start, False
    budget_s, min_steps = (rl_time_budget(run, t_start), run.budget.min_rl_steps) if run.budget else (None, 0)
    bar = tqdm(range(run.start, cfg.max_steps), desc="grpo", disable=not dist.is_main(), initial=run.start,
               total=cfg.max_steps)
    for step in bar:
        *batch, metrics, seconds = grpo_step(run, step)  # batch: trajectories, rewards, advantages
        steps_done = step + 1
        log_step(run.logger, cfg, run.tokenizer, steps_done, metrics, seconds, bar, batch)
        if cfg.eval_steps and steps_done % cfg.eval_steps == 0 and steps_done < cfg.max_steps:
            run_eval(run, f"step{steps_done}", steps_done)
        reason = stop_reason(run.ckpt.stop_requested, budget_s, t_start, steps_done - run.start, min_steps)
        stop = reason == "sigterm"  # SIGTERM: save, then leave cleanly
        if stop or cfg.save_steps and steps_done % cfg.save_steps == 0:
            save(run, steps_done)
        if reason:
            dist.print0(f"SIGTERM: checkpoint written at step {steps_done}, exiting" if stop else
                        f"time budget ({budget_s / 60:.1f} min for RL): stopping after {steps_done} steps "
                        f"(the next would end past it)")
            break
    bar.close()
    if not stop and cfg.save_steps and steps_done > run.start and steps_done % cfg.save_steps:
        save(run, steps_done)  # the last steps (e.g. cut by the time budget) are not lost: --resume continues
    # ---- 3. eval after, export (not after SIGTERM: the job is being stopped, the checkpoint is what counts)
    export_dir = os.path.join(cfg.output_dir, "export") if cfg.export and not stop else None
    if not stop:
        free_optimizer_state(run)
        run_eval(run, "after", steps_done)
        if export_dir:  # merged weights (for transformers); under LoRA the adapters too (for PEFT)
            export(run.model, export_dir, base_model=cfg.model_path,
                   adapter_dir=os.path.join(cfg.output_dir, "adapter") if cfg.use_peft else None,
                   dtype=None if cfg.export_dtype == "auto" else getattr(torch, cfg.export_dtype))
    if dist.is_main():  # before -> after with intervals, the paired gain, the export (and summary.json)
        write_summary(cfg.output_dir, results, steps_done, time.time() - run.t_run, export_dir)
    run.ckpt.close()
    if run.logger:
        run.logger.close()
    return results


def start_run(cfg: Config, env, train_examples: list, eval_examples, reward_weights, sft_examples, eval_env,
              credit, budget: RunBudget | None = None) -> Run:
    """Checks, the run fitted to the machine (grpo/fit/sizing.py), its folder, models, optimizer, sampler,
    checkpoints and logs (grpo/fit/build.py), and the evals' sizes (under a budget, its time plan)."""
    t_run = time.time()
    cfg.check()
    cuda_allocator(torch.cuda.is_available())  # before dist.init, whose NCCL is the first to allocate
    dist.init(cfg.dist_timeout_min)
    sft_examples, eval_env = sft_examples or train_examples, eval_env or env
    check_inputs(cfg, env, train_examples, sft_examples)
    device = dist.device()
    extra = credit.memory_terms(cfg) if hasattr(credit, "memory_terms") else []  # a recipe's own models
    memory = fit_to_machine(cfg, device, extra)  # before config.json records the sizes, and anything loads
    dist.on_rank0(record_run, cfg)
    torch.manual_seed(cfg.seed)
    tokenizer, model, ref_model, optimizer, scheduler, sampler = build(cfg, device)
    if cfg.preflight:  # one synthetic worst-case step: out of memory now, not hours in
        preflight(cfg, model, sampler, optimizer, device, memory)
    ckpt, found, logger = open_run(cfg, model, optimizer, scheduler)
    start, results = (found["step"], found.get("results", {})) if found else (0, {})
    # the eval sizes: as configured, or under run_budget_min shrunk to what fits on this machine (the plan)
    eval_examples = list(eval_examples or [])
    eval_q = min(cfg.eval_limit, len(eval_examples))
    before_q = min(cfg.eval_before_limit or cfg.eval_limit, len(eval_examples))
    tokens = plan_tokens(cfg, model, tokenizer, eval_env, eval_examples, sft_examples) if budget else []
    plan = make_plan(budget, cfg, model, sampler, *tokens, eval_q, before_q) if budget else None
    if plan:
        eval_q, before_q = plan.eval_q, plan.before_q
    if "warmstart" in results:  # resumed: the last eval pairs with the warm-start's questions
        eval_q = results["warmstart"]["questions"]
        if plan:
            plan.eval_q = eval_q
    params = sampling_params(env, tokenizer, cfg.num_generations, cfg.temperature, cfg.max_completion_length,
                             cfg.seed, cfg.top_p, cfg.top_k, cfg.min_p, cfg.max_turns,
                             kept_set=cfg.logprobs_kept_set)
    return Run(cfg=cfg, env=env, eval_env=eval_env, train_examples=train_examples,
               eval_examples=eval_examples, sft_examples=sft_examples, credit=credit,
               reward_weights=reward_weights, device=device, tokenizer=tokenizer, model=model,
               ref_model=ref_model, optimizer=optimizer, scheduler=scheduler, sampler=sampler, params=params,
               loss=loss_options(cfg), ckpt=ckpt, logger=logger, budget=budget, plan=plan, eval_q=eval_q,
               before_q=before_q, start=start, resumed=found is not None, results=results, t_run=t_run)


def check_inputs(cfg: Config, env, train_examples: list, sft_examples: list):
    """One-line errors before anything loads or is written: the env's here, the rest fit.build.check_run's."""
    if cfg.sft_steps > 0 and as_env(env).gold_messages is None:
        raise ValueError(f"sft_steps={cfg.sft_steps}: the warm-start needs env.gold_messages(example), "
                         f"which {type(env).__name__} does not have")
    check_run(cfg, train_examples, sft_examples)


def plan_tokens(cfg: Config, model: Transformer, tokenizer, env, eval_examples: list,
                sft_examples: list) -> tuple[list, float]:
    """What the time plan counts: up to 16 eval prompts' token ids, and a warm-start batch's tokens a rank."""
    kw = {**as_env(env).chat_kwargs, "enable_thinking": cfg.enable_thinking}
    prompts = [render_prompt(tokenizer, env.prompt(x), **kw) for x in (eval_examples or sft_examples)[:16]]
    gold = [gold_trajectory(tokenizer, env, ex, model.eos_token_ids()[0], kw)
            for ex in sft_examples[:32]] if cfg.sft_steps else []
    per = sum(len(t.prompt_ids) + len(t.completion_ids) for t in gold) / max(len(gold), 1)
    return prompts, per * cfg.sft_batch / dist.world_size()

# ----------------------------------------------------------------------------- around the steps

def run_eval(run: Run, phase: str, at_step: int):
    """The eval of `phase` (and its greedy twin with eval_greedy), unless it has results already (a
    resumed run): every rank's share, summed up on each; logged, and its records written by rank 0."""
    cfg, results = run.cfg, run.results
    # the untrained model's eval can be shorter: it scores ~0 and rambles to the token limit
    limit = run.before_q if phase == "before" else run.eval_q
    greedy_twin = cfg.eval_greedy and cfg.eval_temperature
    protocols = [(phase, False)] + ([(f"{phase}_greedy", True)] if greedy_twin else [])
    t = time.time()
    for name, greedy in protocols:
        if not run.eval_examples or name in results:
            continue
        run.model.eval()
        r = evaluate_on_ranks(run.model, run.tokenizer, run.eval_env, run.eval_examples[:limit], cfg, greedy,
                              run.sampler)
        records, results[name] = r.pop("records"), r  # per_question: what a paired comparison pairs
        dist.print0(f"eval {name}: mean@{r['n']} {r['mean']:.3f} ± {r['ci95']:.3f} | "
                    f"pass@{r['n']} {r['pass']:.3f}")
        run.log({f"eval/{name}/mean": r["mean"], f"eval/{name}/pass": r["pass"]}, at_step)
        if run.logger:
            run.logger.dump_jsonl(f"eval_{name}.jsonl", records)
        run.eval_seconds[phase] = time.time() - t
    if run.plan and phase in ("before", "warmstart") and phase in run.eval_seconds:
        run.plan.done(phase, run.eval_seconds[phase], limit)


def evaluate_on_ranks(model, tokenizer, env, examples: list, cfg: Config, greedy: bool = False,
                      sampler: Sampler | None = None) -> dict:
    """summarize(...) of the whole eval plus its records; each rank evaluates a contiguous share, seeded by
    global question index, so any world size gives the same records. `sampler`: the rollouts' own, freed
    before and after (the eval sizes its own cache: few-shot prompts are longer), but where CUDA graphs are
    kept (`keep_kv_cache`): the eval replays them in the rollouts' cache, freed after only if it grew."""
    share = -(-len(examples) // dist.world_size())
    lo, hi = min(dist.rank() * share, len(examples)), min((dist.rank() + 1) * share, len(examples))
    settings = run_eval_settings(cfg, greedy)
    keep = sampler is not None and sampler.runner.use_graphs and cfg.keep_kv_cache
    held = sampler.cache.max_seq_len if keep and sampler.cache is not None else None
    with dist.gathered(model):
        if sampler is not None and not keep:
            sampler.release()
        r = evaluate(model, tokenizer, env, examples[lo:hi], **settings, progress=dist.is_main(),
                     prompt_offset=lo, sampler=sampler)
        if sampler is not None and (not keep or sampler.cache is None or sampler.cache.max_seq_len != held):
            sampler.release()
    records = dist.all_gather_objects(r["records"])  # every rank holds the whole eval, in question order
    return summarize(records, settings["n"]) | {"records": records}


def warm_start_phase(run: Run):
    """The supervised warm-start (on a CPU its freed memory back to the OS), the time plan made again from
    what it measured, its eval, and a checkpoint at step 0 (a crash in RL does not cost the warm-start)."""
    t = time.time()
    warm_start(run.model, run.tokenizer, run.env, run.sft_examples, run.cfg, run.device, run.log)
    if run.device.type == "cpu":
        trim()
    if run.plan:
        run.plan.done("warm-start", time.time() - t, run.cfg.sft_steps)
        if run.plan.refit(time.time() - run.t_run):  # the evals shrink further if the phases ran slower
            run.eval_q = run.plan.eval_q
            dist.print0(run.plan.line(time.time() - run.t_run))
    run_eval(run, "warmstart", 0)
    if run.cfg.save_steps:
        save(run, 0)


def free_optimizer_state(run: Run):
    """Training is over: AdamW's two states (8 bytes a trained parameter: 1 GiB for SmolLM2-135M) give the
    eval after their room; the last checkpoint holds them (--resume continues from it)."""
    run.optimizer.state.clear()
    if run.device.type == "cpu":
        trim()


def rl_time_budget(run: Run, t_start: float) -> float | None:
    """Seconds left to RL under the run's budget (None: no limit), the last evals planned as long as the
    warm-start's (the same questions), else at the plan's estimate; said at start."""
    seconds, plan = run.eval_seconds, run.plan
    planned = plan.estimate("after", run.eval_q) if plan else 0.0
    last_eval = seconds.get("warmstart") or planned or seconds.get("before", 0.0)
    budget_s = rl_budget(run.budget, t_start - run.t_run, last_eval)
    if budget_s is not None:
        steps = min(run.budget.min_rl_steps, run.cfg.max_steps - run.start)
        dist.print0(f"RL: {budget_s / 60:.1f} min of the budget left (the last evals planned at "
                    f"{last_eval / 60:.1f} min); at least {steps} steps (min_rl_steps)")
    return budget_s


def save(run: Run, at_step: int):
    """A checkpoint of the run at `at_step`, with what a resume checks (grpo.infra.checkpoint's save_step)."""
    path = run.ckpt.save_step(at_step, run.model, run.optimizer, run.scheduler, run.results,
                              run.cfg.prompts_per_step, run.cfg.seed)
    dist.print0(f"checkpoint: {path}")
