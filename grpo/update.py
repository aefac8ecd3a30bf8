"""The policy update: trajectories -> packed micro-batches -> mu optimizer steps.

    policy_update(model, ref_model, optimizer, scheduler, trajs, advantages, cfg, device)
1. Old log-probs come from one no-grad pass before the mu updates; with mu = 1 they equal the
   current log-probs detached (rho = 1) and that pass is skipped.
2. Log-probs come from the model's `labels=` path (fused LM head: no logits tensor).
3. All loss normalizers (sequences, tokens) are counted over the whole optimizer step, every
   micro-batch and every rank, so accumulation and world size never change the gradient.
4. A sequence whose advantages are all zero has zero loss and zero gradient (without a KL
   term, and not under BNPO): it is left out of the forward and backward, and still counted.
5. share_prompt: the sequences of one prompt share one row, the prompt computed once
   (grpo.model.shared_prompt_attention); their log-probs are gathered back into the
   per-sequence layout the loss reads.
"""
import math
import time

import torch

from grpo import dist
from grpo.config import Config
from grpo.loss import LossOptions, policy_loss
from grpo.model import SharedPrompts

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


def pack(trajs: list, device) -> dict:
    """The sequences end to end in one row, no padding: (1, sum of lengths) input_ids, positions
    restarting at 0 for each (the model attends within each sequence only), labels and loss_mask
    as collate's. For losses that are a plain token sum (the warm-start's): right-padding a batch
    of gold episodes of 150 to 450 tokens computed ~1.5x its tokens."""
    rows = [collate([t], "cpu") for t in trajs]
    cat = lambda key: torch.cat([r[key][0] for r in rows])[None].to(device)  # noqa: E731
    positions = torch.cat([torch.arange(r["input_ids"].shape[1]) for r in rows])[None].to(device)
    return dict(input_ids=cat("input_ids"), position_ids=positions, labels=cat("labels"), loss_mask=cat("loss_mask"))


def prompt_rows(trajs: list, keep: list[int], budget: int) -> list[tuple[list[int], int]]:
    """share_prompt: the kept sequences grouped by prompt into rows of (indices, tokens), each at
    most `budget` tokens: the prompt once without its last token, then for each sequence that
    token again and the completion. The last prompt token's output predicts a different first
    token for each completion, so each completion needs its own copy of it."""
    rows, open_rows = [], {}
    for i in keep:
        prompt, need = tuple(trajs[i].prompt_ids), len(trajs[i].completion_ids) + 1
        row = open_rows.get(prompt)
        if row is None or row[1] + need > budget:
            row = open_rows[prompt] = [[], len(prompt) - 1]
            rows.append(row)
        row[0].append(i)
        row[1] += need
    return [tuple(row) for row in rows]


def shared_prompt_batch(rows: list[list], device) -> dict:
    """Rows of one prompt's sequences (prompt_rows) -> (R, L) input_ids, position_ids, labels, the
    rows' layout for the model's shared-prompt attention (grpo.model.SharedPrompts: each
    completion attends to the prompt and to itself only), and `index` (N, T): where each of
    collate's (N, T) positions of these N sequences, in row order, lies in the flattened (R * L)
    rows (R * L, one past the end, where none: it reads a zero). A group of G sequences computes
    its prompt once instead of G times."""
    R, N = len(rows), sum(len(r) for r in rows)
    L = max(len(r[0].prompt_ids) - 1 + sum(len(t.completion_ids) + 1 for t in r) for r in rows)
    T = max(len(t.prompt_ids) + len(t.completion_ids) for r in rows for t in r)
    Pm = max(1, max(len(r[0].prompt_ids) - 1 for r in rows))
    Mm = max(len(t.completion_ids) + 1 for r in rows for t in r)
    input_ids, position_ids = torch.zeros(R, L, dtype=torch.long), torch.zeros(R, L, dtype=torch.long)
    labels = torch.full((R, L), -100, dtype=torch.long)
    index, n = torch.full((N, T), R * L, dtype=torch.long), 0
    prompt_at, segment_at = torch.full((R, Pm), R * L, dtype=torch.long), torch.full((N, Mm), R * L, dtype=torch.long)
    segment_row, mask = torch.zeros(N, dtype=torch.long), torch.zeros(N, 1, Mm, Pm + Mm, dtype=torch.bool)
    causal = torch.ones(Mm, Mm, dtype=torch.bool).tril()
    for r, row in enumerate(rows):
        prompt = row[0].prompt_ids
        P, s = len(prompt), len(prompt) - 1
        input_ids[r, :s], position_ids[r, :s] = torch.tensor(prompt[:-1], dtype=torch.long), torch.arange(s)
        prompt_at[r, :s] = r * L + torch.arange(s)
        for t in row:
            C = len(t.completion_ids)
            input_ids[r, s:s + C + 1] = torch.tensor(prompt[-1:] + t.completion_ids)
            position_ids[r, s:s + C + 1] = torch.arange(P - 1, P + C)
            ids, scored = torch.tensor(t.completion_ids), torch.tensor(t.loss_mask, dtype=torch.bool)
            labels[r, s:s + C] = torch.where(scored, ids, -100)
            index[n, P - 1:P - 1 + C] = r * L + torch.arange(s, s + C)
            segment_at[n, :C + 1], segment_row[n] = r * L + torch.arange(s, s + C + 1), r
            mask[n, 0, :, :P - 1] = True   # the row's real prompt tokens
            mask[n, 0, :, Pm:] = causal    # its own segment, causally (padded queries read its first token)
            s, n = s + C + 1, n + 1
    out = dict(input_ids=input_ids, position_ids=position_ids, labels=labels, index=index)
    return {k: v.to(device) for k, v in out.items()} | {
        "layout": SharedPrompts(prompt_at, segment_at, segment_row, mask).to(device)}


def sequence_logprobs(model, b: dict, temperature: float, return_entropy: bool = False):
    """(N, T) log-probs (and entropies) of a micro-batch in collate's layout: from its own rows,
    or from its shared-prompt rows (b["prompt_rows"]) gathered back into that layout."""
    shared = b.get("prompt_rows")
    if shared is None:
        return model(b["input_ids"], labels=b["labels"], temperature=temperature, return_entropy=return_entropy)
    out = model(shared["input_ids"], shared["position_ids"], labels=shared["labels"], temperature=temperature,
                return_entropy=return_entropy, shared=shared["layout"])
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
        units, lengths = map(list, zip(*prompt_rows(trajs, keep, cfg.micro_batch_tokens))) if keep else ([], [])
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
    eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high  # unset: symmetric clip
    return LossOptions(aggregation=cfg.loss_type, eps_low=cfg.epsilon, eps_high=eps_high,
                       delta=cfg.delta or None, dual_clip=cfg.dual_clip or None, beta=cfg.beta,
                       tis_cap=cfg.tis_cap or None, max_completion_length=cfg.max_completion_length,
                       importance_sampling_level=getattr(cfg, "importance_sampling_level", "token"))


def progress_bar(total: int):
    """Rank 0's bar over the update's micro-batches (rows done, tokens/s, ETA), gone when done."""
    from tqdm import tqdm
    return tqdm(total=total, desc="update", unit="mb", leave=False, mininterval=2.0, disable=not dist.is_main())


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
    """mu optimizer steps over one batch of trajectories. Returns the update's metrics over the
    global batch: per-token means (ratio, clip and IS rates, kl, entropy, sampler_gap), the loss,
    the mean grad norm, skipped updates, and counts (tokens, sequences trained on)."""
    opts = opts or loss_options(cfg)
    world = dist.world_size()
    # the normalizers count every sequence, also those update_batches leaves out
    num_sequences = dist.all_sum(float(len(trajs)))
    num_tokens = dist.all_sum(float(sum(sum(t.loss_mask) for t in trajs if not masked_out(t, cfg))))
    batches = update_batches(trajs, advantages, cfg, device)
    old = batch_logprobs(model, batches, cfg.temperature) if cfg.num_iterations > 1 else None
    ref = batch_logprobs(ref_model, batches, cfg.temperature) if ref_model is not None else None
    sums, grad_norm, skipped = {}, 0.0, 0
    bar, t0, done_tokens = progress_bar(cfg.num_iterations * len(batches)), time.time(), 0
    for it in range(cfg.num_iterations):
        for k, b in enumerate(batches):
            logprobs, entropy = sequence_logprobs(model, b, cfg.temperature, return_entropy=True)
            old_logprobs = old[k] if old is not None else logprobs.detach()
            loss, m = policy_loss(logprobs, old_logprobs, b["advantages"], b["loss_mask"], opts,
                                  num_sequences=num_sequences, num_tokens=num_tokens, world_size=world,
                                  num_micro_batches=len(batches), sampler_logprobs=b["sampler_logprobs"],
                                  ref_logprobs=ref[k] if ref is not None else None)
            loss.backward()
            done_tokens += b["input_ids"].numel()  # rows x padded length: what the forward computed
            if not bar.disable:
                bar.set_postfix_str(f"{done_tokens / max(time.time() - t0, 1e-9):.0f} tok/s", refresh=False)
                bar.update(1)
            m["loss"] = loss.detach()
            if it == 0:  # what the update trains on, counted once (not per iteration)
                m["entropy"] = (entropy.detach() * b["loss_mask"]).sum()
                m["sequences"] = (b["loss_mask"].sum(1) > 0).sum().float()
            for key, v in m.items():
                sums[key] = sums.get(key, 0.0) + v.float()          # on device: no sync per micro-batch
        norm, ok = optimizer_step(model, optimizer, scheduler, cfg)
        grad_norm, skipped = grad_norm + norm / cfg.num_iterations, skipped + (not ok)
    bar.close()
    keys = sorted(sums)
    total = dict(zip(keys, dist.all_sum(torch.stack([sums[k] for k in keys]).double()).tolist()))  # host sync
    per_token_iter = total["tokens"]                      # mask tokens summed over iterations
    out = {k: total[k] / max(per_token_iter, 1.0) for k in
           ("ratio", "clip_low", "clip_high", "dual_clip", "kl", "is_weight", "is_capped", "sampler_gap")}
    out |= {"entropy": total["entropy"] * cfg.num_iterations / max(per_token_iter, 1.0),
            # each rank's loss is scaled by world size (FSDP averages gradients): the mean is the global loss
            "loss": total["loss"] / cfg.num_iterations / world,
            "grad_norm": grad_norm, "skipped_updates": skipped, "sequences": total["sequences"],
            "tokens": per_token_iter / cfg.num_iterations, "num_tokens": num_tokens}
    return out
