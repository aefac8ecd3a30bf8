"""The line length: no line of grpo/, recipes/ or kernels/ over 110 characters (comments and docstrings
too: the field comments of grpo/config.py and of each recipe's class are --help's text, and grpo/flags.py
joins their continuation lines)."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINE = 110
FOLDERS = ("grpo", "recipes", "kernels")  # the package, the recipes a user forks, the Triton kernels


def long_lines(folder: Path, limit: int = MAX_LINE) -> list[str]:
    """'path:line (length)' of every line over `limit` characters in the .py files under `folder`."""
    return [f"{p.relative_to(folder.parent)}:{i} ({len(line)})" for p in sorted(folder.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > limit]


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_line_is_over_110_characters(folder):
    found = long_lines(ROOT / folder)
    assert not found, f"{len(found)} lines over {MAX_LINE} characters:\n" + "\n".join(found)


def test_the_check_names_each_long_line(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n" + "y = '" + "z" * 110 + "'\n")
    (tmp_path / "b.py").write_text("# " + "w" * 108 + "\n")   # exactly 110: allowed
    found = [f.split("/")[-1] for f in long_lines(tmp_path)]
    assert found == ["a.py:2 (116)"]
