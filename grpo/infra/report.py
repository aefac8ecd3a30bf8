"""What a run reports beyond metrics.jsonl: the trackers of `report_to`, and the summary at its end.

Trackers (each an optional install; all of them run without a network):
- tensorboard: output_dir/tb (grpo.infra.metrics.Logger; always installed);
- wandb (`pip install wandb`): offline unless WANDB_MODE says otherwise, into output_dir/wandb
  (`wandb sync output_dir/wandb/offline-run-*` uploads it later); project WANDB_PROJECT or "grpo";
- trackio (`pip install trackio`): a local database (TRACKIO_DIR, default ~/.cache/huggingface/trackio),
  project TRACKIO_PROJECT or "grpo"; `trackio show` opens it.
The summary: before / after (and warm-start) eval means with 95% intervals, the paired gain
after - before on the same questions, steps, time and the export path, printed and written to
output_dir/summary.json.
"""
import dataclasses
import importlib.util
import json
import math
import os
from types import SimpleNamespace

from grpo.config import REPORTERS
from grpo.infra.stats import paired_gain


def reporters(report_to: str) -> list[str]:
    names = [r.strip() for r in report_to.split(",") if r.strip()]
    if "all" in names:
        return [r for r in REPORTERS if r == "tensorboard" or importlib.util.find_spec(r) is not None]
    return [r for r in names if r != "none"]


def check_reporters(report_to: str):
    """Before the model loads: each named tracker is installed."""
    for name in reporters(report_to):
        if importlib.util.find_spec(name) is None:
            raise ValueError(f"report_to={name}: the package is not installed (pip install {name}, "
                             f"or pip install 'grpo[{name}]')")


def open_trackers(cfg, resumed: bool) -> list:
    """Rank 0: the trackers of cfg.report_to beyond TensorBoard (which grpo.infra.metrics.Logger writes),
    each with log(metrics, step) and close()."""
    out, run_name = [], os.path.basename(os.path.abspath(cfg.output_dir))
    config = {k: v for k, v in dataclasses.asdict(cfg).items()
              if isinstance(v, (str, int, float, bool, type(None)))}
    names = reporters(cfg.report_to)
    if "wandb" in names:
        import wandb
        # one wandb run per output folder, so that a --resume continues it
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "grpo"), name=run_name, dir=cfg.output_dir,
                         config=config, mode=os.environ.get("WANDB_MODE", "offline"), resume="allow",
                         id=_run_id(cfg.output_dir))
        out.append(SimpleNamespace(log=lambda m, step: run.log(m, step=step), close=run.finish))
    if "trackio" in names:
        import trackio
        trackio.init(project=os.environ.get("TRACKIO_PROJECT", "grpo"), name=run_name, config=config,
                     resume="allow" if resumed else "never")
        out.append(SimpleNamespace(log=lambda m, step: trackio.log(m, step=step), close=trackio.finish))
    return out


def _run_id(out_dir: str) -> str:
    """A stable id per output folder (wandb ids: letters, digits, - and _)."""
    import hashlib
    return "grpo-" + hashlib.sha1(os.path.abspath(out_dir).encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------- the end of a run

def summary(results: dict, steps: int, seconds: float, export_path: str | None) -> dict:
    """The run in one record: each eval's mean with its interval, the paired gains over the eval
    before (the same questions, where both have them), steps, minutes, the export."""
    evals = {name: {k: r[k] for k in ("mean", "ci95", "pass", "n", "questions") if k in r}
             for name, r in results.items() if name != "sampler_gap"}
    gains = {}
    before = results.get("before", {}).get("per_question")
    for name in ("warmstart", "after"):
        after = results.get(name, {}).get("per_question")
        if before and after:
            k = min(len(before), len(after))  # the eval before may be shorter (eval_before_limit)
            gain, ci = paired_gain(before[:k], after[:k])
            gains[f"{name} - before"] = {"gain": gain, "ci95": ci, "questions": k}
    return {"evals": evals, "gains": gains, "steps": steps, "minutes": seconds / 60, "export": export_path,
            "sampler_gap": results.get("sampler_gap")}


def summary_lines(s: dict) -> list[str]:
    lines = [f"run: {s['steps']} steps in {s['minutes']:.1f} min"]
    for name, r in s["evals"].items():
        lines.append(f"  eval {name}: mean@{r.get('n', 1)} {r['mean']:.3f} ± {r['ci95']:.3f} "
                     f"({r.get('questions', '?')} questions)")
    for name, g in s["gains"].items():
        significant = "" if math.isnan(g["ci95"]) or abs(g["gain"]) <= g["ci95"] else " (past the interval)"
        lines.append(f"  gain {name}: {g['gain']:+.3f} ± {g['ci95']:.3f}, paired over {g['questions']} "
                     f"questions{significant}")
    gap = s.get("sampler_gap")
    if gap:  # how far the update's old log-probs were from the sampler's: ~1e-6 in fp32, exactly on-policy
        lines.append(f"  sampler-trainer gap: mean {gap['mean']:.2e}, max {gap['max']:.2e} |log-prob| over "
                     f"{gap['tokens']:.0f} sampled tokens")
    lines.append(f"  export: {s['export']}" if s["export"] else "  export: none (--export false, or stopped)")
    return lines


def write_summary(out_dir: str, results: dict, steps: int, seconds: float, export_path: str | None) -> dict:
    """Rank 0: print the summary and write output_dir/summary.json."""
    s = summary(results, steps, seconds, export_path)
    path = os.path.join(out_dir, "summary.json")
    with open(path, "w") as f:
        json.dump(s, f, indent=2)
    print("\n".join(summary_lines(s) + [f"  summary: {path}"]), flush=True)
    return s
