"""`python -m grpo.cli.plan`: a recipe's memory plan on a GPU or a CPU, with no GPU, no weights, no network.

    python -m grpo.cli.plan recipes/calculator_qwen25_3b.py --gpus 8 --gpu "RTX 6000 Ada"
    python -m grpo.cli.plan recipes/retool_qwen3_4b.py --gpus 8 --gpu H200 --micro_batch_tokens 8704
    python -m grpo.cli.plan recipes/calculator_smollm2_cpu.py --cpu --memory_gb 8
    python -m grpo.cli.plan --table         # every GPU recipe on 1 and 8 of each GPU below
                                            # (docs/gpu.md's table)

--gpu names a GPU (its memory, and the sizes a run there would take from the plan where the recipe
and the flags leave them);
--memory_gb sets the memory instead; any other flag is the recipe's own. Prints the table of each
phase's terms, the peak against the card, and, where it does not fit, the changes that lower the peak,
each with its peak, and where none alone fits, the combinations that do.
"""
import argparse
import dataclasses
import importlib.util
import os
import sys

from grpo.config import Config
from grpo.fit.memory import GIB, GPU_MEMORY_GIB, fixes_text, memory_plan, model_config, size, what_fits
from grpo.flags import parse_args, required_fields
from grpo.models.model import ModelArgs


def recipe_module(path: str):
    """A recipe file as a module (its main() runs only as __main__): its Config subclass, and its
    memory_terms(cfg, args, world, device, memory) where it holds models of its own (ProcessGRPO)."""
    if not os.path.isfile(path):
        raise ValueError(f"no recipe file {path}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # recipes import their siblings
    spec = importlib.util.spec_from_file_location("grpo_plan_recipe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, Config)
             and v.__module__ == module.__name__]
    if len(found) != 1:
        raise ValueError(f"{path} defines {len(found)} Config subclasses, not one")
    return module, found[0]


def plan_for(recipe: str, gpus: int = 1, gpu: str | None = None, memory_gb: float | None = None,
             cpu: bool = False, flags: list[str] = ()):
    """(plan, model args, config) of a recipe on `gpus` ranks of a GPU (or a CPU), as its run would
    size it."""
    if gpus < 1:
        raise ValueError(f"--gpus {gpus}: at least 1")
    if gpu and gpu not in GPU_MEMORY_GIB:
        raise ValueError(f"unknown --gpu {gpu!r}: one of {', '.join(GPU_MEMORY_GIB)}")
    module, cls = recipe_module(recipe) if recipe.endswith(".py") else (None, Config)
    flags = list(flags)
    if not any(f == "--profile" or f.startswith("--profile=") for f in flags):
        flags += ["--profile", "cpu" if cpu else gpu or "none"]  # the sizes a run there would take
    given = {f.split("=")[0][2:] for f in flags if f.startswith("--")}
    # data paths
    flags += [f"--{name}=unread" for name in required_fields(cls) if name not in given | {"model_path"}]
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(gpus)  # recipes size their batches by it (prompts_per_step 0)
    try:
        cfg = parse_args(cls, flags)
    finally:
        if saved is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = saved
    path = cfg.model_path or "HuggingFaceTB/SmolLM2-135M-Instruct"  # the CPU default's packaged model
    args = ModelArgs.from_hf(model_config(path))
    device = "cpu" if cpu else "cuda"
    memory = memory_gb if memory_gb is not None else None if cpu else GPU_MEMORY_GIB.get(gpu, 80.0)
    total = int(memory * GIB) if memory else memory_plan(args, cfg, gpus, device).memory
    # a recipe's own models, as its run holds them: computed before the sizing, as the run does
    extra = module.memory_terms(cfg, args, gpus, device, total) if hasattr(module, "memory_terms") else []
    free = cfg.profile_applied["sized_by_plan"]
    if free and not cpu:  # as a run on that GPU sizes itself at start (grpo.fit.sizing.size_to_memory)
        cfg = dataclasses.replace(cfg, **size(args, cfg, gpus, device, memory, extra, free))
    return memory_plan(args, cfg, gpus, device, memory, extra), args, cfg, extra


GPU_RECIPES = ["calculator_qwen25_05b.py", "calculator_qwen25_3b.py", "gsm8k_qwen3_06b.py",
               "retool_qwen3_4b.py", "processgrpo_qwen25_05b.py", "gsm8k_qwen35_08b.py"]


def gpu_table(folder: str = "recipes") -> str:
    """docs/gpu.md's table: each GPU recipe's planned peak per rank on 1 / 8 of each GPU, sized as a run there
    sizes itself."""
    lines = ["| recipe | " + " | ".join(GPU_MEMORY_GIB) + " |", "|---|" + "---|" * len(GPU_MEMORY_GIB)]
    for recipe in GPU_RECIPES:
        cells = []
        for gpu in GPU_MEMORY_GIB:
            plans = [plan_for(os.path.join(folder, recipe), n, gpu)[0] for n in (1, 8)]
            cells.append(" / ".join(f"{p.peak[1] / GIB:.0f}{'' if p.fits else ' ✗'}" for p in plans))
        lines.append(f"| {recipe} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]):
    if argv == ["--table"]:  # every GPU recipe on every GPU: docs/gpu.md's table
        print(gpu_table())
        return
    ap = argparse.ArgumentParser(prog="python -m grpo.cli.plan", description=__doc__.split("\n")[0])
    ap.add_argument("recipe", help="a recipe file (recipes/*.py), or 'config' for Config's defaults")
    ap.add_argument("--gpus", type=int, default=1, help="ranks (one GPU each)")
    ap.add_argument("--gpu", default=None,
                    help=f"one of {', '.join(GPU_MEMORY_GIB)} (default: 80 GiB, Config's sizes)")
    ap.add_argument("--memory_gb", type=float, default=None,
                    help="memory per rank in GiB, instead of --gpu's")
    ap.add_argument("--cpu", action="store_true", help="a CPU run (memory: this machine's RAM / ranks)")
    known, flags = ap.parse_known_args(argv)
    profile = next((f.split("=", 1)[1] if "=" in f else flags[i + 1] if i + 1 < len(flags) else ""
                    for i, f in enumerate(flags) if f == "--profile" or f.startswith("--profile=")), None)
    if known.cpu and profile not in (None, "cpu"):  # a CPU run sizes nothing from the plan
        print(f"--profile {profile}: ignored on a CPU "
              "(a CPU run takes the recipe's sizes; --memory_gb sets the memory)")
        flags = [f for i, f in enumerate(flags) if not (f == "--profile" or f.startswith("--profile=")
                                                         or i > 0 and flags[i - 1] == "--profile")]
    try:
        plan, args, cfg, extra = plan_for(known.recipe, known.gpus, known.gpu, known.memory_gb, known.cpu,
                                          flags)
    except ValueError as e:
        raise SystemExit(f"python -m grpo.cli.plan: {e}") from None
    where = "CPU" if known.cpu else f"{known.gpus} x {known.gpu or 'GPU'}"
    print(f"{known.recipe} on {where}: {cfg.model_path or 'SmolLM2-135M'} "
          f"({args.n_layers} layers, hidden {args.dim}), "
          f"gen_batch {cfg.gen_batch}, kv_budget_gb {cfg.kv_budget_gb:g}, "
          f"micro_batch_tokens {cfg.micro_batch_tokens}, "
          f"gradient_checkpointing {cfg.gradient_checkpointing}, keep_kv_cache {cfg.keep_kv_cache}")
    print(plan.table())
    for note in plan.notes:
        print(note)
    if not plan.fits:
        print(fixes_text(what_fits(args, cfg, known.gpus, plan.device, plan.memory / GIB, extra)))


if __name__ == "__main__":
    main(sys.argv[1:])
