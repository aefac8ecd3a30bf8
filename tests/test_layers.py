"""The layers, read from the source (AST, imports inside functions included).

grpo/ is the GRPO story (its top-level files) and wings with one door each: engine/ (the sampler),
models/, fit/ (memory, time, CPU precision), infra/ (dist, checkpoints, metrics, data), measure/ (what
the benches share with their tests) and cli/ (the command lines). Arrows point down: config.py imports
no grpo module; models read only config and the kernels; the engine reads the models and the kernels,
never the story, fit or infra; infra reads the models; fit reads the engine, models and infra; the
story reads them all; measure and cli sit on top. The wings draw no circle. The core (grpo/ but its
command lines in grpo/cli/) never imports the envs or a command line and never runs a recipe file;
the kernels are a leaf that imports torch and triton only. A module's `if __name__ == "__main__":`
block is its own command line and may reach up to grpo.cli (but grpo/eval.py's does not: the eval's
command line is grpo/cli/eval.py alone). The tests and the benches share code only through the
package: no test imports or loads a bench script, and no bench imports a test module (a test may run a
bench script as a process)."""
import ast
import importlib.machinery
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = sorted(p for p in (ROOT / "grpo").rglob("*.py") if "cli" not in p.relative_to(ROOT / "grpo").parts)
STDLIB = {"math", "os", "sys", "functools", "typing", "dataclasses", "contextlib", "struct", "subprocess", "tempfile",
          "time", "pathlib", "unittest", "importlib"}
RUNS_A_FILE = {"spec_from_file_location", "exec_module", "run_path", "run_module", "exec", "execfile"}


def imports_and_calls(path: Path) -> tuple[set[str], set[str]]:
    """Modules imported and names called anywhere in the file, except under `if __name__ == "__main__":`."""
    tree = ast.parse(path.read_text())
    main_blocks = {id(n) for n in ast.walk(tree) if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)}
    modules, calls, stack = set(), set(), [tree]
    while stack:
        node = stack.pop()
        if id(node) in main_blocks:
            continue
        if isinstance(node, ast.Import):
            modules |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = "." * node.level + node.module  # relative: within its own package
            modules |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call):
            f = node.func
            calls.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
        stack.extend(ast.iter_child_nodes(node))
    return modules, calls


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(ROOT / "grpo")))
def test_the_core_never_imports_envs_or_command_lines_and_never_runs_a_recipe(path):
    modules, calls = imports_and_calls(path)
    upward = sorted(m for m in modules if m.startswith(("grpo.envs", "grpo.cli")) or m in ("envs", "recipes"))
    assert not upward, f"{path.name} imports {upward}"
    assert not calls & RUNS_A_FILE, f"{path.name} calls {sorted(calls & RUNS_A_FILE)}"


@pytest.mark.parametrize("path", sorted((ROOT / "kernels").glob("*.py")), ids=lambda p: p.name)
def test_kernels_are_a_leaf(path):
    modules, _ = imports_and_calls(path)
    allowed = ("torch", "triton", ".", "grpo.kernels")
    outside = sorted(m for m in modules if m.split(".")[0] not in STDLIB and not m.startswith(allowed))
    assert not outside, f"kernels/{path.name} imports {outside}"


def test_the_kernels_folder_never_shadows_pypis_kernels():
    """Python started in the checkout's root has the root first on sys.path, where kernels/ would be found
    as PyPI's `kernels` (which transformers imports when it is installed): `import kernels` there gets
    PyPI's package, or, with none installed, an error that says so; transformers imports either way."""
    code = ("import importlib.util, sys\n"
            "import transformers.integrations.hub_kernels\n"
            "try:\n    import kernels\n    print('file', kernels.__file__)\n"
            "except ModuleNotFoundError as e:\n    print('error', e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    kind, _, rest = r.stdout.strip().splitlines()[-1].partition(" ")
    outside = [p for p in sys.path if Path(p or ".").resolve() != ROOT]
    if importlib.machinery.PathFinder.find_spec("kernels", outside) is not None:  # PyPI's is installed
        assert kind == "file" and not Path(rest).resolve().is_relative_to(ROOT), r.stdout
    else:
        assert kind == "error" and "grpo.kernels" in rest, r.stdout


def test_the_check_sees_function_level_imports_and_skips_main_blocks(tmp_path):
    """The check itself: an import inside a function counts, one under the __main__ guard does not."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from grpo.envs import tasks\n    importlib.util.spec_from_file_location('x', 'r.py')\n"
                 "if __name__ == '__main__':\n    from grpo.cli.eval import main\n")
    modules, calls = imports_and_calls(f)
    assert "grpo.envs" in modules and "grpo.cli.eval" not in modules and "spec_from_file_location" in calls


def test_the_eval_library_never_imports_its_command_line():
    """grpo/eval.py is the library; `python -m grpo.eval` only says the command is grpo.cli.eval."""
    tree = ast.parse((ROOT / "grpo" / "eval.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not [m for m in imported if m.startswith("grpo.cli")], imported



# ----------------------------------------------------------------------------- the wings

WINGS = ("engine", "models", "fit", "infra", "measure", "cli", "kernels", "envs")
MAY_READ = {  # a wing -> the wings its modules may import (besides its own)
    "config": set(),
    "models": {"config", "kernels"},
    "engine": {"models", "kernels"},
    "infra": {"config", "models", "kernels"},
    "fit": {"config", "engine", "models", "infra", "kernels"},
    "story": {"config", "engine", "models", "infra", "fit", "kernels"},
    "measure": {"config", "engine", "models", "infra", "fit", "kernels", "story"},
    "cli": {"config", "engine", "models", "infra", "fit", "kernels", "story", "measure", "envs"},
}


def wing_of(module: str) -> str | None:
    """grpo.engine.sampler -> engine; grpo.config -> config; grpo.trainer, grpo -> story; outside: None."""
    parts = module.split(".")
    if parts[0] != "grpo":
        return None
    if len(parts) == 1 or parts[1] == "__init__":
        return "story"
    if parts[1] == "config":
        return "config"
    return parts[1] if parts[1] in WINGS else "story"


def module_of(path: Path, package: Path = ROOT / "grpo") -> str:
    parts = ("grpo", *path.relative_to(package).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def wing_arrows(paths) -> dict[tuple[str, str], list[str]]:
    """(from wing, to wing) -> the imports that draw that arrow."""
    arrows = {}
    for path in paths:
        source = module_of(path)
        for target in imports_and_calls(path)[0] - {"grpo"}:  # `from grpo import x` names grpo.x too
            a, b = wing_of(source), wing_of(target)
            if b is not None and a != b:
                arrows.setdefault((a, b), []).append(f"{source} -> {target}")
    return arrows


def module_arrows(paths, package: Path = ROOT / "grpo") -> dict[tuple[str, str], list[str]]:
    """(from module, to module) among the package's own files, function-level imports included; `grpo`
    itself (its __init__.py, a face that hands names on lazily) is left out, as in wing_arrows."""
    known = {module_of(p, package) for p in paths} - {"grpo"}
    arrows = {}
    for path in paths:
        source = module_of(path, package)
        for target in imports_and_calls(path)[0] & (known - {source}):
            arrows.setdefault((source, target), []).append(f"{source} -> {target}")
    return arrows


def circle(arrows) -> list[str]:
    """A circle among the arrows (wings' or modules'), or []."""
    graph = {}
    for a, b in arrows:
        graph.setdefault(a, set()).add(b)
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return []


ALL_GRPO = sorted((ROOT / "grpo").rglob("*.py"))


def test_the_story_is_the_top_level_and_the_rest_lives_in_wings():
    top = sorted(p.name for p in (ROOT / "grpo").glob("*.py"))
    assert len(top) <= 14, top
    assert {p.name for p in (ROOT / "grpo").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(WINGS) - {
        "kernels", "envs"}


def test_each_wing_reads_only_the_wings_below_it():
    bad = {arrow: found for arrow, found in wing_arrows(ALL_GRPO).items() if arrow[1] not in MAY_READ[arrow[0]]}
    assert not bad, bad


def test_config_imports_no_grpo_module():
    modules, _ = imports_and_calls(ROOT / "grpo" / "config.py")
    assert not [m for m in modules if m.startswith("grpo")], modules


def test_the_wings_draw_no_circle():
    assert circle(wing_arrows(ALL_GRPO)) == []


def test_the_modules_draw_no_circle():
    """Inside a wing too: no two files import each other, even from inside a function (a lazy import that
    hides a circle from Python still ties the two files together for a reader)."""
    assert circle(module_arrows(ALL_GRPO)) == []


def test_the_wing_checks_catch_an_arrow_up_and_a_circle(tmp_path):
    """The checks themselves, on files written here: an engine module that imports the trainer is an
    arrow up, and two wings that import each other are a circle."""
    engine = tmp_path / "grpo" / "engine"
    engine.mkdir(parents=True)
    (engine / "probe.py").write_text("def f():\n    from grpo.trainer import train\n")
    arrows = {("engine", wing_of(m)) for m in imports_and_calls(engine / "probe.py")[0] if wing_of(m)}
    assert ("engine", "story") in arrows and "story" not in MAY_READ["engine"]
    assert circle({("engine", "story"): [], ("story", "engine"): []}) in (["engine", "story", "engine"],
                                                                          ["story", "engine", "story"])
    assert circle({("story", "engine"): [], ("engine", "models"): []}) == []
    models = tmp_path / "grpo" / "models"  # two files of one wing, one import lazy: a module circle
    models.mkdir()
    (models / "model.py").write_text("def f():\n    from grpo.models.qwen35 import HybridBlock\n")
    (models / "qwen35.py").write_text("from grpo.models.model import MLP\n")
    arrows = module_arrows(sorted(models.glob("*.py")), tmp_path / "grpo")
    assert sorted(circle(arrows)) == ["grpo.models.model", "grpo.models.model", "grpo.models.qwen35"]

# ----------------------------------------------------------------------------- tests <-> bench

BENCH, TESTS = ROOT / "bench", ROOT / "tests"
LOADS = {"spec_from_file_location", "SourceFileLoader", "run_path", "run_module", "import_module", "__import__"}


def reaches(path: Path, folder: Path) -> list[str]:
    """How the file at `path` imports or loads code from `folder` (bench/ or tests/): an import of one
    of its modules, as `bench.x` or by a script's own name (`import gpu_check` works once the folder
    is on sys.path; names the file's own folder also has are its own), a sys.path entry into the
    folder, or a file or module loaded from it by importlib or runpy. A load's path is read from the
    strings in its arguments, followed through the file's assignments (SCRIPT = ROOT / "bench" / "x.py").
    Running a script as a process is none of these."""
    tree = ast.parse(path.read_text())
    foreign = {p.stem for p in folder.glob("*.py")} - {p.stem for p in path.parent.glob("*.py")} | {folder.name}
    assigned = {}  # name -> the expressions assigned to it, anywhere in the file
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    assigned.setdefault(target.id, []).append(node.value)

    memo = {}  # name -> its strings, once: a file that reassigns names (bench/gpu_check.py) made the walk exponential

    def strings(expr, seen=()) -> set[str]:
        out = set()
        for n in ast.walk(expr):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                out.add(n.value)
            elif isinstance(n, ast.Name) and n.id in assigned and n.id not in seen:
                if n.id not in memo:
                    memo[n.id] = set().union(*(strings(value, (*seen, n.id)) for value in assigned[n.id]))
                out |= memo[n.id]
        return out

    def into(text: str, by_name: bool) -> bool:  # a path into the folder, or (by_name) one of its modules
        return folder.name in text.replace("\\", "/").split("/") or by_name and text.split(".")[0] in foreign

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in foreign]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] in foreign:
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            on_path = isinstance(f, ast.Attribute) and ast.unparse(f.value) == "sys.path"
            by_name = name in ("import_module", "__import__", "run_module")
            if (name in LOADS or on_path) and any(into(t, by_name) for a in [*node.args, *node.keywords]
                                                  for t in strings(a)):
                found.append(f"line {node.lineno}: {ast.unparse(f)}(...) into {folder.name}/")
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(ast.unparse(t).startswith("sys.path") for t in targets) and any(into(t, False)
                                                                                   for t in strings(node.value)):
                found.append(f"line {node.lineno}: sys.path set into {folder.name}/")
    return found


@pytest.mark.parametrize("path", sorted(TESTS.glob("*.py")), ids=lambda p: p.name)
def test_no_test_imports_or_loads_a_bench_script(path):
    assert not reaches(path, BENCH), f"tests/{path.name} reaches into bench/: {reaches(path, BENCH)}"


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_no_bench_imports_a_test_module(path):
    assert not reaches(path, TESTS), f"bench/{path.name} reaches into tests/: {reaches(path, TESTS)}"


def test_the_tests_bench_check_catches_each_way_in(tmp_path):
    """The check itself, on files written here: each way a test could reach a bench script (and a bench a
    test module) is caught; running a script as a process, or loading a recipe, is not."""
    def check(text: str, folder: Path) -> list[str]:
        f = tmp_path / "probe.py"
        f.write_text(text)
        return reaches(f, folder)

    head = "import importlib.util, runpy, subprocess, sys\nfrom pathlib import Path\nROOT = Path(__file__).parents[1]\n"
    bad = {  # what test_gpu_check.py, test_compile.py and test_bench_rollout.py did before the helpers moved
        "sys.path + script name": 'sys.path.insert(0, str(ROOT / "bench"))\nimport gpu_check\n',
        "sys.path alone": 'sys.path.append(str(Path(__file__).parents[1] / "bench"))\n',
        "sys.path slice": 'sys.path[:0] = [str(ROOT / "bench")]\n',
        "spec through a name": 'SCRIPT = ROOT / "bench" / "rollout.py"\nOTHER = SCRIPT.with_name("step.py")\n'
                                'def load():\n    spec = importlib.util.spec_from_file_location("b", OTHER)\n',
        "runpy": 'runpy.run_path("bench/gpu_check.py")\n',
        "package import": "from bench.table import print_table\n",
        "script name in a function": "def f():\n    import compile_kernels\n",
        "import_module": 'importlib.import_module("decode_kernels")\n',
    }
    for what, text in bad.items():
        assert check(head + text, BENCH), what
    good = ('SCRIPT = ROOT / "bench" / "gpu_check.py"\n'
            'subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=SCRIPT.parent)\n'
            'spec = importlib.util.spec_from_file_location("sandbox", ROOT / "envs" / "sandbox.py")\n'
            'from grpo.measure import baseline\nfrom grpo.kernels.cases import sweep\nimport torch\n')
    assert check(head + good, BENCH) == []
    # a bench reaching into tests/: a test module by name, or the folder on sys.path
    assert check("from toy import ToyEnv\n", TESTS) and check(head + 'sys.path.insert(0, str(ROOT / "tests"))\n', TESTS)
    assert check(head + 'sys.path.insert(0, str(ROOT / "recipes"))\nimport table\n', TESTS) == []
