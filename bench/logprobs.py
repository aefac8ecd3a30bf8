"""Benchmark: fused linear log-probs (grpo.kernels.linear_logprobs) against the naive path
(full logits, log_softmax, gather) and torch.compile of it: time and peak extra memory,
forward and forward+backward, over a grid of N (tokens), V (vocab), H (hidden).

    python bench/logprobs.py            # CPU: fp32, N=2048, V=151936, H=896 and neighbours
    python bench/logprobs.py --quick    # a small grid, seconds
    python bench/logprobs.py --no-compile

Goals: CPU, N=2048 V=151936 H=896: peak extra memory <= 25% of naive, time <= 1.4x
naive. GPU (bf16, N=8x4096, V=151936, H in {896, 2048}): memory <= 10% and time <= naive.
TFLOP/s is effective: 2NHV forward, 6NHV forward+backward (our recompute not counted).
Peak memory: torch.cuda.max_memory_allocated on GPU; on CPU the process's peak RSS (VmHWM,
reset through /proc/self/clear_refs), so each CPU measurement runs in its own process.
Last line of output: json.dumps(rows).
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from grpo.kernels import linear_logprobs
from grpo.kernels.reference import linear_logprobs_ref
from table import print_table  # bench/table.py (bench/ is on sys.path: run as a script, or from gpu_check)

# -----------------------------------------------------------------------------
# harness (bench/loss.py uses it too)

def _rss(key: str) -> int:
    line = next(l for l in open("/proc/self/status") if l.startswith(key))
    return int(line.split()[1]) * 1024


def measure(fn, inputs: list, backward: bool, reps: int, device: str) -> tuple[float, float]:
    """fn(*inputs) -> tensor; returns (median ms, peak extra MiB over the inputs)."""
    params = [x for x in inputs if torch.is_tensor(x) and x.requires_grad]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step():
        with torch.set_grad_enabled(backward):
            out = fn(*inputs)
            if backward:
                torch.autograd.grad(out.float().sum(), params)  # the gradients are outputs, counted
        sync()

    step()                                                        # warm-up (and compile)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        open("/proc/self/clear_refs", "w").write("5")            # reset the peak RSS to now
        base = _rss("VmRSS")
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else _rss("VmHWM")
    return statistics.median(times) * 1e3, (peak - base) / 2**20


def run_cases(script: str, cases: list[dict], one_case) -> list[dict]:
    """On CPU each case runs in a fresh process (peak RSS is per process); on GPU in this one."""
    rows = []
    for case in cases:
        if case["device"] == "cuda":
            rows.append(one_case(case))
            continue
        out = subprocess.run([sys.executable, script, "--one", json.dumps(case)], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"failed: {case}\n{out.stderr[-1500:]}", file=sys.stderr)
            rows.append({**case, "ms": float("nan"), "peak_mib": float("nan")})
        else:
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def print_logprobs_table(rows: list[dict], flops) -> None:
    """One line per case; ratios against the naive row with the same shape and mode."""
    key = lambda r: (r["N"], r["V"], r["H"], r["dtype"], r["mode"])  # noqa: E731
    naive = {key(r): r for r in rows if r["method"] == "naive"}
    nan = float("nan")
    shown = [{**{c: r[c] for c in ("N", "V", "H", "dtype", "mode", "method", "ms")},
              "x naive": r["ms"] / n["ms"] if n else nan, "peak MiB": r["peak_mib"],
              "% naive": r["peak_mib"] / n["peak_mib"] if n and n["peak_mib"] > 0 else nan,
              "TFLOP/s": flops(r) / (r["ms"] * 1e-3) / 1e12} for r in rows for n in [naive.get(key(r))]]
    print_table(shown, list(shown[0]), {"ms": ".1f", "peak MiB": ".0f", "% naive": ".0%"}, dump=False)


def grid(args, device: str) -> list[dict]:
    if device == "cuda":
        shapes = [(4096, 151936, 896)] if args.quick else [(n, 151936, h) for n in (8192, 32768) for h in (896, 2048)]
        dtype = "bfloat16"
    else:
        shapes = [(256, 16384, 256)] if args.quick else [(512, 151936, 896), (2048, 32768, 896), (2048, 151936, 896)]
        dtype = "float32"
    methods = ["naive", "ours"] + ([] if args.no_compile else ["compiled"])
    return [dict(N=N, V=V, H=H, dtype=dtype, mode=mode, method=m, device=device)
            for N, V, H in shapes for mode in ("fwd", "fwd+bwd") for m in methods]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a small grid")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the naive path")
    p.add_argument("--one", help=argparse.SUPPRESS)             # internal: one CPU case, in a child process
    return p.parse_args()

# -----------------------------------------------------------------------------
# this benchmark

def one_case(case: dict) -> dict:
    N, V, H, device = case["N"], case["V"], case["H"], case["device"]
    dtype = getattr(torch, case["dtype"])
    backward = case["mode"] == "fwd+bwd"
    torch.manual_seed(0)
    hidden = torch.randn(N, H, device=device, dtype=dtype).requires_grad_(backward)
    weight = torch.randn(V, H, device=device, dtype=dtype).mul_(H**-0.5).requires_grad_(backward)
    labels = torch.randint(0, V, (N,), device=device)
    fn = {"naive": linear_logprobs_ref, "ours": linear_logprobs, "compiled": torch.compile(linear_logprobs_ref)}
    reps = 5 if device == "cuda" else (1 if N * V > 2**28 else 3)
    ms, peak = measure(fn[case["method"]], [hidden, weight, labels], backward, reps, device)
    return {**case, "ms": ms, "peak_mib": peak}


if __name__ == "__main__":
    args = parse_args()
    if args.one:
        print(json.dumps(one_case(json.loads(args.one))))
        sys.exit()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = run_cases(__file__, grid(args, device), one_case)
    print_logprobs_table(rows, lambda r: (6 if r["mode"] == "fwd+bwd" else 2) * r["N"] * r["H"] * r["V"])
    print(json.dumps(rows))
