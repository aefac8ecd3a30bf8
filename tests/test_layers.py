"""The layers, read from the source (AST, imports inside functions included): the core (grpo/,
but its command lines in grpo/cli/) never imports the envs or a command line and never runs a
recipe file; the kernels are a leaf that imports torch and triton only. A module's
`if __name__ == "__main__":` block is its own command line and may reach up to grpo.cli."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = sorted(p for p in (ROOT / "grpo").glob("*.py"))
STDLIB = {"math", "os", "functools", "typing", "dataclasses", "contextlib", "struct", "subprocess", "tempfile", "time",
          "pathlib", "unittest"}
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


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
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


def test_the_check_sees_function_level_imports_and_skips_main_blocks(tmp_path):
    """The check itself: an import inside a function counts, one under the __main__ guard does not."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from grpo.envs import tasks\n    importlib.util.spec_from_file_location('x', 'r.py')\n"
                 "if __name__ == '__main__':\n    from grpo.cli.eval import main\n")
    modules, calls = imports_and_calls(f)
    assert "grpo.envs" in modules and "grpo.cli.eval" not in modules and "spec_from_file_location" in calls
