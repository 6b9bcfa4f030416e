"""`telerag bench tier`: the retrieval tier on Ray against faiss in process, same lists (see
`benchmarks.tier`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from telerag.cli.preconditions import built_datastore, require_ray
from telerag.config.settings import load_settings


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("tier", help="the retrieval tier's shards on Ray vs faiss in process, the same lists")
    parser.add_argument("--datastore", type=Path, help="default: the configured one (the built-in Wikipedia datastore)")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="queries per search")
    parser.add_argument("--searches", type=int, default=50, help="measured per shards and batch, after 5 unmeasured")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--nprobe", type=int, help="default: the server's for the datastore")
    parser.add_argument("--cpus-per-replica", type=float, default=1.0)
    parser.add_argument(
        "--faiss-threads", type=int, help="faiss's threads here (default: every core, as the one-process server); 1 on a busy box"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require_ray("bench tier")
    from telerag.benchmarks.tier import TierBenchConfig, format_table, run_tier_bench  # brings torch and Ray

    datastore = built_datastore(args.datastore or load_settings(None, {}).retrieval.datastore)
    config = TierBenchConfig(
        datastore=datastore,
        shards=tuple(args.shards),
        batches=tuple(args.batch),
        searches=args.searches,
        k=args.k,
        nprobe=args.nprobe,
        cpus_per_replica=args.cpus_per_replica,
        faiss_threads=args.faiss_threads,
    )
    report = run_tier_bench(config, progress=not args.json)
    print(format_table(report))
    if args.json:
        print(json.dumps(asdict(report)))
    return 0
