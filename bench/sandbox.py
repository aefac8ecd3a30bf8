"""Benchmark: latency of one sandboxed call, grpo.envs.sandbox's pool against a fresh interpreter per call.

Rows:
- pool, calls apart: a call every `--gap` s, so the pool has refilled, as tool calls come during a rollout
- pool, back to back: calls as fast as they return; workers start no faster than an interpreter
- fresh python -c: `python -c CODE` per call, no isolation at all (the baseline: x = its p50 / the row's)
- fresh isolated: the same namespaces as the pool (`unshare ... python -I -c CODE`), started per call
- with --against DIR: another checkout's envs/sandbox.py (a `git worktree` of HEAD), its pool's calls
  interleaved with this one's, so both rows see the same load (a shared machine's noise is larger than
  the difference between two versions)

    python bench/sandbox.py [--calls 100] [--gap 0.2] [--against /tmp/head]

Last line of output: json.dumps(rows).
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np

import grpo.envs
from grpo.envs import cgroups
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


def load_sandbox(checkout: str):
    """`checkout`/envs/sandbox.py as a module of its own, importing that checkout's cgroups.py."""
    def load(name):
        spec = importlib.util.spec_from_file_location(f"against_{name}", os.path.join(checkout, "envs", f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    grpo.envs.cgroups = load("cgroups")  # what its `from grpo.envs import cgroups` finds
    try:
        return load("sandbox")
    finally:
        grpo.envs.cgroups = cgroups


def interleaved(a, b, calls: int, gap: float) -> tuple[list[float], list[float]]:
    """Calls `gap` s apart alternating between two pools (which goes first alternates too)."""
    ms = ([], [])
    for i in range(calls):
        for j in (0, 1) if i % 2 else (1, 0):
            ms[j].extend(timed(lambda: (a, b)[j].run(CODE), 1, gap))
    return ms


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--gap", type=float, default=0.2, help="seconds between calls in the first row")
    p.add_argument("--against", help="a checkout whose envs/sandbox.py to time too, calls interleaved")
    args = p.parse_args()
    prefix = namespaces()[0] or []
    fresh = lambda argv: subprocess.run(argv, capture_output=True, text=True, env=ENV).stdout  # noqa: E731
    results = {}
    if args.against:
        with Sandbox(workers=4) as sb, load_sandbox(args.against).Sandbox(workers=4) as other:
            time.sleep(1)
            ours, theirs = interleaved(sb, other, args.calls, args.gap)
        results[f"pool, calls {args.gap:g} s apart, interleaved: this checkout"] = ours
        results[f"pool, calls {args.gap:g} s apart, interleaved: {args.against}"] = theirs
    with Sandbox(workers=4) as sb:
        time.sleep(1)  # the pool's first workers finish starting
        results[f"pool, calls {args.gap:g} s apart"] = timed(lambda: sb.run(CODE), args.calls, args.gap)
        results["pool, back to back"] = timed(lambda: sb.run(CODE), args.calls)
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
