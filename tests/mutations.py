"""Loss options patched out one at a time, to prove the loss tests would notice. Each entry replaces
one function of grpo.loss, by name, with a version that lacks one option (mostly the original called
without it): no line of grpo/loss.py is quoted, so a reflow or a rename of a local changes nothing
here. tests/test_mutations.py runs tests/test_loss.py once per entry, in a child process that applies
it before the tests import grpo.loss, and expects a failure every time."""
import math

import torch

import grpo.loss

INF = math.inf


def original(name: str):
    return grpo.loss.__dict__["_unpatched_" + name]


def _no_flat_zero(rewards, G, scale="group", batch_rewards=None, backend=None):
    """group_advantages without a flat group's exact 0 (its mean may not be representable: 0.1 x 8)."""
    r = rewards.float().view(-1, G)
    centered = r - r.mean(dim=1, keepdim=True)
    if scale == "none":
        return centered.view(-1)
    std = r.std(dim=1, keepdim=True) if scale == "group" else (
        rewards if batch_rewards is None else batch_rewards).float().std()
    return (centered / (std + 1e-4)).view(-1)


def _no_clean(logprobs, old_logprobs, advantages, loss_mask, *, eps_low=0.2, eps_high=0.2, delta=None,
              dual_clip=None, ref_logprobs=None, beta=0.0, sampler_logprobs=None, tis_cap=None,
              surrogate="clip", tau_pos=1.0, tau_neg=1.05, kl_ratio=False):
    """token_loss without zeroing the padding before its exps (padding may hold inf: 0 x inf = nan)."""
    m = loss_mask.bool()
    f = lambda x: None if x is None else x.float()  # noqa: E731
    lp, old, ref, smp, A = f(logprobs), f(old_logprobs), f(ref_logprobs), f(sampler_logprobs), advantages.float()
    if surrogate == "cispo":
        loss = grpo.loss.cispo_surrogate(lp, old, A, eps_high)
    elif surrogate == "sapo":
        loss = grpo.loss.sapo_surrogate(lp, old, A, tau_pos, tau_neg)
    else:
        loss = grpo.loss.clipped_surrogate(lp, old, A, eps_low, eps_high, delta, dual_clip)
    if smp is not None and tis_cap is not None:
        loss = grpo.loss.tis_weight(old, smp, tis_cap) * loss
    if ref is not None and beta > 0:
        kl = grpo.loss.kl_k3_corrected(lp, ref, torch.exp(lp - old)) if kl_ratio else grpo.loss.kl_k3(lp, ref)
        loss = loss + beta * kl
    return torch.where(m, loss, 0.0)


def _advantages_of(transform):
    """group_advantages on transformed rewards (and batch rewards): an option of its input taken out."""
    def patched(rewards, G, scale="group", batch_rewards=None, backend=None):
        return original("group_advantages")(transform(rewards), G, scale,
                                            None if batch_rewards is None else transform(batch_rewards), backend)
    return patched


BY_NAME = {  # name: (function in grpo.loss, what replaces it)
    "delta": ("clipped_surrogate", lambda lp, old, A, eps_low=0.2, eps_high=0.2, delta=None, dual_clip=None:
              original("clipped_surrogate")(lp, old, A, eps_low, eps_high, None, dual_clip)),
    "dual_clip": ("clipped_surrogate", lambda lp, old, A, eps_low=0.2, eps_high=0.2, delta=None, dual_clip=None:
                  original("clipped_surrogate")(lp, old, A, eps_low, eps_high, delta, None)),
    "clip_higher": ("clipped_surrogate", lambda lp, old, A, eps_low=0.2, eps_high=0.2, delta=None, dual_clip=None:
                    original("clipped_surrogate")(lp, old, A, eps_low, eps_low, delta, dual_clip)),
    "clip": ("clipped_surrogate", lambda lp, old, A, eps_low=0.2, eps_high=0.2, delta=None, dual_clip=None:
             original("clipped_surrogate")(lp, old, A, INF, INF, delta, dual_clip)),  # a clip range with no edge
    "tis_cap": ("tis_weight", lambda old, smp, cap: original("tis_weight")(old, smp, INF)),
    "tis_weight": ("tis_weight", lambda old, smp, cap: torch.ones_like(old)),
    "k3_kl": ("kl_k3", lambda lp, ref: lp - ref.detach()),  # the k1 estimate, -(ref - logp), not k3
    "kl_term": ("kl_k3", lambda lp, ref: torch.zeros_like(lp)),
    "grpo_aggregate": ("grpo_aggregate", lambda losses, mask, n, world_size=1:  # a token sum, not a per-sequence mean
                       (losses * mask).sum() * world_size / n),
    "world_size": ("grpo_aggregate", lambda losses, mask, n, world_size=1: original("grpo_aggregate")(losses, mask, n)),
    "bnpo_aggregate": ("bnpo_aggregate", lambda losses, mask, num_micro_batches=1:
                       original("bnpo_aggregate")(losses, mask)),
    "dr_grpo_aggregate": ("dr_grpo_aggregate", lambda losses, mask, n, max_completion_length, world_size=1:
                          (losses * mask).sum() * world_size / n),  # no constant length normalizer
    "dapo_aggregate": ("dapo_aggregate", lambda losses, mask, num_tokens, world_size=1:  # the micro-batch's own count
                       (losses * mask).sum() * world_size / mask.sum().clamp(min=1)),
    "overlong_penalty": ("overlong_penalty", lambda lengths, max_len, buffer:  # no soft ramp: -1 past max_len only
                         torch.where(lengths <= max_len, 0.0, -1.0)),
    "flat_groups_exact_zero": ("group_advantages", _no_flat_zero),
    "masked_garbage": ("token_loss", _no_clean),
    # GSPO off: the sequence level silently runs token ratios
    "gspo_sequence_ratio": ("sequence_ratio_logprobs", lambda logprobs, old_logprobs, loss_mask: logprobs),
    # GSPO's ratio without its gradient through the mean (a detached sequence ratio trains nothing)
    "gspo_ratio_gradient": ("sequence_ratio_logprobs", lambda logprobs, old_logprobs, loss_mask:
                            original("sequence_ratio_logprobs")(logprobs, old_logprobs, loss_mask).detach()),
    # TRL's cases (tests/test_trl_loss.py): an unscorable reward counted as 0, an infinite one kept huge
    "unscorable_left_out": ("group_advantages", _advantages_of(lambda r: torch.nan_to_num(r, nan=0.0))),
    "infinite_group_zero": ("group_advantages", _advantages_of(lambda r: torch.where(r.isinf(), r.sign() * 1e6, r))),
    "cispo_cap": ("cispo_surrogate", lambda lp, old, A, cap: original("cispo_surrogate")(lp, old, A, INF)),
    "cispo_weight_detached": ("cispo_surrogate", lambda lp, old, A, cap:  # the weight differentiated too
                              -torch.exp(lp - old).clamp(max=cap) * A * lp),
    "sapo_gate": ("sapo_surrogate", lambda lp, old, A, tau_pos=1.0, tau_neg=1.05: -torch.exp(lp - old) * A),
    "sapo_temperature_neg": ("sapo_surrogate", lambda lp, old, A, tau_pos=1.0, tau_neg=1.05:
                             original("sapo_surrogate")(lp, old, A, tau_pos, tau_pos)),
    "kl_bias_correction": ("kl_k3_corrected", lambda lp, ref, rho: grpo.loss.kl_k3(lp, ref)),
    "kl_ratio_gradient": ("kl_k3_corrected", lambda lp, ref, rho: original("kl_k3_corrected")(lp, ref, rho.detach())),
}


def apply(name: str):
    """Replace one function of grpo.loss by name, in the module's own namespace (the other functions
    of grpo.loss look it up there at each call); the original stays as _unpatched_<name>."""
    attr, replacement = BY_NAME[name]
    assert callable(getattr(grpo.loss, attr, None)), f"mutation {name!r}: grpo.loss has no {attr}"
    grpo.loss.__dict__["_unpatched_" + attr] = getattr(grpo.loss, attr)
    setattr(grpo.loss, attr, replacement)
