"""Where a kernel's work runs, decided in one place for every wrapper in grpo.kernels and for
grpo.loss, grpo.engine.sampling and grpo.engine.decode.

- gpu(t): does t's work take the GPU's way (the Triton kernel, with the GPU's tile sizes and
  warps)? True for CUDA tensors, and for any tensor inside compile_for() below.
- use_triton(t, backend, what): the wrappers' choice. backend "triton" or "torch" forces it;
  None runs Triton where gpu(t) and triton imports, and says once when it does not (the
  reference computes the same thing, but a silent fallback would hide a slow path).
- references(): inside, the calls that name no backend take the PyTorch references, silently
  (a reference run on a GPU: bench/gpu_check.py's greedy parity).
- sm_count(t): the GPU's streaming multiprocessors, which size the split-K/split-V grids.
- compile_for(arch): on a machine without a GPU, every Triton launch inside compiles for
  CUDA sm_<arch> through Triton's own pipeline (TTIR, TTGIR, LLVM IR, PTX, and ptxas, which
  ships in Triton's wheel, to a cubin) and launches nothing. The wrappers run as on that GPU
  (GPU tile sizes, grids sized by its SM count) on CPU tensors, so a CPU finds out whether the
  kernels build for the GPU, with which registers, spills and shared memory
  (bench/compile_kernels.py), and how many kernels a decode step launches. The outputs of
  kernels that never ran are uninitialized: only the launches count there, not the numbers.
  Process-wide while it lasts: a launch from another thread inside the block compiles and does
  not run either.
"""
import os
from contextlib import contextmanager

import torch
from torch import Tensor

try:
    import triton
except ImportError:  # CPU-only installs: the references still work
    triton = None

HAS_TRITON = triton is not None

# SMs of the GPUs the recipes have profiles for, by CUDA arch (compile_for's grids)
SMS = {80: 108, 89: 142, 90: 132, 100: 148}

_compiling = None   # the _CompileOnly of the compile_for() block we are in, if any
_references = False  # inside a references() block
_warned = set()


def gpu(t: Tensor) -> bool:
    """Does t's work take the GPU's way (the Triton kernel, GPU tiles)? See the module docstring."""
    return t.is_cuda or _compiling is not None


def use_triton(t: Tensor, backend: str | None, what: str = "a kernel") -> bool:
    """Run the Triton kernel on t's work? See the module docstring."""
    if backend is not None:
        assert backend in ("triton", "torch"), f"{backend=}"
        assert backend == "torch" or HAS_TRITON, "backend='triton' but triton is not importable"
        return backend == "triton"
    if _references:
        return False
    if gpu(t) and not HAS_TRITON and what not in _warned:
        _warned.add(what)
        print(f"grpo.kernels: triton is not importable, {what} runs its PyTorch reference on CUDA")
    return gpu(t) and HAS_TRITON


@contextmanager
def references():
    """Inside: every call that names no backend takes the PyTorch reference."""
    global _references
    saved, _references = _references, True
    try:
        yield
    finally:
        _references = saved


def sm_count(t: Tensor) -> int:
    """SMs of t's GPU (inside compile_for: of the target's, from SMS)."""
    if _compiling is not None:
        return SMS[_compiling.arch]
    return torch.cuda.get_device_properties(t.device).multi_processor_count


class _CompileOnly:
    """A Triton driver that reports a CUDA target and launches nothing; `launches` records one
    (kernel name, compiled kernel) per launch, in order."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        self.arch, self.target, self.launches = arch, GPUTarget("cuda", arch, 32), []

    # the parts of triton's DriverBase that JITFunction.run reads
    def get_current_target(self):
        return self.target

    def get_current_device(self):  # a key of its own in each kernel's per-device compile cache
        return f"compile-only:sm_{self.arch}"

    def get_current_stream(self, device=None):
        return 0


@contextmanager
def compile_for(arch: int = 90):
    """Compile every Triton launch inside for CUDA sm_<arch>, run none; yields the list of
    (kernel name, compiled kernel) launches, which fills as the block runs."""
    global _compiling
    assert HAS_TRITON, "compile_for needs triton"
    assert arch in SMS, f"{arch=}: one of {sorted(SMS)}"
    assert os.environ.get("TRITON_INTERPRET") != "1", "compile_for compiles: unset TRITON_INTERPRET"
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction
    assert _compiling is None, "compile_for blocks do not nest"
    fake, saved = _CompileOnly(arch), driver._active
    own = JITFunction.__dict__.get("__getitem__")  # None: inherited (KernelInterface's), left so after

    def compile_launch(fn, grid):  # fn[grid](...): compile (run's warmup path), record, launch nothing
        def launch(*args, **kwargs):
            fake.launches.append((fn.__name__, fn.run(*args, grid=grid, warmup=True, **kwargs)))
        return launch

    driver.set_active(fake)
    JITFunction.__getitem__ = compile_launch
    _compiling = fake
    try:
        yield fake.launches
    finally:
        driver._active = saved
        if own is None:
            del JITFunction.__getitem__
        else:
            JITFunction.__getitem__ = own
        _compiling = None
