"""TEMPORARY (lead's stand-in until the kernels branch lands): references only."""
import torch
import torch.nn.functional as F


def add_rmsnorm(x, residual, weight, eps, backend=None):
    h = x if residual is None else x + residual
    hf = h.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * weight, h


def silu_mul(gu, backend=None):
    g, u = gu.chunk(2, -1)
    return (F.silu(g.float()) * u.float()).to(gu.dtype)


def _norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def qkv_rope_write(qkv, cos, sin, k_cache, v_cache, slot, pos, n_heads, n_kv_heads, head_dim, q_norm=None,
                   k_norm=None, eps=1e-6, backend=None):
    B, D = qkv.shape[0], head_dim
    q, k, v = qkv.split([n_heads * D, n_kv_heads * D, n_kv_heads * D], -1)
    q, k, v = q.reshape(B, n_heads, D), k.reshape(B, n_kv_heads, D), v.reshape(B, n_kv_heads, D)
    if q_norm is not None:
        q, k = _norm(q, q_norm, eps), _norm(k, k_norm, eps)
    c, s = cos[:, None], sin[:, None]
    rot = lambda x: torch.cat(((x1 := x.float().chunk(2, -1))[0] * c - x1[1] * s, x1[1] * c + x1[0] * s), -1).to(qkv.dtype)
    q, k = rot(q), rot(k)
    k_cache[slot, pos] = k.to(k_cache.dtype)
    v_cache[slot, pos] = v.to(v_cache.dtype)
    return q


def decode_attention(q, k_cache, v_cache, slot, length, scale=None, backend=None):
    raise NotImplementedError
