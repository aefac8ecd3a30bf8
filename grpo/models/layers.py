"""The parts of a decoder block, shared by the dense families (grpo/models/model.py) and Qwen3.5's
hybrid layers (grpo/models/qwen35.py): rotary embeddings, RMSNorm (and its fused backward), the
attention over packed documents or a KV cache, and the SwiGLU MLP (and its fused backward). `args` is a
grpo.models.model.ModelArgs.
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo.models.prompt_attention import SharedPrompts, shared_prompt_attention

try:  # optional: flash-attn's varlen kernel for packed training batches on CUDA
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None
HALF = (torch.float16, torch.bfloat16)  # flash-attn's only dtypes: fp32 takes SDPA


# ----------------------------------------------------------------------------- rotary

def rope_inv_freq(args, device=None) -> Tensor:  # (D/2,) fp32, or (rotary_dim/2,) where partial
    D = args.rotary_dim or args.head_dim
    inv_freq = 1.0 / args.rope_theta ** (torch.arange(0, D, 2, device=device, dtype=torch.float32) / D)
    s = args.rope_scaling
    # llama3: long wavelengths divided by `factor`, short kept, a smooth ramp between (Llama 3.1 report)
    if s:
        lo_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
        hi_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"])
                  / (s["high_freq_factor"] - s["low_freq_factor"]))
        mixed = (1 - smooth) * inv_freq / s["factor"] + smooth * inv_freq
        inv_freq = torch.where(wavelen > lo_wl, inv_freq / s["factor"],
                               torch.where(wavelen < hi_wl, inv_freq, mixed))
    return inv_freq


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x (B, nh, T, D); cos, sin (B, 1, T, D/2); the "rotate half" layout of HF checkpoints
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


def doc_mask(position_ids: Tensor) -> Tensor:  # (B, T) -> (B, 1, T, T) bool, True = may attend
    """Causal mask for packed rows: a new document starts wherever the positions do not count on
    by one (e.g. restart at 0), and no token attends across documents."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    doc = starts.cumsum(-1)  # (B, T) document index of every token
    T = position_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


# ----------------------------------------------------------------------------- blocks

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFn.apply(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float, rstd: Tensor | None = None) -> Tensor:
    # normalize in fp32 at least (as the reference implementations do), scale in the input dtype
    xf = x.to(_norm_dtype(x))
    if rstd is None:
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    return weight * (xf * rstd).type_as(x)


def _norm_dtype(x: Tensor) -> torch.dtype:  # fp32, or float64 for float64 inputs (gradcheck)
    return torch.promote_types(x.dtype, torch.float32)


class _RMSNormFn(torch.autograd.Function):
    """rms_norm for training, keeping its input and 1 / rms (a float a token) for the backward:
    autograd's own graph of it also keeps the normalized value, H floats a token (SmolLM2 in fp32:
    4.6 KB a token and layer for its two norms, ~10% of what a Block keeps)."""
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        rstd = torch.rsqrt(x.to(_norm_dtype(x)).pow(2).mean(-1, keepdim=True) + eps)  # (..., 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return rms_norm(x, weight, eps, rstd)

    @staticmethod
    def backward(ctx, gy: Tensor):
        x, weight, rstd = ctx.saved_tensors
        n = x.to(rstd.dtype) * rstd  # the normalized value, recomputed
        gw = None
        if ctx.needs_input_grad[1]:  # y = w * n: sum over tokens of gy * n, as autograd reduces it
            gw = (gy * n.type_as(x)).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
        gx = None
        if ctx.needs_input_grad[0]:  # d/dx of x * rstd(x): rstd * (gn - n * mean(gn * n)) over the last dim
            gn = gy.to(rstd.dtype) * weight.to(rstd.dtype)
            gx = (rstd * (gn - n * (gn * n).mean(-1, keepdim=True))).to(x.dtype)
        return gx, gw, None


class Attention(nn.Module):
    def __init__(self, args, layer_idx: int):
        super().__init__()
        self.layer_idx, self.n_heads, self.n_kv_heads, self.head_dim = (
            layer_idx, args.n_heads, args.n_kv_heads, args.head_dim)
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        if args.qk_norm:  # Qwen3: RMSNorm over each head's D channels, before rotary
            self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache=None,
                varlen=None) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.n_kv_heads != self.n_heads
        if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # autocast_bf16 on a CPU: the matmuls in bf16, attention in fp32. Its bf16 kernels are
            # the slower ones there, in decode (the fp32 cache cast to bf16 on every call) and in
            # training's forward and backward (bench/RESULTS.md has the figures)
            with torch.autocast("cpu", enabled=False):
                y = self._attend(q.float(), k.float(), v.float(), mask, cache, varlen, gqa)
        else:
            y = self._attend(q, k, v, mask, cache, varlen, gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, cache, varlen,
                gqa: bool) -> Tensor:
        """q (B, nh, T, D), k, v (B, nkv, T, D), rotary applied -> (B, nh, T, D)."""
        cache_mask = None
        if cache is not None:
            # the sampler's hook: it stores this step's k, v and hands back what to attend
            # over, (B, nkv, S, D) with a bool mask (B, 1, T, S); mask None = a packed prefill
            k, v, cache_mask = cache.update(self.layer_idx, k, v)
        if isinstance(varlen, SharedPrompts):
            return shared_prompt_attention(q, k, v, varlen, gqa)
        if varlen is not None and cache_mask is None:  # packed documents: no (T x T) mask
            flash = flash_attn_varlen_func is not None and q.is_cuda and q.dtype in HALF
            return flash_attention(q, k, v, varlen) if flash else per_document_attention(q, k, v, varlen, gqa)
        mask = cache_mask if cache_mask is not None else mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)


def per_document_attention(q: Tensor, k: Tensor, v: Tensor, varlen: tuple, gqa: bool) -> Tensor:
    """Causal SDPA on each packed document alone, for the sampler's packed prefill where
    flash-attn is not used: work grows with the sum of squared document lengths, not with
    (T x T), and each call is plain causal, so SDPA may pick a fused kernel instead of the
    math one that an arbitrary boolean mask gets (an 8,192-token prefill: ~4 GiB of fp32 scores
    per layer). q (B, nh, T, D), k, v (B, nkv, T, D) -> (B, nh, T, D)."""
    B, nh, T, D = q.shape
    flat = lambda t: t.transpose(1, 2).reshape(B * T, t.shape[1], D).transpose(0, 1)  # (heads, B*T, D)
    qf, kf, vf = flat(q), flat(k), flat(v)
    bounds = varlen[2]
    y = torch.cat([F.scaled_dot_product_attention(qf[None, :, s:e], kf[None, :, s:e], vf[None, :, s:e],
                                                  is_causal=True, enable_gqa=gqa)[0]
                   for s, e in zip(bounds[:-1], bounds[1:])], dim=1)  # (nh, B*T, D)
    return y.transpose(0, 1).reshape(B, T, nh, D).transpose(1, 2)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, varlen: tuple) -> Tensor:
    """flash-attn's varlen kernel over packed documents: no (T x T) mask, no padding work."""
    cu_seqlens, max_len, _ = varlen
    B, nh, T, D = q.shape
    flat = lambda t: t.transpose(1, 2).reshape(B * T, t.shape[1], D)  # (B*T, nh, D)
    y = flash_attn_varlen_func(flat(q), flat(k), flat(v), cu_seqlens, cu_seqlens, max_len, max_len,
                               causal=True)
    return y.view(B, T, nh, D).transpose(1, 2)


class MLP(nn.Module):  # SwiGLU
    def __init__(self, args):
        super().__init__()
        self.gate_proj = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.up_proj = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.down_proj = nn.Linear(args.ffn_dim, args.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        d = self.down_proj  # a LoRA down projection, or one with hooks, runs its own forward
        lean = (type(d) is nn.Linear and d.bias is None and not d._forward_hooks and not d._forward_pre_hooks
                and gate.requires_grad and torch.is_grad_enabled()
                and not torch.is_autocast_enabled(x.device.type))
        return _SwiGLUDown.apply(gate, up, d.weight) if lean else d(F.silu(gate) * up)


class _SwiGLUDown(torch.autograd.Function):
    """down(silu(gate) * up) for training, keeping gate, up and the weight for the backward, which
    recomputes silu(gate) and the product (elementwise, ~1% of the MLP's FLOPs). Autograd's own graph
    also keeps both: 2 x ffn_dim floats a token, a quarter of what a Block keeps (SmolLM2 in fp32:
    12 KB a token and layer). Not under autocast, whose casts the backward would have to replay; in bf16
    the same gradients as autograd's, bit for bit (tests/test_backward.py)."""
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up, w)
        return F.linear(F.silu(gate) * up, w)

    @staticmethod
    def backward(ctx, go: Tensor):  # go (..., H)
        gate, up, w = ctx.saved_tensors
        gh = go @ w  # (..., F): the product's grad
        silu = F.silu(gate)  # the forward's op: in bf16 the same bits as the product it made
        gw = None
        if ctx.needs_input_grad[2]:
            gw = go.reshape(-1, go.shape[-1]).T @ (silu * up).reshape(-1, up.shape[-1])  # (H, F)
        # the ops autograd runs for silu(gate) * up, in place where it can: at most four (..., F) tensors
        # at a time (the memory plan's backward term), and in bf16 autograd's own rounding
        g_up = silu.mul_(gh)
        return torch.ops.aten.silu_backward(gh.mul_(up), gate), g_up, gw
