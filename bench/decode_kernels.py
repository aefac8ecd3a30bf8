"""Benchmark: the decode kernels (grpo.kernels: fused_sample, add_rmsnorm, silu_mul,
qkv_rope_write, decode_attention) against their eager PyTorch references
(grpo.kernels.reference), at the decode shapes of the goals: Qwen2.5-0.5B (B 256 rows, H 896,
14 heads, 2 KV heads, D 64, F 4864) and Qwen2.5-3B (B 64, H 2048, 16 heads, 2 KV heads, D 128,
F 11008), V 151936; the cache holds S 1024 positions a slot, rows filled to random lengths
(the reference attends over all S under a mask, as the sampler's SDPA does).

    python bench/decode_kernels.py              # CUDA only: on a CPU it says so and exits
    python bench/decode_kernels.py --iters 50
    python bench/decode_kernels.py --sweep      # and the decode attention's launch alternatives

Each time (microseconds) is the mean over `iters` back-to-back calls (CUDA events), the best of `reps`
such runs: these kernels take microseconds, so one call is mostly launch overhead, which is
what the eager references pay once per small op. Imports torch and triton only (through
grpo.kernels), no transformers: runs on a bare GPU box after `pip install --no-deps -e .`.
Last line of output: json.dumps(rows).
"""
import argparse
import sys
from unittest import mock
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from table import print_table  # noqa: E402

from grpo.kernels import add_rmsnorm, decode_attention, fused_sample, qkv_rope_write, silu_mul  # noqa: E402
from grpo.kernels import layers  # noqa: E402

SHAPES = {"qwen2.5-0.5b": dict(B=256, H=896, NH=14, NKV=2, D=64, F=4864),
          "qwen2.5-3b": dict(B=64, H=2048, NH=16, NKV=2, D=128, F=11008)}
V, S = 151936, 1024  # vocabulary; cache positions per slot


def time_ms(fn, iters: int, reps: int) -> float:
    fn()                                                     # warm-up: Triton compiles here
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / iters)
    return best


def cases(dtype: torch.dtype, dev: str = "cuda", model: str = "qwen2.5-0.5b"):
    """(name, shape, call with a backend argument) at `model`'s decode shapes."""
    B, H, NH, NKV, D, F = SHAPES[model].values()
    g = torch.Generator(device=dev).manual_seed(0)
    rand = lambda *shape, dt=dtype: torch.randn(*shape, generator=g, device=dev).to(dt)  # noqa: E731
    key = torch.randint(0, 1 << 62, (B,), generator=g, device=dev)
    step = torch.randint(0, 4096, (B,), generator=g, device=dev)
    out = []
    for ldt in dict.fromkeys((torch.float32, dtype)):  # fp32 logits, and the model dtype's
        logits = rand(B, V, dt=ldt) * 4
        for T in (1.0, 0.0):
            out.append((f"fused_sample T={T:g}", f"({B}, {V}) {str(ldt)[6:]}",
                        lambda be, l=logits, T=T: fused_sample(l, key, step, T, backend=be)))
    x, res, w = rand(B, H), rand(B, H), 1 + 0.1 * rand(H)
    out.append(("add_rmsnorm", f"({B}, {H})", lambda be: add_rmsnorm(x, res, w, 1e-6, backend=be)))
    gu = rand(B, 2 * F)
    out.append(("silu_mul", f"({B}, {2 * F})", lambda be: silu_mul(gu, backend=be)))
    qkv = rand(B, (NH + 2 * NKV) * D)
    pos = torch.randint(0, S, (B,), generator=g, device=dev)
    freqs = pos.float()[:, None] * (1e6 ** -(torch.arange(0, D, 2, device=dev) / D))
    cos, sin = freqs.cos(), freqs.sin()
    k_cache, v_cache = rand(B, S, NKV, D), rand(B, S, NKV, D)
    slot = torch.arange(B, device=dev)
    qn, kn = 1 + 0.1 * rand(D), 1 + 0.1 * rand(D)
    for norm in (False, True):
        out.append((f"qkv_rope_write{' +qk_norm' if norm else ''}", f"({B}, {qkv.shape[1]})",
                    lambda be, n=norm: qkv_rope_write(qkv, cos, sin, k_cache, v_cache, slot, pos, NH, NKV, D,
                                                      qn if n else None, kn if n else None, backend=be)))
    q = rand(B, NH, D)
    length = torch.randint(1, S + 1, (B,), generator=g, device=dev)
    out.append(("decode_attention", f"({B}, {NH}, {D}) x {S}",
                lambda be: decode_attention(q, k_cache, v_cache, slot, length, backend=be)))
    return out


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


# (keys a block, warps, stages) tried by the sweep; the shipped one is layers._attention_launch's
SWEEP = [(16, 4, 1), (16, 4, 3), (16, 8, 3), (32, 4, 2), (32, 4, 3), (32, 8, 2), (32, 8, 3), (64, 4, 1),
         (64, 4, 2), (64, 8, 2), (64, 8, 3), (64, 4, 3), (128, 4, 2), (128, 8, 2)]


def sweep(dtype: torch.dtype, iters: int, reps: int, dev: str = "cuda") -> list[dict]:
    """The decode attention's launch alternatives at both shapes, against the shipped one (CUDA).
    A spilling configuration (fp32: 64 keys x 4 warps x 3 stages) is timed too; one
    the GPU cannot launch (too much shared memory) is a row saying so."""
    from triton.runtime.errors import OutOfResources
    rows = []
    with torch.no_grad():
        for model in SHAPES:
            call = next(c for name, _, c in cases(dtype, dev, model) if name == "decode_attention")
            shipped = layers._attention_launch(SHAPES[model]["D"], dtype)
            base = time_ms(lambda: call("triton"), iters, reps)
            for cfg in SWEEP:
                r = dict(model=model, keys_warps_stages=str(cfg), shipped=cfg == shipped)
                try:
                    with mock.patch.object(layers, "_attention_launch", lambda D, dtype, cfg=cfg: cfg):
                        us = 1e3 * time_ms(lambda: call("triton"), iters, reps)
                    rows.append(dict(r, us=us, speed=1e3 * base / us, error=""))
                except OutOfResources as e:  # e.g. 136 KB of shared memory on an RTX 6000 Ada
                    rows.append(dict(r, us=float("nan"), speed=float("nan"), error=str(e).splitlines()[0][:120]))
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
