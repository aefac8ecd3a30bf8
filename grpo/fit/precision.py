"""How a run uses a CPU: its threads, and the matmul precision it runs fastest (fp32, or bf16
under torch.autocast).

Only the CPU has the choice: on CUDA the blocks compute in bf16 (FSDP's MixedPrecisionPolicy)
and this is not asked. A CPU with native bf16 (AVX512-BF16, AMX) runs bf16 matmuls several times
faster than fp32; one without it (AVX2 only: most laptops and many cloud VMs) emulates them,
several times slower (docs/cpu.md and bench/RESULTS.md have the figures). The CPU flags alone do not say
which a given PyTorch build and machine will do, so `autocast_bf16 = "auto"` times a few
matmuls of the model's own shapes (well under a second) and picks bf16 only where it beats fp32
by `MARGIN`. "true" and "false" force the choice.
"""
import os
import platform
import time

import torch

from grpo.config import SETTINGS, normalize

MARGIN = 1.2  # bf16 must be this much faster: its rounding costs a little accuracy, so a tie goes to fp32


def matmul_gflops(rows: int, d_in: int, d_out: int, dtype: torch.dtype, seconds: float = 0.12) -> float:
    """GFLOP/s of (rows, d_in) @ (d_in, d_out) in `dtype` on the CPU, with this process's threads.
    The weight is cast once, as the sampler's autocast cache does; the best of the timed calls
    counts (a shared machine's noise only ever slows a call down)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d_in, generator=g).to(dtype)
    w = torch.randn(d_out, d_in, generator=g).to(dtype)
    torch.nn.functional.linear(x, w)  # warm-up: first-call allocation and kernel selection
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 2 or spent < seconds and calls < 50:
        t = time.perf_counter()
        torch.nn.functional.linear(x, w)
        dt = time.perf_counter() - t
        best, spent, calls = min(best, dt), spent + dt, calls + 1
    return 2 * rows * d_in * d_out / best / 1e9


def measure(hidden: int, intermediate: int, rows: int = 128) -> dict:
    """{"float32": GFLOP/s, "bfloat16": GFLOP/s} on the MLP's up projection, the model's largest matmul
    in a block; `rows` tokens, as a decode wave or a packed micro-batch slice gives."""
    return {name: matmul_gflops(rows, hidden, intermediate, dtype)
            for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}


def choose(setting, rates_fn, margin: float = MARGIN) -> tuple[bool, str]:
    """(use bf16 autocast?, one line saying why). `rates_fn()` -> {"float32": r, "bfloat16": r}
    is called only for "auto" (tests pass a stub)."""
    setting = normalize(setting)
    if setting not in SETTINGS:
        raise ValueError(f"autocast_bf16={setting!r}, expected one of {', '.join(SETTINGS)}")
    if setting != "auto":
        return setting == "true", (f"autocast_bf16={setting} (forced): "
                                   f"{'bf16' if setting == 'true' else 'fp32'} matmuls")
    rates = rates_fn()
    fp32, bf16 = rates["float32"], rates["bfloat16"]
    use = bf16 > margin * fp32
    return use, (f"autocast_bf16=auto: {'bf16' if use else 'fp32'} matmuls (measured fp32 {fp32:.0f}, bf16 "
                 f"{bf16:.0f} GFLOP/s, {torch.get_num_threads()} threads; bf16 needs {margin}x; "
                 f"CPU capability {torch.backends.cpu.get_cpu_capability()})")


def set_autocast(model, setting, device=None, rates_fn=None) -> str:
    """Sets model.autocast_bf16 for `setting` on this machine; returns the line to print.
    On CUDA autocast stays off (bf16 comes from the weights or FSDP's policy).
    `rates_fn`: the measurement (default: `measure` on the model's shapes; under torchrun the
    trainer passes one that averages every rank's, so that all ranks choose alike)."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type != "cpu":
        model.autocast_bf16 = False
        return f"autocast_bf16: off on {device.type} (the weights or FSDP's policy give bf16)"
    if rates_fn is None:
        rates_fn = lambda: measure(model.args.dim, model.args.ffn_dim)  # noqa: E731
    model.autocast_bf16, line = choose(setting, rates_fn)
    return line


def cpu_name() -> str:
    """The CPU's model name, e.g. "AMD EPYC 9R14" (Linux: /proc/cpuinfo; elsewhere platform's guess).
    Benches print it beside get_cpu_capability(): "AVX512" alone does not tell a core with one 512-bit
    FMA path from one with two, and the fp32 floor differs by 2x between them."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def set_threads(requested: int = 0) -> int:
    """Intra-op threads for this process; returns the count. `requested` > 0 is used as given.
    0: one process keeps torch's default (the machine's cores); under torchrun, which sets
    OMP_NUM_THREADS=1 for every rank, each rank gets its share of the cores this process may
    use, so two ranks on a 16-core machine do not run on 2 of them."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if requested == 0 and local_world > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        requested = max(1, cores // local_world)
    if requested > 0:
        torch.set_num_threads(requested)
    return torch.get_num_threads()
