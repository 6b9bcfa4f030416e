"""`telerag bench cluster`: one question stream with topic locality through the one-process server
and through the tiers on Ray Serve, per request router and batch (see `benchmarks.cluster`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from telerag.cli.preconditions import built_datastore, require_ray
from telerag.cli.runtime_flags import add_cluster_flags, add_runtime_flags, overrides
from telerag.config.settings import load_settings, packaged_config
from telerag.pipelines.questions import read_questions

ROUTERS = ("cluster", "default")  # benchmarks.cluster.ROUTERS, without importing it to parse flags


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cluster",
        help="a question stream with topic locality through the one-process server and the tiers on Ray, per router "
        "(deploys its own applications on the cluster)",
    )
    add_runtime_flags(parser)
    add_cluster_flags(parser, given_how="")
    parser.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="clients in flight (default 1 4)")
    parser.add_argument("--questions", type=Path, default=packaged_config("questions_wiki_en.txt"))
    parser.add_argument("--runs", type=int, default=12, help="articles in the stream, in a seeded order")
    parser.add_argument("--run-length", type=int, default=3, help="questions about one article in a row")
    parser.add_argument("--repeat-rate", type=float, default=0.2, help="share of requests re-asking an earlier question")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pipeline", default="naive")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--cache-mb", type=float, help="each replica's cluster cache (default: a quarter of the datastore)")
    parser.add_argument("--prefetch-budget-mb", type=float, help="every prefetch's budget (default: 1/32 of the datastore)")
    parser.add_argument("--tier-searches", type=int, default=30, help="searches per batch for remote_overhead")
    parser.add_argument(
        "--write-rate",
        type=float,
        default=0.0,
        help="documents a second written through the ingress beside each batch's stream run once more (on a copy of "
        "the datastore): acknowledgment and freshness; 0: none",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        help="run on a new Ray cluster of N nodes on this machine, each in a network namespace of its own (root: "
        "ip netns); default: the cluster at RAY_ADDRESS, or a local one",
    )
    parser.add_argument(
        "--node-cpus", type=int, help="each node's logical CPUs with --nodes (default: the least that holds every replica twice)"
    )
    parser.add_argument("--port", type=int, help="Serve's HTTP proxy (server.port); a running Serve's if joining one")
    parser.add_argument("--json", action="store_true", help='print one JSON line last: {"rows": [...], ...}')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require_ray("bench cluster")
    from telerag.benchmarks.cluster import ClusterBenchConfig, StreamShape, format_table, run_cluster_bench
    from telerag.benchmarks.cluster_on_nodes import node_cpus, run_on_nodes
    from telerag.benchmarks.ray_netns import unavailable
    from telerag.retrieval.datastore import Datastore

    if args.node_cpus is not None and (args.nodes is None or args.node_cpus < 1):
        raise SystemExit("bench cluster --node-cpus: at least 1, and only with --nodes")
    if args.nodes is not None and (args.nodes < 1 or (reason := unavailable())):
        raise SystemExit(f"bench cluster --nodes: {'at least 1' if args.nodes < 1 else reason}")
    settings = load_settings(args.config, overrides(args))
    datastore = built_datastore(settings.retrieval.datastore.expanduser())
    size_mb = Datastore.load(datastore, verify_checksums=False).vectors.nbytes / 2**20
    retrieval = settings.retrieval.model_copy(
        update={
            "cache_mb": args.cache_mb if args.cache_mb is not None else size_mb / 4,
            "prefetch_budget_mb": args.prefetch_budget_mb if args.prefetch_budget_mb is not None else size_mb / 32,
            "build_if_missing": False,
        }
    )
    server = settings.server.model_copy(update={"warm_up": False})  # a warm-up would fill the caches before the stream
    settings = settings.model_copy(update={"retrieval": retrieval, "server": server})
    config = ClusterBenchConfig(
        stream=StreamShape(runs=args.runs, run_length=args.run_length, repeat_rate=args.repeat_rate, seed=args.seed),
        routers=tuple(args.routers),
        batches=tuple(args.batch),
        pipeline=args.pipeline,
        max_tokens=args.max_tokens,
        tier_searches=args.tier_searches,
        write_rate=args.write_rate,
    )
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    log = logging.getLogger("telerag.bench.cluster").info
    if args.nodes is None:
        report = run_cluster_bench(settings, read_questions(args.questions), config, log=log)
    else:
        cpus = args.node_cpus or node_cpus(settings, args.nodes)
        report = run_on_nodes(settings, args.questions.resolve(), config, args.nodes, cpus, log=log)
    print(format_table(report))
    if args.json:
        print(json.dumps(asdict(report)))
    return 0
