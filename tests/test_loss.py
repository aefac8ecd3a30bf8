"""grpo.loss: hand-computed values, every loss option against an independent float64 version,
and gradient accumulation: micro-batches and ranks must not change the gradient."""
import itertools
import math
import statistics

import pytest
import torch

from grpo.loss import (LossOptions, clipped_surrogate, group_advantages, kl_k3, overlong_penalty,
                       policy_loss, tis_weight, token_loss)

# -----------------------------------------------------------------------------
# hand-written numbers


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 3.0, 3.0])               # two groups of G=2
    std = math.sqrt(0.5)                                  # unbiased std of (1, 0): sqrt(2 * 0.25 / 1)
    expected = torch.tensor([0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.0, 0.0])
    torch.testing.assert_close(group_advantages(r, 2, "group"), expected)
    torch.testing.assert_close(group_advantages(r, 2, "none"), torch.tensor([0.5, -0.5, 0.0, 0.0]))
    # std of all raw rewards, here of another rank's rewards too: (1, 0, 3, 3, 0, 0, 0, 4)
    everyone = torch.cat([r, torch.tensor([0.0, 0.0, 0.0, 4.0])])
    batch_std = statistics.stdev(everyone.tolist())       # unbiased, independent of torch
    torch.testing.assert_close(group_advantages(r, 2, "batch", batch_rewards=everyone),
                               torch.tensor([0.5, -0.5, 0.0, 0.0]) / (batch_std + 1e-4))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("value", [0.1, 1 / 3, 0.7, -2.3])
def test_flat_groups_get_exactly_zero(scale, value):
    """A group of equal rewards whose mean is not exactly representable must not leave a tiny
    advantage of one sign (it would be trained on with a KL term or BNPO)."""
    r = torch.tensor([value] * 8 + [0.0, 1.0] * 4)        # a flat group of 8, then an informative one
    A = group_advantages(r, 8, scale)
    assert (A[:8] == 0).all(), A[:8]
    assert (A[8:] != 0).all()


def test_batch_scale_on_several_ranks_needs_every_ranks_rewards(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    with pytest.raises(ValueError, match="batch_rewards"):
        group_advantages(torch.tensor([0.0, 1.0]), 2, "batch")


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([3, 6, 8, 10, 11])             # L_max 10, buffer 4: ramp over (6, 10]
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4), torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))


def test_surrogate_by_hand():
    lp = torch.tensor([math.log(1.5)] * 4)                # rho = 1.5 against old 0
    old = torch.zeros(4)
    A = torch.tensor([1.0, -1.0, 2.0, -2.0])
    # A > 0: clipped at 1.2; A < 0: the unclipped 1.5 |A| is the larger loss
    torch.testing.assert_close(clipped_surrogate(lp, old, A), torch.tensor([-1.2, 1.5, -2.4, 3.0]))
    # delta 1.4 caps rho inside the unclipped term; dual-clip 1.3 bounds the loss by 1.3 |A|
    torch.testing.assert_close(clipped_surrogate(lp, old, A, delta=1.4), torch.tensor([-1.2, 1.4, -2.4, 2.8]))
    torch.testing.assert_close(clipped_surrogate(lp, old, A, dual_clip=1.3), torch.tensor([-1.2, 1.3, -2.4, 2.6]))
    # clip-higher: eps_high 0.6 leaves rho = 1.5 unclipped
    torch.testing.assert_close(clipped_surrogate(lp, old, A, eps_high=0.6), torch.tensor([-1.5, 1.5, -3.0, 3.0]))


def test_kl_and_tis_by_hand():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])
    torch.testing.assert_close(kl_k3(lp, ref), torch.tensor([0.0, math.e - 2.0]))
    old, sampler = torch.tensor([-1.0, -1.0]), torch.tensor([-1.5, -0.5])
    torch.testing.assert_close(tis_weight(old, sampler, cap=1.5), torch.tensor([1.5, math.exp(-0.5)]))

# -----------------------------------------------------------------------------
# every option combination on the torch path against an independent float64 version


def naive_policy_loss(lp, old, A, mask, agg, num_seq, num_tok, L, eps_low, eps_high, delta, dual, ref, beta,
                      sampler, cap, sequence: bool = False):
    """Token by token in float64, written from the papers' equations without sharing code with grpo.loss.
    `sequence`: TRL's sequence level (GSPO): s_b = exp(mean of the masked log-ratios), differentiated
    through that mean, in place of every token's ratio; KL on the real log-probs."""
    B, T = lp.shape
    total = 0.0
    for b in range(B):
        n = max(mask[b].sum(), 1)
        seq_rho = torch.exp(sum((lp[b, t] - old[b, t]) * mask[b, t] for t in range(T)) / n) if sequence else None
        seq = []
        for t in range(T):
            rho = seq_rho if sequence else torch.exp(lp[b, t] - old[b, t])
            r1 = torch.clamp(rho, max=delta) if delta is not None else rho
            lt = -torch.minimum(r1 * A[b], torch.clamp(rho, 1 - eps_low, 1 + eps_high) * A[b])
            if dual is not None and A[b] < 0:
                lt = torch.minimum(lt, -dual * A[b])
            if sampler is not None:
                lt = lt * min(math.exp(old[b, t] - sampler[b, t]), cap)
            if ref is not None:
                d = ref[b, t] - lp[b, t]
                lt = lt + beta * (torch.exp(d) - d - 1)
            seq.append(lt * mask[b, t])
        s = torch.stack(seq).sum()
        total = total + (s / n / num_seq if agg == "grpo" else s)
    return {"grpo": total, "dr_grpo": total / (num_seq * L), "dapo": total / num_tok,
            "bnpo": total / mask.sum()}[agg]


def active_batch(dtype=torch.float64):
    """A batch where every option changes the loss: ratios below 1 - eps_low, between the two
    clip-higher bounds (1.2, 1.28), above delta (4) and above dual-clip (3), for both signs of
    the advantage; TIS weights above the cap (2); a reference that differs; rows of unequal
    length and a fully masked one (its values finite: the float64 formula multiplies by 0)."""
    log_rho = torch.log(torch.tensor([0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.5, 3.5, 5.0, 8.0], dtype=dtype))
    T = len(log_rho)
    old = -torch.linspace(0.2, 3.0, T, dtype=dtype).repeat(5, 1)                     # (5, T)
    lp = old + log_rho.roll(1) * torch.tensor([1.0, 1.0, 0.5, 1.0, 1.0], dtype=dtype)[:, None]  # shuffled per row
    lp[0] = old[0] + log_rho                                                          # row 0: every ratio, A > 0
    lp[1] = old[1] + log_rho.flip(0)                                                  # row 1: every ratio, A < 0
    A = torch.tensor([1.3, -0.7, 0.4, -2.0, 0.9], dtype=dtype)
    mask = torch.ones(5, T, dtype=dtype)
    mask[2, 7:] = 0                                                                   # unequal lengths
    mask[3, :2] = 0
    mask[4] = 0                                                                       # a fully masked row
    ref = old + torch.linspace(-0.5, 0.6, T, dtype=dtype)
    sampler = old - torch.tensor([-1.0, 0.3, 0.9, 2.0, 0.0, 1.2, -0.4, 0.8, 1.5, 0.1, 0.7], dtype=dtype)  # w up to e^2
    return lp, old, A, mask, ref, sampler


def make_batch(B=3, T=7, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    lp = old + torch.randn(B, T, generator=g, dtype=dtype) * 0.4      # ratios well outside [0.8, 1.2]
    mask = (torch.rand(B, T, generator=g) > 0.3).to(dtype)
    mask[-1] = 0                                                        # a fully masked row
    A = torch.randn(B, generator=g, dtype=dtype)
    ref = old + torch.randn(B, T, generator=g, dtype=dtype) * 0.3
    sampler = old + torch.randn(B, T, generator=g, dtype=dtype) * 0.3
    return lp, old, A, mask, ref, sampler


OPTIONS = list(itertools.product(["grpo", "bnpo", "dr_grpo", "dapo"], [None, 4.0], [None, 3.0], [False, True],
                                 [False, True], [0.2, 0.28]))


def run_policy_loss(agg, delta, dual, kl, tis, eps_high, dtype=torch.float32):
    """(loss, gradient, metrics) of policy_loss on the active batch, and the float64 reference's."""
    lp, old, A, mask, ref, sampler = active_batch()
    opts = LossOptions(loss_type=agg, eps_low=0.2, eps_high=eps_high, delta=delta, dual_clip=dual,
                       beta=0.05 if kl else 0.0, tis_cap=2.0 if tis else None, max_completion_length=13, backend="torch")
    x = lp.to(dtype).requires_grad_()
    loss, metrics = policy_loss(x, old.to(dtype), A.to(dtype), mask.to(dtype), opts, num_sequences=6, num_tokens=40,
                                ref_logprobs=ref.to(dtype) if kl else None,
                                sampler_logprobs=sampler.to(dtype) if tis else None)
    loss.backward()
    lp64 = lp.clone().requires_grad_()
    expected = naive_policy_loss(lp64, old, A, mask, agg, 6, 40, 13, 0.2, eps_high, delta, dual,
                                 ref if kl else None, 0.05 if kl else 0.0, sampler if tis else None, 2.0)
    expected.backward()
    return (loss, x.grad, metrics), (expected, lp64.grad)


@pytest.mark.parametrize("agg,delta,dual,kl,tis,eps_high", OPTIONS)
def test_policy_loss_every_option(agg, delta, dual, kl, tis, eps_high):
    (loss, grad, metrics), (expected, expected_grad) = run_policy_loss(agg, delta, dual, kl, tis, eps_high)
    # fp32 inputs against float64: relative error of a few fp32 ulps per token, summed over 44
    torch.testing.assert_close(loss.double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad.double(), expected_grad, atol=1e-6, rtol=1e-5)
    assert grad[4].abs().sum() == 0, "a fully masked row must get no gradient"
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("option,on,off", [
    ("delta", dict(delta=4.0), {}), ("dual", dict(dual=3.0), {}), ("kl", dict(kl=True), {}),
    ("tis", dict(tis=True), {}), ("eps_high", dict(eps_high=0.28), {}),
    ("delta under dual-clip", dict(delta=2.0, dual=3.0), dict(dual=3.0))])
def test_every_option_is_active_in_the_batch(option, on, off):
    """Guards the test above: each option alone changes the gradient of the active batch, so a
    code path that ignored it would fail there."""
    base = dict(agg="dapo", delta=None, dual=None, kl=False, tis=False, eps_high=0.2)
    (_, with_option, _), _ = run_policy_loss(**{**base, **on})
    (_, without, _), _ = run_policy_loss(**{**base, **off})
    assert (with_option - without).abs().max() > 1e-3, option


def test_token_loss_ignores_garbage_under_the_mask():
    """Padding may hold inf or nan log-probs: the masked positions get loss 0 and gradient 0,
    not nan (exp's backward would give 0 * inf there)."""
    lp, old, A, mask, ref, sampler = active_batch(torch.float32)
    for garbage in (float("inf"), float("-inf"), float("nan")):
        x = torch.where(mask.bool(), lp, garbage).requires_grad_()
        kw = dict(delta=4.0, dual_clip=3.0, ref_logprobs=torch.where(mask.bool(), ref, garbage), beta=0.05,
                  sampler_logprobs=torch.where(mask.bool(), sampler, garbage), tis_cap=2.0)
        loss = token_loss(x, torch.where(mask.bool(), old, garbage), A[:, None], mask, **kw)
        loss.sum().backward()
        assert torch.isfinite(loss).all() and (loss[mask == 0] == 0).all()
        assert torch.isfinite(x.grad).all() and (x.grad[mask == 0] == 0).all(), garbage


def test_metrics_by_hand():
    lp = torch.log(torch.tensor([[0.5, 1.5, 1.0]]))                # rho = 0.5, 1.5, 1.0 against old 0
    old, mask = torch.zeros(1, 3), torch.ones(1, 3)
    opts = LossOptions(dual_clip=1.2, tis_cap=1.0, max_completion_length=3)
    _, m = policy_loss(lp, old, torch.tensor([-1.0]), mask, opts, num_sequences=1, num_tokens=3,
                       sampler_logprobs=torch.tensor([[0.0, 0.0, 1.0]]))
    assert m["clip_low"] == 1 and m["clip_high"] == 0           # rho 0.5 < 0.8 with A < 0
    assert m["dual_clip"] == 1                                    # rho 1.5: loss 1.5 > 1.2 |A|
    torch.testing.assert_close(m["ratio"], torch.tensor(3.0))
    torch.testing.assert_close(m["is_weight"], torch.tensor(2.0 + math.exp(-1.0)))
    torch.testing.assert_close(m["sampler_gap"], torch.tensor(1.0))

# -----------------------------------------------------------------------------
# gradient accumulation and world size: the same gradient however the step is split


def step_grad(parts, agg, num_sequences, num_tokens, world_size=1, num_micro_batches=1):
    """Sum of backward() over (lp, old, A, mask) micro-batches; the counts are step totals."""
    grads = []
    for lp, old, A, mask in parts:
        lp = lp.clone().requires_grad_()
        opts = LossOptions(loss_type=agg, max_completion_length=16, backend="torch")
        loss, _ = policy_loss(lp, old, A, mask, opts, num_sequences=num_sequences, num_tokens=num_tokens,
                              world_size=world_size, num_micro_batches=num_micro_batches)
        loss.backward()
        grads.append(lp.grad)
    return torch.cat(grads)


@pytest.mark.parametrize("agg", ["grpo", "dr_grpo", "dapo"])
def test_gradient_accumulation(agg):
    lp, old, A, mask, _, _ = make_batch(B=6, T=16, seed=1)
    mask[0, 12:] = 0                                              # unequal lengths: DAPO's count matters
    totals = dict(num_sequences=6, num_tokens=int(mask.sum()))     # over the whole step
    full = step_grad([(lp, old, A, mask)], agg, **totals)
    split = step_grad([(lp[:2], old[:2], A[:2], mask[:2]), (lp[2:], old[2:], A[2:], mask[2:])], agg, **totals)
    torch.testing.assert_close(split, full, atol=1e-7, rtol=1e-5)
    # two ranks with world_size=2, then FSDP's mean over ranks: the same gradient again
    rank0 = step_grad([(lp[:3], old[:3], A[:3], mask[:3])], agg, **totals, world_size=2)
    rank1 = step_grad([(lp[3:], old[3:], A[3:], mask[3:])], agg, **totals, world_size=2)
    # each rank's gradient lives on its own tokens; the mean over 2 ranks halves it back
    torch.testing.assert_close(torch.cat([rank0, rank1]) / 2, full, atol=1e-7, rtol=1e-5)


def test_bnpo_is_per_micro_batch():
    """BNPO: each micro-batch's own token mean, averaged over micro-batches (the float64 formula
    per micro-batch, halved)."""
    lp, old, A, mask, _, _ = make_batch(B=4, T=8, seed=2, dtype=torch.float64)
    mask = torch.zeros(4, 8, dtype=torch.float64)
    mask[0, :3], mask[1, :1], mask[2:, :6] = 1, 1, 1                # 4 tokens, then 12: unequal counts
    parts = [(lp[:2], old[:2], A[:2], mask[:2]), (lp[2:], old[2:], A[2:], mask[2:])]
    grads = step_grad(parts, "bnpo", num_sequences=4, num_tokens=1, num_micro_batches=2)
    for (lp_i, old_i, A_i, m_i), g in zip(parts, grads.split(2)):
        lp_i = lp_i.clone().requires_grad_()
        expected = naive_policy_loss(lp_i, old_i, A_i, m_i, "bnpo", 4, 1, 16, 0.2, 0.2, None, None, None, 0.0,
                                     None, None) / 2
        expected.backward()
        torch.testing.assert_close(g, lp_i.grad)
    # and not the token mean of the whole step (which is what a split-independent loss would give)
    whole = lp.clone().requires_grad_()
    naive_policy_loss(whole, old, A, mask, "bnpo", 4, 1, 16, 0.2, 0.2, None, None, None, 0.0, None, None).backward()
    assert (whole.grad - grads).abs().max() > 1e-3


# -----------------------------------------------------------------------------
# GSPO: one ratio per sequence (importance_sampling_level="sequence")

def test_sequence_level_ratio_by_hand():
    """Sequence 0: token log-ratios 0.1 and 0.3 (a third token masked) -> s = e^0.2 = 1.2214, past
    1 + eps = 1.2 with A > 0: clipped at every token, no gradient. Sequence 1: log-ratios -0.1, 0.1,
    0 -> s = 1, A = -1: each token's loss is 1 and d s / d logp_t = s / 3, so the GRPO mean over 2
    sequences gives 1/6 per token. Token level would clip only sequence 0's second token."""
    old = torch.zeros(2, 3, dtype=torch.float64)
    lp = torch.tensor([[0.1, 0.3, 7.0], [-0.1, 0.1, 0.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    A = torch.tensor([1.0, -1.0], dtype=torch.float64)
    opts = LossOptions(loss_type="grpo", importance_sampling_level="sequence", backend="torch")
    loss, metrics = policy_loss(lp, old, A, mask, opts, num_sequences=2, num_tokens=5)
    loss.backward()
    # the loss is computed in fp32: a few ulps
    torch.testing.assert_close(loss.double(), torch.tensor((-1.2 + 1.0) / 2, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, 0.0], [1 / 6] * 3], dtype=torch.float64),
                               atol=1e-6, rtol=0)
    # the logged ratio and clip counts are the sequence's: 2 tokens at e^0.2 and 3 at 1; 2 clipped high
    torch.testing.assert_close(metrics["ratio"].double(), torch.tensor(2 * math.exp(0.2) + 3, dtype=torch.float64),
                               atol=1e-5, rtol=0)
    assert metrics["clip_high"].item() == 2 and metrics["clip_low"].item() == 0


def naive_gspo_loss(*args):
    """The float64 reference at TRL's sequence level (GSPO)."""
    return naive_policy_loss(*args, sequence=True)


@pytest.mark.parametrize("agg,delta,dual,kl,tis", list(itertools.product(
    ["grpo", "bnpo", "dr_grpo", "dapo"], [None, 4.0], [None, 3.0], [False, True], [False, True])))
def test_sequence_level_every_option(agg, delta, dual, kl, tis):
    lp, old, A, mask, ref, sampler = active_batch()
    # rows whose sequence ratios land on each side of the clip range and past delta and dual-clip
    lp = old + (lp - old) * torch.tensor([0.6, 1.0, 0.9, 0.4, 1.0], dtype=torch.float64)[:, None]
    opts = LossOptions(loss_type=agg, eps_low=0.2, eps_high=0.28, delta=delta, dual_clip=dual,
                       beta=0.05 if kl else 0.0, tis_cap=2.0 if tis else None, max_completion_length=13,
                       backend="torch", importance_sampling_level="sequence")
    x = lp.float().requires_grad_()
    loss, _ = policy_loss(x, old.float(), A.float(), mask.float(), opts, num_sequences=6, num_tokens=40,
                          ref_logprobs=ref.float() if kl else None, sampler_logprobs=sampler.float() if tis else None)
    loss.backward()
    lp64 = lp.clone().requires_grad_()
    expected = naive_gspo_loss(lp64, old, A, mask, agg, 6, 40, 13, 0.2, 0.28, delta, dual, ref if kl else None,
                               0.05 if kl else 0.0, sampler if tis else None, 2.0)
    expected.backward()
    # fp32 inputs against float64, as in test_policy_loss_every_option
    torch.testing.assert_close(loss.double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), lp64.grad, atol=1e-6, rtol=1e-5)
    assert x.grad[4].abs().sum() == 0, "a fully masked row must get no gradient"
