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

The log-prob reported with a token is of the distribution it was drawn from: softmax(logits / T)
renormalised over the kept set when a filter is set (the ratio of an unchanged policy is then 1;
scoring the full vocabulary instead biases it below 1: a mean ratio of ~0.9 at top_p 0.8, reported
for other trainers). Every kept set is a top set of z = logits / T (ties at its edge all kept), so one
number per token defines it: the threshold, midway between the smallest kept z and the largest
dropped one, returned with `return_threshold` and recorded by the sampler. The trainer scores
{v : z_v >= threshold} plus the sampled token with its own logits (grpo.kernels.linear_logprobs'
`threshold`): 4 bytes a token instead of the kept ids, and the midpoint keeps the set the same
under the two sides' rounding unless a logit lies within it of the gap's middle.
"""
import math

import torch
from torch import Tensor

from grpo import kernels
from grpo.engine.cpu import packed_linear

# the hash, one definition for the sampler and for the Triton kernel's reference
from grpo.kernels.reference import (GOLDEN, MASK32, gumbel, int32_bits, log_exp_noise, mix32,  # noqa: F401
                                    noise_seed, weyl_bits)
from grpo.models.model import lm_logits


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
        # keep a token if the mass strictly before it is below top_p (so the crossing one stays),
        # and every token tied with the last kept one: the kept set is {logp >= its smallest}
        keep_sorted = (p.cumsum(-1) - p < top_p) & (srt > float("-inf"))
        last = srt.masked_fill(~keep_sorted, float("inf")).amin(-1, keepdim=True)  # (B, 1)
        keep = logp >= last
    elif top_k > 0 and top_k < logp.shape[-1]:
        kth = logp.topk(top_k, -1).values[:, -1:]  # (B, 1); ties at the k-th value all stay
        keep = logp >= kth
    if min_p > 0.0:
        keep &= logp >= logp.max(-1, keepdim=True).values + math.log(min_p)
    return keep


def kept_threshold(z: Tensor, keep: Tensor) -> Tensor:
    """(B, V) z and a top-set mask -> (B,) fp32: midway between the smallest kept z and the largest
    dropped one (-inf when nothing is dropped), so that {z >= threshold} is the kept set."""
    lo = z.masked_fill(~keep, float("inf")).amin(-1)
    hi = z.masked_fill(keep, float("-inf")).amax(-1)
    return torch.where(hi > float("-inf"), lo + (hi - lo) / 2, float("-inf"))


def kept_logprobs(z: Tensor, tokens: Tensor, threshold: Tensor) -> Tensor:
    """(B, V) z, (B,) tokens and thresholds -> (B,) log-probs of the tokens over {z >= threshold}
    plus the token itself, renormalised: the trainer's own mask (grpo.kernels.logprobs.kept), on the full
    logits."""
    kept = kernels.logprobs.kept(z.clone(), tokens, threshold, 0)  # (B, V): -inf outside the kept set
    return z.gather(-1, tokens[:, None])[:, 0] - kept.logsumexp(-1)


def sample(logits: Tensor, key: Tensor, step: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0, kept_set: bool = True, return_threshold: bool = False):
    """logits (B, V), request keys (B,), completion positions (B,) -> tokens (B,) int64,
    logprobs (B,) fp32 (and thresholds (B,) fp32 if `return_threshold`).

    The logprob is of the chosen token under softmax(logits / temperature), renormalised over the
    kept set when top-k/top-p/min-p filter the vocabulary (the distribution it was drawn from; the
    threshold says which set, -inf for the whole vocabulary). `kept_set=False`: the full
    vocabulary's log-prob whatever the filters (TRL's rule; the threshold is then -inf). Greedy
    (temperature 0) reports the temperature-1 logprob over the full vocabulary."""
    filtered = top_k > 0 or top_p < 1.0 or min_p > 0.0
    full = lambda tokens: torch.full(tokens.shape, float("-inf"), device=tokens.device)  # noqa: E731
    if not filtered and _fused(logits):
        tokens, lp = kernels.fused_sample(logits, key, step, temperature, backend="triton")
        return (tokens, lp, full(tokens)) if return_threshold else (tokens, lp)
    logits = logits.float()
    if temperature == 0.0:
        tokens = logits.argmax(-1)
        lp = logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
        return (tokens, lp, full(tokens)) if return_threshold else (tokens, lp)
    z = logits / temperature  # (B, V) fp32
    keep = filter_mask(z, top_k, top_p, min_p) if filtered else None
    # CPU: the race a few rows at a time (~4 MiB of int64), so the hash's passes stay in cache
    # instead of faulting in a fresh (B, V) int64 buffer for each (2-3x faster at V 49k); CUDA: one piece
    n = len(z) if kernels.gpu(z) else max(1, (1 << 19) // z.shape[-1])
    pieces = [slice(r, r + n) for r in range(0, len(z), n)]
    tokens = torch.cat([_race(z[r], key[r], step[r], None if keep is None else keep[r]) for r in pieces])
    if keep is None or not kept_set:
        lp, threshold = z.gather(-1, tokens[:, None])[:, 0] - z.logsumexp(-1), full(tokens)
    else:
        threshold = kept_threshold(z, keep)
        lp = kept_logprobs(z, tokens, threshold)
    return (tokens, lp, threshold) if return_threshold else (tokens, lp)


HEAD_CHUNK = 2048  # LM-head rows per step of sample_hidden's loop: a (48 x 2048) fp32 block stays in cache


def sample_hidden(hidden: Tensor, weight: Tensor, key: Tensor, step: Tensor, temperature: float,
                  top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, chunk: int = HEAD_CHUNK,
                  packed: list | None = None, kept_set: bool = True, return_threshold: bool = False):
    """sample(hidden @ weight.T, ...) from the last hidden states (B, H) and the LM head (V, H): the
    same tokens. On a CPU with no filter set the vocabulary goes `chunk` rows at a time, each chunk's
    logits, noise, race and log-sum-exp computed while its (B, chunk) block is in cache, so no (B, V)
    logits exist (SmolLM2, 48 rows, one thread: LM head and sampling 61 ms a step against 80). The
    race's winner is the best chunk winner (the first on a tie, as argmax); the log-sum-exp combines
    the chunks', so a log-prob may differ from sample()'s in its last bits, a token never. `packed`: the
    LM head's `chunk`-row blocks packed for oneDNN (grpo.engine.cpu.pack; grpo.engine.decode's packed mode),
    the same logits to fp32 rounding from a faster GEMM."""
    assert packed is None or chunk == HEAD_CHUNK, "packed LM-head blocks are HEAD_CHUNK rows each"
    filtered = top_k > 0 or top_p < 1.0 or min_p > 0.0
    if filtered or kernels.gpu(hidden):  # fp32 logits (V of them a row) from the LM head's dtype
        return sample(lm_logits(hidden, weight), key, step, temperature, top_k, top_p, min_p, kept_set,
                      return_threshold)
    hidden, V = hidden.to(weight.dtype), weight.shape[0]
    # the noise's inputs once a step, not once a chunk: the seeds' and the vocabulary's bits
    if temperature > 0.0:
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
    lp = torch.stack(picked, -1).gather(-1, c)[:, 0] - torch.stack(lse, -1).logsumexp(-1)
    return (tokens, lp, torch.full_like(lp, float("-inf"))) if return_threshold else (tokens, lp)


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
