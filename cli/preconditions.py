"""What a command needs before it starts, refused in one line naming what to do."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def require_ray(command: str) -> None:
    """Ray Serve is an optional extra: `command` (e.g. "bench tier") says it needs it."""
    if importlib.util.find_spec("ray") is None:
        raise SystemExit(f"{command} needs Ray Serve: pip install 'telerag[ray]' (ray[serve] 2.60)")


def built_datastore(path: Path) -> Path:
    """`path`, a datastore already built (the commands that measure one never build it)."""
    if not (path / "manifest.json").is_file():
        raise SystemExit(f"no datastore at {path}: build it first (`telerag datastore build --wikipedia --out {path}`)")
    return path
