"""The policy update with each group's prompt computed once (share_prompt) against one row per
sequence, side by side in one run: one optimizer step of grpo.update.policy_update on the same
trajectories, alternating the two settings, the best of --repeat kept for each.

    python bench/shared_prompt.py            # CPU: SmolLM2-135M, the CPU recipe's shapes (8 x G=6,
                                             # prompt 104, completions of 60-220 tokens), bf16 autocast
    python bench/shared_prompt.py --quick    # 2 x G=4, prompt 64, completions of 16-48 tokens

The trajectories are synthetic (random tokens, random advantages, no flat group): the update's
cost depends on their lengths only. Last line of output: json.dumps(rows).
"""
import argparse
import json
import time

import torch

from grpo.config import Config
from grpo.models.model import Transformer
from grpo.rollout import Trajectory
from grpo.update import policy_update, update_batches


def trajectories(V: int, P: int, G: int, plen: int, lo: int, hi: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(100, V, (n,), generator=g).tolist()  # noqa: E731
    out = []
    for k in range(P):
        prompt = ids(plen)
        for _ in range(G):
            C = int(torch.randint(lo, hi + 1, (), generator=g))
            out.append(Trajectory({}, k, prompt, ids(C), [1] * C, [0.0] * C, "stop", 1))
    return out


def timed_update(model, trajs, advantages, cfg) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every repeat sees the same weights
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    t = time.perf_counter()
    policy_update(model, None, optimizer, scheduler, trajs, advantages, cfg, "cpu")
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes")
    ap.add_argument("--repeat", type=int, default=3, help="timed updates per setting; the best is kept")
    args = ap.parse_args()
    from grpo.models.smollm2 import local_path
    P, G, plen, lo, hi = (2, 4, 64, 16, 48) if args.quick else (8, 6, 104, 60, 220)
    model = Transformer.from_pretrained(local_path()).train()
    model.autocast_bf16 = True  # as the CPU recipe
    trajs = trajectories(model.args.vocab_size, P, G, plen, lo, hi)
    advantages = torch.randn(len(trajs), generator=torch.Generator().manual_seed(1))
    rows = []
    for share in (False, True):
        cfg = Config(num_generations=G, prompts_per_step=P, loss_type="dr_grpo", micro_batch_tokens=4096,
                     max_prompt_length=plen, max_completion_length=hi, share_prompt=share)
        batches = update_batches(trajs, advantages, cfg, "cpu")
        tokens = sum((b["prompt_rows"] if share else b)["input_ids"].numel() for b in batches)
        rows.append(dict(share_prompt=share, cfg=cfg, tokens=tokens, micro_batches=len(batches), seconds=[]))
    timed_update(model, trajs, advantages, rows[0]["cfg"])  # warm-up
    for _ in range(args.repeat):
        for r in rows:
            r["seconds"].append(timed_update(model, trajs, advantages, r["cfg"]))
    base = min(rows[0]["seconds"])
    print(f"SmolLM2-135M, {P} prompts x G={G}, prompt {plen}, completions {lo}-{hi} tokens, "
          f"{torch.get_num_threads()} threads")
    print("| update | tokens forwarded (padding included) | micro-batches | seconds (best) | speed-up |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        best = min(r["seconds"])
        name = "prompt once per group (share_prompt)" if r["share_prompt"] else "one row per sequence"
        print(f"| {name} | {r['tokens']} | {r['micro_batches']} | {best:.2f} | {base / best:.2f}x |")
        r.pop("cfg")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
