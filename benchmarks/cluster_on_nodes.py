"""`telerag bench cluster --nodes N`: the bench on a Ray cluster of N nodes on this machine, each
node in a network namespace of its own (`benchmarks.ray_netns`; root, for `ip netns`), the
datastore on the filesystem they all read (it stands for the shared volume). Every call between
the tiers then crosses a network link, as between machines, though the nodes share the cores.

The bench itself runs as the cluster's driver inside the head's namespace (`python -m
telerag.benchmarks.cluster_on_nodes`, given its settings and configuration as JSON), where the
Serve proxy it asks listens; its log passes through, and its report comes back as one line."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from telerag.benchmarks.cluster import ClusterBenchConfig, ClusterReport, ClusterRow, ClusterWriteRow, StreamShape
from telerag.config.settings import Settings

MARK = "BENCH_CLUSTER_REPORT "


def node_cpus(settings: Settings, nodes: int) -> int:
    """Each node's logical CPUs: the least that holds every replica the settings ask for twice
    over, as each run's redeploy starts the new replicas before the old ones stop."""
    from telerag.server.ray_serve.applications import cpus_wanted

    return max(1, math.ceil(2 * cpus_wanted(settings) / nodes))


def run_on_nodes(
    settings: Settings,
    questions: Path,
    config: ClusterBenchConfig,
    nodes: int,
    cpus: int,
    *,
    log: Callable[[str], None] = print,
) -> ClusterReport:
    """A new cluster of `nodes` nodes of `cpus` CPUs each, the bench run on it as its driver, and
    the cluster taken down whatever happened; NetnsError if the driver failed."""
    from telerag.benchmarks.ray_netns import NetnsCluster, NetnsError, describe

    job = {"settings": settings.model_dump(mode="json"), "questions": str(questions), "config": asdict(config)}
    log(f"bringing up {nodes} Ray nodes of {cpus} CPUs, each in a network namespace")
    with NetnsCluster(workers=nodes - 1, cpus=cpus) as cluster:
        log(describe(cluster))
        done = cluster.driver(["-m", "telerag.benchmarks.cluster_on_nodes", json.dumps(job)])
        lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
        if done.returncode != 0 or not lines:
            raise NetnsError(f"the bench's driver in {cluster.head.namespace} ended with exit status {done.returncode}")
    return report_of(json.loads(lines[-1].removeprefix(MARK)))


def config_of(fields: dict[str, Any]) -> ClusterBenchConfig:
    return ClusterBenchConfig(
        **{
            **fields,
            "stream": StreamShape(**fields["stream"]),
            "routers": tuple(fields["routers"]),
            "batches": tuple(fields["batches"]),
        }
    )


def report_of(fields: dict[str, Any]) -> ClusterReport:
    rows = [ClusterRow(**row) for row in fields["rows"]]
    writes = [ClusterWriteRow(**write) for write in fields["writes"]]
    return ClusterReport(**{**fields, "rows": rows, "writes": writes})


def main(argv: list[str]) -> int:
    """The driver's part: the bench, connected to the cluster at RAY_ADDRESS."""
    import logging

    from telerag.benchmarks.cluster import run_cluster_bench
    from telerag.pipelines.questions import read_questions

    job = json.loads(argv[0])
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    settings = Settings.model_validate(job["settings"])
    log = logging.getLogger("telerag.bench.cluster").info
    report = run_cluster_bench(settings, read_questions(Path(job["questions"])), config_of(job["config"]), log=log)
    sys.stdout.write(MARK + json.dumps(asdict(report)) + "\n")  # the report, to the process that started the driver
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
