"""What a run says as it goes (grpo.trainer's loop): each step's metrics to the logs and its line on rank
0, the step's rollouts every log_completions_steps, and the sampler-trainer gap so far, kept with the
eval results (a checkpoint holds it; summary.json reports it)."""
from grpo.config import Config
from grpo.infra import dist
from grpo.infra.metrics import Logger, rollout_records


def log_step(logger: Logger | None, cfg: Config, tokenizer, steps_done: int, metrics: dict, seconds: float,
             bar, batch: tuple):
    """The step's metrics to rank 0's logs (`logger`; None on the other ranks), its line on rank 0, and
    every log_completions_steps the step's rollouts (`batch`: trajectories, rewards, advantages; all
    ranks', gathered to rank 0)."""
    if logger:
        logger.log(metrics, steps_done)
    m = metrics
    bar.set_postfix(reward=f"{m['reward/mean']:.3f}", len=f"{m['completion/len']:.0f}")
    dist.print0(f"step {steps_done} | reward {m['reward/mean']:.3f} | len {m['completion/len']:.0f} | "
                f"loss {m['loss']:.4f} | gap {m['sampler_gap']:.2e} | {seconds:.1f}s")
    if cfg.log_completions_steps and steps_done % cfg.log_completions_steps == 0:
        records = dist.all_gather_objects(rollout_records(*batch, tokenizer))
        if logger:
            logger.rollouts(records, steps_done)


def track_gap(results: dict, update: dict):
    """The run's sampler-trainer gap, |old log-prob - the sampler's| over every sampled token so far
    (mean and max), kept in `results` beside the evals' from the update's own (grpo.update.policy_update)."""
    g = results.setdefault("sampler_gap", {"mean": 0.0, "max": 0.0, "tokens": 0.0})
    n = update["tokens"]
    g["mean"] = (g["mean"] * g["tokens"] + update["sampler_gap"] * n) / max(g["tokens"] + n, 1.0)
    g["max"], g["tokens"] = max(g["max"], update["sampler_gap_max"]), g["tokens"] + n
