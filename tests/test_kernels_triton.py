"""The Triton kernels on CPU, under the interpreter, at small awkward shapes, against the
references (float64 for the log-probs, the torch path for the loss). Each program instance
runs in numpy, so shapes stay small; the torch-path tests cover every option combination.

TRITON_INTERPRET=1 must be set before triton is imported at all (triton.language's own
helpers are decorated at import), and conftest.py imports transformers, which imports triton.
So without it this module re-runs itself in a fresh pytest process with it set.
"""
import os
import subprocess
import sys

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
triton = pytest.importorskip("triton")


@pytest.mark.skipif(INTERPRET, reason="already under the interpreter")
def test_triton_kernels_under_interpreter():
    """Re-run this module in a fresh process with TRITON_INTERPRET=1 (about a minute on 2 cores)."""
    out = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
    print(out.stdout[-2000:])
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]


# the kernel tests below run only in that process (the test tensors live on the CPU)
interpreted = pytest.mark.skipif(not INTERPRET, reason="run by test_triton_kernels_under_interpreter")

from grpo.kernels.advantages import group_advantages  # noqa: E402
from grpo.kernels.grpo_loss import grpo_token_loss  # noqa: E402
from grpo.kernels.logprobs import linear_logprobs  # noqa: E402
from grpo.kernels.reference import entropy_ref, linear_logprobs_ref  # noqa: E402
from grpo.loss import policy_loss  # noqa: E402


# (leading shape, H, V, backward chunk, temperature, dtype): V not a multiple of BLOCK_V=32 nor
# of the chunk, N not a multiple of BLOCK_N=16, H not a multiple of BLOCK_H=16
CASES = [((37,), 40, 301, 128, 0.7, torch.float32), ((3, 13), 33, 515, 256, 1.0, torch.bfloat16),
         ((2, 67), 72, 1237, 1000, 1.3, torch.float32)]


@interpreted
@pytest.mark.parametrize("lead,H,V,chunk,temperature,dtype", CASES)
def test_linear_logprobs_triton(lead, H, V, chunk, temperature, dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(*lead, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 2 / H**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, lead, generator=g)
    labels.view(-1)[::4] = -100
    labels.view(-1, lead[-1])[0] = -100                                  # a fully masked row
    grad_out = torch.randn(lead, generator=g)
    lp, ent = linear_logprobs(hidden, weight, labels, temperature, backend="triton", return_entropy=True,
                              chunk_size=chunk)
    gh, gw = torch.autograd.grad((lp * grad_out).sum(), (hidden, weight))
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    lp64 = linear_logprobs_ref(h64, w64, labels, temperature)
    gh64, gw64 = torch.autograd.grad((lp64 * grad_out.double()).sum(), (h64, w64))
    # fp32 accumulation in the kernel against float64 on the same input values
    torch.testing.assert_close(lp.double(), lp64, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), entropy_ref(h64.detach(), w64.detach(), temperature), atol=5e-5, rtol=1e-5)
    # gradients are rounded to the input dtype (bf16: 8 bits of mantissa)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-3, rtol=1.6e-2)
    torch.testing.assert_close(gh.double(), gh64, **tol)
    torch.testing.assert_close(gw.double(), gw64, **tol)
    assert (lp[labels < 0] == 0).all() and (gh[labels < 0] == 0).all()
    # and the torch backend gives the same numbers
    torch.testing.assert_close(lp, linear_logprobs(hidden, weight, labels, temperature, backend="torch"), atol=1e-5, rtol=1e-5)


# each option at least once, and in pairs: (delta, dual_clip, kl, tis, eps_high)
OPTIONS = [(None, None, False, False, 0.2), (1.5, None, True, False, 0.28), (None, 3.0, False, True, 0.2),
           (1.5, 3.0, False, True, 0.28), (None, 3.0, True, False, 0.28), (1.5, 3.0, True, True, 0.2)]


@interpreted
@pytest.mark.parametrize("delta,dual,kl,tis,eps_high", OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grpo_token_loss_triton(delta, dual, kl, tis, eps_high, dtype):
    g = torch.Generator().manual_seed(1)
    B, T = 5, 301                                                       # 1505 tokens: 2 blocks, the last partial
    old = -torch.rand(B, T, generator=g) * 3
    lp = (old + torch.randn(B, T, generator=g) * 0.4).to(dtype)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[2] = False                                                     # a fully masked row
    A = torch.randn(B, 1, generator=g)
    kw = dict(eps_low=0.2, eps_high=eps_high, delta=delta, dual_clip=dual,
              ref_logprobs=old + torch.randn(B, T, generator=g) * 0.3 if kl else None, beta=0.04 if kl else 0.0,
              sampler_logprobs=old + torch.randn(B, T, generator=g) * 0.3 if tis else None,
              tis_cap=2.0 if tis else None)
    grad_out = torch.randn(B, T, generator=g)
    out = {}
    for backend in ("triton", "torch"):
        x = lp.detach().clone().requires_grad_()
        loss = grpo_token_loss(x, old, A, mask, backend=backend, **kw)
        (loss * grad_out).sum().backward()
        out[backend] = loss, x.grad
    # same fp32 formulas in both: agreement to a few fp32 ulps
    torch.testing.assert_close(out["triton"][0], out["torch"][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out["triton"][1], out["torch"][1], atol=1e-6, rtol=1e-5)
    assert out["triton"][1].dtype == dtype and (out["triton"][1][2] == 0).all()


@interpreted
@pytest.mark.parametrize("aggregation", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_policy_loss_triton_backend(aggregation):
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(4, 9, generator=g) * 3
    lp = old + torch.randn(4, 9, generator=g) * 0.4
    mask, A = (torch.rand(4, 9, generator=g) > 0.2).float(), torch.randn(4, generator=g)
    res = {}
    for backend in ("triton", "torch"):
        x = lp.clone().requires_grad_()
        loss, metrics = policy_loss(x, old, A, mask, aggregation=aggregation, num_sequences=8, num_tokens=50,
                                    max_completion_len=12, dual_clip=3.0, backend=backend)
        loss.backward()
        res[backend] = loss, x.grad, metrics
    torch.testing.assert_close(res["triton"][0], res["torch"][0])
    torch.testing.assert_close(res["triton"][1], res["torch"][1])
    assert res["triton"][2].keys() == res["torch"][2].keys()


@interpreted
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_triton(scale):
    rewards = torch.randn(30, generator=torch.Generator().manual_seed(3))   # G=6: not a power of 2
    torch.testing.assert_close(group_advantages(rewards, 6, scale, backend="triton"),
                               group_advantages(rewards, 6, scale, backend="torch"))
