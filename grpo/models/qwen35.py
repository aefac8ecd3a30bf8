"""Qwen3.5's hybrid decoder blocks (the dense text models, e.g. Qwen3.5-0.8B), for
grpo.models.model.Transformer.

Qwen3.5 differs from Qwen3 in four places, read from config.json:
  - layer_types: most layers mix tokens with Gated DeltaNet (grpo/models/deltanet.py: linear attention,
    a recurrent state instead of a KV cache), one in `full_attention_interval` (4) with attention;
  - the attention layers gate their output, o_proj(attn * sigmoid(gate)), the gate a second half of
    each head's q_proj rows, and rotate only the first partial_rotary_factor (1/4) of each head;
  - every RMSNorm but the linear layers' gated one scales by (1 + weight): its weight is stored
    zero-centred (CenteredRMSNorm);
  - a checkpoint of the vision-language model (model_type qwen3_5) nests the text model's config
    in text_config and its weights under model.language_model.; the vision tower and the
    multi-token-prediction head (mtp.*) are not read. Its text positions are plain rotary: the
    three M-RoPE streams are equal for text.
Parameter names are transformers' Qwen3_5ForCausalLM's, so save_pretrained writes a folder that
transformers loads as that class.
"""
import torch
from torch import Tensor, nn

from grpo.models.deltanet import GatedDeltaNet, LinearArgs, fp32
from grpo.models.layers import MLP, Attention, apply_rope


def text_config(cfg: dict) -> dict:
    """The text model's config.json fields: a VLM config's text_config, flattened, as transformers'
    Qwen3_5ForCausalLM writes it (so that an export loads as that class); other configs unchanged."""
    if cfg.get("model_type") != "qwen3_5" or "text_config" not in cfg:
        return cfg
    text = dict(cfg["text_config"])
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "pad_token_id", "torch_dtype"):
        if key in cfg and (key == "tie_word_embeddings" or key not in text):  # the VLM's own tie rules
            text[key] = cfg[key]
    return {**text, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"]}


def hybrid_args(cfg: dict, model_args):
    """ModelArgs of a qwen3_5 / qwen3_5_text config; what we would misread is an error."""
    cfg = text_config(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}: only silu (SwiGLU)")
    if cfg.get("attention_bias"):
        raise ValueError("unsupported config field attention_bias=True for qwen3_5")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"unsupported rope type {rope.get('rope_type')!r}: Qwen3.5 text needs 'default'")
    theta = rope.get("rope_theta") or cfg.get("rope_theta", 10000.0)
    # transformers' default when a config names none (Qwen3_5TextConfig.__post_init__)
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    L, n_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads") or n_heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    every = cfg.get("full_attention_interval", 4)
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                       for i in range(L)]
    if len(types) != L or set(types) - {"full_attention", "linear_attention"}:
        raise ValueError(f"layer_types {types} do not give num_hidden_layers={L} layers of "
                         "full_attention / linear_attention")
    la = LinearArgs(cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                    cfg["linear_value_head_dim"], cfg.get("linear_conv_kernel_dim", 4))
    if la.v_heads % la.k_heads:
        raise ValueError(f"linear_num_value_heads={la.v_heads} is not a multiple of "
                         f"linear_num_key_heads={la.k_heads}")
    rotary_dim = int(head_dim * partial)
    if n_heads % n_kv or rotary_dim % 2:
        raise ValueError(f"unsupported attention shape: {n_heads} heads, {n_kv} kv heads, "
                         f"rotary dim {rotary_dim}")
    return model_args(
        model_type=cfg["model_type"], vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=L,
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, ffn_dim=cfg["intermediate_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=None, qkv_bias=False,
        qk_norm=True, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        layer_types=tuple(types), rotary_dim=rotary_dim, linear=la)


class CenteredRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), in fp32, then cast to the input's dtype (as transformers' Qwen3.5)."""
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = fp32(x)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
                * (1.0 + fp32(self.weight))).type_as(x)


class GatedAttention(nn.Module):
    """Qwen3.5's attention layer: Qwen3's (GQA, q/k norms before rotary) with an output gate and
    partial rotary. The attention proper, with the sampler's KV-cache hook, is grpo.models.model's."""
    _attend = Attention._attend

    def __init__(self, args, layer_idx: int):
        super().__init__()
        self.layer_idx, self.n_heads, self.n_kv_heads, self.head_dim = (
            layer_idx, args.n_heads, args.n_kv_heads, args.head_dim)
        self.rotary_dim = args.rotary_dim
        D = args.head_dim
        self.q_proj = nn.Linear(args.dim, 2 * args.n_heads * D, bias=False)  # per head [query | gate]
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(args.n_heads * D, args.dim, bias=False)
        self.q_norm = CenteredRMSNorm(D, args.norm_eps)
        self.k_norm = CenteredRMSNorm(D, args.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache=None,
                varlen=None) -> Tensor:
        B, T, _ = x.shape
        q, gate = self.q_proj(x).view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)  # (B, nh, T, D)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = partial_rope(q, cos, sin, self.rotary_dim), partial_rope(k, cos, sin, self.rotary_dim)
        gqa = self.n_kv_heads != self.n_heads
        if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):  # as Attention.forward: fp32 on a CPU
            with torch.autocast("cpu", enabled=False):
                y = self._attend(q.float(), k.float(), v.float(), mask, cache, varlen, gqa)
        else:
            y = self._attend(q, k, v, mask, cache, varlen, gqa)
        y = y.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(y)


def partial_rope(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int) -> Tensor:
    """Rotary on the first rotary_dim channels of each head, the rest as they are. x (B, nh, T, D);
    cos, sin (B, 1, T, rotary_dim/2)."""
    return torch.cat([apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)


class HybridBlock(nn.Module):
    """A pre-norm block whose token mixer is linear_attn (GatedDeltaNet) or self_attn (GatedAttention),
    as config.json's layer_types says; the MLP is grpo.models.model's SwiGLU."""
    def __init__(self, args, layer_idx: int):
        super().__init__()
        self.input_layernorm = CenteredRMSNorm(args.dim, args.norm_eps)
        if args.layer_types[layer_idx] == "linear_attention":
            self.linear_attn = GatedDeltaNet(args, layer_idx)
        else:
            self.self_attn = GatedAttention(args, layer_idx)
        self.post_attention_layernorm = CenteredRMSNorm(args.dim, args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache=None,
                varlen=None) -> Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            x = x + self.linear_attn(h, cache, varlen)
        else:
            x = x + self.self_attn(h, cos, sin, mask, cache, varlen)
        return x + self.mlp(self.post_attention_layernorm(x))
