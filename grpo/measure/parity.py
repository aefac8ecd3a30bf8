"""The rules bench/gpu_check.py's parity checks are judged by, with the arithmetic behind each tolerance.
Imports torch (and grpo.kernels' reference noise) only: a bare GPU box runs it.

- greedy decode against a reference decode of the same model: random weights give near-ties that
  rounding may flip, so a row may part from the reference only at a near-tie (TIE_REL);
- T > 0 sampling against a float64 reference of the same rule (the same Gumbel noise, the kept set of
  top-k / top-p found again by sorting): the same tokens except where the two best perturbed scores tie
  (SCORE_TIE), the same kept set except at its edge, the log-probs within LOGPROB_TOL; and the tokens'
  frequencies against the distribution they should follow (tv_tolerance);
- the bf16 decode kernels against their references, in units of a bf16 ulp at each vector's scale
  (ulps_at_scale), and the decode attention against a bound on the reference's own rounding
  (attention_bound).
"""
import math

import torch
from torch import Tensor

from grpo.kernels.reference import gumbel

# a tie: both tokens within 1/64 of the top logit (2-4 bf16 steps); bf16 against fp32 decode of the
# 0.5B shape (CPU) parted rows at gaps of 0.001-0.006 of the top logit, never more
TIE_REL = 1 / 64


@torch.no_grad()
def greedy_rows(model, prompts, ref: list, out: list, gaps: list | None = None) -> tuple[int, int, int]:
    """(rows equal, rows parted at a near-tie, rows parted elsewhere): see TIE_REL. `gaps` collects,
    per parted row, the top logit minus the lower of the two tokens' logits, over |top logit|."""
    equal = ties = bad = 0
    device = next(model.parameters()).device
    for p, a, b in zip(prompts, ref, out):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            equal, bad = equal + (len(a) == len(b)), bad + (len(a) != len(b))
            continue
        z = model(torch.tensor([p + a[:k]], device=device))[0, -1].float()  # (V,) where the rows part
        gap = ((z.max() - torch.minimum(z[a[k]], z[b[k]])) / z.max().abs()).item()
        tie = gap <= TIE_REL
        ties, bad = ties + tie, bad + (not tie)
        if gaps is not None:
            gaps.append(gap)
    return equal, ties, bad

# ----------------------------------------------------------------------------- T > 0 sampling


# The sampler computes z = logits / T and z + g in fp32: each rounded to 2^-24 relative, so two perturbed
# scores of |s| <= ~40 that differ by less than ~40 x 2^-23 ~ 5e-6 may order either way. 1e-5: twice that.
SCORE_TIE = 1e-5
# log p = z_t - logsumexp(z) in fp32 against float64: z_t and the max carry 2^-24 |z| each (|z| <~ 40:
# 2.4e-6 each), the sum of V exponentials a relative log2(V) x 2^-24 (V 151936: 1e-6). ~6e-6 at worst: 2e-5.
LOGPROB_TOL = 2e-5


def kept_reference(z: Tensor, top_k: int, top_p: float) -> tuple[Tensor, Tensor]:
    """(B, V) float64 z -> (keep (B, V) bool, edge (B, V) bool): the tokens top-k then top-p keep, found by
    sorting (a token stays while the mass before it, over the top-k, is below top_p; ties at the last kept
    value all stay), and the tokens whose fate fp32 rounding may flip: a mass before them within 1e-5 of
    top_p (an fp32 running sum over thousands of terms), or a value within 1e-6 of the last kept one."""
    srt, idx = z.sort(-1, descending=True)
    V = z.shape[-1]
    rank_ok = torch.arange(V, device=z.device) < (top_k if top_k > 0 else V)
    p = srt.masked_fill(~rank_ok, float("-inf")).softmax(-1)
    before = p.cumsum(-1) - p
    keep_sorted = rank_ok & (before < top_p) if top_p < 1.0 else rank_ok.expand_as(srt)
    near = (before - top_p).abs() < 1e-5 if top_p < 1.0 else torch.zeros_like(keep_sorted)
    last = srt.masked_fill(~keep_sorted, float("inf")).amin(-1, keepdim=True)  # the smallest kept value
    keep = z >= last
    edge = (torch.zeros_like(keep).scatter(-1, idx, near)
            | ((z - last).abs() <= 1e-6 * last.abs().clamp(min=1)))
    return keep, edge


@torch.no_grad()
def sample_reference(logits: Tensor, key: Tensor, step: Tensor, temperature: float, top_k: int = 0,
                     top_p: float = 1.0) -> dict:
    """grpo.engine.sampling's rule in float64 from the same noise: (B, V) logits -> tokens, log-probs over the
    kept set, the kept set and its edge (kept_reference), and each row's two best perturbed scores' gap."""
    z = logits.double() / temperature
    keep, edge = kept_reference(z, top_k, top_p)
    score = (z + gumbel(key, step, z.shape[-1]).double()).masked_fill(~keep, float("-inf"))
    top2 = score.topk(2, -1).values
    tokens = score.argmax(-1)
    logprobs = z.gather(-1, tokens[:, None])[:, 0] - z.masked_fill(~keep, float("-inf")).logsumexp(-1)
    return dict(tokens=tokens, logprobs=logprobs, keep=keep, edge=edge, gap=top2[:, 0] - top2[:, 1],
                top=top2[:, 0])


def sampling_errors(tokens: Tensor, logprobs: Tensor, threshold: Tensor | None, logits: Tensor,
                    temperature: float, ref: dict) -> dict:
    """The sampler's draw against sample_reference's: rows whose token differs off a tie (SCORE_TIE
    relative to the top score), kept-set entries that differ off the set's edge (the sampler's set:
    its threshold on its fp32 z, plus the token), and the largest log-prob error over the rows with
    the same token and kept set."""
    same = tokens == ref["tokens"]
    tie = ref["gap"] <= SCORE_TIE * ref["top"].abs().clamp(min=1)
    out = dict(token_rows_off_tie=int((~same & ~tie).sum()), token_rows_at_tie=int((~same & tie).sum()))
    if threshold is not None:
        z = logits.float() / temperature
        kept = (z >= threshold[:, None].float()) | torch.nn.functional.one_hot(tokens, z.shape[-1]).bool()
        differ = (kept != ref["keep"]) & same[:, None]
        out["kept_set_off_edge"] = int((differ & ~ref["edge"]).sum())
        out["kept_set_rows_at_edge"] = int(differ.any(-1).sum())
        same &= ~differ.any(-1)
    err = (logprobs.double() - ref["logprobs"]).abs()
    out["logprob_max_err"] = err[same].max().item() if same.any() else 0.0
    return out


def tv_distance(tokens: Tensor, probs: Tensor) -> float:
    """Total variation between the tokens' frequencies and the (V,) distribution they should follow."""
    freq = torch.bincount(tokens, minlength=len(probs)).double() / len(tokens)
    return 0.5 * (freq - probs.double()).abs().sum().item()


def tv_tolerance(V: int, N: int) -> float:
    """3x the expected total variation of N fair draws over V values: E|f_v - p_v| ~ sqrt(2/pi) sqrt(p_v / N),
    so E[TV] <= 0.5 sqrt(2/pi) sum_v sqrt(p_v / N) <= 0.4 sqrt(V / N) (Cauchy-Schwarz)."""
    return 3 * 0.4 * math.sqrt(V / N)

# ----------------------------------------------------------------------------- the bf16 decode kernels


def bf16_ulp(x: Tensor) -> Tensor:
    """bf16's spacing at |x| (8 significant bits: 2^(floor(log2 |x|) - 7)); at 0, the smallest normal's."""
    return torch.exp2(torch.floor(torch.log2(x.abs().float().clamp(min=2.0**-126))) - 7)


def ulps_at_scale(out: Tensor, ref: Tensor) -> float:
    """max |out - ref| over each last-dim vector, in bf16 ulps of that vector's largest |ref|: one rounding
    flip of any element (its ulp <= the vector's) counts at most 1, and a value that cancels to ~0 (rotary's
    x1 cos - x2 sin) is judged at the scale its inputs had."""
    err = (out.float() - ref.float()).abs().amax(-1)
    return (err / bf16_ulp(ref.float().abs().amax(-1))).max().item() if err.numel() else 0.0


def attention_bound(q: Tensor, k: Tensor, v: Tensor, length: Tensor, out_ref: Tensor, scale: float) -> Tensor:
    """(B, nh) bound on |ours - reference| for one query a row over its first length[b] keys. Ours is fp32
    through and rounds the output once; the reference (SDPA on bf16) may round the scores s_j (2^-9 |s_j|
    each) and the probabilities p_j (2^-9 p_j) to bf16. A score error moves p_j by at most p_j (|ds_j| +
    max |ds|), so |do| <= 2^-9 (2 max|s| + 1) max|v_j| + one ulp of |o| for the two output roundings.
    q (B, nh, D), k, v (B, S, nkv, D) of the rows' slots."""
    B, nh, D = q.shape
    nkv = k.shape[2]
    kf = k.float().repeat_interleave(nh // nkv, dim=2)  # (B, S, nh, D)
    vf = v.float().repeat_interleave(nh // nkv, dim=2)
    valid = torch.arange(k.shape[1], device=q.device)[None, :, None] < length[:, None, None]  # (B, S, 1)
    s = torch.einsum("bhd,bshd->bsh", q.float(), kf) * scale  # (B, S, nh)
    s_max = s.abs().masked_fill(~valid, 0).amax(1)  # (B, nh)
    v_max = vf.abs().amax(-1).masked_fill(~valid, 0).amax(1)  # (B, nh)
    return 2.0**-9 * (2 * s_max + 1) * v_max + bf16_ulp(out_ref.float().abs().amax(-1))
