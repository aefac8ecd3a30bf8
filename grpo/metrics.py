"""What a run records: each step's metrics over the global batch, written to TensorBoard and
metrics.jsonl (one JSON object per step, flushed at once so a crash loses nothing)."""
import json
import os

import torch

from grpo import dist
from grpo.config import Config


def step_metrics(trajs, rewards, advantages, zero_var, m: dict, cfg: Config, t_gen: float, t_update: float, lr: float) -> dict:
    """The step's metrics over the global batch: each rank holds B/world groups, so per-sequence
    numbers are gathered and loss sums added over ranks (timings are rank 0's)."""
    terms = list(trajs[0].rewards)
    per_seq = torch.tensor([[len(t.completion_ids), t.finish_reason == "length", t.num_turns] + [t.rewards[k] for k in terms]
                            for t in trajs], dtype=torch.float64)  # (N, 3 + terms)
    per_seq = dist.all_gather_cat(torch.cat([rewards[:, None].double(), advantages[:, None].double(), per_seq], 1))
    rewards, advantages, lengths, truncated, turns = per_seq[:, :5].T
    zero_var = dist.all_gather_cat(zero_var.float())  # (B,)
    out = {
        "reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "advantage/mean": advantages.mean().item(), "advantage/abs_mean": advantages.abs().mean().item(),
        "completion/len": lengths.mean().item(), "completion/truncated": truncated.mean().item(),
        "completion/turns": turns.mean().item(), "zero_variance_groups": zero_var.float().mean().item(),
        "time/generate": t_gen, "time/update": t_update, "tokens_per_s": lengths.sum().item() / max(t_gen + t_update, 1e-9), "lr": lr,
    }
    for i, k in enumerate(terms):
        out[f"reward/{k}"] = per_seq[:, 5 + i].mean().item()
    if m:
        # m holds this rank's sums over micro-batches and iterations (grpo.loss.loss_metrics), tokens
        # too; grad_norm, skipped_updates and num_tokens are global already. The loss each rank
        # returns is scaled by world size (FSDP averages gradients), so the global loss is the mean.
        local = [k for k in m if k not in ("grad_norm", "skipped_updates", "num_tokens")]
        m = m | dict(zip(local, dist.all_sum(torch.tensor([m[k] for k in local], dtype=torch.float64)).tolist()))
        tokens = max(m["tokens"], 1.0)
        out |= {"loss": m["loss"] / cfg.num_iterations / dist.world_size(), "grad_norm": m["grad_norm"],
                "skipped_updates": m["skipped_updates"], "entropy": m["entropy"] * cfg.num_iterations / tokens,
                "update/sequences": m["sequences"]}
        for key in ("ratio", "clip_low", "clip_high", "dual_clip", "kl", "is_weight", "is_capped", "sampler_gap"):
            out[key] = m[key] / tokens
    if torch.cuda.is_available():
        out["memory/max_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


class Logger:
    """TensorBoard scalars and text, plus metrics.jsonl (one JSON object per step)."""
    def __init__(self, out_dir: str, purge_after: int | None = None):
        """`purge_after`: the step a resumed run continues from; what an interrupted run logged
        after it (steps it is about to redo) is dropped from both logs, so each step appears once."""
        from torch.utils.tensorboard import SummaryWriter
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        path = os.path.join(out_dir, "metrics.jsonl")
        if purge_after is not None and os.path.exists(path):
            rows = [r for r in open(path) if _logged_step(r) <= purge_after]
            open(path, "w").writelines(rows)
        self.tb = SummaryWriter(os.path.join(out_dir, "tb"), purge_step=None if purge_after is None else purge_after + 1)
        self.jsonl = open(os.path.join(out_dir, "metrics.jsonl"), "a")

    def log(self, metrics: dict, step: int):
        for k, v in metrics.items():
            self.tb.add_scalar(k, v, step)
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()  # nothing lost on a crash

    def text(self, tag: str, text: str, step: int):
        self.tb.add_text(tag, "```\n" + text + "\n```", step)

    def dump_jsonl(self, name: str, records: list):
        with open(os.path.join(self.out_dir, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)

    def close(self):
        self.tb.close()
        self.jsonl.close()


def _logged_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError):  # a line cut short by a crash
        return float("inf")
