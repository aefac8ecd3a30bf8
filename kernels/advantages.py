"""Group advantage normalization on the device where the rewards live: one Triton program per
group of G completions. The PyTorch reference, and the function the trainer calls, is
grpo.loss.group_advantages (it runs this kernel for CUDA rewards).

    A_i = (r_i - mean_group(r)) / (std + 1e-4)    std unbiased, of the group or of the batch
    A_i = r_i - mean_group(r)                      (scale "none", Dr. GRPO)
A group whose rewards are all equal gets exactly 0: its mean is not always exactly
representable (0.1 x 8), and r - mean would leave a tiny advantage of one sign. As TRL's
GRPOTrainer: a NaN reward (unscorable) is left out of the group's mean and std and gets 0; a group
with fewer than 2 scorable rewards, or with an infinite one, gets 0 everywhere.
"""
import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

SCALES = {"none": 0, "group": 1, "batch": 2}

if triton is not None:
    @triton.jit
    def _group_advantages_kernel(r_ptr, out_ptr, batch_std, G,
                                 SCALE: tl.constexpr, BLOCK_G: tl.constexpr):
        # SCALE: 0 none, 1 group std, 2 batch std
        offs = tl.program_id(0) * G + tl.arange(0, BLOCK_G)
        lane = tl.arange(0, BLOCK_G) < G
        r = tl.load(r_ptr + offs, mask=lane, other=0.0).to(tl.float32)
        ok = lane & (r == r)                                    # scorable: NaN is not equal to itself
        n = tl.sum(ok.to(tl.float32), axis=0)
        flat = tl.max(tl.where(ok, r, float("-inf")), axis=0) == tl.min(tl.where(ok, r, float("inf")), axis=0)
        has_inf = tl.max((ok & (tl.abs(r) == float("inf"))).to(tl.int32), axis=0) > 0
        zero = flat | (n < 2.0) | has_inf                       # the group teaches nothing
        mean = tl.sum(tl.where(ok, r, 0.0), axis=0) / tl.maximum(n, 1.0)
        centered = tl.where(zero, 0.0, tl.where(ok, r - mean, 0.0))
        if SCALE == 1:
            std = tl.sqrt(tl.sum(centered * centered, axis=0) / tl.maximum(n - 1.0, 1.0))   # unbiased
            centered = centered / (std + 1e-4)
        if SCALE == 2:
            centered = centered / (batch_std + 1e-4)
        tl.store(out_ptr + offs, centered, mask=lane)


def group_advantages(rewards: Tensor, G: int, scale: str = "group", batch_std: float = 0.0) -> Tensor:
    """(B*G,) rewards, consecutive groups of G -> (B*G,) fp32 advantages. `batch_std`: the
    unbiased std of every finite raw reward of the global batch, for scale="batch"."""
    assert triton is not None, "triton is not importable: use grpo.loss.group_advantages"
    assert rewards.dim() == 1 and rewards.numel() % G == 0, f"{rewards.shape=} not (B*{G},)"
    assert scale in SCALES, f"{scale=} not in {list(SCALES)}"
    assert scale != "group" or G > 1, "an unbiased group std needs G > 1"
    r = rewards.float().contiguous()
    out = torch.empty_like(r)
    _group_advantages_kernel[(r.numel() // G,)](r, out, float(batch_std), G, SCALE=SCALES[scale],
                                               BLOCK_G=triton.next_power_of_2(G), enable_fp_fusion=True)
    return out
