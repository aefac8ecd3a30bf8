"""The trainer's one flat config (its command line: grpo/flags.py's parse_args; its profile:
grpo/fit/profile.py).

A recipe subclasses `Config` with its own defaults and fields; precedence is
    Config defaults < profile < recipe defaults < --config YAML file < command line
(on a GPU the memory plan sizes, at start, what none of them set; it never overrides a forker's choice).
    python recipes/calculator_smollm2_cpu.py --num_generations=8 --learning_rate 1e-6
Field names are TRL's GRPOConfig names where the idea is the same (num_generations,
learning_rate, max_prompt_length, max_completion_length, max_steps, num_iterations = mu,
epsilon / epsilon_high, beta, loss_type, scale_rewards, mask_truncated_completions,
gradient_checkpointing, save_steps, save_total_limit, eval_steps, lr_scheduler_type,
steps_per_generation, gradient_accumulation_steps, and ModelConfig's use_peft and lora_*). Batch
sizes differ: `prompts_per_step` counts prompts over all ranks, where TRL's
per_device_train_batch_size counts completions per device (ours x G / ranks). docs/trl.md lists
every TRL field we accept, translate or refuse, and each default or meaning that differs.
A field's trailing comment is its description in `--help`, and the `# ---- name` lines its sections.
"""
from dataclasses import dataclass

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
SCALES = ("group", "batch", "none")
CHOICES = {"loss_type": LOSS_TYPES, "scale_rewards": SCALES, "lr_scheduler_type": ("constant", "cosine"),
           "dtype": ("auto", "float32", "bfloat16"), "autocast_bf16": ("auto", "true", "false"),
           "importance_sampling_level": ("token", "sequence"), "kernels": ("auto", "torch"),
           "export_dtype": ("auto", "float32", "bfloat16")}
REPORTERS = ("tensorboard", "wandb", "trackio")  # report_to: comma-separated, or "none" / "all"


@dataclass
class Config:
    """GRPO trainer settings (grpo.trainer.train); a recipe subclasses it with its own defaults."""
    # ---- model and data
    model_path: str = ""              # HF checkpoint folder (config.json + safetensors) or hub id
    output_dir: str = "runs/grpo"     # checkpoints, metrics.jsonl, TensorBoard, export
    train_data: str = ""              # training questions: a JSONL, CSV or Parquet file or a
                                      # dataset id name[:config[:split]]
    eval_data: str = ""               # eval questions, the same forms; empty = the recipe's own (or none)
    question_field: str = "question"  # the data column holding the question (else prompt, else problem)
    answer_field: str = "answer"      # the data column holding the answer
    seed: int = 0                     # seeds the data order, the sampler and the init
    max_steps: int = 100              # RL steps, each: sample, score, then num_iterations x
                                      # steps_per_generation / gradient_accumulation_steps
                                      # optimizer steps (TRL counts optimizer steps: with its
                                      # defaults, 1 x 1 / 1, the same count)
    resume: bool = False              # continue from the newest complete checkpoint
    export: bool = True               # Hugging Face export at the end
    export_dtype: str = "auto"        # its weights: auto = as trained (a full fine-tune's fp32
                                      # masters; under LoRA the base's dtype, bf16 on a GPU, which
                                      # drops an update below half a bf16 ulp of W); float32 keeps
                                      # the merged LoRA update whole (twice the bytes)
    # ---- GRPO
    prompts_per_step: int = 8         # B: prompts per step over all ranks (TRL counts completions per device)
    num_generations: int = 8          # G: completions per prompt
    num_iterations: int = 1           # mu: policy updates per batch of rollouts
    steps_per_generation: int | None = None  # TRL's: micro-steps per batch of rollouts; none =
                                      # gradient_accumulation_steps, so one optimizer step a batch. The
                                      # batch is split into steps_per_generation /
                                      # gradient_accumulation_steps mini-batches of whole groups, each an
                                      # optimizer step (then the old log-probs are the rollout policy's)
    gradient_accumulation_steps: int = 1  # TRL's: micro-steps per optimizer step; here it only divides
                                      # steps_per_generation (micro-batches are cut by
                                      # micro_batch_tokens, and the gradient does not depend on the cut)
    loss_type: str = "grpo"           # grpo | bnpo | dr_grpo | dapo: the clipped surrogate, each its
                                      # aggregation over tokens (grpo.loss: one function each); cispo:
                                      # -sg(min(rho, epsilon_high)) A logp, a token mean as dapo (MiniMax-M1,
                                      # arXiv 2506.13585); sapo: -sigmoid(tau (rho - 1)) 4 / tau A, a soft
                                      # gate for the clip, a sequence mean as grpo (arXiv 2511.20347)
    importance_sampling_level: str = "token"  # the ratio rho: per token (GRPO), or one per sequence, the
                                      # geometric mean of its tokens' ratios (GSPO, arXiv 2507.18071)
    scale_rewards: str = "group"      # advantage std: group | batch | none (Dr. GRPO)
    epsilon: float = 0.2              # eps_low of the clip range
    epsilon_high: float | None = None  # eps_high; unset = epsilon (DAPO's clip-higher: 0.28);
                                      # cispo: the cap on rho itself, as TRL (unset: epsilon;
                                      # ScaleRL, arXiv 2510.13786, uses 5)
    sapo_temperature_pos: float = 1.0  # sapo's tau where A > 0 (TRL's name and default)
    sapo_temperature_neg: float = 1.05  # sapo's tau where A <= 0: larger fades off-policy negative
                                      # tokens faster
    delta: float = 0.0                # two-sided clipping: cap rho at delta; 0 = off (cispo and
                                      # sapo ignore it, as TRL)
    dual_clip: float = 0.0            # dual-clip c > 1 for A < 0; 0 = off (cispo and sapo ignore it)
    beta: float = 0.0                 # k3 KL weight; 0 = no reference model is loaded
    use_bias_correction_kl: bool = True  # the KL term rho_t k3_t, k3 weighted by the importance
                                      # ratio rho = pi / pi_old with its gradient (DeepSeek-V3.2,
                                      # arXiv 2512.02556: unbiased on tokens drawn from pi_old), in
                                      # place of k3_t = exp(ref - logp) - (ref - logp) - 1
                                      # (DeepSeekMath, arXiv 2402.03300); TRL's name and default
    tis_cap: float = 2.0              # truncated importance sampling cap C; 0 = off
    mask_truncated_completions: bool = False  # no loss on completions cut at max_completion_length...
    keep_truncated_answers: bool = False  # ...except those cut after they answered
                                      # (env.answered(t), if the env has it): masking them too makes
                                      # not stopping free while a wrong answer that stops is pushed
                                      # down, and a model can learn to repeat its answer line
    overlong_buffer: int = 0          # DAPO overlong penalty buffer L_buf; 0 = off
    drop_flat_groups: bool = False    # dynamic sampling (DAPO): drop groups whose rewards are all equal...
    max_refills: int = 2              # ...and refill them with fresh prompts, at most this many times a step
    # ---- generation
    temperature: float = 1.0          # sampling temperature of the rollouts (log-probs use it too)
    top_p: float = 1.0                # nucleus sampling; 1 = off
    top_k: int = 0                    # 0 = off
    min_p: float = 0.0                # 0 = off
    logprobs_kept_set: bool = True    # with top_p/top_k/min_p: every log-prob (sampler, old, policy,
                                      # reference) is of the kept set renormalised, the distribution
                                      # sampled, so an unchanged policy's ratio is 1; false: of the full
                                      # vocabulary, as TRL scores them (the ratio is biased below 1)
    max_prompt_length: int = 1024     # prompt tokens (the sampler's cache holds prompt + completion)
    max_completion_length: int = 512  # all completion tokens, sampled and injected
    max_turns: int = 0                # assistant turns per episode; 0 = the env's own limit (env.max_turns)
    enable_thinking: bool = True      # passed to the chat template (Qwen3: False = non-thinking mode)
    # ---- optimization (the supervised warm-start's sft_ fields: before RL, 0 steps = off)
    learning_rate: float = 1e-6       # AdamW peak learning rate
    weight_decay: float = 0.0         # AdamW weight decay
    adam_beta1: float = 0.9           # AdamW beta1
    adam_beta2: float = 0.99          # AdamW beta2
    adam_epsilon: float = 1e-8        # AdamW epsilon: updates are g / (sqrt(v) + eps), so a
                                      # gradient far below eps moves its weight by ~lr x g / eps
                                      # rather than by lr (sign-like)
    warmup_steps: int = 0             # linear warmup, in optimizer steps (as TRL; see max_steps
                                      # for their number)
    lr_scheduler_type: str = "constant"  # after warmup
    max_grad_norm: float = 1.0        # 0 = no clipping
    sft_steps: int = 0                # supervised steps on the env's gold trajectories before RL
    sft_batch: int = 8                # examples per warm-start step
    sft_learning_rate: float = 1e-5   # warm-start AdamW learning rate
    # ---- LoRA (TRL's ModelConfig names; off = every weight is trained)
    use_peft: bool = False            # train LoRA adapters on a frozen base (grpo.models.lora)
                                      # instead of every weight; adapters usually want ~10x a full
                                      # fine-tune's learning_rate
    lora_r: int = 16                  # the adapters' rank r
    lora_alpha: int = 32              # the adapters' output scaled by lora_alpha / r (lora_alpha /
                                      # sqrt(r) with use_rslora)
    lora_dropout: float = 0.05        # dropout on the adapters' input, in training only (see disable_dropout)
    disable_dropout: bool = True      # no dropout in the policy's forward (TRL's name; its default
                                      # is false): the sampler never drops, so the update scores
                                      # what it sampled. false applies lora_dropout and takes the
                                      # old log-probs in a no-grad pass without it
    lora_target_modules: str | None = None  # comma-separated among q_proj, k_proj, v_proj, o_proj, gate_proj,
                                      # up_proj, down_proj; all-linear = all seven; none = PEFT's default for
                                      # the architecture, as in TRL: q_proj,v_proj for Llama, Qwen2 and Qwen3
    use_rslora: bool = False          # rank-stabilized LoRA (arXiv 2312.03732): scale by lora_alpha / sqrt(r)
    adapter_path: str = ""            # start from a PEFT LoRA folder (adapter_config.json +
                                      # adapter_model.safetensors); its r, alpha and modules
                                      # replace the flags'
    # ---- logging, eval and checkpoints
    report_to: str = "tensorboard"    # trackers beside metrics.jsonl: tensorboard, wandb (offline unless
                                      # WANDB_MODE says otherwise), trackio; comma-separated, none or all
    log_completions_steps: int = 10   # every N steps: rollouts/step_N.jsonl and a TensorBoard table; 0 = off
    eval_steps: int = 0               # eval every N steps; 0 = only before and after training
    eval_limit: int = 200             # eval questions
    eval_n: int = 1                   # samples per eval question (mean@k, pass@k)
    eval_temperature: float = 0.0     # 0 = greedy
    eval_max_completion_length: int = 0  # the evals' completion tokens; 0 = max_completion_length
    eval_greedy: bool = False         # with eval_temperature > 0: each eval also greedy, as "<phase>_greedy"
    eval_before_limit: int = 0        # questions for the eval before training; 0 = eval_limit
    save_steps: int = 50              # checkpoint every N steps (and on SIGTERM); 0 = off
    save_total_limit: int = 2         # checkpoints kept
    time_budget_min: float = 0.0      # stop RL before a step that would end past this many
                                      # minutes; 0 = no limit
    run_budget_min: float = 0.0       # ...or past what leaves the run (this process), its last
                                      # eval included, within this; 0 = none
    min_rl_steps: int = 1             # RL steps run even when run_budget_min is spent (the plan
                                      # says so at start)
    min_eval_questions: int = 20      # run_budget_min never shrinks an eval below this many questions
    # ---- hardware
    dtype: str = "auto"               # compute dtype: auto = bf16 on CUDA, fp32 on CPU
    autocast_bf16: str = "false"      # CPU, fp32 weights: bf16 matmuls in the blocks under torch.autocast;
                                      # auto = where a start-up measurement finds them faster
                                      # (grpo.fit.precision)
    num_threads: int = 0              # CPU threads per rank; 0 = the cores this process may use,
                                      # shared by its node's ranks
    profile: str = "auto"             # auto: on a GPU the memory plan sizes gen_batch, kv_budget_gb,
                                      # micro_batch_tokens and gradient_checkpointing where nothing set
                                      # them; on a CPU, fp32; a GPU's name (grpo.fit.memory.GPU_MEMORY_GIB):
                                      # sized for its memory; none: Config's values
    gen_batch: int = 64               # sampler slots (rows decoded together)
    kv_budget_gb: float = 0.0         # sampler KV-cache budget; 0 = sized from gen_batch
    keep_kv_cache: bool = True        # GPU: the sampler's cache, state, decode weights and CUDA graphs stay
                                      # through the update (graphs captured once per run); false frees them
                                      # for the update each step, as a CPU always does (no graphs to keep)
    plan_memory: bool = True          # refuse to start where the memory plan's peak exceeds the
                                      # device (grpo/fit/memory.py; python -m grpo.cli.plan prints
                                      # it); false: start anyway
    preflight: bool = False           # before step 1, one synthetic worst-case step (every row at
                                      # full length, the largest micro-batch): its measured peaks
                                      # beside the plan's (grpo/fit/preflight.py)
    cuda_graphs: bool = True          # GPU: each sampler decode window one CUDA graph; false =
                                      # eager launches (slower)
    kernels: str = "auto"             # auto = grpo.kernels' Triton kernels on CUDA; torch = their
                                      # PyTorch references everywhere (slower; the way around a
                                      # kernel that fails on your GPU)
    micro_batch_tokens: int = 8192    # token budget of one packed micro-batch (padding included)
    gradient_checkpointing: bool = False  # recompute each block's activations in backward
    share_prompt: bool = False        # update: each prompt computed once for all its completions
                                      # (bench/shared_prompt.py; bench/RESULTS.md has the figures)
    dist_timeout_min: float = 60.0    # how long a collective waits for the slowest rank (a long rollout)

    def clip_high(self) -> float:
        """eps_high: epsilon_high, or epsilon where unset (a symmetric clip). The one place of that rule."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def optimizer_steps(self) -> int:
        """Optimizer steps per batch of rollouts (per pass; num_iterations passes): TRL's
        steps_per_generation counts micro-steps, gradient_accumulation_steps of them to an optimizer step.
        The one place of that rule."""
        S = (self.gradient_accumulation_steps if self.steps_per_generation is None
             else self.steps_per_generation)
        return S // self.gradient_accumulation_steps

    def check(self):
        """Clear errors before any work starts; resolves epsilon_high (unset = epsilon)."""
        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(f"bad config: {msg}")
        self.autocast_bf16 = normalize(self.autocast_bf16)  # true/false/1/0/yes/no, or a saved run's bool
        reporters = [r.strip() for r in self.report_to.split(",") if r.strip()]
        need(set(reporters) <= {*REPORTERS, "none", "all"},
             f"report_to={self.report_to!r}, expected a comma-separated list of {', '.join(REPORTERS)}, "
             "or none or all")
        # TRL's booleans for scale_rewards, mapped as its GRPOConfig.__post_init__ maps them
        self.scale_rewards = {"true": "group", "false": "none"}.get(str(self.scale_rewards).lower(),
                                                                    self.scale_rewards)
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            need(value in choices, f"{name}={value!r}, expected one of {', '.join(choices)}")
        self.epsilon_high = self.clip_high()  # resolved, so config.json records the clip that ran
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
        need(min(self.sapo_temperature_pos, self.sapo_temperature_neg) > 0, "sapo temperatures must be > 0")
        need(self.loss_type != "cispo" or self.importance_sampling_level == "token",
             "loss_type=cispo weighs each token's log-prob by its own ratio: "
             "it needs importance_sampling_level=token")
        need(self.temperature > 0, f"temperature={self.temperature} must be > 0 (use top_k=1 for greedy)")
        need(0 < self.top_p <= 1 and self.top_k >= 0 and 0 <= self.min_p < 1,
             "top_p in (0, 1], top_k >= 0, min_p in [0, 1)")
        need(self.max_completion_length >= 1 and self.max_prompt_length >= 1 and self.max_turns >= 0,
             "lengths >= 1 and max_turns >= 0")
        need(self.overlong_buffer < self.max_completion_length,
             "overlong_buffer must be < max_completion_length")
        if self.steps_per_generation is None:  # TRL's default: one optimizer step per batch of rollouts
            self.steps_per_generation = self.gradient_accumulation_steps
        need(min(self.num_iterations, self.micro_batch_tokens, self.steps_per_generation,
                 self.gradient_accumulation_steps) >= 1,
             "num_iterations, steps_per_generation, gradient_accumulation_steps and micro_batch_tokens >= 1")
        # TRL lets an optimizer step span two batches of rollouts; here each step takes whole groups of
        # one batch
        need(self.steps_per_generation % self.gradient_accumulation_steps == 0,
             f"steps_per_generation={self.steps_per_generation} must be a multiple of "
             f"gradient_accumulation_steps={self.gradient_accumulation_steps} "
             "(their ratio: optimizer steps per batch of rollouts)")
        # on a GPU, sized at start to hold one
        sized = getattr(self, "profile_applied", {}).get("sized_by_plan", ())
        need(self.micro_batch_tokens >= self.max_prompt_length + self.max_completion_length
             or "micro_batch_tokens" in sized,
             f"micro_batch_tokens={self.micro_batch_tokens} cannot hold one sequence of "
             f"{self.max_prompt_length}+{self.max_completion_length} tokens")
        need(self.gen_batch >= 1 and self.kv_budget_gb >= 0, "gen_batch >= 1 and kv_budget_gb >= 0")
        need(self.eval_n >= 1 and min(self.eval_limit, self.eval_before_limit, self.eval_temperature) >= 0,
             "eval_n >= 1, eval_limit >= 0, eval_before_limit >= 0, eval_temperature >= 0")
        need(self.lora_r >= 1 and self.lora_alpha > 0 and 0 <= self.lora_dropout < 1,
             f"lora_r={self.lora_r} >= 1, lora_alpha={self.lora_alpha} > 0, "
             f"lora_dropout={self.lora_dropout} in [0, 1)")
        need(not self.adapter_path or self.use_peft, f"adapter_path={self.adapter_path!r} needs --use_peft")
        # one spelling of the modules (all-linear, any order), so a resume compares like with like
        if self.use_peft:
            try:
                self.lora_target_modules = ",".join(parse_targets(self.lora_target_modules))
            except ValueError as e:
                need(False, str(e))
        need(min(self.sft_steps, self.sft_batch - 1, self.save_steps, self.eval_steps, self.warmup_steps,
                 self.log_completions_steps, self.max_refills, self.time_budget_min, self.run_budget_min,
                 self.num_threads, self.min_rl_steps, self.min_eval_questions) >= 0,
             "step counts, sft_batch, max_refills, num_threads, min_rl_steps and the time budgets "
             "must not be negative")
        return self


# ----------------------------------------------------------------------------- LoRA's target modules
# the linear layers of a block, in PEFT's names (transformers' module names)
ATTENTION, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
# Qwen3.5's Gated DeltaNet
LINEAR_ATTENTION = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
TARGETS = ATTENTION + MLP + LINEAR_ATTENTION
# no target_modules (TRL's ModelConfig default, None): PEFT's per-architecture default
# (peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING), the same for every
# architecture grpo.models.model loads
PEFT_DEFAULT_TARGETS = {"llama": ("q_proj", "v_proj"), "qwen2": ("q_proj", "v_proj"),
                        "qwen3": ("q_proj", "v_proj")}


def parse_targets(names) -> tuple:
    """"q_proj,v_proj", a list of names, "all-linear" (PEFT's name for every one), or None (PEFT's
    default: PEFT_DEFAULT_TARGETS) -> the names in block order; a name that is not a linear layer of
    the blocks is a one-line error."""
    if names is None:
        # one tuple for every architecture we load (tests/test_trl_config.py checks)
        return PEFT_DEFAULT_TARGETS["qwen2"]
    if isinstance(names, str):
        names = (TARGETS if names.strip() == "all-linear"
                 else [n.strip() for n in names.split(",") if n.strip()])
    names = set(names)
    bad = sorted(names - set(TARGETS))
    if bad or not names:
        raise ValueError(f"lora_target_modules: {', '.join(bad) or 'empty'}: "
                         "not a linear layer of the blocks; "
                         f"choose from {', '.join(TARGETS)} (comma-separated), or all-linear")
    return tuple(n for n in TARGETS if n in names)


# ----------------------------------------------------------------------------- on/off words
# autocast_bf16's words (grpo/fit/precision.py decides what "auto" picks)
SETTINGS = ("auto", "true", "false")
WORDS = {"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false", "off": "false"}


def normalize(setting) -> str:
    """True / "True" / "1" -> "true", and so on; a saved run's bool reads as its word."""
    if isinstance(setting, bool):
        return "true" if setting else "false"
    word = str(setting).strip().lower()
    return WORDS.get(word, word)


MOVED = {"parse_args": "grpo.flags", "print_help": "grpo.flags", "required_fields": "grpo.flags",
         "apply_profile": "grpo.fit.profile"}
__all__ = ["Config", "CHOICES", "LOSS_TYPES", "SCALES", "REPORTERS"]


def __getattr__(name: str):
    """A name that lived here before the wings (config.py imports no grpo module): where it is now."""
    if name in MOVED:
        raise ImportError(f"grpo.config.{name} moved: from {MOVED[name]} import {name}")
    raise AttributeError(f"module 'grpo.config' has no attribute {name!r}")
