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
A resume is safe as well as exact: the atomic rename, the fallback past unreadable folders, the
SIGTERM flag and a new world size each sit next to the save or load they protect.
"""
import contextlib
import json
import os
import random
import shutil
import signal
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from grpo.infra import dist

# What a checkpoint holds of the model: the trained parameters. Under LoRA that is the adapters (the
# frozen base is the run's model_path, loaded again on resume); otherwise every weight. Not strict on
# load: the frozen base is not in the file (DCP still fails on any trained key the file lacks)
TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)
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

    def close(self):
        signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)

    def save_step(self, step: int, model, optimizer, scheduler, results: dict, prompts_per_step: int,
                  seed: int) -> Path:
        """save() of a training run's step, with what a resume checks: the evals so far, and the data
        position, a function of (step, prompts_per_step, seed) (grpo.trainer.prompt_batch)."""
        data = {"next_prompt": step * prompts_per_step, "prompts_per_step": prompts_per_step, "seed": seed}
        return self.save(step, model, optimizer, scheduler, meta={"results": results, "data": data})

    @staticmethod
    def check_position(found: dict, prompts_per_step: int, seed: int):
        """A loaded checkpoint (load_latest's) against the run resuming it: save_step's data position is a
        function of prompts_per_step and seed, so a resume must keep them."""
        data = found.get("data", {})
        if data and (data["prompts_per_step"], data["seed"]) != (prompts_per_step, seed):
            raise ValueError(f"{found['path']} was written with {data}: the data position is a function of "
                             "prompts_per_step and seed, so keep them (or use a new output_dir)")

    def save(self, step: int, model, optimizer, scheduler, meta: dict | None = None) -> Path:
        """Every rank calls this. `meta`: JSON-able extras (data position, eval results)."""
        final = self.root / f"step_{step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier interrupted save
            tmp.mkdir(parents=True)
        dist.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED)
        with one_process_quiet():
            # DCP fsyncs its files
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
        torch.save(_rng_state(), tmp / f"rng_{dist.rank()}.pt")
        _fsync(tmp / f"rng_{dist.rank()}.pt")
        dist.barrier()  # every rank's files are on disk
        if os.environ.get(HANG_ENV) == str(step):
            time.sleep(3600)
        if dist.is_main():
            info = {"step": step, "world_size": dist.world_size(), "scheduler": scheduler.state_dict(),
                    **(meta or {})}
            (tmp / "meta.json").write_text(json.dumps(info))
            _fsync(tmp / "meta.json")
            _fsync(tmp)  # its entries
            if final.exists():
                _remove(final)
            os.rename(tmp, final)  # the commit point: atomic on one filesystem
            _fsync(self.root)  # the rename itself: after a power loss, the newest checkpoint is still there
            for old in self.complete()[:-self.keep_last] if self.keep_last > 0 else []:
                _remove(old)  # only now: what replaces them is durable
        dist.barrier()
        return final

    def complete(self) -> list[Path]:
        """Committed checkpoint folders `step_NNNNNN`, oldest first (not `.tmp` or `.old`)."""
        if not self.root.exists():
            return []
        return sorted(p for p in self.root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())

    def candidates(self) -> list[tuple[Path, bool]]:
        """(committed folder, incomplete: no meta.json or .metadata), newest first; says what it skips."""
        for tmp in sorted(self.root.glob("step_*.tmp")) if self.root.exists() else []:
            print(f"checkpoint: skipping {tmp} (an interrupted save: it was never committed)", flush=True)
        out = []
        for path in reversed(self.complete()):
            missing = [f for f in ("meta.json", ".metadata") if not (path / f).exists()]
            if missing:
                print(f"checkpoint: skipping {path} (incomplete: no {' or '.join(missing)})", flush=True)
            out.append((path, bool(missing)))
        return out

    def load_latest(self, model, optimizer, scheduler) -> dict | None:
        """Restore the newest loadable checkpoint into model, optimizer, scheduler and the RNGs;
        returns its meta.json plus "path", or None when there is no checkpoint at all. Rank 0 lists
        the folder and every rank follows its list: ranks that see the folder differently (a
        network filesystem's cache) would otherwise resume different steps without an error."""
        tried = []
        for path, incomplete in dist.on_rank0(self.candidates):
            tried.append(path.name)
            if incomplete:
                continue
            error = None
            try:
                meta = json.loads((path / "meta.json").read_text())
                model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED)
                state = {"model": model_sd, "optimizer": optim_sd}
                with one_process_quiet():
                    dcp.load(state, checkpoint_id=str(path))  # errors reach every rank (DCP gathers them)
                set_state_dict(model, optimizer, model_state_dict=state["model"],
                               optim_state_dict=state["optimizer"], options=TRAINED)
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


# ----------------------------------------------------------------------------- the run folder

# a folder holding one of these holds a run (config.json alone: a run that failed before its first
# log line, e.g. on a wrong model_path; it is overwritten)
RUN_FILES = ("metrics.jsonl", "checkpoints")
# what a resumed run must share with the run it continues: the weights it started from (the base and,
# under LoRA, the adapters' shape and first values), and what decides its data order and groups (a
# recipe's data fields too, where it has them)
LORA_FIELDS = ("use_peft", "lora_r", "lora_alpha", "lora_target_modules", "use_rslora", "adapter_path")
SAME_RUN_FIELDS = ("model_path", "seed", "prompts_per_step", "num_generations",
                   "train_data", "question_field", "answer_field") + LORA_FIELDS


def refuse_used_dir(out_dir: str) -> None:
    """A fresh run never writes into another run's folder (also called by recipes that write
    there before train(), e.g. a filtered data set)."""
    used = [name for name in RUN_FILES if (Path(out_dir) / name).exists()]
    if used:
        raise FileExistsError(f"{out_dir} holds another run ({', '.join(used)}): use --resume to continue "
                              "it, or another --output_dir")


def open_run_dir(out_dir: str, config: dict, resume: bool, meta: dict) -> None:
    """Rank 0, before any model loads. A fresh run refuses a folder that holds another run (its
    checkpoints would be pruned and later resumed, its metrics appended to); --resume refuses a
    folder whose recorded config differs in SAME_RUN_FIELDS. Then config.json records this run:
    every config field, plus "_meta" (profile, versions, git commit); config_history.jsonl gets one
    line per start (the first run's settings, then each --resume's), so a resume loses nothing."""
    out = Path(out_dir)
    record = out / "config.json"
    if not resume:
        refuse_used_dir(out_dir)
    elif record.exists():
        recorded = read_json(record)
        lora = recorded.get("use_peft") or config.get("use_peft")  # the LoRA fields matter only under LoRA
        differ = [f"{k}: {recorded[k]!r} there, {config[k]!r} now" for k in SAME_RUN_FIELDS
                  if k in recorded and k in config and recorded[k] != config[k]
                  and (lora or k not in LORA_FIELDS)]
        if differ:
            raise ValueError(f"--resume: {record} was written by another run ({'; '.join(differ)}); "
                             "resume with its settings, or use another --output_dir")
    out.mkdir(parents=True, exist_ok=True)
    history = out / "config_history.jsonl"
    if resume and record.exists() and not history.exists():  # a run from before the history: keep its record
        history.write_text(json.dumps(read_json(record)) + "\n")
    # a fresh run: what a never-started one left is overwritten
    with open(history, "a" if resume else "w") as f:
        f.write(json.dumps({**config, "_meta": meta}) + "\n")
    record.write_text(json.dumps({**config, "_meta": meta}, indent=2) + "\n")


@contextlib.contextmanager
def one_process_quiet():
    """DCP warns on every save and load without torch.distributed ("assuming the intent is to save in
    a single process"): that is the intent of a one-process run, so not a warning worth a line each."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore",
                                message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def note_run(out_dir: str, meta: dict) -> None:
    """Rank 0: add what the run decided at start (e.g. the precision `auto` chose) to config.json's
    "_meta", so that `python -m grpo.cli.eval --run` evaluates as the run did."""
    record = Path(out_dir) / "config.json"
    config = read_json(record)
    config["_meta"] = {**config.get("_meta", {}), **meta}
    record.write_text(json.dumps(config, indent=2) + "\n")


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None


def run_meta(profile: dict) -> dict:
    """What config.json records beside the fields: the profile, the code's version and commit."""
    import importlib.metadata
    import subprocess
    try:
        version = importlib.metadata.version("grpo")
    except importlib.metadata.PackageNotFoundError:
        version = None
    root = Path(__file__).resolve().parents[2]  # the clone (grpo/infra/ up two), for an editable install
    commit = dirty = None
    try:
        def git(*args) -> str:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        if git("rev-parse", "--show-toplevel") == str(root):  # not some repository site-packages sits in
            commit = git("rev-parse", "HEAD") or None
            dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        pass
    import __main__
    main = getattr(__main__, "__file__", None)   # the recipe file a run was launched from
    recipe = os.path.abspath(main) if main and main.endswith(".py") else None
    return {"profile": profile, "recipe": recipe, "grpo_version": version, "git_commit": commit,
            "git_dirty": dirty, "torch_version": torch.__version__,
            "world_size": dist.world_size(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


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


def _fsync(path: Path):
    """Flush a file, or a folder's entries, to the disk (a crash after a commit must find it whole)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path):
    """Rename, then delete: a folder half-deleted by a crash no longer looks like a checkpoint."""
    gone = path.with_name(path.name + ".old")
    shutil.rmtree(gone, ignore_errors=True)
    os.rename(path, gone)
    shutil.rmtree(gone, ignore_errors=True)


def export(model, path: str, dtype: torch.dtype | None = None, adapter_dir: str | None = None,
           base_model: str = ""):
    """Hugging Face folder (weights, config, tokenizer, chat template, generation_config) that
    transformers loads, LoRA adapters merged in; with `adapter_dir`, the adapters also as a PEFT
    folder (over `base_model`). Every rank calls it: under FSDP the full state dict is gathered to
    rank 0's CPU (the other ranks get an empty dict), and rank 0 writes."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_main():
        if adapter_dir is not None:
            from grpo.models.lora import save_adapter
            save_adapter(adapter_dir, state, model.lora, base_model)
        model.save_pretrained(path, state_dict=state, dtype=dtype)
    dist.barrier()
