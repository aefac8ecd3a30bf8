"""Benchmark: latency of one sandboxed call, grpo.envs.sandbox's pool against a fresh interpreter per call.

Rows:
- pool, calls apart: a call every `--gap` s, so the pool has refilled, as tool calls come during a rollout
- pool, back to back: calls as fast as they return; workers start no faster than an interpreter
- fresh python -c: `python -c CODE` per call, no isolation at all (the baseline: x = its p50 / the row's)
- fresh isolated: the same namespaces as the pool (`unshare ... python -I -c CODE`), started per call

    python bench/sandbox.py [--calls 100] [--gap 0.2]

Last line of output: json.dumps(rows).
"""
import argparse
import json
import subprocess
import sys
import time

import numpy as np

from grpo.envs.sandbox import ENV, Sandbox, namespaces

CODE = "print(sum(i * i for i in range(1000)))"


def timed(call, calls: int, gap: float = 0.0) -> list[float]:
    ms = []
    for _ in range(calls):
        time.sleep(gap)
        t = time.perf_counter()
        assert call().strip() == "332833500"
        ms.append((time.perf_counter() - t) * 1e3)
    return ms


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--gap", type=float, default=0.2, help="seconds between calls in the first row")
    args = p.parse_args()
    prefix = namespaces()[0] or []
    fresh = lambda argv: subprocess.run(argv, capture_output=True, text=True, env=ENV).stdout  # noqa: E731
    with Sandbox(workers=4) as sb:
        time.sleep(1)  # the pool's first workers finish starting
        results = {f"pool, calls {args.gap:g} s apart": timed(lambda: sb.run(CODE), args.calls, args.gap),
                   "pool, back to back": timed(lambda: sb.run(CODE), args.calls)}
    results["fresh python -c"] = timed(lambda: fresh([sys.executable, "-c", CODE]), args.calls)
    if prefix:
        results["fresh isolated (unshare, python -I -c)"] = timed(
            lambda: fresh([*prefix, sys.executable, "-I", "-c", CODE]), args.calls)
    base = np.percentile(results["fresh python -c"], 50)
    rows = [{"method": k, "calls": len(v), "p50_ms": round(float(np.percentile(v, 50)), 1),
             "p99_ms": round(float(np.percentile(v, 99)), 1),
             "x": round(float(base / np.percentile(v, 50)), 2)} for k, v in results.items()]
    print("| method | calls | p50 ms | p99 ms | x |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['method']} | {r['calls']} | {r['p50_ms']} | {r['p99_ms']} | {r['x']} |")
    print(json.dumps(rows))
