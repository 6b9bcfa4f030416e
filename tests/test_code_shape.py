"""The size rules of the code style: a source module of at most 400 lines and a function of at
most 80, unless the code says why at its top. A module over the limit says so in its docstring
with a sentence containing "long because" (what keeps it one module); a function over the
limit says in its docstring that "the order of steps is the point" (a sequence read top to
bottom, which splitting would scatter)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80
MODULE_REASON = "long because"
FUNCTION_REASON = "the order of steps is the point"


def source_files() -> list[Path]:
    """Every module of the installed packages (their folders from pyproject.toml), data aside."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    folders = sorted({ROOT / folder.split("/")[0] for folder in package_dirs.values()} - {ROOT / "config"})
    return [path for folder in folders for path in sorted(folder.rglob("*.py"))]


def says(docstring: str | None, reason: str) -> bool:
    return reason in " ".join((docstring or "").lower().split())  # wrapped over lines or not


def oversized(source: str) -> list[str]:
    """What in this module's `source` is over a limit without saying why."""
    tree = ast.parse(source)
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES and not says(ast.get_docstring(tree), MODULE_REASON):
        found.append(f"{lines} lines, and its docstring does not say it is {MODULE_REASON!r}")
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            if length > MAX_FUNCTION_LINES and not says(ast.get_docstring(node), FUNCTION_REASON):
                found.append(f"{node.name} (line {node.lineno}) is {length} lines")
    return found


@pytest.mark.parametrize("path", [pytest.param(path, id=path.relative_to(ROOT).as_posix()) for path in source_files()])
def test_modules_and_functions_are_short_or_say_why(path: Path):
    found = oversized(path.read_text(encoding="utf-8"))
    assert not found, f"{path.relative_to(ROOT)}: " + "; ".join(found)


def test_the_rules_read_the_reasons():
    assert {"retrieval", "pipelines", "server", "benchmarks"} <= {path.relative_to(ROOT).parts[0] for path in source_files()}
    body = "    x = 1\n" * MAX_FUNCTION_LINES
    assert oversized(f"def f():\n{body}") == [f"f (line 1) is {MAX_FUNCTION_LINES + 1} lines"]
    assert not oversized(f'def f():\n    """Parse, check, write: the order of\n    steps is the point."""\n{body}')
    module = "x = 1\n" * MAX_MODULE_LINES
    assert len(oversized(f'"""A module."""\n{module}')) == 1
    assert not oversized(f'"""A module, long because its table is one thing."""\n{module}')
