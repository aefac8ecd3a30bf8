"""Qwen3-0.6B (thinking off) on GSM8K, optimized against the benchmark's own scorer
(model card: cmpatino/qwen-grpo-r5).

    torchrun --nproc_per_node=1 recipes/gsm8k_qwen3_06b.py --model_path=/models/Qwen3-0.6B
    python -m grpo.cli.eval --model_path runs/gsm8k_qwen3_06b/export --task gsm8k --shots 10 \
        --enable_thinking 0 --max_completion_length 768

Data: the Hugging Face openai/gsm8k (train and test splits of config main), fetched once by the
optional `datasets` library. Offline, pass local files with the same columns (JSONL, CSV or
Parquet): --train_data=gsm8k/train.jsonl --eval_data=gsm8k/test.jsonl (grpo.infra.data.load_examples).

Reference: 10-shot greedy GSM8K test 47.5% -> 70.9% in 251 steps (about $8 on one L4, then
one L40S). Settings as the card: inspect's MATH_PROMPT_TEMPLATE ("ANSWER: $ANSWER" last
line); reward = inspect's numeric match (5 significant figures) + 0.2 for ending on an
ANSWER line; DAPO loss, beta = 0, rewards scaled within groups, truncated completions
masked, 16 prompts a step, max 768 tokens. The card ran three stages, each from the last one's
weights: r2, 77 steps at lr 3e-6, G = 8, temperature 1.0; r4, from r2, lr 2e-6, G = 16, temperature
1.0 (its step 100 kept); r5, from r4's step 100, 74 steps at lr 2e-6, G = 16, temperature 1.15.
One run here covers them from the base model: 250 steps at G = 16, lr 3e-6 after 10 warm-up steps
and temperature 1.1, between the stages' values, so that one command reproduces the result. The
card's own path is three commands, each from the last one's export:
    python recipes/gsm8k_qwen3_06b.py --max_steps 77 --num_generations 8 --temperature 1.0 \
        --output_dir runs/gsm8k_r2
    python recipes/gsm8k_qwen3_06b.py --model_path runs/gsm8k_r2/export --max_steps 100 --learning_rate 2e-6 \
        --temperature 1.0 --seed 1 --output_dir runs/gsm8k_r4
    python recipes/gsm8k_qwen3_06b.py --model_path runs/gsm8k_r4/export --max_steps 74 --learning_rate 2e-6 \
        --temperature 1.15 --seed 2 --output_dir runs/gsm8k_r5
(each stage draws its prompts anew: another --seed orders them differently, where the card's stages
together saw each prompt at most once). The eval's token limit is training's, 768, here and in the
eval command above. Sizes per GPU: the memory plan's, at start (python -m grpo.cli.plan).

| setting | the card | here | why |
| --- | --- | --- | --- |
| stages | 3 (77 + 100 + 74 steps) | 1 run of 250 steps, or the 3 commands above | one command |
| lr | 3e-6, then 2e-6 | 3e-6 after 10 warm-up steps | the stages' first |
| G x prompts | 8 x 16, then 16 x 16 | 16 x 16 | the later stages' |
| temperature | 1.0, then 1.15 | 1.1 | between the two |
| clip (epsilon, epsilon_high) | 0.2, 0.2 (TRL's default) | 0.2, 0.2 | |
| loss, beta, scaling, masking | DAPO, 0, group, truncated masked | same | |
| completion tokens, train and eval | 768 | 768 | |
| eval | inspect_evals/gsm8k, 10-shot greedy, 1,319 | our port of its prompt and scorer, same | |
"""
from dataclasses import dataclass

from grpo.config import Config
from grpo.flags import parse_args
from grpo.infra.data import load_or_exit
from grpo.envs import gsm8k
from grpo.envs.tasks import gsm8k_example
from grpo.fit.sizing import run_command
from grpo.trainer import train


@dataclass
class GSM8KQwen3(Config):
    model_path: str = "Qwen/Qwen3-0.6B"   # a local HF folder, or a hub id fetched once into the HF cache
    output_dir: str = "runs/gsm8k_qwen3_06b"
    train_data: str = "openai/gsm8k:main:train"  # a JSONL, CSV or Parquet file, or name[:config[:split]]
    eval_data: str = "openai/gsm8k:main:test"    # the same; the eval's 10 shots come from train_data
    eval_shots: int = 10              # eval protocol: 10-shot greedy (training prompts are zero-shot)
    enable_thinking: bool = False     # Qwen3 non-thinking mode, in training and eval alike
    max_steps: int = 250
    prompts_per_step: int = 16
    num_generations: int = 16
    temperature: float = 1.1
    learning_rate: float = 3e-6
    warmup_steps: int = 10
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    beta: float = 0.0
    mask_truncated_completions: bool = True
    max_prompt_length: int = 512         # zero-shot training prompts (the 10-shot eval sizes its own sampler)
    max_completion_length: int = 768
    eval_limit: int = 1319
    eval_steps: int = 50
    save_steps: int = 25


def load(cfg: GSM8KQwen3, source: str) -> list[dict]:
    # the usual failure is a missing file or no network: one line, saying what to pass
    return load_or_exit(source, "gsm8k recipe", " (--train_data=FILE --eval_data=FILE)",
                        question_field=cfg.question_field, answer_field=cfg.answer_field,
                        prepare=gsm8k_example)


def eval_setup(cfg: GSM8KQwen3, train_set: list[dict] | None = None) -> tuple:
    """The eval env (the harness's k-shot system prompt, shots from the train data) and the test
    set (also `python -m grpo.cli.eval --run`)."""
    train_set = train_set if train_set is not None else load(cfg, cfg.train_data) if cfg.eval_shots else []
    shots = gsm8k.fewshot_examples(train_set, cfg.eval_shots) if cfg.eval_shots else []
    return gsm8k.GSM8KEnv(fewshot=shots), load(cfg, cfg.eval_data)


def main(cls=GSM8KQwen3):
    cfg = parse_args(cls)
    train_set = load(cfg, cfg.train_data)
    eval_env, test_set = eval_setup(cfg, train_set)  # eval k-shot, train zero-shot: two envs, one scorer
    train(cfg, gsm8k.GSM8KEnv(), train_set, test_set, reward_weights=gsm8k.DEFAULT_WEIGHTS, eval_env=eval_env)


if __name__ == "__main__":
    run_command(main)  # a run the memory plan refuses: its line and table
