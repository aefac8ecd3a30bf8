"""The fast subset's Triton run: two small kernels under the interpreter against their PyTorch
references, in a child process of a few seconds (the kernel modules' full re-runs are slow)."""
import torch
from interpret import interpreted, rerun_under_interpreter

from grpo.kernels import silu_mul
from grpo.kernels.reference import silu_mul_ref
from grpo.loss import group_advantages  # its backend="triton" is grpo.kernels' kernel

test_small_kernels_under_interpreter = rerun_under_interpreter(__file__, slow=False)


@interpreted
def test_silu_mul_kernel_is_its_reference():
    gu = torch.randn(5, 2 * 200, generator=torch.Generator().manual_seed(0)) * 4
    torch.testing.assert_close(silu_mul(gu, backend="triton"), silu_mul_ref(gu), atol=1e-6, rtol=1e-6)


@interpreted
def test_group_advantages_kernel_is_its_reference():
    rewards = torch.randn(18, generator=torch.Generator().manual_seed(1))  # G=6: not a power of 2
    rewards[6:12] = 0.1  # a flat group: advantages exactly 0
    ours = group_advantages(rewards, 6, "group", backend="triton")
    torch.testing.assert_close(ours, group_advantages(rewards, 6, "group", backend="torch"))
    assert (ours[6:12] == 0).all()
