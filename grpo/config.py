"""The trainer's one flat config, its command line, and the profile.

A recipe subclasses `Config` with its own defaults and fields; precedence is
    Config defaults < profile < recipe defaults < --config YAML file < command line
(on a GPU the memory plan sizes, at start, what none of them set; it never overrides a forker's choice).
    python recipes/calculator_smollm2_cpu.py --num_generations=8 --learning_rate 1e-6
Field names are TRL's GRPOConfig names where the idea is the same (num_generations,
learning_rate, max_prompt_length, max_completion_length, max_steps, num_iterations = mu,
epsilon / epsilon_high, beta, loss_type, scale_rewards, mask_truncated_completions,
gradient_checkpointing, save_steps, save_total_limit, eval_steps, lr_scheduler_type). One
difference of meaning: `prompts_per_step` counts prompts over all ranks, where TRL's
per_device_train_batch_size counts completions per device (ours x G / ranks).
A field's trailing comment is its description in `--help`. The command line (YAML, --help,
one-line errors) and the profile sit beside the fields they read.
"""
import dataclasses
import difflib
import inspect
import re
import sys
import types
import typing
from dataclasses import dataclass

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")
# names before TRL's vocabulary (one vocabulary: no aliases, but a pointer in the error)
RENAMED = {"lr": "learning_rate", "num_steps": "max_steps", "group_size": "num_generations",
           "max_prompt_len": "max_prompt_length", "max_completion_len": "max_completion_length",
           "save_every": "save_steps", "keep_last": "save_total_limit", "eval_every": "eval_steps",
           "lr_schedule": "lr_scheduler_type", "activation_checkpointing": "gradient_checkpointing",
           "log_completions_every": "log_completions_steps", "sft_lr": "sft_learning_rate",
           "drop_zero_variance": "drop_flat_groups"}
CHOICES = {"loss_type": LOSS_TYPES, "scale_rewards": SCALES, "lr_scheduler_type": ("constant", "cosine"),
           "dtype": ("auto", "float32", "bfloat16"), "autocast_bf16": ("auto", "true", "false"),
           "importance_sampling_level": ("token", "sequence"), "kernels": ("auto", "torch")}
REPORTERS = ("tensorboard", "wandb", "trackio")  # report_to: comma-separated, or "none" / "all"


@dataclass
class Config:
    """GRPO trainer settings (grpo.trainer.train); a recipe subclasses it with its own defaults."""
    # ---- run
    model_path: str = ""              # HF checkpoint folder (config.json + safetensors) or hub id
    output_dir: str = "runs/grpo"     # checkpoints, metrics.jsonl, TensorBoard, export
    train_data: str = ""              # training questions: a JSONL, CSV or Parquet file or a dataset id name[:config[:split]]
    eval_data: str = ""               # eval questions, the same forms; empty = the recipe's own (or none)
    question_field: str = "question"  # the data column holding the question (else prompt, else problem)
    answer_field: str = "answer"      # the data column holding the answer
    seed: int = 0                     # seeds the data order, the sampler and the init
    max_steps: int = 100              # optimizer steps of RL (each: sample, score, mu updates)
    prompts_per_step: int = 8         # B: prompts per step over all ranks (TRL counts completions per device)
    num_generations: int = 8          # G: completions per prompt
    dtype: str = "auto"               # compute dtype: auto = bf16 on CUDA, fp32 on CPU
    autocast_bf16: str = "false"      # CPU, fp32 weights: bf16 matmuls in the blocks under torch.autocast;
                                      # auto = where a start-up measurement finds them faster (grpo.cpu)
    num_threads: int = 0              # CPU threads per rank; 0 = the cores this process may use, shared by its node's ranks
    profile: str = "auto"             # auto: on a GPU the memory plan sizes gen_batch, kv_budget_gb, micro_batch_tokens and
                                      # gradient_checkpointing where nothing set them; on a CPU, fp32; a GPU's name
                                      # (grpo.memory.GPU_MEMORY_GIB): sized for its memory; none: Config's values
    # ---- sampling
    temperature: float = 1.0          # sampling temperature of the rollouts (log-probs use it too)
    top_p: float = 1.0                # nucleus sampling; 1 = off
    top_k: int = 0                    # 0 = off
    min_p: float = 0.0                # 0 = off
    max_prompt_length: int = 1024     # prompt tokens (the sampler's cache holds prompt + completion)
    max_completion_length: int = 512  # all completion tokens, sampled and injected
    max_turns: int = 0                # assistant turns per episode; 0 = the env's own limit (env.max_turns)
    enable_thinking: bool = True      # passed to the chat template (Qwen3: False = non-thinking mode)
    gen_batch: int = 64               # sampler slots (rows decoded together)
    kv_budget_gb: float = 0.0         # sampler KV-cache budget; 0 = sized from gen_batch
    keep_kv_cache: bool = True        # GPU: the sampler's cache, state, decode weights and CUDA graphs stay through
                                      # the update (graphs captured once per run); false frees them for the update
                                      # each step, as a CPU always does (no graphs to keep)
    plan_memory: bool = True          # refuse to start where the memory plan's peak exceeds the device (grpo/memory.py;
                                      # python -m grpo.plan prints it); false: start anyway
    preflight: bool = False           # before step 1, one synthetic worst-case step (every row at full length, the largest
                                      # micro-batch): its measured peaks beside the plan's (grpo/preflight.py)
    cuda_graphs: bool = True          # GPU: each sampler decode window one CUDA graph; false = eager launches (slower)
    kernels: str = "auto"             # auto = grpo.kernels' Triton kernels on CUDA; torch = their PyTorch references
                                      # everywhere (slower; the way around a kernel that fails on your GPU)
    # ---- GRPO
    num_iterations: int = 1           # mu: policy updates per batch of rollouts
    steps_per_generation: int = 1     # S: each batch of rollouts split into S mini-batches of whole groups, each an
                                      # optimizer step (TRL's name); the old log-probs are the rollout policy's
    loss_type: str = "grpo"           # aggregation over tokens (grpo.loss: one function each)
    scale_rewards: str = "group"      # advantage std: group | batch | none (Dr. GRPO)
    epsilon: float = 0.2              # eps_low of the clip range
    epsilon_high: float | None = None  # eps_high; unset = epsilon (DAPO's clip-higher: 0.28)
    delta: float = 0.0                # two-sided clipping: cap rho at delta; 0 = off
    dual_clip: float = 0.0            # dual-clip c > 1 for A < 0; 0 = off
    importance_sampling_level: str = "token"  # the ratio rho: per token (GRPO), or one per sequence, the
                                      # geometric mean of its tokens' ratios (GSPO, arXiv 2507.18071)
    beta: float = 0.0                 # k3 KL weight; 0 = no reference model is loaded
    tis_cap: float = 2.0              # truncated importance sampling cap C; 0 = off
    mask_truncated_completions: bool = False  # no loss on completions cut at max_completion_length...
    keep_truncated_answers: bool = False  # ...except those cut after they answered (env.answered(t), if the env
                                      # has it): masking them too makes not stopping free while a wrong answer
                                      # that stops is pushed down, and a model can learn to repeat its answer line
    overlong_buffer: int = 0          # DAPO overlong penalty buffer L_buf; 0 = off
    drop_flat_groups: bool = False    # dynamic sampling (DAPO): drop groups whose rewards are all equal...
    max_refills: int = 2              # ...and refill them with fresh prompts, at most this many times a step
    # ---- optimization
    learning_rate: float = 1e-6       # AdamW peak learning rate
    weight_decay: float = 0.0         # AdamW weight decay
    adam_beta1: float = 0.9           # AdamW beta1
    adam_beta2: float = 0.99          # AdamW beta2
    adam_epsilon: float = 1e-8        # AdamW epsilon: updates are g / (sqrt(v) + eps), so a gradient far below eps
                                      # moves its weight by ~lr x g / eps rather than by lr (sign-like)
    warmup_steps: int = 0             # linear warmup, in optimizer steps (num_iterations x steps_per_generation a step)
    lr_scheduler_type: str = "constant"  # after warmup
    max_grad_norm: float = 1.0        # 0 = no clipping
    micro_batch_tokens: int = 8192    # token budget of one packed micro-batch (padding included)
    gradient_checkpointing: bool = False  # recompute each block's activations in backward
    share_prompt: bool = False        # update: each prompt computed once for all its completions (CPU,
                                      # G=6: 37% fewer tokens, update 1.14-1.34x; not yet measured on a GPU)
    # ---- LoRA (TRL's ModelConfig names; off = every weight is trained)
    use_peft: bool = False            # train LoRA adapters on a frozen base (grpo.lora) instead of every weight; adapters
                                      # usually want ~10x a full fine-tune's learning_rate
    lora_r: int = 16                  # the adapters' rank r
    lora_alpha: int = 32              # the adapters' output scaled by lora_alpha / r (lora_alpha / sqrt(r) with use_rslora)
    lora_dropout: float = 0.05        # dropout on the adapters' input, in training only
    lora_target_modules: str = "all-linear"  # comma-separated among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
                                      # down_proj; all-linear = all seven
    use_rslora: bool = False          # rank-stabilized LoRA (arXiv 2312.03732): scale by lora_alpha / sqrt(r)
    adapter_path: str = ""            # start from a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors);
                                      # its r, alpha and modules replace the flags'
    # ---- supervised warm-start (before RL; 0 steps = off)
    sft_steps: int = 0                # supervised steps on the env's gold trajectories before RL
    sft_batch: int = 8                # examples per warm-start step
    sft_learning_rate: float = 1e-5   # warm-start AdamW learning rate
    # ---- logging, eval, checkpoints
    log_completions_steps: int = 10   # every N steps: rollouts/step_N.jsonl and a TensorBoard table; 0 = off
    report_to: str = "tensorboard"    # trackers beside metrics.jsonl: tensorboard, wandb (offline unless
                                      # WANDB_MODE says otherwise), trackio; comma-separated, none or all
    eval_steps: int = 0               # eval every N steps; 0 = only before and after training
    eval_limit: int = 200             # eval questions
    eval_n: int = 1                   # samples per eval question (mean@k, pass@k)
    eval_max_completion_length: int = 0  # the evals' completion tokens; 0 = max_completion_length
    eval_temperature: float = 0.0     # 0 = greedy
    eval_greedy: bool = False         # with eval_temperature > 0: each eval also greedy, as "<phase>_greedy"
    eval_before_limit: int = 0        # questions for the eval before training; 0 = eval_limit
    save_steps: int = 50              # checkpoint every N steps (and on SIGTERM); 0 = off
    save_total_limit: int = 2         # checkpoints kept
    resume: bool = False              # continue from the newest complete checkpoint
    export: bool = True               # Hugging Face export at the end
    time_budget_min: float = 0.0      # stop RL before a step that would end past this many minutes; 0 = no limit
    run_budget_min: float = 0.0       # ...or past what leaves the run (this process), its last eval included, within this; 0 = none
    min_rl_steps: int = 1             # RL steps run even when run_budget_min is spent (the plan says so at start)
    min_eval_questions: int = 20      # run_budget_min never shrinks an eval below this many questions
    dist_timeout_min: float = 60.0    # how long a collective waits for the slowest rank (a long rollout)

    def check(self):
        """Clear errors before any work starts; resolves epsilon_high (unset = epsilon)."""
        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(f"bad config: {msg}")
        from grpo.cpu import normalize
        self.autocast_bf16 = normalize(self.autocast_bf16)  # true/false/1/0/yes/no, or a saved run's bool
        reporters = [r.strip() for r in self.report_to.split(",") if r.strip()]
        need(set(reporters) <= {*REPORTERS, "none", "all"},
             f"report_to={self.report_to!r}, expected a comma-separated list of {', '.join(REPORTERS)}, or none or all")
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            need(value in choices, f"{name}={value!r}, expected one of {', '.join(choices)}")
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        need(self.num_generations >= 2,
             f"num_generations={self.num_generations}: GRPO needs at least 2 completions per prompt")
        need(self.prompts_per_step >= 1 and self.max_steps >= 0, "prompts_per_step >= 1 and max_steps >= 0")
        need(self.learning_rate > 0 and self.sft_learning_rate > 0, "learning rates must be > 0")
        need(0 <= self.epsilon < 1 and self.epsilon_high >= 0,
             f"epsilon={self.epsilon}, epsilon_high={self.epsilon_high}")
        need(self.delta == 0 or self.delta > 1 + self.epsilon_high,
             f"delta={self.delta} must exceed 1 + epsilon_high")
        need(self.dual_clip == 0 or self.dual_clip > 1, f"dual_clip={self.dual_clip} must be > 1")
        need(self.beta >= 0 and self.tis_cap >= 0, "beta and tis_cap must be >= 0")
        need(self.temperature > 0, f"temperature={self.temperature} must be > 0 (use top_k=1 for greedy)")
        need(0 < self.top_p <= 1 and self.top_k >= 0 and 0 <= self.min_p < 1,
             "top_p in (0, 1], top_k >= 0, min_p in [0, 1)")
        need(self.max_completion_length >= 1 and self.max_prompt_length >= 1 and self.max_turns >= 0,
             "lengths >= 1 and max_turns >= 0")
        need(self.overlong_buffer < self.max_completion_length,
             "overlong_buffer must be < max_completion_length")
        need(self.num_iterations >= 1 and self.micro_batch_tokens >= 1 and self.steps_per_generation >= 1,
             "num_iterations, steps_per_generation and micro_batch_tokens >= 1")
        sized = getattr(self, "profile_applied", {}).get("sized_by_plan", ())  # on a GPU, sized at start to hold one
        need(self.micro_batch_tokens >= self.max_prompt_length + self.max_completion_length or "micro_batch_tokens" in sized,
             f"micro_batch_tokens={self.micro_batch_tokens} cannot hold one sequence of "
             f"{self.max_prompt_length}+{self.max_completion_length} tokens")
        need(self.gen_batch >= 1 and self.kv_budget_gb >= 0, "gen_batch >= 1 and kv_budget_gb >= 0")
        need(self.eval_n >= 1 and min(self.eval_limit, self.eval_before_limit, self.eval_temperature) >= 0,
             "eval_n >= 1, eval_limit >= 0, eval_before_limit >= 0, eval_temperature >= 0")
        need(self.lora_r >= 1 and self.lora_alpha > 0 and 0 <= self.lora_dropout < 1,
             f"lora_r={self.lora_r} >= 1, lora_alpha={self.lora_alpha} > 0, lora_dropout={self.lora_dropout} in [0, 1)")
        need(not self.adapter_path or self.use_peft, f"adapter_path={self.adapter_path!r} needs --use_peft")
        if self.use_peft:  # one spelling of the modules (all-linear, any order), so a resume compares like with like
            from grpo.lora import parse_targets
            try:
                self.lora_target_modules = ",".join(parse_targets(self.lora_target_modules))
            except ValueError as e:
                need(False, str(e))
        need(min(self.sft_steps, self.sft_batch - 1, self.save_steps, self.eval_steps, self.warmup_steps,
                 self.log_completions_steps, self.max_refills, self.time_budget_min, self.run_budget_min,
                 self.num_threads, self.min_rl_steps, self.min_eval_questions) >= 0,
             "step counts, sft_batch, max_refills, num_threads, min_rl_steps and the time budgets must not be negative")
        return self


# ----------------------------------------------------------------------------- command line

# TRL GRPOConfig names with no field here: what to do instead, said where the name is refused
TRL_NAMES = {
    "per_device_train_batch_size": "TRL counts completions per device; here a step is prompts_per_step prompts "
                                   "(all ranks) x num_generations completions: use --prompts_per_step",
    "per_device_eval_batch_size": "evals sample gen_batch rows at a time: use --gen_batch (and --eval_limit)",
    "generation_batch_size": "a step samples prompts_per_step x num_generations completions: use "
                             "--prompts_per_step (--gen_batch: rows decoded together)",
    "gradient_accumulation_steps": "not needed: a step's batch is split into micro-batches by token count "
                                   "(--micro_batch_tokens) and the gradient does not depend on the split",
    "use_vllm": "not needed: the sampler runs on the training weights (no second engine, no weight sync)",
    "vllm_mode": "not needed: the sampler runs on the training weights (no vLLM)",
    "vllm_gpu_memory_utilization": "the sampler's KV cache is sized by --kv_budget_gb (or --gen_batch)",
    "vllm_importance_sampling_correction": "always on: truncated importance sampling against the sampler's "
                                           "log-probs, capped by --tis_cap (0 = off)",
    "vllm_importance_sampling_cap": "use --tis_cap",
    "peft_config": "in Python GRPOTrainer(peft_config=peft.LoraConfig(...)); on the command line --use_peft with "
                   "--lora_r, --lora_alpha, --lora_dropout, --lora_target_modules, --use_rslora",
    "use_dora": "not supported: LoRA only (--use_peft)",
    "load_in_4bit": "not supported: the frozen base is bf16 on a GPU, fp32 on a CPU",
    "load_in_8bit": "not supported: the frozen base is bf16 on a GPU, fp32 on a CPU",
    "use_liger_loss": "not needed: the log-probs and the loss are fused Triton kernels on CUDA",
    "use_liger_kernel": "not needed: the log-probs and the loss are fused Triton kernels on CUDA",
    "num_train_epochs": "use --max_steps (one epoch = number of prompts / prompts_per_step steps)",
    "warmup_ratio": "use --warmup_steps",
    "logging_steps": "every step is logged (metrics.jsonl, and the trackers of --report_to)",
    "logging_dir": "logs go to output_dir (metrics.jsonl; TensorBoard in output_dir/tb)",
    "run_name": "a run is named by its --output_dir",
    "bf16": "use --dtype bfloat16 (auto: bf16 on CUDA, fp32 on CPU)",
    "fp16": "not supported: use --dtype bfloat16 or float32",
    "deepspeed": "not supported: FSDP2 under torchrun shards the model",
    "fsdp": "always on under torchrun (FSDP2, one shard group per block)",
    "eval_strategy": "use --eval_steps (0 = before and after training only)",
    "save_strategy": "use --save_steps (0 = off)",
    "log_completions": "use --log_completions_steps (0 = off)",
    "num_completions_to_print": "use --log_completions_steps: every completion goes to rollouts/step_N.jsonl",
    "reward_weights": "a recipe's field (recipes/custom_task.py --reward_weights) or GRPOTrainer(reward_weights=...)",
    "push_to_hub": "not supported: the export (output_dir/export) is a Hugging Face folder to upload yourself",
    "sync_ref_model": "not supported: the reference model (beta > 0) is the initial policy",
    "repetition_penalty": "not supported by the sampler",
    "shuffle_dataset": "always: each epoch is a permutation seeded by --seed",
    "disable_dropout": "not needed: the model has no dropout",
    "model_init_kwargs": "use --dtype",
}
# --help's sections, in order; a recipe's own fields join the first
HELP_GROUPS = {
    "model and data": ("model_path", "output_dir", "train_data", "eval_data", "question_field", "answer_field",
                       "seed", "max_steps", "resume", "export"),
    "GRPO": ("prompts_per_step", "num_generations", "num_iterations", "steps_per_generation", "loss_type",
             "importance_sampling_level",
             "scale_rewards", "epsilon", "epsilon_high", "delta", "dual_clip", "beta", "tis_cap",
             "mask_truncated_completions", "keep_truncated_answers", "overlong_buffer", "drop_flat_groups",
             "max_refills"),
    "generation": ("temperature", "top_p", "top_k", "min_p", "max_prompt_length", "max_completion_length",
                   "max_turns", "enable_thinking"),
    "optimization": ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "warmup_steps",
                     "lr_scheduler_type", "max_grad_norm", "sft_steps", "sft_batch", "sft_learning_rate"),
    "LoRA": ("use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "use_rslora", "adapter_path"),
    "logging, eval and checkpoints": ("report_to", "log_completions_steps", "eval_steps", "eval_limit", "eval_n",
                                      "eval_temperature", "eval_max_completion_length", "eval_greedy", "eval_before_limit", "save_steps",
                                      "save_total_limit", "time_budget_min", "run_budget_min", "min_rl_steps",
                                      "min_eval_questions"),
    "hardware": ("dtype", "autocast_bf16", "num_threads", "profile", "gen_batch", "kv_budget_gb",
                 "keep_kv_cache", "plan_memory", "preflight", "cuda_graphs", "kernels", "micro_batch_tokens",
                 "gradient_checkpointing", "share_prompt", "dist_timeout_min"),
}
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _base(typ):
    """float | None -> float (None is spelled "none" on the command line)."""
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    return args[0] if isinstance(typ, types.UnionType) and len(args) == 1 else typ


def _convert(name: str, value, typ, label: str | None = None):
    """A command-line string (or a YAML value) as the field's type; one-line errors that start
    with `label` (default --name)."""
    label, base = label or f"--{name}", _base(typ)
    if value is None or base is not typ and str(value).lower() == "none":
        if base is typ:
            raise ValueError(f"{label}: a value is required")
        return None
    if base is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in TRUE:
            return True
        if str(value).lower() in FALSE:
            return False
        raise ValueError(f"{label}={value!r}: expected true or false (or 1 or 0)")
    try:
        if base is int and isinstance(value, float) or base is not str and isinstance(value, bool):
            raise ValueError
        return base(value)
    except (TypeError, ValueError):
        raise ValueError(f"{label}={value!r}: expected {base.__name__}") from None


def unknown_field(name: str, fields, where: str = "") -> str:
    """The one line for a name that is not a field: TRL's names say what to use instead, old names
    their new one, typos the closest fields."""
    if name in TRL_NAMES:
        return f"{where}--{name} is a TRL GRPOConfig option with no field here: {TRL_NAMES[name]}"
    close = [RENAMED[name]] if RENAMED.get(name) in fields else difflib.get_close_matches(name, fields, 3, 0.75)
    hint = f" (did you mean {', '.join('--' + c for c in close)}?)" if close else ""
    return f"{where}unknown field --{name}{hint}"


def descriptions(cls) -> dict[str, str]:
    """Each field's trailing comment in its class source (recipes' fields too), with the comment-only
    lines that continue it: --help's text."""
    out = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        last = None
        for line in source.splitlines():
            field = re.match(r"^\s+(\w+):[^=\n]+=[^#\n]*#\s*(.+)$", line)
            more = re.match(r"^\s+#\s*(.+)$", line)
            if field:
                last = field.group(1)
                out[last] = field.group(2).strip()
            elif more and last and not more.group(1).startswith("---"):
                out[last] += " " + more.group(1).strip()
            else:
                last = None
    return out


def required_fields(cls) -> tuple:
    """A recipe names the fields it cannot run without in a `required` class attribute."""
    return tuple(getattr(cls, "required", ()))


def print_help(cls):
    defaults, hints, text = cls(), typing.get_type_hints(cls), descriptions(cls)
    from grpo.memory import SIZED
    profile = {k: "sized by the memory plan" for k in SIZED} if _cuda() else {"dtype": "float32"}
    required = required_fields(cls)
    doc = cls.__doc__ or ""
    if doc.startswith(cls.__name__ + "("):  # dataclass's generated signature: the recipe's own text instead
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().split("\n\n")[0]
    print(doc.strip() + "\n\nflags: --name=value or --name value (booleans: --name, --name true|false|1|0); "
          "--config FILE.yaml (flags win)")
    names = [f.name for f in dataclasses.fields(cls)]
    listed = {n for group in HELP_GROUPS.values() for n in group}
    groups = {g: [n for n in names if n in fields] for g, fields in HELP_GROUPS.items()}
    groups["model and data"] = [n for n in names if n not in listed] + groups["model and data"]
    if required:
        groups = {"required": list(required)} | {g: [n for n in ns if n not in required] for g, ns in groups.items()}
    for group, members in groups.items():
        if members:
            print(f"\n{group}:")
        for name in members:
            typ = _base(hints[name])
            line = f"  --{name} ({typ.__name__}, " + ("REQUIRED" if name in required else
                                                     f"default {getattr(defaults, name)!r}") + ")"
            if name in CHOICES:
                line += f" {{{' | '.join(CHOICES[name])}}}"
            if name in profile:
                line += f" [profile auto here: {profile[name]}]"
            print(line + (f"\n      {text[name]}" if name in text else ""))


def parse_args(cls=Config, argv: list[str] | None = None):
    """--name=value or --name value (a bare --flag sets a bool; --flag true|false|1|0 too), over cls's
    defaults, an optional --config YAML file and the profile. Unknown fields, bad values and
    missing required fields are one-line errors (ValueError; from the real command line, an exit
    with that line)."""
    if argv is None:
        try:
            return parse_args(cls, sys.argv[1:])
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    if "--help" in argv or "-h" in argv:
        print_help(cls)
        raise SystemExit(0)
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    given, config_file, k = {}, None, 0
    while k < len(argv):
        arg, k = argv[k], k + 1
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}: use --name=value or --name value")
        name, eq, text = arg[2:].partition("=")
        is_bool = name in fields and _base(hints[name]) is bool
        follows = k < len(argv) and not argv[k].startswith("--")
        if not eq and follows and (name == "config" or name in fields and not is_bool
                                   or is_bool and argv[k].lower() in TRUE + FALSE):
            text, eq, k = argv[k], "=", k + 1          # --name value (a bool's: true/false/1/0/yes/no/on/off)
        if name == "config":
            config_file = text
            continue
        if name not in fields:
            raise ValueError(unknown_field(name, fields))
        if not eq and not is_bool:
            raise ValueError(f"--{name} needs a value: --{name}=... or --{name} ...")
        given[name] = _convert(name, text, hints[name]) if eq else True
    from_file = load_yaml(config_file, fields, hints) if config_file else {}
    cfg = cls()
    apply_profile(cfg, given.get("profile", from_file.get("profile", cfg.profile)), {*from_file, *given})
    for key, value in {**from_file, **given}.items():
        setattr(cfg, key, value)
    text = descriptions(cls)
    for name in required_fields(cls):
        if not str(getattr(cfg, name)).strip():
            raise ValueError(f"--{name} is required" + (f": {text[name]}" if name in text else ""))
    return cfg.check()


def load_yaml(path: str, fields: set, hints: dict) -> dict:
    """A YAML mapping of field names to values (the same names as the flags); errors name the file
    and the key."""
    import yaml
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise ValueError(f"--config {where}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of field: value")
    for key in data:
        if key not in fields:
            message = unknown_field(str(key), fields, where=f"--config {path}: ")
            raise ValueError(message.replace(f"--{key} is", f"key {key!r} is", 1).replace(
                f"field --{key}", f"field {key!r}", 1))
    return {k: _convert(k, v, hints[k], label=f"--config {path}: key {k!r}") for k, v in data.items()}


# ----------------------------------------------------------------------------- profiles

def apply_profile(cfg: Config, name: str = "auto", given=()) -> dict:
    """Resolve the profile once, under what the recipe chose: Config defaults < profile < the recipe's own
    defaults < YAML < command line (`given`: the fields those two set). On a GPU ("auto", or a GPU's name
    in grpo.memory.GPU_MEMORY_GIB) it names the fields the memory plan sizes at start
    (grpo.trainer.fit_to_memory): of grpo.memory.SIZED, those nobody set; a field the recipe declares is
    its choice, even at Config's default. On a CPU it sets dtype float32. "none": Config's own values.
    cfg.profile_applied records it (config.json: a Config built in Python records that none was applied).
    -> the settings applied now."""
    from grpo.memory import GPU_MEMORY_GIB, SIZED
    if name not in ("auto", "none", "cpu", *GPU_MEMORY_GIB):
        raise ValueError(f"unknown profile {name!r}: auto, none, cpu or a GPU ({', '.join(GPU_MEMORY_GIB)})")
    cpu = name == "cpu" or name == "auto" and not _cuda()
    settings = {"dtype": "float32"} if cpu else {}
    base = Config()
    declared = {k for c in type(cfg).__mro__[:type(cfg).__mro__.index(Config)] for k in inspect.get_annotations(c)}
    own = {k for k in (*settings, *SIZED) if k in declared or getattr(cfg, k) != getattr(base, k)}
    applied = {k: v for k, v in settings.items() if k not in own and k not in given}
    for key, value in applied.items():
        setattr(cfg, key, value)
    sized = [] if cpu or name == "none" else [k for k in SIZED if k not in own and k not in given]
    cfg.profile_applied = {"name": name, "resolved": "cpu" if cpu else name, "settings": applied,
                           "sized_by_plan": sized, "kept_from_the_recipe": {k: getattr(cfg, k) for k in sorted(own)}}
    return applied


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()
