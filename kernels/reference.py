"""The naive versions of the kernels, for tests, benches and the torch backends: readable, and
as memory-hungry as they look.

The GRPO loss and advantage references are the plain functions of grpo/loss.py (kernels/ is
a leaf and does not import grpo): tests import them from there. sample_ref is a copy of
grpo.engine.sampling's unfiltered rule for the same reason; a test checks the two agree bit for bit.
"""
import torch
from torch import Tensor


def linear_logprobs_ref(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float = 1.0,
                        threshold: Tensor | None = None) -> Tensor:
    """(..., H), (V, H), (...) -> (...) log-probs of labels; labels < 0 give 0. Computed in fp32
    (fp64 for fp64 inputs) from the upcast inputs. threshold (...): renormalised over each token's
    kept set, the logits / T at or above it and the label."""
    dt = torch.promote_types(hidden.dtype, torch.float32)
    logits = hidden.to(dt) @ weight.to(dt).T / temperature      # (..., V): the full logits
    if threshold is not None:
        label = torch.nn.functional.one_hot(labels.clamp(min=0), logits.shape[-1]).bool()
        logits = logits.masked_fill((logits < threshold[..., None].to(dt)) & ~label, float("-inf"))
    logprobs = logits.log_softmax(-1)                          # (..., V): and a second copy
    picked = logprobs.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return torch.where(labels >= 0, picked, 0.0)


def entropy_ref(hidden: Tensor, weight: Tensor, temperature: float = 1.0) -> Tensor:
    """(..., H), (V, H) -> (...) entropy of softmax(hidden @ weight.T / T)."""
    dt = torch.promote_types(hidden.dtype, torch.float32)
    logprobs = (hidden.to(dt) @ weight.to(dt).T / temperature).log_softmax(-1)
    return -(logprobs.exp() * logprobs).sum(-1)


# -----------------------------------------------------------------------------
# sampling: grpo/engine/sampling.py's sample with no top-k/top-p/min-p

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: the Weyl-sequence step of SplitMix-style counters


def mix32(x):
    """murmur3's 32-bit finalizer, a bijection on [0, 2^32), for Python ints and int64 tensors
    (products may wrap int64; wrapping keeps the low 32 bits, the only ones kept)."""
    x = x & MASK32
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & MASK32
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)


def gumbel(key: Tensor, step: Tensor, V: int, start: int = 0, seed: Tensor | None = None) -> Tensor:
    """Gumbel noise -log(-log u_v), one u_v per (request key, step, token v), a pure function of
    the three: a 32-bit seed per (key, step), then murmur3's finalizer over seed ^ (Weyl sequence
    in v). (B,), (B,) int64 -> (B, V) fp32. `start`: the noise of tokens [start, start + V) (a chunk
    of the vocabulary); `seed`: noise_seed(key, step), when the caller has it (once for all chunks).
    The sampler's CPU loop adds the noise to the logits as z - log_exp_noise(...) instead, one pass
    fewer and the same bits (z + (-a) and z - a round alike)."""
    seed = noise_seed(key, step) if seed is None else seed
    return log_exp_noise(int32_bits(seed), weyl_bits(start, V, seed.device)).neg_()


def log_exp_noise(seed32: Tensor, weyl32: Tensor) -> Tensor:
    """log E_v, E_v = -log u_v ~ Exp(1): the Gumbel noise negated. seed32 (B,) and weyl32 (V,) int32
    (int32_bits of noise_seed and of the Weyl terms) -> (B, V) fp32. These integer passes are the
    largest part of sampling's cost; they run on int32 holding the same 32 bits as the int64
    definition (multiplication keeps the low 32 bits of the product in either type; a logical shift
    is an arithmetic one masked): half the bytes, and AVX2 has no 64-bit multiply (same bits: tested)."""
    x = seed32[:, None] ^ weyl32  # (B, V) int32: the bits of seed ^ weyl < 2^32
    t = torch.bitwise_right_shift(x, 16)  # one scratch buffer for both xorshifts
    x ^= t.bitwise_and_(0xFFFF)
    x *= _int32(0x85EBCA6B)
    x ^= torch.bitwise_right_shift(x, 13, out=t).bitwise_and_(0x7FFFF)
    x *= _int32(0xC2B2AE35)
    x >>= 9  # keep bits 9..31 (the finalizer's last xorshift would change only 9..15: left out)
    x &= 0x7FFFFF
    u = torch.add(x, 0.5).mul_(2.0**-23)  # fp32: 23 bits, so it holds u exactly: 0 < u < 1, never 1
    return u.log_().neg_().log_()


def weyl_bits(start: int, V: int, device) -> Tensor:
    # (V,) int32: the Weyl terms of tokens [start, start + V)
    return int32_bits(torch.arange(start, start + V, device=device) * GOLDEN & MASK32)


def noise_seed(key: Tensor, step: Tensor) -> Tensor:  # (B,), (B,) int64 -> (B,) int64 < 2^32
    """The 32-bit seed of one request's noise at one completion position."""
    return mix32((key >> 32) ^ mix32(key ^ mix32(step * GOLDEN + 0x165667B1)))


def _int32(x: int) -> int:  # a value in [0, 2^32) -> the int32 with the same bits (two's complement)
    return x - (1 << 32) if x >= 1 << 31 else x


def int32_bits(x: Tensor) -> Tensor:  # int64 values in [0, 2^32) -> int32 tensors with the same bits
    return torch.where(x >= 1 << 31, x - (1 << 32), x).to(torch.int32)


def sample_ref(logits: Tensor, key: Tensor, step: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(B, V) logits, (B,) keys, (B,) steps -> tokens (B,) int64, logprobs (B,) fp32 of the token
    under softmax(logits / T); T 0 is greedy with the T-1 log-prob. Inference only."""
    logits = logits.float()
    if temperature == 0.0:
        tokens = logits.argmax(-1)
        return tokens, logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    z = logits / temperature                                   # (B, V) fp32
    tokens = (gumbel(key, step, z.shape[-1]) + z).argmax(-1)
    return tokens, z.gather(-1, tokens[:, None])[:, 0] - z.logsumexp(-1)

# -----------------------------------------------------------------------------
# decode layers: grpo/models/layers.py's eager ops, one decode token per row; inference only

def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """grpo.models.layers.RMSNorm: normalize in fp32, round to x's dtype, scale; returned in x's dtype."""
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)).to(x.dtype)


def add_rmsnorm_ref(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(N, H), (N, H) or None, (H,) -> y = RMSNorm(h) (N, H), h = x + residual (N, H)."""
    h = x if residual is None else x + residual
    return _rms_norm(h, weight, eps), h


def silu_mul_ref(gu: Tensor) -> Tensor:
    """(N, 2F) gate|up -> silu(gate) * up (N, F), in fp32, returned in gu's dtype."""
    gate, up = gu.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gu.dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """grpo.models.layers.apply_rope ("rotate half"): x (..., D), cos, sin (..., D/2), in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


def qkv_rope_write_ref(qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, slot: Tensor,
                       pos: Tensor, n_heads: int, n_kv_heads: int, head_dim: int,
                       q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                       eps: float = 1e-6) -> Tensor:
    """qkv (B, (nh + 2 nkv) D), cos, sin (B, D/2) -> q (B, nh, D) rotated; writes rotated k and
    raw v into k_cache, v_cache (slots, S, nkv, D) at [slot, pos] in the cache dtype."""
    B, D = qkv.shape[0], head_dim
    q, k, v = qkv.split([n_heads * D, n_kv_heads * D, n_kv_heads * D], dim=-1)
    q, k, v = q.reshape(B, n_heads, D), k.reshape(B, n_kv_heads, D), v.reshape(B, n_kv_heads, D)
    if q_norm is not None:  # Qwen3: RMSNorm over each head's channels, before rotary
        q, k = _rms_norm(q, q_norm, eps), _rms_norm(k, k_norm, eps)
    cos, sin = cos.float()[:, None], sin.float()[:, None]       # (B, 1, D/2): every head
    if q_norm is None:  # q and k heads are neighbours in qkv: one rotary over both (half the ops)
        qk = _rope(qkv[:, :(n_heads + n_kv_heads) * D].view(B, n_heads + n_kv_heads, D), cos, sin)
        q, k = qk[:, :n_heads], qk[:, n_heads:]
    else:
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    k_cache[slot, pos] = k.to(k_cache.dtype)                     # (B, nkv, D) into (slots, S, nkv, D)
    v_cache[slot, pos] = v.to(v_cache.dtype)
    return q


def decode_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, slot: Tensor, length: Tensor,
                         scale: float | None = None) -> Tensor:
    """q (B, nh, D) over cache[slot, :length] (slots, S, nkv, D) -> (B, nh, D): SDPA with an
    explicit mask, on the gathered (B, nkv, S, D) slots, GQA by enable_gqa."""
    S = k_cache.shape[1]
    k, v = k_cache[slot].transpose(1, 2), v_cache[slot].transpose(1, 2)    # (B, nkv, S, D) copies
    mask = (torch.arange(S, device=q.device) < length[:, None])[:, None, None]  # (B, 1, 1, S)
    y = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale,
                                                         enable_gqa=q.shape[1] != k.shape[1])
    return y[:, :, 0]                                                     # (B, nh, D)
