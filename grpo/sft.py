"""The supervised warm-start: cross-entropy on gold trajectories before RL (Config's sft_* fields).

A weak model that never writes the tool format cannot learn it from rewards it never earns, so a
recipe may first teach the format on the env's demonstrations (`env.gold_messages(example)`),
rendered in the very token layout a rollout produces (gold_trajectory, with rollout's own
continuation_ids), packed end to end without padding (pack), and trained on the sampled-looking
turns only (warm_start).
"""
import math
import random

import torch
from tqdm import tqdm

from grpo.config import Config
from grpo.env import as_env
from grpo.infra import dist
from grpo.models.lora import trainable
from grpo.rollout import Trajectory, continuation_ids, render_prompt
from grpo.update import collate


def gold_trajectory(tokenizer, env, example: dict, eos_id: int,
                    chat_kwargs: dict | None = None) -> Trajectory:
    """A demonstration rendered in the very layout a rollout produces: sampled-looking assistant
    turns (mask 1), template-made observation tokens between them (mask 0), the final EOS.
    Used by the supervised warm-start; env.gold_messages(example) gives the turns. A turn with
    `"learn": False` (e.g. a mistaken tool call before its correction) is context, mask 0."""
    chat_kwargs = {**as_env(env).chat_kwargs, **(chat_kwargs or {})}  # e.g. the env's tools
    messages = env.prompt(example)
    prompt = render_prompt(tokenizer, messages, **chat_kwargs)
    gold = env.gold_messages(example)  # [assistant, observation, assistant, ...]
    ids, mask = [], []
    for i in range(0, len(gold), 2):
        turn = tokenizer.encode(gold[i]["content"], add_special_tokens=False)
        ids += turn
        mask += [int(gold[i].get("learn", True))] * len(turn)
        if i + 1 < len(gold):
            obs = continuation_ids(tokenizer, messages, gold[i]["content"], gold[i + 1]["content"],
                                   gold[i + 1]["role"], **chat_kwargs)
            messages = messages + gold[i:i + 2]
            ids += obs
            mask += [0] * len(obs)
    ids.append(eos_id)
    mask.append(1)
    return Trajectory(example=example, prompt_index=-1, prompt_ids=prompt, completion_ids=ids, loss_mask=mask,
                      sampler_logprobs=[0.0] * len(ids), finish_reason="stop", num_turns=(len(gold) + 1) // 2,
                      text=tokenizer.decode(ids, skip_special_tokens=True),
                      turns=[m["content"] for m in gold[0::2]],
                      observations=[m["content"] for m in gold[1::2]])


def pack(trajs: list, device) -> dict:
    """The sequences end to end in one row, no padding: (1, sum of lengths) input_ids, positions
    restarting at 0 for each (the model attends within each sequence only), labels and loss_mask
    as collate's. For losses that are a plain token sum (the warm-start's): right-padding a batch
    of gold episodes of 150 to 450 tokens computed ~1.5x its tokens."""
    rows = [collate([t], "cpu") for t in trajs]
    cat = lambda key: torch.cat([r[key][0] for r in rows])[None].to(device)  # noqa: E731
    positions = torch.cat([torch.arange(r["input_ids"].shape[1]) for r in rows])[None].to(device)
    return dict(input_ids=cat("input_ids"), position_ids=positions, labels=cat("labels"),
                loss_mask=cat("loss_mask"))


def _split(trajs: list, sizes: list[int], n: int) -> list[list]:
    """The trajectories in order, cut into n runs of about equal tokens (some may be empty)."""
    total, parts, acc = sum(sizes), [[] for _ in range(n)], 0
    for t, size in zip(trajs, sizes):
        parts[min(n - 1, acc * n // max(total, 1))].append(t)
        acc += size
    return parts


# a one-token micro-batch that trains nothing: a rank's turn in the collectives
def _masked(t, device) -> dict:
    b = pack([t], device)
    return {k: v[:, :1] for k, v in b.items()} | {"loss_mask": torch.zeros_like(b["loss_mask"][:, :1])}


def warm_start(model, tokenizer, env, examples: list, cfg: Config, device, log):
    """Supervised cross-entropy on the sampled-token positions of gold trajectories rendered in
    the rollout layout, so RL starts from a model that knows the tool format. Each rank trains on
    its share of every batch, the loss normalized by the batch's token count over all ranks, so
    any world size takes the same steps."""
    params = trainable(model)  # the adapters under LoRA
    optimizer = torch.optim.AdamW(params, lr=cfg.sft_learning_rate,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    eos = model.eos_token_ids()[0]
    kw = dict(enable_thinking=cfg.enable_thinking)
    rng = random.Random(cfg.seed)  # the same batches on every rank
    share, rank, world = cfg.sft_batch // dist.world_size(), dist.rank(), dist.world_size()
    model.train()
    for step in tqdm(range(cfg.sft_steps), desc="warm-start", disable=not dist.is_main()):
        batch = rng.sample(examples, cfg.sft_batch)[rank * share:(rank + 1) * share]
        trajs = [gold_trajectory(tokenizer, env, ex, eos, kw) for ex in batch]
        # packed micro-batches of up to micro_batch_tokens (the activations of one at a time: a CPU's
        # peak memory); every rank runs as many (FSDP's collectives pair up), an empty one a masked token
        sizes = [len(t.prompt_ids) + len(t.completion_ids) for t in trajs]
        n = int(dist.all_max_floats([math.ceil(sum(sizes) / cfg.micro_batch_tokens)])[0])
        packs = [pack(part, device) if part else _masked(trajs[0], device)
                 for part in _split(trajs, sizes, n)]
        # host sync: the global normalizer
        tokens = dist.all_sum(sum(b["loss_mask"].sum().item() for b in packs))
        nll_sum = 0.0
        for b in packs:  # (1, sum of lengths) each
            nll = -(model(b["input_ids"], b["position_ids"], labels=b["labels"]) * b["loss_mask"]).sum()
            # FSDP averages gradients over ranks: scale the local sum by world
            (nll * world / tokens).backward()
            nll_sum += nll.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log({"sft/loss": dist.all_sum(nll_sum) / tokens}, step)
    del optimizer
