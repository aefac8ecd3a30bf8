"""grpo.engine.sampler against transformers.generate: same model, prompts and settings (greedy, no
early stop, so every row makes exactly --new tokens), prefill and decode timed apart.

    python bench/sampler.py            # CPU: SmolLM2-135M fp32, batch 32, 128 new tokens
    python bench/sampler.py --quick    # CPU, batch 8, 16 new tokens
    python bench/sampler.py --gpu      # CUDA: random Qwen2.5-0.5B / Qwen3-0.6B shapes, bf16, batch 64
                                       # and 256, prompt 256, 512 new; with the memory-bandwidth roofline

Prefill time = a run with 1 new token; decode = the rest. The roofline fraction (GPU) is
measured decode tokens/s over bandwidth / (weight bytes + mean KV bytes read per step) x batch.
On CPU, where decode is compute-bound, the matmul floor is the decode tokens/s of a step that
did nothing but the weight matmuls, and ceiling_x_decode that floor over transformers' decode
tokens/s: the most any sampler doing the same fp32 matmuls could gain over it.
"""
import argparse
import tempfile
import time

import torch

from grpo.models.model import Transformer
from grpo.engine.sampler import Sampler, SamplingParams
from table import print_table  # bench/table.py

SHAPES = {  # random weights with the published configs' shapes
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                                   max_position_embeddings=32768)),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                                 rope_theta=1e6, max_position_embeddings=40960)),
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def best(fn, device, reps):  # min over repeats: a shared machine only ever adds time
    return min(timed(fn, device) for _ in range(reps))


def run_ours(model, prompts, new, gen_batch, reps=1):
    sampler = Sampler(model, gen_batch=gen_batch, max_seq_len=max(map(len, prompts)) + new)
    go = lambda k: sampler.generate(prompts, SamplingParams(temperature=0, max_tokens=k, stop_token_ids=[]))
    device = next(model.parameters()).device
    go(4)  # warm-up (and CUDA graph capture of the first span bucket)
    return best(lambda: go(1), device, reps), best(lambda: go(new), device, reps)


def run_hf(ref, prompts, new, reps=1):
    device = ref.device
    L = max(map(len, prompts))  # left padding, as generate wants for batches
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts], device=device)
    attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=device)
    go = lambda k: ref.generate(input_ids=ids, attention_mask=attn, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                pad_token_id=0)
    with torch.no_grad():
        go(4)
        return best(lambda: go(1), device, reps), best(lambda: go(new), device, reps)


def bandwidth(device) -> float:  # bytes/s of a large device copy (read + write)
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    dt = timed(lambda: [y.copy_(x) for _ in range(10)], device) / 10
    return 2 * x.numel() / dt


def roofline_tps(model, B, prompt_len, new, bw) -> float:
    a = model.args
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_tok = 2 * a.n_layers * a.n_kv_heads * a.head_dim * next(model.parameters()).element_size()
    kv_read = B * (prompt_len + new / 2) * kv_per_tok  # mean over the decode
    return B * bw / (weights + kv_read)


@torch.no_grad()
def matmul_floor_tps(model, B: int, reps: int = 5) -> float:
    """Decode tokens/s if a step cost nothing but its weight matmuls, (B, in) @ W.T for every
    linear layer and the LM head: a ceiling for any sampler that does the same matmuls in
    the same dtype (attention, norms, sampling and Python only add to it)."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = [torch.randn(B, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
    step = lambda: [x @ w.T for x, w in zip(xs, weights)]
    step()
    return B / best(step, weights[0].device, reps)


def row(name, B, prompts, new, ours, hf, roof=None, floor=None):
    P = sum(map(len, prompts))
    r = dict(model=name, batch=B, prompt_tokens=P, new=new)
    for who, (t_pre, t_all) in (("ours", ours), ("hf", hf)):
        r[f"{who}_prefill_tps"] = P / t_pre
        r[f"{who}_decode_tps"] = B * (new - 1) / max(t_all - t_pre, 1e-9)
        r[f"{who}_tps"] = B * new / t_all
    r["x"] = r["ours_tps"] / r["hf_tps"]
    r["x_decode"] = r["ours_decode_tps"] / r["hf_decode_tps"]
    if roof:
        r["roofline_frac"] = r["ours_decode_tps"] / roof
    if floor:  # the most any sampler with these matmuls could reach, over transformers' decode
        r["matmul_floor_decode_tps"], r["ceiling_x_decode"] = floor, floor / r["hf_decode_tps"]
    return r


def cpu_rows(quick: bool, reps: int):
    import transformers  # here, not at the top: bench/gpu_check.py runs without it
    from grpo.models.smollm2 import local_path
    path = local_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    B, new = (8, 16) if quick else (32, 128)
    topics = ["the sea", "prime numbers", "Paris", "a recipe for bread", "how rain forms", "chess openings", "the moon",
              "why the sky is blue"]
    qs = [f"Tell me about {topics[i % 8]}." + " Keep it short and simple, please." * (i % 4) for i in range(B)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"] for q in qs]
    model = Transformer.from_pretrained(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours, hf = run_ours(model, prompts, new, B, reps), run_hf(ref, prompts, new, reps)
    return [row("smollm2-135m fp32 cpu", B, prompts, new, ours, hf, floor=matmul_floor_tps(model, B))]


def gpu_rows(quick: bool):
    import transformers  # here, not at the top: bench/gpu_check.py runs without it
    device, rows = torch.device("cuda"), []
    bw = bandwidth(device)
    for name, (family, cfg) in SHAPES.items():
        hf_cfg = transformers.AutoConfig.for_model(family, **cfg)
        torch.manual_seed(0)
        ref = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).to(device).eval()
        with tempfile.TemporaryDirectory() as d:
            ref.save_pretrained(d)
            model = Transformer.from_pretrained(d, dtype=torch.bfloat16, device=device)
        for B in ((8,) if quick else (64, 256)):
            plen, new = (64, 32) if quick else (256, 512)
            g = torch.Generator().manual_seed(B)
            prompts = torch.randint(100, hf_cfg.vocab_size, (B, plen), generator=g).tolist()
            ours, hf = run_ours(model, prompts, new, B), run_hf(ref, prompts, new)
            rows.append(row(f"{name} bf16", B, prompts, new, ours, hf, roofline_tps(model, B, plen, new, bw)))
        del ref, model
        torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a small run")
    ap.add_argument("--gpu", action="store_true", help="the CUDA shapes (needs a GPU)")
    ap.add_argument("--repeat", type=int, default=1, help="time each phase this many times, keep the best")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (a shared CPU: 1 avoids oversubscription)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = gpu_rows(args.quick) if args.gpu else cpu_rows(args.quick, args.repeat)
    cols = ["model", "batch", "new", "ours_prefill_tps", "hf_prefill_tps", "ours_decode_tps", "hf_decode_tps", "ours_tps",
            "hf_tps", "x", "x_decode"] + (["roofline_frac"] if args.gpu else ["matmul_floor_decode_tps", "ceiling_x_decode"])
    print_table(rows, cols)


if __name__ == "__main__":
    main()
