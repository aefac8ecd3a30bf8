"""Qwen2.5-3B-Instruct learns a multi-turn calculator tool (the reference run:
github.com/Danau5tin/calculator_agent_rl).

    torchrun --nproc_per_node=8 recipes/calculator_qwen25_3b.py --model_path=/models/Qwen2.5-3B-Instruct
    # 4x A100 80GB:
    torchrun --nproc_per_node=4 recipes/calculator_qwen25_3b.py --model_path=... --prompts_per_step=4
    # one 48 GB GPU (RTX 6000 Ada, L40S): LoRA adapters on the frozen bf16 base
    python recipes/calculator_qwen25_3b.py --model_path=... --use_peft --learning_rate=1e-5 \
        --prompts_per_step=1

A full fine-tune does not fit one 48 GB card: fp32 weights, gradients and AdamW's two states are
46 GiB before any activation or KV cache. LoRA r 16 on the seven linear layers of every block
trains 30M parameters (0.45 GiB with their gradients and AdamW states) beside a 5.75 GiB bf16 base;
with FSDP's unsharded copy while sampling and the sampler's decode copy (5.75 GiB each) and a 128-row
KV cache of 1,524 tokens (6.7 GiB), ~24 GiB, about 20 GiB stay for the update's checkpointed
activations (computed, not yet run: bench/RESULTS.md). The learning rate is the reference's x10, the
usual ratio for adapters (not tuned here).

Reference: accuracy 27% -> 89% on its 158 held-out questions, one epoch over its 1,500 training
questions (the 0.5B: 0.6% -> 34%). The reference trained the 3B on 2 A100s with vLLM on 2 more, and
the 0.5B on 6 RTX 6000 Adas with vLLM on 2: 8 generations per training GPU and G = 8, so one prompt
per training GPU a step (3B: 2 prompts, ~750 steps, ~1,500 updates at mu = 2). Here the same GPUs
sample and train, and `--prompts_per_step` 0 (the default) keeps the reference's rule: 8 x GPUs / G
prompts, so 8 on 8 GPUs (187 steps, 4x fewer updates than the reference's 3B run at the same lr);
`--prompts_per_step 2` is the reference's 3B batch on any number of GPUs.

Reward: with `--judge_base_url=http://host/v1 --judge_model=NAME` (OpenAI-compatible; the key, if
the server wants one, from the JUDGE_API_KEY environment variable, never a flag), the reference's:
0.8 an LLM judge's score of a rubric over the whole trajectory (grpo.envs.calculator.JUDGE_RUBRIC,
our wording of the reference's criteria) and 0.2 code verification (the last number within an
absolute 0.1). Without a judge (the default) the run says so at start and trains on verification,
with small tool-use (0.2) and format (0.1) terms in place of the judge's tool-use criteria.
Data: the reference's CSVs work as they are (a question or prompt column, an expression, an answer).
The loaders read local files and dataset ids, not URLs: download them, then pass the files.
    https://raw.githubusercontent.com/Danau5tin/calculator_agent_rl/main/datasets/calculator_train.csv
        -> --train_data=calculator_train.csv (its 1,500 training questions)
    https://github.com/Danau5tin/agentic_environments, branch qwen, file
    examples/calculator_agent/datasets/basic_calculations_eval.csv
        -> --eval_data=basic_calculations_eval.csv (its 158 evaluation questions)
Without them, questions are generated (grpo.envs.calculator_data). On a GPU the memory plan sizes the
sampler's batch and KV budget, the micro-batch and gradient checkpointing at start
(`python -m grpo.cli.plan`).

| setting | the reference | here | why |
| --- | --- | --- | --- |
| samples per question G, temperature | 8, 0.9 | 8, 0.9 | |
| prompts a step | 8 per training GPU / G | same (`--prompts_per_step 0`) | |
| lr, schedule | 1e-6, 10 warm-up steps then constant | same | |
| mu, beta, grad clip | 2, 0.002, 0.1 | same | |
| prompt / completion tokens | 1,024 / 500 | same | |
| tool calls | at most 5 | 5 (`max_turns` 6: calls and the answer) | |
| reward | judge 0.8 + verification 0.2 | same with `--judge_base_url` | |
| reward without a judge | | verification + tool use 0.2 + format 0.1 | no judge server by default |
| verification | last number | `Answer:` line (else last number) | the system prompt asks for the line |
| verification tolerance | absolute 0.1 | same | |
| judge | Claude 3.5 Haiku, its rubric | any OpenAI-compatible model, our rubric | |
| sampling | vLLM on separate GPUs | the training GPUs, the weights in place | the design |
| data | its 1,500 / 158 CSVs | generated, or the CSVs (--train_data, --eval_data) | no network at run time |
"""
import os
from dataclasses import dataclass

from grpo.config import Config
from grpo.flags import parse_args
from grpo.infra.data import epoch_steps, load_or_exit
from grpo.envs.calculator import DEFAULT_WEIGHTS, JUDGE_WEIGHTS, CalculatorEnv, generate_questions
from grpo.envs.tasks import calculator_example
from grpo.fit.sizing import run_command
from grpo.trainer import train


@dataclass
class CalculatorQwen(Config):
    model_path: str = "Qwen/Qwen2.5-3B-Instruct"  # a local HF folder, or a hub id fetched once into its cache
    output_dir: str = "runs/calculator_qwen25_3b"
    train_questions: int = 1500       # one epoch: max_steps = train_questions // prompts_per_step
    eval_questions: int = 200
    judge_base_url: str = ""          # optional LLM judge (OpenAI-compatible /chat/completions):
                                      # 0.8 of the reward
    judge_model: str = ""
    answer_abs_tol: float = 0.1       # verification: right within this absolute difference (the reference's)
    prompts_per_step: int = 0         # 0: 8 generations per GPU / G (the reference's rule: 8 on 8 GPUs)
    num_generations: int = 8
    max_steps: int = 0                # 0 = one epoch
    temperature: float = 0.9
    learning_rate: float = 1e-6
    num_iterations: int = 2           # mu
    max_grad_norm: float = 0.1
    max_prompt_length: int = 1024
    max_completion_length: int = 500
    max_turns: int = 6                # assistant turns: at most 5 calculator calls, then the answer
    loss_type: str = "grpo"
    beta: float = 0.002               # KL to the starting model (k3)
    warmup_steps: int = 10            # optimizer steps, then constant
    eval_limit: int = 200
    eval_steps: int = 50
    eval_temperature: float = 0.2     # the reference's evaluation (REFERENCE_EVAL): one sample at T 0.2,
    eval_turn_tokens: int = 1000      # at most 1,000 tokens a turn,
    eval_max_completion_length: int = 6500  # 5 calls and the answer, with the calculator's outputs
    save_steps: int = 25
    dtype: str = "auto"               # bf16 compute on GPU, fp32 master weights

    def check(self):
        if self.judge_base_url and not self.judge_model:
            raise ValueError("bad config: --judge_base_url needs --judge_model (the model the server serves)")
        if self.prompts_per_step == 0:  # under torchrun WORLD_SIZE is set before this runs
            self.prompts_per_step = reference_prompts_per_step(int(os.environ.get("WORLD_SIZE", 1)),
                                                               self.num_generations)
        return super().check()


def reference_prompts_per_step(gpus: int, G: int, per_gpu: int = 8) -> int:
    """The reference's batch: `per_gpu` generations on each training GPU, G of them a prompt."""
    return max(1, per_gpu * gpus // G)


def reward_weights(cfg: CalculatorQwen) -> dict:
    """The reference's weights with a judge; without one, say what the run trains on instead."""
    if cfg.judge_base_url:
        return JUDGE_WEIGHTS
    print("calculator: no LLM judge (--judge_base_url): the reward is verification (1.0) with tool-use (0.2) "
          "and format (0.1) terms, where the reference's was 0.8 a judge's score of the calculator's use "
          "and 0.2 verification")
    return DEFAULT_WEIGHTS


def load(cfg: CalculatorQwen, source: str, count: int, seed: int, split: str) -> list[dict]:
    if not source:
        return generate_questions(count, seed, split)
    return load_or_exit(source, "calculator recipe", question_field=cfg.question_field,
                        answer_field=cfg.answer_field, prepare=calculator_example)


def eval_setup(cfg: CalculatorQwen) -> tuple:
    """The eval env and questions (also `python -m grpo.cli.eval --run`): the reference's protocol
    (REFERENCE_EVAL, by the fields above), on --eval_data or on generated questions (said at start).
    No judge: an eval scores verification only, so a judge's requests there would be spent for nothing."""
    if not cfg.eval_data:
        print(f"calculator: evals on {cfg.eval_questions} generated questions (no --eval_data): "
              "the reference's protocol, not its 158 questions")
    return (CalculatorEnv(rel_tol=0.0, abs_tol=cfg.answer_abs_tol),
            load(cfg, cfg.eval_data, cfg.eval_questions, cfg.seed + 1, "eval"))


def main(cls=CalculatorQwen):
    cfg = parse_args(cls)
    questions = load(cfg, cfg.train_data, cfg.train_questions, cfg.seed, "train")
    eval_env, eval_qs = eval_setup(cfg)
    env = CalculatorEnv(judge_base_url=cfg.judge_base_url or None, judge_model=cfg.judge_model or None,
                        judge_api_key=os.environ.get("JUDGE_API_KEY"),  # not a flag: flags land in logs
                        rel_tol=0.0, abs_tol=cfg.answer_abs_tol)
    if cfg.max_steps == 0:
        cfg.max_steps = epoch_steps(len(questions), cfg.prompts_per_step)
    train(cfg, env, questions, eval_qs, reward_weights=reward_weights(cfg), eval_env=eval_env)


if __name__ == "__main__":
    run_command(main)  # a run the memory plan refuses: its line and table
