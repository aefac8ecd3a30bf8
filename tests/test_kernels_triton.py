"""The Triton kernels on CPU, under the interpreter, at small awkward shapes, against the
references (float64 for the log-probs, the torch path for the loss). Each program instance
runs in numpy, so shapes stay small; the torch-path tests cover every option combination.

TRITON_INTERPRET=1 must be set before triton is imported at all (triton.language's own
helpers are decorated at import), and conftest.py imports transformers, which imports triton.
So without it this module re-runs itself in a fresh pytest process with it set.
"""
import pytest
import torch
from interpret import interpreted, rerun_under_interpreter

triton = pytest.importorskip("triton")

# about a minute on 2 cores; the kernel tests below run only in that process (the tensors live on the CPU)
test_triton_kernels_under_interpreter = rerun_under_interpreter(__file__)

from test_loss import active_batch  # noqa: E402

from grpo.kernels import logprobs as logprobs_module  # noqa: E402
from grpo.kernels.grpo_loss import grpo_token_loss  # noqa: E402
from grpo.kernels.logprobs import linear_logprobs  # noqa: E402
from grpo.kernels.reference import entropy_ref, linear_logprobs_ref  # noqa: E402
from grpo.loss import LossOptions, group_advantages, policy_loss, token_loss  # noqa: E402

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py: the fast subset leaves it out)


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
    ent64 = torch.where(labels >= 0, entropy_ref(h64.detach(), w64.detach(), temperature), 0.0)  # ignored: 0
    torch.testing.assert_close(ent.double(), ent64, atol=5e-5, rtol=1e-5)
    # gradients are rounded to the input dtype (bf16: 8 bits of mantissa)
    for ours, exact in ((gh, gh64), (gw, gw64)):
        # fp32: an element sums N tokens' terms as large as the largest gradient, so its rounding is a few
        # ulps of that scale, not of its own value (AVX2 and AVX512 round the sums differently: 1.4e-5 of
        # gw's 5.2 on one, under 1e-5 on the other; the chunked torch path 3.5e-6)
        scale = max(1.0, exact.abs().max().item())
        tol = dict(atol=1e-5 * scale, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-3, rtol=1.6e-2)
        torch.testing.assert_close(ours.double(), exact, **tol)
    assert (lp[labels < 0] == 0).all() and (gh[labels < 0] == 0).all()
    # and the torch backend gives the same numbers
    torch.testing.assert_close(lp, linear_logprobs(hidden, weight, labels, temperature, backend="torch"), atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_triton_forward_and_bf16_backward_agree(monkeypatch, temperature):
    """The Triton forward scales fp32 logits by 1/T; the backward recomputes them with bf16
    matmuls on CUDA (emulated: the compute dtype kept). Its softmax must sum to 1 against the
    forward's logsumexp, or the gradient is of another function (rows were off by up to 9e-3
    when the backward scaled a bf16 hidden instead)."""
    monkeypatch.setattr(logprobs_module, "_compute_dtype", lambda x: x.dtype)
    sums, real = [], logprobs_module._dlogits_triton

    def spy(z, lse, labels, g, v0, threshold=None):
        sums.append(torch.exp(z.double() - lse.double()[:, None]).sum(1))
        return real(z, lse, labels, g, v0, threshold)
    monkeypatch.setattr(logprobs_module, "_dlogits_triton", spy)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 21, 48, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(700, 48, generator=g) * 6 / 48**0.5).bfloat16().requires_grad_()  # logits std ~6
    labels = torch.randint(0, 700, (3, 21), generator=g)
    lp = linear_logprobs(hidden, weight, labels, temperature, backend="triton", chunk_size=256)
    gh, gw = torch.autograd.grad(lp.sum(), (hidden, weight))
    row_sums = sum(sums)
    torch.testing.assert_close(row_sums, torch.ones_like(row_sums), atol=1e-5, rtol=0)
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    gh64, gw64 = torch.autograd.grad(linear_logprobs_ref(h64, w64, labels, temperature).sum(), (h64, w64))
    for ours, exact in ((gh, gh64), (gw, gw64)):  # bf16 dz and bf16 output: compare in norm
        assert (ours.double() - exact).norm() / exact.norm() < 3e-3


@interpreted
@pytest.mark.parametrize("lead,H,V,chunk,temperature,dtype", CASES[:2])
def test_linear_logprobs_triton_kept_set(lead, H, V, chunk, temperature, dtype):
    """The sampler's kept sets (top_p 0.8 and top_k 20 thresholds; -inf rows beside them): the Triton
    forward's log-probs and entropies, and its backward's gradients, against float64 over the same sets."""
    from grpo.engine.sampling import sample
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(*lead, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 3 / H**0.5).to(dtype)
    flat = hidden.reshape(-1, H).float() @ weight.float().T
    N = flat.shape[0]
    labels, _, threshold = sample(flat, torch.arange(N), torch.zeros(N, dtype=torch.long), temperature, top_k=20,
                                  top_p=0.8, return_threshold=True)
    threshold[::5] = float("-inf")
    labels, threshold = labels.reshape(lead), threshold.reshape(lead)
    labels.view(-1)[3] = -100
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = linear_logprobs(h, w, labels, temperature, backend="triton", return_entropy=True, chunk_size=chunk,
                              threshold=threshold)
    up = torch.randn(lead, generator=g)
    gh, gw = torch.autograd.grad((lp * up).sum(), (h, w))
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp64 = linear_logprobs_ref(h64, w64, labels, temperature, threshold=threshold)
    gh64, gw64 = torch.autograd.grad((lp64 * up.double()).sum(), (h64, w64))
    torch.testing.assert_close(lp.double(), lp64.detach(), atol=5e-5, rtol=1e-5)
    _, ent_torch = linear_logprobs(hidden, weight, labels, temperature, backend="torch", return_entropy=True,
                                   threshold=threshold)
    torch.testing.assert_close(ent, ent_torch, atol=1e-4, rtol=1e-4)
    for ours, exact in ((gh, gh64), (gw, gw64)):
        # fp32: an element sums N tokens' terms as large as the largest gradient, so its rounding is a few
        # ulps of that scale, not of its own value (AVX2 and AVX512 round the sums differently: 1.4e-5 of
        # gw's 5.2 on one, under 1e-5 on the other; the chunked torch path 3.5e-6)
        scale = max(1.0, exact.abs().max().item())
        tol = dict(atol=1e-5 * scale, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-3, rtol=1.6e-2)
        torch.testing.assert_close(ours.double(), exact, **tol)


@interpreted
def test_kept_set_far_below_zero_keeps_its_running_max():
    """Every kept logit / T near -150 and the set's columns past the first blocks of each split: the forward's
    running max must come from the kept columns, not stay at 0 (exp(-150) underflows fp32)."""
    g = torch.Generator().manual_seed(9)
    N, H, V = 19, 16, 301
    hidden = 1 + 0.1 * torch.randn(N, H, generator=g)  # h . 1 / sqrt(H) ~ 4 on every row
    direction = torch.ones(H) / H**0.5
    weight = 0.05 * torch.randn(V, H, generator=g) - 10.0 * direction  # logits ~ -40: z = logits / 0.3 ~ -133
    weight[250:] += 0.5 * direction  # the largest logits (the kept set) sit in the last columns
    z = (hidden @ weight.T) / 0.3
    labels = z.argmax(-1)
    threshold = z.topk(20, -1).values[:, -1] - 1e-3
    assert z.max() < -80
    lp = linear_logprobs(hidden, weight, labels, 0.3, backend="triton", threshold=threshold)
    ref = linear_logprobs_ref(hidden.double(), weight.double(), labels, 0.3, threshold=threshold)
    torch.testing.assert_close(lp.double(), ref, atol=1e-4, rtol=1e-5)


@interpreted
def test_fused_kept_set_logprobs_equal_the_samplers(tiny_dir, monkeypatch):
    """The trainer's fused path (the Triton LM-head kernel inside the model's forward) over a rollout
    drawn with top_p 0.8, top_k 20 and min_p 0.1, no update between: old = sampler within 1e-5 a token
    and the mean importance ratio 1 within 1e-4 (fp32)."""
    import functools

    import grpo.kernels
    from grpo.config import Config
    from grpo.engine.sampler import Sampler, SamplingParams
    from grpo.models.model import Transformer
    from grpo.rollout import Trajectory
    from grpo.update import batch_logprobs, update_batches
    path, _ = tiny_dir("qwen2")
    model = Transformer.from_pretrained(path).eval()
    prompts = [[5, 17, 99, 3], [11, 12]]
    out = Sampler(model).generate(prompts, SamplingParams(n=3, temperature=0.8, top_p=0.8, top_k=20, min_p=0.1,
                                                          max_tokens=10, stop_token_ids=[], seed=2))
    trajs = [Trajectory({}, c.prompt_index, prompts[c.prompt_index], c.token_ids, c.loss_mask, c.logprobs,
                        c.finish_reason, c.num_turns, kept_thresholds=c.thresholds) for c in out]
    monkeypatch.setattr(grpo.kernels, "linear_logprobs", functools.partial(linear_logprobs, backend="triton"))
    batches = update_batches(trajs, torch.ones(len(trajs)), Config(num_generations=3, micro_batch_tokens=256), "cpu")
    old = batch_logprobs(model, batches, 0.8)
    m = [b["loss_mask"].bool() for b in batches]
    diff = torch.cat([o[k] - b["sampler_logprobs"][k] for o, b, k in zip(old, batches, m)])
    assert diff.abs().max() < 1e-5 and abs(diff.exp().mean().item() - 1) < 1e-4


OPTIONS = [dict(), dict(delta=4.0), dict(dual_clip=3.0), dict(kl=True), dict(tis=True), dict(eps_high=0.28),
           dict(delta=4.0, dual_clip=3.0, kl=True, tis=True, eps_high=0.28), dict(kl=True, kl_ratio=True),
           dict(surrogate="cispo", eps_high=2.0), dict(surrogate="sapo"),
           dict(surrogate="cispo", eps_high=2.0, kl=True, kl_ratio=True, tis=True),
           dict(surrogate="sapo", kl=True, kl_ratio=True, tis=True, delta=4.0, dual_clip=3.0)]


def token_loss_inputs(delta=None, dual_clip=None, kl=False, tis=False, eps_high=0.2, surrogate="clip",
                      kl_ratio=False, dtype=torch.float32):
    """tests/test_loss.py's active batch (every option changes its loss), padding made garbage;
    sapo at temperatures 1 and 1.6 (its A < 0 rows differ from TRL's default 1.05 more visibly)."""
    lp, old, A, mask, ref, sampler = (x.float() for x in active_batch())
    garbage = lambda x: torch.where(mask.bool(), x, float("inf"))  # noqa: E731  padding may hold anything
    kw = dict(eps_low=0.2, eps_high=eps_high, delta=delta, dual_clip=dual_clip,
              ref_logprobs=garbage(ref) if kl else None, beta=0.05 if kl else 0.0,
              sampler_logprobs=garbage(sampler) if tis else None, tis_cap=2.0 if tis else None,
              surrogate=surrogate, tau_pos=1.0, tau_neg=1.6, kl_ratio=kl_ratio)
    return garbage(lp).to(dtype), garbage(old), A[:, None], mask, kw


@interpreted
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "+".join(str(v) if k == "surrogate" else k
                                                                for k, v in o.items()) or "plain")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grpo_token_loss_triton(options, dtype):
    lp, old, A, mask, kw = token_loss_inputs(**options, dtype=dtype)
    grad_out = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    out = {}
    for name, fn in (("triton", grpo_token_loss), ("reference", token_loss)):
        x = lp.detach().clone().requires_grad_()
        loss = fn(x, old, A, mask, **kw)
        (loss * grad_out).sum().backward()
        out[name] = loss, x.grad
    # the same fp32 formulas: agreement to a few fp32 ulps
    torch.testing.assert_close(out["triton"][0], out["reference"][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out["triton"][1].float(), out["reference"][1].float(), atol=1e-6, rtol=1e-5)
    assert out["triton"][1].dtype == dtype and (out["triton"][1][mask == 0] == 0).all()


@interpreted
@pytest.mark.parametrize("aggregation,corrected,level", [
    *((a, False, "token") for a in ("grpo", "bnpo", "dr_grpo", "dapo")), ("dapo", True, "token"),
    ("dapo", True, "sequence"), ("cispo", True, "token"), ("sapo", True, "token"), ("sapo", True, "sequence")])
def test_policy_loss_triton_backend(aggregation, corrected, level):
    lp, old, A, mask, kw = token_loss_inputs(delta=4.0, dual_clip=3.0, kl=True, tis=True, eps_high=0.28)
    res = {}
    for backend in ("triton", "torch"):
        opts = LossOptions(loss_type=aggregation, eps_high=0.28, delta=4.0, dual_clip=3.0, beta=0.05, tis_cap=2.0,
                           max_completion_length=12, backend=backend, use_bias_correction_kl=corrected,
                           importance_sampling_level=level)
        x = lp.clone().requires_grad_()
        loss, metrics = policy_loss(x, old, A, mask, opts, num_sequences=8, num_tokens=50,
                                    ref_logprobs=kw["ref_logprobs"], sampler_logprobs=kw["sampler_logprobs"])
        loss.backward()
        res[backend] = loss, x.grad, metrics
    torch.testing.assert_close(res["triton"][0], res["torch"][0])
    torch.testing.assert_close(res["triton"][1], res["torch"][1])
    assert res["triton"][2].keys() == res["torch"][2].keys()


@interpreted
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_triton(scale):
    rewards = torch.randn(30, generator=torch.Generator().manual_seed(3))   # G=6: not a power of 2
    rewards[6:12] = 0.1                                                     # a flat group, mean not exact
    rewards[[13, 16]] = float("nan")                                        # unscorable: left out, 0
    rewards[19] = float("inf")                                              # zeroes its group
    rewards[[24, 25, 27, 28, 29]] = float("nan")                            # one scorable reward: 0
    everyone = torch.cat([rewards, torch.arange(6.0)])                      # another rank's rewards too
    kw = dict(batch_rewards=everyone) if scale == "batch" else {}
    ours = group_advantages(rewards, 6, scale, backend="triton", **kw)
    torch.testing.assert_close(ours, group_advantages(rewards, 6, scale, backend="torch", **kw))
    assert (ours[6:12] == 0).all() and (ours[18:] == 0).all() and ours[[13, 16]].eq(0).all()
    assert ours[[12, 14, 15, 17]].ne(0).all()
