"""The engine's side of a CPU: the C allocator's free memory handed back (`trim`), and oneDNN's packed
GEMM for decode's fp32 weights."""
import ctypes

import torch

_libc = None


def trim() -> None:
    """Hand the C allocator's free memory back to the OS (glibc's malloc_trim; elsewhere nothing).
    Tensors under glibc's mmap threshold (it rises to 32 MB as large blocks are freed) live in the
    heap, and freed ones stay in the process: the CPU default held 6 GB during an eval that needed
    3. Called when a phase has freed its tensors (a sampler's release, the end of an update)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):  # not glibc (musl, macOS): their allocators return memory
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


# ----------------------------------------------------------------------------- oneDNN's packed GEMM
# The sampler's decode GEMMs on a CPU in fp32 (grpo.engine.decode, grpo.engine.sampling.sample_hidden): a
# weight reordered once per sampler call into oneDNN's blocked layout, then x @ W.T from it. One
# fp32 thread of an AVX512 CPU, SmolLM2's shapes at 4-128 rows: 1.3-2.2x torch's F.linear (MKL's small-M
# path reads the weights at a fifth of the bandwidth); with both held to AVX2, 1.0-1.2x.
PACK_ROWS = 64  # the rows the layout is chosen for: packed for 48 or 128, alike at 4-100 rows


def can_pack() -> bool:  # measured on x86 only (AVX2, AVX512): elsewhere decode keeps torch's GEMMs
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.backends.cpu.get_cpu_capability().startswith("AVX"))


def pack(weight: torch.Tensor) -> torch.Tensor:  # (out, in) fp32 -> an opaque oneDNN tensor of the same shape
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # (n, in) -> (n, out)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
