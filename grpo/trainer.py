"""GRPO (arXiv 2402.03300), readable top to bottom: rollout > reward > advantage > update.

    train(cfg, env, train_examples, eval_examples)
`grpo_step` (below `Run`, what a run holds) is one step on one rank; `_train` is the run around it (the eval before, the
warm-start, the steps with their logs, evals and checkpoints, the eval after and the export), and
`start_run` its setup, which gathers what the run holds into one `Run`.
1. Sampling runs on the very weights being trained (grpo/engine/sampler.py): no second engine, no
   weight sync. The sampler/trainer log-prob gap is logged; truncated importance sampling
   (tis_cap) corrects what remains.
2. A prompt's G samples live on one rank, so group statistics are local; only the "batch"
   reward std is gathered.
3. The update (grpo/update.py): packed micro-batches, mu optimizer steps, every loss
   normalizer counted over the whole step, so accumulation and world size never change it.
4. KL to a reference model only when beta > 0 (off by default, as in DAPO and Dr. GRPO).
"""
import dataclasses
import functools
import math
import os
import random
import time

import torch
from tqdm import tqdm

from grpo.config import Config
from grpo.engine.cpu import trim
from grpo.engine.kv_cache import KVCache
from grpo.engine.sampler import Sampler
from grpo.env import as_env
from grpo.eval import evaluate, run_eval_settings, summarize
from grpo.fit.budget import RunBudget, TimePlan, make_plan, rl_budget, stop_reason
from grpo.fit.fallback import kernels_of
from grpo.fit.memory import (GIB, GPU_MEMORY_GIB, Plan, fixes_text, memory_of_cpu, memory_plan, model_config,
                             size, what_fits)
from grpo.fit.precision import measure, set_autocast, set_threads
from grpo.fit.preflight import preflight
from grpo.infra import dist
from grpo.infra.checkpoint import Checkpointer, export, note_run, open_run_dir, refuse_used_dir, run_meta
from grpo.infra.metrics import Logger, credit_metrics, rollout_records, step_metrics
from grpo.infra.report import check_reporters, open_trackers, reporters, write_summary
from grpo.loss import group_advantages, overlong_penalty
from grpo.models.lora import (BaseModel, adapter_settings, adapters, add_lora, cast_base, load_adapter,
                              read_adapter, settings_of, trainable)
from grpo.models.model import ModelArgs, Transformer, _local_or_hub
from grpo.rewards import unscorable
from grpo.rollout import assign_rewards, render_prompt, rollout, sampling_params
from grpo.sft import gold_trajectory, warm_start
from grpo.update import loss_options, policy_update

# ----------------------------------------------------------------------------- the GRPO step


@dataclasses.dataclass
class Run:
    """What a run holds from setup (start_run) to its summary: the settings, the data, the models and
    their sampler, the logs, and the results so far. The step and the evals take it whole."""
    cfg: Config
    env: object
    eval_env: object
    train_examples: list
    eval_examples: list
    sft_examples: list
    credit: object              # per-token credit (grpo.process.ProcessCredit) or None
    device: torch.device
    tokenizer: object
    model: object
    ref_model: object
    optimizer: object
    scheduler: object
    sampler: Sampler
    rollouts: object            # (examples, offset) -> G scored trajectories each (scored_rollouts)
    loss: object                # grpo.loss.LossOptions, once per run (grpo.update.loss_options)
    ckpt: Checkpointer
    logger: object              # rank 0's Logger, else None
    budget: RunBudget | None    # the run's time limits (grpo.fit.budget); None: none, and no budget code runs
    plan: TimePlan | None       # under budget.run_budget_min: the phases' estimates, which size the evals
    eval_q: int                 # questions of the evals after the warm-start and after RL (the plan's, or configured)
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
    """One step on this rank: its share of the step's prompts, G scored rollouts each -> rewards ->
    advantages (-> per-token credit) -> mu policy updates. -> (trajectories, rewards, advantages, the
    step's metrics, its seconds)."""
    cfg, model, share = run.cfg, run.model, rank_share(run.cfg)
    t0 = time.time()
    # 1. rollouts on the weights being trained, gathered once for the whole step
    examples, first = prompt_batch(run.train_examples, step, cfg.prompts_per_step, cfg.seed)
    mine = slice(dist.rank() * share, (dist.rank() + 1) * share)
    model.eval()
    with dist.gathered(model):
        trajs = run.rollouts(examples[mine], first + mine.start)
        if cfg.drop_flat_groups:
            trajs = refill(trajs, share, cfg.num_generations, step, cfg, run.rollouts, run.train_examples)
        # the update's activations get the cache's and the decode weights' memory; a CPU has no graphs
        # to keep (the next call allocates and packs the weights again: ~0.3 s for SmolLM2 at one thread)
        if run.device.type != "cuda" or not cfg.keep_kv_cache:
            run.sampler.release()
    if dist.all_sum(float(sum(t.finish_reason != "error" for t in trajs))) == 0:  # every rank's every row
        raise RuntimeError(f"step {step}: every rollout failed, nothing to train on: {rollout_failures(trajs)}")
    t1 = time.time()
    # 2. rewards -> advantages (-> per-token credit: a sequence is left out only if all its tokens get 0)
    rewards = final_rewards(trajs, cfg).to(run.device)
    advantages = advantages_of(rewards, cfg)
    t_credit = time.time()
    if run.credit is not None:
        advantages = run.credit(trajs, advantages, step)
    t_credit = time.time() - t_credit
    # 3. mu policy updates
    model.train()
    update = policy_update(model, run.ref_model, run.optimizer, run.scheduler, trajs, advantages, cfg, run.device,
                           run.loss)
    if run.device.type == "cpu":
        trim()  # the update's freed activations back to the OS (the allocator kept GBs of them)
    t2 = time.time()
    track_gap(run.results, update)
    metrics = step_metrics(trajs, rewards, advantages, flat_groups(rewards.tolist(), cfg.num_generations), update,
                           t1 - t0, t2 - t1 - t_credit, run.scheduler.get_last_lr()[0])
    metrics |= credit_metrics(run.credit, t1 - t0, t_credit)
    return trajs, rewards, advantages, metrics, t2 - t0


def rollout_failures(trajs: list) -> str:
    """Why a step's rows all failed (finish_reason "error"), in one line: empty prompts, or the errors
    grpo.rollout printed for each row (a tool call that raised, a prompt the sampler refused)."""
    empty = sum(not t.prompt_ids for t in trajs)
    if empty == len(trajs):
        return (f"every row's prompt encodes to no tokens ({empty} rows: the env's prompt() and the chat template give "
                "an empty prompt: check the dataset's question field and the template)")
    return (f"{len(trajs)} rows ended in an error ({empty} of them on an empty prompt); each row's error, a "
            "tool call that raised or a prompt the sampler refused, is printed above as 'rollout: completion "
            "N failed'")


def rank_share(cfg: Config) -> int:
    """The prompts each rank samples in a step."""
    return cfg.prompts_per_step // dist.world_size()

# ----------------------------------------------------------------------------- data and rollouts

def lr_lambda(cfg: Config, total_steps: int):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_scheduler_type == "cosine":
            progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0
    return f


def prompt_batch(examples: list, step: int, B: int, seed: int) -> tuple[list, int]:
    """The step's B prompts: epochs over a seeded permutation, so the data position is a pure
    function of the step (resume restores it exactly). Returns (examples, global index of the first)."""
    start = step * B
    out = []
    for k in range(start, start + B):
        epoch, i = divmod(k, len(examples))
        perm = list(range(len(examples)))
        random.Random(seed * 1000003 + epoch).shuffle(perm)
        out.append(examples[perm[i]])
    return out, start


def scored_rollouts(sampler, tokenizer, env, params, chat_kwargs: dict, weights: dict | None,
                    examples: list, offset: int) -> list:
    """G scored trajectories per example; `offset`, the global index of examples[0], seeds them."""
    trajs = rollout(sampler, tokenizer, env, examples, params, prompt_offset=offset, chat_kwargs=chat_kwargs,
                    progress=dist.is_main())  # rank 0's bar: rows done, tokens/s
    return assign_rewards(env, trajs, weights)


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
    """Per group of G consecutive rewards: are its scorable (not NaN) rewards all equal, or fewer
    than 2, or is one infinite? Such a group has zero advantage (exactly: grpo.loss.group_advantages)
    and teaches nothing."""
    rewards = [float(r) for r in rewards]
    scorable = [[r for r in rewards[i:i + G] if not math.isnan(r)] for i in range(0, len(rewards), G)]
    return [len(set(g)) <= 1 or any(math.isinf(r) for r in g) for g in scorable]


def refill(trajs: list, share: int, G: int, step: int, cfg: Config, sample, examples: list) -> list:
    """Dynamic sampling (DAPO, arXiv 2503.14476): flat groups teach nothing; keep the others and
    roll out fresh prompts in their place, at most cfg.max_refills times, judged on the final
    rewards. Refill prompts come from a stream seeded by (seed, step, rank) and their sampler
    seeds from prompt indices past any epoch's, so a resumed run (on as many ranks) draws the same ones."""
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

# ----------------------------------------------------------------------------- setup, resume, eval

def check_inputs(cfg: Config, env, train_examples: list, sft_examples: list):
    """One-line errors before anything loads or is written (each rank reaches the same verdict)."""
    world = dist.world_size()
    if not str(cfg.model_path).strip():
        raise ValueError("model_path is empty: pass --model_path=a Hugging Face checkpoint folder or hub id")
    model_folder(cfg.model_path)  # a missing folder: one line, before anything is written
    if not cfg.resume:
        refuse_used_dir(cfg.output_dir)  # before config.json is written (open_run_dir checks it again)
    check_reporters(cfg.report_to)
    if not train_examples:
        raise ValueError("no training examples: the dataset is empty")
    if (cfg.prompts_per_step // world) % cfg.optimizer_steps():
        raise ValueError(f"steps_per_generation / gradient_accumulation_steps = {cfg.optimizer_steps()} optimizer "
                         f"steps must divide the prompts each rank samples ({cfg.prompts_per_step} / {world}): "
                         "each optimizer step takes whole groups")
    if cfg.prompts_per_step % world:
        raise ValueError(f"prompts_per_step={cfg.prompts_per_step} must be a multiple of the world size "
                         f"{world} (each rank samples prompts_per_step / world size prompts)")
    if cfg.dist_timeout_min <= 0:
        raise ValueError(f"dist_timeout_min={cfg.dist_timeout_min} must be > 0")
    if cfg.adapter_path:  # the adapter's own shape wins over the flags (recorded in config.json as used)
        lora = adapter_settings(cfg.adapter_path)
        cfg.lora_r, cfg.lora_alpha, cfg.use_rslora = lora.r, lora.alpha, lora.rslora
        cfg.lora_target_modules = ",".join(lora.targets)
    if cfg.sft_steps > 0:
        if as_env(env).gold_messages is None:
            raise ValueError(f"sft_steps={cfg.sft_steps}: the warm-start needs env.gold_messages(example), "
                             f"which {type(env).__name__} does not have")
        if cfg.sft_batch % world or len(sft_examples) < cfg.sft_batch:
            raise ValueError(f"sft_batch={cfg.sft_batch} must be a multiple of the world size {world} and at "
                             f"most the {len(sft_examples)} warm-start examples")


def record_run(cfg: Config):
    """Rank 0: claim the output folder (open_run_dir) and write config.json with the profile as
    parse_args applied it (grpo.fit.profile.apply_profile), or none for a Config built in Python."""
    profile = getattr(cfg, "profile_applied", {"name": cfg.profile, "resolved": None, "settings": {},
                                              "note": "Config built in Python: no profile applied"})
    meta = run_meta(profile) | {"config_class": type(cfg).__name__}   # grpo.cli.eval --run rebuilds it
    open_run_dir(cfg.output_dir, dataclasses.asdict(cfg), cfg.resume, meta)


def model_folder(model_path: str) -> str:
    """The local checkpoint folder (a hub id is fetched once), checked before the tokenizer loads."""
    path = _local_or_hub(model_path)
    if not (path / "config.json").is_file():
        what = "no config.json: not a Hugging Face checkpoint folder" if path.is_dir() else "no such folder"
        raise FileNotFoundError(f"model_path {model_path}: {what}")
    return str(path)


def build(cfg: Config, device, extra: list = ()) -> tuple:
    """Tokenizer, policy (fp32 master weights, sharded; bf16 compute on CUDA), the frozen
    reference when beta > 0, AdamW, the lr schedule, and the sampler over the policy's weights."""
    from transformers import AutoTokenizer
    path = model_folder(cfg.model_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    bf16 = cfg.dtype == "bfloat16" or cfg.dtype == "auto" and device.type == "cuda"
    compute_dtype = torch.bfloat16 if bf16 else torch.float32
    threads = set_threads(cfg.num_threads) if device.type == "cpu" else torch.get_num_threads()
    dist.print0(f"grpo | {cfg.model_path} | world {dist.world_size()} | {compute_dtype} | {threads} threads | "
                f"{cfg.max_steps} steps x {cfg.prompts_per_step} prompts x G={cfg.num_generations}")
    check_memory(cfg, path, device, extra)  # before any weight of the policy loads
    # fp32 master weights; under LoRA only the adapters are trained, and the frozen base stays in the compute
    # dtype (bf16 on a GPU: a 3B base is 6 GB, not 6 + 12 of master copy and 24 of Adam)
    model = Transformer.from_pretrained(path, dtype=compute_dtype if cfg.use_peft else torch.float32, device=device)
    if cfg.use_peft:
        add_lora(model, settings_of(cfg), seed=cfg.seed)
        if cfg.adapter_path:
            load_adapter(model, read_adapter(cfg.adapter_path)[1], cfg.adapter_path)
        n = sum(p.numel() for p in trainable(model))
        dist.print0(f"LoRA: r {cfg.lora_r}, alpha {cfg.lora_alpha} on {cfg.lora_target_modules}: {n / 1e6:.2f}M "
                    f"trainable parameters ({n / sum(p.numel() for p in model.parameters()):.2%})")
        if cfg.disable_dropout and cfg.lora_dropout:  # the sampler never drops: a dropped forward scores another policy
            for m in adapters(model):
                m.dropout = 0.0
            dist.print0(f"LoRA: lora_dropout {cfg.lora_dropout} not applied (disable_dropout; --disable_dropout false "
                        "applies it)")
        elif cfg.lora_dropout:
            dist.print0(f"LoRA: lora_dropout {cfg.lora_dropout} in the update's forward; old log-probs from a no-grad "
                        "pass without it (the ratio carries dropout's noise)")
    model.activation_checkpointing = cfg.gradient_checkpointing
    # the sampler and the evals run this same model; rank 0's measurement decides for every rank
    rates = lambda: dist.broadcast(measure(model.args.dim, model.args.ffn_dim) if dist.is_main() else None)  # noqa: E731
    dist.print0(set_autocast(model, cfg.autocast_bf16, device, rates))
    if cfg.use_peft and model.autocast_bf16:  # the frozen base in its matmuls' dtype (grpo.models.lora.cast_base says why)
        cast_base(model, torch.bfloat16)
    dist.on_rank0(note_run, cfg.output_dir, {"autocast_bf16_chosen": model.autocast_bf16})
    dist.shard(model, compute_dtype)
    ref_model = None
    if cfg.beta > 0 and cfg.use_peft:  # the reference is the frozen base: the same model, adapters off
        ref_model = BaseModel(model)
    elif cfg.beta > 0:  # frozen: loaded in the dtype FSDP computes it in (bf16 on a GPU), not as fp32 master
        # weights (a 3B reference: 6 GB, not 12); one CPU process, which nothing casts, keeps fp32
        ref_dtype = compute_dtype if dist.is_dist() or torch.cuda.is_available() else torch.float32
        ref_model = Transformer.from_pretrained(path, dtype=ref_dtype, device=device)
        ref_model.eval().requires_grad_(False)
        ref_model.autocast_bf16 = model.autocast_bf16
        dist.shard(ref_model, compute_dtype)
    optimizer = torch.optim.AdamW(trainable(model), lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay)
    total_steps = cfg.max_steps * cfg.num_iterations * cfg.optimizer_steps()  # optimizer steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
    # the KV cache takes the dtype of the weights it reads (bf16 under FSDP on GPU); sized per
    # call (rollouts and evals, whose few-shot prompts may be longer), so check the budget now
    with dist.gathered(model):
        sampler = Sampler(model, tokenizer, gen_batch=cfg.gen_batch, kv_budget_bytes=int(cfg.kv_budget_gb * 2**30) or None,
                          cuda_graphs=cfg.cuda_graphs)
    row = KVCache.slot_bytes(model.args, cfg.max_prompt_length + cfg.max_completion_length, sampler.dtype)
    if sampler.kv_budget_bytes < row:
        raise ValueError(f"kv_budget_gb={cfg.kv_budget_gb}: {sampler.kv_budget_bytes / 2**30:.2f} GiB of KV cache holds no "
                         f"row of max_prompt_length + max_completion_length tokens ({row / 2**30:.2f} GiB)")
    return tokenizer, model, ref_model, optimizer, scheduler, sampler


def plan_run(cfg: Config, args: ModelArgs, device, extra: list = ()) -> Plan:
    """The memory plan (grpo/fit/memory.py) of this run on this device: a GPU's memory, or on a CPU this node's
    RAM shared by its ranks."""
    world, local = dist.world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else memory_of_cpu(local)
    return memory_plan(args, cfg, world, device.type, memory / 2**30, extra)


def size_to_memory(cfg: Config, device, extra: list = ()) -> dict:
    """On a GPU, before anything loads: the fields the profile left to the plan (cfg.profile_applied's
    sized_by_plan: what the recipe, its YAML and its command line did not set) sized by the memory plan
    for this GPU's memory, or for the GPU the profile names (grpo.fit.memory.size says how). Rank 0 decides for
    every rank. -> the values set."""
    profile = getattr(cfg, "profile_applied", {})
    free = profile.get("sized_by_plan", [])
    if free and device.type != "cuda":  # a GPU's profile named on a CPU run: nothing is sized here
        profile["sized_by_plan"] = []
        cfg.check()  # the checks the sizing would have answered (a micro-batch that holds a sequence) apply
        return {}
    if not free:
        return {}
    args = ModelArgs.from_hf(model_config(model_folder(cfg.model_path)))
    props = torch.cuda.get_device_properties(device)
    name = profile["name"] if profile["name"] in GPU_MEMORY_GIB else props.name
    memory = GPU_MEMORY_GIB.get(profile["name"], props.total_memory / GIB)
    chosen = dist.broadcast(size(args, cfg, dist.world_size(), "cuda", memory, extra, free) if dist.is_main() else None)
    for key, value in chosen.items():
        setattr(cfg, key, value)
    dist.print0(f"memory plan for {name} ({memory:.0f} GiB): " + ", ".join(f"{k} {v}" for k, v in chosen.items()))
    return chosen


def check_memory(cfg: Config, path, device, extra: list = ()):
    """The memory plan's one line, and a refusal, with the plan's table and what would fit, where its peak
    exceeds the device. cfg.plan_memory false: the line only."""
    args = ModelArgs.from_hf(model_config(path))
    plan = plan_run(cfg, args, device, extra)
    dist.print0(plan.summary())
    if not plan.fits and cfg.plan_memory:
        fixes = fixes_text(what_fits(args, cfg, plan.world, device.type, plan.memory / 2**30, extra))
        raise ValueError(f"{plan.table()}\n{fixes}\n(--plan_memory false starts anyway)")


def resume(ckpt: Checkpointer, model, optimizer, scheduler, cfg: Config) -> dict | None:
    """The newest complete checkpoint loaded into model, optimizer and scheduler, or None."""
    if not cfg.resume:
        return None
    found = ckpt.load_latest(model, optimizer, scheduler)
    if found is None:
        dist.print0(f"resume: no checkpoint in {ckpt.root}, starting from step 0")
        return None
    Checkpointer.check_position(found, cfg.prompts_per_step, cfg.seed)
    dist.print0(f"resumed from {found['path']} at step {found['step']} "
                f"(next prompt {found['step'] * cfg.prompts_per_step})")
    return found


def evaluate_on_ranks(model, tokenizer, env, examples: list, cfg: Config, greedy: bool = False,
                      sampler=None) -> dict:
    """summarize(...) of the whole eval plus its records; each rank evaluates a contiguous
    share, seeded by global question index, so any world size gives the same records.
    `sampler`: the rollouts' own, so there is never a second cache. Its cache is freed before and
    after the eval (sized to the eval: few-shot prompts are longer), except where CUDA graphs are
    kept (`keep_kv_cache`): then the eval decodes in the rollouts' cache and replays their graphs
    (its own sampling settings captured once a run), and only an eval whose rows did not fit, and
    so grew the cache, frees it after, for the rollouts to size their own again."""
    share = -(-len(examples) // dist.world_size())
    lo, hi = min(dist.rank() * share, len(examples)), min((dist.rank() + 1) * share, len(examples))
    settings = run_eval_settings(cfg, greedy)
    keep = sampler is not None and sampler.use_graphs and cfg.keep_kv_cache
    held = sampler.cache.max_seq_len if keep and sampler.cache is not None else None
    with dist.gathered(model):
        if sampler is not None and not keep:
            sampler.release()
        r = evaluate(model, tokenizer, env, examples[lo:hi], **settings, progress=dist.is_main(), prompt_offset=lo,
                     sampler=sampler)
        if sampler is not None and (not keep or sampler.cache is None or sampler.cache.max_seq_len != held):
            sampler.release()
    records = dist.all_gather_objects(r["records"])  # every rank holds the whole eval, in question order
    return summarize(records, settings["n"]) | {"records": records}


# ----------------------------------------------------------------------------- the run

@dist.fail_together  # an exception on one rank ends every rank with its message, not a hang

def plan_tokens(cfg, model, tokenizer, env, eval_examples: list, sft_examples: list) -> tuple[list, float]:
    """What the time plan counts: up to 16 eval prompts' token ids, and a warm-start batch's tokens a rank."""
    kw = {**as_env(env).chat_kwargs, "enable_thinking": cfg.enable_thinking}
    prompts = [render_prompt(tokenizer, env.prompt(ex), **kw) for ex in (list(eval_examples) or sft_examples)[:16]]
    gold = [gold_trajectory(tokenizer, env, ex, model.eos_token_ids()[0], kw)
            for ex in sft_examples[:32]] if cfg.sft_steps else []
    per = sum(len(t.prompt_ids) + len(t.completion_ids) for t in gold) / max(len(gold), 1)
    return prompts, per * cfg.sft_batch / dist.world_size()


def train(cfg: Config, env, train_examples: list, eval_examples: list = (),
          reward_weights: dict | None = None, sft_examples: list | None = None, eval_env=None,
          credit=None, budget: RunBudget | None = None) -> dict:
    """The whole run; returns the eval results ({phase: mean, ci95, pass, per_question scores}).
    `eval_env`: a different prompt for eval (e.g. GSM8K's 10-shot protocol); default `env`.
    `credit(trajs, advantages, step) -> advantages`: per-token credit on top of the outcome
    advantages ((N,) in, (N,) or (N, C) out), e.g. grpo.process.ProcessCredit.
    `budget`: the run's time limits (grpo.fit.budget.RunBudget, as the CPU recipe passes). None: the ones a
    command line set in the config (--run_budget_min, --time_budget_min: RunBudget.of), else none at all:
    the evals at their configured sizes, no probe, no time limit.
    `cfg.kernels == "torch"`: every grpo.kernels call in the run takes its PyTorch reference."""
    budget = budget if budget is not None else RunBudget.of(cfg)
    with kernels_of(cfg):  # a failure inside Triton or a graph capture names the way around (grpo/fit/fallback.py)
        run = start_run(cfg, env, train_examples, eval_examples, reward_weights, sft_examples, eval_env, credit,
                        budget)
        return _train(run)


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
    budget_s = rl_time_budget(run, t_start) if run.budget else None
    min_steps = run.budget.min_rl_steps if run.budget else 0
    bar = tqdm(range(run.start, cfg.max_steps), desc="grpo", disable=not dist.is_main(), initial=run.start,
               total=cfg.max_steps)
    for step in bar:
        trajs, rewards, advantages, metrics, seconds = grpo_step(run, step)
        steps_done = step + 1
        log_step(run, steps_done, metrics, seconds, bar, (trajs, rewards, advantages))
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
        if export_dir:  # merged weights (transformers loads them); under LoRA also the adapters (PEFT loads them)
            export(run.model, export_dir, adapter_dir=os.path.join(cfg.output_dir, "adapter") if cfg.use_peft else None,
                   base_model=cfg.model_path,
                   dtype=None if cfg.export_dtype == "auto" else getattr(torch, cfg.export_dtype))
    if dist.is_main():  # before -> after with intervals, the paired gain, the export: printed and summary.json
        write_summary(cfg.output_dir, results, steps_done, time.time() - run.t_run, export_dir)
    run.ckpt.close()
    if run.logger:
        run.logger.close()
    return results


def start_run(cfg: Config, env, train_examples: list, eval_examples, reward_weights, sft_examples, eval_env,
              credit, budget: RunBudget | None = None) -> Run:
    """Checks, the run folder (never another run's), the sizes from the memory plan, models, optimizer,
    sampler, the resumed checkpoint, the logs and the evals' sizes (under a budget, its time plan)."""
    t_run = time.time()
    cfg.check()
    dist.init(cfg.dist_timeout_min)
    sft_examples = sft_examples or train_examples
    check_inputs(cfg, env, train_examples, sft_examples)
    device = dist.device()
    extra = credit.memory_terms(cfg) if hasattr(credit, "memory_terms") else []  # a recipe's own models
    size_to_memory(cfg, device, extra)  # before config.json records the sizes
    dist.on_rank0(record_run, cfg)
    torch.manual_seed(cfg.seed)
    tokenizer, model, ref_model, optimizer, scheduler, sampler = build(cfg, device, extra)
    if cfg.preflight:  # one synthetic worst-case step: out of memory now, not hours in
        preflight(cfg, model, sampler, optimizer, device, plan_run(cfg, model.args, device, extra))
    ckpt = Checkpointer(cfg.output_dir, keep_last=cfg.save_total_limit)
    found = resume(ckpt, model, optimizer, scheduler, cfg)
    start, results = (found["step"], found.get("results", {})) if found else (0, {})
    logger = Logger(cfg.output_dir, start if found else None, list(results), "tensorboard" in reporters(cfg.report_to),
                    open_trackers(cfg, found is not None)) if dist.is_main() else None
    # the eval sizes: as configured, or under run_budget_min shrunk to what fits on this machine (the plan)
    eval_examples = list(eval_examples or [])
    eval_q = min(cfg.eval_limit, len(eval_examples))
    before_q = min(cfg.eval_before_limit or cfg.eval_limit, len(eval_examples))
    plan = make_plan(budget, cfg, model, sampler, *plan_tokens(cfg, model, tokenizer, eval_env or env, eval_examples,
                                                               sft_examples), eval_q, before_q) if budget else None
    if plan:
        eval_q, before_q = plan.eval_q, plan.before_q
    if "warmstart" in results:  # resumed: the last eval pairs with the warm-start's questions
        eval_q = results["warmstart"]["questions"]
        if plan:
            plan.eval_q = eval_q
    params = sampling_params(env, tokenizer, cfg.num_generations, cfg.temperature, cfg.max_completion_length,
                             cfg.seed, cfg.top_p, cfg.top_k, cfg.min_p, cfg.max_turns,
                             kept_set=cfg.logprobs_kept_set)
    rollouts = functools.partial(scored_rollouts, sampler, tokenizer, env, params,
                                 dict(enable_thinking=cfg.enable_thinking), reward_weights)
    return Run(cfg=cfg, env=env, eval_env=eval_env or env, train_examples=train_examples,
               eval_examples=eval_examples, sft_examples=sft_examples, credit=credit, device=device,
               tokenizer=tokenizer, model=model, ref_model=ref_model, optimizer=optimizer, scheduler=scheduler,
               sampler=sampler, rollouts=rollouts, loss=loss_options(cfg), ckpt=ckpt, logger=logger, budget=budget,
               plan=plan, eval_q=eval_q, before_q=before_q, start=start, resumed=found is not None, results=results,
               t_run=t_run)


def run_eval(run: Run, phase: str, at_step: int):
    """The eval of `phase` (and its greedy twin with eval_greedy), unless it has results already (a
    resumed run): every rank's share, summed up on each; logged, and its records written by rank 0."""
    cfg, results = run.cfg, run.results
    # the untrained model's eval can be shorter: it scores ~0 and rambles to the token limit
    limit = run.before_q if phase == "before" else run.eval_q
    protocols = [(phase, False)] + ([(f"{phase}_greedy", True)] if cfg.eval_greedy and cfg.eval_temperature else [])
    t = time.time()
    for name, greedy in protocols:
        if not run.eval_examples or name in results:
            continue
        run.model.eval()
        r = evaluate_on_ranks(run.model, run.tokenizer, run.eval_env, run.eval_examples[:limit], cfg, greedy,
                              run.sampler)
        records, results[name] = r.pop("records"), r  # per_question: what a paired comparison pairs
        dist.print0(f"eval {name}: mean@{r['n']} {r['mean']:.3f} ± {r['ci95']:.3f} | pass@{r['n']} {r['pass']:.3f}")
        run.log({f"eval/{name}/mean": r["mean"], f"eval/{name}/pass": r["pass"]}, at_step)
        if run.logger:
            run.logger.dump_jsonl(f"eval_{name}.jsonl", records)
        run.eval_seconds[phase] = time.time() - t
    if run.plan and phase in ("before", "warmstart") and phase in run.eval_seconds:
        run.plan.done(phase, run.eval_seconds[phase], limit)


def warm_start_phase(run: Run):
    """The supervised warm-start, the time plan (if any) made again from what it measured, its eval, and
    a checkpoint at step 0 (a crash in the RL phase does not cost the warm-start)."""
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
    """Training is over: AdamW's two states (8 bytes a trained parameter: 1.0 GiB for SmolLM2-135M in
    fp32) are freed before the eval after, whose KV cache then has their room; the last checkpoint
    holds them where checkpoints are on (--resume continues from it), and nothing after this reads them."""
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
        dist.print0(f"RL: {budget_s / 60:.1f} min of the budget left (the last evals planned at {last_eval / 60:.1f} "
                    f"min); at least {min(run.budget.min_rl_steps, run.cfg.max_steps - run.start)} steps (min_rl_steps)")
    return budget_s


def track_gap(results: dict, update: dict):
    """The run's sampler-trainer gap, |old log-prob - the sampler's| over every sampled token so far
    (mean and max), kept with the eval results: a checkpoint holds it, and summary.json reports it."""
    g = results.setdefault("sampler_gap", {"mean": 0.0, "max": 0.0, "tokens": 0.0})
    n = update["tokens"]
    g["mean"] = (g["mean"] * g["tokens"] + update["sampler_gap"] * n) / max(g["tokens"] + n, 1.0)
    g["max"], g["tokens"] = max(g["max"], update["sampler_gap_max"]), g["tokens"] + n


def log_step(run: Run, steps_done: int, metrics: dict, seconds: float, bar, batch: tuple):
    """The step's metrics to the logs, one line on rank 0, and every log_completions_steps the step's
    rollouts (all ranks', gathered to rank 0)."""
    run.log(metrics, steps_done)
    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", len=f"{metrics['completion/len']:.0f}")
    dist.print0(f"step {steps_done} | reward {metrics['reward/mean']:.3f} | len {metrics['completion/len']:.0f} | "
                f"loss {metrics['loss']:.4f} | gap {metrics['sampler_gap']:.2e} | {seconds:.1f}s")
    if run.cfg.log_completions_steps and steps_done % run.cfg.log_completions_steps == 0:
        records = dist.all_gather_objects(rollout_records(*batch, run.tokenizer))
        if run.logger:
            run.logger.rollouts(records, steps_done)


def save(run: Run, at_step: int):
    """A checkpoint of the run at `at_step`, with what a resume checks (grpo.infra.checkpoint.Checkpointer.save_step)."""
    path = run.ckpt.save_step(at_step, run.model, run.optimizer, run.scheduler, run.results, run.cfg.prompts_per_step,
                              run.cfg.seed)
    dist.print0(f"checkpoint: {path}")
