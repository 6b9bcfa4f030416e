"""`python -m telerag.cli.ray_netns [--workers N]` (`scripts/ray_netns`): a Ray cluster of a head
and N workers on this machine, each node in a network namespace of its own
(`telerag.benchmarks.ray_netns`), held for manual runs until Ctrl-C; it prints how to reach each
node. Root (`ip netns`) and the `ray` extra."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys

from telerag.benchmarks.ray_netns import NetnsCluster, describe, unavailable


def main(argv: list[str] | None = None) -> int:
    """A cluster held until Ctrl-C, for manual runs: it prints how to reach each node."""
    parser = argparse.ArgumentParser(prog="python -m telerag.cli.ray_netns", description=main.__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=1, help="each node's (Ray's logical CPUs)")
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    for signum in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a shell's background job starts with it ignored
        signal.signal(signum, interrupted)
    with NetnsCluster(workers=args.workers, cpus=args.cpus) as cluster:
        print(describe(cluster))
        print(json.dumps(cluster.processes()))
        print("Ctrl-C takes it down.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    if cluster.killed:
        print(f"needed SIGKILL: {cluster.killed}")
    return 0


def interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
