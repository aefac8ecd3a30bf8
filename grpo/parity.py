"""The rule a greedy decode is checked by against a reference decode of the same model (bench/gpu_check.py's
sampler parity: CUDA graphs and flash-attn against eager SDPA). Random weights give near-ties that
rounding may flip, so a row may part from the reference only where both tokens are within TIE_REL
of the top logit of a full forward of the common prefix. Imports torch only (a bare GPU box runs it).
"""
import torch

# a tie: both tokens within 1/64 of the top logit (2-4 bf16 steps); bf16 against fp32 decode of the
# 0.5B shape (CPU) parted rows at gaps of 0.001-0.006 of the top logit, never more
TIE_REL = 1 / 64


@torch.no_grad()
def greedy_rows(model, prompts, ref: list, out: list, gaps: list | None = None) -> tuple[int, int, int]:
    """(rows equal, rows parted at a near-tie, rows parted elsewhere): see TIE_REL. `gaps` collects,
    per parted row, the top logit minus the lower of the two tokens' logits, over |top logit|."""
    equal = ties = bad = 0
    device = next(model.parameters()).device
    for p, a, b in zip(prompts, ref, out):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            equal, bad = equal + (len(a) == len(b)), bad + (len(a) != len(b))
            continue
        z = model(torch.tensor([p + a[:k]], device=device))[0, -1].float()  # (V,) where the rows part
        gap = ((z.max() - torch.minimum(z[a[k]], z[b[k]])) / z.max().abs()).item()
        tie = gap <= TIE_REL
        ties, bad = ties + tie, bad + (not tie)
        if gaps is not None:
            gaps.append(gap)
    return equal, ties, bad
