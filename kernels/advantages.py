"""Group advantage normalization: A_i = (r_i - mean_group(r)) / (std + 1e-4), or no division.

One Triton program per group of G completions. The reference is grpo.loss.group_advantages;
std is unbiased, over the group ("group") or over every raw reward in the batch ("batch", one
torch reduction passed in), and "none" stops at r - mean (Dr. GRPO).
"""
import torch
from torch import Tensor

from grpo.loss import group_advantages as group_advantages_torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def _group_advantages_kernel(r_ptr, out_ptr, batch_std, G,
                                 SCALE: tl.constexpr, BLOCK_G: tl.constexpr):
        # SCALE: 0 none, 1 group std, 2 batch std
        offs = tl.program_id(0) * G + tl.arange(0, BLOCK_G)
        ok = tl.arange(0, BLOCK_G) < G
        r = tl.load(r_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        centered = tl.where(ok, r - tl.sum(r, axis=0) / G, 0.0)
        if SCALE == 1:
            std = tl.sqrt(tl.sum(centered * centered, axis=0) / (G - 1))   # unbiased
            centered = centered / (std + 1e-4)
        if SCALE == 2:
            centered = centered / (batch_std + 1e-4)
        tl.store(out_ptr + offs, centered, mask=ok)


def group_advantages(rewards: Tensor, G: int, scale: str = "group", backend: str | None = None) -> Tensor:
    """(B*G,) rewards, consecutive groups of G -> (B*G,) fp32 advantages; see grpo.loss.group_advantages."""
    if backend is None:
        backend = "triton" if (rewards.is_cuda and triton is not None) else "torch"
    if backend == "torch":
        return group_advantages_torch(rewards, G, scale)
    assert rewards.dim() == 1 and rewards.numel() % G == 0, f"{rewards.shape=} not (B*{G},)"
    assert scale in ("none", "group", "batch"), f"{scale=}"
    assert scale != "group" or G > 1, "an unbiased group std needs G > 1"
    r = rewards.float().contiguous()
    out = torch.empty_like(r)
    batch_std = r.std().item() if scale == "batch" else 0.0   # host sync: one scalar per step
    _group_advantages_kernel[(r.numel() // G,)](
        r, out, batch_std, G, SCALE={"none": 0, "group": 1, "batch": 2}[scale],
        BLOCK_G=triton.next_power_of_2(G))
    return out
