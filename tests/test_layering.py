"""The import rules the package depends on: everything under the `telerag` namespace (an
installed wheel has no top-level `server` or `retrieval`), and one-way layering
cli -> benchmarks -> server -> file_search -> pipelines -> documents -> engines -> config ->
retrieval -> utils: the command line on top, calling into the server and the benchmarks; OpenAI's
file search over the pipelines' retriever contract; the pipelines over the two services they
drive, the LLM engines (which know nothing of RAG: their contract and errors are their own) and
retrieval, and over the documents written into a datastore; the settings of every layer above
the retrieval types they name; shared utilities at the bottom, knowing nothing above them. No
layer reaches up, not even with an import inside a function."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = [
    "utils",
    "retrieval",
    "config",
    "engines",
    "documents",
    "pipelines",
    "file_search",
    "server",
    "benchmarks",
    "cli",
]  # each may import only those before it
SOURCES = [path for layer in LAYERS for path in sorted((ROOT / layer).rglob("*.py"))]
BENCH_COMMANDS = sorted((ROOT / "cli").glob("bench_*.py"))


def imported_modules(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", SOURCES + sorted((ROOT / "tests").glob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_use_the_telerag_namespace(path):
    bare = [name for name in imported_modules(path) if name.split(".")[0] in LAYERS]
    assert not bare, f"import these as telerag.<name>: {bare}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_layers_import_one_way(path):
    layer = path.relative_to(ROOT).parts[0]
    above = LAYERS[LAYERS.index(layer) + 1 :]
    upward = [name for name in imported_modules(path) if name.split(".")[:2] in (["telerag", up] for up in above)]
    assert not upward, f"{layer} must not import {upward}"


def test_the_layers_are_the_installed_packages():
    """Every top-level package the wheel installs (pyproject's package-dir) has its place in the
    order, so a new package cannot slip past these rules."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    assert set(package_dirs.values()) == set(LAYERS)


def test_every_bench_command_calls_into_benchmarks():
    """The `telerag bench` commands parse flags and print; what they measure lives in benchmarks/."""
    assert BENCH_COMMANDS
    for path in BENCH_COMMANDS:
        assert any(name.startswith("telerag.benchmarks.") for name in imported_modules(path)), path.name


def test_the_command_line_and_the_app_load_without_torch():
    """`telerag serve` listens before it imports torch (seconds; more with CUDA), and
    `telerag --help` answers without it: the command line and the app import no torch,
    transformers or sentence-transformers until a command runs."""
    heavy = ("torch", "transformers", "sentence_transformers")
    code = f"import sys, telerag.cli.main, telerag.server.app; print(','.join(name for name in {heavy!r} if name in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert loaded.stdout.strip() == ""
