"""Benchmark: a multi-turn rollout with real sandboxed tool calls, the sampler running each call
in its thread pool while the other rows keep decoding ("overlapped"), against the same rollout
with every call run inline, the decode loop waiting for it ("in series").

Workload: SmolLM2-135M (fp32, CPU), the ReTool env with a two-shot prompt in Qwen3-2507's tool
layout (grpo.envs.retool_small), P questions x G samples at T 0.7, up to 160 tokens, and a tool
call that sleeps `--tool_s` seconds on top of its real run (model-written scripts that import
sympy take ~0.5 s; the default 0.5 s stands for that). Both modes draw the same tokens (seeded
per request), so they do the same work and only the waiting differs.

    python bench/tool_overlap.py [--prompts 4] [--samples 8] [--tool_s 0.5]

Last line of output: json.dumps(rows).
"""
import argparse
import concurrent.futures as cf
import json
import time

import torch
from transformers import AutoTokenizer

from grpo.envs.retool_small import QWEN3_TOOLS_TEMPLATE, TwoShotReTool
from grpo.envs.sandbox import run_code
from grpo.models.model import Transformer
from grpo.rollout import rollout, sampling_params
from grpo.engine.sampler import Sampler
from grpo.models.smollm2 import local_path


class Inline(cf.Executor):
    """Runs a submitted call at once, in the caller's thread: the decode loop waits for it."""
    def submit(self, fn, *args, **kwargs):
        future = cf.Future()
        future.set_result(fn(*args, **kwargs))
        return future


def run(model, tok, env, examples, params, inline: bool) -> tuple[float, list]:
    sampler = Sampler(model, tok, gen_batch=len(examples) * params.n)
    if inline:
        sampler.scheduler.pool = Inline()
    t = time.perf_counter()
    trajs = rollout(sampler, tok, env, examples, params)
    return time.perf_counter() - t, trajs


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tool_s", type=float, default=0.5, help="extra seconds per tool call")
    args = p.parse_args()
    torch.manual_seed(0)
    path = local_path()
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = QWEN3_TOOLS_TEMPLATE
    model = Transformer.from_pretrained(path).eval()
    env = TwoShotReTool(run_code=lambda code, timeout: (time.sleep(args.tool_s), run_code(code, timeout))[1])
    examples = [{"question": f"What is {a} to the power {b}?", "answer": str(a ** b)}
                for a, b in [(3, 4), (7, 2), (2, 9), (6, 3), (4, 5), (9, 2)][:args.prompts]]
    params = sampling_params(env, tok, args.samples, 0.7, 160, seed=0, max_turns=3)
    rows = []
    results = {}
    for name, inline in [("in series (inline tool calls)", True), ("overlapped (tool thread pool)", False)]:
        seconds, trajs = run(model, tok, env, examples, params, inline)
        results[name] = trajs
        calls = sum(len(t.observations) for t in trajs)
        tokens = sum(sum(t.loss_mask) for t in trajs)
        rows.append(dict(mode=name, rows=len(trajs), tool_calls=calls, sampled_tokens=tokens, seconds=seconds))
    same = [a.completion_ids for a in results[rows[0]["mode"]]] == [b.completion_ids for b in results[rows[1]["mode"]]]
    base = rows[0]["seconds"]
    print(f"| mode | rows | tool calls | sampled tokens | s | x |   (same tokens in both: {same})")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        r["x"] = base / r["seconds"]
        print(f"| {r['mode']} | {r['rows']} | {r['tool_calls']} | {r['sampled_tokens']} | {r['seconds']:.1f} | "
              f"{r['x']:.2f} |")
    print(json.dumps(rows))
