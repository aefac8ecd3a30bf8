"""ProcessGRPO's Monte Carlo continuations, two ways: every boundary prefix re-prefilled as its
own prompt (`Sampler.generate` on the prefixes, what grpo/process.py did before), or each
solution prefilled once and its KV forked at every boundary (`Sampler.continue_from`).

    python bench/process.py            # SmolLM2-135M fp32: 4 solutions x 6 boundaries x K=8, 64 new
    python bench/process.py --quick    # 2 solutions x 3 boundaries x K=4, 16 new tokens
    python bench/process.py --device cuda

Solutions: --solution greedy tokens of SmolLM2 per math prompt (no early stop), boundaries
evenly spaced from 0 (before the first step) to the last step. Continuations run without early
stop, so both ways decode the same number of tokens; with the same seeds they are the same
tokens (checked, the `same` column). Prefill time = a run with 1 new token (prefill, fork and
the first sampled token); total = a run with --new tokens. Slots: the sampler's default
(64), so later boundaries of a solution may find no live row to fork from and prefill again
(counted in prefill tokens).
"""
import argparse
import json
import time

import torch
import transformers

from grpo.models.model import Transformer
from grpo.engine.sampler import Sampler, SamplingParams
from grpo.models.smollm2 import local_path

QUESTIONS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether in April and May? Reason step by step.",
             "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total "
             "does it take? Explain each step.",
             "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How "
             "much did she earn? Show your work.",
             "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write "
             "a year? Think it through step by step."]


def timed(fn, device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, out


def run(model, sequences, cuts, K, new, gen_batch, fork: bool, device, reps: int):
    """(prefill s, total s, prefill tokens of the total run, completions): best of `reps`."""
    def go(k):
        sampler = Sampler(model, gen_batch=gen_batch)
        p = SamplingParams(n=K, temperature=1.0, max_tokens=k, stop_token_ids=[], seed=0)
        if fork:
            out = sampler.continue_from(sequences, cuts, p)
        else:
            out = sampler.generate([x[:c] for x, cs in zip(sequences, cuts) for c in cs], p)
        return sampler.tokens_prefilled, out
    go(2)  # warm-up
    t_pre = min(timed(lambda: go(1), device)[0] for _ in range(reps))
    runs = [timed(lambda: go(new), device) for _ in range(reps)]
    t_all, (tokens, out) = min(runs, key=lambda r: r[0])
    return t_pre, t_all, tokens, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="2 solutions x 3 boundaries x K=4, 16 new tokens")
    ap.add_argument("--solution", type=int, default=256, help="solution tokens")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gen_batch", type=int, default=64, help="sampler slots")
    ap.add_argument("--repeat", type=int, default=1, help="time each run this many times, keep the best")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    N, S, K, new = (2, 3, 4, 16) if args.quick else (4, 6, 8, 64)
    device = torch.device(args.device)
    path = local_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = Transformer.from_pretrained(path, device=device)
    chat = [[{"role": "user", "content": q}] for q in QUESTIONS[:N]]
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True)["input_ids"] for m in chat]
    sols = Sampler(model).generate(prompts, SamplingParams(temperature=0, max_tokens=args.solution,
                                                           stop_token_ids=[]))
    sequences = [p + c.token_ids for p, c in zip(prompts, sols)]
    cuts = [[len(p) + args.solution * k // S for k in range(S)] for p in prompts]  # boundaries 0 .. S-1

    rows = []
    for mode, fork in (("re-prefill", False), ("fork", True)):
        t_pre, t_all, tokens, out = run(model, sequences, cuts, K, new, args.gen_batch, fork, device,
                                        args.repeat)
        rows.append(dict(mode=mode, solutions=N, boundaries=N * S, K=K, new=new, prefill_tokens=tokens,
                         prefill_s=t_pre, total_s=t_all, prefill_share=t_pre / t_all, out=out))
    base, fork = rows
    same = all(a.token_ids == b.token_ids for a, b in zip(base.pop("out"), fork.pop("out")))
    for r in rows:
        r["same"] = same
    ratio = {c: base[c] / fork[c] for c in ("prefill_tokens", "prefill_s", "total_s")}
    rows.append(dict(mode="x (re-prefill / fork)", **ratio))
    cols = ["mode", "solutions", "boundaries", "K", "new", "prefill_tokens", "prefill_s", "total_s",
            "prefill_share", "same"]
    print(f"SmolLM2-135M fp32 on {device}, {args.solution}-token solutions, prompts "
          f"{[len(p) for p in prompts]} tokens, {args.gen_batch} slots")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, ""))
                                for c in cols) + " |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
