"""What a run is built from, at setup (grpo.trainer.start_run): its settings and data checked before
anything loads, then, once the memory plan has passed it (grpo/fit/sizing.py), the run folder's record,
the tokenizer, the policy in the dtypes this machine computes in, the frozen reference, AdamW and its
schedule, the sampler over the policy's own weights, the checkpoints (the newest loaded when the run
resumes) and the logs."""
import dataclasses
import math

import torch

from grpo.config import Config
from grpo.engine.kv_cache import KVCache
from grpo.engine.sampler import Sampler
from grpo.fit.precision import measure, set_autocast, set_threads
from grpo.fit.sizing import model_folder
from grpo.infra import dist
from grpo.infra.checkpoint import Checkpointer, note_run, open_run_dir, refuse_used_dir, run_meta
from grpo.infra.metrics import Logger
from grpo.infra.report import check_reporters, open_trackers, reporters
from grpo.models.lora import (BaseModel, adapter_settings, adapters, add_lora, cast_base, load_adapter,
                              read_adapter, settings_of, trainable)
from grpo.models.model import Transformer


def check_run(cfg: Config, train_examples: list, sft_examples: list):
    """One-line errors before anything loads or is written (each rank reaches the same verdict): the
    model's folder, the output folder (never another run's), the data, the batches' split over ranks."""
    world = dist.world_size()
    if not str(cfg.model_path).strip():
        raise ValueError("model_path is empty: pass --model_path=a Hugging Face checkpoint folder or hub id")
    model_folder(cfg.model_path)  # a missing folder: one line, before anything is written
    if not cfg.resume:
        refuse_used_dir(cfg.output_dir)  # before config.json is written (open_run_dir checks it again)
    check_reporters(cfg.report_to)
    if not train_examples:
        raise ValueError("no training examples: the dataset is empty")
    if (cfg.prompts_per_step // world) % cfg.optimizer_steps():
        raise ValueError(f"steps_per_generation / gradient_accumulation_steps = {cfg.optimizer_steps()} "
                         f"optimizer steps must divide the prompts each rank samples ({cfg.prompts_per_step} "
                         f"/ {world}): each optimizer step takes whole groups")
    if cfg.prompts_per_step % world:
        raise ValueError(f"prompts_per_step={cfg.prompts_per_step} must be a multiple of the world size "
                         f"{world} (each rank samples prompts_per_step / world size prompts)")
    if cfg.dist_timeout_min <= 0:
        raise ValueError(f"dist_timeout_min={cfg.dist_timeout_min} must be > 0")
    if cfg.adapter_path:  # the adapter's own shape wins over the flags (recorded in config.json as used)
        lora = adapter_settings(cfg.adapter_path)
        cfg.lora_r, cfg.lora_alpha, cfg.use_rslora = lora.r, lora.alpha, lora.rslora
        cfg.lora_target_modules = ",".join(lora.targets)
    if cfg.sft_steps > 0 and (cfg.sft_batch % world or len(sft_examples) < cfg.sft_batch):
        raise ValueError(f"sft_batch={cfg.sft_batch} must be a multiple of the world size {world} and at "
                         f"most the {len(sft_examples)} warm-start examples")


def record_run(cfg: Config):
    """Rank 0: claim the output folder (open_run_dir) and write config.json with the profile as
    parse_args applied it (grpo.fit.profile.apply_profile), or none for a Config built in Python."""
    profile = getattr(cfg, "profile_applied", {"name": cfg.profile, "resolved": None, "settings": {},
                                              "note": "Config built in Python: no profile applied"})
    meta = run_meta(profile) | {"config_class": type(cfg).__name__}   # grpo.cli.eval --run rebuilds it
    open_run_dir(cfg.output_dir, dataclasses.asdict(cfg), cfg.resume, meta)


def build(cfg: Config, device: torch.device) -> tuple:
    """Tokenizer, policy (fp32 master weights, sharded; bf16 compute on CUDA), the frozen
    reference when beta > 0, AdamW, the lr schedule, and the sampler over the policy's weights."""
    from transformers import AutoTokenizer
    path = model_folder(cfg.model_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    bf16 = cfg.dtype == "bfloat16" or cfg.dtype == "auto" and device.type == "cuda"
    compute_dtype = torch.bfloat16 if bf16 else torch.float32
    threads = set_threads(cfg.num_threads) if device.type == "cpu" else torch.get_num_threads()
    dist.print0(f"grpo | {cfg.model_path} | world {dist.world_size()} | {compute_dtype} | {threads} threads "
                f"| {cfg.max_steps} steps x {cfg.prompts_per_step} prompts x G={cfg.num_generations}")
    # fp32 master weights; under LoRA only the adapters are trained, and the frozen base stays in the compute
    # dtype (bf16 on a GPU: a 3B base is 6 GB, not 6 + 12 of master copy and 24 of Adam)
    model = Transformer.from_pretrained(path, dtype=compute_dtype if cfg.use_peft else torch.float32,
                                        device=device)
    if cfg.use_peft:
        with_lora(model, cfg)
    model.activation_checkpointing = cfg.gradient_checkpointing
    # the sampler and the evals run this same model; rank 0's measurement decides for every rank
    rates = lambda: dist.broadcast(  # noqa: E731
        measure(model.args.dim, model.args.ffn_dim) if dist.is_main() else None)
    dist.print0(set_autocast(model, cfg.autocast_bf16, device, rates))
    # the frozen base in its matmuls' dtype (lora.cast_base says why)
    if cfg.use_peft and model.autocast_bf16:
        cast_base(model, torch.bfloat16)
    dist.on_rank0(note_run, cfg.output_dir, {"autocast_bf16_chosen": model.autocast_bf16})
    dist.shard(model, compute_dtype)
    ref_model = None
    if cfg.beta > 0 and cfg.use_peft:  # the reference is the frozen base: the same model, adapters off
        ref_model = BaseModel(model)
    elif cfg.beta > 0:  # frozen: loaded in the dtype FSDP computes it in (bf16 on a GPU), not as fp32 master
        # weights (a 3B reference: 6 GB, not 12); one CPU process, which nothing casts, keeps fp32
        ref_dtype = compute_dtype if dist.is_dist() or torch.cuda.is_available() else torch.float32
        ref_model = Transformer.from_pretrained(path, dtype=ref_dtype, device=device)
        ref_model.eval().requires_grad_(False)
        ref_model.autocast_bf16 = model.autocast_bf16
        dist.shard(ref_model, compute_dtype)
    optimizer = torch.optim.AdamW(trainable(model), lr=cfg.learning_rate, eps=cfg.adam_epsilon,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    total_steps = cfg.max_steps * cfg.num_iterations * cfg.optimizer_steps()  # optimizer steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
    return tokenizer, model, ref_model, optimizer, scheduler, sampler_of(model, tokenizer, cfg)


def with_lora(model: Transformer, cfg: Config):
    """LoRA adapters on the frozen base (a given adapter folder's weights loaded), said in a line."""
    add_lora(model, settings_of(cfg), seed=cfg.seed)
    if cfg.adapter_path:
        load_adapter(model, read_adapter(cfg.adapter_path)[1], cfg.adapter_path)
    n = sum(p.numel() for p in trainable(model))
    dist.print0(f"LoRA: r {cfg.lora_r}, alpha {cfg.lora_alpha} on {cfg.lora_target_modules}: {n / 1e6:.2f}M "
                f"trainable parameters ({n / sum(p.numel() for p in model.parameters()):.2%})")
    # the sampler never drops: a dropped forward scores another policy
    if cfg.disable_dropout and cfg.lora_dropout:
        for m in adapters(model):
            m.dropout = 0.0
        dist.print0(f"LoRA: lora_dropout {cfg.lora_dropout} not applied (disable_dropout; --disable_dropout "
                    "false applies it)")
    elif cfg.lora_dropout:
        dist.print0(f"LoRA: lora_dropout {cfg.lora_dropout} in the update's forward; old log-probs from a "
                    "no-grad pass without it (the ratio carries dropout's noise)")


def sampler_of(model: Transformer, tokenizer, cfg: Config) -> Sampler:
    """The sampler over the policy's own weights. Its KV cache takes the dtype of the weights it reads
    (bf16 under FSDP on GPU) and is sized per call (rollouts and evals, whose few-shot prompts may be
    longer), so the budget is checked now: it must hold one row of the longest sequence."""
    budget = int(cfg.kv_budget_gb * 2**30) or None
    with dist.gathered(model):
        sampler = Sampler(model, tokenizer, gen_batch=cfg.gen_batch, kv_budget_bytes=budget,
                          cuda_graphs=cfg.cuda_graphs)
    runner = sampler.runner
    row = KVCache.slot_bytes(model.args, cfg.max_prompt_length + cfg.max_completion_length, runner.dtype)
    if runner.kv_budget_bytes < row:
        raise ValueError(f"kv_budget_gb={cfg.kv_budget_gb}: {runner.kv_budget_bytes / 2**30:.2f} GiB of KV "
                         "cache holds no row of max_prompt_length + max_completion_length tokens "
                         f"({row / 2**30:.2f} GiB)")
    return sampler


def lr_lambda(cfg: Config, total_steps: int):
    """The lr's factor at an optimizer step: a linear warm-up over warmup_steps, then constant or cosine."""
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_scheduler_type == "cosine":
            progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return 1.0
    return f


def open_run(cfg: Config, model, optimizer, scheduler) -> tuple[Checkpointer, dict | None, Logger | None]:
    """The run's checkpoints (a resumed run's newest loaded into model, optimizer and scheduler: what it
    found, else None) and rank 0's logs (a resumed run's continued from its step)."""
    ckpt = Checkpointer(cfg.output_dir, keep_last=cfg.save_total_limit)
    found = resume(ckpt, model, optimizer, scheduler, cfg)
    results = found.get("results", {}) if found else {}
    logger = Logger(cfg.output_dir, found["step"] if found else None, list(results),
                    "tensorboard" in reporters(cfg.report_to),
                    open_trackers(cfg, found is not None)) if dist.is_main() else None
    return ckpt, found, logger


def resume(ckpt: Checkpointer, model, optimizer, scheduler, cfg: Config) -> dict | None:
    """The newest complete checkpoint loaded into model, optimizer and scheduler, or None."""
    if not cfg.resume:
        return None
    found = ckpt.load_latest(model, optimizer, scheduler)
    if found is None:
        dist.print0(f"resume: no checkpoint in {ckpt.root}, starting from step 0")
        return None
    Checkpointer.check_position(found, cfg.prompts_per_step, cfg.seed)
    dist.print0(f"resumed from {found['path']} at step {found['step']} "
                f"(next prompt {found['step'] * cfg.prompts_per_step})")
    return found
