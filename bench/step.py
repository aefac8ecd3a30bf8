"""One GRPO step timed by phase, from the trainer's own pieces: generation (grpo.rollout.rollout
on the sampler), old log-probs (update.batch_logprobs, the mu > 1 pass) and the policy update
(update.policy_update: forward with fused log-probs, loss, backward, optimizer step).

    python bench/step.py                # CPU: SmolLM2-135M fp32, 4 prompts x G=4, prompt 128, 64 new tokens
    python bench/step.py --quick        # CPU: 2 prompts x G=2, prompt 64, 16 new tokens
    python bench/step.py --gpu          # CUDA: random Qwen2.5-0.5B shape, bf16 compute on fp32 master
                                        # weights (FSDP2 on one GPU, as the trainer), 16 prompts x G=8,
                                        # prompt 256, 512 new tokens; sizes from the memory plan there
    python bench/step.py --gpu --quick  # CUDA: 4 prompts x G=4, prompt 128, 128 new tokens

Every row samples exactly `new` tokens (no stop ids), so the phases see fixed shapes. Update
MFU = model FLOPs of the update / time / peak, with model FLOPs = 6 x (matmul parameters, LM
head included) + 6 x layers x heads x head_dim x T per token (causal attention, forward +
backward) over real tokens (prompt + completion, no padding). Peak: the GPU's dense bf16 spec;
on CPU, a measured fp32 matmul rate (so CPU MFU reads "share of what matmul alone reaches").
The step is run twice (warm-up: CUDA graph capture, allocator) and the best of --repeat after
that is kept. Last line of output: json.dumps(rows).
"""
import argparse
import json
import time

import torch

from grpo.infra import dist
from grpo.config import Config
from grpo.fit.memory import size
from grpo.models.model import Transformer
from grpo.rollout import rollout
from grpo.engine.sampler import Sampler, SamplingParams
from grpo.loss import group_advantages
from grpo.update import batch_logprobs, policy_update, update_batches
from table import print_table  # bench/table.py (bench/ is on sys.path: run as a script, or from gpu_check)

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                  max_position_embeddings=32768)
PEAK_BF16 = {"B200": 2250e12, "H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12,
             "L40S": 362e12, "RTX 6000 Ada": 364e12, "L4": 121e12}  # dense, no sparsity


class IdsTokenizer:
    """Just enough tokenizer for rollout on token-id prompts: the 'chat template' returns the ids."""
    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kw):
        return list(messages[-1]["content"])

    def decode(self, ids, skip_special_tokens=False):
        return ""


class IdsEnv:
    stop_strings: list = []
    max_turns = 1

    def prompt(self, example):
        return [{"role": "user", "content": example["ids"]}]


# ----------------------------------------------------------------------------- FLOPs and peaks

def matmul_params(model) -> int:
    """Parameters that take part in a matmul per token: every 2-D weight but the embedding
    lookup; a tied LM head is the embedding, so it counts once, as the LM head."""
    a = model.args
    n = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    return n - (0 if a.tie_embeddings else a.vocab_size * a.dim)


def update_flops(model, lengths: list[int]) -> float:
    """Forward + backward model FLOPs over sequences of these lengths (causal attention)."""
    a = model.args
    attn = 6 * a.n_layers * a.n_heads * a.head_dim  # per token per context position: QK^T and AV, x3 for backward
    return sum(6 * matmul_params(model) * T + attn * T * (T + 1) / 2 for T in lengths)


def peak_flops(device) -> tuple[float, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in PEAK_BF16.items():
            if key in name:
                return peak, f"{name} bf16 spec"
        return float("nan"), f"{name}: unknown peak"
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    return 10 * 2 * 1024**3 / (time.perf_counter() - t), "measured fp32 matmul"


# ----------------------------------------------------------------------------- one step

def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def one_step(model, sampler, optimizer, scheduler, cfg: Config, prompts: list[list[int]], new: int, device, seed: int) -> dict:
    """Generation, old log-probs, update; seconds per phase and the trajectories' lengths."""
    B, G = len(prompts), cfg.num_generations
    params = SamplingParams(n=G, temperature=cfg.temperature, max_tokens=new, stop_token_ids=[], seed=seed)
    examples = [{"ids": p} for p in prompts]
    sync(device)
    t0 = time.perf_counter()
    model.eval()
    with dist.gathered(model):
        trajs = rollout(sampler, IdsTokenizer(), IdsEnv(), examples, params)
    sync(device)
    t1 = time.perf_counter()
    rewards = torch.randn(B * G, generator=torch.Generator().manual_seed(seed))  # stand-in rewards: shape is what counts
    advantages = group_advantages(rewards, G, scale="none")
    batch_logprobs(model, update_batches(trajs, advantages, cfg, device), cfg.temperature)  # the mu > 1 pass
    sync(device)
    t2 = time.perf_counter()
    model.train()
    policy_update(model, None, optimizer, scheduler, trajs, advantages, cfg, device)
    sync(device)
    t3 = time.perf_counter()
    assert all(len(t.completion_ids) == new for t in trajs), "every row should sample exactly `new` tokens"
    return dict(generate=t1 - t0, old_logprobs=t2 - t1, update=t3 - t2,
                lengths=[len(t.prompt_ids) + len(t.completion_ids) for t in trajs])


def bench(name: str, model, B: int, G: int, plen: int, new: int, device, repeat: int, profile: dict) -> dict:
    cfg = Config(num_generations=G, prompts_per_step=B, max_prompt_length=plen, max_completion_length=new, temperature=1.0,
                 num_iterations=1, loss_type="grpo", learning_rate=1e-6, tis_cap=2.0, **profile)
    model.activation_checkpointing = cfg.gradient_checkpointing
    n_matmul = matmul_params(model)  # before sharding: full sizes
    flops_model = lambda lengths: update_flops(model, lengths)
    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dist.shard(model, compute_dtype)  # one process: FSDP2 mixed precision on GPU, a no-op on CPU
    with dist.gathered(model):
        sampler = Sampler(model, None, gen_batch=max(cfg.gen_batch, B * G) if device.type == "cpu" else cfg.gen_batch,
                          max_seq_len=plen + new, kv_budget_bytes=int(cfg.kv_budget_gb * 2**30) or None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, model.args.vocab_size, (B, plen), generator=g).tolist()
    step = lambda n, seed: one_step(model, sampler, optimizer, scheduler, cfg, prompts, n, device, seed)
    step(new if device.type == "cuda" else min(new, 8), 1)  # warm-up: CUDA graphs of every span bucket, allocator
    runs = [step(new, 2 + r) for r in range(repeat)]
    best = {k: min(r[k] for r in runs) for k in ("generate", "old_logprobs", "update")}
    lengths = runs[0]["lengths"]
    tokens, sampled = sum(lengths), B * G * new
    peak, peak_note = peak_flops(device)
    flops = flops_model(lengths)
    total = best["generate"] + best["old_logprobs"] + best["update"]
    return {
        "model": name, "device": device.type, "B": B, "G": G, "prompt": plen, "new": new,
        "matmul_params_M": round(n_matmul / 1e6, 1), "micro_batch_tokens": cfg.micro_batch_tokens,
        "generate_s": round(best["generate"], 3), "gen_tok_s": round(sampled / best["generate"], 1),
        "old_logprobs_s": round(best["old_logprobs"], 3), "old_tok_s": round(tokens / best["old_logprobs"], 1),
        "update_s": round(best["update"], 3), "update_tok_s": round(tokens / best["update"], 1),
        "update_tflops": round(flops / best["update"] / 1e12, 3), "update_mfu": round(flops / best["update"] / peak, 4),
        "peak": peak_note, "gen_share": round(best["generate"] / total, 3), "step_s": round(total, 3),
    }


# ----------------------------------------------------------------------------- the rows

def cpu_rows(quick: bool, repeat: int) -> list[dict]:
    from grpo.models.smollm2 import local_path
    B, G, plen, new = (2, 2, 64, 16) if quick else (4, 4, 128, 64)
    model = Transformer.from_pretrained(local_path(), dtype=torch.float32)
    return [bench("smollm2-135m fp32", model, B, G, plen, new, torch.device("cpu"), repeat, {"dtype": "float32"})]


def gpu_rows(quick: bool, repeat: int) -> list[dict]:
    import transformers  # here, not at the top: bench/gpu_check.py runs without it
    device = dist.device()
    torch.cuda.set_device(device)
    B, G, plen, new = (4, 4, 128, 128) if quick else (16, 8, 256, 512)
    config = transformers.Qwen2Config(**QWEN25_05B).to_dict()
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(config)  # random weights, fp32 master copy as in the trainer
    profile = sizes_on_this_gpu(model.args, B, G, plen, new, device)
    return [bench("qwen2.5-0.5b-shape bf16", model, B, G, plen, new, device, repeat, profile)]


def sizes_on_this_gpu(args, B: int, G: int, plen: int, new: int, device) -> dict:
    """gen_batch, kv_budget_gb, micro_batch_tokens and gradient checkpointing as a run of these shapes would
    size them on this GPU (grpo.fit.memory.size: the memory plan, profile auto); Config's on a CPU."""
    if device.type != "cuda":
        return {}
    shape = Config(prompts_per_step=B, num_generations=G, max_prompt_length=plen, max_completion_length=new,
                   eval_limit=0)
    return size(args, shape, 1, "cuda", None)


def print_step_table(rows: list[dict]):
    shown = [{"model": r["model"], "B x G": f"{r['B']} x {r['G']}", "prompt + new": f"{r['prompt']} + {r['new']}",
              "generate s": r["generate_s"], "gen tok/s": r["gen_tok_s"], "old logp s": r["old_logprobs_s"],
              "update s": r["update_s"], "update tok/s": r["update_tok_s"], "update TFLOP/s": r["update_tflops"],
              "update MFU": r["update_mfu"], "gen share of step": r["gen_share"]} for r in rows]
    print_table(shown, list(shown[0]), {"gen tok/s": ".0f", "update tok/s": ".0f", "update TFLOP/s": ".3f",
                                        "update MFU": ".1%", "gen share of step": ".0%"}, dump=False)
    for r in rows:
        print(f"{r['model']}: MFU against {r['peak']}; {r['matmul_params_M']}M matmul parameters; "
              f"micro-batches of {r['micro_batch_tokens']} tokens")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes")
    ap.add_argument("--gpu", action="store_true", help="the CUDA row (needs a GPU)")
    ap.add_argument("--repeat", type=int, default=1, help="timed steps after the warm-up; the best is kept")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (a shared CPU: 1 avoids oversubscription)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu: no CUDA device")
    rows = gpu_rows(args.quick, args.repeat) if args.gpu else cpu_rows(args.quick, args.repeat)
    print_step_table(rows)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
