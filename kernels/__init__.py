"""Fused kernels for the log-prob, advantage and loss path; naive versions in grpo.kernels.reference.

Each kernel has a Triton version (CUDA, or CPU under TRITON_INTERPRET=1) and a PyTorch one;
`backend=None` picks Triton on CUDA and PyTorch elsewhere.
"""
from grpo.kernels.advantages import group_advantages
from grpo.kernels.grpo_loss import grpo_token_loss
from grpo.kernels.logprobs import linear_logprobs

__all__ = ["linear_logprobs", "grpo_token_loss", "group_advantages"]
