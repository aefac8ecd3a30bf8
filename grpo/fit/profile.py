"""The profile: what a run's hardware sets before the recipe's own choices (Config defaults < profile <
the recipe's defaults < YAML < command line), and on a GPU which fields the memory plan sizes at start."""
import inspect

from grpo.config import Config
from grpo.fit.memory import GPU_MEMORY_GIB, SIZED


def apply_profile(cfg: Config, name: str = "auto", given=()) -> dict:
    """Resolve the profile once, under what the recipe chose: Config defaults < profile < the recipe's own
    defaults < YAML < command line (`given`: the fields those two set). On a GPU ("auto", or a GPU's name
    in grpo.fit.memory.GPU_MEMORY_GIB) it names the fields the memory plan sizes at start
    (grpo.fit.sizing.size_to_memory): of grpo.fit.memory.SIZED, those nobody set; a field the recipe
    declares is its choice, even at Config's default. On a CPU it sets dtype float32. "none": Config's
    own values. cfg.profile_applied records it (config.json: a Config built in Python records that none
    was applied).
    -> the settings applied now."""
    if name not in ("auto", "none", "cpu", *GPU_MEMORY_GIB):
        raise ValueError(f"unknown profile {name!r}: auto, none, cpu or a GPU ({', '.join(GPU_MEMORY_GIB)})")
    cpu = name == "cpu" or name == "auto" and not _cuda()
    settings = {"dtype": "float32"} if cpu else {}
    base = Config()
    declared = {k for c in type(cfg).__mro__[:type(cfg).__mro__.index(Config)]
                for k in inspect.get_annotations(c)}
    own = {k for k in (*settings, *SIZED) if k in declared or getattr(cfg, k) != getattr(base, k)}
    applied = {k: v for k, v in settings.items() if k not in own and k not in given}
    for key, value in applied.items():
        setattr(cfg, key, value)
    sized = [] if cpu or name == "none" else [k for k in SIZED if k not in own and k not in given]
    cfg.profile_applied = {"name": name, "resolved": "cpu" if cpu else name, "settings": applied,
                           "sized_by_plan": sized,
                           "kept_from_the_recipe": {k: getattr(cfg, k) for k in sorted(own)}}
    return applied


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


