"""Process groups from the torchrun environment, and FSDP2 applied from outside the model.

One process (plain `python recipe.py`) is world size 1 and nothing here does any work.
Under `torchrun`, gloo on CPU and NCCL on GPU; `shard` applies `fully_shard` to every
transformer block and then to the root, with bf16 compute and fp32 parameters, gradient
reduction and optimizer state on GPU (DESIGN.md, decision 4).
"""
import contextlib
import os

import torch
import torch.distributed as tdist


def init():
    if "RANK" in os.environ and not tdist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        tdist.init_process_group(backend)


def is_dist() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def rank() -> int:
    return tdist.get_rank() if is_dist() else 0


def world_size() -> int:
    return tdist.get_world_size() if is_dist() else 1


def is_main() -> bool:
    return rank() == 0


def print0(*args, **kwargs):
    if is_main():
        print(*args, **kwargs, flush=True)


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def all_sum(x: float) -> float:
    """Sum a Python number over ranks (loss normalizers must be global)."""
    if not is_dist():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device() if torch.cuda.is_available() else "cpu")
    tdist.all_reduce(t)
    return t.item()


def all_gather_cat(x: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-size 1-D tensors from every rank, in rank order."""
    if not is_dist():
        return x
    dev = device()
    parts = [torch.empty_like(x, device=dev) for _ in range(world_size())]
    tdist.all_gather(parts, x.to(dev))
    return torch.cat(parts).to(x.device)


def shard(model: torch.nn.Module, compute_dtype: torch.dtype):
    """fully_shard per block, then the root (embedding, final norm, LM head). No-op in one
    process on CPU; on GPU even one process uses FSDP2's mixed precision (bf16 compute on fp32
    master weights), which is what keeps lr-1e-6 updates from rounding away."""
    if not is_dist() and not torch.cuda.is_available():
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if not is_dist():  # FSDP2 wants a process group even for one GPU
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        tdist.init_process_group("nccl", rank=0, world_size=1)
    for block in model.layers:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def _fsdp_modules(model):
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model: torch.nn.Module):
    """Hold the full weights for a stretch of forwards (sampling): one all-gather per module
    instead of one per decode step. Outside FSDP this does nothing."""
    mods = _fsdp_modules(model) if is_dist() else []
    for m in mods:
        m.unshard()
        m.set_reshard_after_forward(False)
    try:
        yield model
    finally:
        for m in mods:
            m.set_reshard_after_forward(True)
            m.reshard()
