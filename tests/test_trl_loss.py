"""grpo.loss where TRL's GRPOTrainer (trl/trainer/grpo_trainer.py) decides: an unscorable completion
(every reward function returned None) and an infinite reward in the advantages, the ratio-weighted
k3 of use_bias_correction_kl, and the cispo and sapo loss types, on hand-worked numbers and against
an independent float64 version. tests/test_mutations.py runs this file with tests/test_loss.py."""
import itertools
import math
import statistics

import pytest
import torch

from grpo.loss import LossOptions, group_advantages, policy_loss

NAN, INF = math.nan, math.inf

# -----------------------------------------------------------------------------
# advantages: NaN rewards (unscorable) and infinite ones


def by_hand(rewards: list, scale: str, batch_std: float | None = None) -> list:
    """One group's advantages from its rewards, with statistics (independent of torch)."""
    mean = statistics.fmean(rewards)
    std = {"group": statistics.stdev(rewards), "batch": batch_std, "none": None}[scale]
    return [r - mean if std is None else (r - mean) / (std + 1e-4) for r in rewards]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_unscorable_rows_get_zero_and_leave_their_group(scale):
    """TRL: NaN rewards left out of nanmean / nanstd, their advantage nan_to_num'd to 0. The
    others get exactly the advantages of their group without the unscorable row."""
    r = torch.tensor([1.0, NAN, 0.0, 3.0, 2.0, 5.0, NAN, 1.0])          # two groups of G=4, one NaN each
    A = group_advantages(r, 4, scale)
    assert A[1] == 0 and A[6] == 0
    scored = [1.0, 0.0, 3.0, 2.0, 5.0, 1.0]
    batch_std = statistics.stdev(scored)                                # the batch std leaves NaN out too
    expected = by_hand(scored[:3], scale, batch_std) + by_hand(scored[3:], scale, batch_std)
    torch.testing.assert_close(A[[0, 2, 3, 4, 5, 7]], torch.tensor(expected))
    # the same as the groups of 3 that they are
    torch.testing.assert_close(A[[0, 2, 3, 4, 5, 7]], group_advantages(torch.tensor(scored), 3, scale))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_group_with_fewer_than_two_scorable_rewards_gets_zero(scale):
    """TRL's nanstd of a single value is NaN, so the whole group's advantages become 0."""
    r = torch.tensor([NAN, 4.0, NAN, NAN, NAN, NAN, NAN, NAN, 0.0, 1.0, 1.0, 0.0])
    A = group_advantages(r, 4, scale)
    assert (A[:8] == 0).all() and (A[8:] != 0).all(), A


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("inf", [INF, -INF])
def test_an_infinite_reward_zeroes_its_group_only(scale, inf):
    """TRL: inf - inf is NaN through the group's statistics, then 0. Here the group is 0 under every
    scale, and the other groups are as if it held no infinity (the batch std leaves inf out)."""
    r = torch.tensor([1.0, inf, 0.0, 3.0, 0.0, 1.0, 1.0, 0.0])
    A = group_advantages(r, 4, scale)
    assert torch.isfinite(A).all() and (A[:4] == 0).all()
    batch_std = statistics.stdev([1.0, 0.0, 3.0, 0.0, 1.0, 1.0, 0.0])
    torch.testing.assert_close(A[4:], torch.tensor(by_hand([0.0, 1.0, 1.0, 0.0], scale, batch_std)))

# -----------------------------------------------------------------------------
# the KL with use_bias_correction_kl: rho_t k3_t (DeepSeek-V3.2)


def test_bias_corrected_kl_by_hand():
    """rho = 2 and 1/2, A = 0 (no policy term), beta 0.5, the DAPO mean over 2 tokens. The loss is
    beta/2 sum rho_t k3_t and the gradient beta/2 rho_t (logp_t - ref_t): the ratio is
    differentiated too (TRL multiplies by coef_1, not detached)."""
    old = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    lp = (old + torch.tensor([[math.log(2), -math.log(2)]], dtype=torch.float64)).requires_grad_()
    ref = torch.tensor([[-1.0, -0.5]], dtype=torch.float64)
    d = [-math.log(2), 0.5 + math.log(2)]                                # ref - logp
    k3 = [math.exp(x) - x - 1 for x in d]
    rho = [2.0, 0.5]
    opts = LossOptions(loss_type="dapo", beta=0.5, use_bias_correction_kl=True, backend="torch")
    loss, metrics = policy_loss(lp, old, torch.zeros(1), torch.ones(1, 2), opts, num_sequences=1, num_tokens=2,
                                ref_logprobs=ref)
    loss.backward()
    # the loss is computed in fp32: a few ulps
    torch.testing.assert_close(loss.item(), 0.25 * (rho[0] * k3[0] + rho[1] * k3[1]), atol=1e-6, rtol=0)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.25 * r * -x for r, x in zip(rho, d)]], dtype=torch.float64),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(metrics["kl"].item(), rho[0] * k3[0] + rho[1] * k3[1], atol=1e-6, rtol=0)
    # plain k3 (the default, as in TRL): gradient beta/2 (1 - exp(ref - logp))
    lp.grad = None
    loss, _ = policy_loss(lp, old, torch.zeros(1), torch.ones(1, 2), LossOptions(loss_type="dapo", beta=0.5),
                          num_sequences=1, num_tokens=2, ref_logprobs=ref)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.25 * (1 - math.exp(x)) for x in d]], dtype=torch.float64),
                               atol=1e-6, rtol=0)

# -----------------------------------------------------------------------------
# CISPO and SAPO by hand


def test_cispo_by_hand():
    """rho 0.5, 1.5, 3 against old 0, cap (epsilon_high) 2: l_t = -min(rho_t, 2) A logp_t, gradient
    -min(rho_t, 2) A, also where PPO's clip would give none (rho 1.5 > 1.2 with A > 0); summed
    over the step's 10 tokens (TRL aggregates cispo as dapo), a masked token left out."""
    rho = [[0.5, 1.5, 3.0], [0.5, 1.5, 3.0]]
    lp = torch.tensor(rho, dtype=torch.float64).log().requires_grad_()
    A, mask = torch.tensor([1.0, -2.0], dtype=torch.float64), torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    opts = LossOptions(loss_type="cispo", eps_high=2.0, backend="torch")
    loss, metrics = policy_loss(lp, torch.zeros(2, 3, dtype=torch.float64), A, mask.double(), opts,
                                num_sequences=4, num_tokens=10)
    loss.backward()
    w = [[min(r, 2.0) for r in row] for row in rho]
    expected = sum(-w[b][t] * A[b].item() * math.log(rho[b][t]) * mask[b, t].item() for b in range(2) for t in range(3))
    torch.testing.assert_close(loss.item(), expected / 10, atol=1e-6, rtol=0)
    grad = torch.tensor([[-w[b][t] * A[b].item() * mask[b, t].item() / 10 for t in range(3)] for b in range(2)])
    torch.testing.assert_close(lp.grad.float(), grad, atol=1e-6, rtol=0)
    assert metrics["clip_high"] == 1 and metrics["clip_low"] == 0     # TRL's cispo_clip_ratio: rho > cap, A > 0


def test_sapo_by_hand():
    """f(r) = sigmoid(tau (r - 1)) 4 / tau, tau 1 where A > 0 and 2 (sapo_temperature_neg) where
    A < 0: l_t = -f(rho_t) A, gradient -4 s (1 - s) rho_t A; the per-sequence mean over the step's
    3 sequences (TRL aggregates sapo as grpo)."""
    rho = [0.5, 1.0, 2.0]
    lp = torch.tensor([rho, rho], dtype=torch.float64).log().requires_grad_()
    A, tau = [1.0, -1.5], [1.0, 2.0]
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    opts = LossOptions(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=2.0, backend="torch")
    loss, metrics = policy_loss(lp, torch.zeros(2, 3, dtype=torch.float64), torch.tensor(A, dtype=torch.float64),
                                mask, opts, num_sequences=3, num_tokens=10)
    loss.backward()
    sig = lambda x: 1 / (1 + math.exp(-x))                              # noqa: E731
    n = [3, 2]
    expected = sum(-sig(tau[b] * (r - 1)) * 4 / tau[b] * A[b] / n[b] for b in range(2) for r in rho[:n[b]]) / 3
    torch.testing.assert_close(loss.item(), expected, atol=1e-6, rtol=0)
    grad = [[-4 * sig(tau[b] * (r - 1)) * (1 - sig(tau[b] * (r - 1))) * r * A[b] / n[b] / 3 if t < n[b] else 0.0
             for t, r in enumerate(rho)] for b in range(2)]
    torch.testing.assert_close(lp.grad, torch.tensor(grad, dtype=torch.float64), atol=1e-6, rtol=0)
    assert lp.grad[0, 1].item() == pytest.approx(-A[0] / 3 / 3)      # on policy: GRPO's gradient -A
    assert metrics["clip_high"] == 0 and metrics["clip_low"] == 0     # no hard clip

# -----------------------------------------------------------------------------
# every option of the new loss types against an independent float64 version


def naive_loss(lp, old, A, mask, loss_type, num_seq, num_tok, cap, tau_pos, tau_neg, ref, beta, corrected, sampler,
               tis_cap, sequence=False):
    """Token by token in float64 from the papers' equations and TRL's aggregation, sharing no code with grpo.loss."""
    B, T = lp.shape
    total = 0.0
    for b in range(B):
        n = max(mask[b].sum(), 1)
        seq_rho = torch.exp(sum((lp[b, t] - old[b, t]) * mask[b, t] for t in range(T)) / n) if sequence else None
        s = 0.0
        for t in range(T):
            rho = seq_rho if sequence else torch.exp(lp[b, t] - old[b, t])
            if loss_type == "cispo":
                lt = -torch.clamp(rho, max=cap).detach() * A[b] * lp[b, t]
            else:
                tau = tau_pos if A[b] > 0 else tau_neg
                lt = -torch.sigmoid(tau * (rho - 1)) * 4 / tau * A[b]
            if sampler is not None:
                lt = lt * min(math.exp(old[b, t] - sampler[b, t]), tis_cap)
            if ref is not None:
                d = ref[b, t] - lp[b, t]
                lt = lt + beta * (torch.exp(d) - d - 1) * (rho if corrected else 1.0)
            s = s + lt * mask[b, t]
        total = total + (s / n / num_seq if loss_type == "sapo" else s / num_tok)
    return total


@pytest.mark.parametrize("loss_type,kl,corrected,tis,sequence", [
    (lt, kl, c, tis, seq) for lt, kl, c, tis, seq in itertools.product(
        ["cispo", "sapo"], [False, True], [False, True], [False, True], [False, True])
    if (kl or not c) and not (lt == "cispo" and seq)])
def test_cispo_and_sapo_every_option(loss_type, kl, corrected, tis, sequence):
    from test_loss import active_batch
    lp, old, A, mask, ref, sampler = active_batch()
    opts = LossOptions(loss_type=loss_type, eps_high=2.0, sapo_temperature_pos=1.0, sapo_temperature_neg=1.6,
                       beta=0.05 if kl else 0.0, use_bias_correction_kl=corrected, tis_cap=2.0 if tis else None,
                       importance_sampling_level="sequence" if sequence else "token", backend="torch")
    x = lp.float().requires_grad_()
    loss, _ = policy_loss(x, old.float(), A.float(), mask.float(), opts, num_sequences=6, num_tokens=40,
                          ref_logprobs=ref.float() if kl else None, sampler_logprobs=sampler.float() if tis else None)
    loss.backward()
    lp64 = lp.clone().requires_grad_()
    expected = naive_loss(lp64, old, A, mask, loss_type, 6, 40, 2.0, 1.0, 1.6, ref if kl else None, 0.05, corrected,
                          sampler if tis else None, 2.0, sequence)
    expected.backward()
    # fp32 inputs against float64: a few fp32 ulps per token, summed over 44
    torch.testing.assert_close(loss.double(), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), lp64.grad, atol=1e-6, rtol=1e-5)
    assert x.grad[4].abs().sum() == 0, "a fully masked row must get no gradient"


def test_cispo_refuses_the_sequence_level():
    with pytest.raises(ValueError, match="cispo"):
        LossOptions(loss_type="cispo", importance_sampling_level="sequence")
