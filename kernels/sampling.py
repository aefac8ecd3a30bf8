"""Fused sampling: grpo/engine/sampling.py's Gumbel-max race, with no top-k/top-p/min-p, in one pass
over the logits, and the chosen token's log-prob from the same pass.

    z = logits / T,   token = argmax_v (z_v + g_v),   logprob = z[token] - logsumexp(z)

g_v = -log(-log u_v) with u_v a hash of (request key, step, v): the exact rule of
grpo.engine.sampling.sample, so a request draws the same tokens whether its step runs here or there.
The eager path costs ~15 (B, V) passes (the hash's int64 passes, two logs, the add, argmax,
gather, logsumexp) and a (B, V) int64 buffer: 311 MB at B 256 and Qwen's V 151936. Here each
program walks its slice of a row in blocks, keeping a running best (score, index, z) and an
online logsumexp (running max and sum, as in flash-attention); a second tiny kernel combines
the vocabulary splits of each row. The logits are read once; nothing of size V is written.

Bit-exactness with the eager path on the same device:
- the hash runs in uint32 (products wrap mod 2^32, the low 32 bits the reference keeps
  by masking its int64 products); the per-(key, step) seed is hashed in the kernel too;
- z: PyTorch's CUDA divide by a Python scalar multiplies by the fp32 reciprocal (1/T rounded
  once); on CPU it divides. The kernel does the same on each (RECIP);
- log: libdevice's logf on CUDA, CUDA's logf, which torch.log calls (Triton's own tl.log
  may lower to an approximation); numpy's log under the interpreter, which can differ from
  torch's CPU log by an ulp: a token then flips only if its two best scores lie within ~1e-7;
- no FMA contraction (enable_fp_fusion=False): z + g is rounded after z, as in two eager ops;
- argmax takes the first index on ties, inside a block, across blocks (strictly greater
  wins) and across splits, as torch.argmax does.
Temperature 0: greedy argmax of the logits and the temperature-1 log-prob, as the reference.
Inference only: no autograd (the sampler's logits carry no graph).
"""
import struct

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch backend still works
    triton = None
try:
    from triton.language.extra import libdevice
except ImportError:  # a Triton without libdevice: this kernel cannot build, its reference samples (said once)
    libdevice = None
HAS_KERNEL = triton is not None and libdevice is not None

from .reference import sample_ref
from .target import gpu, sm_count, use_triton

# -----------------------------------------------------------------------------
# Triton kernels

if HAS_KERNEL:
    @triton.jit
    def _mix32(x):
        # murmur3's 32-bit finalizer on uint32 (grpo.engine.sampling.mix32); the products wrap mod 2^32
        x = (x ^ (x >> 16)) * 0x85EBCA6B
        x = (x ^ (x >> 13)) * 0xC2B2AE35
        return x ^ (x >> 16)

    @triton.jit
    def _sample_partial_kernel(
        logits_ptr, key_ptr, step_ptr,           # (B, V) fp32/bf16, (B,) int64, (B,) int64
        part_ptr,                                # (4, B, S) fp32: best score, z at best, max, sum
        idx_ptr,                                 # (B, S) int32
        B, V, v_per_split, t_scale, stride_l,
        GREEDY: tl.constexpr, RECIP: tl.constexpr, PRECISE_LOG: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        # program (b, s): row b, vocabulary columns [s * v_per_split, +v_per_split)
        b = tl.program_id(0)
        s = tl.program_id(1)
        S = tl.num_programs(1)
        v_start = s * v_per_split
        v_end = tl.minimum(v_start + v_per_split, V)
        if not GREEDY:
            key = tl.load(key_ptr + b)
            step = tl.load(step_ptr + b)
            # grpo.engine.sampling.gumbel's seed, in uint32: only the low 32 bits of each int64 term survive
            seed = _mix32(step.to(tl.uint32) * 0x9E3779B9 + 0x165667B1)
            seed = _mix32(key.to(tl.uint32) ^ seed)
            seed = _mix32((key >> 32).to(tl.uint32) ^ seed)

        best = tl.full([], float("-inf"), tl.float32)    # best perturbed score in the split
        best_i = v_start                                 # its column (the split's first if all -inf)
        best_z = tl.full([], float("-inf"), tl.float32)  # z at that column
        m = tl.full([], float("-inf"), tl.float32)       # running max of z
        total = tl.zeros([], tl.float32)                 # sum exp(z - m)
        for v0 in range(v_start, v_end, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            ok = cols < v_end
            x = tl.load(logits_ptr + b * stride_l + cols, mask=ok, other=float("-inf")).to(tl.float32)
            if GREEDY:
                z = x
                score = z
            else:
                z = x * t_scale if RECIP else x / t_scale  # t_scale: 1/T on CUDA, T on CPU (the launcher)
                h = seed ^ (cols.to(tl.uint32) * 0x9E3779B9)
                h = (h ^ (h >> 16)) * 0x85EBCA6B
                h = (h ^ (h >> 13)) * 0xC2B2AE35
                h = (h >> 9) & 0x7FFFFF                   # bits 9..31: 23 bits, exact in fp32
                u = (h.to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 0 < u < 1
                if PRECISE_LOG:
                    g = -libdevice.log(-libdevice.log(u))
                else:
                    g = -tl.log(-tl.log(u))
                score = tl.where(ok, g + z, float("-inf"))
            # running best: the block's first maximum, taken only if strictly better
            blk_i = tl.argmax(score, axis=0, tie_break_left=True)
            blk = tl.max(score, axis=0)
            blk_z = tl.sum(tl.where(tl.arange(0, BLOCK_V) == blk_i, z, 0.0), axis=0)
            win = blk > best
            best_i = tl.where(win, v0 + blk_i, best_i)
            best_z = tl.where(win, blk_z, best_z)
            best = tl.where(win, blk, best)
            # online logsumexp; a block of -inf (masked logits) leaves m at -inf, so shift by 0 then
            m_new = tl.maximum(m, tl.max(z, axis=0))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            total = total * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
            m = m_new
        out = b * S + s
        tl.store(part_ptr + out, best)
        tl.store(part_ptr + B * S + out, best_z)
        tl.store(part_ptr + 2 * B * S + out, m)
        tl.store(part_ptr + 3 * B * S + out, total)
        tl.store(idx_ptr + out, best_i)

    @triton.jit
    def _sample_combine_kernel(
        part_ptr, idx_ptr, tokens_ptr, logprobs_ptr,   # (4, B, S), (B, S) -> (B,) int64, (B,) fp32
        B, S,
        BLOCK_S: tl.constexpr,
    ):
        b = tl.program_id(0)
        j = tl.arange(0, BLOCK_S)
        ok = j < S
        at = b * S + j
        best = tl.load(part_ptr + at, mask=ok, other=float("-inf"))
        best_z = tl.load(part_ptr + B * S + at, mask=ok, other=0.0)
        m = tl.load(part_ptr + 2 * B * S + at, mask=ok, other=float("-inf"))
        total = tl.load(part_ptr + 3 * B * S + at, mask=ok, other=0.0)
        idx = tl.load(idx_ptr + at, mask=ok, other=0)
        w = tl.argmax(best, axis=0, tie_break_left=True)  # splits are in column order: first index wins
        M = tl.max(m, axis=0)
        shift = tl.where(M == float("-inf"), 0.0, M)
        lse = shift + tl.log(tl.sum(total * tl.exp(m - shift), axis=0))
        tl.store(tokens_ptr + b, tl.sum(tl.where(j == w, idx, 0), axis=0).to(tl.int64))
        tl.store(logprobs_ptr + b, tl.sum(tl.where(j == w, best_z, 0.0), axis=0) - lse)

# -----------------------------------------------------------------------------
# launcher and the public entry

def _fp32(x: float) -> float:  # x rounded to the nearest fp32
    return struct.unpack("f", struct.pack("f", x))[0]


def _sample_triton(logits: Tensor, key: Tensor, step: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    B, V = logits.shape
    if gpu(logits):
        BLOCK_V, warps = 2048, 8
        # split a row when there are too few rows to give every SM ~4 programs (B 256 on 132 SMs: 3)
        programs = 4 * sm_count(logits)
    else:  # interpreter: small blocks, and 2 splits a row so the combine is tested
        BLOCK_V, warps = 128, 1
        programs = 2 * B
    splits = max(1, min(triton.cdiv(programs, B), triton.cdiv(V, 8 * BLOCK_V) if gpu(logits) else 2))
    v_per_split = triton.cdiv(triton.cdiv(V, splits), BLOCK_V) * BLOCK_V
    splits = triton.cdiv(V, v_per_split)                      # every split non-empty
    greedy = temperature == 0.0
    # PyTorch's CUDA x / T is x * fl(1/fl(T)) in fp32 (one rounding of the reciprocal, on the
    # host); its CPU x / T divides. Pass what each device's kernel needs, exactly in fp32.
    # (Python floats: no tensor op on the host; the double quotient of two fp32 values, rounded to
    # fp32 once, is fp32's own quotient)
    t32 = _fp32(temperature if not greedy else 1.0)
    t_scale = _fp32(1.0 / t32) if gpu(logits) else t32
    part = torch.empty(4, B, splits, dtype=torch.float32, device=logits.device)
    idx = torch.empty(B, splits, dtype=torch.int32, device=logits.device)
    _sample_partial_kernel[(B, splits)](
        logits, key, step, part, idx, B, V, v_per_split, t_scale, logits.stride(0),
        GREEDY=greedy, RECIP=gpu(logits), PRECISE_LOG=gpu(logits), BLOCK_V=BLOCK_V, num_warps=warps,
        enable_fp_fusion=False)  # z = x * (1/T) then z + g, each rounded, as the eager ops: no FMA
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    _sample_combine_kernel[(B,)](part, idx, tokens, logprobs, B, splits,
                                 BLOCK_S=triton.next_power_of_2(splits), num_warps=1, enable_fp_fusion=True)
    return tokens, logprobs


def kernel_available() -> bool:  # the GPU would take the kernel: is it there? (said once when not)
    global _said
    if not HAS_KERNEL and not _said:
        print("grpo.kernels: triton.language.extra.libdevice is not importable, fused_sample runs its "
              "PyTorch reference on CUDA (the same tokens, slower)")
        _said = True
    return HAS_KERNEL


_said = False


def fused_sample(logits: Tensor, key: Tensor, step: Tensor, temperature: float,
                 backend: str | None = None) -> tuple[Tensor, Tensor]:
    """grpo.engine.sampling.sample without filters, in one pass over the logits.

    logits (B, V) fp32 or bf16, key (B,) int64 request keys, step (B,) int64 completion
    positions -> tokens (B,) int64, logprobs (B,) fp32 of the token under softmax(logits / T)
    (temperature 0: greedy, with the temperature-1 log-prob). Inference only (no autograd).
    backend: "triton" | "torch" (kernels.reference.sample_ref) | None (triton on CUDA when importable).
    """
    assert backend != "triton" or HAS_KERNEL, (
        "backend='triton' but triton.language.extra.libdevice is not importable")
    backend = "triton" if use_triton(logits, backend, "fused_sample") and kernel_available() else "torch"
    assert logits.dim() == 2 and key.shape == step.shape == logits.shape[:1], \
        f"{logits.shape=} {key.shape=} {step.shape=}"
    assert temperature >= 0.0, f"{temperature=}"
    if backend == "torch" or len(logits) == 0:  # an empty batch: nothing to launch over
        return sample_ref(logits, key, step, temperature)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return _sample_triton(logits, key.contiguous(), step.contiguous(), float(temperature))
