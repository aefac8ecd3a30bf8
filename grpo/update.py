"""The policy update: trajectories -> packed micro-batches -> mu optimizer steps.

    policy_update(model, ref_model, optimizer, scheduler, trajs, advantages, cfg, device)
1. Old log-probs come from one no-grad pass before the mu updates; with mu = 1 they equal the
   current log-probs detached (rho = 1) and that pass is skipped.
2. Log-probs come from the model's `labels=` path (fused LM head: no logits tensor).
3. Loss normalizers are counted over every micro-batch and every rank, so accumulation and
   world size never change the gradient: sequences over the optimizer step, and tokens (DAPO) as
   TRL counts them, over the whole batch of rollouts divided by its S optimizer steps, the same
   divisor for each (a step's own count would weigh a token more in a step of short completions).
4. A sequence whose advantages are all zero has zero loss and zero gradient (without a KL
   term, and not under BNPO): it is left out of the forward and backward, and still counted.
5. share_prompt: the sequences of one prompt share one row, the prompt computed once
   (grpo/shared_prompt.py); their log-probs are gathered back into the
   per-sequence layout the loss reads.
"""
import math
import time

import torch

from grpo.config import Config
from grpo.engine.progress import bar
from grpo.infra import dist
from grpo.loss import LossOptions, policy_loss
from grpo.models.lora import has_dropout
from grpo.shared_prompt import prompt_rows, shared_prompt_batch

# ----------------------------------------------------------------------------- micro-batches


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
    # at least 1: the rows of a failed, empty prompt
    T = max(1, *(len(t.prompt_ids) + len(t.completion_ids) for t in trajs))
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
    if any(t.kept_thresholds for t in trajs):  # sampled with top_p/top_k/min_p: score each token's kept set
        out["thresholds"] = torch.full((B, T), float("-inf"))  # (B, T) on logits / T; -inf = the vocabulary
        for b, t in enumerate(trajs):
            P, C = len(t.prompt_ids), len(t.kept_thresholds)
            out["thresholds"][b, P - 1:P + C - 1] = torch.tensor(t.kept_thresholds)
    return {k: v.to(device) for k, v in out.items()}


def sequence_logprobs(model, b: dict, temperature: float, return_entropy: bool = False):
    """(N, T) log-probs (and entropies) of a micro-batch in collate's layout: from its own rows,
    or from its shared-prompt rows (b["prompt_rows"]) gathered back into that layout."""
    shared = b.get("prompt_rows")
    if shared is None:
        return model(b["input_ids"], labels=b["labels"], temperature=temperature,
                     return_entropy=return_entropy, thresholds=b.get("thresholds"))
    out = model(shared["input_ids"], shared["position_ids"], labels=shared["labels"], temperature=temperature,
                return_entropy=return_entropy, shared=shared["layout"], thresholds=shared.get("thresholds"))
    unpack = lambda x: torch.cat([x.reshape(-1), x.new_zeros(1)])[shared["index"]]  # noqa: E731
    return tuple(unpack(x) for x in out) if return_entropy else unpack(out)


def token_advantages(trajs: list, advantages: torch.Tensor) -> torch.Tensor:
    """(N,) per sequence or (N, C) per completion token -> (N, T) aligned with collate's rows."""
    if advantages.dim() == 1:
        return advantages[:, None]                      # (N, 1): broadcast over T
    T = max(len(t.prompt_ids) + len(t.completion_ids) for t in trajs)
    out = advantages.new_zeros(len(trajs), T)
    for b, t in enumerate(trajs):
        P, C = len(t.prompt_ids), len(t.completion_ids)
        out[b, P - 1:P + C - 1] = advantages[b, :C]
    return out


@torch.no_grad()
def batch_logprobs(model, batches: list[dict], temperature: float) -> list[torch.Tensor]:
    """(B, T) log-probs under `model` for already collated micro-batches (old policy, reference)."""
    return [sequence_logprobs(model, b, temperature).float() for b in batches]


def masked_out(traj, cfg: Config) -> bool:
    """A truncated completion says nothing about its reward: masked when the config says so,
    unless it was cut after it had answered and the config keeps those (keep_truncated_answers)."""
    return (cfg.mask_truncated_completions and traj.finish_reason == "length"
            and not (cfg.keep_truncated_answers and traj.answered))


def update_batches(trajs: list, advantages: torch.Tensor, cfg: Config, device) -> list[dict]:
    """The micro-batches of one update. `advantages`: (N,) or (N, C) per completion token.

    Without a KL term a sequence whose advantages are all zero (a flat group: grpo.loss makes
    them exactly 0) has zero loss and zero gradient, and so has a sequence whose loss mask is
    cleared (mask_truncated_completions): both are left out, which saves their forward and
    backward and changes nothing else, since the loss normalizers still count them. BNPO keeps
    every sequence: its per-micro-batch token mean depends on what shares the micro-batch.
    Every rank runs the same number of micro-batches, because FSDP's all-gathers and
    reduce-scatters pair up forward by forward across ranks: a rank short of the largest count
    pads with fully masked micro-batches (zero loss, zero gradient), and a step with nothing to
    learn runs one such micro-batch."""
    keep = list(range(len(trajs)))
    if cfg.beta == 0 and cfg.loss_type != "bnpo":
        zero = (advantages.reshape(len(trajs), -1) == 0).all(1).tolist()
        keep = [i for i in keep if not zero[i] and not masked_out(trajs[i], cfg)]
    if cfg.share_prompt:  # rows of one prompt and its completions
        units, lengths = (map(list, zip(*prompt_rows(trajs, keep, cfg.micro_batch_tokens))) if keep
                          else ([], []))
    else:
        units = [[i] for i in keep]
        lengths = [len(trajs[i].prompt_ids) + len(trajs[i].completion_ids) for i in keep]
    batches = []
    for mb in micro_batches(lengths, cfg.micro_batch_tokens):
        mb_units = [units[j] for j in mb]
        mb = [i for u in mb_units for i in u]
        rows = [trajs[i] for i in mb]
        b = collate(rows, device)
        b["advantages"] = token_advantages(rows, advantages[mb]).to(device)
        b["loss_mask"][torch.tensor([masked_out(t, cfg) for t in rows], device=device)] = 0
        if cfg.share_prompt:
            b["prompt_rows"] = shared_prompt_batch([[trajs[i] for i in u] for u in mb_units], device)
        batches.append(b)
    for _ in range(max(1, dist.all_max(len(batches))) - len(batches)):  # the step's metrics need one
        b = collate(trajs[:1], device)
        b["loss_mask"].zero_()
        b["advantages"] = torch.zeros(1, 1, device=device)
        batches.append(b)
    return batches

# ----------------------------------------------------------------------------- the update


def loss_options(cfg: Config) -> LossOptions:
    """The config's loss fields, once per run (0 turns an option off in the config)."""
    return LossOptions(loss_type=cfg.loss_type, eps_low=cfg.epsilon, eps_high=cfg.clip_high(),
                       delta=cfg.delta or None, dual_clip=cfg.dual_clip or None, beta=cfg.beta,
                       tis_cap=cfg.tis_cap or None, max_completion_length=cfg.max_completion_length,
                       importance_sampling_level=getattr(cfg, "importance_sampling_level", "token"),
                       use_bias_correction_kl=cfg.use_bias_correction_kl,
                       sapo_temperature_pos=cfg.sapo_temperature_pos,
                       sapo_temperature_neg=cfg.sapo_temperature_neg)


def progress_bar(total: int):
    """Rank 0's bar over the update's micro-batches (rows done, tokens/s, ETA), gone when done; other
    ranks, and a bare GPU box without tqdm (bench/gpu_check.py needs torch and triton only), get one
    that does nothing."""
    shown = bar(total, "update", "mb", mininterval=2.0) if dist.is_main() else None
    return _NoBar() if shown is None else shown


class _NoBar:  # the calls the update makes on a tqdm bar, doing nothing
    disable = True

    def update(self, n: int = 1):
        pass

    def close(self):
        pass


def optimizer_step(model, optimizer, scheduler, cfg: Config) -> tuple[float, bool]:
    """Clip, then step unless the gradient is not finite (then the update is skipped and logged)."""
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # host sync: once per step
    ok = math.isfinite(norm)
    if ok:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return norm, ok


def policy_update(model, ref_model, optimizer, scheduler, trajs: list, advantages: torch.Tensor, cfg: Config,
                  device, opts: LossOptions | None = None) -> dict:
    """mu x S optimizer steps over one batch of trajectories: S = cfg.optimizer_steps() mini-batches
    of whole groups (TRL's steps_per_generation / gradient_accumulation_steps), each an optimizer
    step, mu passes over them. With mu > 1 or S > 1 the old log-probs are the rollout policy's,
    computed once before any step. Returns the update's metrics over the global batch: per-token
    means (ratio, clip and IS rates, kl, entropy, sampler_gap), the loss, the mean grad norm,
    skipped updates, and counts (tokens, sequences trained on)."""
    opts = opts or loss_options(cfg)
    world, S, G = dist.world_size(), cfg.optimizer_steps(), cfg.num_generations
    groups = len(trajs) // G
    assert S == 1 or groups * G == len(trajs) and groups % S == 0, \
        f"{len(trajs)} sequences on this rank cannot split into {S} optimizer steps of whole groups"
    # TRL's DAPO divisor: the batch's loss tokens over all ranks / S (grpo_trainer.py, _compute_loss:
    # num_items_in_batch / num_processes x gradient_accumulation_steps / steps_per_generation, per rank)
    num_tokens = dist.all_sum(float(sum(sum(t.loss_mask) for t in trajs if not masked_out(t, cfg)))) / S
    steps = []  # per mini-batch: its micro-batches and its normalizers (all ranks)
    for c in range(S):
        rows = (list(range(c * groups // S * G, (c + 1) * groups // S * G)) if S > 1
                else list(range(len(trajs))))
        sub, adv = [trajs[i] for i in rows], advantages[rows]
        num_sequences = dist.all_sum(float(len(sub)))
        steps.append((update_batches(sub, adv, cfg, device), num_sequences, num_tokens))
    # else old = the current policy, detached (rho = 1). Dropout in the policy's forward (lora_dropout with
    # --disable_dropout false): the old log-probs as the sampler ran them, without it, from one no-grad
    # pass, so that TIS and sampler_gap compare like with like; the ratio then carries dropout's noise
    from_rollout = cfg.num_iterations > 1 or S > 1 or has_dropout(model)
    training = model.training
    model.eval()  # the old policy and the reference as the sampler ran them: no dropout (LoRA's lora_dropout)
    old = [batch_logprobs(model, b, cfg.temperature) for b, _, _ in steps] if from_rollout else None
    ref = ([batch_logprobs(ref_model, b, cfg.temperature) for b, _, _ in steps] if ref_model is not None
           else None)
    model.train(training)
    sums, grad_norm, skipped, gap_max = {}, 0.0, 0, torch.zeros((), device=device)
    total_mbs = cfg.num_iterations * sum(len(b) for b, _, _ in steps)
    bar, t0, done_tokens = progress_bar(total_mbs), time.time(), 0
    for it in range(cfg.num_iterations):
        for c, (batches, num_sequences, num_tokens) in enumerate(steps):
            for k, b in enumerate(batches):
                logprobs, entropy = sequence_logprobs(model, b, cfg.temperature, return_entropy=True)
                old_logprobs = old[c][k] if old is not None else logprobs.detach()
                loss, m = policy_loss(logprobs, old_logprobs, b["advantages"], b["loss_mask"], opts,
                                      num_sequences=num_sequences, num_tokens=num_tokens, world_size=world,
                                      num_micro_batches=len(batches), sampler_logprobs=b["sampler_logprobs"],
                                      ref_logprobs=ref[c][k] if ref is not None else None)
                loss.backward()
                done_tokens += b["input_ids"].numel()  # rows x padded length: what the forward computed
                if not bar.disable:
                    bar.set_postfix_str(f"{done_tokens / max(time.time() - t0, 1e-9):.0f} tok/s",
                                        refresh=False)
                    bar.update(1)
                m["loss"] = loss.detach()
                if it == 0:  # what the update trains on, counted once (not per iteration)
                    m["entropy"] = (entropy.detach() * b["loss_mask"]).sum()
                    m["sequences"] = (b["loss_mask"].sum(1) > 0).sum().float()
                gap_max = torch.maximum(gap_max, m.pop("sampler_gap_max").float())
                for key, v in m.items():
                    sums[key] = sums.get(key, 0.0) + v.float()          # on device: no sync per micro-batch
            norm, ok = optimizer_step(model, optimizer, scheduler, cfg)
            grad_norm, skipped = grad_norm + norm / (cfg.num_iterations * S), skipped + (not ok)
    bar.close()
    num_tokens = sum(n for _, _, n in steps)
    keys = sorted(sums)
    total = dict(zip(keys, dist.all_sum(torch.stack([sums[k] for k in keys]).double()).tolist()))  # host sync
    per_token_iter = total["tokens"]                      # mask tokens summed over iterations
    out = {k: total[k] / max(per_token_iter, 1.0) for k in
           ("ratio", "clip_low", "clip_high", "dual_clip", "kl", "is_weight", "is_capped", "sampler_gap")}
    out |= {"entropy": total["entropy"] * cfg.num_iterations / max(per_token_iter, 1.0),
            # each rank's loss is scaled by world size (FSDP averages gradients): the mean is the global loss
            "loss": total["loss"] / (cfg.num_iterations * S) / world,  # the mean over the optimizer steps
            "grad_norm": grad_norm, "skipped_updates": skipped, "sequences": total["sequences"],
            "tokens": per_token_iter / cfg.num_iterations, "num_tokens": num_tokens,
            "sampler_gap_max": dist.all_max_floats([gap_max.item()])[0]}  # host sync: once a step
    return out
