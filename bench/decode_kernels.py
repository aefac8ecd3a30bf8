"""Benchmark: the decode kernels (grpo.kernels: fused_sample, add_rmsnorm, silu_mul,
qkv_rope_write, decode_attention) against their eager PyTorch references
(grpo.kernels.reference), at the decode shapes of the goals: Qwen2.5-0.5B (B 256 rows, H 896,
14 heads, 2 KV heads, D 64, F 4864) and Qwen2.5-3B (B 64, H 2048, 16 heads, 2 KV heads, D 128,
F 11008), V 151936; the cache holds S 1024 positions a slot, rows filled to random lengths
(the reference attends over all S under a mask, as the sampler's SDPA does).

    python bench/decode_kernels.py              # CUDA only: on a CPU it says so and exits
    python bench/decode_kernels.py --iters 50
    python bench/decode_kernels.py --sweep      # and the decode attention's launch alternatives

Each time (microseconds) is the mean over `iters` back-to-back calls replayed from one CUDA graph
(CUDA events), the best of `reps` such runs: the device's time, as the sampler's graphed decode pays
it. Timed as a Python launch loop these kernels measured the host's launch overhead instead (20-60 us
a launch), so a call that cannot be captured falls back to that loop. Imports torch and triton only
(through grpo.kernels), no transformers: runs on a bare GPU box after
`pip install --no-deps --no-build-isolation .` (offline, `-e` fails there: its build wants setuptools
from the network).
Last line of output: json.dumps(rows).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from table import print_table  # noqa: E402

# the cases, their timing and the launch sweep live in the package (the tests check them there)
from grpo.kernels.cases import SHAPES, cases, sweep, time_ms  # noqa: E402


def measure(dtype: torch.dtype, iters: int, reps: int) -> list[dict]:
    """Each kernel against its reference, both shapes (CUDA)."""
    rows = []
    with torch.no_grad():
        for model in SHAPES:
            for name, shape, call in cases(dtype, model=model):
                torch_ms = time_ms(lambda: call("torch"), iters, reps)
                ours_ms = time_ms(lambda: call("triton"), iters, reps)
                # microseconds in the table: its floats print with 2 decimals
                rows.append(dict(model=model, kernel=name, shape=shape, dtype=str(dtype)[6:], torch_us=1e3 * torch_ms,
                                 triton_us=1e3 * ours_ms, x=torch_ms / ours_ms))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--sweep", action="store_true", help="also time the decode attention's launch alternatives")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/decode_kernels.py needs CUDA (the Triton kernels run on CPU only under the interpreter, "
              "which tests/test_kernels_decode.py uses; bench/compile_kernels.py builds them for a GPU): "
              "nothing to measure here")
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"us per call, mean of {a.iters}, best of {a.reps}")
    print_table(measure(getattr(torch, a.dtype), a.iters, a.reps),
                ["model", "kernel", "shape", "dtype", "torch_us", "triton_us", "x"])
    if a.sweep:
        print("\ndecode attention launches (speed: the shipped launch's time over this one's)")
        print_table(sweep(getattr(torch, a.dtype), a.iters, a.reps),
                    ["model", "keys_warps_stages", "shipped", "us", "speed", "error"])


if __name__ == "__main__":
    main()
