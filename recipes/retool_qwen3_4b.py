"""ReTool: Qwen3-4B-Instruct-2507 learns to interleave reasoning with a sandboxed Python code
interpreter, in its own native tool-call format (ReTool, arXiv 2504.11536; the reference run's
model card: BillyWang1/qwen3-4b-instruct-2507-retool-grpo).

    torchrun --nproc_per_node=8 recipes/retool_qwen3_4b.py --model_path=/models/Qwen3-4B-Instruct-2507 \\
        --resume
    python -m grpo.cli.eval --model_path runs/retool_qwen3_4b/export --task aime25 --tool code_interpreter \\
        --eval_n 16 --eval_temperature 1.0 --max_completion_length 16384 \\
        --enable_thinking 0  # and aime24, math500

Reference (slime: Megatron training on 2 B200 + SGLang rollouts on 6): AIME 2024 0.581, AIME
2025 0.498 (mean of 16 samples), MATH-500 0.956, with the interpreter at a 16k-token budget,
after one epoch of DAPO-Math-17k (271 rollouts of 64: its 17.4k deduplicated problems, config `all`
of open-r1/DAPO-Math-17k-Processed, 17,398 rows; the epoch is derived from the rows, --max_steps sets
another length). Settings as the card: 64 prompts x 16 samples
per rollout, lr 1e-6 constant, no KL, seed 42, reward +-1 on the final \\boxed{} (grpo.envs.retool),
max response 8,192 tokens in training and 16,384 in eval (`eval_max_completion_length`, also the
in-training AIME eval's, with the run's 16 tool turns: a row of the eval holds twice the KV, 2.3
GiB, so half as many rows fit and a long answer costs twice the decode), the card's system prompt.
Here the same GPUs sample and train, and a tool call runs in the sandbox while the other rows keep decoding.
As the card, 4 optimizer steps per rollout (`steps_per_generation`: mini-batches of 16 prompts x
16 samples, a global batch of 256; the old log-probs are the rollout's). The dataset's prompts
carry DAPO's instruction to end on an "Answer: $Answer" line, which fights the \\boxed{} reward:
it is stripped (grpo.envs.retool.dapo_example), so the model sees the problem and the card's
system prompt.

Sizing (bf16 KV cache, planned, not measured: no GPU has run it). Qwen3-4B keeps
2 (K, V) x 36 layers x 8 KV heads x 128 dims x 2 bytes = 144 KiB per token, so a slot of
512 prompt + 8,192 completion tokens is 1.2 GiB. On 8 GPUs the memory plan sizes 32 slots (38 GiB
of KV) on H100 / A100-80 and 64 (77 GiB) on H200 / B200, with checkpointing where the recipe's 16k-token
micro-batches need it (`python -m grpo.cli.plan recipes/retool_qwen3_4b.py --gpus 8 --gpu H100`). A step is
1,024 rows: 128 per GPU on 8 GPUs, in about 4 waves of continuous batching on H100 (2 on H200);
rows that finish early free their slot at once. The update (fp32 master weights sharded over 8, bf16 compute,
gradient checkpointing) is small next to the sampling of ~3M tokens a step.
Data: DAPO-Math-17k from the hub (open-r1/DAPO-Math-17k-Processed, config all: `prompt` and
`solution` columns) or a local file with --train_data/--question_field/--answer_field; eval
during training: AIME 2024 (HuggingFaceH4/aime_2024), 16 samples each.
On CPU, SmolLM2-135M with real sandbox calls, a few steps: bench/e2e_retool_smollm2.py and
docs/runs.md (2026-12-02).

Where this differs from the card, all of it:
- Infrastructure: the card ran slime (Megatron training on 2 B200, SGLang rollouts on 6, async
  RL); here the same GPUs sample and train, one rollout after the other: each rollout comes from
  the weights after the previous one's 4 optimizer steps (slime's async mode can sample from
  older weights; the card does not say how stale).
- Data: open-r1/DAPO-Math-17k-Processed, config `all` (17,398 problems, 271 rollouts: the card's
  count; config `en` has ~14.1k), a processed copy of the card's dapo-math-17k; the card does not
  say what it did with DAPO's "Answer: $Answer" instruction, which we strip. Data order: our
  seed-42 shuffle, not slime's.
- Where the card is silent and the slime ReTool example it ran from sets a value (THUDM/slime,
  examples/retool/retool_qwen3_4b_rl.sh), slime's: clip
  epsilon 0.2 below and 0.28 above (eps-clip-high), AdamW weight decay 0.1 and betas (0.9, 0.98).
- Loss details neither gives, ours: loss_type `grpo` (each sequence's token mean, then the
  mean over sequences), truncated importance sampling between the sampler's and the trainer's
  log-probs capped at tis_cap = 2 (grpo.config), gradient clipping 1.0, no warmup; tool responses
  masked out of the loss (as ReTool).
- Tool: our sandbox (grpo.envs.sandbox: isolated workers, 10 s a call) for the card's
  unnamed one; at most 16 assistant turns (tool calls and the answer) a problem, in training and
  eval (the card gives no limit); a call's output as the sandbox returns it (stdout, or the error).
- Eval: AIME 2024 during training (30 problems x 16 samples every 50 steps, 16,384 tokens, ours);
  the card's table through `python -m grpo.cli.eval` as above, MATH-500 scored by math-verify
  equivalence (grpo.envs.math; the card does not name its scorer).
- Prompt length: 512 tokens sizes the KV cache (the card gives none).
- Not yet run on a GPU with the real weights: the sizing above is an estimate.

| setting | the card | here | why |
| --- | --- | --- | --- |
| data, epoch | dapo-math-17k, 271 rollouts of 64 x 16 | its processed copy (config all), 271 | |
| lr, KL, seed, updates a rollout | 1e-6 constant, 0, 42, 4 | same | |
| clip, weight decay, AdamW betas | unstated | 0.2 / 0.28, 0.1, (0.9, 0.98) | slime's ReTool example |
| response tokens, train / eval | 8,192 / 16,384 | same | |
| sampling | SGLang on 6 GPUs, async | the training GPUs, in turn | the design |
| tool, turns | unnamed sandbox, unstated | grpo.envs.sandbox 10 s a call, 16 turns | |
| loss aggregation, TIS, clipping | unstated | grpo, cap 2, 1.0 | ours |
| "Answer: $Answer" instruction | unstated | stripped | it fights the \\boxed{} reward |
"""
from dataclasses import dataclass

from grpo.config import Config
from grpo.flags import parse_args
from grpo.infra.data import epoch_steps, load_or_exit
from grpo.envs.math import aime_example
from grpo.envs.retool import REWARD_WEIGHTS, ReToolEnv, dapo_example
from grpo.fit.sizing import run_command
from grpo.trainer import train


@dataclass
class ReToolQwen3(Config):
    model_path: str = "Qwen/Qwen3-4B-Instruct-2507"
    output_dir: str = "runs/retool_qwen3_4b"
    train_data: str = "open-r1/DAPO-Math-17k-Processed:all:train"  # a file or name[:config[:split]]
    question_field: str = "prompt"
    answer_field: str = "solution"
    eval_data: str = "HuggingFaceH4/aime_2024::train"  # AIME 2024: `problem` and `answer` columns
    eval_question_field: str = "problem"
    tool_timeout: float = 10.0        # seconds per code_interpreter call (the sandbox kills it after)
    seed: int = 42
    max_steps: int = 0                # 0 = one epoch of the training set: rows // prompts_per_step rollouts
    prompts_per_step: int = 64
    num_generations: int = 16
    steps_per_generation: int = 4     # the card's 4 optimizer steps per rollout of 64 x 16 (global batch 256)
    temperature: float = 1.0
    learning_rate: float = 1e-6
    beta: float = 0.0
    loss_type: str = "grpo"
    epsilon_high: float = 0.28        # slime's ReTool example (eps-clip-high): the card gives none
    micro_batch_tokens: int = 16384   # holds one 512 + 8,192-token sequence on any device
                                      # (the plan sizes the rest)
    weight_decay: float = 0.1         # slime's, as above
    adam_beta2: float = 0.98          # slime's, as above
    max_prompt_length: int = 512
    max_completion_length: int = 8192  # sampled and injected (tool responses) tokens
    max_turns: int = 16               # assistant turns: tool calls and the answer
    enable_thinking: bool = False     # the 2507 Instruct model has no thinking mode
    eval_max_completion_length: int = 16384  # the card's eval budget (training: 8,192); 2.3 GiB of KV a row
    eval_limit: int = 30
    eval_n: int = 16
    eval_temperature: float = 1.0
    eval_steps: int = 50
    save_steps: int = 10              # a run of this length will be interrupted: resume with --resume


def load(source: str, **fields) -> list[dict]:
    return load_or_exit(source, "retool recipe", " (--train_data=FILE --eval_data=FILE)", **fields)


def eval_setup(cfg: ReToolQwen3) -> tuple:
    """The env and the eval problems (also `python -m grpo.cli.eval --run`)."""
    env = ReToolEnv(timeout=cfg.tool_timeout, max_turns=cfg.max_turns)
    return env, load(cfg.eval_data, question_field=cfg.eval_question_field, prepare=aime_example)


def main(cls=ReToolQwen3, make_env=None) -> dict:
    """`make_env(cfg)`: the rollouts' env in place of ReToolEnv (bench/e2e_retool_smollm2.py: SmolLM2
    needs solved episodes before the question). Returns train()'s eval results."""
    cfg = parse_args(cls)
    train_set = load(cfg.train_data, question_field=cfg.question_field, answer_field=cfg.answer_field,
                     prepare=dapo_example)  # the problem alone: no "Answer: $Answer" instruction
    if cfg.max_steps == 0:  # one epoch, from the rows there are (the card's 271: 17,398 // 64)
        cfg.max_steps = epoch_steps(len(train_set), cfg.prompts_per_step)
        print(f"max_steps={cfg.max_steps}: one epoch of {len(train_set)} problems "
              f"at {cfg.prompts_per_step} a step")
    env, eval_set = eval_setup(cfg)
    return train(cfg, make_env(cfg) if make_env else env, train_set, eval_set, reward_weights=REWARD_WEIGHTS)


if __name__ == "__main__":
    run_command(main)  # a run the memory plan refuses: its line and table
