"""Qwen3.5's hybrid model: grpo.engine.sampler against transformers.generate on CPU, same random weights, prompts and
settings (greedy, no early stop, so every row makes exactly --new tokens), prefill and decode timed apart as
bench/sampler.py times them. Both decode through a model forward a step (ours: grpo/engine/model_decode.py over the
per-row linear state and the attention layers' KV cache; theirs: its own cache), so the ratio is what the
sampler's loop, cache and chunked/recurrent rule cost against transformers' torch fallbacks.

    python bench/qwen35_decode.py                # tiny hybrid (8 layers, hidden 256), batch 16, 64 new tokens
    python bench/qwen35_decode.py --quick        # batch 4, 16 new tokens
    python bench/qwen35_decode.py --shape 0.8b   # Qwen3.5-0.8B's text shapes (random weights, 3 GB in fp32)
"""
import argparse
import tempfile

import torch

from grpo.models.model import Transformer
from sampler import row, run_hf, run_ours  # bench/sampler.py
from table import print_table  # bench/table.py

SHAPES = {  # Qwen3_5TextConfig fields; every 4th layer full attention (transformers' default pattern)
    "tiny": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                 linear_key_head_dim=32, linear_value_head_dim=32),
    "0.8b": dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                 linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=True),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="tiny", choices=SHAPES)
    ap.add_argument("--quick", action="store_true", help="a small run")
    ap.add_argument("--repeat", type=int, default=1, help="time each phase this many times, keep the best")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (a shared CPU: 1 avoids oversubscription)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers
    torch.manual_seed(0)
    ref = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SHAPES[args.shape])).eval()
    with tempfile.TemporaryDirectory() as d:
        ref.save_pretrained(d)
        model = Transformer.from_pretrained(d)
    B, plen, new = (4, 32, 16) if args.quick else (16, 64, 64)
    prompts = torch.randint(100, ref.config.vocab_size, (B, plen), generator=torch.Generator().manual_seed(B)).tolist()
    ours, hf = run_ours(model, prompts, new, B, args.repeat), run_hf(ref, prompts, new, args.repeat)
    cols = ["model", "batch", "new", "ours_prefill_tps", "hf_prefill_tps", "ours_decode_tps", "hf_decode_tps",
            "ours_tps", "hf_tps", "x", "x_decode"]
    print_table([row(f"qwen3.5 {args.shape} fp32 cpu", B, prompts, new, ours, hf)], cols)


if __name__ == "__main__":
    main()
