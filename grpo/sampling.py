"""Token sampling: temperature, top-k, top-p, min-p, and counter-based randomness.

Randomness is a pure function of (request key, step): one uniform u per row and step, hashed
from the row's key (seed, prompt index, sample index) and the completion position, then
inverse-CDF sampling over the filtered distribution. No generator state is carried, so a
request draws the same tokens in any batch, slot or rank, and the whole step stays on device.
"""
import math

import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF


def mix32(x: Tensor) -> Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding values in [0, 2^32). Products
    may wrap int64, but wrapping keeps the low 32 bits, the only ones we keep."""
    x = x & MASK32
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & MASK32
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & MASK32
    return x ^ (x >> 16)


def request_key(seed: int, prompt_id: int, sample_id: int) -> int:
    """32-bit key of one request: the same (seed, prompt index, sample index) gives the same key."""
    x = torch.tensor(seed & MASK32)
    for part in (prompt_id, sample_id):
        x = mix32(x ^ mix32(torch.tensor(part & MASK32) + 0x9E3779B9))
    return int(x)


def uniform(key: Tensor, step: Tensor) -> Tensor:  # (B,) int64, (B,) int64 -> (B,) fp32 in (0, 1)
    h = mix32(key ^ mix32(step * 0x27D4EB2F + 0x165667B1))
    return ((h >> 8).float() + 0.5) / 2**24  # 24 bits: what an fp32 CDF can resolve anyway


def filter_mask(logp: Tensor, top_k: int, top_p: float, min_p: float) -> Tensor:
    """(B, V) log-probs -> (B, V) bool, True = may be sampled. Applied in the order top-k,
    top-p (on the top-k renormalized distribution), min-p (relative to the most likely token);
    the most likely token always survives."""
    keep = torch.ones_like(logp, dtype=torch.bool)
    if top_p < 1.0:
        srt, idx = logp.sort(-1, descending=True)
        if top_k > 0:
            srt = srt.masked_fill(torch.arange(srt.shape[-1], device=srt.device) >= top_k, float("-inf"))
        p = srt.softmax(-1)
        # keep a token if the mass strictly before it is below top_p (so the crossing one stays)
        keep_sorted = (p.cumsum(-1) - p < top_p) & (srt > float("-inf"))
        keep = keep.scatter(-1, idx, keep_sorted)
    elif top_k > 0 and top_k < logp.shape[-1]:
        kth = logp.topk(top_k, -1).values[:, -1:]  # (B, 1); ties at the k-th value all stay
        keep = logp >= kth
    if min_p > 0.0:
        keep &= logp >= logp.max(-1, keepdim=True).values + math.log(min_p)
    return keep


def sample(logits: Tensor, u: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """logits (B, V), u (B,) -> tokens (B,) int64, logprobs (B,) fp32.

    The logprob is of the chosen token under softmax(logits / temperature) before any
    filtering: the quantity the trainer recomputes (DESIGN.md, the math). Greedy
    (temperature 0) reports the temperature-1 logprob."""
    logits = logits.float()
    if temperature == 0.0:
        tokens = logits.argmax(-1)
        return tokens, logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    logp = (logits / temperature).log_softmax(-1)  # (B, V) fp32
    probs = logp.exp()
    if top_k > 0 or top_p < 1.0 or min_p > 0.0:
        probs = probs * filter_mask(logp, top_k, top_p, min_p)
    cdf = probs.cumsum(-1)  # (B, V), unnormalized when filtered
    # searchsorted (left) lands on the first index reaching u * mass: always a kept token
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None])[:, 0].clamp_(max=logits.shape[-1] - 1)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]
