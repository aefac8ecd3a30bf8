"""Qwen3.5-0.8B (thinking off) on GSM8K: recipes/gsm8k_qwen3_06b.py's task, prompt, scorer and settings
on Qwen3.5's hybrid small model (18 Gated DeltaNet layers, 6 gated-attention layers: grpo/models/qwen35.py).

    torchrun --nproc_per_node=1 recipes/gsm8k_qwen35_08b.py --model_path=/models/Qwen3.5-0.8B
    python -m grpo.cli.eval --model_path runs/gsm8k_qwen35_08b/export --task gsm8k --shots 10 \
        --enable_thinking 0 --max_completion_length 768
    python -m grpo.cli.plan recipes/gsm8k_qwen35_08b.py --gpu H100     # the memory plan, offline

The checkpoint is the vision-language one (model_type qwen3_5); only its language model is read, and the
export is a text-only Qwen3_5ForCausalLM folder. What differs from the Qwen3 recipe's run:
- the sampler keeps a linear state per row (conv window + recurrent state) beside the attention layers'
  KV cache, and decodes eagerly through the model's own forward (grpo/engine/model_decode.py): no CUDA
  graphs and no fused decode kernels, so rollouts are slower per token than a same-size Qwen3's;
- share_prompt is refused (a completion would have to start from its prompt's state), and continue_from
  prefills each cut on its own;
- the linear layers' chunked rule runs in fp32 in plain PyTorch (grpo/models/deltanet.py), and keeps more
  activations a token than an attention layer (the memory plan counts them).
Not yet run end to end on a GPU: no reference result.

The memory plan's peak per rank in GiB on 1 / 8 of each GPU, each run sized as it sizes itself there
(`python -m grpo.cli.plan --table`; computed, not yet measured on a GPU):

| B200 | H200 | H100 | A100-80 | A100-40 | RTX 6000 Ada | L40S | L4 |
|---|---|---|---|---|---|---|---|
| 179 / 168 | 102 / 130 | 63 / 72 | 63 / 72 | 39 / 32 | 43 / 32 | 43 / 32 | 22 / 21 |
"""
from dataclasses import dataclass

from gsm8k_qwen3_06b import GSM8KQwen3, main

from grpo.fit.sizing import run_command


@dataclass
class GSM8KQwen35(GSM8KQwen3):
    model_path: str = "Qwen/Qwen3.5-0.8B"  # a local HF folder, or a hub id fetched once into the HF cache
    output_dir: str = "runs/gsm8k_qwen35_08b"


if __name__ == "__main__":
    run_command(main, GSM8KQwen35)
