"""Peak resident memory and time of the CPU default's update, by micro-batch size and gradient
checkpointing, or LoRA against full fine-tuning; each setting in a fresh process (a process's peak
only grows).

    python bench/cpu_memory.py               # SmolLM2-135M fp32, one thread: 28 sequences of 300 + 140 tokens
    python bench/cpu_memory.py --lora 16     # full fine-tuning against LoRA r 16 (all seven linear layers)
    python bench/cpu_memory.py --quick       # 4 sequences: checks the script

One setting's process: the model, AdamW and a first optimizer step on one sequence (untimed: AdamW's
two fp32 states exist from then on, as in a run's later steps), then the timed optimizer step over the
sequences packed into micro-batches of at most `micro_batch_tokens` (the trainer's packing: whole
sequences), forward + backward on each, then the AdamW step.
Peak = the process's maximum resident set (ru_maxrss, Linux), with what importing torch costs.
The recipe's step trains ~27 of its 48 rollouts (flat groups are left out). With --lora each
setting also times the sampler's per-call refresh of its decode copy (under LoRA: W + s B A merged).
"""
import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from table import print_table  # noqa: E402


def one(setting: dict) -> dict:
    import torch

    from grpo.models.model import Transformer
    from grpo.models.smollm2 import local_path
    torch.set_num_threads(setting["threads"])
    model = Transformer.from_pretrained(local_path(), dtype=torch.float32)
    model.activation_checkpointing = setting["checkpointing"]
    refresh = None
    if setting.get("lora_r"):
        from grpo.models.lora import LoraSettings, add_lora
        add_lora(model, LoraSettings(r=setting["lora_r"], dropout=setting["lora_dropout"]))
    if "lora_r" in setting:  # the sampler's refresh at the start of each call (a merge under LoRA): best of 3
        from grpo.engine.decode import DecodeWeights
        w = DecodeWeights(model)
        refresh = min(_timed(lambda: w.refresh(model)) for _ in range(3))
        del w
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    T = setting["prompt"] + setting["completion"]
    per_mb = max(1, setting["micro_batch_tokens"] // T)  # whole sequences per micro-batch, padded to T
    g = torch.Generator().manual_seed(0)

    def micro_batch(rows: int):
        ids = torch.randint(0, model.args.vocab_size, (rows, T), generator=g)
        labels = ids.roll(-1, dims=1)
        labels[:, :setting["prompt"]] = -100  # the completion is scored
        model(ids, labels=labels).sum().backward()
    micro_batch(1)  # a first step, untimed: AdamW's states exist from then on, as in a run's later steps
    opt.step()
    opt.zero_grad(set_to_none=True)
    t = time.perf_counter()
    for start in range(0, setting["rows"], per_mb):
        micro_batch(min(per_mb, setting["rows"] - start))
    opt.step()
    seconds = time.perf_counter() - t
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {**setting, "seconds": round(seconds, 1), "peak_mib": round(peak_mib),
            **({"refresh_s": round(refresh, 3)} if refresh is not None else {})}


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=28)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--completion", type=int, default=140)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", default="4096,1024,512", help="micro_batch_tokens to try")
    ap.add_argument("--lora", type=int, default=0, help="r: each size with full fine-tuning and with LoRA r")
    ap.add_argument("--lora_dropout", default="0.05", help="LoRA's dropout(s), comma-separated: a row each")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: one setting as JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return
    if args.quick:
        args.rows, args.sizes = 4, "1024"
    common = dict(rows=args.rows, prompt=args.prompt, completion=args.completion, threads=args.threads)
    if args.lora:
        settings = [dict(common, micro_batch_tokens=int(m), checkpointing=False, lora_r=r, lora_dropout=float(p))
                    for m in args.sizes.split(",") for r, drops in ((0, "0"), (args.lora, args.lora_dropout))
                    for p in drops.split(",")]
    else:
        settings = [dict(common, micro_batch_tokens=int(m), checkpointing=ckpt)
                    for m in args.sizes.split(",") for ckpt in (False, True)]
    out = []
    for s in settings:
        r = subprocess.run([sys.executable, __file__, "--one", json.dumps(s)], capture_output=True, text=True,
                           check=True)
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(out[-1], flush=True)
    base = out[0]["seconds"]
    for r in out:
        r["x_time"] = round(r["seconds"] / base, 3)
    import torch

    from grpo.fit.precision import cpu_name
    print(f"{cpu_name()}, CPU capability {torch.backends.cpu.get_cpu_capability()}; {args.rows} sequences of "
          f"{args.prompt} + {args.completion} tokens, {args.threads} thread(s); x_time against the first row")
    print_table(out, ["micro_batch_tokens"] + (["lora_r", "lora_dropout"] if args.lora else ["checkpointing"])
                + ["seconds", "x_time", "peak_mib"]
                + (["refresh_s"] if args.lora else []))


if __name__ == "__main__":
    main()
