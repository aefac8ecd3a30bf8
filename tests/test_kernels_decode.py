"""The decode kernels (grpo.kernels.sampling, grpo.kernels.layers) against their references,
and the references against the code they stand in for (grpo.engine.sampling, grpo.models.model, KVCache).

The Triton kernels run on CPU under the interpreter, at small awkward shapes: as in
test_kernels_triton.py, TRITON_INTERPRET=1 must be set before triton is imported, so
test_decode_kernels_under_interpreter re-runs this module in a fresh pytest process with it
set (slow). The reference tests are plain CPU tests and run in the parent process only.
"""
import pytest
import torch
from interpret import INTERPRET, interpreted, rerun_under_interpreter

import grpo.engine.sampling as sampling
from grpo import kernels
from grpo.engine.kv_cache import KVCache
from grpo.engine.sampling import request_key, sample
from grpo.kernels.layers import add_rmsnorm, decode_attention, qkv_rope_write, silu_mul
from grpo.kernels.reference import (add_rmsnorm_ref, decode_attention_ref, qkv_rope_write_ref, sample_ref,
                                    silu_mul_ref)
from grpo.kernels.sampling import fused_sample
from grpo.models.layers import RMSNorm, apply_rope

test_decode_kernels_under_interpreter = rerun_under_interpreter(__file__)

# kernel tests run only in that process (the test tensors live on the CPU); reference tests only outside it
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
    """kernels/ cannot import grpo.engine.sampling, so sample_ref is a copy of its unfiltered rule: the
    same bits, tokens and log-probs, so the kernel's reference is the sampler's own rule."""
    for dtype in (torch.float32, torch.bfloat16):
        logits, key, step = sampling_inputs(37, 1237, dtype)
        tokens, logprobs = sample_ref(logits, key, step, temperature)
        expected = sample(logits, key, step, temperature)
        assert torch.equal(tokens, expected[0]) and torch.equal(logprobs, expected[1])
        # and fused_sample's torch backend is that reference
        torch.testing.assert_close(fused_sample(logits, key, step, temperature), expected, atol=0, rtol=0)


@interpreted
@pytest.mark.parametrize("V, temperature", [(1237, 0.0), (1237, 0.7), (1237, 1.0), (1237, 1.3),
                                            (4099, 0.0), (4099, 1.3)])  # the larger V (3x the interpreter's
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # time) at greedy and one temperature
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
    """grpo.engine.sampling.sample takes the kernel when _fused says so (CUDA with triton) and no filter
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

# -----------------------------------------------------------------------------
# decode layers

DTYPES = [torch.float32, torch.bfloat16]


def assert_close_rounded(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, steps: int, floor: float = 0.0):
    """Results computed in fp32 and rounded to `dtype` on the way (`steps` roundings).
    fp32: the same formulas, differing only in the order of sums and rsqrt's last bit.
    bf16: the interpreter has no bf16, and its fp32 -> bf16 casts truncate where the GPU (and
    torch) round to nearest even, so each rounding may move a result by one bf16 ulp: allow
    `steps` ulps of max(|ref|, floor) elementwise (floor: the inputs' size, where a difference
    like rotary's x1 cos - x2 sin cancels them)."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape, f"{ours.dtype=} {ref.dtype=} {ours.shape=}"
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
        return
    r = ref.float()
    ulp = torch.exp2(torch.floor(torch.log2(r.abs().clamp(min=max(floor, 2.0**-100)))) - 7)  # bf16: 8 bits
    err = (ours.float() - r).abs()
    assert (err <= steps * ulp).all(), f"{(err / ulp).max()=} ulps"


def rope_tables(pos: torch.Tensor, D: int, theta: float = 1e6):  # (B,) -> cos, sin (B, D/2) fp32, as the model
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    freqs = pos.float()[:, None] * inv_freq
    return freqs.cos(), freqs.sin()


def qkv_inputs(B, nh, nkv, D, dtype, cache_dtype, norm, slots=7, S=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(B, (nh + 2 * nkv) * D, generator=g) * 2).to(dtype)
    slot = torch.randperm(slots, generator=g)[:B]                      # distinct slots, any order
    pos = torch.randint(0, S, (B,), generator=g)
    cos, sin = rope_tables(pos * 997, D)                               # large angles
    k_cache = torch.randn(slots, S, nkv, D, generator=g).to(cache_dtype)  # old entries must survive
    v_cache = torch.randn(slots, S, nkv, D, generator=g).to(cache_dtype)
    qn = kn = None
    if norm:
        qn = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype)
        kn = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype)
    return qkv, cos, sin, k_cache, v_cache, slot, pos, qn, kn


@reference
@pytest.mark.parametrize("norm", [False, True], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2,
                                               (torch.bfloat16, torch.float32)])
def test_qkv_rope_write_ref_is_the_model(norm, dtype, cache_dtype):
    """The reference does what Attention.forward and KVCache.update do for one token, bit for bit."""
    B, nh, nkv, D = 5, 6, 2, 20
    qkv, cos, sin, k_cache, v_cache, slot, pos, qn, kn = qkv_inputs(B, nh, nkv, D, dtype, cache_dtype, norm)
    args = type("Args", (), dict(n_layers=2, n_kv_heads=nkv, head_dim=D))
    cache = KVCache(args, slots=7, max_seq_len=23, dtype=cache_dtype, device=torch.device("cpu"))
    cache.k[1], cache.v[1] = k_cache, v_cache
    q, k, v = qkv.split([nh * D, nkv * D, nkv * D], dim=-1)
    q, k, v = q.view(B, 1, nh, D), k.view(B, 1, nkv, D), v.view(B, 1, nkv, D)   # (B, T=1, heads, D)
    if norm:
        q_norm, k_norm = RMSNorm(D, 1e-6).to(dtype), RMSNorm(D, 1e-6).to(dtype)
        q_norm.weight.data, k_norm.weight.data = qn, kn
        with torch.no_grad():
            q, k = q_norm(q), k_norm(k)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                   # (B, heads, 1, D)
    c, s = cos[:, None, None], sin[:, None, None]                      # (B, 1, T=1, D/2)
    q, k = apply_rope(q, c, s), apply_rope(k, c, s)
    cache.rows(slot, pos, 1, 23)
    cache.update(1, k, v)
    ours = qkv_rope_write_ref(qkv, cos, sin, k_cache.clone(), v_cache.clone(), slot, pos, nh, nkv, D, qn, kn)
    assert torch.equal(ours, q[:, :, 0])
    kc, vc = k_cache.clone(), v_cache.clone()
    qkv_rope_write_ref(qkv, cos, sin, kc, vc, slot, pos, nh, nkv, D, qn, kn)
    assert torch.equal(kc, cache.k[1]) and torch.equal(vc, cache.v[1])


@interpreted
@pytest.mark.parametrize("norm", [False, True], ids=["qwen2", "qwen3"])
@pytest.mark.parametrize("B,nh,nkv,D", [(5, 6, 2, 20), (3, 14, 2, 64)])   # D/2 = 10: not a power of 2
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2,
                                               (torch.bfloat16, torch.float32)])
def test_qkv_rope_write_triton(norm, B, nh, nkv, D, dtype, cache_dtype):
    inputs = qkv_inputs(B, nh, nkv, D, dtype, cache_dtype, norm, seed=D)
    qkv, cos, sin, k_cache, v_cache, slot, pos, qn, kn = inputs
    kc, vc = k_cache.clone(), v_cache.clone()
    q = qkv_rope_write(qkv, cos, sin, kc, vc, slot, pos, nh, nkv, D, qn, kn, backend="triton")
    kr, vr = k_cache.clone(), v_cache.clone()
    q_ref = qkv_rope_write_ref(qkv, cos, sin, kr, vr, slot, pos, nh, nkv, D, qn, kn)
    assert q.shape == (B, nh, D) and q.dtype == dtype
    steps = 4 if norm else 1                            # norm: rounded, scaled and rounded, rotated and rounded
    assert_close_rounded(q, q_ref, dtype, steps, floor=1.0)           # heads of rms ~1 (normed) to 2
    assert_close_rounded(kc, kr, dtype, steps, floor=1.0)
    assert torch.equal(vc, vr)                          # v is copied: only the cast, exact
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    written[slot, pos] = True
    assert torch.equal(kc[~written], k_cache[~written])  # nothing else touched


@reference
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_ref_is_the_model(dtype):
    g = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(7, 901, generator=g) * 3).to(dtype), torch.randn(7, 901, generator=g).to(dtype)
    norm = RMSNorm(901, 1e-5).to(dtype)
    norm.weight.data = (1 + 0.3 * torch.randn(901, generator=g)).to(dtype)
    with torch.no_grad():
        y, h = add_rmsnorm_ref(x, residual, norm.weight, 1e-5)
        assert torch.equal(h, x + residual) and torch.equal(y, norm(x + residual))
        y, h = add_rmsnorm_ref(x, None, norm.weight, 1e-5)
        assert h is x and torch.equal(y, norm(x))


@interpreted
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_triton(with_residual, dtype):
    g = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(7, 901, generator=g) * 3).to(dtype), torch.randn(7, 901, generator=g).to(dtype)
    weight = (1 + 0.3 * torch.randn(901, generator=g)).to(dtype)
    residual = residual if with_residual else None
    y, h = add_rmsnorm(x, residual, weight, 1e-5, backend="triton")
    y_ref, h_ref = add_rmsnorm_ref(x, residual, weight, 1e-5)
    assert y.dtype == h.dtype == dtype
    assert_close_rounded(h, h_ref, dtype, 1)
    assert_close_rounded(y, y_ref, dtype, 4)                     # h, normalized, scaled: three roundings and rsqrt
    if not with_residual:
        assert h is x


@reference
def test_silu_mul_ref_against_float64():
    g = torch.Generator().manual_seed(3)
    gu = torch.randn(7, 2 * 333, generator=g) * 4
    gate, up = gu.double().chunk(2, dim=-1)
    exact = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(silu_mul_ref(gu).double(), exact, atol=1e-6, rtol=1e-6)   # fp32 roundings
    assert silu_mul_ref(gu.bfloat16()).dtype == torch.bfloat16


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_triton(dtype):
    g = torch.Generator().manual_seed(4)
    gu = (torch.randn(7, 2 * 333, generator=g) * 4).to(dtype)
    ours = silu_mul(gu, backend="triton")
    assert ours.shape == (7, 333) and ours.dtype == dtype
    assert_close_rounded(ours, silu_mul_ref(gu), dtype, 1)


def attention_inputs(B, nh, nkv, D, S, dtype, slots=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, nh, D, generator=g) * 2).to(dtype)            # scores of size ~2: a peaked softmax
    k_cache = torch.randn(slots, S, nkv, D, generator=g).to(dtype)
    v_cache = torch.randn(slots, S, nkv, D, generator=g).to(dtype)
    slot = torch.randperm(slots, generator=g)[:B]
    length = torch.randint(1, S + 1, (B,), generator=g)
    length[0], length[-1] = 1, S                                      # one key; the whole slot
    return q, k_cache, v_cache, slot, length


def attention_float64(q, k_cache, v_cache, slot, length, scale):  # row by row, GQA by repeat
    out = []
    for b in range(len(q)):
        k = k_cache[slot[b], :length[b]].double().transpose(0, 1)    # (nkv, L, D)
        v = v_cache[slot[b], :length[b]].double().transpose(0, 1)
        rep = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)  # (nh, L, D)
        p = (q[b].double()[:, None] @ k.transpose(1, 2))[:, 0] * scale   # (nh, L)
        out.append((p.softmax(-1)[:, None] @ v)[:, 0])
    return torch.stack(out)                                           # (B, nh, D)


@reference
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_ref_against_float64(dtype):
    q, k_cache, v_cache, slot, length = attention_inputs(5, 6, 2, 20, 37, dtype)
    exact = attention_float64(q, k_cache, v_cache, slot, length, 20 ** -0.5)
    ours = decode_attention_ref(q, k_cache, v_cache, slot, length)   # scale None: D^-0.5
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)  # bf16 SDPA rounds
    torch.testing.assert_close(ours.double(), exact, **tol)
    assert ours.dtype == dtype
    assert torch.equal(decode_attention(q, k_cache, v_cache, slot, length), ours)   # the torch backend


@interpreted
@pytest.mark.parametrize("B,nh,nkv,D,S", [(5, 6, 2, 20, 37), (3, 14, 2, 64, 50), (4, 4, 4, 24, 19)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_triton(B, nh, nkv, D, S, dtype):
    q, k_cache, v_cache, slot, length = attention_inputs(B, nh, nkv, D, S, dtype, seed=S)
    ours = decode_attention(q, k_cache, v_cache, slot, length, scale=0.3, backend="triton")
    exact = attention_float64(q, k_cache, v_cache, slot, length, 0.3)
    assert ours.shape == (B, nh, D) and ours.dtype == dtype
    if dtype == torch.float32:  # fp32 accumulation in another order than float64's
        torch.testing.assert_close(ours.double(), exact, atol=1e-5, rtol=1e-5)
    else:  # fp32 sums of p rounded to bf16 (as flash kernels round it), and the output's rounding: 2 ulps
        assert_close_rounded(ours, exact.to(dtype), dtype, 2, floor=0.25)  # (the interpreter truncates both)


@interpreted
def test_empty_batch():
    """A decode step with no live rows (the sampler may have none left) launches nothing."""
    tokens, logprobs = fused_sample(torch.zeros(0, 301), torch.zeros(0, dtype=torch.int64),
                                    torch.zeros(0, dtype=torch.int64), 0.7, backend="triton")
    assert tokens.shape == logprobs.shape == (0,) and tokens.dtype == torch.int64
    y, h = add_rmsnorm(torch.zeros(0, 40), None, torch.ones(40), 1e-6, backend="triton")
    assert y.shape == (0, 40) and silu_mul(torch.zeros(0, 48), backend="triton").shape == (0, 24)
    q, k_cache, v_cache, slot, length = attention_inputs(1, 4, 2, 8, 5, torch.float32)
    assert decode_attention(q[:0], k_cache, v_cache, slot[:0], length[:0], backend="triton").shape == (0, 4, 8)
