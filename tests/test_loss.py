"""grpo.loss: hand-computed values, every loss option against an independent float64 version,
and gradient accumulation: micro-batches and ranks must not change the gradient."""
import itertools
import math

import pytest
import torch

from grpo.loss import (clipped_surrogate, group_advantages, kl_k3, overlong_penalty, policy_loss,
                       tis_weight)

# -----------------------------------------------------------------------------
# hand-written numbers


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 3.0, 3.0])               # two groups of G=2
    std = math.sqrt(0.5)                                  # unbiased std of (1, 0): sqrt(2 * 0.25 / 1)
    expected = torch.tensor([0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.0, 0.0])
    torch.testing.assert_close(group_advantages(r, 2, "group"), expected)
    torch.testing.assert_close(group_advantages(r, 2, "none"), torch.tensor([0.5, -0.5, 0.0, 0.0]))
    batch_std = r.std().item()                            # std of all raw rewards: 1.5
    torch.testing.assert_close(group_advantages(r, 2, "batch"),
                               torch.tensor([0.5, -0.5, 0.0, 0.0]) / (batch_std + 1e-4))


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
                      sampler, cap):
    """Token by token in float64, written from DESIGN.md's math without sharing code with grpo.loss."""
    B, T = lp.shape
    total = 0.0
    for b in range(B):
        seq = []
        for t in range(T):
            rho = torch.exp(lp[b, t] - old[b, t])
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
        total = total + (s / max(mask[b].sum(), 1) / num_seq if agg == "grpo" else s)
    return {"grpo": total, "dr_grpo": total / (num_seq * L), "dapo": total / num_tok,
            "bnpo": total / mask.sum()}[agg]


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


OPTIONS = list(itertools.product(["grpo", "bnpo", "dr_grpo", "dapo"], [None, 1.5], [None, 3.0], [False, True], [False, True]))


@pytest.mark.parametrize("agg,delta,dual,kl,tis", OPTIONS)
def test_policy_loss_every_option(agg, delta, dual, kl, tis):
    lp, old, A, mask, ref, sampler = make_batch(dtype=torch.float64)
    kw = dict(eps_low=0.2, eps_high=0.28, delta=delta, dual_clip=dual, ref_logprobs=ref if kl else None,
              beta=0.05 if kl else 0.0, sampler_logprobs=sampler if tis else None, tis_cap=2.0 if tis else None)
    lp32 = lp.float().requires_grad_()
    loss, metrics = policy_loss(lp32, old.float(), A.float(), mask.float(), aggregation=agg, num_sequences=5,
                                num_tokens=20, max_completion_len=9, backend="torch",
                                **{k: (v.float() if torch.is_tensor(v) else v) for k, v in kw.items()})
    loss.backward()
    lp64 = lp.clone().requires_grad_()
    expected = naive_policy_loss(lp64, old, A, mask, agg, 5, 20, 9, kw["eps_low"], kw["eps_high"], delta, dual,
                                 kw["ref_logprobs"], kw["beta"], kw["sampler_logprobs"], kw["tis_cap"])
    expected.backward()
    # fp32 inputs against float64: relative error of a few fp32 ulps per token, summed over 21
    torch.testing.assert_close(loss.double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lp32.grad.double(), lp64.grad, atol=1e-6, rtol=1e-5)
    assert lp32.grad[-1].abs().sum() == 0, "a fully masked row must get no gradient"
    assert metrics["tokens"] == mask.sum() and all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_metrics_by_hand():
    lp = torch.log(torch.tensor([[0.5, 1.5, 1.0]]))                # rho = 0.5, 1.5, 1.0 against old 0
    old, mask = torch.zeros(1, 3), torch.ones(1, 3)
    _, m = policy_loss(lp, old, torch.tensor([-1.0]), mask, num_sequences=1, num_tokens=3, max_completion_len=3,
                       dual_clip=1.2, sampler_logprobs=torch.tensor([[0.0, 0.0, 1.0]]), tis_cap=1.0)
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
        loss, _ = policy_loss(lp, old, A, mask, aggregation=agg, num_sequences=num_sequences,
                              num_tokens=num_tokens, max_completion_len=16, world_size=world_size,
                              num_micro_batches=num_micro_batches, backend="torch")
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
    lp, old, A, mask, _, _ = make_batch(B=4, T=8, seed=2)
    parts = [(lp[:2], old[:2], A[:2], mask[:2]), (lp[2:], old[2:], A[2:], mask[2:])]
    grads = step_grad(parts, "bnpo", num_sequences=4, num_tokens=1, num_micro_batches=2)
    for (lp_i, old_i, A_i, m_i), g in zip(parts, grads.split(2)):  # each: its own token mean, halved
        lp_i = lp_i.clone().requires_grad_()
        loss, _ = policy_loss(lp_i, old_i, A_i, m_i, aggregation="bnpo", num_sequences=4, num_tokens=1,
                              max_completion_len=8, backend="torch")
        (loss / 2).backward()
        torch.testing.assert_close(g, lp_i.grad)
