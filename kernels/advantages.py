"""Group advantage normalization on the device where the rewards live: one Triton program per
group of G completions. The PyTorch reference, and the function the trainer calls, is
grpo.loss.group_advantages (it runs this kernel for CUDA rewards).

    A_i = (r_i - mean_group(r)) / (std + 1e-4)    std unbiased, of the group or of the batch
    A_i = r_i - mean_group(r)                      (scale "none", Dr. GRPO)
A group whose rewards are all equal gets exactly 0: its mean is not always exactly
representable (0.1 x 8), and r - mean would leave a tiny advantage of one sign.
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
        ok = tl.arange(0, BLOCK_G) < G
        r = tl.load(r_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        flat = tl.max(tl.where(ok, r, float("-inf")), axis=0) == tl.min(tl.where(ok, r, float("inf")), axis=0)
        centered = tl.where(ok, r - tl.sum(r, axis=0) / G, 0.0)
        if SCALE == 1:
            std = tl.sqrt(tl.sum(centered * centered, axis=0) / (G - 1))   # unbiased
            centered = centered / (std + 1e-4)
        if SCALE == 2:
            centered = centered / (batch_std + 1e-4)
        tl.store(out_ptr + offs, tl.where(flat, 0.0, centered), mask=ok)


def group_advantages(rewards: Tensor, G: int, scale: str = "group", batch_std: float = 0.0) -> Tensor:
    """(B*G,) rewards, consecutive groups of G -> (B*G,) fp32 advantages. `batch_std`: the
    unbiased std of every raw reward of the global batch, for scale="batch"."""
    assert triton is not None, "triton is not importable: use grpo.loss.group_advantages"
    assert rewards.dim() == 1 and rewards.numel() % G == 0, f"{rewards.shape=} not (B*{G},)"
    assert scale in SCALES, f"{scale=} not in {list(SCALES)}"
    assert scale != "group" or G > 1, "an unbiased group std needs G > 1"
    r = rewards.float().contiguous()
    out = torch.empty_like(r)
    _group_advantages_kernel[(r.numel() // G,)](r, out, float(batch_std), G, SCALE=SCALES[scale],
                                               BLOCK_G=triton.next_power_of_2(G), enable_fp_fusion=True)
    return out
