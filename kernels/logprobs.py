"""Fused LM head + log-softmax + gather: per-token log-probs without the (N, V) logits.

    logprobs[n] = z[n, labels[n]] - logsumexp(z[n]),   z = hidden @ weight.T / T

or, given a threshold per token (the sampler's kept set under top-k/top-p/min-p, grpo/engine/sampling.py),
the log-sum-exp over that set only, renormalised: K_n = {v : z[n, v] >= threshold[n]} plus the label,
    logprobs[n] = z[n, labels[n]] - logsumexp(z[n, K_n])
(a threshold of -inf keeps the whole vocabulary). The mask is applied chunk by chunk, in the forward
and in the backward's recompute alike, so the logits still never exist.

The naive path (kernels/reference.py) materializes z and its log-softmax, two (N, V) fp32
tensors: 2.5 GB at N=2048 tokens and Qwen's V=151936, and 40 GB at N=32k. Here the vocabulary
is walked in chunks with an online logsumexp (as in flash-attention), keeping only per-token
statistics: lse (N,), the target logit (N,), and E_p[z] (N,) for the entropy.

Backward recomputes the logits one vocab chunk at a time (N, C) instead of storing them:
    dz = (onehot(label) - softmax(z)) * g / T          (g = upstream gradient of logprobs)
    grad_hidden += dz @ weight[chunk]       grad_weight[chunk] = dz.T @ hidden
The logits are scaled by 1/T in fp32, in the forward and in the backward's recompute alike,
never by scaling a bf16 hidden: that would round z/T differently from the forward's fp32
scaling, and the backward's softmax would no longer match the forward's logsumexp.
Chunking over the vocab (not tokens) writes each grad_weight row exactly once, instead of
re-reading and re-adding the full (V, H) gradient once per token chunk.

Cost: 2NHV FLOPs forward, 6NHV backward (recompute + two matmuls), against the naive
2NHV + 4NHV: at most 8/6 of the naive matmul time, for a small fraction of its memory.

Backends:
- "triton": one kernel for the forward (the logits never exist outside registers); backward
  uses torch matmuls per vocab chunk (cuBLAS) and a Triton kernel for dz in place.
- "torch": the same algorithm in chunked PyTorch; the training path on CPU (under autocast_bf16
  its gradient matmuls take bf16: `grad_dtype`).
Labels < 0 (e.g. -100) are ignored: log-prob 0 and no gradient. Statistics are fp32 for any
input dtype. Entropy is returned for logging and token selection, not differentiated.
"""
import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch backend still works
    triton = None

from .target import gpu, sm_count, use_triton

# -----------------------------------------------------------------------------
# Triton kernels

if triton is not None:
    @triton.jit
    def _logprobs_fwd_kernel(
        h_ptr, w_ptr, labels_ptr, thr_ptr,       # (N, H), (V, H), (N,), (N,) kept-set thresholds (if KEPT)
        lse_ptr, tgt_ptr, ez_ptr,                # (S, N) fp32 partial stats, one row per vocab split
        N, V, H, v_per_split, inv_T, stride_h, stride_w,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
        UPCAST: tl.constexpr, KEPT: tl.constexpr,
    ):
        # program (i, s): tokens [i*BLOCK_N, +BLOCK_N) against vocab split s
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
        if KEPT:
            thr = tl.load(thr_ptr + rows, mask=row_ok, other=float("-inf"))
        v_start = tl.program_id(1) * v_per_split
        v_end = tl.minimum(v_start + v_per_split, V)

        m = tl.full([BLOCK_N], float("-inf"), tl.float32)    # running max of z
        s = tl.zeros([BLOCK_N], tl.float32)                  # sum exp(z - m)
        t = tl.zeros([BLOCK_N], tl.float32)                  # sum exp(z - m) * z, for the entropy
        tgt = tl.zeros([BLOCK_N], tl.float32)                # z[label] if the label is in this split
        for v0 in range(v_start, v_end, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            col_ok = cols < v_end
            acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
            for h0 in range(0, H, BLOCK_H):
                k = h0 + tl.arange(0, BLOCK_H)
                a = tl.load(h_ptr + rows[:, None] * stride_h + k[None, :],
                            mask=row_ok[:, None] & (k[None, :] < H), other=0.0)     # (BLOCK_N, BLOCK_H)
                b = tl.load(w_ptr + cols[None, :] * stride_w + k[:, None],
                            mask=col_ok[None, :] & (k[:, None] < H), other=0.0)     # (BLOCK_H, BLOCK_V)
                if UPCAST:  # the interpreter has no bf16 arithmetic
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                # ieee: fp32 inputs stay fp32 (no tf32 rounding); bf16 inputs are exact either way
                acc = tl.dot(a, b, acc, input_precision="ieee")
            z = acc * inv_T                                                          # (BLOCK_N, BLOCK_V)
            tgt += tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
            counted = col_ok[None, :]
            if KEPT:  # the sampler's kept set (the label always counts)
                counted = counted & ((z >= thr[:, None]) | (cols[None, :] == labels[:, None]))
            z = tl.where(counted, z, float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=1))
            # nothing counted yet (a kept set's first chunks): exponents taken from 0, m stays -inf
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            scale = tl.exp(m - m_use)                        # rescale old sums to the new max
            p = tl.exp(z - m_use[:, None])                   # 0 on padded columns
            s = s * scale + tl.sum(p, axis=1)
            t = t * scale + tl.sum(p * tl.where(counted, z, 0.0), axis=1)
            m = m_new
        out = tl.program_id(1) * N + rows
        tl.store(lse_ptr + out, m + tl.log(s), mask=row_ok)
        tl.store(tgt_ptr + out, tgt, mask=row_ok)
        tl.store(ez_ptr + out, tl.where(s > 0, t / s, 0.0), mask=row_ok)  # E_p[z] within the split

    @triton.jit
    def _dlogits_kernel(
        z_ptr, lse_ptr, labels_ptr, g_ptr, thr_ptr,  # (N, C) logits / T of one vocab chunk, overwritten by dz
        C, v0, stride_z,
        BLOCK: tl.constexpr, KEPT: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < C
        z = tl.load(z_ptr + row * stride_z + cols, mask=ok, other=0.0)
        lse = tl.load(lse_ptr + row)
        label = tl.load(labels_ptr + row)
        g = tl.load(g_ptr + row)
        p = tl.exp(z.to(tl.float32) - lse)                   # softmax probabilities of this chunk
        if KEPT:  # outside the kept set: probability 0
            p = tl.where((z.to(tl.float32) >= tl.load(thr_ptr + row)) | (cols + v0 == label), p, 0.0)
        dz = (tl.where(cols + v0 == label, 1.0, 0.0) - p) * g
        tl.store(z_ptr + row * stride_z + cols, dz.to(z.dtype), mask=ok)

# -----------------------------------------------------------------------------
# launchers and the chunked torch path

def _compute_dtype(x: Tensor) -> torch.dtype:
    # on GPU, matmuls run in the input dtype (bf16 tensor cores, fp32 accumulation); on CPU
    # bf16 matmuls are slow and round the logits, so chunks are upcast (fp64 stays fp64)
    return x.dtype if x.is_cuda else torch.promote_types(x.dtype, torch.float32)


_MM_FP32_OUT: dict = {}  # 16-bit dtype -> whether torch.mm gives its CUDA operands an fp32 output


def mm_fp32_out(dtype: torch.dtype) -> bool:
    """Whether torch.mm takes out_dtype=torch.float32 for `dtype` operands on CUDA (newer PyTorch), tried
    once: without it scaled_logits multiplies fp32 copies of both operands (said once, not hidden in every
    call; the sampler then keeps one fp32 copy of its LM head per call: grpo.engine.decode)."""
    if dtype not in _MM_FP32_OUT:
        try:
            a = torch.ones(1, 1, dtype=dtype, device="cuda")
            _MM_FP32_OUT[dtype] = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError) as e:  # older PyTorch: no out_dtype
            _no_fp32_out(dtype, e)
    return _MM_FP32_OUT[dtype]


def _no_fp32_out(dtype: torch.dtype, error: Exception):  # said once, as grpo.kernels' other fallbacks
    _MM_FP32_OUT[dtype] = False
    print(f"grpo.kernels: torch.mm(out_dtype=torch.float32) failed for {dtype} ({type(error).__name__}: "
          f"{error}): fp32 logits from fp32 copies of the operands from now on (slower, more memory)")


def scaled_logits(h: Tensor, w: Tensor, inv_T: float = 1.0) -> Tensor:
    """(N, H) @ (C, H).T / T -> (N, C), fp32 for half inputs: bf16 logits would be rounded by up
    to |z| 2^-9, a few percent on exp(z - lse) for z ~ 20 (cuBLAS accumulates in fp32 either way).
    Half products are exact in fp32, so the upcast fallback gives cuBLAS's numbers."""
    if h.dtype in (torch.bfloat16, torch.float16):
        z = None
        if h.is_cuda and _MM_FP32_OUT.get(h.dtype, True):  # a failure is not tried again
            try:
                z = torch.mm(h, w.T, out_dtype=torch.float32)
                _MM_FP32_OUT[h.dtype] = True
            except (TypeError, RuntimeError) as e:  # older PyTorch: no out_dtype
                _no_fp32_out(h.dtype, e)
        z = h.float() @ w.float().T if z is None else z
    else:
        z = h @ w.T
    return z.mul_(inv_T) if inv_T != 1.0 else z


def _chunk_size(N: int, V: int, on_gpu: bool) -> int:
    # vocab columns per chunk: an (N, C) block of about 8M elements on CPU (32 MB fp32, cache
    # and memory friendly) and 64M on GPU (fewer, larger cuBLAS calls)
    budget = 2**26 if on_gpu else 2**23
    return min(V, max(256, budget // max(N, 1) // 256 * 256))


def kept(z: Tensor, labels: Tensor, threshold: Tensor | None, v0: int) -> Tensor:
    """In place: z (N, C) logits / T of columns [v0, v0 + C) with -inf outside each row's kept set
    (z >= threshold, or the label's column). threshold None: z unchanged."""
    if threshold is None:
        return z
    out = z < threshold[:, None].to(z.dtype)                                  # (N, C)
    out &= torch.arange(v0, v0 + z.shape[1], device=z.device) != labels[:, None]  # the label always counts
    return z.masked_fill_(out, float("-inf"))


def _forward_torch(hidden, weight, labels, temperature, chunk, want_entropy, threshold=None):
    """(N, H), (V, H), (N,) -> lse (N,), target logit (N,), entropy (N,) or None; stats fp32+.
    threshold (N,) or None: the lse and entropy over each row's kept set."""
    N, V = hidden.shape[0], weight.shape[0]
    dt = _compute_dtype(hidden)
    sdt = torch.promote_types(dt, torch.float32)            # dtype of the statistics
    h = hidden.to(dt)                                        # (N, H); logits are scaled in fp32, below
    lse = torch.full((N,), float("-inf"), dtype=sdt, device=hidden.device)
    tgt = torch.zeros(N, dtype=sdt, device=hidden.device)
    ez = torch.zeros(N, dtype=sdt, device=hidden.device)    # E_p[z], renormalized as lse grows
    for v0 in range(0, V, chunk):
        z = scaled_logits(h, weight[v0:v0 + chunk].to(dt), 1.0 / temperature).to(sdt)  # (N, C) logits / T
        z = kept(z, labels, threshold, v0)  # -inf outside the kept set (the label's logit stays)
        lse_new = torch.logaddexp(lse, z.logsumexp(-1))
        if want_entropy:  # where: a kept set's chunk may hold nothing (-inf - -inf, exp(-inf) * -inf are nan)
            p = torch.exp(z - lse_new[:, None])
            ez = torch.where(lse_new > float("-inf"), ez * torch.exp(lse - lse_new), 0.0) + \
                torch.where(p > 0, p * z, 0.0).sum(-1)
        lse = lse_new
        y = labels - v0                                       # label's column in this chunk
        hit = (y >= 0) & (y < z.shape[1])
        tgt += torch.where(hit, z.gather(1, y.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)
    return lse, tgt, (lse - ez) if want_entropy else None


def _forward_triton(hidden, weight, labels, temperature, want_entropy, threshold=None):
    N, H = hidden.shape
    V = weight.shape[0]
    if gpu(hidden):
        # 16-bit operands: tensor-core tiles. fp32 operands ("ieee" dots on the FMA units, tiles twice
        # the bytes): the 16-bit launch spilled 248 bytes on sm_80 (255 registers) and took 98 KB of
        # the 99 KB an sm_89 block gets; half the tokens and hidden a step, 2 stages: 110-184
        # registers, no spill, 20 KB on sm_80-sm_100 (bench/compile_kernels.py)
        BLOCK_N, BLOCK_V, BLOCK_H, warps, stages = (32, 128, 32, 8, 2) if hidden.dtype == torch.float32 else (
            64, 128, 64, 8, 3)
        programs = 2 * sm_count(hidden)
    else:  # interpreter: small tiles, and 2 splits so the split combine is tested
        BLOCK_N, BLOCK_V, BLOCK_H, warps, stages = 16, 32, 16, 1, 1
        programs = 2 * triton.cdiv(N, BLOCK_N)
    n_blocks = triton.cdiv(N, BLOCK_N)
    # split the vocab when there are too few token blocks to fill the GPU
    splits = max(1, min(triton.cdiv(programs, n_blocks), triton.cdiv(V, 4 * BLOCK_V)))
    v_per_split = triton.cdiv(triton.cdiv(V, splits), BLOCK_V) * BLOCK_V
    splits = triton.cdiv(V, v_per_split)                      # every split non-empty
    stats = torch.empty(3, splits, N, dtype=torch.float32, device=hidden.device)
    _logprobs_fwd_kernel[(n_blocks, splits)](
        hidden, weight, labels, labels if threshold is None else threshold, stats[0], stats[1], stats[2],
        N, V, H, v_per_split, 1.0 / temperature, hidden.stride(0), weight.stride(0),
        BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H,
        UPCAST=not gpu(hidden), KEPT=threshold is not None,
        num_warps=warps, num_stages=stages,
        enable_fp_fusion=True,  # FMA, explicitly: Triton 3.10 flips the default
    )
    lse_s, tgt_s, ez_s = stats                                 # (S, N) each
    lse = lse_s.logsumexp(0)
    ez = (torch.exp(lse_s - lse) * ez_s).sum(0)              # each split's E_p[z], weighted by its mass
    return lse, tgt_s.sum(0), (lse - ez) if want_entropy else None


def _dlogits_torch(z, lse, labels, g, v0, threshold=None):
    """In place: z (N, C) logits / T of columns [v0, v0 + C) -> dz = (onehot - softmax) * g.
    Three passes over (N, C) and no second buffer: this is most of the non-matmul time on CPU.
    threshold: the softmax over each row's kept set (0 outside it)."""
    z = kept(z, labels, threshold, v0)
    y = labels - v0
    hit = (y >= 0) & (y < z.shape[1])
    dz = z.sub_(lse[:, None].to(z.dtype)).exp_().mul_(-g.to(z.dtype)[:, None])   # -p * g
    onehot_g = torch.where(hit, g, 0.0).to(z.dtype)[:, None]                     # + g at the label
    return dz.scatter_add_(1, y.clamp(0, z.shape[1] - 1)[:, None], onehot_g)


def _dlogits_triton(z, lse, labels, g, v0, threshold=None):
    N, C = z.shape
    BLOCK = 1024 if gpu(z) else 64
    _dlogits_kernel[(N, triton.cdiv(C, BLOCK))](z, lse, labels, g, labels if threshold is None else threshold,
                                                 C, v0, z.stride(0), BLOCK=BLOCK, KEPT=threshold is not None,
                                                 enable_fp_fusion=True)
    return z


def _backward(hidden, weight, labels, lse, grad, temperature, chunk, dlogits, need_h, need_w, grad_dtype,
              threshold=None):
    """Recompute one vocab chunk of logits at a time; each grad_weight row is written once.
    The recompute is the forward's (its softmax must match the forward's lse); the two gradient
    matmuls take `grad_dtype` inputs (None: the forward's)."""
    V = weight.shape[0]
    dt = _compute_dtype(hidden)
    gdt = grad_dtype or dt
    h = hidden.to(dt)                                        # (N, H), as in the forward
    h_g = h.to(gdt)                                          # (N, H), the grad_weight matmul's
    # ignored labels: no gradient; 1/T (d z/T / d z) folded into g, which scales every dz
    g = torch.where(labels >= 0, grad.to(lse.dtype), 0.0) / temperature
    grad_h = torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device) if need_h else None
    grad_w = torch.empty_like(weight) if need_w else None
    for v0 in range(0, V, chunk):
        w = weight[v0:v0 + chunk].to(dt)                        # (C, H)
        z = scaled_logits(h, w, 1.0 / temperature)              # (N, C) fp32+: the forward's logits / T
        dz = dlogits(z, lse, labels, g, v0, threshold).to(gdt)  # (N, C), in the gradient matmuls' dtype
        if need_h:
            grad_h += dz @ w.to(gdt)
        if need_w:
            grad_w[v0:v0 + chunk] = dz.T @ h_g
    return (grad_h.to(hidden.dtype) if need_h else None), grad_w

# -----------------------------------------------------------------------------
# autograd.Function and the public entry

class LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, backend, return_entropy, chunk, lead, grad_dtype,
                threshold):
        if backend == "triton":
            lse, tgt, entropy = _forward_triton(hidden, weight, labels, temperature, return_entropy,
                                                threshold)
        else:
            lse, tgt, entropy = _forward_torch(hidden, weight, labels, temperature, chunk, return_entropy,
                                               threshold)
        logprobs = torch.where(labels >= 0, tgt - lse, 0.0)
        ctx.save_for_backward(hidden, weight, labels, lse, threshold)
        ctx.temperature, ctx.backend, ctx.chunk, ctx.grad_dtype = temperature, backend, chunk, grad_dtype
        if entropy is None:
            entropy = lse.new_empty(0)
        ctx.mark_non_differentiable(entropy)
        # shaped here, not by .view() outside: FSDP2 warns about (and cannot hook) view outputs
        return logprobs.reshape(lead).clone(), entropy.reshape(lead if return_entropy else -1)

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, labels, lse, threshold = ctx.saved_tensors
        grad_logprobs = grad_logprobs.reshape(-1)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dlogits = _dlogits_triton if ctx.backend == "triton" else _dlogits_torch
        grad_h, grad_w = _backward(hidden, weight, labels, lse, grad_logprobs, ctx.temperature,
                                   ctx.chunk, dlogits, need_h, need_w, ctx.grad_dtype, threshold)
        return grad_h, grad_w, None, None, None, None, None, None, None, None


def linear_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float = 1.0,
                    backend: str | None = None, return_entropy: bool = False,
                    chunk_size: int | None = None, grad_dtype: torch.dtype | None = None,
                    threshold: Tensor | None = None):
    """log softmax(hidden @ weight.T / temperature)[labels], without the logits.

    hidden (..., H), weight (V, H), labels (...) int64 -> logprobs (...) fp32
    (and entropy (...) fp32, not differentiable, if return_entropy). Labels < 0: log-prob 0,
    entropy 0, no gradient, and no LM-head work (prompt tokens are ~half of a GRPO batch).
    backend: "triton" | "torch" | None (triton on CUDA when importable).
    chunk_size: vocab columns per backward (and torch forward) chunk; None picks one.
    grad_dtype: the input dtype of the backward's two gradient matmuls (dz @ W, dz.T @ hidden);
    None = the forward's. threshold (...) fp32 or None: each token's log-prob (and entropy) over its
    kept set {v : z_v >= threshold} plus the label, renormalised (-inf: the whole vocabulary); the
    sampler records it when top-k/top-p/min-p filter the vocabulary (grpo/engine/sampling.py). The
    CPU trainer under autocast_bf16 passes bf16: the forward and the recompute stay fp32 (log-probs
    exact, matching the sampler's); the two matmuls run at bf16's rate, with bf16's rounding of the
    gradients (normwise ~3e-3), as the blocks' own matmuls have under autocast (the backward at
    9,600 tokens of SmolLM2: 5.4 s instead of 9.6).
    """
    backend = "triton" if use_triton(hidden, backend, "linear_logprobs") else "torch"
    lead = labels.shape
    H, V = hidden.shape[-1], weight.shape[0]
    assert hidden.shape[:-1] == lead and weight.shape[1] == H, \
        f"{hidden.shape=} {weight.shape=} {labels.shape=}"
    hidden = hidden.reshape(-1, H)                            # (N, H)
    labels = labels.reshape(-1)                               # (N,)
    if threshold is not None:
        assert threshold.shape == lead, f"{threshold.shape=} != {labels.shape=}"
        threshold = threshold.reshape(-1).float()            # (N,)
    keep = labels >= 0
    if not bool(keep.all()):  # host sync: prompt and padding rows skip the LM head altogether
        idx = keep.nonzero().squeeze(1)                       # (M,)
        if idx.numel() == 0:  # nothing to score: zeros, still attached to the graph
            zero = (hidden[:, 0] * 0 + weight[0, 0] * 0).float().reshape(lead)
            return (zero, zero.detach()) if return_entropy else zero
        out = linear_logprobs(hidden[idx], weight, labels[idx], temperature, backend, return_entropy,
                              chunk_size, grad_dtype, None if threshold is None else threshold[idx])
        lp, ent = out if return_entropy else (out, None)
        place = lambda x: (torch.zeros(len(labels), dtype=x.dtype, device=x.device)
                           .index_put((idx,), x).reshape(lead))
        return (place(lp), place(ent)) if return_entropy else place(lp)
    hidden, labels = hidden.contiguous(), labels.contiguous()
    threshold = None if threshold is None else threshold.contiguous()
    chunk = chunk_size or _chunk_size(hidden.shape[0], V, gpu(hidden))
    logprobs, entropy = LinearLogprobs.apply(hidden, weight.contiguous(), labels, float(temperature),
                                             backend, return_entropy, chunk, tuple(lead), grad_dtype,
                                             threshold)
    return (logprobs, entropy) if return_entropy else logprobs
