"""The docs name what the code has: every command of the `telerag` command line in the README's
command-line section, every benchmark in docs/benchmarks.md's table of benchmark commands, every
layer in docs/design.md's request path. A command or layer added without a word in the docs
fails here."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from telerag.cli.main import build_parser
from tests.test_layering import LAYERS

ROOT = Path(__file__).resolve().parents[1]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's subcommands by name (none for a command without)."""
    for action in parser._actions:  # argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def readme_command_lines() -> list[str]:
    """The `telerag ...` lines of the README's command-line block."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return [
        line
        for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
        for line in block.splitlines()
        if line.startswith("telerag ")
    ]


def test_the_readme_names_every_command_and_its_actions():
    lines = readme_command_lines()
    for name, command in subcommands(build_parser()).items():
        mine = [line for line in lines if line.split()[1] == name]
        assert mine, f"the README's command line section lacks `telerag {name}`"
        named = {word for line in mine for part in line.split()[2:3] for word in part.split("|")}
        for action in subcommands(command):
            assert action in named, f"the README's command line section lacks `telerag {name} {action}`"


def test_the_benchmark_page_lists_every_benchmark_command():
    table = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").split("## The benchmark commands", 1)[1]
    listed = set(re.findall(r"^\| `telerag bench ([\w-]+)`", table, flags=re.M))
    assert set(subcommands(subcommands(build_parser())["bench"])) == listed


def test_the_design_names_every_layer():
    """docs/design.md's request path names each layer of the one-way order (`test_layering.LAYERS`)."""
    request_path = (
        (ROOT / "docs" / "design.md").read_text(encoding="utf-8").split("## The request path", 1)[1].split("\n## ", 1)[0]
    )
    assert [layer for layer in LAYERS if f"`{layer}`" not in request_path] == []
