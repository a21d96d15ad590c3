"""The tree's own rules: test modules share code only through
``tests/support``, and no source file grows past what one reads in a sitting."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("cli", "engine", "lookup", "training", "tests")
# The most lines a Python file of the tree may hold.
MOST_LINES = 500


def python_files() -> list[Path]:
    return sorted(p for top in SOURCES for p in (ROOT / top).rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_test_module_imports_another_test_module() -> None:
    offenders = {}
    for path in (ROOT / "tests").rglob("*.py"):
        others = {
            name
            for name in imported_modules(path)
            if name.startswith("tests.") and not name.startswith("tests.support")
        }
        if others:
            offenders[str(path.relative_to(ROOT))] = sorted(others)
    assert offenders == {}, "move what they share into tests/support"


def test_no_python_file_is_over_the_line_limit() -> None:
    files = python_files()
    assert len(files) > 100, "the tree was not found"
    long = {
        str(p.relative_to(ROOT)): n
        for p in files
        if (n := len(p.read_text().splitlines())) > MOST_LINES
    }
    assert long == {}
