"""Decode-shaped forwards under autocast_bf16 (fp32 weights, bf16 matmuls) with the weights cast
to bf16 on every forward, as each forward's own autocast does alone, against once per call, as
grpo.engine.sampler does by holding a disabled autocast around its loop (torch keeps its cast cache
while any autocast context is open; under no_grad, not under inference_mode). Side by side in
one run, alternating, the best of --repeat kept. Third column: grpo.engine.decode's step (what the
sampler runs now), over a resident bf16 copy of the weights with fused QKV and gate-up: no cast at all.

    python bench/autocast_cache.py              # SmolLM2-135M, 48 and 128 rows, one token each
    python bench/autocast_cache.py --quick      # 8 rows, fewer forwards

Last line of output: json.dumps(rows).
"""
import argparse
import contextlib
import json
import time

import torch

from grpo.engine.decode import DecodeWeights, decode
from grpo.engine.kv_cache import KVCache
from grpo.models.model import Transformer


def forwards_ms(model, rows: int, n: int, cached: bool) -> float:
    x = torch.randint(100, 1000, (rows, 1))
    last = torch.zeros(rows, 1, dtype=torch.long)
    with torch.no_grad(), (torch.autocast("cpu", enabled=False) if cached else contextlib.nullcontext()):
        model(x, output_index=last)  # the cast (cached case) and allocations happen here
        t = time.perf_counter()
        for _ in range(n):
            model(x, output_index=last)
        return (time.perf_counter() - t) / n * 1000


def decode_ms(model, w: DecodeWeights, rows: int, n: int) -> float:
    """The same tokens through grpo.engine.decode.decode: one token per row at position 0 of a cache."""
    cache = KVCache(model.args, rows, 8, torch.float32, torch.device("cpu"))
    tok, pos = torch.randint(100, 1000, (rows,)), torch.zeros(rows, dtype=torch.long)
    with torch.no_grad():
        decode(w, cache, tok, pos, rows, 1)
        t = time.perf_counter()
        for _ in range(n):
            decode(w, cache, tok, pos, rows, 1)
        return (time.perf_counter() - t) / n * 1000


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds per setting; the best is kept")
    args = ap.parse_args()
    from grpo.models.smollm2 import local_path
    model = Transformer.from_pretrained(local_path()).eval()
    model.autocast_bf16 = True
    sizes, n = ((8,), 3) if args.quick else ((48, 128), 10)
    print(f"SmolLM2-135M, fp32 weights, bf16 matmuls, one token per row, {n} forwards, "
          f"{torch.get_num_threads()} threads")
    w = DecodeWeights(model)
    w.refresh(model)
    print("| rows | cast every forward, ms | cast once per call, ms | speed-up | grpo.engine.decode, ms | vs once |")
    print("| --- | --- | --- | --- | --- | --- |")
    out = []
    for rows in sizes:
        times = {False: [], True: [], "decode": []}
        for _ in range(args.repeat):
            for cached in (False, True):
                times[cached].append(forwards_ms(model, rows, n, cached))
            times["decode"].append(decode_ms(model, w, rows, n))
        every, once, dec = min(times[False]), min(times[True]), min(times["decode"])
        print(f"| {rows} | {every:.1f} | {once:.1f} | {every / once:.2f}x | {dec:.1f} | {once / dec:.2f}x |")
        out.append(dict(rows=rows, every_ms=every, once_ms=once, decode_ms=dec))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
