"""GRPO (arXiv 2402.03300), readable top to bottom: rollout > reward > advantage > loss > step.

    train(cfg, env, train_examples, eval_examples)
1. Sampling runs on the very weights being trained (grpo/sampler.py): no second engine, no
   weight sync. The sampler/trainer log-prob gap is logged; truncated importance sampling
   (tis_cap) corrects what remains.
2. Old log-probs come from one no-grad pass before the mu updates; with mu = 1 they equal the
   current log-probs detached (rho = 1) and that pass is skipped.
3. Log-probs come from the model's `labels=` path (fused LM head: no logits tensor).
4. All loss normalizers (sequences, tokens) are counted over the whole optimizer step, every
   micro-batch and every rank, so accumulation and world size never change the gradient.
5. KL to a reference model only when beta > 0 (off by default, as in DAPO and Dr. GRPO).
"""
import math
import os
import random
import time

import torch
from tqdm import tqdm

from grpo import dist
from grpo.checkpoint import Checkpointer, export
from grpo.config import Config
from grpo.eval import evaluate, summarize
from grpo.loss import group_advantages, overlong_penalty, policy_loss
from grpo.metrics import Logger, step_metrics
from grpo.model import Transformer
from grpo.rollout import gold_trajectory, rollout, sampling_params, score
from grpo.sampler import Sampler


# ----------------------------------------------------------------------------- batches

def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most `budget` tokens, padding included
    (rows padded to the longest): sorting by length first keeps the padding small."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current = [], []
    for i in order:
        if current and lengths[i] * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


def collate(trajs: list, device) -> dict:
    """Right-padded rows; position t scores token t+1, so completion token j of a sequence with
    prompt length P is the label at position P-1+j. Returns (B, T) tensors."""
    T = max(len(t.prompt_ids) + len(t.completion_ids) for t in trajs)
    B = len(trajs)
    input_ids = torch.zeros(B, T, dtype=torch.long)
    labels = torch.full((B, T), -100, dtype=torch.long)
    loss_mask = torch.zeros(B, T)
    sampler_logprobs = torch.zeros(B, T)
    for b, t in enumerate(trajs):
        P, C = len(t.prompt_ids), len(t.completion_ids)
        input_ids[b, :P + C] = torch.tensor(t.prompt_ids + t.completion_ids)
        labels[b, P - 1:P + C - 1] = torch.tensor(t.completion_ids)
        loss_mask[b, P - 1:P + C - 1] = torch.tensor(t.loss_mask, dtype=torch.float)
        sampler_logprobs[b, P - 1:P + C - 1] = torch.tensor(t.sampler_logprobs)
    labels[loss_mask == 0] = -100  # injected tokens are never scored
    out = dict(input_ids=input_ids, labels=labels, loss_mask=loss_mask, sampler_logprobs=sampler_logprobs)
    return {k: v.to(device) for k, v in out.items()}


@torch.no_grad()
def batch_logprobs(model, batches: list[dict], temperature: float) -> list[torch.Tensor]:
    """(B, T) log-probs under `model` for already collated micro-batches (old policy, reference)."""
    return [model(b["input_ids"], labels=b["labels"], temperature=temperature).float() for b in batches]


def logprobs_of(model, trajs: list, budget: int, temperature: float, device) -> list[torch.Tensor]:
    """Per-trajectory (B, T) log-probs under `model`, micro-batched as policy_update does.
    Returns one tensor per micro-batch of micro_batches(...)."""
    lengths = [len(t.prompt_ids) + len(t.completion_ids) for t in trajs]
    return batch_logprobs(model, [collate([trajs[i] for i in mb], device) for mb in micro_batches(lengths, budget)], temperature)


def lr_lambda(cfg: Config, total_steps: int):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "cosine":
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


def flat_groups(rewards: list[float], G: int) -> list[bool]:
    """Per group of G consecutive rewards: are they all equal? Such a group has zero advantage
    and teaches nothing. Equal values, not std == 0, which float rounding of the mean can miss."""
    return [len(set(rewards[i:i + G])) == 1 for i in range(0, len(rewards), G)]


def refill(trajs: list, share: int, G: int, step: int, cfg: Config, sample, examples: list) -> list:
    """Dynamic sampling (DAPO, arXiv 2503.14476): groups whose G rewards are all equal have zero
    advantage and teach nothing; keep the others and roll out fresh prompts in their place, at
    most cfg.max_refills times. Refill prompts come from a stream seeded by (seed, step, rank)
    and their sampler seeds from indices past any epoch's, so a resumed run draws the same ones."""
    chunks = lambda ts: [ts[i:i + G] for i in range(0, len(ts), G)]
    informative = lambda ts: [g for g, f in zip(chunks(ts), flat_groups([t.reward for t in ts], G)) if not f]
    groups = informative(trajs)
    rng = random.Random(f"refill-{cfg.seed}-{step}-{dist.rank()}")
    for attempt in range(cfg.max_refills):
        if len(groups) >= share:
            break
        exs = rng.sample(examples, min(share - len(groups), len(examples)))
        offset = 1 << 40 | (step * dist.world_size() + dist.rank()) << 16 | attempt << 12  # unique sampler seeds
        groups += informative(sample(exs, offset))
    # still short: top up with original zero-variance groups (zero advantage, no gradient), so that
    # every rank holds exactly `share` groups for the collectives that follow
    flat = [g for g, f in zip(chunks(trajs), flat_groups([t.reward for t in trajs], G)) if f]
    return [t for g in (groups[:share] + flat)[:share] for t in g]


# ----------------------------------------------------------------------------- one optimizer step

def optimizer_step(model, optimizer, scheduler, cfg: Config) -> tuple[float, bool]:
    """Clip, then step unless the gradient is not finite (then the update is skipped and logged)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # host sync: once per step
    ok = math.isfinite(norm)
    if ok:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return norm, ok


def masked_out(traj, cfg: Config) -> bool:
    return cfg.mask_truncated_completions and traj.finish_reason == "length"  # a truncated answer says nothing about its reward


def update_batches(trajs: list, advantages: torch.Tensor, cfg: Config, device, flat: list[bool] | None = None) -> list[dict]:
    """The micro-batches of one update. Without a KL term, a group whose G rewards are all equal
    has zero advantage, hence zero loss and zero gradient, and so has a sequence whose loss mask
    is cleared (mask_truncated_completions): both are left out, which saves their forward and
    backward and changes nothing else, since the loss normalizers still count them. BNPO keeps
    every sequence: its per-micro-batch token mean depends on what shares the micro-batch.
    Every rank runs the same number of micro-batches, because FSDP's all-gathers and
    reduce-scatters pair up forward by forward across ranks: a rank short of the largest count
    pads with fully masked micro-batches (zero loss, zero gradient), and a step with nothing to
    learn runs one such micro-batch. `flat`: per group, flat_groups of the final rewards the
    advantages came from (with any overlong penalty); default from each trajectory's reward."""
    G = cfg.group_size
    keep = list(range(len(trajs)))
    if cfg.beta == 0 and cfg.loss_type != "bnpo":
        flat = flat_groups([t.reward for t in trajs], G) if flat is None else flat
        keep = [i for i in keep if not flat[i // G] and not masked_out(trajs[i], cfg)]
    lengths = [len(trajs[i].prompt_ids) + len(trajs[i].completion_ids) for i in keep]
    mbs = [[keep[j] for j in mb] for mb in micro_batches(lengths, cfg.micro_batch_tokens)]
    batches = []
    for mb in mbs:
        b = collate([trajs[i] for i in mb], device)
        b["advantages"] = advantages[mb].to(device)
        b["loss_mask"][torch.tensor([masked_out(trajs[i], cfg) for i in mb], device=device)] = 0
        batches.append(b)
    for _ in range(max(1, dist.all_max(len(batches))) - len(batches)):  # at least one: the step's metrics come from it
        b = collate(trajs[:1], device)
        b["loss_mask"].zero_()
        b["advantages"] = torch.zeros(1, device=device)
        batches.append(b)
    return batches


def policy_update(model, ref_model, optimizer, scheduler, trajs: list, advantages: torch.Tensor, cfg: Config, device,
                  flat: list[bool] | None = None):
    """mu optimizer steps over one batch of trajectories; returns summed metrics."""
    world = dist.world_size()
    # the normalizers count every sequence, also those update_batches leaves out
    num_sequences = dist.all_sum(float(len(trajs)))
    num_tokens = dist.all_sum(float(sum(sum(t.loss_mask) for t in trajs if not masked_out(t, cfg))))
    batches = update_batches(trajs, advantages, cfg, device, flat)
    old = batch_logprobs(model, batches, cfg.temperature) if cfg.num_iterations > 1 else None
    ref = batch_logprobs(ref_model, batches, cfg.temperature) if ref_model is not None else None
    metrics = {"sequences": float(sum((b["loss_mask"].sum(1) > 0).sum() for b in batches))}  # those with gradient
    for it in range(cfg.num_iterations):
        for k, b in enumerate(batches):
            logprobs, entropy = model(b["input_ids"], labels=b["labels"], temperature=cfg.temperature, return_entropy=True)
            old_logprobs = old[k] if old is not None else logprobs.detach()
            loss, m = policy_loss(
                logprobs, old_logprobs, b["advantages"], b["loss_mask"], aggregation=cfg.loss_type,
                num_sequences=num_sequences, num_tokens=num_tokens, max_completion_len=cfg.max_completion_len,
                world_size=world, num_micro_batches=len(batches), eps_low=cfg.epsilon, eps_high=cfg.epsilon_high, delta=cfg.delta or None,
                dual_clip=cfg.dual_clip or None, ref_logprobs=ref[k] if ref is not None else None, beta=cfg.beta,
                sampler_logprobs=b["sampler_logprobs"], tis_cap=cfg.tis_cap or None)
            loss.backward()
            m["loss"] = loss.detach()
            if it == 0:  # entropy of the sequences in the update (not the left-out groups): count it once
                m["entropy"] = (entropy.detach() * b["loss_mask"]).sum()
            for key, v in m.items():
                metrics[key] = metrics.get(key, 0.0) + float(v)  # host sync: logging only
        norm, ok = optimizer_step(model, optimizer, scheduler, cfg)
        metrics["grad_norm"] = metrics.get("grad_norm", 0.0) + norm / cfg.num_iterations
        metrics["skipped_updates"] = metrics.get("skipped_updates", 0) + (not ok)
    metrics["num_tokens"] = num_tokens
    return metrics


# ----------------------------------------------------------------------------- warm-start

def warm_start(model, tokenizer, env, examples: list, cfg: Config, device, log):
    """Supervised cross-entropy on the sampled-token positions of gold trajectories rendered in
    the rollout layout, so RL starts from a model that knows the tool format."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, betas=(cfg.adam_beta1, cfg.adam_beta2))
    eos = model.eos_token_ids()[0]
    kw = dict(enable_thinking=cfg.enable_thinking)
    rng = random.Random(cfg.seed)
    model.train()
    for step in tqdm(range(cfg.sft_steps), desc="warm-start", disable=not dist.is_main()):
        trajs = [gold_trajectory(tokenizer, env, ex, eos, kw) for ex in rng.sample(examples, cfg.sft_batch)]
        b = collate(trajs, device)
        logprobs = model(b["input_ids"], labels=b["labels"])
        loss = -(logprobs * b["loss_mask"]).sum() / b["loss_mask"].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log({"sft/loss": loss.item()}, step)
    del optimizer


# ----------------------------------------------------------------------------- the run

def train(cfg: Config, env, train_examples: list, eval_examples: list = (), reward_weights: dict | None = None,
          sft_examples: list | None = None, eval_env=None) -> dict:
    """The whole run; returns the eval results ({phase: accuracy, interval, per-question scores}).
    `eval_env`: a different prompt for eval (e.g. GSM8K's 10-shot protocol); default `env`."""
    # ---- 1. setup
    cfg.check()
    dist.init()
    device = dist.device()
    compute_dtype = torch.bfloat16 if (cfg.dtype == "bfloat16" or cfg.dtype == "auto" and device.type == "cuda") else torch.float32
    torch.manual_seed(cfg.seed)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
    model = Transformer.from_pretrained(cfg.model_path, dtype=torch.float32, device=device)  # fp32 master weights
    model.activation_checkpointing = cfg.activation_checkpointing
    dist.shard(model, compute_dtype)
    ref_model = None
    if cfg.beta > 0:
        ref_model = Transformer.from_pretrained(cfg.model_path, dtype=torch.float32, device=device).eval().requires_grad_(False)
        dist.shard(ref_model, compute_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                  weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, cfg.num_steps * cfg.num_iterations))
    with dist.gathered(model):  # the sampler sizes its KV cache in the dtype of the weights it reads (bf16 under FSDP on GPU)
        sampler = Sampler(model, tokenizer, max_batch=cfg.gen_batch, max_seq_len=cfg.max_prompt_len + cfg.max_completion_len,
                          kv_budget_bytes=int(cfg.kv_budget_gb * 2**30) or None)
    ckpt = Checkpointer(cfg.output_dir, keep_last=cfg.keep_last)
    start, results, found = 0, {}, None
    if cfg.resume and (found := ckpt.load_latest(model, optimizer, scheduler)) is not None:
        start, results = found["step"], found.get("results", {})
        data = found.get("data", {})
        if data and (data["prompts_per_step"], data["seed"]) != (cfg.prompts_per_step, cfg.seed):
            raise ValueError(f"{found['path']} was written with {data}: the data position is a function of "
                             "prompts_per_step and seed, so keep them (or use a new output_dir)")
        dist.print0(f"resumed from {found['path']} at step {start} (next prompt {start * cfg.prompts_per_step})")
    elif cfg.resume:
        dist.print0(f"resume: no checkpoint in {ckpt.root}, starting from step 0")
    logger = Logger(cfg.output_dir, purge_after=start if start else None) if dist.is_main() else None
    log = (lambda m, s: logger.log(m, s)) if logger else (lambda m, s: None)
    dist.print0(f"grpo | {cfg.model_path} | world {dist.world_size()} | {compute_dtype} | "
                f"{cfg.num_steps} steps x {cfg.prompts_per_step} prompts x G={cfg.group_size}")
    kw = dict(enable_thinking=cfg.enable_thinking)

    def run_eval(name: str, at_step: int):
        if not eval_examples or name in results:
            return
        model.eval()
        questions = list(eval_examples[:cfg.eval_limit])
        share = -(-len(questions) // dist.world_size())  # each rank evaluates a contiguous share, seeded by global index
        lo, hi = min(dist.rank() * share, len(questions)), min((dist.rank() + 1) * share, len(questions))
        with dist.gathered(model):
            r = evaluate(model, tokenizer, eval_env or env, questions[lo:hi], n=cfg.eval_n, temperature=cfg.eval_temperature,
                         max_tokens=cfg.max_completion_len, max_turns=cfg.max_turns, chat_kwargs=kw, gen_batch=cfg.gen_batch,
                         kv_budget_bytes=int(cfg.kv_budget_gb * 2**30) or None, progress=dist.is_main(),
                         prompt_offset=lo)  # its own sampler: eval prompts may be longer (few-shot)
        records = dist.all_gather_objects(r["records"])  # every rank holds the whole eval, in question order
        results[name] = r = summarize(records, cfg.eval_n)  # per_question: what a paired comparison pairs
        dist.print0(f"eval {name}: mean@{cfg.eval_n} {r['mean']:.3f} ± {r['ci95']:.3f} | pass@{cfg.eval_n} {r['pass']:.3f}")
        log({f"eval/{name}/mean": r["mean"], f"eval/{name}/pass": r["pass"]}, at_step)
        if logger:
            logger.dump_jsonl(f"eval_{name}.jsonl", records)

    def save(at_step: int):  # the data position is a function of (step, prompts_per_step, seed): saved to check
        data = {"next_prompt": at_step * cfg.prompts_per_step, "prompts_per_step": cfg.prompts_per_step, "seed": cfg.seed}
        dist.print0(f"checkpoint: {ckpt.save(at_step, model, optimizer, scheduler, meta={'results': results, 'data': data})}")

    # ---- 2. eval before, optional warm-start (a resumed run has done both: every checkpoint comes after them)
    if start == 0 and found is None:
        run_eval("before", 0)
        if cfg.sft_steps > 0:
            warm_start(model, tokenizer, env, sft_examples or train_examples, cfg, device, log)
            run_eval("warmstart", 0)
            if cfg.save_every:
                save(0)  # a crash in the RL phase does not cost the warm-start

    # ---- 3. RL
    B, G, world, rank = cfg.prompts_per_step, cfg.group_size, dist.world_size(), dist.rank()
    assert B % world == 0, f"prompts_per_step={B} must be a multiple of world size {world}"
    params = sampling_params(env, tokenizer, G, cfg.temperature, cfg.max_completion_len, cfg.seed,
                             cfg.top_p, cfg.top_k, cfg.min_p, cfg.max_turns)
    t_start = time.time()
    bar = tqdm(range(start, cfg.num_steps), desc="grpo", disable=not dist.is_main(), initial=start, total=cfg.num_steps)
    steps_done, stop = start, False
    for step in bar:
        t0 = time.time()
        # 3a. rollouts: this rank's share of the step's prompts, G samples each
        examples, first = prompt_batch(train_examples, step, B, cfg.seed)
        share = B // world
        model.eval()
        with dist.gathered(model):
            trajs = score(env, rollout(sampler, tokenizer, env, examples[rank * share:(rank + 1) * share], params,
                                       prompt_offset=first + rank * share, chat_kwargs=kw), reward_weights)
            if cfg.drop_zero_variance:
                trajs = refill(trajs, share, G, step, cfg, lambda exs, offset: score(env, rollout(
                    sampler, tokenizer, env, exs, params, prompt_offset=offset, chat_kwargs=kw), reward_weights), train_examples)
        t1 = time.time()
        # 3b. rewards -> advantages (group stats are local: a prompt's G samples live on one rank)
        rewards = torch.tensor([t.reward for t in trajs])
        if cfg.overlong_buffer > 0:
            lengths = torch.tensor([len(t.completion_ids) for t in trajs], dtype=torch.float)
            rewards = rewards + overlong_penalty(lengths, cfg.max_completion_len, cfg.overlong_buffer)
        if cfg.scale_rewards == "batch":  # std over the global batch of raw rewards
            all_rewards = dist.all_gather_cat(rewards)
            advantages = (rewards.view(-1, G) - rewards.view(-1, G).mean(1, keepdim=True)).flatten() / (all_rewards.std() + 1e-4)
        else:
            advantages = group_advantages(rewards, G, scale=cfg.scale_rewards)
        flat = flat_groups(rewards.tolist(), G)  # (groups,) groups that teach nothing: left out of the update
        # 3c. mu policy updates
        model.train()
        m = policy_update(model, ref_model, optimizer, scheduler, trajs, advantages, cfg, device, flat)
        t2 = time.time()
        steps_done = step + 1
        # 3d. logging: one line per step on rank 0
        metrics = step_metrics(trajs, rewards, advantages, torch.tensor(flat), m, cfg, t1 - t0, t2 - t1, scheduler.get_last_lr()[0])
        log(metrics, step + 1)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", len=f"{metrics['completion/len']:.0f}")
        dist.print0(f"step {step + 1} | reward {metrics['reward/mean']:.3f} | len {metrics['completion/len']:.0f} | "
                    f"loss {metrics.get('loss', 0):.4f} | gap {metrics.get('sampler_gap', 0):.2e} | {t2 - t0:.1f}s")
        if logger and cfg.log_completions_every and step % cfg.log_completions_every == 0:
            logger.text("completions", trajs[0].text, step + 1)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.num_steps:
            run_eval(f"step{step + 1}", step + 1)
        stop = ckpt.should_stop()  # SIGTERM: save, then leave cleanly
        if stop or cfg.save_every and (step + 1) % cfg.save_every == 0:
            save(step + 1)
        if stop:
            dist.print0(f"SIGTERM: checkpoint written at step {step + 1}, exiting")
            break
        if cfg.time_budget_min and time.time() - t_start > 60 * cfg.time_budget_min:
            dist.print0(f"time budget of {cfg.time_budget_min} min reached after {step + 1} steps")
            break
    bar.close()
    if not stop and cfg.save_every and steps_done > start and steps_done % cfg.save_every:
        # the last steps (e.g. cut by the time budget) are not lost: --resume --num_steps=... continues
        save(steps_done)

    # ---- 4. eval after, export (not after SIGTERM: the job is being stopped, the checkpoint is what counts)
    if not stop:
        run_eval("after", steps_done)
        if cfg.export:
            export(model, os.path.join(cfg.output_dir, "export"))
    ckpt.close()
    if logger:
        logger.close()
    return results
