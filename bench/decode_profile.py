"""Where the sampler's decode time goes on CUDA: one `Sampler.generate` call's wall time against
the GPU's busy time, the kernels that fill it (torch.profiler), and the wall time with fewer
host syncs per token (sync_every) and with greedy instead of sampled tokens.

    python bench/decode_profile.py                            # CUDA: random Qwen2.5-0.5B shape, bf16,
                                                              # batch 256, prompt 256, 256 new tokens
    python bench/decode_profile.py --shape qwen2.5-3b --batch 64
    python bench/decode_profile.py --dry-run                  # CPU, tiny model: the same code

Every row makes exactly `--new` tokens (no stop ids). "GPU busy" sums the kernels' own times
over the profiled call (kernels do not overlap on one stream), so wall minus busy is time the
GPU waited on the host: Python between windows, graph capture, launches, syncs.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_check import build  # noqa: E402  (random weights, transformers' init, the Qwen shapes)
from sampler import timed  # noqa: E402  (bench/sampler.py: wall time with the device synchronized)
from table import print_table  # noqa: E402

from grpo.engine.sampler import Sampler, SamplingParams  # noqa: E402


def self_device_us(e) -> float:  # the attribute's name changed across torch versions
    return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--top", type=int, default=12, help="kernels listed")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model (automatic without CUDA)")
    args = ap.parse_args()
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    if dry:
        args.shape, args.batch, args.prompt, args.new = "tiny", 8, 16, 16
    model = build(args.shape, device).to(torch.float32 if dry else torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.args.vocab_size, (args.batch, args.prompt), generator=g).tolist()
    B, new = args.batch, args.new

    def call(sync_every: int, temperature: float):
        sampler = Sampler(model, gen_batch=B, max_seq_len=args.prompt + new, sync_every=sync_every)
        params = lambda k: SamplingParams(temperature=temperature, max_tokens=k, stop_token_ids=[])  # noqa: E731
        sampler.generate(prompts[:8], params(4))  # warm-up
        t_prefill = timed(lambda: sampler.generate(prompts, params(1)), device)
        t_all = timed(lambda: sampler.generate(prompts, params(new)), device)
        return sampler, params(new), t_prefill, t_all

    rows = []
    for sync_every, temperature in ((8, 1.0), (32, 1.0), (8, 0.0)):
        _, _, t_prefill, t_all = call(sync_every, temperature)
        decode = t_all - t_prefill
        rows.append(dict(sync_every=sync_every, temperature=temperature, prefill_s=t_prefill, decode_s=decode,
                         ms_per_step=1e3 * decode / (new - 1), decode_tok_s=B * (new - 1) / decode))
    print(f"{args.shape}, {'cpu fp32' if dry else torch.cuda.get_device_name(device) + ' bf16'}, batch {B}, "
          f"prompt {args.prompt}, {new} new tokens")
    print_table(rows, ["sync_every", "temperature", "prefill_s", "decode_s", "ms_per_step", "decode_tok_s"])

    sampler, params, _, _ = call(8, 1.0)
    activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * (not dry)
    with torch.profiler.profile(activities=activities) as prof:
        wall = timed(lambda: sampler.generate(prompts, params), device)
    events = [e for e in prof.key_averages() if self_device_us(e) > 0]
    busy = sum(self_device_us(e) for e in events) / 1e6
    print(f"\nprofiled call (sync_every 8, temperature 1): wall {wall:.3f} s, GPU busy {busy:.3f} s "
          f"({busy / wall:.0%}); the rest is host time the GPU waited on")
    top = sorted(events, key=self_device_us, reverse=True)[:args.top]
    print_table([dict(kernel=e.key[:90], calls=e.count, ms=self_device_us(e) / 1e3,
                      share_of_busy=f"{self_device_us(e) / 1e6 / busy:.1%}") for e in top],
                ["kernel", "calls", "ms", "share_of_busy"])


if __name__ == "__main__":
    main()
