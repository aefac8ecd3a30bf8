"""The naive log-prob path, for tests and benches: readable, and as memory-hungry as it looks.

The GRPO loss and advantage references are the plain functions of grpo/loss.py (kernels/ is
a leaf and does not import grpo): tests import them from there.
"""
import torch
from torch import Tensor


def linear_logprobs_ref(hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """(..., H), (V, H), (...) -> (...) log-probs of labels; labels < 0 give 0. Computed in fp32
    (fp64 for fp64 inputs) from the upcast inputs."""
    dt = torch.promote_types(hidden.dtype, torch.float32)
    logits = hidden.to(dt) @ weight.to(dt).T / temperature      # (..., V): the full logits
    logprobs = logits.log_softmax(-1)                          # (..., V): and a second copy
    picked = logprobs.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    return torch.where(labels >= 0, picked, 0.0)


def entropy_ref(hidden: Tensor, weight: Tensor, temperature: float = 1.0) -> Tensor:
    """(..., H), (V, H) -> (...) entropy of softmax(hidden @ weight.T / T)."""
    dt = torch.promote_types(hidden.dtype, torch.float32)
    logprobs = (hidden.to(dt) @ weight.to(dt).T / temperature).log_softmax(-1)
    return -(logprobs.exp() * logprobs).sum(-1)
