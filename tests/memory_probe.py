"""Run in a fresh process by tests/test_memory.py: one phase's measured peak against the memory plan's.

    python tests/memory_probe.py update MODEL TOKENS            # one micro-batch's forward + backward
    python tests/memory_probe.py sample MODEL PROMPTS G P M     # one Sampler call: PROMPTS x G rows, P + M tokens
MODEL: smollm2 or small (a random 6-layer Llama, 8k vocabulary). Measured: the peak resident size
(VmHWM, reset through /proc/self/clear_refs) over the resident size before the phase, with the model's
weights, the gradients' and AdamW's state of a step before already resident. Prints one JSON line."""
import ctypes
import gc
import json
import sys

import torch

from grpo.config import Config
from grpo.engine.sampler import Sampler, SamplingParams
from grpo.fit.memory import memory_plan
from grpo.fit.preflight import peak_bytes, reset_peak
from grpo.models.model import Transformer

SMALL = dict(model_type="llama", vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e4)


def status(key: str) -> int:  # bytes
    return next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith(key))


def main(phase: str, which: str, *sizes: int):
    torch.set_num_threads(1)
    if which == "smollm2":
        from grpo.models.smollm2 import local_path
        model = Transformer.from_pretrained(local_path(), dtype=torch.float32)
    else:
        torch.manual_seed(0)
        model = Transformer(SMALL)
    for p in model.parameters():  # resident: from_pretrained maps the file, and its pages come in when read
        p.data.sum()
    V = model.args.vocab_size
    if phase == "update":
        (T,) = sizes
        cfg = Config(micro_batch_tokens=T, max_prompt_length=T // 2, max_completion_length=T // 2, dtype="float32")
        ids, labels = torch.randint(0, V, (1, T)), torch.randint(0, V, (1, T))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)  # a step first: AdamW's state exists, as in a run
        model.train()
        model(ids[:, :16], labels=labels[:, :16]).sum().backward()  # 16 tokens leave the same states
        opt.step()
        opt.zero_grad(set_to_none=True)
        terms = ("gradients, fp32, sharded", "activations of one micro-batch", "log-probs' vocabulary chunk",
                 "root's input and output", "a layer's backward temporaries")
        run = lambda: model(ids, labels=labels).sum().backward()  # noqa: E731
    else:
        prompts, G, P, M = sizes
        cfg = Config(prompts_per_step=prompts, num_generations=G, max_prompt_length=P, max_completion_length=M,
                     gen_batch=512, dtype="float32", eval_limit=0)
        model.eval()
        sampler = Sampler(model, None, gen_batch=512)
        g = torch.Generator().manual_seed(0)
        rows = [torch.randint(0, V, (P,), generator=g).tolist() for _ in range(prompts)]
        terms = ("KV cache", "decode copy of the weights", "sampler workspace")
        run = lambda: sampler.generate(rows, SamplingParams(n=G, temperature=1.0, max_tokens=M,  # noqa: E731
                                                            stop_token_ids=[], seed=0))
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = status("VmRSS:")
    reset_peak(torch.device("cpu"))  # VmHWM := VmRSS
    run()
    measured = peak_bytes(torch.device("cpu")) - base
    plan = memory_plan(model.args, cfg, 1, "cpu", 64)
    planned = {name: b for name, b, _ in plan.phases["update" if phase == "update" else "rollouts"]}
    print(json.dumps({"measured": measured, "planned": sum(planned[t] for t in terms)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))
