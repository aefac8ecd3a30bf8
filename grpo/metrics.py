"""What a run records: each step's metrics over the global batch, written to TensorBoard and
metrics.jsonl (one JSON object per step, flushed at once so a crash loses nothing)."""
import json
import os

import torch

from grpo import dist


def step_metrics(trajs, rewards, advantages, flat, update: dict, t_gen: float, t_update: float,
                 lr: float) -> dict:
    """The step's metrics over the global batch: each rank holds B/world groups, so per-sequence
    numbers are gathered; `update` holds policy_update's global means (timings are rank 0's).
    rewards (N,) final rewards, advantages (N,) or (N, C), flat (N/G,) bool: flat groups."""
    terms = list(trajs[0].rewards)
    per_seq = torch.tensor([[len(t.completion_ids), t.finish_reason == "length", t.num_turns]
                            + [t.rewards[k] for k in terms] for t in trajs],
                           dtype=torch.float64)  # (N, 3 + terms)
    A = advantages.reshape(len(trajs), -1).double()
    A = A.sum(1) / (A != 0).sum(1).clamp(min=1) if A.shape[1] > 1 else A[:, 0]   # (N,) mean nonzero credit
    per_seq = dist.all_gather_cat(torch.cat([rewards[:, None].double().cpu(), A[:, None].cpu(), per_seq], 1))
    rewards, advantages, lengths, truncated, turns = per_seq[:, :5].T
    flat = dist.all_gather_cat(torch.as_tensor(flat, dtype=torch.float64))  # (groups,)
    out = {
        "reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
        "advantage/mean": advantages.mean().item(), "advantage/abs_mean": advantages.abs().mean().item(),
        "completion/len": lengths.mean().item(), "completion/truncated": truncated.mean().item(),
        "completion/turns": turns.mean().item(), "flat_groups": flat.mean().item(),
        "time/generate": t_gen, "time/update": t_update,
        "tokens_per_s": lengths.sum().item() / max(t_gen + t_update, 1e-9), "lr": lr,
    }
    for i, k in enumerate(terms):
        out[f"reward/{k}"] = per_seq[:, 5 + i].mean().item()
    out |= {k: v for k, v in update.items() if k not in ("sequences", "tokens", "num_tokens")}
    out["update/sequences"] = update.get("sequences", 0.0)
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
        self.tb = SummaryWriter(os.path.join(out_dir, "tb"),
                                purge_step=None if purge_after is None else purge_after + 1)
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
