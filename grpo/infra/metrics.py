"""What a run records: each step's metrics over the global batch, written to TensorBoard and
metrics.jsonl (one JSON object per step, flushed at once so a crash loses nothing)."""
import functools
import json
import math
import os

import torch

from grpo.infra import dist


def sequence_advantages(advantages, N: int):
    """(N,) or (N, C) advantages -> (N,) fp64 on CPU: per-token credit as the mean over the tokens
    that got any (0 for a sequence that got none)."""
    A = advantages.reshape(N, -1).double().cpu()
    return A.sum(1) / (A != 0).sum(1).clamp(min=1) if A.shape[1] > 1 else A[:, 0]


def step_metrics(trajs, rewards, advantages, flat, update: dict, t_gen: float, t_update: float,
                 lr: float) -> dict:
    """The step's metrics over the global batch: each rank holds B/world groups, so per-sequence
    numbers are gathered; `update` holds policy_update's global means (timings are rank 0's).
    rewards (N,) final rewards, advantages (N,) or (N, C), flat (N/G,) bool: flat groups."""
    terms = list(dict.fromkeys(k for t in trajs for k in t.rewards))
    nan = float("nan")  # a term that does not apply (None): left out of its mean, as TRL's nanmean
    per_seq = torch.tensor([[len(t.completion_ids), t.finish_reason == "length", t.num_turns]
                            + [nan if t.rewards.get(k) is None else t.rewards[k] for k in terms]
                            for t in trajs],
                           dtype=torch.float64)  # (N, 3 + terms)
    A = sequence_advantages(advantages, len(trajs))
    per_seq = dist.all_gather_cat(torch.cat([rewards[:, None].double().cpu(), A[:, None].cpu(), per_seq], 1))
    rewards, advantages, lengths, truncated, turns = per_seq[:, :5].T
    flat = dist.all_gather_cat(torch.as_tensor(flat, dtype=torch.float64))  # (groups,)
    G = max(len(rewards) // max(len(flat), 1), 1)
    # unscorable (NaN): left out of the reward's mean and std, as TRL's nanmean
    scored = rewards[~rewards.isnan()]
    out = {
        "reward/mean": scored.mean().item() if len(scored) else 0.0,
        "reward/std": scored.std().item() if len(scored) > 1 else 0.0,
        # completions every reward term was None for, and groups an infinite reward zeroed
        # (grpo.loss.group_advantages)
        "reward/unscorable": float(rewards.isnan().sum()),
        "reward/infinite_groups": float(rewards.isinf().view(-1, G).any(1).sum()),
        "advantage/mean": advantages.mean().item(), "advantage/abs_mean": advantages.abs().mean().item(),
        "completion/len": lengths.mean().item(), "completion/truncated": truncated.mean().item(),
        "completion/turns": turns.mean().item(), "flat_groups": flat.mean().item(),
        "time/generate": t_gen, "time/update": t_update,
        "tokens_per_s": lengths.sum().item() / max(t_gen + t_update, 1e-9), "lr": lr,
    }
    for i, k in enumerate(terms):
        applies = per_seq[:, 5 + i][~per_seq[:, 5 + i].isnan()]
        out[f"reward/{k}"] = applies.mean().item() if len(applies) else 0.0
        out[f"rewards/{k}/mean"] = out[f"reward/{k}"]                 # TRL's names for the same
        out[f"rewards/{k}/std"] = applies.std().item() if len(applies) > 1 else 0.0
    out |= {k: v for k, v in update.items() if k not in ("sequences", "tokens", "num_tokens")}
    out["update/sequences"] = update.get("sequences", 0.0)
    if torch.cuda.is_available():
        out["memory/max_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out | trl_aliases(out, lengths)


# our metric -> TRL GRPOTrainer's name for it (logged under both: a TRL user's dashboards find theirs)
TRL_ALIASES = {"reward/mean": "reward", "flat_groups": "frac_reward_zero_std",
               "completion/len": "completions/mean_length",
               "completion/truncated": "completions/clipped_ratio",
               "clip_low": "clip_ratio/low_mean", "clip_high": "clip_ratio/high_mean", "lr": "learning_rate",
               "sampler_gap": "sampling/sampling_logp_difference/mean",
               "is_weight": "sampling/importance_sampling_ratio/mean"}


def trl_aliases(out: dict, lengths) -> dict:
    """TRL's names for our step metrics; TRL's `reward_std` is the batch's (nanstd), our reward/std."""
    aliases = {trl: out[ours] for ours, trl in TRL_ALIASES.items() if ours in out}
    if "clip_low" in out and "clip_high" in out:
        aliases["clip_ratio/region_mean"] = out["clip_low"] + out["clip_high"]  # disjoint: A < 0 or A > 0
    return aliases | {"reward_std": out["reward/std"], "completions/min_length": lengths.min().item(),
                      "completions/max_length": lengths.max().item()}


def credit_metrics(credit, t_gen: float, t_credit: float) -> dict:
    """A per-token credit's costs (grpo.process.ProcessCredit.stats), rank 0's, and the share of
    the step's sampling time it took (its continuations vs the rollouts)."""
    if credit is None:
        return {}
    stats = getattr(credit, "stats", None) or {}
    return {f"credit/{k}": float(v) for k, v in stats.items()} | \
        {"credit/seconds": t_credit, "credit/time_share": t_credit / max(t_gen + t_credit, 1e-9)}


def rollout_records(trajs, rewards, advantages, tokenizer) -> list[dict]:
    """One JSON-able record per trajectory of this rank: what the step trained on."""
    out = []
    for t, r, a in zip(trajs, rewards.tolist(), sequence_advantages(advantages, len(trajs)).tolist()):
        out.append({"prompt_index": t.prompt_index, "prompt": tokenizer.decode(t.prompt_ids),
                    "completion": t.text, "rewards": t.rewards, "reward": None if math.isnan(r) else r,
                    "advantage": a,
                    "finish_reason": t.finish_reason, "turns": t.num_turns, "tokens": len(t.completion_ids)})
    return out


class Logger:
    """TensorBoard scalars and text, plus metrics.jsonl (one JSON object per row). Rows form series
    (series() below): the warm-start's, one per eval, and the RL steps'; the warm-start's scalars go
    to their own TensorBoard run (tb/warmstart), since its steps 0..sft_steps-1 overlap RL's."""
    def __init__(self, out_dir: str, resumed_at: int | None = None, evals_done=(), tensorboard: bool = True,
                 trackers=()):
        """A run that continues an interrupted one drops what it is about to log again, per series,
        so each row appears once. `resumed_at`: the checkpoint's step; its warm-start (if any) and
        the evals in `evals_done` are kept, RL rows up to that step are kept. None: nothing is
        kept (a fresh run, or a --resume that found no checkpoint and starts over).
        `tensorboard`: write output_dir/tb; `trackers`: more (grpo.infra.report.open_trackers), each
        with log(metrics, step) and close()."""
        from torch.utils.tensorboard import SummaryWriter
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir = out_dir
        path = os.path.join(out_dir, "metrics.jsonl")
        if os.path.exists(path):
            keep = functools.partial(_kept, resumed_at=resumed_at, evals_done=set(evals_done))
            rows = [r for r in open(path) if keep(r)]
            with open(path, "w") as f:
                f.writelines(rows)
        # TensorBoard hides what a run logged at or after purge_step (all tags of one run folder)
        purge = 0 if resumed_at is None else resumed_at + 1
        self._writer = lambda sub: SummaryWriter(os.path.join(out_dir, *sub), purge_step=purge)
        self.tb = self._writer(["tb"]) if tensorboard else None
        self.trackers = list(trackers)
        self.tb_warmstart = None  # made at the warm-start's first row: a resumed run never has one
        self.jsonl = open(path, "a")

    def log(self, metrics: dict, step: int):
        if series(metrics) == "sft" and self.tb is not None:
            self.tb_warmstart = self.tb_warmstart or self._writer(["tb", "warmstart"])
        tb = self.tb_warmstart if series(metrics) == "sft" else self.tb
        for k, v in metrics.items() if tb is not None else ():
            tb.add_scalar(k, v, step)
        for tracker in self.trackers:
            tracker.log(metrics, step)
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()  # nothing lost on a crash

    def text(self, tag: str, text: str, step: int):
        if self.tb is not None:
            self.tb.add_text(tag, "```\n" + text + "\n```", step)

    def rollouts(self, records: list[dict], step: int, shown: int = 4):
        """rollouts/step_N.jsonl with every record, and a TensorBoard table of the first few."""
        os.makedirs(os.path.join(self.out_dir, "rollouts"), exist_ok=True)
        self.dump_jsonl(os.path.join("rollouts", f"step_{step:06d}.jsonl"), records)
        cell = lambda x: str(x).replace("|", "\\|").replace("\n", "<br>")   # noqa: E731  markdown table cell
        terms = list(records[0]["rewards"]) if records else []
        rows = [f"| completion | reward | {' | '.join(terms)} | advantage | finish |",
                "|" + " --- |" * (len(terms) + 4)]
        rows += [f"| {cell(r['completion'][-600:])} | {r['reward']:.3f} | "
                 + " | ".join("n/a" if r["rewards"].get(k) is None else f"{r['rewards'][k]:.3f}"
                              for k in terms)
                 + f" | {r['advantage']:+.3f} | {r['finish_reason']} |" for r in records[:shown]]
        if self.tb is not None:
            self.tb.add_text("rollouts", "\n".join(rows), step)

    def dump_jsonl(self, name: str, records: list):
        with open(os.path.join(self.out_dir, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)

    def close(self):
        for tb in (self.tb, self.tb_warmstart):
            if tb is not None:
                tb.close()
        for tracker in self.trackers:
            tracker.close()
        self.jsonl.close()


def series(row: dict) -> str:
    """"sft" (the warm-start: sft/* only), "eval/<name>" (one eval), or "rl" (a step's metrics)."""
    keys = [k for k in row if k != "step"]
    if keys and all(k.startswith("sft/") for k in keys):
        return "sft"
    if keys and all(k.startswith("eval/") for k in keys):
        return "/".join(keys[0].split("/")[:2])
    return "rl"


def _kept(line: str, resumed_at: int | None, evals_done: set) -> bool:
    """Does a resumed run keep this metrics.jsonl line (see Logger)?"""
    try:
        row = json.loads(line)
        step = row["step"]
    except (ValueError, KeyError, TypeError):  # a line cut short by a crash
        return False
    if resumed_at is None:
        return False
    kind = series(row)
    if kind == "sft":
        return True  # every checkpoint comes after the warm-start
    if kind.startswith("eval/"):
        return kind[len("eval/"):] in evals_done  # the rest will run again
    return step <= resumed_at
