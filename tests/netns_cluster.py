"""What the multi-node tests share beside the harness itself (`telerag.benchmarks.ray_netns`): a
cluster that skips the test where none can run here, and reading a driver's findings."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from telerag.benchmarks.ray_netns import NetnsCluster, unavailable


def driver_findings(stdout: str, mark: str) -> dict:
    """What a driver run in a namespace found: the JSON of its last line starting with `mark`."""
    lines = [line for line in stdout.splitlines() if line.startswith(mark)]
    assert lines, f"the driver printed no {mark.strip()} line:\n{stdout[-4000:]}"
    found: dict = json.loads(lines[-1].removeprefix(mark))
    return found


@contextlib.contextmanager
def cluster_for_test(logs_to: Path, *, workers: int = 2, cpus: int = 1) -> Iterator[NetnsCluster]:
    """A test's cluster (`NetnsCluster`), or the test skipped where this machine cannot run one
    (`unavailable`); each node's Ray logs copied to `logs_to` if the test failed."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with NetnsCluster(workers=workers, cpus=cpus, logs_to=logs_to) as running:
        yield running
