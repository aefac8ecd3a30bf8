"""LoRA (Hu et al., arXiv 2106.09685): low-rank adapters trained on a frozen base.

    settings = LoraSettings(r=16, alpha=32, dropout=0.05)
    add_lora(model, settings)           # the chosen linear layers of every block gain adapters

Each chosen nn.Linear becomes a LoRALinear that holds the same weight and bias tensors under the
same names (checkpoints and transformers' keys are unchanged) and two small matrices:
    y = x W^T + b + s * dropout(x) A^T B^T      A (r, in), B (out, r), s = alpha / r
(rsLoRA, arXiv 2312.03732: s = alpha / sqrt(r)). B starts at zero, so the adapted model starts
exactly equal to the base; A starts as PEFT initialises it (Kaiming-uniform, a = sqrt(5)). Every
other weight is frozen: no gradient, no optimizer state, and under FSDP only the adapters'
gradients are reduced.

The sampler needs no extra step: its decode weights (grpo/engine/decode.py: a copy, or on a CPU in fp32
weights packed for oneDNN) are refreshed at the start of every call from `effective_weight`,
W + s B A, merged once there. The KL reference
(beta > 0) is the base itself with the adapters switched off (`BaseModel`): no second model.
Also here: PEFT's adapter folder (adapter_config.json, adapter_model.safetensors with PEFT's key
names) written and read, and the merged state dict of a Hugging Face export.
"""
import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo.config import ATTENTION, LINEAR_ATTENTION, MLP, PEFT_DEFAULT_TARGETS, parse_targets

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model.model."  # PeftModelForCausalLM > LoraModel > *ForCausalLM > the decoder


@dataclass(frozen=True)
class LoraSettings:
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: tuple = PEFT_DEFAULT_TARGETS["qwen2"]  # PEFT's default, as TRL leaves it (parse_targets(None))
    rslora: bool = False

    @property
    def scale(self) -> float:  # s: the adapters' output multiplier
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)


def settings_of(cfg) -> LoraSettings:
    """A Config's LoRA fields (use_peft, lora_r, lora_alpha, lora_dropout, lora_target_modules,
    use_rslora)."""
    return LoraSettings(cfg.lora_r, float(cfg.lora_alpha), cfg.lora_dropout,
                        parse_targets(cfg.lora_target_modules), cfg.use_rslora)


class LoRALinear(nn.Module):
    """A frozen nn.Linear's weight (out, in) and bias, plus the trainable adapters A (r, in), B (out, r)."""

    def __init__(self, base: nn.Linear, r: int, scale: float, dropout: float, generator: torch.Generator):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same tensors, under the same names
        # the adapters' master weights are fp32 whatever the base's dtype (bf16 on a GPU)
        a = torch.empty(r, self.in_features)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # PEFT's init_lora_weights=True
        self.lora_A = nn.Parameter(a.to(base.weight.device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, device=base.weight.device))
        self.scale, self.dropout, self.enabled = scale, dropout, True

    def forward(self, x: Tensor) -> Tensor:  # x (..., in) -> (..., out)
        y = F.linear(x, self.weight, self.bias)
        if not self.enabled:
            return y
        h = F.dropout(x, self.dropout, self.training) if self.dropout else x
        # in the adapters' dtype: fp32 beside a bf16 base outside FSDP (which otherwise casts both for us)
        # (..., r) between: cheap
        delta = F.linear(F.linear(h.to(self.lora_A.dtype), self.lora_A), self.lora_B)
        return y + self.scale * delta.to(y.dtype)


def add_lora(model, settings: LoraSettings, seed: int = 0):
    """Adapters on `settings.targets` in every block of our Transformer (in place); every other
    weight frozen. A's initialisation comes from its own generator seeded by `seed`, so every rank
    starts from the same adapters whatever else drew from torch's global one."""
    generator = torch.Generator().manual_seed(seed)
    model.requires_grad_(False)
    for parent, name in block_linears(model):
        if name in settings.targets:
            setattr(parent, name, LoRALinear(getattr(parent, name), settings.r, settings.scale,
                                             settings.dropout, generator))
    model.lora = settings  # save_pretrained merges, the trainer writes the adapter folder
    return model


@torch.no_grad()
def cast_base(model, dtype: torch.dtype):
    """The blocks' frozen linear weights (and biases) stored in `dtype`, the dtype their matmuls run
    in: a CPU under autocast_bf16. Autocast caches a weight's bf16 cast only for a weight that requires
    grad, so a frozen fp32 one would be cast anew in every forward: each of the sampler's prefills
    and tool turns, and each micro-batch (docs/runs.md has the figures: the CPU default's LoRA
    warm-start and evals ran faster). Same matmul inputs, half the bytes."""
    for parent, name in block_linears(model):
        m = getattr(parent, name)
        m.weight = nn.Parameter(m.weight.to(dtype), requires_grad=False)
        if m.bias is not None:
            m.bias = nn.Parameter(m.bias.to(dtype), requires_grad=False)


def block_linears(model):
    """(parent module, name) of each linear layer of every block: attention's four (a Qwen3.5 linear
    layer's five instead) and the MLP's three."""
    for block in model.layers:
        mixer = ((block.self_attn, ATTENTION) if hasattr(block, "self_attn")
                 else (block.linear_attn, LINEAR_ATTENTION))
        for parent, names in (mixer, (block.mlp, MLP)):
            for name in names:
                yield parent, name


def adapters(model) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def has_dropout(model) -> bool:
    """Whether the model's training forward drops anything: adapters with lora_dropout > 0 (our
    Transformer has no other dropout)."""
    return any(m.dropout > 0 for m in adapters(model))


def trainable(model) -> list[nn.Parameter]:
    """What the optimizer holds: the adapters under LoRA, every parameter otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


@torch.no_grad()
def effective_weight(linear: nn.Module, out: Tensor | None = None) -> Tensor:
    """The (out, in) weight a layer applies: W, or W + s B A for an adapted one, merged in `out`'s
    dtype (default W's) with the GEMM's fp32 accumulation. `out`: written in place (the sampler's
    decode copy: no temporary the size of W). The merge is 2 r in out FLOPs on a K = r GEMM, bound
    by reading W and writing `out`, as the plain copy is."""
    if not isinstance(linear, LoRALinear) or not linear.enabled:
        return linear.weight if out is None else out.copy_(linear.weight)
    dtype = linear.weight.dtype if out is None else out.dtype
    b, a = linear.lora_B.to(dtype), linear.lora_A.to(dtype)
    return torch.addmm(linear.weight.to(dtype), b, a, alpha=linear.scale, out=out)


@contextlib.contextmanager
def adapters_off(model):
    """The base model's forward: every adapter skipped (the KL reference under LoRA)."""
    mods = adapters(model)
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.enabled = True


class BaseModel:
    """Called like the model, computed by the frozen base: the update's KL reference under LoRA."""

    def __init__(self, model):
        self.model = model

    def __call__(self, *args, **kwargs):
        with adapters_off(self.model):
            return self.model(*args, **kwargs)


# ----------------------------------------------------------------------------- state dicts and PEFT folders

def is_adapter_key(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def merged_state(state: dict, settings: LoraSettings, dtype: torch.dtype | None = None) -> dict:
    """A full state dict with adapters -> a plain model's: each adapted W replaced by W + s B A, summed
    in fp32 and written in `dtype` (default: W's own, as peft's merge_and_unload keeps it). Rounding to
    a bf16 W loses each entry of s B A below half a bf16 ulp of W (2^-9 to 2^-8 of |W|) and rounds the
    rest: float32 keeps the update whole, at twice the bytes (a 3B: 12 GB, not 6)."""
    out = {k: v for k, v in state.items() if not is_adapter_key(k)}
    for key, a in state.items():
        if key.endswith(".lora_A"):
            name = key.removesuffix(".lora_A")
            w = out[name + ".weight"]
            merged = w.float() + settings.scale * state[name + ".lora_B"].float() @ a.float()
            out[name + ".weight"] = merged.to(dtype or w.dtype)
    return out


def save_adapter(path, state: dict, settings: LoraSettings, base_model: str = ""):
    """A PEFT adapter folder from a state dict holding the adapters (ours: layers.0.self_attn.q_proj.lora_A):
    peft.PeftModel.from_pretrained(base, path) loads it."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = {PEFT_PREFIX + k + ".weight": v.detach().float().contiguous()
               for k, v in state.items() if is_adapter_key(k)}
    if not weights:
        raise ValueError("save_adapter: the state dict holds no adapters (a model without add_lora?)")
    save_file(weights, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": settings.r, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
              "target_modules": list(settings.targets), "use_rslora": settings.rslora, "bias": "none",
              "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
              "modules_to_save": None, "use_dora": False}
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


# peft.LoraConfig's fields (peft 0.21) that the arithmetic above reads, as PEFT does...
IMPLEMENTED = ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "init_lora_weights")
# ...and those that change nothing here: bookkeeping, or read by PEFT only beside a field that is refused
INERT = ("peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode", "auto_mapping",
         "peft_version", "runtime_config", "megatron_core", "qalora_group_size", "layers_pattern",
         "ensure_weight_tying")
# every other field is refused unless off: use_dora, bias, lora_bias, fan_in_fan_out, modules_to_save,
# exclude_modules, layers_to_transform, layer_replication, rank_pattern, alpha_pattern, target_parameters,
# trainable_token_indices, alora_invocation_tokens (aLoRA), use_qalora, megatron_config, loftq/eva/corda/
# lora_ga/velora/monteclora/arrow/kasa configs, use_bdlora, and any field a later PEFT adds
OFF = (None, False, "none", {}, [], (), set())
# initialisations whose adapters are relative to a modified base (PiSSA, OLoRA, CorDA, LoftQ): refused
PLAIN_INITS = (True, False, "gaussian", None)


def refused_options(options: dict, inits: tuple = PLAIN_INITS) -> list[str]:
    """"name=value" of each PEFT option in `options` (a LoraConfig's fields, or an adapter_config.json)
    that we would misread: one neither IMPLEMENTED nor INERT that is not off, or an init_lora_weights
    outside `inits`."""
    odd = [f"{k}={v!r}" for k, v in options.items()
           if k not in IMPLEMENTED + INERT and not any(v == off and type(v) is type(off) for off in OFF)]
    init = options.get("init_lora_weights", True)
    return odd + ([f"init_lora_weights={init!r}"] if init not in inits else [])


def adapter_settings(path) -> LoraSettings:
    """A PEFT LoRA folder's adapter_config.json -> its settings; one-line errors for what we cannot load."""
    path = Path(path)
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / name).is_file():
            raise FileNotFoundError(f"adapter_path {path}: no {name} "
                                    f"(a PEFT LoRA folder holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    cfg = json.loads((path / ADAPTER_CONFIG).read_text())
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"adapter_path {path}: peft_type {cfg.get('peft_type')!r}, only LORA is supported")
    odd = refused_options(cfg)
    if odd:
        raise ValueError(f"adapter_path {path}: unsupported LoRA options {', '.join(odd)} (plain LoRA only: "
                         f"{', '.join(IMPLEMENTED)})")
    targets = cfg.get("target_modules") or ()
    return LoraSettings(int(cfg["r"]), float(cfg.get("lora_alpha", 8)), float(cfg.get("lora_dropout", 0.0)),
                        parse_targets(targets if isinstance(targets, str) else list(targets)),
                        bool(cfg.get("use_rslora", False)))


def read_adapter(path) -> tuple[LoraSettings, dict]:
    """A PEFT LoRA folder -> (its settings, {our name: tensor})."""
    from safetensors.torch import load_file
    settings, path = adapter_settings(path), Path(path)
    state = {}
    for key, value in load_file(str(path / ADAPTER_WEIGHTS)).items():
        name = key.removeprefix(PEFT_PREFIX).removesuffix(".weight").replace(".default", "")
        if key == name or not is_adapter_key(name):
            raise ValueError(f"adapter_path {path}: unexpected tensor {key!r} (expected {PEFT_PREFIX}"
                             "layers.N.<module>.lora_A.weight / lora_B.weight)")
        state[name] = value
    return settings, state


@torch.no_grad()
def load_adapter(model, state: dict, source: str = "adapter"):
    """Copy {name: tensor} adapters into a model that has them (shapes checked, every one present)."""
    params = {k: p for k, p in model.named_parameters() if is_adapter_key(k)}
    missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or extra:
        raise ValueError(f"{source}: adapters do not match the model's (missing {missing[:3]}, unexpected "
                         f"{extra[:3]}): the same base model, r and target modules?")
    for k, p in params.items():
        if tuple(state[k].shape) != tuple(p.shape):
            raise ValueError(f"{source}: {k} has shape {tuple(state[k].shape)}, "
                             f"the model's is {tuple(p.shape)}")
        p.copy_(state[k])
