"""`--reward_funcs` names -> callables: `module:fn` (the current folder importable), `file.py:fn`
and paths, with one-line errors; and the names as a run records them (absolute paths), so that
`python -m grpo.cli.eval --run` finds them from any folder. A command-line concern: it imports the
user's files, which the library (grpo/rewards.py) never does.
"""
import importlib
import importlib.util
import os
import sys
from pathlib import Path


def import_functions(names: str, flag: str = "--reward_funcs") -> dict:
    """"mod:fn,pkg.mod:fn2,my_rewards.py:fn3,/abs/path/r.py:fn4" -> {fn: callable}; one-line errors.
    A module name is looked up with the current folder importable (as `python -c` would); a name
    ending in .py, or holding a path separator, is that file."""
    funcs = {}
    for name in filter(None, (n.strip() for n in names.split(","))):
        where, _, attr = name.rpartition(":")
        if not where or not attr:
            raise SystemExit(f"error: {flag} {name!r}: expected module:function or file.py:function")
        try:
            module = _load(where)
            fn = getattr(module, attr)
        except (ImportError, AttributeError, OSError, SyntaxError) as e:
            raise SystemExit(f"error: {flag} {name!r}: {type(e).__name__}: {e} "
                             "(expected module:function or file.py:function)") from None
        if not callable(fn):
            raise SystemExit(f"error: {flag} {name!r}: {attr} is not a function")
        funcs[attr] = fn
    if not funcs:
        raise SystemExit(f"error: {flag} names no function")
    return funcs


def portable_names(names: str) -> str:
    """--reward_funcs as a run records it: file paths made absolute, and modules found in the current
    folder named by their file, so that `python -m grpo.cli.eval --run` finds them from anywhere."""
    out = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        where, _, attr = name.rpartition(":")
        if where.endswith(".py") or os.sep in where:
            where = str(Path(where).expanduser().resolve())
        else:
            spec = importlib.util.find_spec(where.split(".")[0])
            origin = getattr(spec, "origin", None)
            if origin and "." not in where and Path(origin).parent == Path.cwd():
                where = str(Path(origin).resolve())
        out.append(f"{where}:{attr}")
    return ",".join(out)


def _load(where: str):
    if where.endswith(".py") or os.sep in where:
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ImportError(f"no such file {path}")
        sys.path.insert(0, str(path.parent))  # the file's own imports of its neighbours
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(path.stem, module)
        spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        # `python recipes/x.py` puts the recipe's folder first, not the current one
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(where)
