"""The ways around the GPU-only parts of a run, for a GPU where one of them fails:
- `kernels="torch"` (`--kernels torch`): every grpo.kernels call takes its PyTorch reference;
- `cuda_graphs=False` (`--cuda_graphs false`): the sampler decodes without CUDA graphs.
Both give the same results, slower. `kernels_of(cfg)` enters the first for a block of work and,
when the block fails inside Triton or a CUDA graph capture, puts the setting to try on the
exception (train(), ProcessGRPO's filter and the eval command lines use it).
"""
import argparse
import contextlib
import importlib.util
import os
import sys
import traceback

from grpo.config import CHOICES
from grpo.kernels import HAS_TRITON, references


@contextlib.contextmanager
def kernels_of(cfg):
    """cfg.kernels as a context ("torch"; "auto" or None: the Triton kernels); see the module docstring."""
    try:
        with references() if cfg.kernels == "torch" else contextlib.nullcontext():
            yield
    except Exception as e:
        hint = way_around(e)
        if hint and hasattr(e, "add_note"):  # Python 3.11+
            e.add_note(hint)
        elif hint:
            print(hint, file=sys.stderr)
        raise


def way_around(e: BaseException) -> str | None:
    """The setting that avoids a failure inside Triton or a CUDA graph capture, from the files the
    traceback passes through (the exception's, and those of the exceptions it was raised from);
    None for any other failure, and never an error of its own."""
    try:
        files, seen = [], set()
        while e is not None and id(e) not in seen:
            seen.add(id(e))
            files += [os.path.normpath(f.filename) for f in traceback.extract_tb(e.__traceback__)]
            e = e.__cause__ or e.__context__
        triton = os.path.dirname(importlib.util.find_spec("triton").origin) if HAS_TRITON else None
        if triton and any(f.startswith(triton + os.sep) for f in files):
            return ("grpo: this failed inside Triton. --kernels torch runs grpo.kernels' PyTorch references "
                    "instead (slower, the same results); "
                    "please report it with your GPU, torch and triton versions")
        if any(f.endswith(os.path.join("torch", "cuda", "graphs.py")) for f in files):
            return ("grpo: this failed capturing a CUDA graph. "
                    "--cuda_graphs false decodes without graphs (slower)")
    except Exception:  # the hint must never hide the failure it is about
        pass
    return None


def add_arguments(p: argparse.ArgumentParser, flag, default_note: str = ""):
    """--kernels and --cuda_graphs on a command line (`flag`: its true/false parser). Unset, they
    are None: kernels_of takes None as "auto", and a sampler's cuda_graphs is `value is not False`."""
    p.add_argument("--kernels", choices=CHOICES["kernels"], default=None,
                   help="auto = grpo.kernels' Triton kernels on CUDA; torch = their PyTorch references "
                        "(slower; the way around a kernel that fails on your GPU); "
                        f"default auto{default_note}")
    p.add_argument("--cuda_graphs", type=flag, default=None, metavar="{true,false}",
                   help="GPU: decode windows as CUDA graphs; false = eager (slower); "
                        f"default true{default_note}")
