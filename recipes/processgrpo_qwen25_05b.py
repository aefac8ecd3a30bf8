"""ProcessGRPO: Qwen2.5-0.5B-Instruct on numeric math, each reasoning step credited by how much it
raised a frozen copy's chance of finishing correctly (model card:
zaydsyed/TactLM-Math-ProcessGRPO-Qwen2.5-0.5B).

    torchrun --nproc_per_node=1 recipes/processgrpo_qwen25_05b.py
    # the controls, on the same filtered problems, data order and settings (no second filter pass):
    torchrun --nproc_per_node=1 recipes/processgrpo_qwen25_05b.py --credit=outcome \\
        --filter_solve_rate=false --train_data=runs/processgrpo_qwen25_05b/train_filtered.jsonl \\
        --output_dir=runs/processgrpo_outcome
    torchrun ... --credit=shuffled --filter_solve_rate=false \\
        --train_data=runs/processgrpo_qwen25_05b/train_filtered.jsonl ...
    # the benchmark: the 700 fresh multi-step problems, by operation count, paired gain over the base
    python -m grpo.envs.processgrpo --model_path runs/processgrpo_qwen25_05b/export \\
        --base Qwen/Qwen2.5-0.5B-Instruct
    # the card's other columns (its prompt, exact numbers, greedy, 3,072 tokens); GSM8K through the line above
    python -m grpo.cli.eval --model_path runs/processgrpo_qwen25_05b/export --task svamp \\
        --max_completion_length 3072
    #   ... --task gsm_symbolic, --task math500_numeric;
    #   python -m grpo.envs.processgrpo ... --data openai/gsm8k:main:test

Reference (one A100, one seed): mean validation accuracy over training 0.498 (process) vs 0.455
(final-answer only) vs 0.465 (shuffled credit); checkpoint at step 280, chosen by validation
accuracy. Base -> process (final-answer only in brackets), greedy, 3,072 new tokens: GSM8K 47.4 ->
49.7 (49.2), SVAMP 55.3 -> 64.0 (58.3), held-out 57.6 -> 65.7 (61.8), fresh multi-step 30.9 ->
36.1 (28.4); on 5- and 6-operation problems 20% / 11% -> 26% / 19% (14% / 9%).
Settings as the card: Dr. GRPO loss (no std scaling), 8 problems x 8 attempts a step, lr 1e-6,
3,072-token cap, K = 16 continuations, progress weight 3, the prompt of grpo.envs.processgrpo
(one worked example, then "Please reason step by step...") in training and eval; reward = exact
numeric match of the last \\boxed{} (`format`, a \\boxed{} present, is logged with weight 0).

Data, as the card (defaults; grpo.envs.processgrpo.load_sources): numeric-answer problems from
GSM8K (openai/gsm8k:main:train, its '#### n' answers), MATH (nlile/hendrycks-MATH-benchmark::train,
MATH's 12,000 problems outside MATH-500; rows whose answer is not a number dropped, counted) and
the generator (multistep:train:300, 2,100 problems of 2-8 operations), each id fetched once by
`datasets`. Offline, a local JSONL, CSV or Parquet file in the dataset's columns takes an id's
place: --train_data=gsm8k_train.jsonl,math_train.parquet,multistep:train:300 and
--eval_data=heldout:gsm8k_train.jsonl,heldout:math_train.parquet (keep `heldout:`: every eval
question is dropped from training, so a whole file there would leave its source out of training);
a missing id is a one-line error naming the flag. Then the card's filter, on by
default (--filter_solve_rate=false turns it off): the problems the frozen base model solves 1 to
7 times in 8 samples (temperature 1, up to 3,072 tokens), written to train_filtered.jsonl in the
output folder (read back on --resume; each process filters: meant for one GPU).
What the filter costs: 8 samples per candidate problem. The defaults give ~18,000 candidates
(GSM8K ~7,100, MATH's numeric rows ~9,000 (79% of 12,000, as in MATH-500, less the 5% held
out), the generator's 2,100), so ~145,000 samples: at ~300 tokens a 0.5B
solution ~43M sampled tokens (at most 442M at the 3,072 cap), ~40 training steps' worth of
continuations, all before step 1. It prints its estimate at start and the measured samples,
sampled and prompt tokens and seconds at the end. A cheaper pass takes fewer candidates (e.g.
multistep:train:100); its token cap is the training one, max_completion_length.

Checkpoint choice by validation accuracy (as the reference), on another distribution than the
benchmark: eval_data = held-out GSM8K + MATH (`heldout:SOURCE`: the 5% of each train split
that grpo.envs.processgrpo.heldout sets aside by question hash, ~370 + ~450; neither source has
a validation split of its own), shuffled once (seed 0) so the first eval_limit = 350 mix both,
and dropped from training (grpo.envs.processgrpo.without: disjoint by construction). The
generator's problems are left for the final benchmark. The eval runs every eval_steps = 20 steps,
and every 20 steps is a checkpoint (save_total_limit = 0 keeps them all, ~6 GB each with the
optimizer). Pick the step with the highest `eval/step<N>/mean` in metrics.jsonl
(`eval/before/mean` is the base, `eval/after/mean` the last step; per problem:
eval_step<N>.jsonl, `correct`), then export it:
    python -m grpo.cli.export runs/processgrpo_qwen25_05b/checkpoints/step_000280 runs/best

Credit (--credit, grpo.process.ProcessCredit, passed to train as `credit`): `process`, each step's
tokens get A + 3 x (p_k - p_(k-1)); `shuffled`, the same progress permuted over a solution's
steps; `outcome`, the advantages untouched (plain GRPO, bit for bit; the frozen copy is not
loaded unless the filter needs it). The frozen copy is a second grpo.models.model.Transformer (bf16 on
CUDA, fp32 on CPU, eval mode, no grad) with its own grpo.engine.sampler.Sampler of `continuation_batch`
slots; it also runs the filter.

What a step costs, an estimate (not measured on a GPU): 64 solutions x S boundaries x K = 16
continuations. S <= max_process_steps = 8 (later paragraphs are merged into the last step); a
0.5B solution has about 4-8 paragraphs, so S ~ 6: ~6,100 continuations, each from its boundary
to the end of the solution, capped at max_continuation_length = 1,024 tokens (a continuation
cut there counts as a failure). With ~150-200 tokens left on average that is ~1M sampled
tokens a step (8.4M at worst), ~50x the 64 rollouts' ~20k; the prefixes' prefill (~400
tokens each, forked into K rows) is small beside that. So continuations dominate the step
time; their budget is K, the boundary cap and the length cap above, decoded in continuous
batches of `continuation_batch` rows. To go faster, cut K (noisier p_k) or max_process_steps.
On CPU, SmolLM2-135M, 3 steps of 2 x 4 solutions with K = 4: docs/runs.md (2026-12-02).

Where this differs from the card, all of it:
- Data: NuminaMath, one of the card's four sources, is not read (the card does not say which
  subset or how many rows; AI-MO/NuminaMath-CoT is 860k rows, mostly non-numeric); the card's
  8,478 filtered problems and "exact splits" are in its dataset, which is not public here, so
  our filtered set is re-derived and its size will differ. The card's blind-solver check of
  each answer key (a second solver on disagreements) is not done: answer keys are the
  datasets'. Our numeric test: grpo.envs.processgrpo.parse_number (MATH-500: 396 numeric
  problems by it, the card's 389 by its own rule, which it does not publish).
- Validation: the card's validation set is not described; ours is the held-out GSM8K + MATH
  slice above, 350 problems. Its "held-out test" (510 problems of the training distribution,
  sealed before training) is not built here.
- Not in the card, chosen here: continuations at temperature 1 and at most 1,024 tokens, at most
  8 boundaries per solution, 400 steps (the card's checkpoint is step 280 of an unstated total),
  eval every 20 steps, the 5% held-out slice, the filter's samples at the training temperature 1.
- Steps are the paragraphs of the text the model wrote (grpo.process.step_ends), as the card
  says; a solution with no blank line at all is split at its lines instead. The card's model
  drifted late in training to steps on single lines (its "merges reasoning steps"), which weakened
  its per-step credit; here such a solution keeps one step a line. A solution that mixes both is
  split at its blank lines only.
- Eval: GSM8K through `python -m grpo.envs.processgrpo --data openai/gsm8k:main:test` (the
  card's prompt); `grpo.cli.eval --task gsm8k` is another protocol (the inspect_evals prompt).
  SVAMP is ChilleD/SVAMP's 300-problem test split (the card does not name its split); IFEval
  and MMLU-Redux are not run here. The confidence intervals are grpo.infra.stats.paired_bootstrap's.
- Not yet run on a GPU with the real weights: no figure of this recipe's is a reproduction.

| setting | the card | here | why |
| --- | --- | --- | --- |
| loss, batch, lr | Dr. GRPO, 8 x 8, 1e-6 | same | |
| K, progress weight, token cap | 16, 3, 3,072 | same | |
| data | MATH, GSM8K, NuminaMath, generator | no NuminaMath | subset unstated |
| filtered problems | 8,478 | filtered here | set not public |
| answer-key check | blind solver + second solver | the datasets' keys | |
| steps | paragraphs | paragraphs, else lines | keeps per-step credit through the card's drift |
| continuations | unstated | T 1, <= 1,024 tokens, <= 8 boundaries | |
| length, checkpoint | step 280 of unstated | 400 steps, pick by validation | |
| validation | undescribed | 350 held-out GSM8K + MATH | |
"""
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo.infra import dist
from grpo.config import Config
from grpo.flags import parse_args
from grpo.infra.checkpoint import refuse_used_dir
from grpo.infra.data import DataError
from grpo.envs.processgrpo import (DEFAULT_WEIGHTS, TRAIN_SOURCES, VALIDATION_SOURCES, OneShotMathEnv,
                                   filter_by_solve_rate, load_sources, without)
from grpo.fit.memory import frozen_copy_terms
from grpo.models.model import Transformer
from grpo.process import ProcessCredit
from grpo.engine.sampler import Sampler
from grpo.fit.fallback import kernels_of
from grpo.fit.sizing import run_command
from grpo.trainer import train

CREDITS = ("process", "outcome", "shuffled")


@dataclass
class ProcessGRPOQwen(Config):
    model_path: str = "Qwen/Qwen2.5-0.5B-Instruct"  # a local HF folder, or a hub id fetched once
    output_dir: str = "runs/processgrpo_qwen25_05b"
    train_data: str = TRAIN_SOURCES   # comma-separated: files, dataset ids, multistep:train:N
    eval_data: str = VALIDATION_SOURCES  # checkpoint choice: held-out GSM8K + MATH,
                                      # not the benchmark's generator
    credit: str = "process"           # process | outcome (final-answer only) | shuffled (control)
    num_continuations: int = 16       # K: continuations of the frozen copy per step boundary
    progress_weight: float = 3.0      # token advantage = A + weight x its step's progress
    max_process_steps: int = 8        # step boundaries per solution (later steps merged into the last)
    max_continuation_length: int = 1024  # tokens per continuation; one cut there counts as a failure
    max_continuation_total: int = 0   # cap on a step's boundaries x K x length; over it the longest
                                      # solutions get the outcome advantage only; 0 = no cap
    continuation_batch: int = 256     # the frozen copy's sampler slots (rows decoded together)
    filter_solve_rate: bool = True    # keep problems the base model solves 1-7 times in 8 (a rollout pass)
    max_steps: int = 400
    prompts_per_step: int = 8
    num_generations: int = 8
    learning_rate: float = 1e-6
    loss_type: str = "dr_grpo"
    scale_rewards: str = "none"       # Dr. GRPO: no std division (arXiv 2503.20783)
    beta: float = 0.0
    temperature: float = 1.0
    max_prompt_length: int = 1024     # the worked example + a question: ~300 tokens; MATH problems run longer
    max_completion_length: int = 3072
    eval_limit: int = 350
    eval_steps: int = 20
    save_steps: int = 20
    save_total_limit: int = 0         # keep every checkpoint: the best by validation is chosen afterwards

# ----------------------------------------------------------------------------- setup


def frozen_copy(cfg: Config, device: torch.device) -> Transformer:
    """The starting model, frozen: the continuations' judge of how likely a prefix is to succeed."""
    bf16 = cfg.dtype == "bfloat16" or cfg.dtype == "auto" and device.type == "cuda"
    model = Transformer.from_pretrained(cfg.model_path, dtype=torch.bfloat16 if bf16 else torch.float32,
                                        device=device)
    if cfg.adapter_path:  # a run from a LoRA adapter starts from the base plus that adapter
        from grpo.models.lora import add_lora, load_adapter, read_adapter
        settings, state = read_adapter(cfg.adapter_path)
        load_adapter(add_lora(model, settings), state, cfg.adapter_path)
    return model.eval().requires_grad_(False)


def filtered(cfg: Config, sampler, tokenizer, env, examples: list[dict]) -> list[dict]:
    """The problems the base model solves 1 to 7 times in 8, saved beside the run (so the controls
    and a --resume train on exactly these)."""
    path = Path(cfg.output_dir) / "train_filtered.jsonl"
    if not cfg.resume:  # before hours of filtering, and before this file is overwritten
        try:
            refuse_used_dir(cfg.output_dir)
        except FileExistsError as e:
            raise SystemExit(f"error: {e}") from None
    if cfg.resume and path.exists():
        print(f"filter: reading {path} (--resume)")
        return [json.loads(line) for line in open(path)]
    samples = 8 * len(examples)   # the estimate: ~300 tokens is a 0.5B model's typical solution
    print(f"filter: {len(examples)} candidate problems x 8 samples = {samples:,} samples; at most "
          f"{samples * cfg.max_completion_length:,} sampled tokens ({cfg.max_completion_length} each), "
          f"~{samples * 300:,} at ~300 a solution (--filter_solve_rate=false skips it)")
    kept, solved, cost = filter_by_solve_rate(sampler, tokenizer, env, examples, temperature=cfg.temperature,
                                              max_tokens=cfg.max_completion_length, seed=cfg.seed,
                                              chat_kwargs=dict(enable_thinking=cfg.enable_thinking))
    print(f"filter: kept {len(kept)} of {len(examples)} problems (solved 1-7 times in 8); "
          f"{solved.count(0)} never solved, {solved.count(8)} always")
    print(f"filter cost: {cost['samples']:,} samples, {cost['completion_tokens']:,} sampled tokens "
          f"({cost['completion_tokens'] / max(cost['samples'], 1):.0f} a sample), {cost['prompt_tokens']:,} "
          f"prompt tokens, {cost['seconds']:.0f} s")
    if not kept:  # training on nothing is no run
        raise SystemExit(f"error: the filter kept none of {len(examples)} problems: the model solves them "
                         f"all or never (--filter_solve_rate=false trains on them unfiltered)")
    if os.environ.get("RANK", "0") == "0":   # before the process group: torchrun's rank
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(ex) + "\n" for ex in kept))
    return kept


def load(sources: str, flag: str, *fields) -> list[dict]:
    try:
        return load_sources(sources, *fields)
    except DataError as e:  # one line, not a traceback: the usual cause is a missing file or no network
        example = ("heldout:gsm8k_train.jsonl,heldout:math_train.parquet" if flag == "--eval_data"
                   else "gsm8k_train.jsonl,math_train.parquet,multistep:train:300")
        raise SystemExit(f"processgrpo recipe: {e} (offline: {flag}={example})") from None


def eval_setup(cfg: ProcessGRPOQwen) -> tuple:
    """The one-shot boxed env and the validation problems, shuffled so that any eval_limit takes
    every source (also `python -m grpo.cli.eval --run`)."""
    examples = load(cfg.eval_data, "--eval_data") if cfg.eval_data else []
    random.Random(0).shuffle(examples)
    return OneShotMathEnv(), examples


def data(cfg: ProcessGRPOQwen) -> tuple[list[dict], object, list[dict]]:
    """(training problems, env, validation problems): training less every validation question."""
    train_examples = load(cfg.train_data, "--train_data", cfg.question_field, cfg.answer_field)
    env, eval_examples = eval_setup(cfg)
    kept = without(train_examples, eval_examples)
    print(f"data: {len(kept)} training problems ({len(train_examples) - len(kept)} held out for "
          f"validation), {len(eval_examples)} validation problems (the first {cfg.eval_limit} evaluated)")
    return kept, env, eval_examples


def memory_terms(cfg, args, world: int, device: str, memory: int) -> list:
    """For python -m grpo.cli.plan: the frozen copy and its sampler, held through the run (the trainer counts
    them from the objects themselves: grpo.process.ProcessCredit.memory_terms)."""
    if cfg.credit == "outcome" and not cfg.filter_solve_rate:
        return []
    c = 2 if device == "cuda" else 4
    budget = int(cfg.kv_budget_gb * 2**30) or (memory // 2 if device == "cuda" else 2 << 30)
    length = cfg.max_prompt_length + cfg.max_completion_length + cfg.max_continuation_length
    return frozen_copy_terms(args, c, cfg.continuation_batch, length, budget)


def main(cls=ProcessGRPOQwen):
    cfg = parse_args(cls)
    if cfg.credit not in CREDITS:
        raise SystemExit(f"error: --credit={cfg.credit!r}: one of {', '.join(CREDITS)}")
    train_examples, env, eval_examples = data(cfg)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
    sampler = None   # the outcome control needs no frozen copy (unless it filters the data)
    if cfg.credit != "outcome" or cfg.filter_solve_rate:
        sampler = Sampler(frozen_copy(cfg, dist.device()), tokenizer, gen_batch=cfg.continuation_batch,
                          kv_budget_bytes=int(cfg.kv_budget_gb * 2**30) or None, cuda_graphs=cfg.cuda_graphs)
    if cfg.filter_solve_rate:
        with kernels_of(cfg):  # train() enters it for the run; the filter runs before
            train_examples = filtered(cfg, sampler, tokenizer, env, train_examples)
        sampler = sampler if cfg.credit != "outcome" else None
    credit = ProcessCredit(sampler, tokenizer, env, num_continuations=cfg.num_continuations,
                           weight=cfg.progress_weight, mode=cfg.credit, temperature=cfg.temperature,
                           max_continuation_tokens=cfg.max_continuation_length,
                           max_steps=cfg.max_process_steps, max_total_tokens=cfg.max_continuation_total,
                           seed=cfg.seed)
    return train(cfg, env, train_examples, eval_examples, reward_weights=DEFAULT_WEIGHTS, credit=credit)


if __name__ == "__main__":
    run_command(main)  # a run the memory plan refuses: its line and table
