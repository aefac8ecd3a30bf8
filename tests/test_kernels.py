"""grpo.kernels on the torch path (the CPU training path) against the naive references and
float64; the Triton kernels are in test_kernels_triton.py (under TRITON_INTERPRET=1)."""
import subprocess
import sys
import textwrap

import pytest
import torch

from grpo.kernels import linear_logprobs
from grpo.kernels import logprobs as logprobs_module
from grpo.kernels.reference import entropy_ref, linear_logprobs_ref


def make_inputs(lead, H, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 2 / H**0.5).to(dtype)   # logits of std ~2, as an LM head
    labels = torch.randint(0, V, lead, generator=g)
    labels.view(-1)[::5] = -100                                         # ignored tokens
    labels.view(-1, lead[-1])[0] = -100                                 # a fully masked row
    return hidden, weight, labels


def grads(fn, hidden, weight, labels, temperature, g):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fn(h, w, labels, temperature)
    return (out.detach(), *torch.autograd.grad((out * g).sum(), (h, w)))


# (leading shape, H, V, chunk): vocab not a multiple of the chunk, token count odd, (B, T) leading
SHAPES = [((37,), 40, 301, 64), ((3, 13), 64, 1000, None), ((9, 41), 33, 4231, 1024)]


@pytest.mark.parametrize("lead,H,V,chunk", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_logprobs_torch(lead, H, V, chunk, temperature, dtype):
    hidden, weight, labels = make_inputs(lead, H, V, dtype)
    g = torch.randn(lead)                                              # upstream gradient of the log-probs
    ours = lambda h, w, y, T: linear_logprobs(h, w, y, T, backend="torch", chunk_size=chunk)  # noqa: E731
    lp, gh, gw = grads(ours, hidden, weight, labels, temperature, g)
    # float64 from the same (possibly bf16) input values: what fp32 accumulation should reach
    lp64, gh64, gw64 = grads(linear_logprobs_ref, hidden.double(), weight.double(), labels, temperature, g.double())
    assert lp.dtype == torch.float32 and gh.dtype == dtype and gw.dtype == dtype
    # fp32 statistics over V <= 4231 terms: errors of a few 1e-6 on log-probs of size ~10
    torch.testing.assert_close(lp.double(), lp64, atol=5e-5, rtol=1e-5)
    # gradients: fp32 accumulation, then rounded to the input dtype (bf16: 8 bits of mantissa)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-3, rtol=1.6e-2)
    torch.testing.assert_close(gh.double(), gh64, **tol)
    torch.testing.assert_close(gw.double(), gw64, **tol)
    # and the fp32 naive path within fp32 tolerance
    lp_ref = linear_logprobs_ref(hidden, weight, labels, temperature)
    torch.testing.assert_close(lp, lp_ref, atol=5e-5, rtol=1e-5)
    ignored = labels < 0
    assert (lp[ignored] == 0).all() and (gh[ignored] == 0).all(), "ignored labels: log-prob 0, no gradient"


@pytest.mark.parametrize("lead,H,V,chunk", SHAPES[1:])  # SHAPES[0] masks its only row: no gradient
def test_bf16_gradient_matmuls_keep_the_forward(lead, H, V, chunk):
    # fp32 inputs, grad_dtype bf16 (the CPU trainer under autocast_bf16): the log-probs are the fp32
    # path's bit for bit; the gradients are bf16 matmuls', within bf16's rounding of float64's
    hidden, weight, labels = make_inputs(lead, H, V, torch.float32)
    g = torch.randn(lead, generator=torch.Generator().manual_seed(1))
    run = lambda dt: grads(lambda h, w, y, T: linear_logprobs(h, w, y, T, backend="torch", chunk_size=chunk,  # noqa: E731
                                                              grad_dtype=dt), hidden, weight, labels, 0.7, g)
    lp32, gh32, gw32 = run(None)
    lp, gh, gw = run(torch.bfloat16)
    _, gh64, gw64 = grads(linear_logprobs_ref, hidden.double(), weight.double(), labels, 0.7, g.double())
    assert torch.equal(lp, lp32) and gh.dtype == gw.dtype == torch.float32
    rel = lambda x, exact: ((x.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    for ours, fp32, exact in ((gh, gh32, gh64), (gw, gw32, gw64)):
        # normwise: ~3e-3 measured, bf16's rounding (2^-8); fp32's matmuls ~3e-7
        assert 1e-4 < rel(ours, exact) < 1e-2 and rel(fp32, exact) < 1e-5, (rel(ours, exact), rel(fp32, exact))
    assert (gh[labels < 0] == 0).all()


def test_the_model_takes_bf16_gradient_matmuls_under_autocast(monkeypatch, tiny_dir):
    import grpo.kernels
    from grpo.models.model import Transformer
    seen, real = [], grpo.kernels.linear_logprobs
    monkeypatch.setattr(grpo.kernels, "linear_logprobs",
                        lambda *a, **kw: seen.append(kw["grad_dtype"]) or real(*a, **kw))
    model = Transformer.from_pretrained(tiny_dir("qwen2")[0])
    ids = torch.randint(0, model.args.vocab_size, (2, 6))
    for on in (False, True):
        model.autocast_bf16 = on
        model(ids, labels=ids).sum().backward()
    assert seen == [None, torch.bfloat16]


def test_entropy_torch():
    hidden, weight, labels = make_inputs((2, 19), 48, 777, torch.float32)
    lp, ent = linear_logprobs(hidden, weight, labels, 0.8, backend="torch", return_entropy=True, chunk_size=256)
    ref = torch.where(labels >= 0, entropy_ref(hidden.double(), weight.double(), 0.8), 0.0)  # ignored: 0
    torch.testing.assert_close(ent.double(), ref, atol=5e-5, rtol=1e-5)
    assert ent.shape == labels.shape and not ent.requires_grad


def test_tied_embedding_gradient():
    """The LM head weight is often the input embedding: both gradients must add up."""
    g = torch.Generator().manual_seed(3)
    emb = torch.randn(500, 32, generator=g, requires_grad=True)
    ids = torch.randint(0, 500, (4, 10), generator=g)
    grad = {}
    for name, fn in [("ours", lambda h, y: linear_logprobs(h, emb, y, backend="torch", chunk_size=128)),
                     ("ref", lambda h, y: linear_logprobs_ref(h, emb, y))]:
        hidden = torch.tanh(emb[ids])                                 # (4, 10, 32) from the same weight
        fn(hidden[:, :-1], ids[:, 1:]).sum().backward()
        grad[name], emb.grad = emb.grad, None
    torch.testing.assert_close(grad["ours"], grad["ref"], atol=1e-5, rtol=1e-4)


def test_no_grad_forward_and_weight_only_grad():
    hidden, weight, labels = make_inputs((50,), 16, 300, torch.float32)
    with torch.no_grad():                                              # old / ref log-probs
        torch.testing.assert_close(linear_logprobs(hidden, weight, labels), linear_logprobs_ref(hidden, weight, labels))
    w = weight.clone().requires_grad_()
    linear_logprobs(hidden, w, labels, chunk_size=128).sum().backward()
    w_ref = weight.clone().requires_grad_()
    linear_logprobs_ref(hidden, w_ref, labels).sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad, atol=1e-5, rtol=1e-4)


def softmax_row_sums(monkeypatch) -> list:
    """Spy on the backward's dz: the sum over the vocabulary of its softmax exp(z - lse) per
    token, where z is the backward's recomputed logits and lse the forward's. Consistent
    numerics give 1: the backward then differentiates the function the forward computed."""
    sums = []
    real = logprobs_module._dlogits_torch

    def spy(z, lse, labels, g, v0, threshold=None):
        sums.append(torch.exp(z.double() - lse.double()[:, None]).sum(1))
        return real(z, lse, labels, g, v0, threshold)
    monkeypatch.setattr(logprobs_module, "_dlogits_torch", spy)
    return sums


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_bf16_matmuls_scale_the_fp32_logits(monkeypatch, temperature):
    """The CUDA path runs the matmuls in bf16 (fp32 accumulation); emulated here by keeping the
    compute dtype. Scaling a bf16 hidden by 1/T would round z/T by up to |z| 2^-9 (log-probs off
    by ~1e-2 at T 0.7); the logits must be scaled in fp32, in the forward and in the backward's
    recompute alike."""
    monkeypatch.setattr(logprobs_module, "_compute_dtype", lambda x: x.dtype)
    sums = softmax_row_sums(monkeypatch)
    hidden, weight, labels = make_inputs((4, 50), 64, 3000, torch.bfloat16, seed=5)
    weight = weight * 3                                                 # logits of std ~6: rounding shows
    g = torch.randn(4, 50, generator=torch.Generator().manual_seed(6))
    lp, gh, gw = grads(lambda h, w, y, T: linear_logprobs(h, w, y, T, backend="torch", chunk_size=1024),
                       hidden, weight, labels, temperature, g)
    lp64, gh64, gw64 = grads(linear_logprobs_ref, hidden.double(), weight.double(), labels, temperature, g.double())
    # products of bf16 values are exact in fp32: only fp32 accumulation error remains
    torch.testing.assert_close(lp.double(), lp64, atol=1e-4, rtol=1e-5)
    row_sums = sum(sums)                                                # over the 3 vocab chunks
    assert len(row_sums) == (labels >= 0).sum()                         # ignored rows: no LM-head work
    torch.testing.assert_close(row_sums, torch.ones_like(row_sums), atol=1e-5, rtol=0)
    # gradients pass through a bf16 dz and come back in bf16 (8-bit mantissa, relative rounding
    # 2^-9 = 2e-3 per element, twice): compare in norm, within the two roundings' 2^-8
    for ours, exact in ((gh, gh64), (gw, gw64)):
        assert (ours.double() - exact).norm() / exact.norm() < 2**-8


MEMORY_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from grpo.kernels import linear_logprobs
    from grpo.kernels.reference import linear_logprobs_ref
    N, V, H = map(int, sys.argv[3:])
    hidden = torch.randn(N, H).requires_grad_()
    weight = torch.randn(V, H).mul_(0.03).requires_grad_()
    labels = torch.randint(0, V, (N,))
    fn = linear_logprobs if sys.argv[1] == "ours" else linear_logprobs_ref
    def rss(key):  # bytes, from /proc: VmRSS now, VmHWM the peak since the reset below
        line = next(l for l in open("/proc/self/status") if l.startswith(key))
        return int(line.split()[1]) * 1024
    open("/proc/self/clear_refs", "w").write("5")                        # reset the peak to now
    base, t = rss("VmRSS"), time.time()
    logprobs = fn(hidden, weight, labels)
    if sys.argv[2] == "backward":
        logprobs.sum().backward()
    print(rss("VmHWM") - base, time.time() - t)
""")


# Qwen2.5-0.5B's tokens and vocabulary at a quarter of its hidden size (896): the peaks measured are
# the (N, V) tensors and ours' (N, chunk) blocks, which H does not size, at a quarter of the matmuls
PEAK_NVH = (2048, 151936, 224)


def peak_extra(which, mode):
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, which, mode, *map(str, PEAK_NVH)],
                         capture_output=True, text=True, check=True)
    peak, seconds = out.stdout.split()
    return int(peak) / 2**20, float(seconds)


@pytest.mark.slow  # a process of its own
def test_peak_memory_far_below_naive():
    """N=2048, V=151936, H=224, fp32 on CPU, each in a fresh process (peak RSS is per process).

    The naive forward alone (logits and log-softmax, 2 x 1.2 GB) is a lower bound on its peak
    (forward+backward adds the logits' gradient: about 3.5 GB); ours runs forward and backward,
    so its peak includes the 0.14 GB grad_weight that both must produce.
    """
    naive, t_naive = peak_extra("naive", "forward")
    ours, t_ours = peak_extra("ours", "backward")
    print(f"peak extra memory: naive forward {naive:.0f} MiB ({t_naive:.1f} s), "
          f"ours forward+backward {ours:.0f} MiB ({t_ours:.1f} s)")
    assert naive > 2000, f"{naive=:.0f} MiB: the naive path should hold two (N, V) fp32 tensors"
    grad_weight = PEAK_NVH[1] * PEAK_NVH[2] * 4 / 2**20
    assert ours < 0.3 * naive, f"{ours=:.0f} MiB vs {naive=:.0f} MiB"
    assert ours - grad_weight < 0.1 * naive, f"workspace {ours - grad_weight:.0f} MiB vs {naive=:.0f} MiB"


def test_sampling_without_libdevice_takes_the_reference_and_says_so(monkeypatch, capsys):
    """A Triton that imports without triton.language.extra.libdevice: the fused sampler cannot
    build, so a GPU's sampling takes the PyTorch reference (the same tokens) with one warning,
    instead of launching a kernel that was never defined (HAS_TRITON alone said yes)."""
    import grpo.engine.sampling
    from grpo.kernels import sampling as ks
    from grpo.kernels import target
    from grpo.kernels.reference import sample_ref
    monkeypatch.setattr(ks, "HAS_KERNEL", False)
    monkeypatch.setattr(ks, "_said", False)
    monkeypatch.setattr(target, "HAS_TRITON", True)
    monkeypatch.setattr(target, "gpu", lambda t: True)  # as if the logits were on a GPU
    g = torch.Generator().manual_seed(0)
    logits, key, step = torch.randn(5, 300, generator=g), torch.arange(5), torch.zeros(5, dtype=torch.int64)
    tokens, lp = grpo.engine.sampling.sample(logits, key, step, 1.0)
    grpo.engine.sampling.sample(logits, key, step, 1.0)
    assert torch.equal(tokens, sample_ref(logits, key, step, 1.0)[0])
    assert capsys.readouterr().out.count("libdevice is not importable") == 1
    with pytest.raises(AssertionError, match="libdevice"):
        ks.fused_sample(logits, key, step, 1.0, backend="triton")
