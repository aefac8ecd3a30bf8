"""One decoder-only Transformer for the Qwen2/Qwen2.5, Qwen3 and Llama families.

The three families differ in three switches, read from a Hugging Face config.json:
  - Qwen2/2.5: bias on the q/k/v projections;
  - Qwen3: RMSNorm on each head of q and k before rotary, explicit head_dim;
  - Llama (SmolLM2, Llama 3): optional llama3 rope scaling, often tied embeddings.
Qwen3.5's hybrid models (Gated DeltaNet and gated-attention layers) take grpo/models/qwen35.py's blocks.
Parameter names equal transformers' (minus the "model." prefix), so a checkpoint loads by
name and `save_pretrained` writes a folder that transformers loads back.

forward() returns logits; given `labels` it returns per-token log-probs of the labels
instead, computed from the final hidden states by the fused LM-head kernel, so the
(tokens x vocab) logits never exist. Inside forward is where FSDP has the LM-head weight
unsharded. The attention takes an optional KV-cache object: the sampler (grpo/engine/sampler.py)
runs these very blocks, so there is one set of weights and one attention.

The block's parts (rotary, RMSNorm, attention, MLP) are in grpo/models/layers.py. Also here: the
packed documents' boundaries (_varlen), and the checks that turn a config or checkpoint we would
misread into a one-line error, each beside the code it guards.
"""
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo.models.layers import MLP, Attention, RMSNorm, doc_mask, rope_inv_freq
from grpo.models.prompt_attention import SharedPrompts
from grpo.models.qwen35 import CenteredRMSNorm, HybridBlock, hybrid_args, text_config


SUPPORTED = ("llama", "qwen2", "qwen3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json")


@dataclass
class ModelArgs:
    model_type: str
    vocab_size: int
    dim: int                    # H: hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int             # grouped-query attention: n_heads % n_kv_heads == 0
    head_dim: int               # D
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    rope_scaling: dict | None   # llama3 only; None = plain rotary
    qkv_bias: bool              # Qwen2/2.5
    qk_norm: bool               # Qwen3
    tie_embeddings: bool
    # Qwen3.5's hybrid models (grpo/models/qwen35.py): each layer's "linear_attention" | "full_attention",
    # the rotated channels of a head (0 = all), and the linear layers' shapes
    # (grpo.models.deltanet.LinearArgs)
    layer_types: tuple | None = None
    rotary_dim: int = 0
    linear: object = None

    @property
    def hybrid(self) -> bool:  # Gated DeltaNet layers: a recurrent state per row beside the KV cache
        return self.layer_types is not None

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArgs":
        """Read a transformers config.json; anything we would silently get wrong is an error."""
        mt = cfg.get("model_type")
        if mt in ("qwen3_5", "qwen3_5_text"):  # Qwen3.5's hybrid models (grpo/models/qwen35.py)
            return hybrid_args(cfg, cls)
        if mt not in SUPPORTED:
            raise ValueError(f"unsupported model_type {mt!r}: grpo supports {SUPPORTED + ('qwen3_5',)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}: only silu (SwiGLU)")
        if cfg.get("mlp_bias"):
            raise ValueError("unsupported config field mlp_bias=True")
        if cfg.get("use_sliding_window") or (mt == "llama" and cfg.get("sliding_window")):
            raise ValueError("unsupported config field use_sliding_window=True (sliding-window attention)")
        if cfg.get("pretraining_tp", 1) != 1:
            raise ValueError(f"unsupported config field pretraining_tp={cfg['pretraining_tp']}")
        # transformers >= 5 writes rope_parameters; older configs write rope_theta + rope_scaling
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope type {rope_type!r}: grpo supports 'default' and 'llama3'")
        n_heads = cfg["num_attention_heads"]
        n_kv = cfg.get("num_key_value_heads") or n_heads
        if n_heads % n_kv:
            raise ValueError(f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        if head_dim % 2:
            raise ValueError(f"unsupported head_dim={head_dim}: rotary embeddings need an even head_dim")
        return cls(
            model_type=mt, vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"], n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            ffn_dim=cfg["intermediate_size"], norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rope_scaling=rope if rope_type == "llama3" else None,
            qkv_bias=(mt == "qwen2") or bool(cfg.get("attention_bias", False)),
            qk_norm=(mt == "qwen3"), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )


# ----------------------------------------------------------------------------- blocks

def lm_logits(h: Tensor, weight: Tensor) -> Tensor:
    """h (..., H) through the LM head (V, H) -> logits (..., V) in fp32, summed in fp32 from the
    weight's dtype: the logits the trainer's log-probs come from (grpo.kernels.linear_logprobs), so
    that a sampled token's log-prob differs from the trainer's by the order of sums only, not by a
    bf16 rounding of each logit (a relative 2^-9, seen as `sampler_gap` and in the TIS weights).
    The 16-bit case is the log-prob kernels' own (grpo.kernels.scaled_logits: one cuBLAS GEMM with an
    fp32 output on CUDA, exact 16-bit products in fp32 elsewhere). Inference only."""
    h = h.to(weight.dtype)
    if weight.dtype not in (torch.float16, torch.bfloat16):
        return F.linear(h, weight)
    from grpo.kernels import scaled_logits
    flat = scaled_logits(h.reshape(-1, h.shape[-1]), weight)  # (N, V) fp32
    return flat.view(*h.shape[:-1], weight.shape[0])


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args, layer_idx)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache=None,
                varlen=None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, varlen)
        return x + self.mlp(self.post_attention_layernorm(x))


# ----------------------------------------------------------------------------- model

class Transformer(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.config = dict(config)  # the HF config.json, written back by save_pretrained
        self.args = args = ModelArgs.from_hf(config)
        block, norm = Block, RMSNorm
        # Qwen3.5: Gated DeltaNet and gated-attention blocks, (1 + w) norms (grpo/models/qwen35.py)
        if args.hybrid:
            self.config, block, norm = text_config(self.config), HybridBlock, CenteredRMSNorm
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(block(args, i) for i in range(args.n_layers))
        self.norm = norm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(args, self.embed_tokens.weight.device),
                             persistent=False)
        self.generation_config: dict = {}
        self.source_path: str | None = None  # tokenizer files are copied from here on save
        self.activation_checkpointing = False
        # bf16 matmuls inside the blocks under torch.autocast (config autocast_bf16): the weights,
        # the residual stream, the final norm and the LM head stay fp32, so log-probs keep fp32's
        # precision (the LM head's two gradient matmuls take bf16); on CPUs with AVX512-BF16 a bf16
        # matmul runs several times faster than the fp32 one (grpo/fit/precision.py)
        self.autocast_bf16 = False
        self.lora = None  # grpo.models.lora.LoraSettings once add_lora gave the blocks adapters

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, *, labels: Tensor | None = None,
                temperature: float = 1.0, cache=None, output_index: Tensor | None = None,
                return_entropy: bool = False, shared: "SharedPrompts | None" = None,
                thresholds: Tensor | None = None):
        """input_ids (B, T) -> logits (B, T, V), or (B, K, V) at `output_index` (B, K).

        With `labels` (B, T), the token to score at each position (already shifted; -100 = ignore):
        returns log-probs (B, T) fp32 under softmax(logits / temperature), and the entropy too
        if `return_entropy`. Packed rows: positions that do not count on by one start a new
        document, which attends only to itself. `cache`: the sampler's KV-cache object. `shared`:
        rows of one prompt and its completions (the update's share_prompt; see SharedPrompts).
        `thresholds` (B, T) with labels: each token's log-prob over its kept set when sampling filtered
        the vocabulary (grpo.kernels.linear_logprobs' threshold; -inf = the whole vocabulary)."""
        B, T = input_ids.shape
        x = self.embed_tokens(input_ids)  # (B, T, H)
        # packed documents (position ids given, no history to attend to: a packed training batch
        # or the sampler's packed prefill) take flash-attn or SDPA per document, never a (T x T) mask
        fresh = cache is None or getattr(cache, "read", ()) is None
        varlen = shared
        if varlen is None and position_ids is not None and fresh:
            varlen = self._varlen(position_ids)
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
            mask = None  # plain causal
        else:  # a cache over history replaces it with its own; varlen and shared need none
            mask = doc_mask(position_ids) if varlen is None else None
        freqs = position_ids[:, None, :, None].float() * self.inv_freq  # (B, 1, T, D/2) fp32
        cos, sin = freqs.cos(), freqs.sin()
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16):
            for block in self.layers:
                if self.activation_checkpointing and self.training:
                    x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, mask, None, varlen,
                                                          use_reentrant=False)
                else:
                    x = block(x, cos, sin, mask, cache, varlen)
        h = self.norm(x)  # (B, T, H)
        if labels is not None:
            from grpo.kernels import linear_logprobs  # Triton on CUDA, chunked torch elsewhere
            # under autocast_bf16 the LM head's gradient matmuls run bf16 too (its forward stays fp32)
            return linear_logprobs(h, self.lm_head.weight, labels, temperature=temperature,
                                   return_entropy=return_entropy, threshold=thresholds,
                                   grad_dtype=torch.bfloat16 if self.autocast_bf16 else None)
        if output_index is not None:  # the sampler's: a few rows, in fp32 as the trainer scores them
            h = h.gather(1, output_index[..., None].expand(-1, -1, h.shape[-1]))  # (B, K, H)
            return lm_logits(h, self.lm_head.weight)
        return self.lm_head(h)

    @staticmethod
    def _varlen(position_ids: Tensor):
        """cu_seqlens for flash-attn from packed position ids (document starts = position breaks)."""
        flat = position_ids.reshape(-1)
        starts = torch.ones_like(flat, dtype=torch.bool)
        starts[1:] = flat[1:] != flat[:-1] + 1
        starts[:: position_ids.shape[1]] = True  # every row starts a document
        idx = starts.nonzero().flatten()
        cu = torch.cat([idx, idx.new_tensor([flat.numel()])]).to(torch.int32)
        bounds = cu.tolist()  # host sync: once per forward
        return cu, max(e - s for s, e in zip(bounds[:-1], bounds[1:])), bounds

    # ------------------------------------------------------------------------- load / save

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "Transformer":
        """Load a HF checkpoint folder (config.json + model.safetensors, or shards + index).
        The model is built on the meta device, so no random weights are ever allocated."""
        from safetensors import safe_open
        path = _local_or_hub(path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path}/config.json not found: not a Hugging Face checkpoint folder")
        config = _read_json(path / "config.json")
        with torch.device("meta"):
            model = cls(config)
        expected = {k: v for k, v in model.state_dict().items()
                    if not (k == "lm_head.weight" and model.args.tie_embeddings)}
        state = {}
        for file in _weight_files(path):
            try:
                f = safe_open(str(file), framework="pt", device="cpu")
            except Exception as e:  # safetensors' own error names no file (it checks the size on open)
                raise ValueError(f"{file}: not a readable safetensors file (truncated or corrupt? "
                                 f"{type(e).__name__}: {str(e)[:200]})") from None
            with f:
                for key in f.keys():
                    # Qwen3.5's VLM nests it
                    name = key.removeprefix("model.").removeprefix("language_model.")
                    if name not in expected:
                        if (name == "lm_head.weight" and model.args.tie_embeddings or "rotary_emb" in name
                                or name.startswith(("visual.", "mtp."))):
                            continue  # a tied copy, a buffer we recompute, a VLM's vision tower or MTP head
                        raise ValueError(f"{file.name}: unexpected weight {key!r} "
                                         f"for a {model.args.model_type} model")
                    t = f.get_tensor(key)
                    if tuple(t.shape) != tuple(expected[name].shape):
                        raise ValueError(f"{file.name}: weight {key!r} has shape {tuple(t.shape)}, "
                                         f"the config implies {tuple(expected[name].shape)}")
                    state[name] = t.to(device=device, dtype=dtype)
        missing = sorted(set(expected) - set(state))
        if missing:
            raise ValueError(f"{path}: missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        model.load_state_dict(state, strict=False, assign=True)
        if model.args.tie_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.inv_freq = rope_inv_freq(model.args, device)
        if (path / "generation_config.json").exists():
            model.generation_config = _read_json(path / "generation_config.json")
        model.source_path = str(path)
        return model

    def eos_token_ids(self) -> list[int]:
        """Every EOS id of generation_config (falling back to config.json): the default stops."""
        eos = self.generation_config.get("eos_token_id", self.config.get("eos_token_id"))
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def save_pretrained(self, path: str, state_dict: dict | None = None, max_shard_bytes: int = 4 << 30,
                        dtype: torch.dtype | None = None):
        """Write config.json, safetensors (sharded above `max_shard_bytes`), generation_config and the
        tokenizer files of the folder we came from, so that transformers loads the result.
        `state_dict`: a full (unsharded) state dict, as gathered under FSDP; default ours. LoRA adapters
        are merged into the weights they adapt, in `dtype` (default: each base weight's own)."""
        from safetensors.torch import save_file
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = state_dict if state_dict is not None else self.state_dict()
        # adapters merged: transformers loads a plain model (grpo.models.lora.save_adapter: PEFT's)
        if self.lora is not None:
            from grpo.models.lora import merged_state
            # summed in fp32, rounded once to `dtype` (default W's)
            state = merged_state(state, self.lora, dtype)
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        state = {"model." + k if k != "lm_head.weight" else k: v.detach().contiguous()
                 for k, v in state.items()
                 if not (k == "lm_head.weight" and self.args.tie_embeddings) and k != "inv_freq"}
        shards, size = [{}], 0
        for k, v in state.items():
            nbytes = v.numel() * v.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][k], size = v, size + nbytes
        if len(shards) == 1:
            save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        else:
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
            for name, shard in zip(names, shards):
                save_file(shard, str(path / name), metadata={"format": "pt"})
            index = {"metadata": {}, "weight_map": {k: n for n, s in zip(names, shards) for k in s}}
            (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        dtype = next(iter(state.values())).dtype
        config = {**self.config, "torch_dtype": str(dtype).removeprefix("torch.")}
        (path / "config.json").write_text(json.dumps(config, indent=2))
        if self.generation_config:
            (path / "generation_config.json").write_text(json.dumps(self.generation_config, indent=2))
        if self.source_path and Path(self.source_path).resolve() != path.resolve():
            for name in TOKENIZER_FILES:
                if (Path(self.source_path) / name).exists():
                    shutil.copy(Path(self.source_path) / name, path / name)


def _local_or_hub(path) -> Path:
    """A local folder as is; a hub id ("Qwen/Qwen2.5-3B-Instruct") that is not a local folder is
    fetched once into the Hugging Face cache (weights, config, tokenizer files only)."""
    local = Path(path)
    if local.exists() or str(path).startswith((".", "/", "~")) or str(path).count("/") != 1:
        return local
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(
            str(path), allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]))
    except Exception as e:  # offline, unknown repo, gated model: say what was tried
        raise FileNotFoundError(f"{path!r} is not a local folder and could not be fetched from the "
                                f"Hugging Face hub ({type(e).__name__}); "
                                "pass --model_path=/path/to/checkpoint") from e


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted({path / f for f in _read_json(index)["weight_map"].values()})
        absent = [f.name for f in files if not f.exists()]
        if absent:
            raise FileNotFoundError(f"{path}: shards named in the index are missing: {absent}")
        return files
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
