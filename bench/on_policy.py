"""On-policy costs and checks on SmolLM2-135M, on this CPU, in one process (docs/on_policy.md).

    python bench/on_policy.py            # 48 rows x 64 tokens; --quick: 8 rows x 16 tokens
    python bench/on_policy.py --threads 1

Table 1, decode with LoRA adapters against without, at the same rows and tokens: in fp32 (decode's
weights packed for oneDNN, the adapters merged into them once a call) and under autocast_bf16 (a bf16
copy, the adapters applied unmerged: two small GEMMs more per adapted GEMM). Sampler.generate at T 1
with no stop; best of --reps, the three models taking turns in each.
Table 2, the importance ratio of an unchanged policy: rollouts at T 1 under top-p / top-k / min-p, then
the update's old log-probs over the same tokens, scored over the sampler's kept set (ours) and over the
full vocabulary (TRL's rule): mean ratio exp(old - sampler), the share of tokens outside [0.9, 1.1],
and the mean |gap|, against the sampler's own log-probs of the kept set.
"""
import argparse
import time

import torch

from grpo.models import lora
from grpo.config import Config, parse_targets
from grpo.fit.precision import cpu_name
from grpo.envs.calculator import SHORT_SYSTEM_PROMPT, CalculatorEnv, generate_questions
from grpo.models.model import Transformer
from grpo.rollout import Trajectory, render_prompt
from grpo.engine.sampler import Sampler, SamplingParams
from grpo.models.smollm2 import local_path
from grpo.update import batch_logprobs, update_batches
from table import print_table  # bench/table.py


def prompts_of(tokenizer, k: int) -> list[list[int]]:
    env = CalculatorEnv(system_prompt=SHORT_SYSTEM_PROMPT)
    return [render_prompt(tokenizer, env.prompt(ex)) for ex in generate_questions(k, seed=0)]


def model_with(adapters: str, autocast: bool) -> Transformer:
    model = Transformer.from_pretrained(local_path()).eval()
    if adapters != "none":
        lora.add_lora(model, lora.LoraSettings(r=16, alpha=32, dropout=0.0, targets=parse_targets(adapters)))
        with torch.no_grad():
            for m in lora.adapters(model):
                m.lora_B.normal_(0, 1e-3)  # moved adapters: B starts at zero, where a merge would be free
    if autocast:
        model.autocast_bf16 = True
        if adapters != "none":
            lora.cast_base(model, torch.bfloat16)  # as the trainer does: the frozen base in the matmuls' dtype
    return model


def decode_seconds(models: list, prompts, n: int, new: int, reps: int) -> list[float]:
    """Best-of-reps seconds of one generate() call per model, the models taking turns within each rep (a
    shared machine's load then falls on all of them alike)."""
    samplers = [Sampler(m) for m in models]
    params = SamplingParams(n=n, temperature=1.0, max_tokens=new, stop_token_ids=[], seed=0)
    for s in samplers:
        s.generate(prompts, params)  # warm: the cache, packs, autocast's casts
    times = [[] for _ in samplers]
    for _ in range(reps):
        for s, ts in zip(samplers, times):
            t = time.perf_counter()
            s.generate(prompts, params)
            ts.append(time.perf_counter() - t)
    return [min(ts) for ts in times]


def ratio_rows(tokenizer, prompts, n: int, new: int) -> list[dict]:
    model = Transformer.from_pretrained(local_path()).eval()
    rows = []
    for name, f in [("top_p 0.8", dict(top_p=0.8)), ("top_k 20", dict(top_k=20)), ("min_p 0.1", dict(min_p=0.1)),
                    ("all three", dict(top_p=0.8, top_k=20, min_p=0.1))]:
        out = Sampler(model).generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=new, seed=1, **f))
        trajs = [Trajectory({}, c.prompt_index, prompts[c.prompt_index], c.token_ids, c.loss_mask, c.logprobs,
                            c.finish_reason, c.num_turns, kept_thresholds=c.thresholds) for c in out]
        for scored in ("kept set", "full vocabulary"):
            if scored == "full vocabulary":
                for t in trajs:
                    t.kept_thresholds = []
            batches = update_batches(trajs, torch.ones(len(trajs)), Config(micro_batch_tokens=4096), "cpu")
            old = batch_logprobs(model, batches, 1.0)
            mask = [b["loss_mask"].bool() for b in batches]
            diff = torch.cat([o[m] - b["sampler_logprobs"][m] for o, b, m in zip(old, batches, mask)])
            ratio = diff.exp()
            rows.append({"filter": name, "scored over": scored, "tokens": len(diff),
                         "mean ratio": f"{ratio.mean().item():.4f}",
                         "outside [0.9, 1.1]": f"{((ratio < 0.9) | (ratio > 1.1)).float().mean().item():.1%}",
                         "mean |gap|": f"{diff.abs().mean().item():.1e}"})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=6, help="samples per prompt")
    ap.add_argument("--new", type=int, default=64, help="tokens each row decodes")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--table", type=int, choices=(0, 1, 2), default=0, help="0: both tables; 1 or 2: that one")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.n, args.new, args.reps = 2, 4, 16, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{cpu_name()} | {torch.backends.cpu.get_cpu_capability()} | {torch.get_num_threads()} threads | "
          f"torch {torch.__version__}")
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(local_path())
    prompts = prompts_of(tokenizer, args.prompts)
    rows = []
    tokens = len(prompts) * args.n * args.new
    for autocast in (False, True) if args.table != 2 else ():
        variants = ("none", "q_proj,v_proj", "all-linear")
        base, *others = decode_seconds([model_with(v, autocast) for v in variants], prompts, args.n, args.new,
                                       args.reps)
        for adapters, t in zip(variants[1:], others):
            rows.append({"matmuls": "bf16 (autocast)" if autocast else "fp32", "adapters (r 16)": adapters,
                         "rows": len(prompts) * args.n, "tok/s without": f"{tokens / base:.0f}",
                         "tok/s with": f"{tokens / t:.0f}", "with / without time": f"{t / base:.2f}x"})
    if rows:
        print_table(rows, list(rows[0]))
    if args.table != 1:
        ratios = ratio_rows(tokenizer, prompts, args.n, args.new)
        print_table(ratios, list(ratios[0]))


if __name__ == "__main__":
    main()
