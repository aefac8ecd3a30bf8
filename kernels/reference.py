"""The naive versions, for tests and benches: readable, and as memory-hungry as they look.

The GRPO loss references are the plain functions of grpo.loss (token_loss, the aggregations,
group_advantages); they are re-exported here so that tests find every reference in one place.
"""
import torch
from torch import Tensor

from grpo.loss import group_advantages as group_advantages_ref  # noqa: F401
from grpo.loss import token_loss as grpo_token_loss_ref  # noqa: F401


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
