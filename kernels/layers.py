"""Decode-step layer kernels: the small elementwise and per-row work between the matmuls of
one decoder layer, fused so a decode step launches fewer kernels (eager PyTorch: ~54 a layer).

- qkv_rope_write: split the fused q|k|v projection, Qwen3's per-head RMSNorm, rotary on q and
  k, and the KV-cache write of this token's k and v: one kernel where the eager ops launch
  about 20 (about 40 with Qwen3's norms).
- add_rmsnorm: the residual add and the next RMSNorm, returning both (the residual stream
  continues from h): one kernel for about 9.
- silu_mul: SwiGLU's silu(gate) * up from one (N, 2F) gate|up matmul output: one kernel for 2
  (and one matmul for two).
- decode_attention: one query per row against its cache slot's first length[b] keys, GQA,
  split over KV blocks (flash-decoding) with an online softmax in fp32, then a combine kernel:
  no (B, S) gather of the slot's keys, no mask tensor, no repeat of the KV heads.
Each has a PyTorch reference in kernels/reference.py (the `backend="torch"` path) with the
model's rounding steps (grpo/models/layers.py: RMSNorm, apply_rope; KVCache.update), which the
kernels reproduce: fp32 math inside, rounded to the activation dtype where the model rounds.
Inference only: no autograd (the sampler's forward runs without a graph).
"""
import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch backends still work
    triton = None

from .target import gpu, sm_count, use_triton
from .reference import add_rmsnorm_ref, decode_attention_ref, qkv_rope_write_ref, silu_mul_ref

# -----------------------------------------------------------------------------
# Triton kernels

if triton is not None:
    @triton.jit
    def _norm_rope(ptr, w_ptr, cos, sin, heads, n_heads, cols, half, D, eps,
                   HAS_NORM: tl.constexpr):
        # one row's heads as two (BLOCK_HEADS, BLOCK_HALF) tiles, the halves of each head's D
        # channels ("rotate half"); returns the rotated halves in the input dtype, and where they go
        ok = (heads[:, None] < n_heads) & (cols[None, :] < half)
        at = heads[:, None] * D + cols[None, :]
        raw1 = tl.load(ptr + at, mask=ok, other=0.0)
        x1 = raw1.to(tl.float32)
        x2 = tl.load(ptr + at + half, mask=ok, other=0.0).to(tl.float32)
        if HAS_NORM:  # RMSNorm over the head's D channels: normalized, rounded, scaled, rounded (as RMSNorm)
            r = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)  # (BLOCK_HEADS,)
            w1 = tl.load(w_ptr + cols, mask=cols < half, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + half + cols, mask=cols < half, other=0.0).to(tl.float32)
            x1 = ((x1 * r[:, None]).to(raw1.dtype).to(tl.float32) * w1[None, :]).to(raw1.dtype).to(tl.float32)
            x2 = ((x2 * r[:, None]).to(raw1.dtype).to(tl.float32) * w2[None, :]).to(raw1.dtype).to(tl.float32)
        y1 = x1 * cos[None, :] - x2 * sin[None, :]
        y2 = x2 * cos[None, :] + x1 * sin[None, :]
        return y1.to(raw1.dtype), y2.to(raw1.dtype), at, ok

    @triton.jit
    def _qkv_rope_write_kernel(
        qkv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr,   # (B, (nh + 2 nkv) D), (B, D/2) fp32 x2, (D,) x2
        kc_ptr, vc_ptr, slot_ptr, pos_ptr, q_ptr,    # (slots, S, nkv, D) x2, (B,) x2, (B, nh, D) out
        NH, NKV, D, half, eps, stride_qkv, stride_cs,
        stride_cslot, stride_cpos, stride_chead,
        HAS_NORM: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):
        b = tl.program_id(0)                           # one decode token per program
        cols = tl.arange(0, BLOCK_HALF)
        heads = tl.arange(0, BLOCK_HEADS)
        cos = tl.load(cos_ptr + b * stride_cs + cols, mask=cols < half, other=0.0)
        sin = tl.load(sin_ptr + b * stride_cs + cols, mask=cols < half, other=0.0)
        row = qkv_ptr + b * stride_qkv
        q1, q2, at, ok = _norm_rope(row, qn_ptr, cos, sin, heads, NH, cols, half, D, eps, HAS_NORM)
        tl.store(q_ptr + b * NH * D + at, q1, mask=ok)
        tl.store(q_ptr + b * NH * D + at + half, q2, mask=ok)
        k1, k2, at, ok = _norm_rope(row + NH * D, kn_ptr, cos, sin, heads, NKV, cols, half, D, eps, HAS_NORM)
        # cache[slot, pos] (int64 offsets: one layer's cache can pass 2^31 elements)
        base = tl.load(slot_ptr + b) * stride_cslot + tl.load(pos_ptr + b) * stride_cpos
        c_at = base + heads[:, None] * stride_chead + cols[None, :]
        tl.store(kc_ptr + c_at, k1.to(kc_ptr.dtype.element_ty), mask=ok)
        tl.store(kc_ptr + c_at + half, k2.to(kc_ptr.dtype.element_ty), mask=ok)
        v_row = row + (NH + NKV) * D                   # v: no norm, no rotary, only the cast
        v1 = tl.load(v_row + at, mask=ok, other=0.0)
        v2 = tl.load(v_row + at + half, mask=ok, other=0.0)
        tl.store(vc_ptr + c_at, v1.to(vc_ptr.dtype.element_ty), mask=ok)
        tl.store(vc_ptr + c_at + half, v2.to(vc_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _add_rmsnorm_kernel(
        x_ptr, res_ptr, w_ptr, y_ptr, h_ptr,         # (N, H) x, residual, (H,), (N, H) y, h
        H, eps, stride_x, stride_r,
        HAS_RES: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        n = tl.program_id(0)                           # one row per program: H fits in registers
        cols = tl.arange(0, BLOCK_H)
        ok = cols < H
        raw = tl.load(x_ptr + n * stride_x + cols, mask=ok, other=0.0)
        h = raw
        if HAS_RES:  # h = x + residual, rounded to x's dtype as the eager add is
            r = tl.load(res_ptr + n * stride_r + cols, mask=ok, other=0.0)
            h = (raw.to(tl.float32) + r.to(tl.float32)).to(raw.dtype)
            tl.store(h_ptr + n * H + cols, h, mask=ok)
        hf = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / H + eps)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        y = (hf * rstd).to(raw.dtype).to(tl.float32) * w  # normalize in fp32, round, scale (RMSNorm)
        tl.store(y_ptr + n * H + cols, y.to(raw.dtype), mask=ok)

    @triton.jit
    def _silu_mul_kernel(
        gu_ptr, out_ptr,                             # (N, 2F) gate|up -> (N, F)
        F, stride_gu,
        BLOCK: tl.constexpr,
    ):
        n = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < F
        g_raw = tl.load(gu_ptr + n * stride_gu + cols, mask=ok, other=0.0)
        g = g_raw.to(tl.float32)
        u = tl.load(gu_ptr + n * stride_gu + F + cols, mask=ok, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u                 # silu(g) = g * sigmoid(g), in fp32
        tl.store(out_ptr + n * F + cols, y.to(g_raw.dtype), mask=ok)

    @triton.jit
    def _decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr,      # (B, nh, D), (slots, S, nkv, D) x2, (B,) x2
        acc_ptr, ml_ptr,                             # (B, nh, splits, D) fp32, (2, B, nh, splits) fp32
        NH, G, D, n_per_split, scale, stride_qb, stride_qh,
        stride_cslot, stride_cpos, stride_chead,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    ):
        # program (b, kv head, split): the G query heads sharing that KV head, over positions
        # [split * n_per_split, +n_per_split) of the row's first length[b]. Both dots take the
        # operands in the cache's dtype and accumulate in fp32: bf16 runs on the tensor cores (the
        # MMA pads the BLOCK_G heads to its own tile; no padding of ours beyond a power of two), fp32
        # runs on the FMA units ("ieee": no tf32), as the fp32 accumulation the reference gets. "ieee"
        # names only how fp32 operands are multiplied: 16-bit ones take the MMA under it too
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        SPLITS = tl.num_programs(2)
        length = tl.load(len_ptr + b)
        start = sp * n_per_split
        end = tl.minimum(start + n_per_split, length)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = kvh * G + g
        qd_ok = (g[:, None] < G) & (d[None, :] < D)
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=qd_ok, other=0.0)
        if UPCAST:  # the interpreter has no bf16 arithmetic: the same values, in fp32
            q = q.to(tl.float32)
        base = tl.load(slot_ptr + b) * stride_cslot + kvh * stride_chead
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)   # running max score
        l = tl.zeros([BLOCK_G], tl.float32)                 # sum exp(score - m)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)      # sum exp(score - m) v
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nd_ok = (n[:, None] < end) & (d[None, :] < D)
            at = base + n[:, None] * stride_cpos + d[None, :]
            k = tl.load(k_ptr + at, mask=nd_ok, other=0.0)                      # (BLOCK_N, BLOCK_D)
            v = tl.load(v_ptr + at, mask=nd_ok, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            # q.k exact products, fp32 sums, then the scale (as SDPA: scores in fp32, scaled)
            score = tl.dot(q, tl.trans(k), input_precision="ieee") * scale   # (BLOCK_G, BLOCK_N) fp32
            score = tl.where(n[None, :] < end, score, float("-inf"))
            m_new = tl.maximum(m, tl.max(score, axis=1))     # finite: n0 < end, one key at least
            alpha = tl.exp(m - m_new)
            p = tl.exp(score - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            # p rounded to v's dtype for the MMA (bf16: a relative 2^-9 a weight, as SDPA's flash
            # kernels round their probabilities); its sum l stays fp32
            pv = p.to(v_ptr.dtype.element_ty)
            if UPCAST:
                pv = pv.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")
            m = m_new
        out = (b * NH + heads) * SPLITS + sp                 # (BLOCK_G,) index into (B, nh, splits)
        g_ok = g < G
        tl.store(acc_ptr + out[:, None] * D + d[None, :], acc, mask=qd_ok)
        tl.store(ml_ptr + out, m, mask=g_ok)
        tl.store(ml_ptr + NH * SPLITS * tl.num_programs(0) + out, l, mask=g_ok)

    @triton.jit
    def _decode_attention_combine_kernel(
        acc_ptr, ml_ptr, o_ptr,                      # (B, nh, splits, D), (2, B, nh, splits) -> (B, nh, D)
        BNH, D, SPLITS,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0)                           # one (b, head)
        j = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        j_ok = j < SPLITS
        m = tl.load(ml_ptr + row * SPLITS + j, mask=j_ok, other=float("-inf"))
        l = tl.load(ml_ptr + BNH * SPLITS + row * SPLITS + j, mask=j_ok, other=0.0)
        acc = tl.load(acc_ptr + (row * SPLITS + j[:, None]) * D + d[None, :],
                      mask=j_ok[:, None] & (d[None, :] < D), other=0.0)
        w = tl.exp(m - tl.max(m, axis=0))                # empty splits (past the length): m -inf, weight 0
        y = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
        tl.store(o_ptr + row * D + d, y.to(o_ptr.dtype.element_ty), mask=d < D)

# -----------------------------------------------------------------------------
# public entries: backend "triton" | "torch" (the reference) | None (triton on CUDA when importable)

def _use_triton(t: Tensor, backend: str | None, what: str) -> bool:
    """Launch the kernel? An empty batch takes the reference (nothing to launch over)."""
    return use_triton(t, backend, what) and t.shape[0] > 0


def qkv_rope_write(qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, slot: Tensor,
                   pos: Tensor, n_heads: int, n_kv_heads: int, head_dim: int, q_norm: Tensor | None = None,
                   k_norm: Tensor | None = None, eps: float = 1e-6, backend: str | None = None) -> Tensor:
    """One decode token per row: split q|k|v, per-head RMSNorm (Qwen3, if q_norm/k_norm), rotary,
    and the cache write; returns the rotated q.

    qkv (B, (nh + 2 nkv) D) = [q heads | k heads | v heads]; cos, sin (B, D/2) fp32 at each row's
    position; k_cache, v_cache (slots, S, nkv, D) of one layer, written in place at [slot, pos]
    (rotated k and raw v, cast to the cache dtype); slot, pos (B,) int64; q_norm, k_norm (D,).
    -> q (B, nh, D) in qkv's dtype. Inference only (no autograd).
    """
    B = qkv.shape[0]
    nh, nkv, D = n_heads, n_kv_heads, head_dim
    assert qkv.shape == (B, (nh + 2 * nkv) * D) and D % 2 == 0, f"{qkv.shape=} {nh=} {nkv=} {D=}"
    assert cos.shape == sin.shape == (B, D // 2), f"{cos.shape=} {sin.shape=}"
    assert (k_cache.shape[2:] == (nkv, D)
            and v_cache.shape == k_cache.shape), f"{k_cache.shape=} {v_cache.shape=}"
    assert (q_norm is None) == (k_norm is None), "q_norm and k_norm come together (Qwen3)"
    if not _use_triton(qkv, backend, "qkv_rope_write"):
        return qkv_rope_write_ref(qkv, cos, sin, k_cache, v_cache, slot, pos, nh, nkv, D, q_norm, k_norm, eps)
    assert (k_cache.stride(3) == 1
            and v_cache.stride() == k_cache.stride()), "caches: rows of D contiguous, same layout"
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    q = torch.empty(B, nh, D, dtype=qkv.dtype, device=qkv.device)
    has_norm = q_norm is not None
    _qkv_rope_write_kernel[(B,)](
        qkv, cos, sin, q_norm if has_norm else cos, k_norm if has_norm else cos,  # dummies when no norm
        k_cache, v_cache, slot, pos, q,
        nh, nkv, D, D // 2, float(eps), qkv.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HAS_NORM=has_norm, BLOCK_HEADS=triton.next_power_of_2(max(nh, nkv)),
        BLOCK_HALF=triton.next_power_of_2(D // 2), num_warps=4 if gpu(qkv) else 1,
        enable_fp_fusion=False)  # x1 cos - x2 sin rounded per product, as apply_rope's eager ops: no FMA
    return q


def add_rmsnorm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float,
                backend: str | None = None) -> tuple[Tensor, Tensor]:
    """h = x + residual (x's dtype; h = x when residual is None), y = RMSNorm(h) * weight.

    x, residual (N, H), weight (H,) -> y (N, H) in x's dtype, h (N, H): grpo.models.model's RMSNorm
    on h (normalized in fp32, rounded to x's dtype, then scaled). Inference only (no autograd).
    """
    N, H = x.shape
    assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype), f"{x.shape=}"
    assert weight.shape == (H,), f"{weight.shape=} {H=}"
    if not _use_triton(x, backend, "add_rmsnorm"):
        return add_rmsnorm_ref(x, residual, weight, eps)
    x = x if x.stride(1) == 1 else x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    y = torch.empty(N, H, dtype=x.dtype, device=x.device)
    h = torch.empty_like(y) if residual is not None else x
    _add_rmsnorm_kernel[(N,)](
        x, residual if residual is not None else x, weight, y, h, H, float(eps), x.stride(0),
        residual.stride(0) if residual is not None else 0,
        HAS_RES=residual is not None, BLOCK_H=triton.next_power_of_2(H),
        num_warps=(4 if H <= 2048 else 8) if gpu(x) else 1, enable_fp_fusion=True)
    return y, h


def silu_mul(gu: Tensor, backend: str | None = None) -> Tensor:
    """SwiGLU's activation from the concatenated gate|up projection: gu (N, 2F) -> silu(gate) * up
    (N, F) in gu's dtype, computed in fp32. Inference only (no autograd)."""
    N, F2 = gu.shape
    assert F2 % 2 == 0, f"{gu.shape=}"
    if not _use_triton(gu, backend, "silu_mul"):
        return silu_mul_ref(gu)
    F = F2 // 2
    gu = gu if gu.stride(1) == 1 else gu.contiguous()
    out = torch.empty(N, F, dtype=gu.dtype, device=gu.device)
    BLOCK = 1024 if gpu(gu) else 64
    _silu_mul_kernel[(N, triton.cdiv(F, BLOCK))](gu, out, F, gu.stride(0), BLOCK=BLOCK,
                                                   enable_fp_fusion=True)
    return out


def _attention_launch(D: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(keys a block, warps, pipeline stages) of the decode attention on a GPU, for head dim D.
    16-bit caches: the k and v tiles stay in their dtype and feed the tensor cores. Timed on an
    H200 (bench/decode_kernels.py --sweep, graph-replayed, bf16, 2026-12-04) against 13 others,
    each as a speed-up over the previous 64 x 8 x 2: at D 64 (Qwen2.5-0.5B's 256 rows) 64 keys x 4
    warps x 3 stages, 1.20x (the fastest, 64 x 4 x 2, 1.23x); at D 128 (3B's 64 rows) 64 x 8 x 3,
    1.23x (64 x 4 x 3 was 1.36x, but spills 16 bytes on sm_100 with 4 query heads a KV head,
    Qwen3-4B's shape; 64 x 4 x 2 spills 8 on sm_90 and sm_100 with 2 and 4). Both compile with no
    spill for 2 to 8 heads on sm_80-sm_100 (63-80 registers). fp32 caches: the "ieee" dots run on
    the FMA units from fp32 tiles, twice the registers and shared memory: 8 warps and 32 (D <= 64)
    or 16 keys leave no spill (64 keys x 4 warps spilled; 128 spilled up to 648 bytes and asked
    139 KB at D 128); not timed on a GPU (the trainer's caches are bf16 there). Compiled for each
    arch by bench/compile_kernels.py and tests/test_compile.py."""
    if dtype == torch.float32:
        return (32 if D <= 64 else 16), 8, 3
    return (64, 4, 3) if D <= 64 else (64, 8, 3)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slot: Tensor, length: Tensor,
                     scale: float | None = None, backend: str | None = None) -> Tensor:
    """One query per row over its cache slot: softmax(q k^T * scale) v over cache[slot, :length].

    q (B, nh, D); k_cache, v_cache (slots, S, nkv, D) of one layer, q's dtype; slot (B,) int64;
    length (B,) int64, 1 <= length <= S (this step's key already written); GQA: head h reads
    KV head h // (nh // nkv); scale defaults to D^-0.5. -> (B, nh, D) in q's dtype, accumulated
    in fp32. Inference only (no autograd).
    """
    B, nh, D = q.shape
    slots, S, nkv, Dc = k_cache.shape
    assert Dc == D and nh % nkv == 0 and v_cache.shape == k_cache.shape, f"{q.shape=} {k_cache.shape=}"
    assert k_cache.dtype == v_cache.dtype == q.dtype, f"{q.dtype=} {k_cache.dtype=} {v_cache.dtype=}"
    scale = D ** -0.5 if scale is None else scale
    if not _use_triton(q, backend, "decode_attention"):
        return decode_attention_ref(q, k_cache, v_cache, slot, length, scale)
    assert (k_cache.stride(3) == 1
            and v_cache.stride() == k_cache.stride()), "caches: rows of D contiguous, same layout"
    q = q if q.stride(2) == 1 else q.contiguous()
    G = nh // nkv
    if gpu(q):
        BLOCK_N, warps, stages = _attention_launch(D, q.dtype)
        # split the keys when B * nkv programs would leave SMs idle (flash-decoding)
        programs = 4 * sm_count(q)
        splits = max(1, min(triton.cdiv(programs, B * nkv), triton.cdiv(S, 4 * BLOCK_N)))
    else:  # interpreter: small blocks, 3 splits so the combine (and an empty split) is tested
        BLOCK_N, warps, stages, splits = 16, 1, 1, 3
    n_per_split = triton.cdiv(triton.cdiv(S, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(S, n_per_split)
    acc = torch.empty(B, nh, splits, D, dtype=torch.float32, device=q.device)
    ml = torch.empty(2, B, nh, splits, dtype=torch.float32, device=q.device)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    _decode_attention_kernel[(B, nkv, splits)](
        q, k_cache, v_cache, slot, length, acc, ml, nh, G, D, n_per_split, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_G=triton.next_power_of_2(G), BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        UPCAST=not gpu(q),
        num_warps=warps, num_stages=stages, enable_fp_fusion=True)
    out = torch.empty(B, nh, D, dtype=q.dtype, device=q.device)
    _decode_attention_combine_kernel[(B * nh,)](acc, ml, out, B * nh, D, splits,
                                               BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=BLOCK_D,
                                               num_warps=1, enable_fp_fusion=True)
    return out
