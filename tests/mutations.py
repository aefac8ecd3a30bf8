"""Loss options patched out one at a time, to prove the loss tests would notice: each MUTATIONS
entry replaces one line of grpo/loss.py; each BY_NAME entry replaces one of its functions, by
name, so that it keeps working when the function's lines are edited. tests/test_mutations.py runs
tests/test_loss.py once per entry, in a child process that applies it before the tests import
grpo.loss, and expects a failure every time."""
import grpo.loss

MUTATIONS = {  # name: (text in grpo/loss.py, what replaces it)
    "delta": ("unclipped = (rho if delta is None else rho.clamp(max=delta)) * A", "unclipped = rho * A"),
    "dual_clip": ("loss = torch.where(A < 0, torch.minimum(loss, -dual_clip * A), loss)", "loss = loss"),
    "tis_cap": ("return torch.exp(old_logprobs - sampler_logprobs).clamp(max=cap).detach()",
                "return torch.exp(old_logprobs - sampler_logprobs).detach()"),
    "tis_weight": ("loss = tis_weight(old, smp, tis_cap) * loss", "loss = loss"),
    "clip_higher": ("clipped = rho.clamp(1 - eps_low, 1 + eps_high) * A", "clipped = rho.clamp(1 - eps_low, 1 + eps_low) * A"),
    "clip": ("loss = -torch.minimum(unclipped, clipped)", "loss = -unclipped"),
    "k3_kl": ("return torch.exp(d) - d - 1", "return -d"),
    "kl_term": ("loss = loss + beta * kl_k3(lp, ref)", "loss = loss"),
    "grpo_aggregate": ("return per_seq.sum() * world_size / num_sequences",
                       "return (losses * loss_mask).sum() * world_size / num_sequences"),
    "bnpo_aggregate": ("return (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1) / num_micro_batches",
                       "return (losses * loss_mask).sum() / loss_mask.sum().clamp(min=1)"),
    "dr_grpo_aggregate": ("return (losses * loss_mask).sum() * world_size / (num_sequences * max_completion_length)",
                          "return (losses * loss_mask).sum() * world_size / num_sequences"),
    "dapo_aggregate": ("return (losses * loss_mask).sum() * world_size / max(num_tokens, 1)",
                       "return (losses * loss_mask).sum() * world_size / loss_mask.sum().clamp(min=1)"),
    "world_size": ("return per_seq.sum() * world_size / num_sequences", "return per_seq.sum() / num_sequences"),
    "overlong_penalty": ("return torch.where(lengths <= start, 0.0, torch.where(lengths <= max_len, ramp, -1.0))",
                         "return torch.where(lengths <= max_len, 0.0, -1.0)"),
    "flat_groups_exact_zero": ("centered = torch.where(flat, 0.0, r - r.mean(dim=1, keepdim=True))",
                               "centered = r - r.mean(dim=1, keepdim=True)"),
    "masked_garbage": ("clean = lambda x: None if x is None else torch.where(m, x.float(), 0.0)",
                       "clean = lambda x: None if x is None else x.float()"),
}


BY_NAME = {  # name: (function in grpo.loss, what replaces it)
    # GSPO off: the sequence level silently runs token ratios
    "gspo_sequence_ratio": ("sequence_ratio_logprobs", lambda logprobs, old_logprobs, loss_mask: logprobs),
    # GSPO's ratio without its gradient through the mean (a detached sequence ratio trains nothing)
    "gspo_ratio_gradient": ("sequence_ratio_logprobs",
                            lambda logprobs, old_logprobs, loss_mask: _seq(logprobs, old_logprobs, loss_mask).detach()),
}


def _seq(logprobs, old_logprobs, loss_mask):
    return grpo.loss.__dict__["_unpatched_sequence_ratio_logprobs"](logprobs, old_logprobs, loss_mask)


def apply(name: str):
    """Replace one function of grpo.loss by name (BY_NAME), or re-execute grpo/loss.py with one
    line replaced (MUTATIONS), in the module's own namespace."""
    if name in BY_NAME:
        attr, replacement = BY_NAME[name]
        assert callable(getattr(grpo.loss, attr, None)), f"mutation {name!r}: grpo.loss has no {attr}"
        grpo.loss.__dict__["_unpatched_" + attr] = getattr(grpo.loss, attr)
        setattr(grpo.loss, attr, replacement)
        return
    old, new = MUTATIONS[name]
    source = open(grpo.loss.__file__).read()
    assert source.count(old) == 1, f"mutation {name!r}: its line is not in grpo/loss.py once"
    exec(compile(source.replace(old, new), grpo.loss.__file__, "exec"), grpo.loss.__dict__)
