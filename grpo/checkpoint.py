"""Sharded checkpoints that resume exactly, and the Hugging Face export.

A checkpoint is a folder `step_000040/` written by torch.distributed.checkpoint (every rank
writes its shards of the model and optimizer), plus `meta.json` (step, scheduler, eval
results) and `rng_<rank>.pt`. It is written under `step_000040.tmp/` and renamed only when
complete, so a crash or SIGKILL mid-save leaves the previous checkpoint as the newest
complete one; partial folders are skipped with a message. The data position is a function
of the step (trainer.prompt_batch) and sampling is seeded per prompt, so step + weights +
optimizer + scheduler + RNG is the whole state.
"""
import json
import os
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from grpo import dist


class Checkpointer:
    def __init__(self, out_dir: str, keep_last: int = 2):
        self.root = Path(out_dir) / "checkpoints"
        self.keep_last = keep_last
        self.stop_requested = False
        signal.signal(signal.SIGTERM, self._on_sigterm)  # torchrun and schedulers send SIGTERM first

    def _on_sigterm(self, signum, frame):
        # only a flag: the trainer saves at the end of the current step, where the state is whole
        self.stop_requested = True

    def should_stop(self) -> bool:
        return dist.all_sum(float(self.stop_requested)) > 0  # every rank agrees, or saves would deadlock

    def save(self, step: int, model, optimizer, scheduler, results: dict | None = None):
        final = self.root / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
        torch.save(torch.get_rng_state(), tmp / f"rng_{dist.rank()}.pt")
        _barrier()
        if dist.is_main():
            meta = {"step": step, "scheduler": scheduler.state_dict(), "results": results or {}, "world_size": dist.world_size()}
            (tmp / "meta.json").write_text(json.dumps(meta))
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)  # the commit point
            for old in self.complete()[:-self.keep_last] if self.keep_last > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()
        return final

    def complete(self) -> list[Path]:
        """Complete checkpoint folders, oldest first (a .tmp folder is an interrupted save)."""
        if not self.root.exists():
            return []
        return sorted(p for p in self.root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))

    def load_latest(self, model, optimizer, scheduler) -> dict | None:
        """Restore the newest loadable checkpoint; None when there is none."""
        for tmp in self.root.glob("step_*.tmp") if self.root.exists() else []:
            dist.print0(f"checkpoint: skipping {tmp} (an interrupted save)")
        for path in reversed(self.complete()):
            meta_file = path / "meta.json"
            if not meta_file.exists() or not (path / ".metadata").exists():
                dist.print0(f"checkpoint: skipping {path} (incomplete: no meta.json or .metadata)")
                continue
            try:
                meta = json.loads(meta_file.read_text())
                model_sd, optim_sd = get_state_dict(model, optimizer)
                state = {"model": model_sd, "optimizer": optim_sd}
                dcp.load(state, checkpoint_id=str(path))
                set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
            except Exception as e:  # a corrupt folder: say so, fall back to an older one
                dist.print0(f"checkpoint: skipping {path} (unreadable: {type(e).__name__}: {e})")
                continue
            scheduler.load_state_dict(meta["scheduler"])
            rng = path / f"rng_{dist.rank()}.pt"
            if rng.exists():
                torch.set_rng_state(torch.load(rng))
            return {**meta, "path": str(path)}
        return None


def _barrier():
    if dist.is_dist():
        torch.distributed.barrier()


def export(model, path: str, dtype: torch.dtype | None = None):
    """Hugging Face folder (weights, config, tokenizer, chat template, generation_config) that
    transformers loads. Under FSDP the full state dict is gathered to rank 0's CPU first."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_main():
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        model.save_pretrained(path, state_dict=state)
    _barrier()
