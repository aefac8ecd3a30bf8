"""Qwen2.5-0.5B-Instruct learns a multi-turn calculator tool (the reference run:
github.com/Danau5tin/calculator_agent_rl).

    torchrun --nproc_per_node=8 recipes/calculator_qwen25_05b.py --model_path=/models/Qwen2.5-0.5B-Instruct
    # one GPU:
    torchrun --nproc_per_node=1 recipes/calculator_qwen25_05b.py --model_path=... --prompts_per_step=1

Reference: accuracy 0.6% -> 34% on its 158 held-out questions, same settings as the 3B recipe
(calculator_qwen25_3b.py, whose docstring tables them against the reference's), trained on 6 RTX
6000 Adas (vLLM on 2 more): 8 generations per training GPU, so `--prompts_per_step 6` is its batch
on any number of GPUs (the default, 0, gives 8 x GPUs / G). On a GPU the memory plan sizes the
sampler's batch and KV budget, the micro-batch and gradient checkpointing at start, for the GPU it
finds (`python -m grpo.cli.plan recipes/calculator_qwen25_05b.py --gpu L4` shows what it picks there).
"""
from dataclasses import dataclass

from calculator_qwen25_3b import CalculatorQwen, main

from grpo.fit.sizing import run_command


@dataclass
class CalculatorQwen05B(CalculatorQwen):
    model_path: str = "Qwen/Qwen2.5-0.5B-Instruct"
    output_dir: str = "runs/calculator_qwen25_05b"


if __name__ == "__main__":
    run_command(main, CalculatorQwen05B)
