"""Token sampling: temperature, top-k, top-p, min-p, and counter-based randomness.

The rule is the Gumbel-max trick. Every token v of the vocabulary gets
its own uniform u_v, a hash of (request key, completion position, v), and the sample is

    token = argmax over kept v of  logits_v / T - log E_v,   E_v = -log u_v ~ Exp(1)

(equivalently the first arrival of an exponential race, argmin E_v / p_v): an exact draw from
softmax(logits / T) renormalized over the tokens that top-k, top-p and min-p keep (the others
score -inf). Why noise per token rather than one uniform per step: an inverse CDF over the
vocabulary moves every slice boundary when fp32 rounding changes (a different batch is a
different matmul), and a tail token's slice can be narrower than that shift, so the same
uniform picks another token. In the race a choice flips only when the two best perturbed
scores lie within rounding error (~1e-5) of each other, which almost never happens. The tests
check the guarantee: identical SmolLM2 tokens at T 1 over 128 positions whether the same
requests run in batches of 8, of 1, or mixed with other prompts.

No generator state is carried: a request draws the same tokens in any batch, slot or rank,
and the whole step stays on device with no host sync. On CUDA with no filter set, the same
rule runs as one fused Triton pass over the logits (grpo.kernels.fused_sample: the same
tokens, without the (B, V) int64 noise buffer).
"""
import math

import torch
from torch import Tensor

# the hash, one definition for the sampler and for the Triton kernel's reference
from grpo.kernels.reference import (GOLDEN, MASK32, gumbel, int32_bits, log_exp_noise, mix32,  # noqa: F401
                                    noise_seed, weyl_bits)

from grpo import kernels
from grpo.cpu import packed_linear
from grpo.model import lm_logits


def request_key(seed: int, prompt_id: int, sample_id: int) -> int:
    """63-bit key of one request, from three int64s with both 32-bit halves of each mixed in
    (two lanes of 32 bits). Each half is absorbed by a bijection, so triples that differ in one
    half (prompt i and refill prompt 1 << 40 | i) always differ; any two collide with ~2^-63."""
    lo, hi = 0, 0x6A09E667
    for part in (seed, prompt_id, sample_id):
        for half in (part & MASK32, (part >> 32) & MASK32):  # two's complement halves of an int64
            lo = mix32(lo ^ mix32(half + GOLDEN))
            hi = mix32(hi ^ mix32(half ^ 0x5BD1E995))
    return (hi >> 1) << 32 | lo


def filter_mask(logp: Tensor, top_k: int, top_p: float, min_p: float) -> Tensor:
    """(B, V) log-probs (or logits: the masks do not move when a row is shifted) -> (B, V) bool,
    True = may be sampled. Applied in the order top-k, top-p (on the top-k renormalized
    distribution), min-p (relative to the most likely token); the most likely token always survives."""
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


def sample(logits: Tensor, key: Tensor, step: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0) -> tuple[Tensor, Tensor]:
    """logits (B, V), request keys (B,), completion positions (B,) -> tokens (B,) int64,
    logprobs (B,) fp32.

    The logprob is of the chosen token under softmax(logits / temperature) before any
    filtering: the quantity the trainer recomputes (every log-prob in the loss is of the
    temperature-scaled full distribution, never the top-k/top-p filtered one). Greedy
    (temperature 0) reports the temperature-1 logprob."""
    filtered = top_k > 0 or top_p < 1.0 or min_p > 0.0
    if not filtered and _fused(logits):
        return kernels.fused_sample(logits, key, step, temperature, backend="triton")
    logits = logits.float()
    if temperature == 0.0:
        tokens = logits.argmax(-1)
        return tokens, logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    z = logits / temperature  # (B, V) fp32
    keep = filter_mask(z, top_k, top_p, min_p) if filtered else None
    # CPU: the race a few rows at a time (~4 MiB of int64), so the hash's passes stay in cache
    # instead of faulting in a fresh (B, V) int64 buffer for each (2-3x faster at V 49k); CUDA: one piece
    n = len(z) if kernels.gpu(z) else max(1, (1 << 19) // z.shape[-1])
    pieces = [slice(r, r + n) for r in range(0, len(z), n)]
    tokens = torch.cat([_race(z[r], key[r], step[r], None if keep is None else keep[r]) for r in pieces])
    return tokens, z.gather(-1, tokens[:, None])[:, 0] - z.logsumexp(-1)


HEAD_CHUNK = 2048  # LM-head rows per step of sample_hidden's loop: a (48 x 2048) fp32 block stays in cache


def sample_hidden(hidden: Tensor, weight: Tensor, key: Tensor, step: Tensor, temperature: float, top_k: int = 0,
                  top_p: float = 1.0, min_p: float = 0.0, chunk: int = HEAD_CHUNK,
                  packed: list | None = None) -> tuple[Tensor, Tensor]:
    """sample(hidden @ weight.T, ...) from the last hidden states (B, H) and the LM head (V, H): the
    same tokens. On a CPU with no filter set the vocabulary goes `chunk` rows at a time, each chunk's
    logits, noise, race and log-sum-exp computed while its (B, chunk) block is in cache, so no (B, V)
    logits exist (SmolLM2, 48 rows, one thread: LM head and sampling 61 ms a step against 80). The
    race's winner is the best chunk winner (the first on a tie, as argmax); the log-sum-exp combines
    the chunks', so a log-prob may differ from sample()'s in its last bits, a token never. `packed`: the
    LM head's `chunk`-row blocks packed for oneDNN (grpo.cpu.pack; grpo.decode's packed mode), the same
    logits to fp32 rounding from a faster GEMM."""
    assert packed is None or chunk == HEAD_CHUNK, "packed LM-head blocks are HEAD_CHUNK rows each"
    filtered = top_k > 0 or top_p < 1.0 or min_p > 0.0
    if filtered or kernels.gpu(hidden):  # fp32 logits (V of them a row) from the LM head's dtype
        return sample(lm_logits(hidden, weight), key, step, temperature, top_k, top_p, min_p)
    hidden, V = hidden.to(weight.dtype), weight.shape[0]
    if temperature > 0.0:  # the noise's inputs once a step, not once a chunk: the seeds' and the vocabulary's bits
        seed32, weyl = int32_bits(noise_seed(key, step)), weyl_bits(0, V, hidden.device)
    best, where, picked, lse = [], [], [], []  # per chunk: (B,) best score, its token, that token's z, lse(z)
    for start in range(0, V, chunk):
        z = (packed_linear(hidden, packed[start // chunk]) if packed is not None
             else lm_logits(hidden, weight[start:start + chunk]))  # (B, c) fp32 logits of the chunk
        if temperature == 0.0:
            score = z  # greedy: the largest logit; its log-prob at T 1
        else:
            z = z / temperature if temperature != 1.0 else z
            score = log_exp_noise(seed32, weyl[start:start + z.shape[-1]])
            torch.sub(z, score, out=score)  # z_v - log E_v: gumbel()'s bits, one pass fewer
        s, v = score.max(-1)
        best.append(s), where.append(v + start), picked.append(z.gather(-1, v[:, None])[:, 0])
        lse.append(z.logsumexp(-1))
    c = torch.stack(best, -1).argmax(-1, keepdim=True)  # (B, 1): the winning chunk
    tokens = torch.stack(where, -1).gather(-1, c)[:, 0]
    return tokens, torch.stack(picked, -1).gather(-1, c)[:, 0] - torch.stack(lse, -1).logsumexp(-1)


def _fused(logits: Tensor) -> bool:
    """Sample with the fused kernel? On CUDA when triton imports (said once when it does not:
    the eager path draws the same tokens, but a silent fallback would hide a slow path)."""
    return kernels.use_triton(logits, None, "sampling") and kernels.sampling.kernel_available()


def _race(z: Tensor, key: Tensor, step: Tensor, keep: Tensor | None) -> Tensor:  # (b, V) -> (b,) int64
    score = log_exp_noise(int32_bits(noise_seed(key, step)), weyl_bits(0, z.shape[-1], z.device))
    torch.sub(z, score, out=score)  # z_v - log E_v: gumbel()'s bits
    if keep is not None:
        score.masked_fill_(~keep, float("-inf"))
    return score.argmax(-1)
