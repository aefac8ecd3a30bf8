"""Accuracy of a model on an env's questions: mean@k and pass@k with 95% intervals.

    evaluate(model, tokenizer, env, examples, n=4, temperature=1.0) -> {mean, ci95, pass, records, ...}
The library behind the trainer's evals and `python -m grpo.cli.eval`, its command line (tasks, data
and a run's recipe live there, so that this module needs no env and never imports its command line).
"""
import sys

import torch

from grpo.env import as_env
from grpo.infra.stats import mean_ci95
from grpo.rollout import assign_rewards, rollout, sampling_params


@torch.no_grad()
def evaluate(model, tokenizer, env, examples: list[dict], n: int = 1, temperature: float = 0.0,
             max_tokens: int = 512, max_turns: int = 0, sampler=None, chat_kwargs: dict | None = None,
             seed: int = 1234, gen_batch: int = 64, kv_budget_bytes: int | None = None, progress: bool = True,
             prompt_offset: int = 0, cuda_graphs: bool = True, max_turn_tokens: int = 0) -> dict:
    """Run the env on `examples` with n samples each (temperature 0 = greedy). The score is the
    env's `correct` reward term (or the one its `score_term` names). Returns mean (mean@n),
    pass (pass@n), ci95 and per-sample records.
    `prompt_offset`: the global index of examples[0] (it seeds the samples), so that a share of
    the questions evaluated on one rank gives what the whole list gives in one process.
    `cuda_graphs`: for the sampler made here (a lent one keeps its own)."""
    from grpo.engine.sampler import Sampler
    # a sampler sized to this call unless the caller lends its own
    sampler = sampler or Sampler(model, tokenizer, gen_batch=gen_batch, kv_budget_bytes=kv_budget_bytes,
                                 cuda_graphs=cuda_graphs)
    params = sampling_params(env, tokenizer, n, temperature, max_tokens, seed, max_turns=max_turns,
                             max_turn_tokens=max_turn_tokens)
    trajs = assign_rewards(env, rollout(sampler, tokenizer, env, list(examples), params,
                                        prompt_offset=prompt_offset, chat_kwargs=chat_kwargs,
                                        progress=progress))
    failed = [t for t in trajs if t.finish_reason == "error"]
    if failed:  # a refused prompt would silently score 0: an accuracy must not hide that
        raise RuntimeError(f"eval: {len(failed)} of {len(trajs)} completions failed in the sampler "
                           f"(e.g. a prompt longer than the KV cache allows); see the messages above")
    records, term = [], as_env(env).score_term
    for q, ex in enumerate(examples):
        for t in trajs[q * n:(q + 1) * n]:
            records.append({"question": ex.get("question", ex.get("prompt", "")),
                            "answer": str(ex.get("answer")), "completion": t.text,
                            "extracted": as_env(env).extract(t),
                            "correct": t.rewards.get(term) or 0.0, "rewards": t.rewards,
                            "finish_reason": t.finish_reason, "turns": t.num_turns})
    return summarize(records, n) | {"records": records}


def summarize(records: list[dict], n: int) -> dict:
    """mean@n, pass@n and their intervals from per-sample records, n consecutive per question."""
    per_question = [sum(r["correct"] for r in records[q:q + n]) / n for q in range(0, len(records), n)]
    passed = [float(max(r["correct"] for r in records[q:q + n]) > 0) for q in range(0, len(records), n)]
    mean, ci = mean_ci95(per_question)
    pass_k, pass_ci = mean_ci95(passed)
    return {"mean": mean, "ci95": ci, "pass": pass_k, "pass_ci95": pass_ci, "n": n,
            "questions": len(per_question),
            "per_question": per_question}  # mean over each question's n samples: what paired_gain pairs


def run_eval_settings(cfg, greedy: bool = False) -> dict:
    """evaluate()'s settings from a run's config: the trainer's evals and `--run` use this one
    mapping, so a run evaluated again is evaluated as it evaluated itself. `greedy`: the
    one-sample greedy protocol that `eval_greedy` adds beside the sampled one."""
    n, temperature = (1, 0.0) if greedy else (cfg.eval_n, cfg.eval_temperature)
    max_tokens = getattr(cfg, "eval_max_completion_length", 0) or cfg.max_completion_length
    return dict(n=n, temperature=temperature, max_tokens=max_tokens, max_turns=cfg.max_turns,
                max_turn_tokens=getattr(cfg, "eval_turn_tokens", 0),
                chat_kwargs={"enable_thinking": cfg.enable_thinking},
                gen_batch=cfg.gen_batch, kv_budget_bytes=int(cfg.kv_budget_gb * 2**30) or None)


if __name__ == "__main__":  # the command line is grpo/cli/eval.py: say so, rather than run nothing
    print("python -m grpo.eval is a library: the command is python -m grpo.cli.eval", file=sys.stderr)
    sys.exit(2)
