"""The decode kernels (grpo.kernels.sampling, grpo.kernels.layers) against their references,
and the references against the code they stand in for (grpo.sampling, grpo.model, KVCache).

The Triton kernels run on CPU under the interpreter, at small awkward shapes: as in
test_kernels_triton.py, TRITON_INTERPRET=1 must be set before triton is imported, so
test_decode_kernels_under_interpreter re-runs this module in a fresh pytest process with it
set (slow). The reference tests are plain CPU tests and run in the parent process only.
"""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import grpo.sampling as sampling
from grpo import kernels
from grpo.kernels.reference import sample_ref
from grpo.kernels.sampling import fused_sample
from grpo.sampling import request_key, sample

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.slow  # starts a process (tests/conftest.py: the fast subset leaves it out)
@pytest.mark.skipif(INTERPRET, reason="already under the interpreter")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_decode_kernels_under_interpreter():
    """Re-run this module in a fresh process with TRITON_INTERPRET=1."""
    out = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
                         env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
    print(out.stdout[-2000:])
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]


# kernel tests run only in that process (the test tensors live on the CPU); reference tests only outside it
interpreted = pytest.mark.skipif(not INTERPRET, reason="run by test_decode_kernels_under_interpreter")
reference = pytest.mark.skipif(INTERPRET, reason="a reference test: runs in the parent process")

# -----------------------------------------------------------------------------
# sampling


def sampling_inputs(B: int, V: int, dtype: torch.dtype, seed: int = 0):
    """Logits with the rows that break a careless kernel, request keys as the sampler makes them
    (refill prompts 1 << 40 | i set high bits), and steps from 0 to 2^40."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 4
    logits[0] = 1.5                                   # every token tied
    logits[1, [3, V // 2 + 1, V - 2]] = 30.0          # greedy: three tied maxima in different blocks and splits
    logits[2, 100:V // 2] = float("-inf")             # whole masked blocks (a banned range)
    logits[3] *= 3                                     # a peaked row, |z| up to ~60: fp32 ulp 4e-6
    logits = logits.to(dtype)                          # bf16: many tied values in every row
    key = torch.tensor([request_key(seed + i % 3, (1 << 40 | i) if i % 2 else i, i % 5) for i in range(B)])
    step = torch.randint(0, 1 << 40, (B,), generator=g)
    step[:B // 2] = torch.arange(B // 2)              # and the small steps of a real completion
    return logits, key, step


@reference
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.3])
def test_sample_ref_equals_grpo_sampling(temperature):
    """kernels/ cannot import grpo.sampling, so sample_ref is a copy of its unfiltered rule: the
    same bits, tokens and log-probs, so the kernel's reference is the sampler's own rule."""
    for dtype in (torch.float32, torch.bfloat16):
        logits, key, step = sampling_inputs(37, 1237, dtype)
        tokens, logprobs = sample_ref(logits, key, step, temperature)
        expected = sample(logits, key, step, temperature)
        assert torch.equal(tokens, expected[0]) and torch.equal(logprobs, expected[1])
        torch.testing.assert_close(fused_sample(logits, key, step, temperature), expected, atol=0, rtol=0)  # torch backend


@interpreted
@pytest.mark.parametrize("V", [1237, 4099])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_sample_triton(V, temperature, dtype):
    logits, key, step = sampling_inputs(37, V, dtype, seed=V)
    tokens, logprobs = fused_sample(logits, key, step, temperature, backend="triton")
    expected_tokens, expected_logprobs = sample(logits, key, step, temperature)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(tokens, expected_tokens), (tokens != expected_tokens).nonzero()
    if temperature == 0.0:
        assert tokens[0] == 0 and tokens[1] == 3      # first index on ties, as torch.argmax
    # an online logsumexp against torch's two-pass one, both in fp32: a few ulps of the largest |z|
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=0)


@interpreted
def test_sample_calls_the_kernel_where_fused(monkeypatch):
    """grpo.sampling.sample takes the kernel when _fused says so (CUDA with triton) and no filter
    is set; forced here on CPU, it draws what the eager path draws."""
    calls = []
    real = kernels.fused_sample
    monkeypatch.setattr(kernels, "fused_sample", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    logits, key, step = sampling_inputs(9, 515, torch.float32)
    eager = sample(logits, key, step, 0.7)
    monkeypatch.setattr(sampling, "_fused", lambda logits: True)
    torch.testing.assert_close(sample(logits, key, step, 0.7), eager, atol=1e-5, rtol=0)
    assert calls == [dict(backend="triton")]
    sample(logits, key, step, 0.7, top_k=5)            # a filter: the eager path
    sample(logits, key, step, 0.7, top_p=0.9)
    sample(logits, key, step, 0.7, min_p=0.1)
    assert len(calls) == 1
