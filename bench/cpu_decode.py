"""The sampler's CPU decode against this machine's floor, all measured in one process.

    python bench/cpu_decode.py                  # SmolLM2-135M fp32, 48 rows (8 calculator prompts x 6), 160 tokens
    python bench/cpu_decode.py --threads 1      # one core (the stand-in for a 2-core AVX2 machine on an AVX512 one)
    python bench/cpu_decode.py --quick          # 16 rows, 32 tokens: checks the script

Three decode rates, in tokens/s, at the same rows:
- ours: `Sampler.generate` at temperature 1 with no stop (every row makes --new tokens), prefill left
  out (the time of a 1-token call is subtracted);
- torch's matmuls alone: a step that does nothing but the decode weights' matmuls (each layer's
  fused qkv, o, gate|up and down, and the LM head) at these rows: what torch's GEMMs give;
- the physical floor: the step's FLOPs at the best fp32 GEMM rate measured here (a 1024^3 matmul)
  or one read of the weights at the measured read bandwidth, whichever is slower.
Ratios: ours / floor (the goal is >= 0.50) and ours / matmuls. The CPU kind and thread count are printed.
A second table times decode's own kernels alone at the same rows: its GEMMs as it calls them (packed
for oneDNN where it packs) and its attention over the run's mean keys a row. floor / (GEMMs +
attention) is the most any engine built on these kernels can reach, whatever it does around them. The
last line says what 0.50 of the floor leaves for everything beside those kernels, against what it takes.
"""
import argparse
import time

import torch
import torch.nn.functional as F

from grpo.fit.precision import cpu_name, matmul_gflops
from grpo.envs.calculator import SHORT_SYSTEM_PROMPT, CalculatorEnv, generate_questions
from grpo.models.model import Transformer
from grpo.rollout import render_prompt
from grpo.engine.sampler import Sampler, SamplingParams
from grpo.models.smollm2 import local_path
from table import print_table  # bench/table.py


def best(fn, reps: int) -> float:  # min over repeats: a shared machine only ever adds time
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def read_bandwidth(mib: int = 512) -> float:  # bytes/s of summing a buffer far larger than the caches
    x = torch.ones(mib << 18)  # fp32
    x.sum()
    return x.numel() * 4 / best(x.sum, 5)


def matmul_step(sampler: Sampler, rows: int, reps: int) -> float:
    """Seconds of one decode step's weight matmuls alone, at `rows` rows, in the decode copy's dtypes."""
    w = sampler.weights
    x = {W.shape[1]: torch.randn(rows, W.shape[1]).to(w.mm_dtype) for W in w.matrices(0)}
    head = torch.randn(rows, w.lm_head.shape[1]).to(w.lm_head.dtype)

    def step():
        for i in range(w.args.n_layers):
            for W in w.matrices(i):
                F.linear(x[W.shape[1]], W)
        F.linear(head, w.lm_head)
    step()
    return best(step, reps)


def kernels_step(sampler: Sampler, rows: int, span: int, reps: int) -> tuple[float, float]:
    """Seconds of one decode step's GEMMs as decode calls them (packed for oneDNN where it packs: the
    layers' four and the LM head's vocabulary chunks), and of its attention alone (decode's own, over a
    cache of `span` keys a row), at `rows` rows: what any engine built on these kernels spends at least."""
    from grpo.engine.cpu import packed_linear
    from grpo.engine.decode import _attend, _key_bias
    from grpo.engine.kv_cache import KVCache
    w, a = sampler.weights, sampler.weights.args
    x, h = torch.randn(rows, a.dim).to(w.mm_dtype), torch.randn(rows, a.ffn_dim).to(w.mm_dtype)
    xo = torch.randn(rows, a.n_heads * a.head_dim).to(w.mm_dtype)  # o's input: the heads' outputs
    head = torch.randn(rows, a.dim).to(w.lm_head.dtype)

    def gemms():
        for i in range(a.n_layers):
            w.qkv(i, x), w.o(i, xo), w.gate_up(i, x), w.down(i, h)
        if w.head is not None:
            [packed_linear(head, blk) for blk in w.head]
        else:
            F.linear(head, w.lm_head)
    cache = KVCache(a, rows, span, torch.float32, "cpu")
    cache.k.normal_(), cache.v.normal_()
    q, slot = torch.randn(rows, a.n_heads, a.head_dim), torch.arange(rows)
    pos = torch.full((rows,), span - 1)
    bias = _key_bias(pos, span)

    def attention():
        for i in range(a.n_layers):
            _attend(q, cache.k[i], cache.v[i], slot, pos + 1, span, bias, None)
    gemms(), attention()
    return best(gemms, reps), best(attention, reps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="0: torch's default")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=6, help="samples per prompt (rows = prompts x n)")
    ap.add_argument("--new", type=int, default=160, help="tokens each row decodes")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.n, args.new, args.reps = 4, 4, 32, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer
    path = local_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = Transformer.from_pretrained(path, dtype=torch.float32).eval()
    model.autocast_bf16 = False  # fp32 matmuls: the floor below is fp32's
    env = CalculatorEnv(system_prompt=SHORT_SYSTEM_PROMPT)
    prompts = [render_prompt(tok, env.prompt(q))
               for q in generate_questions(args.prompts, seed=1, split="eval", phrasing="heldout")]
    rows = args.prompts * args.n
    sampler = Sampler(model, tok, gen_batch=rows)
    go = lambda k: sampler.generate(prompts, SamplingParams(n=args.n, temperature=1.0, max_tokens=k,  # noqa: E731
                                                            stop_token_ids=[], seed=0))
    go(2)  # warm-up: allocation, first calls
    t_new, t_one = best(lambda: go(args.new), args.reps), best(lambda: go(1), args.reps)
    ours = rows * (args.new - 1) / (t_new - t_one)  # the 1-token call: prefill and the first token

    t_mm = matmul_step(sampler, rows, 3)
    mean_span = round(sum(map(len, prompts)) / len(prompts) + args.new / 2)  # a row's keys, on average
    with torch.no_grad():
        t_gemm, t_attn = kernels_step(sampler, rows, mean_span, 3)
    w = sampler.weights
    params = sum(W.numel() for i in range(w.args.n_layers) for W in w.matrices(i)) + w.lm_head.numel()
    gemm = matmul_gflops(1024, 1024, 1024, torch.float32, seconds=1.0) * 1e9  # FLOP/s
    bw = read_bandwidth()
    t_floor = max(2 * params * rows / gemm, params * 4 / bw)
    span = max(map(len, prompts)) + args.new
    print(f"{cpu_name()}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
          f"SmolLM2-135M fp32, {rows} rows, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.new} new (keys up to {span}); fp32 GEMM {gemm / 1e9:.0f} GFLOP/s (1024^3), read "
          f"{bw / 1e9:.1f} GB/s; a step: {2 * params * rows / 1e9:.1f} GFLOP, {params * 4 / 1e6:.0f} MB of weights")
    table = [dict(threads=torch.get_num_threads(), rows=rows, ours=round(ours, 1), matmuls=round(rows / t_mm, 1),
                  floor=round(rows / t_floor, 1), ours_ms=round(1e3 * rows / ours, 1), matmuls_ms=round(1e3 * t_mm, 1),
                  floor_ms=round(1e3 * t_floor, 1), ours_of_floor=round(ours * t_floor / rows, 3),
                  matmuls_of_floor=round(t_floor / t_mm, 3), ours_of_matmuls=round(ours * t_mm / rows, 3),
                  gemms_ms=round(1e3 * t_gemm, 1), attention_ms=round(1e3 * t_attn, 1),
                  kernels_of_floor=round(t_floor / (t_gemm + t_attn), 3),
                  capability=torch.backends.cpu.get_cpu_capability())]
    print_table(table, ["threads", "rows", "ours", "matmuls", "floor", "ours_ms", "matmuls_ms", "floor_ms",
                        "ours_of_floor", "matmuls_of_floor", "ours_of_matmuls"])
    print(f"decode's own kernels alone, a step at {rows} rows (attention over {mean_span} keys a row, the run's mean):")
    print_table(table, ["gemms_ms", "attention_ms", "floor_ms", "kernels_of_floor"], dump=False)
    kernels_ms, goal_ms = 1e3 * (t_gemm + t_attn), 2e3 * t_floor
    print(f"0.50 of the floor allows {goal_ms:.1f} ms a step: decode's GEMMs and attention alone take {kernels_ms:.1f}, "
          f"leaving {goal_ms - kernels_ms:.1f} ms for everything else (norms, rotary, KV writes, sampling, the host), "
          f"which take {1e3 * rows / ours - kernels_ms:.1f} here")


if __name__ == "__main__":
    main()
