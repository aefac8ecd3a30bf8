"""The command line of a Config: `parse_args(cls, argv)`, `--help`, `--config run.yaml`, one-line errors.

    cfg = parse_args(MyRecipe)      # --name=value or --name value; a bare --flag sets a bool
Precedence: the dataclass's defaults < the profile (grpo.fit.profile.apply_profile) < the recipe's
own defaults < the YAML file < the command line. Each field's trailing comment in the class source
is its --help text, and the class's `# ---- name` lines are --help's sections (a recipe's own
fields join the first): both read from the source once, here (field_docs). TRL GRPOConfig and
ModelConfig names with no field here are refused with what to use instead (TRL_NAMES; docs/trl.md
lists them all); names from before TRL's vocabulary point to theirs (RENAMED).
"""
import dataclasses
import difflib
import inspect
import re
import sys
import types
import typing

from grpo.config import CHOICES, Config
from grpo.fit import profile as profiles
from grpo.fit.profile import apply_profile

# names before TRL's vocabulary (one vocabulary: no aliases, but a pointer in the error)
RENAMED = {"lr": "learning_rate", "num_steps": "max_steps", "group_size": "num_generations",
           "max_prompt_len": "max_prompt_length", "max_completion_len": "max_completion_length",
           "save_every": "save_steps", "keep_last": "save_total_limit", "eval_every": "eval_steps",
           "lr_schedule": "lr_scheduler_type", "activation_checkpointing": "gradient_checkpointing",
           "log_completions_every": "log_completions_steps", "sft_lr": "sft_learning_rate",
           "drop_zero_variance": "drop_flat_groups"}
# TRL GRPOConfig / ModelConfig names with no field here: what to do instead, said where the name is refused
TRL_NAMES = {
    "per_device_train_batch_size": "TRL counts completions per device; here a step is prompts_per_step "
                                   "prompts (all ranks) x num_generations completions: "
                                   "use --prompts_per_step",
    "per_device_eval_batch_size": "evals sample gen_batch rows at a time: use --gen_batch (and --eval_limit)",
    "generation_batch_size": "a step samples prompts_per_step x num_generations completions: use "
                             "--prompts_per_step (--gen_batch: rows decoded together)",
    "use_vllm": "not needed: the sampler runs on the training weights (no second engine, no weight sync)",
    "vllm_mode": "not needed: the sampler runs on the training weights (no vLLM)",
    "vllm_gpu_memory_utilization": "the sampler's KV cache is sized by --kv_budget_gb (or --gen_batch)",
    "vllm_importance_sampling_correction": "always on: truncated importance sampling against the sampler's "
                                           "log-probs, capped by --tis_cap (0 = off)",
    "vllm_importance_sampling_cap": "use --tis_cap",
    "vllm_importance_sampling_clip_max": "use --tis_cap (here per token, truncated: TRL's default mode "
                                         "sequence_mask with 3.0 drops whole sequences instead)",
    "vllm_importance_sampling_mode": "per-token truncation only (TRL's token_truncate), capped by --tis_cap",
    "peft_config": "in Python GRPOTrainer(peft_config=peft.LoraConfig(...)); on the command line --use_peft "
                   "with --lora_r, --lora_alpha, --lora_dropout, --lora_target_modules, --use_rslora",
    "use_dora": "not supported: LoRA only (--use_peft)",
    "lora_target_parameters": "not supported: --lora_target_modules adapts the blocks' linear layers",
    "lora_modules_to_save": "not supported: under --use_peft only the adapters train",
    "lora_task_type": "always CAUSAL_LM",
    "model_name_or_path": "use --model_path",
    "bnb_4bit_quant_type": "not supported: no quantized base (load_in_4bit)",
    "use_bnb_nested_quant": "not supported: no quantized base (load_in_4bit)",
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
    "reward_weights": "a recipe's field (recipes/custom_task.py --reward_weights) "
                      "or GRPOTrainer(reward_weights=...)",
    "push_to_hub": "not supported: the export (output_dir/export) is a Hugging Face folder "
                   "to upload yourself",
    "sync_ref_model": "not supported: the reference model (beta > 0) is the initial policy",
    "repetition_penalty": "not supported by the sampler",
    "shuffle_dataset": "always: each epoch is a permutation seeded by --seed",
    "model_init_kwargs": "use --dtype",
    "max_tool_calling_iterations": "use --max_turns (assistant turns per episode; 0 = the env's own limit)",
    "chat_template_kwargs": "use --enable_thinking (the one keyword passed to the chat template)",
    "generation_kwargs": "the sampler takes --temperature, --top_p, --top_k and --min_p",
    "num_generations_eval": "use --eval_n (samples per eval question)",
    "remove_unused_columns": "not needed: every data column reaches the reward functions",
    "multi_objective_aggregation": "rewards are weighted and summed, then the sum is normalised "
                                   "(TRL's default, sum_then_normalize)",
    "top_entropy_quantile": "not supported: every completion token is trained on",
    "entropy_coef": "not supported: no entropy bonus",
    "off_policy_mask_threshold": "not supported: no off-policy sequence masking",
    "cast_lm_head_to_fp32": "not supported",
    "ref_model_sync_steps": "not supported: the reference model (beta > 0) is the initial policy",
    "ref_model_mixup_alpha": "not supported: the reference model (beta > 0) is the initial policy",
    "trust_remote_code": "not needed: grpo.models.model implements Llama, Qwen2 and Qwen3 itself",
    "attn_implementation": "not needed: attention is grpo.models.model's own",
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
        if base is str and isinstance(value, list):  # a YAML list, as TRL's list fields take: comma-separated
            return ",".join(map(str, value))
        return base(value)
    except (TypeError, ValueError):
        raise ValueError(f"{label}={value!r}: expected {base.__name__}") from None


def unknown_field(name: str, fields, where: str = "") -> str:
    """The one line for a name that is not a field: TRL's names say what to use instead, old names
    their new one, typos the closest fields."""
    if name in TRL_NAMES:
        return (f"{where}--{name} is a TRL option (GRPOConfig, ModelConfig) with no field here: "
                f"{TRL_NAMES[name]}")
    close = ([RENAMED[name]] if RENAMED.get(name) in fields
             else difflib.get_close_matches(name, fields, 3, 0.75))
    hint = f" (did you mean {', '.join('--' + c for c in close)}?)" if close else ""
    return f"{where}unknown field --{name}{hint}"


def field_docs(cls) -> tuple[dict[str, str], dict[str, list[str]]]:
    """From the class sources (Config's and each recipe's): each field's trailing comment, with the
    comment-only lines that continue it (--help's text), and the fields under each `# ---- name` line
    (--help's sections; a field before any, a recipe's own, joins the first). -> (text, sections)."""
    text, sections = {}, {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        last, section = None, None
        for line in source.splitlines():
            field = (re.match(r"^\s+(\w+):[^=\n]+=[^#\n]*#\s*(.+)$", line)
                     or re.match(r"^\s+(\w+):[^=\n]+=", line))
            more = re.match(r"^\s+#\s*(.+)$", line)
            if more and more.group(1).startswith("----"):
                section, last = more.group(1).strip("- ").split(" (")[0], None
                sections.setdefault(section, [])
            elif field:
                last = field.group(1)
                if field.lastindex == 2:
                    text[last] = field.group(2).strip()
                if not any(last in members for members in sections.values()):
                    sections.setdefault(section or next(iter(sections), ""), []).append(last)
            elif more and last in text:
                text[last] += " " + more.group(1).strip()
            else:
                last = None
    return text, sections


def required_fields(cls) -> tuple:
    """A recipe names the fields it cannot run without in a `required` class attribute."""
    return tuple(getattr(cls, "required", ()))


def print_help(cls):
    defaults, hints, (text, sections) = cls(), typing.get_type_hints(cls), field_docs(cls)
    from grpo.fit.memory import SIZED
    profile = {k: "sized by the memory plan" for k in SIZED} if profiles._cuda() else {"dtype": "float32"}
    required = required_fields(cls)
    doc = cls.__doc__ or ""
    if doc.startswith(cls.__name__ + "("):  # dataclass's generated signature: the recipe's own text instead
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().split("\n\n")[0]
    print(doc.strip() + "\n\nflags: --name=value or --name value (booleans: --name, --name true|false|1|0); "
          "--config FILE.yaml (flags win)")
    names = [f.name for f in dataclasses.fields(cls)]
    groups = {g: [n for n in members if n in names] for g, members in sections.items()}
    unread = [n for n in names if not any(n in members for members in groups.values())]  # no source to read
    first = next(iter(groups), "fields")
    groups[first] = unread + groups.get(first, [])
    if required:
        groups = {"required": list(required)} | {g: [n for n in ns if n not in required]
                                                 for g, ns in groups.items()}
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
    cfg.set_by_user = frozenset({*from_file, *given})  # what a recipe's own adjustments must leave alone
    text = field_docs(cls)[0]
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


