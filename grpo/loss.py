"""GRPO's math as plain functions: advantages, the clipped surrogate, KL, aggregations.

Every equation of GRPO and of the variants below is one small function here, readable beside
the papers. They are the references that the fused kernels in `grpo.kernels` are tested
against, and the path that runs where those kernels do not: `group_advantages` and
`policy_loss` call the Triton kernels for CUDA tensors and these functions elsewhere.
Token tensors are (B, T) for one micro-batch; advantages are (B,) per sequence or (B, T)
per token (process credit). The metrics a run logs per token (loss_metrics) and the options
dataclass are here too: they read the same equations as the loss.

- GRPO: DeepSeekMath, arXiv 2402.03300.   - Dr. GRPO: arXiv 2503.20783.
- DAPO (clip-higher, token mean, overlong penalty): arXiv 2503.14476.
- dual-clip PPO: arXiv 1912.09729.        - k3 KL estimator: J. Schulman, "Approximating KL divergence".
- GSPO (one ratio per sequence, TRL's importance_sampling_level="sequence"): arXiv 2507.18071.
- CISPO (clipped, detached IS weight on log pi): MiniMax-M1, arXiv 2506.13585.
- SAPO (a soft sigmoid gate in place of the clip): arXiv 2511.20347.
- k3 weighted by the ratio (TRL's use_bias_correction_kl): DeepSeek-V3.2, arXiv 2512.02556.
Where TRL's GRPOTrainer (trl/trainer/grpo_trainer.py) decides a case the papers leave open (an
unscorable completion, an infinite reward, how cispo and sapo aggregate), these functions do what it does.
Which distribution the log-probs are of: softmax(logits / T) of the tokens the sampler drew from, so
under top_p/top_k/min_p its kept set renormalised (the sampler records each token's set; the update's
old, policy and reference log-probs are taken over the same set), never the full vocabulary, whose
ratio for an unchanged policy is below 1 (docs/on_policy.md). TRL scores the full vocabulary; the
config's logprobs_kept_set=false does too.
"""
import math
from dataclasses import dataclass

import torch
import torch.distributed
from torch import Tensor

from grpo import kernels

# -----------------------------------------------------------------------------
# advantages and reward shaping

def group_advantages(rewards: Tensor, G: int, scale: str = "group", batch_rewards: Tensor | None = None,
                     backend: str | None = None) -> Tensor:
    """(B*G,) rewards, consecutive groups of G completions of one prompt -> (B*G,) fp32 advantages.

    scale="group": (r - mean_group) / (std_group + 1e-4)   (GRPO)
    scale="batch": (r - mean_group) / (std_batch + 1e-4)   (std of all raw rewards in the batch:
                   `batch_rewards` holds every rank's rewards; required when ranks > 1)
    scale="none":  r - mean_group                          (Dr. GRPO: no std division, it
                   up-weights groups with a small reward spread)
    std is unbiased (divides by n - 1), as in the GRPO paper's implementations. As TRL's
    GRPOTrainer does it (nanmean, nanstd, then nan_to_num(advantages, nan=0)):
    - a NaN reward (unscorable: every reward function returned None) is left out of its group's
      mean and std and of the batch std, and gets advantage 0;
    - a group with fewer than 2 scorable rewards gets 0 (TRL's nanstd of one value is NaN);
    - a group holding an infinite reward gets 0 (TRL: inf - inf is NaN); the batch std leaves
      inf out (under scale batch or none TRL lets it reach the other groups).
    A group whose scorable rewards are all equal gets exactly 0 (its mean may not be
    representable: 0.1 x 8).
    """
    assert rewards.dim() == 1 and rewards.numel() % G == 0, f"{rewards.shape=} not (B*{G},)"
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"{scale=} not in group|batch|none")
    assert scale != "group" or G > 1, "an unbiased group std needs G > 1"
    if scale == "batch" and batch_rewards is None:
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise ValueError("scale='batch' on several ranks needs batch_rewards, every rank's rewards: "
                             "the local std is not the batch's")
        batch_rewards = rewards
    batch_std = None
    if scale == "batch":
        finite = batch_rewards.float()[batch_rewards.isfinite()]           # NaN and inf left out
        batch_std = finite.std() if finite.numel() > 1 else finite.new_zeros(())
    if kernels.use_triton(rewards, backend, "group_advantages"):
        return kernels.group_advantages(rewards, G, scale, float(batch_std) if scale == "batch" else 0.0)
    r = rewards.float().view(-1, G)                            # (B, G); NaN: unscorable
    ok = ~r.isnan()                                            # (B, G) the scorable rewards
    n = ok.sum(1, keepdim=True)                                # (B, 1) how many
    hi = torch.where(ok, r, -math.inf).amax(1, keepdim=True)
    lo = torch.where(ok, r, math.inf).amin(1, keepdim=True)
    zero = (hi == lo) | (n < 2) | r.isinf().any(1, keepdim=True)   # (B, 1): groups that teach nothing
    mean = torch.where(ok, r, 0.0).sum(1, keepdim=True) / n.clamp(min=1)
    centered = torch.where(ok & ~zero, r - mean, 0.0)          # (B, G)
    if scale == "none":
        return centered.view(-1)
    # group: the std of the scorable rewards (the others are 0 in `centered`)
    std = ((centered.square().sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt() if scale == "group"
           else batch_std)
    return (centered / (std + 1e-4)).view(-1)


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int) -> Tensor:
    """DAPO's soft overlong punishment: (B,) completion lengths -> (B,) reward term in [-1, 0].

    0 up to max_len - buffer, then a linear ramp down to -1 at max_len, -1 beyond.
    """
    start = max_len - buffer
    ramp = (start - lengths.float()) / buffer                  # negative inside the buffer
    return torch.where(lengths <= start, 0.0, torch.where(lengths <= max_len, ramp, -1.0))

# -----------------------------------------------------------------------------
# token losses: (B, T) -> (B, T)

def clipped_surrogate(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                      eps_low: float = 0.2, eps_high: float = 0.2,
                      delta: float | None = None, dual_clip: float | None = None) -> Tensor:
    """l_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A), rho_t = exp(logp - old_logp).

    delta: caps rho_t at delta inside the unclipped term (two-sided clipping: a huge ratio on
    a negative advantage cannot blow up the loss). dual_clip c > 1: for A < 0 the loss is
    bounded by c |A| (dual-clip PPO). Both None: the plain PPO/GRPO surrogate.
    """
    A = advantages
    rho = torch.exp(logprobs - old_logprobs.detach())
    unclipped = (rho if delta is None else rho.clamp(max=delta)) * A
    clipped = rho.clamp(1 - eps_low, 1 + eps_high) * A
    loss = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(A < 0, torch.minimum(loss, -dual_clip * A), loss)
    return loss


def cispo_surrogate(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, cap: float) -> Tensor:
    """CISPO (MiniMax-M1, arXiv 2506.13585): l_t = -sg(min(rho_t, cap)) A log pi(o_t).

    The clip bounds the importance weight, stopped from the gradient, never the token's gradient:
    every token gets d l_t / d logp_t = -min(rho_t, cap) A, where PPO's clip gives 0. `cap` is
    TRL's epsilon_high, a bound on rho itself (not 1 + eps), and there is no lower bound, as in
    TRL's loss_type="cispo" (ScaleRL, arXiv 2510.13786, uses cap 5).
    """
    rho = torch.exp(logprobs - old_logprobs.detach())
    return -rho.clamp(max=cap).detach() * advantages * logprobs


def sapo_surrogate(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                   tau_pos: float = 1.0, tau_neg: float = 1.05) -> Tensor:
    """SAPO (arXiv 2511.20347): l_t = -f(rho_t) A, f(r) = sigmoid(tau (r - 1)) 4 / tau, with
    tau = tau_pos where A > 0, else tau_neg (TRL's sapo_temperature_pos / _neg).

    A soft gate in place of the clip: d l_t / d logp_t = -4 s (1 - s) rho_t A, s = sigmoid(tau
    (rho_t - 1)), which is GRPO's -A on policy (rho = 1) and fades smoothly as rho leaves 1;
    a larger tau_neg fades negative-advantage tokens faster (their updates are the less stable).
    """
    rho = torch.exp(logprobs - old_logprobs.detach())
    tau = torch.where(advantages > 0, advantages.new_tensor(tau_pos), advantages.new_tensor(tau_neg))
    return -torch.sigmoid(tau * (rho - 1)) * 4 / tau * advantages


def sequence_ratio_logprobs(logprobs: Tensor, old_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """GSPO: (B, T) log-probs whose ratio to old_logprobs is, at every token, the sequence's ratio

        s_i = exp(mean over i's mask tokens of (logp_t - old_logp_t)),

    the geometric mean of its token ratios, with its gradient through that mean (as TRL's
    importance_sampling_level="sequence" computes it). Fed to the token loss as `logprobs`, the
    surrogate, clip, delta and dual-clip read s_i unchanged. GSPO-token's form, sg[s_i] *
    exp(logp_t - sg[logp_t]) (arXiv 2507.18071 eq. 13-14), has the same values and gradients
    except where a per-token weight (tis_cap's w_t) varies along a sequence: we follow TRL there.
    """
    m = loss_mask.bool()
    log_ratio = torch.where(m, logprobs - old_logprobs.detach(), 0.0)                        # (B, T)
    seq = log_ratio.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)             # (B, 1)
    return old_logprobs.detach() + seq                                                       # (B, T)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3_t = exp(ref - logp) - (ref - logp) - 1: an unbiased, always >= 0 estimate of KL(pi || ref)."""
    d = ref_logprobs.detach() - logprobs
    return torch.exp(d) - d - 1


def kl_k3_corrected(logprobs: Tensor, ref_logprobs: Tensor, rho: Tensor) -> Tensor:
    """rho_t k3_t, DeepSeek-V3.2's unbiased KL estimate (arXiv 2512.02556; TRL's
    use_bias_correction_kl: per_token_kl * coef_1, coef_1 = pi / pi_old with its gradient).

    The tokens were drawn from pi_old, not pi: plain k3 (DeepSeekMath) then estimates the KL of
    the wrong distribution. Weighted by rho, with rho's gradient kept, the token's gradient is
    rho_t (logp_t - ref_t): the gradient of KL(pi || ref) sampled from pi_old, where plain k3's is
    1 - exp(ref_t - logp_t).
    """
    return rho * kl_k3(logprobs, ref_logprobs)


def tis_weight(old_logprobs: Tensor, sampler_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated importance weight w_t = min(exp(old - sampler), cap), detached.

    Corrects for the sampler's numerics differing from the trainer's (different kernels,
    bf16 KV cache): the tokens were drawn from the sampler's distribution, not pi_old's.
    """
    return torch.exp(old_logprobs - sampler_logprobs).clamp(max=cap).detach()


def token_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor, *,
               eps_low: float = 0.2, eps_high: float = 0.2,
               delta: float | None = None, dual_clip: float | None = None,
               ref_logprobs: Tensor | None = None, beta: float = 0.0,
               sampler_logprobs: Tensor | None = None, tis_cap: float | None = None,
               surrogate: str = "clip", tau_pos: float = 1.0, tau_neg: float = 1.05,
               kl_ratio: bool = False) -> Tensor:
    """The per-token loss w_t l_t + beta k3_t in fp32, 0 where loss_mask is 0: (B, T) -> (B, T).
    The reference for grpo.kernels.grpo_token_loss; advantages (B, 1) or (B, T).

    surrogate: "clip" (clipped_surrogate: eps_low, eps_high, delta, dual_clip), "cispo"
    (cispo_surrogate, capped at eps_high) or "sapo" (sapo_surrogate: tau_pos, tau_neg).
    kl_ratio: rho_t k3_t (kl_k3_corrected) in place of k3_t.
    """
    assert surrogate in ("clip", "cispo", "sapo"), f"{surrogate=} not in clip|cispo|sapo"
    m = loss_mask.bool()
    # padding may hold garbage (inf): zero every input there before any exp, or the masked
    # positions' gradient would be 0 * inf = nan
    clean = lambda x: None if x is None else torch.where(m, x.float(), 0.0)   # noqa: E731
    lp, old, ref, smp = clean(logprobs), clean(old_logprobs), clean(ref_logprobs), clean(sampler_logprobs)
    A = advantages.float()
    if surrogate == "cispo":
        loss = cispo_surrogate(lp, old, A, eps_high)
    elif surrogate == "sapo":
        loss = sapo_surrogate(lp, old, A, tau_pos, tau_neg)
    else:
        loss = clipped_surrogate(lp, old, A, eps_low, eps_high, delta, dual_clip)
    if smp is not None and tis_cap is not None:
        loss = tis_weight(old, smp, tis_cap) * loss
    if ref is not None and beta > 0:
        kl = kl_k3_corrected(lp, ref, torch.exp(lp - old.detach())) if kl_ratio else kl_k3(lp, ref)
        loss = loss + beta * kl
    return torch.where(m, loss, 0.0)

# -----------------------------------------------------------------------------
# aggregations: (B, T) token losses and mask -> scalar, for one micro-batch.
# num_sequences / num_tokens are totals over the whole optimizer step (all micro-batches, all
# ranks), so summing backward() over micro-batches and FSDP's mean over ranks gives exactly
# the full-batch gradient; the local sum is scaled by world_size because FSDP averages.

def grpo_aggregate(losses: Tensor, loss_mask: Tensor, num_sequences: int, world_size: int = 1) -> Tensor:
    """GRPO: mean over sequences of each sequence's token mean (long answers count less per token)."""
    per_seq = (losses * loss_mask).sum(-1) / loss_mask.sum(-1).clamp(min=1)   # (B,); empty rows add 0
    return per_seq.sum() * world_size / num_sequences


def bnpo_aggregate(losses: Tensor, loss_mask: Tensor, num_micro_batches: int = 1) -> Tensor:
    """BNPO: token mean within this micro-batch (so it depends on the split, by definition);
    averaged over micro-batches like a plain loss / grad_accum_steps, and over ranks by FSDP."""
    return (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1) / num_micro_batches


def dr_grpo_aggregate(losses: Tensor, loss_mask: Tensor, num_sequences: int,
                      max_completion_length: int, world_size: int = 1) -> Tensor:
    """Dr. GRPO: sum / (sequences x max completion tokens), a constant, so no length bias."""
    return (losses * loss_mask).sum() * world_size / (num_sequences * max_completion_length)


def dapo_aggregate(losses: Tensor, loss_mask: Tensor, num_tokens: int, world_size: int = 1) -> Tensor:
    """DAPO: global token mean; num_tokens counts the mask tokens of the whole optimizer step
    (dividing by the micro-batch's own count is the usual gradient-accumulation bug)."""
    # max: a step with every token masked gives 0, not NaN
    return (losses * loss_mask).sum() * world_size / max(num_tokens, 1)

# -----------------------------------------------------------------------------
# the one entry the trainer calls per micro-batch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")


@dataclass(frozen=True)
class LossOptions:
    """A run's loss settings, built once from its config (grpo.update.loss_options)."""
    # grpo | bnpo | dr_grpo | dapo: the clipped surrogate, aggregated by the *_aggregate of that name;
    # cispo (cispo_surrogate, DAPO's token mean) | sapo (sapo_surrogate, GRPO's sequence mean), as TRL
    loss_type: str = "grpo"
    eps_low: float = 0.2
    eps_high: float = 0.2              # clip-higher; cispo: the cap on rho itself (TRL's epsilon_high)
    delta: float | None = None         # two-sided clipping cap; None = off (the clipped surrogate only)
    dual_clip: float | None = None     # dual-clip c > 1; None = off (the clipped surrogate only)
    beta: float = 0.0                  # k3 KL weight (needs ref_logprobs)
    use_bias_correction_kl: bool = False  # rho_t k3_t in place of k3_t (kl_k3_corrected)
    tis_cap: float | None = None       # truncated IS cap (needs sampler_logprobs); None = off
    max_completion_length: int = 1        # Dr. GRPO's constant normalizer
    importance_sampling_level: str = "token"  # token (GRPO) | sequence (GSPO: sequence_ratio_logprobs)
    sapo_temperature_pos: float = 1.0  # SAPO's tau where A > 0
    sapo_temperature_neg: float = 1.05  # SAPO's tau where A <= 0
    backend: str | None = None         # token loss: "triton" | "torch" | None (triton on CUDA)

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r} not in {'|'.join(LOSS_TYPES)}")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(f"importance_sampling_level={self.importance_sampling_level!r} "
                             "not in token|sequence")
        if self.loss_type == "cispo" and self.importance_sampling_level == "sequence":
            raise ValueError("loss_type='cispo' weighs each token's log-prob by its own ratio: "
                             "importance_sampling_level='sequence' is not supported with it")
        if min(self.sapo_temperature_pos, self.sapo_temperature_neg) <= 0:
            raise ValueError(f"sapo temperatures {self.sapo_temperature_pos}, {self.sapo_temperature_neg} "
                             "must be > 0")

    @property
    def surrogate(self) -> str:  # token_loss's name for the token loss: clip | cispo | sapo
        return self.loss_type if self.loss_type in ("cispo", "sapo") else "clip"


@torch.no_grad()
def loss_metrics(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
                 opts: LossOptions, ref_logprobs: Tensor | None = None,
                 sampler_logprobs: Tensor | None = None,
                 ratio_logprobs: Tensor | None = None) -> dict[str, Tensor]:
    """Detached sums over the micro-batch's mask tokens; add them over micro-batches (and
    ranks), then divide by "tokens" for means (`ratio_logprobs`: what rho reads; GSPO's per sequence):
      tokens      number of mask tokens
      ratio       sum of rho_t
      clip_low    tokens where rho < 1 - eps_low and A < 0 (the clip zeroes their gradient)
      clip_high   tokens where rho > 1 + eps_high and A > 0; cispo: where rho > its cap and A > 0
                  (TRL's cispo_clip_ratio); sapo has no clip (both 0)
      dual_clip   tokens where the dual-clip bound c |A| is the loss (A < 0)
      kl          sum of k3_t, or of rho_t k3_t with use_bias_correction_kl (0 without ref_logprobs)
      is_weight   sum of the truncated importance weight w_t (tokens when no sampler log-probs)
      is_capped   tokens where w_t hit tis_cap
      sampler_gap sum of |old_logp - sampler_logp| (0 without sampler log-probs)
      sampler_gap_max  the largest |old_logp - sampler_logp| (a max over micro-batches, not a sum)
    """
    m = loss_mask.bool()
    A = advantages.float().expand_as(logprobs)                 # advantages broadcastable: (B, 1) or (B, T)
    s = lambda x: torch.where(m, x.float(), 0.0).sum()         # noqa: E731  (where: padding may hold inf)
    rho = torch.exp((logprobs if ratio_logprobs is None else ratio_logprobs) - old_logprobs)
    zero = logprobs.new_zeros((), dtype=torch.float32)
    out = {"tokens": m.sum().float(), "ratio": s(rho), "clip_low": s((rho < 1 - opts.eps_low) & (A < 0)),
           "clip_high": s((rho > 1 + opts.eps_high) & (A > 0)), "dual_clip": zero}
    if opts.surrogate == "cispo":
        out["clip_low"], out["clip_high"] = zero, s((rho > opts.eps_high) & (A > 0))
    elif opts.surrogate == "sapo":
        out["clip_low"], out["clip_high"] = zero, zero
    elif opts.dual_clip is not None:
        surrogate = clipped_surrogate(logprobs if ratio_logprobs is None else ratio_logprobs, old_logprobs, A,
                                      opts.eps_low, opts.eps_high, opts.delta)
        out["dual_clip"] = s((A < 0) & (surrogate > -opts.dual_clip * A))
    out["kl"] = zero
    if ref_logprobs is not None:
        out["kl"] = s(kl_k3_corrected(logprobs, ref_logprobs, rho) if opts.use_bias_correction_kl
                      else kl_k3(logprobs, ref_logprobs))
    if sampler_logprobs is not None:
        w = torch.exp(old_logprobs - sampler_logprobs)
        out["is_weight"] = s(w.clamp(max=opts.tis_cap) if opts.tis_cap is not None else w)
        out["is_capped"] = s(w > opts.tis_cap) if opts.tis_cap is not None else zero
        gap = (old_logprobs - sampler_logprobs).abs().float()
        out["sampler_gap"] = s(gap)
        out["sampler_gap_max"] = torch.where(m, gap, 0.0).amax()
    else:
        out["is_weight"], out["is_capped"], out["sampler_gap"] = out["tokens"], zero, zero
        out["sampler_gap_max"] = zero
    return out


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor,
                opts: LossOptions, *, num_sequences: float, num_tokens: float, world_size: int = 1,
                num_micro_batches: int = 1, ref_logprobs: Tensor | None = None,
                sampler_logprobs: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's loss and metrics. (B, T) token tensors, advantages (B,) or (B, T).

    num_sequences, num_tokens: totals over the optimizer step (all micro-batches and ranks);
    num_micro_batches: only BNPO uses it. The token loss runs the fused Triton kernel on CUDA
    (opts.backend) and token_loss above elsewhere: the same numbers.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]                        # (B, 1), broadcast over T
    sequence = opts.importance_sampling_level == "sequence"
    # GSPO: the ratio's log-probs carry each sequence's ratio; the KL (below) reads the real ones
    ratio_logprobs = sequence_ratio_logprobs(logprobs, old_logprobs, loss_mask) if sequence else logprobs
    kw = dict(eps_low=opts.eps_low, eps_high=opts.eps_high, delta=opts.delta, dual_clip=opts.dual_clip,
              ref_logprobs=None if sequence else ref_logprobs, beta=0.0 if sequence else opts.beta,
              sampler_logprobs=sampler_logprobs, tis_cap=opts.tis_cap, surrogate=opts.surrogate,
              tau_pos=opts.sapo_temperature_pos, tau_neg=opts.sapo_temperature_neg,
              kl_ratio=opts.use_bias_correction_kl)
    token = (kernels.grpo_token_loss if kernels.use_triton(logprobs, opts.backend, "the GRPO token loss")
             else token_loss)
    losses = token(ratio_logprobs, old_logprobs, advantages, loss_mask, **kw)   # (B, T) fp32, 0 off the mask
    if sequence and ref_logprobs is not None and opts.beta > 0:  # w_t l_t + beta k3_t, as token_loss adds it
        m = loss_mask.bool()  # padding may hold inf: zero it before the exp (as token_loss does)
        lp, ref = torch.where(m, logprobs.float(), 0.0), torch.where(m, ref_logprobs.float(), 0.0)
        if opts.use_bias_correction_kl:  # TRL's coef_1 at the sequence level: the sequence's ratio
            rho = torch.exp(torch.where(m, ratio_logprobs.float() - old_logprobs.float(), 0.0))
            kl = kl_k3_corrected(lp, ref, rho)
        else:
            kl = kl_k3(lp, ref)
        losses = losses + opts.beta * torch.where(m, kl, 0.0)
    m = loss_mask.float()
    if opts.loss_type in ("grpo", "sapo"):     # TRL aggregates sapo as grpo
        loss = grpo_aggregate(losses, m, num_sequences, world_size)
    elif opts.loss_type == "bnpo":
        loss = bnpo_aggregate(losses, m, num_micro_batches)
    elif opts.loss_type == "dr_grpo":
        loss = dr_grpo_aggregate(losses, m, num_sequences, opts.max_completion_length, world_size)
    else:                                      # dapo, and cispo (TRL aggregates it as dapo)
        loss = dapo_aggregate(losses, m, num_tokens, world_size)
    return loss, loss_metrics(logprobs, old_logprobs, advantages, loss_mask, opts,
                              ref_logprobs, sampler_logprobs, ratio_logprobs=ratio_logprobs)
