"""Fused GRPO token loss: surrogate (clipped, CISPO or SAPO), dual-clip, truncated IS weight and
k3 KL in one pass.

One Triton kernel reads each token's log-probs once and writes both the token loss and its
derivative d loss / d logprobs; backward is then a single multiply. The math is exactly
grpo.loss.token_loss, the PyTorch reference, which grpo.loss.policy_loss runs where this
kernel does not (CPU); aggregation over tokens (GRPO, BNPO, Dr. GRPO, DAPO) stays there too.

The derivative, with rho = exp(logp - old_logp) (d rho / d logp = rho):
  unclipped s1 = min(rho, delta) A   ->  rho A, or 0 where rho > delta
  clipped   s2 = clip(rho, lo, hi) A ->  rho A, or 0 where the clip is active
  l = -min(s1, s2) takes the derivative of the smaller term (half each on a tie, as torch does);
  dual-clip replaces l by c |A| (derivative 0) where A < 0 and l > c |A|;
  CISPO l = -sg(min(rho, cap)) A logp  ->  -min(rho, cap) A (the weight is detached);
  SAPO  l = -sigmoid(tau (rho - 1)) 4 / tau A  ->  -4 s (1 - s) rho A, s that sigmoid;
  w l has derivative w dl (w detached); beta k3 has derivative beta (1 - exp(ref - logp)), and
  beta rho k3 (use_bias_correction_kl) has beta rho (k3 + 1 - exp(ref - logp)) = beta rho (logp - ref).
"""
import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: grpo.loss runs the reference instead
    triton = None

# -----------------------------------------------------------------------------
# kernel

if triton is not None:
    @triton.jit
    def _grpo_token_loss_kernel(
        lp_ptr, old_ptr, adv_ptr, mask_ptr, ref_ptr, smp_ptr,   # (N,) each, any float dtype
        loss_ptr, dlp_ptr,                                      # (N,) fp32 outputs
        N, eps_low, eps_high, delta, dual_clip, beta, tis_cap, tau_pos, tau_neg,
        SURROGATE: tl.constexpr,                                # 0 clipped, 1 CISPO, 2 SAPO
        HAS_DELTA: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_KL: tl.constexpr, KL_RATIO: tl.constexpr,
        HAS_TIS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        # load in any dtype, compute in fp32 (the interpreter has no bf16 arithmetic anyway)
        lp = tl.load(lp_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        old = tl.load(old_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        A = tl.load(adv_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        m = tl.load(mask_ptr + offs, mask=ok, other=0.0) != 0

        rho = tl.exp(lp - old)
        if SURROGATE == 1:                                      # CISPO: the cap is eps_high
            w_is = tl.minimum(rho, eps_high)
            loss = -w_is * A * lp
            dloss = -w_is * A
        elif SURROGATE == 2:                                    # SAPO
            tau = tl.where(A > 0, tau_pos, tau_neg)
            gate = tl.sigmoid(tau * (rho - 1.0))
            loss = -gate * 4.0 / tau * A
            dloss = -4.0 * gate * (1.0 - gate) * rho * A
        else:
            r1 = rho
            if HAS_DELTA:
                r1 = tl.minimum(rho, delta)
            s1 = r1 * A
            s2 = tl.minimum(tl.maximum(rho, 1.0 - eps_low), 1.0 + eps_high) * A
            d1 = rho * A
            if HAS_DELTA:
                d1 = tl.where(rho > delta, 0.0, d1)
            d2 = tl.where((rho < 1.0 - eps_low) | (rho > 1.0 + eps_high), 0.0, rho * A)
            loss = -tl.minimum(s1, s2)
            dloss = -tl.where(s1 < s2, d1, tl.where(s1 > s2, d2, 0.5 * (d1 + d2)))
            if HAS_DUAL:
                bound = -dual_clip * A                          # c |A| where A < 0
                capped = (A < 0) & (loss > bound)
                loss = tl.where(capped, bound, loss)
                dloss = tl.where(capped, 0.0, dloss)
        if HAS_TIS:
            smp = tl.load(smp_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            w = tl.minimum(tl.exp(old - smp), tis_cap)
            loss = w * loss
            dloss = w * dloss
        if HAS_KL:
            ref = tl.load(ref_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            d = ref - lp
            k3 = tl.exp(d) - d - 1.0
            if KL_RATIO:                                        # rho k3, rho differentiated too
                loss += beta * rho * k3
                dloss += beta * rho * (lp - ref)
            else:
                loss += beta * k3
                dloss += beta * (1.0 - tl.exp(d))
        # where, not multiply: padding may hold garbage (inf) that 0 * inf would turn into nan
        tl.store(loss_ptr + offs, tl.where(m, loss, 0.0), mask=ok)
        tl.store(dlp_ptr + offs, tl.where(m, dloss, 0.0), mask=ok)

# -----------------------------------------------------------------------------
# launcher

SURROGATES = {"clip": 0, "cispo": 1, "sapo": 2}


def _token_loss_triton(logprobs, old_logprobs, advantages, loss_mask, ref_logprobs, sampler_logprobs,
                       eps_low, eps_high, delta, dual_clip, beta, tis_cap, surrogate, tau_pos, tau_neg,
                       kl_ratio) -> tuple[Tensor, Tensor]:
    shape = logprobs.shape
    flat = lambda x: x.expand(shape).contiguous().view(-1)      # noqa: E731  advantages may be (B, 1)
    lp, old, adv = flat(logprobs.detach()), flat(old_logprobs), flat(advantages)
    mask = flat(loss_mask.to(torch.float32))
    has_kl = ref_logprobs is not None and beta > 0
    has_tis = sampler_logprobs is not None and tis_cap is not None
    ref = flat(ref_logprobs) if has_kl else lp                  # dummy pointers when off
    smp = flat(sampler_logprobs) if has_tis else lp
    N = lp.numel()
    loss = torch.empty(N, dtype=torch.float32, device=lp.device)
    dlp = torch.empty_like(loss)
    BLOCK = 1024
    _grpo_token_loss_kernel[(triton.cdiv(N, BLOCK),)](
        lp, old, adv, mask, ref, smp, loss, dlp, N,
        float(eps_low), float(eps_high), float(delta or 0.0), float(dual_clip or 0.0),
        float(beta), float(tis_cap or 0.0), float(tau_pos), float(tau_neg), SURROGATE=SURROGATES[surrogate],
        HAS_DELTA=delta is not None, HAS_DUAL=dual_clip is not None, HAS_KL=has_kl, KL_RATIO=bool(kl_ratio),
        HAS_TIS=has_tis, BLOCK=BLOCK,
        enable_fp_fusion=True,  # each launch says, as Triton 3.10 flips the default
    )
    return loss.view(shape), dlp.view(shape)

# -----------------------------------------------------------------------------
# autograd.Function and the public entry

class GRPOTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logprobs, old_logprobs, advantages, loss_mask, ref_logprobs, sampler_logprobs,
                eps_low, eps_high, delta, dual_clip, beta, tis_cap, surrogate, tau_pos, tau_neg, kl_ratio):
        loss, dlp = _token_loss_triton(logprobs, old_logprobs, advantages, loss_mask, ref_logprobs,
                                       sampler_logprobs, eps_low, eps_high, delta, dual_clip, beta, tis_cap,
                                       surrogate, tau_pos, tau_neg, kl_ratio)
        ctx.save_for_backward(dlp)
        ctx.lp_dtype = logprobs.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (dlp,) = ctx.saved_tensors
        # only logprobs gets a gradient: old, ref, sampler log-probs and advantages are data
        return (grad_loss * dlp).to(ctx.lp_dtype), *([None] * 15)


def grpo_token_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor, *,
                    eps_low: float = 0.2, eps_high: float = 0.2,
                    delta: float | None = None, dual_clip: float | None = None,
                    ref_logprobs: Tensor | None = None, beta: float = 0.0,
                    sampler_logprobs: Tensor | None = None, tis_cap: float | None = None,
                    surrogate: str = "clip", tau_pos: float = 1.0, tau_neg: float = 1.05,
                    kl_ratio: bool = False) -> Tensor:
    """Per-token GRPO loss w_t l_t + beta k3_t, 0 where loss_mask is 0: (B, T) -> (B, T) fp32.

    advantages broadcast to logprobs' shape ((B, 1) or (B, T)). Differentiable in logprobs only.
    surrogate: clip | cispo (capped at eps_high) | sapo (tau_pos, tau_neg); kl_ratio: rho_t k3_t.
    """
    assert triton is not None, "triton is not importable: use grpo.loss.token_loss"
    assert surrogate in SURROGATES, f"{surrogate=} not in {'|'.join(SURROGATES)}"
    return GRPOTokenLoss.apply(logprobs, old_logprobs, advantages, loss_mask, ref_logprobs, sampler_logprobs,
                               eps_low, eps_high, delta, dual_clip, beta, tis_cap, surrogate, tau_pos,
                               tau_neg, kl_ratio)
