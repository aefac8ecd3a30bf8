"""A run against its machine's memory, at setup (grpo.trainer.start_run), before any weight loads and
before anything is written: `fit_to_machine` sizes on a GPU what the profile left to the memory plan
(grpo/fit/memory.py) and checks the run against the device. A run that cannot fit is refused with one
line and the plan's table (`DoesNotFit`), which a command line prints as just that (`run_command`).
`cuda_allocator` sets the CUDA caching allocator up before the first CUDA allocation."""
import os

import torch

from grpo.config import Config
from grpo.fit.memory import (GIB, GPU_MEMORY_GIB, Plan, fixes_text, memory_of_cpu, memory_plan, model_config,
                             size, what_fits)
from grpo.infra import dist
from grpo.models.model import ModelArgs, _local_or_hub

ALLOC_CONF = "expandable_segments:True"


class DoesNotFit(ValueError):
    """The memory plan's refusal: `line`, the verdict in one line, and `table`, the plan's terms with what
    would fit. A ValueError whose first line is the verdict (what a failing rank posts to the others)."""

    def __init__(self, line: str, table: str):
        super().__init__(f"{line}\n{table}")
        self.line, self.table = line, table


def model_folder(model_path: str) -> str:
    """The local checkpoint folder (a hub id is fetched once), checked before the tokenizer loads."""
    path = _local_or_hub(model_path)
    if not (path / "config.json").is_file():
        what = "no config.json: not a Hugging Face checkpoint folder" if path.is_dir() else "no such folder"
        raise FileNotFoundError(f"model_path {model_path}: {what}")
    return str(path)


def cuda_allocator(cuda: bool, environ=os.environ) -> str | None:
    """A CUDA run's allocator grows its segments in place (expandable_segments): the rollouts' KV cache and
    the update's activations take turns in one memory, and fixed-size segments strand what one phase
    freed in blocks the other cannot use. Set before the first CUDA allocation (the allocator reads it
    once); a user's own PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) is kept. -> the value set, or None."""
    if not cuda or "PYTORCH_CUDA_ALLOC_CONF" in environ or "PYTORCH_ALLOC_CONF" in environ:
        return None
    environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    return ALLOC_CONF


def fit_to_machine(cfg: Config, device: torch.device, extra: list = ()) -> Plan:
    """The sizes left to the plan (a GPU), then the run checked against the device: the plan's line, or
    DoesNotFit. `extra`: the (term, bytes, formula) a recipe's own models hold (ProcessGRPO's). ->
    the plan."""
    size_to_memory(cfg, device, extra)
    return check_memory(cfg, model_folder(cfg.model_path), device, extra)


def plan_run(cfg: Config, args: ModelArgs, device: torch.device, extra: list = ()) -> Plan:
    """The memory plan of this run on this device: a GPU's memory, or on a CPU this node's RAM shared by
    its ranks."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cuda = device.type == "cuda"
    memory = torch.cuda.get_device_properties(device).total_memory if cuda else memory_of_cpu(local)
    return memory_plan(args, cfg, dist.world_size(), device.type, memory / GIB, extra)


def size_to_memory(cfg: Config, device: torch.device, extra: list = ()) -> dict:
    """On a GPU, before anything loads: the fields the profile left to the plan (cfg.profile_applied's
    sized_by_plan: what the recipe, its YAML and its command line did not set) sized by the memory plan
    for this GPU's memory, or for the GPU the profile names (grpo.fit.memory.size says how). Rank 0
    decides for every rank. On a CPU nothing is sized, and a GPU's profile is said to be ignored.
    -> the values set."""
    profile = getattr(cfg, "profile_applied", {})
    free = profile.get("sized_by_plan", [])
    if device.type != "cuda":
        if profile.get("name") in GPU_MEMORY_GIB:  # as `python -m grpo.cli.plan --cpu` says it
            dist.print0(f"--profile {profile['name']}: ignored on a CPU (a CPU run takes the recipe's sizes)")
        if free:
            profile["sized_by_plan"] = []
            cfg.check()  # the checks the sizing would have answered (a micro-batch that holds a sequence)
        return {}
    if not free:
        return {}
    args = ModelArgs.from_hf(model_config(model_folder(cfg.model_path)))
    props = torch.cuda.get_device_properties(device)
    name = profile["name"] if profile["name"] in GPU_MEMORY_GIB else props.name
    memory = GPU_MEMORY_GIB.get(profile["name"], props.total_memory / GIB)
    world = dist.world_size()
    chosen = dist.broadcast(size(args, cfg, world, "cuda", memory, extra, free) if dist.is_main() else None)
    for key, value in chosen.items():
        setattr(cfg, key, value)
    sizes = ", ".join(f"{k} {v}" for k, v in chosen.items())
    dist.print0(f"memory plan for {name} ({memory:.0f} GiB): {sizes}")
    return chosen


def check_memory(cfg: Config, path: str, device: torch.device, extra: list = ()) -> Plan:
    """The memory plan's one line; where its peak exceeds the device, DoesNotFit instead: that line, the
    plan's table and what would fit. cfg.plan_memory false: the line only. -> the plan."""
    args = ModelArgs.from_hf(model_config(path))
    plan = plan_run(cfg, args, device, extra)
    if plan.fits or not cfg.plan_memory:
        dist.print0(plan.summary())
        return plan
    fixes = fixes_text(what_fits(args, cfg, plan.world, device.type, plan.memory / GIB, extra))
    raise DoesNotFit(f"{plan.summary()}: refused (--plan_memory false starts anyway)",
                     f"{plan.table()}\n{fixes}")


def run_command(main, *args):
    """A command line's main(*args) (a recipe's `__main__`): a run the memory plan refuses ends with its
    line and table on stderr (rank 0's) and exit status 1, not a traceback. Called as a library, main
    raises DoesNotFit as it is."""
    try:
        return main(*args)
    except DoesNotFit as e:
        raise SystemExit(f"{e.line}\n{e.table}" if dist.rank() == 0 else 1) from None
