"""Sharded checkpoints that resume exactly, and the Hugging Face export.

A checkpoint is a folder `step_000040/` written by torch.distributed.checkpoint (every rank
writes its shards of the model and optimizer; `.metadata` is written last by rank 0), plus
`rng_<rank>.pt` (each rank's generators) and `meta.json` (step, data position, scheduler, eval
results). It is written as `step_000040.tmp/` and renamed only when complete, so a crash or
SIGKILL mid-save leaves the previous checkpoint as the newest complete one; unfinished or
unreadable folders are skipped with a message. The data position is a function of the step
(trainer.prompt_batch) and sampling is seeded per prompt, so step + weights + optimizer +
scheduler + RNG is the whole state. Every rank must see the same `out_dir` (multi-node: a
shared filesystem).
Past STYLE.md's ~100 lines because a resume must be safe as well as exact (the atomic rename,
the fallback past unreadable folders, the SIGTERM flag, a new world size), and each of those
only makes sense next to the save or load it protects.
"""
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from grpo import dist

# Test hook (tests/test_dist.py): the save of this step sleeps between the shard write and
# the commit (rename), so a test can SIGKILL a save in flight. Unset in real runs.
HANG_ENV = "GRPO_TEST_HANG_SAVE_AT_STEP"


class Checkpointer:
    def __init__(self, out_dir: str, keep_last: int = 2):
        self.root = Path(out_dir) / "checkpoints"
        self.keep_last = keep_last
        self.stop_requested = False
        # torchrun and schedulers (SLURM, Kubernetes) send SIGTERM before SIGKILL; restored by close()
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        # only a flag: the trainer saves at the end of the current step, where the state is whole
        self.stop_requested = True

    def should_stop(self) -> bool:
        return dist.all_sum(float(self.stop_requested)) > 0  # every rank agrees, or saves would deadlock

    def close(self):
        signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)

    def save(self, step: int, model, optimizer, scheduler, meta: dict | None = None) -> Path:
        """Every rank calls this. `meta`: JSON-able extras (data position, eval results)."""
        final = self.root / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier interrupted save
            tmp.mkdir(parents=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
        torch.save(_rng_state(), tmp / f"rng_{dist.rank()}.pt")
        dist.barrier()  # every rank's files are on disk
        if os.environ.get(HANG_ENV) == str(step):
            time.sleep(3600)
        if dist.is_main():
            info = {"step": step, "world_size": dist.world_size(), "scheduler": scheduler.state_dict(),
                    **(meta or {})}
            (tmp / "meta.json").write_text(json.dumps(info))
            if final.exists():
                _remove(final)
            os.rename(tmp, final)  # the commit point: atomic on one filesystem
            for old in self.complete()[:-self.keep_last] if self.keep_last > 0 else []:
                _remove(old)
        dist.barrier()
        return final

    def complete(self) -> list[Path]:
        """Committed checkpoint folders `step_NNNNNN`, oldest first (not `.tmp` or `.old`)."""
        if not self.root.exists():
            return []
        return sorted(p for p in self.root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())

    def load_latest(self, model, optimizer, scheduler) -> dict | None:
        """Restore the newest loadable checkpoint into model, optimizer, scheduler and the RNGs;
        returns its meta.json plus "path", or None when there is no checkpoint at all."""
        for tmp in sorted(self.root.glob("step_*.tmp")) if self.root.exists() else []:
            dist.print0(f"checkpoint: skipping {tmp} (an interrupted save: it was never committed)")
        tried = []
        for path in reversed(self.complete()):
            tried.append(path.name)
            missing = [f for f in ("meta.json", ".metadata") if not (path / f).exists()]
            if missing:  # same shared folder on every rank: all skip together
                dist.print0(f"checkpoint: skipping {path} (incomplete: no {' or '.join(missing)})")
                continue
            error = None
            try:
                meta = json.loads((path / "meta.json").read_text())
                model_sd, optim_sd = get_state_dict(model, optimizer)
                state = {"model": model_sd, "optimizer": optim_sd}
                dcp.load(state, checkpoint_id=str(path))  # errors reach every rank (DCP gathers them)
                set_state_dict(model, optimizer, model_state_dict=state["model"],
                               optim_state_dict=state["optimizer"])
                scheduler.load_state_dict(meta["scheduler"])
                rng_file = path / f"rng_{dist.rank()}.pt"  # absent for new ranks after a change of world size
                rng = torch.load(rng_file, weights_only=False) if rng_file.exists() else None
            except (Exception, CheckpointException) as e:
                # a corrupt folder: say so, fall back to an older one
                error = _describe(e)
            if dist.all_sum(float(error is not None)) > 0:
                dist.print0(f"checkpoint: skipping {path} (unreadable: {error or 'failed on another rank'})")
                continue
            if rng is not None:
                _set_rng_state(rng)
            if meta.get("world_size") != dist.world_size():
                dist.print0(f"checkpoint: {path} was written by {meta.get('world_size')} ranks, "
                            f"resuming on {dist.world_size()} "
                            "(weights and optimizer reshard; sampling is seeded per prompt)")
            return {**meta, "path": str(path)}
        if tried:  # a failed load may have written part of the weights: never train from that
            raise RuntimeError(f"no loadable checkpoint in {self.root} (tried {', '.join(tried)}); "
                               "move the folder away to start from scratch")
        return None


def _describe(e: BaseException) -> str:
    """One line: DCP wraps each rank's error in a CheckpointException (a BaseException); name the first."""
    if isinstance(e, CheckpointException) and e.failures:
        rank, (e, _) = next(iter(e.failures.items()))
        return f"rank {rank}: {_describe(e)}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] + ('...' if len(text[0]) > 200 else '') if text else ''}"


def _rng_state() -> dict:
    # the trainer draws from torch's generators only (eval's unseeded sampling); python's is cheap to add
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _remove(path: Path):
    """Rename, then delete: a folder half-deleted by a crash no longer looks like a checkpoint."""
    gone = path.with_name(path.name + ".old")
    shutil.rmtree(gone, ignore_errors=True)
    os.rename(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def export(model, path: str, dtype: torch.dtype | None = None):
    """Hugging Face folder (weights, config, tokenizer, chat template, generation_config) that
    transformers loads. Every rank calls it: under FSDP the full state dict is gathered to rank
    0's CPU (the other ranks get an empty dict), and rank 0 writes."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_main():
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        model.save_pretrained(path, state_dict=state)
    dist.barrier()
