"""The trainer's one flat config, its command line, and per-GPU profiles.

A recipe subclasses `Config` with its own defaults and fields; precedence is
    Config defaults < recipe defaults < GPU profile (pick_profile) < command line.
    python recipes/calculator_smollm2_cpu.py --group_size=8 --lr=1e-6
Field names follow TRL's GRPOConfig where the meaning is the same (num_iterations = mu,
epsilon / epsilon_high, beta, loss_type, scale_rewards, mask_truncated_completions).
"""
import dataclasses
import sys
import typing
from dataclasses import dataclass

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")


@dataclass
class Config:
    # ---- run
    model_path: str = ""              # HF checkpoint folder (config.json + safetensors)
    output_dir: str = "runs/grpo"     # checkpoints, metrics.jsonl, TensorBoard, export
    seed: int = 0
    num_steps: int = 100              # optimizer steps of RL (each: sample, score, mu updates)
    prompts_per_step: int = 8         # B: prompts per step (global, over all ranks)
    group_size: int = 8               # G: completions per prompt
    dtype: str = "auto"               # compute dtype: auto = bf16 on CUDA, fp32 on CPU
    profile: str = "auto"             # GPU profile for batch sizes and budgets; "none" = off
    # ---- sampling
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    min_p: float = 0.0
    max_prompt_len: int = 1024
    max_completion_len: int = 512     # all completion tokens, sampled and injected
    max_turns: int = 0                # assistant turns per episode; 0 = the env's own limit (env.max_turns)
    enable_thinking: bool = True      # passed to the chat template (Qwen3: False = non-thinking mode)
    gen_batch: int = 64               # sampler slots (rows decoded together)
    kv_budget_gb: float = 0.0         # sampler KV-cache budget; 0 = sized from gen_batch
    # ---- GRPO
    num_iterations: int = 1           # mu: policy updates per batch of rollouts
    loss_type: str = "grpo"           # grpo | bnpo | dr_grpo | dapo (DESIGN.md, "The math, pinned")
    scale_rewards: str = "group"      # advantage std: group | batch | none (Dr. GRPO)
    epsilon: float = 0.2              # eps_low of the clip range
    epsilon_high: float = 0.2         # eps_high (DAPO's clip-higher: 0.28)
    delta: float = 0.0                # two-sided clipping: cap rho at delta; 0 = off
    dual_clip: float = 0.0            # dual-clip c > 1 for A < 0; 0 = off
    beta: float = 0.0                 # k3 KL weight; 0 = no reference model is loaded
    tis_cap: float = 2.0              # truncated importance sampling cap C; 0 = off
    mask_truncated_completions: bool = False
    overlong_buffer: int = 0          # DAPO overlong penalty buffer L_buf; 0 = off
    drop_flat_groups: bool = False    # dynamic sampling (DAPO): drop flat groups (all rewards equal)...
    max_refills: int = 2              # ...and refill with fresh prompts, at most this many extra rollouts per step
    # ---- optimization
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    warmup_steps: int = 0
    lr_schedule: str = "constant"     # constant | cosine (after warmup)
    max_grad_norm: float = 1.0        # 0 = no clipping
    micro_batch_tokens: int = 8192    # token budget of one packed micro-batch (padding included)
    activation_checkpointing: bool = False
    # ---- supervised warm-start (before RL; 0 steps = off)
    sft_steps: int = 0
    sft_batch: int = 8
    sft_lr: float = 1e-5
    # ---- logging, eval, checkpoints
    log_completions_every: int = 10   # sample completions to TensorBoard as text
    eval_every: int = 0               # 0 = only before and after training
    eval_limit: int = 200             # eval questions
    eval_n: int = 1                   # samples per eval question (mean@k, pass@k)
    eval_temperature: float = 0.0     # 0 = greedy
    save_every: int = 50              # checkpoint every N steps (and on SIGTERM); 0 = off
    keep_last: int = 2                # checkpoints kept
    resume: bool = False              # continue from the newest complete checkpoint
    export: bool = True               # Hugging Face export at the end
    time_budget_min: float = 0.0      # stop RL after this many minutes; 0 = no limit

    def check(self):
        """Clear errors before any work starts."""
        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(f"bad config: {msg}")
        need(self.loss_type in LOSS_TYPES, f"loss_type={self.loss_type!r}, expected one of {LOSS_TYPES}")
        need(self.scale_rewards in SCALES, f"scale_rewards={self.scale_rewards!r}, expected one of {SCALES}")
        need(self.lr_schedule in ("constant", "cosine"), f"lr_schedule={self.lr_schedule!r}")
        need(self.dtype in ("auto", "float32", "bfloat16"), f"dtype={self.dtype!r}")
        need(self.group_size >= 2, f"group_size={self.group_size}: GRPO needs at least 2 completions per prompt")
        need(self.prompts_per_step >= 1 and self.num_steps >= 0, "prompts_per_step >= 1 and num_steps >= 0")
        need(self.lr > 0 and self.sft_lr > 0, "learning rates must be > 0")
        need(0 <= self.epsilon < 1 and self.epsilon_high >= 0, f"epsilon={self.epsilon}, epsilon_high={self.epsilon_high}")
        need(self.delta == 0 or self.delta > 1 + self.epsilon_high, f"delta={self.delta} must exceed 1 + epsilon_high")
        need(self.dual_clip == 0 or self.dual_clip > 1, f"dual_clip={self.dual_clip} must be > 1")
        need(self.beta >= 0 and self.tis_cap >= 0, "beta and tis_cap must be >= 0")
        need(self.temperature > 0, f"temperature={self.temperature} must be > 0 (use top_k=1 for greedy)")
        need(0 < self.top_p <= 1 and self.top_k >= 0 and 0 <= self.min_p < 1, "top_p in (0, 1], top_k >= 0, min_p in [0, 1)")
        need(self.max_completion_len >= 1 and self.max_prompt_len >= 1 and self.max_turns >= 0, "lengths >= 1 and max_turns >= 0")
        need(self.overlong_buffer < self.max_completion_len, "overlong_buffer must be < max_completion_len")
        need(self.num_iterations >= 1 and self.micro_batch_tokens >= 1, "num_iterations and micro_batch_tokens >= 1")
        need(self.micro_batch_tokens >= self.max_prompt_len + self.max_completion_len,
             f"micro_batch_tokens={self.micro_batch_tokens} cannot hold one sequence of "
             f"{self.max_prompt_len}+{self.max_completion_len} tokens")
        return self


# ----------------------------------------------------------------------------- command line

def _convert(name: str, text: str, typ):
    if typ is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--{name}={text!r}: expected true or false")
    try:
        return typ(text)
    except ValueError:
        raise ValueError(f"--{name}={text!r}: expected {typ.__name__}") from None


def parse_args(cls=Config, argv: list[str] | None = None):
    """`--field=value` (or `--flag` for a bool) over cls's defaults and the GPU profile.
    Unknown fields and values of the wrong type are errors; `--help` lists every field."""
    argv = sys.argv[1:] if argv is None else argv
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if "--help" in argv or "-h" in argv:
        print((cls.__doc__ or "").strip() + "\n\nfields (--name=value):")
        defaults = cls()
        for name in fields:
            print(f"  --{name}={getattr(defaults, name)!r}  ({hints[name].__name__})")
        raise SystemExit(0)
    given = {}
    for arg in argv:
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}: use --field=value")
        name, eq, text = arg[2:].partition("=")
        if name not in fields:
            close = [f for f in fields if name.split("_")[0] in f]
            raise ValueError(f"unknown field --{name}" + (f" (did you mean {', '.join('--' + c for c in close[:4])}?)" if close else ""))
        if not eq and hints[name] is not bool:
            raise ValueError(f"--{name} needs a value: --{name}=...")
        given[name] = _convert(name, text, hints[name]) if eq else True
    cfg = cls()
    profile = pick_profile() if given.get("profile", cfg.profile) == "auto" else {}
    for name, value in {**profile, **given}.items():
        if name in fields:  # a profile may name fields a recipe does not use
            setattr(cfg, name, value)
    return cfg.check()


# ----------------------------------------------------------------------------- GPU profiles

# Per GPU: sampler slots, KV-cache budget and packed micro-batch size for a ~0.5-4B model in
# bf16 with fp32 master weights under FSDP. Chosen from memory size; the recipes' own
# batch shapes (prompts_per_step, group_size) stay as the reference runs set them.
PROFILES = {
    "B200":     dict(gen_batch=256, kv_budget_gb=60, micro_batch_tokens=65536),
    "H200":     dict(gen_batch=256, kv_budget_gb=50, micro_batch_tokens=49152),
    "H100":     dict(gen_batch=256, kv_budget_gb=24, micro_batch_tokens=32768),
    "A100-80":  dict(gen_batch=256, kv_budget_gb=24, micro_batch_tokens=32768),
    "A100-40":  dict(gen_batch=128, kv_budget_gb=10, micro_batch_tokens=16384),
    "RTX 6000 Ada": dict(gen_batch=128, kv_budget_gb=12, micro_batch_tokens=16384, activation_checkpointing=True),
    "L40S":     dict(gen_batch=128, kv_budget_gb=12, micro_batch_tokens=16384, activation_checkpointing=True),
    "L4":       dict(gen_batch=64, kv_budget_gb=5, micro_batch_tokens=8192, activation_checkpointing=True),
    "cpu":      dict(dtype="float32"),
}


def pick_profile(name: str | None = None) -> dict:
    """Settings for the GPU found (or the one named), or the CPU profile without CUDA."""
    import torch
    if name is None:
        if not torch.cuda.is_available():
            return dict(PROFILES["cpu"])
        props = torch.cuda.get_device_properties(0)
        gb = props.total_memory / 2**30
        name = props.name
        for key in ("B200", "H200", "H100", "RTX 6000 Ada", "L40S", "L4"):
            if key in name:
                return dict(PROFILES[key])
        if "A100" in name:
            return dict(PROFILES["A100-80" if gb > 50 else "A100-40"])
        # unknown GPU: scale the smallest profile that fits its memory
        key = "A100-80" if gb > 70 else "L40S" if gb > 40 else "L4"
        print(f"pick_profile: unknown GPU {name!r} ({gb:.0f} GB), using the {key} profile")
        return dict(PROFILES[key])
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}: one of {list(PROFILES)}")
    return dict(PROFILES[name])
