"""Process groups from the torchrun environment, and FSDP2 applied from outside the model.

One process (plain `python recipe.py`) is world size 1 and nothing here does any work on CPU.
Under `torchrun`, gloo on CPU and NCCL on GPU; `shard` applies `fully_shard` to every
transformer block and then to the root, with bf16 compute and fp32 parameters, gradient
reduction and optimizer state on GPU (with lr 1e-6, updates to bf16 weights would round away).
Multi-node is plain torchrun, the same line on every node, with `output_dir` on a filesystem
that every node sees:
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-id=calc3b \
             --rdzv-endpoint=node0:29500 --shutdown-timeout=300 \
             recipes/calculator_qwen25_3b.py --model_path=/shared/models/Qwen2.5-3B-Instruct \
             --output_dir=/shared/runs/calc3b --resume
On SIGTERM torchrun passes the signal to the ranks, which save at the end of the current step;
it SIGKILLs them after --shutdown-timeout seconds (default 30), so give it a step and a save.
Ranks always agree: a decision that reads a clock or a folder is rank 0's, broadcast
(`on_rank0`, `broadcast`); an exception on one rank ends every rank with that rank's message
(`fail_together`), not a hang until the collective timeout.
Also here: the collectives that make losses and logged means global, `gathered` for sampling,
and the failure watch. Every process-group primitive the trainer uses is in this one file.
"""
import atexit
import contextlib
import datetime
import functools
import os
import re
import sys
import threading

import torch
import torch.distributed as tdist

# fully_shard(reshard_after_forward=None) (the root keeps its weights for backward, pytorch PR
# 155319) and FSDPModule.set_reshard_after_forward (PR 149103) first shipped in torch 2.8
MIN_TORCH = "2.8"
if tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < (2, 8):
    raise ImportError(f"grpo needs torch >= {MIN_TORCH} (FSDP2's fully_shard(reshard_after_forward=None) and "
                      f"set_reshard_after_forward); this is torch {torch.__version__}: "
                      f"pip install -U 'torch>={MIN_TORCH}'")


def init(timeout_min: float = 60.0):
    """The process group from torchrun's environment. `timeout_min`: how long a collective may wait
    for the slowest rank (one rank's 16k-token rollout while the others wait) before it fails."""
    if "RANK" in os.environ and not tdist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_min)
        if torch.cuda.is_available():
            dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(dev)
            # device_id: eager NCCL init, no guessing
            tdist.init_process_group("nccl", device_id=dev, timeout=timeout)
        else:
            tdist.init_process_group("gloo", timeout=timeout)
        _watch_failures()


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


def barrier():
    if is_dist():
        tdist.barrier()


def all_sum(x: float | torch.Tensor) -> float | torch.Tensor:
    """Sum a number, or a tensor of numbers in one collective, over ranks (loss normalizers and
    logged means must be global). fp64: counts stay exact, and with gloo the sum of two ranks
    does not depend on the order (bitwise-reproducible metrics)."""
    if not is_dist():
        return x
    t = torch.as_tensor(x, dtype=torch.float64).to(device())
    tdist.all_reduce(t)
    return t.item() if not isinstance(x, torch.Tensor) else t.to(x.device, x.dtype)


def all_max(x: int) -> int:
    """The largest of an integer over ranks (e.g. the micro-batch count every rank must run)."""
    if not is_dist():
        return x
    t = torch.tensor(x, dtype=torch.int64, device=device())
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return int(t.item())


def all_max_floats(values: list[float]) -> list[float]:
    """Element-wise max over ranks, in one collective (e.g. a stop flag and the elapsed time)."""
    if not is_dist():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device())
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t.tolist()


def broadcast(obj):
    """Rank 0's Python object on every rank: for decisions that must not differ between ranks."""
    if not is_dist():
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def on_rank0(fn, *args):
    """fn(*args) run by rank 0 only (it reads or writes the shared output folder); every rank
    returns its result, or raises its error."""
    result = error = None
    if is_main():
        try:
            result = fn(*args)
        except Exception as e:
            error = e
    result, error = broadcast((result, error)) if is_dist() else (result, error)
    if error is not None:
        raise error
    return result


def all_gather_objects(items: list) -> list:
    """Concatenate Python lists (e.g. eval records) from every rank, in rank order."""
    if not is_dist():
        return items
    parts = [None] * world_size()
    tdist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


def all_gather_cat(x: torch.Tensor) -> torch.Tensor:
    """Concatenate tensors of equal shape from every rank along dim 0, in rank order."""
    if not is_dist():
        return x
    dev = device()
    parts = [torch.empty_like(x, device=dev) for _ in range(world_size())]
    tdist.all_gather(parts, x.to(dev))
    return torch.cat(parts).to(x.device)


def shard(model: torch.nn.Module, compute_dtype: torch.dtype):
    """fully_shard per block, then the root (embedding, final norm, LM head: a tied LM head is
    the embedding, one parameter in the root's group). No-op in one process on CPU; on GPU even
    one process uses FSDP2's mixed precision (bf16 compute on fp32 master weights), which is
    what keeps lr-1e-6 updates from rounding away. The optimizer, built on model.parameters()
    after this, holds fp32 state shards."""
    if not is_dist() and not torch.cuda.is_available():
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if not is_dist():  # FSDP2 wants a process group even for one GPU; an in-memory store needs no port
        tdist.init_process_group("nccl", store=tdist.HashStore(), rank=0, world_size=1, device_id=device())
    # blocks take their inputs as given: x is already bf16 (the root's embedding runs in param_dtype)
    # and the rope tables stay fp32. Casting block inputs made activation checkpointing fail on
    # torch 2.11 (H200): FSDP2 skips its pre-forward hook in the backward's recompute, so the
    # recomputed block saw fp32 tables where the forward had seen bf16 ones
    block_mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)
    for block in model.layers:
        fully_shard(block, mp_policy=block_mp)
    # the root keeps its weights after forward for the backward that follows (FSDP's default);
    # a frozen model (the KL reference) has no backward, so it frees them at once
    frozen = not any(p.requires_grad for p in model.parameters())
    fully_shard(model, mp_policy=mp, reshard_after_forward=True if frozen else None)
    return model


def _fsdp_modules(model):
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model: torch.nn.Module):
    """Hold the full weights for a stretch of forwards (sampling, eval): one all-gather per
    module instead of one per module per decode step. Inside, the modules' parameters are the
    unsharded tensors (compute dtype), so `next(model.parameters())` gives the sampler the
    dtype it will see. Outside FSDP this does nothing."""
    mods = _fsdp_modules(model)
    for m in mods:  # same module order on every rank: the all-gathers pair up
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield model
    finally:
        for m in mods:
            # FSDP's own defaults: blocks free their full weights after forward; the root keeps
            # them, since backward needs the LM head and embedding at once (setting True here
            # would cost an extra all-gather of the largest layer every micro-batch)
            m.set_reshard_after_forward(m is not model, recurse=False)
            m.reshard()


# ----------------------------------------------------------------------------- failing together
# The first rank to fail writes its message to torchrun's key-value store. A rank whose collective
# then fails (the peer's connection closed) raises that message instead of its own; a rank that
# would wait out the collective timeout (NCCL, another node, a long rollout) is ended by a watcher
# thread that polls the store. Without this, a failure on one node leaves the others hanging for
# `dist_timeout_min`, and the message that explains it is on another machine.
FAILURE_GRACE_S = 5.0  # the watcher gives the main thread this long to raise the message itself
_store = None
_handled = threading.Event()  # the main thread is raising a failure (its own, or another rank's)
_done = threading.Event()     # the process is exiting: the watcher stops polling


def _failure_store():
    global _store
    if _store is None:
        client = tdist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=datetime.timedelta(seconds=60))
        # a torchrun restart reuses the store: a failure of an earlier attempt must not end this one
        attempt = [os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")]
        _store = tdist.PrefixStore("grpo/" + "/".join(attempt), client)
    return _store


def _watch_failures():
    def watch():
        while not _done.is_set():
            try:
                store = _failure_store()
                message = store.get("failed").decode() if store.check(["failed"]) else None
            except Exception:  # the store is gone: torchrun is ending the job
                return
            if message is not None:
                if message.startswith(f"rank {rank()}:") or _handled.wait(FAILURE_GRACE_S):
                    return
                print(f"[rank{rank()}]: stopping, {message}", file=sys.stderr, flush=True)
                os._exit(1)  # the main thread is stuck, e.g. in a collective that would wait out the timeout
            _done.wait(2.0)
    _failure_store()  # connect from the main thread, at start: a bad address fails here, not later
    thread = threading.Thread(target=watch, name="grpo-failure-watch", daemon=True)
    thread.start()

    def stop():
        # a daemon thread still inside a store call when the interpreter finalizes aborts the
        # process ("terminate called without an active exception", seen at a clean exit in CI)
        global _store
        _done.set()
        thread.join(timeout=10)
        _store = None  # the store client goes while the interpreter is whole, from the main thread
        # and so does the process group: left to the interpreter's teardown, its C++ threads were once
        # destroyed still running (the same abort, rank 1 of a 2-rank CPU run after its last line)
        if tdist.is_initialized():
            tdist.destroy_process_group()
    atexit.register(stop)


def fail_together(fn):
    """Decorator: an exception in fn on one rank ends every rank with that rank's message."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            if not is_dist() or isinstance(e, SystemExit) and not e.code:
                raise
            _handled.set()
            error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            # e.g. grpo.fit.fallback's
            error += "".join(f" ({n.strip()[:300]})" for n in getattr(e, "__notes__", []))
            try:  # the first one posted wins
                first = _failure_store().compare_set("failed", "", f"rank {rank()}: {error}").decode()
            except Exception:
                first = f"rank {rank()}: {error}"
            if first.split(": ", 1)[1] != error:  # this rank failed because another did: say which, and why
                raise RuntimeError(f"stopping, {first}") from e
            raise
    return wrapper
