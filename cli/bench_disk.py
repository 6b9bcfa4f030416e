"""`telerag bench disk`: the flags of `benchmarks.disk`'s `DiskBenchConfig`, and its report."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    # a flag left out keeps `DiskBenchConfig`'s default: the benchmark (and torch) load only when it runs
    parser = subparsers.add_parser(
        "disk",
        help="a datastore searched from disk (cold, with and without lookahead) against faiss's OnDiskInvertedLists and "
        "against every list in memory, on a synthetic datastore",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--vectors", type=int)
    parser.add_argument("--dim", type=int)
    parser.add_argument("--nlist", type=int, help="default: 4*sqrt(vectors)")
    parser.add_argument("--nprobe", type=int, help="default: 4*sqrt(nlist), the server's")
    parser.add_argument("--topk", type=int)
    parser.add_argument("--batches", type=int, nargs="+", help="queries per search call, each in turn (default: 1 8)")
    parser.add_argument("--queries", type=int)
    parser.add_argument("--host-cache-mb", type=float, help="our host cache (default 256)")
    parser.add_argument("--device", help="cuda: ours through a host tier into a device cache (default cpu)")
    parser.add_argument("--cache-mb", type=float, help="on a device, its cache (default: --host-cache-mb)")
    parser.add_argument("--llm-ms", type=float, help="the pre-retrieval call the lookahead reads during (default 1000)")
    parser.add_argument("--overlap-noise", type=float, help="q_out = q_in + noise")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--datastore-dir", type=Path, help="where synthetic datastores (and faiss's on-disk files) are kept")
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from telerag.benchmarks.disk import DiskBenchConfig, format_table
    from telerag.benchmarks.disk import run as run_bench

    given = vars(args)
    if "batches" in given:
        given["batches"] = tuple(given["batches"])
    config = DiskBenchConfig(**{f.name: given[f.name] for f in dataclasses.fields(DiskBenchConfig) if f.name in given})
    result = run_bench(config, progress=not given.get("json", False))
    print(format_table(result))
    if given.get("json", False):
        config_fields = {
            key: str(value) if isinstance(value, Path) else value for key, value in dataclasses.asdict(config).items()
        }
        print(json.dumps({**result, "config": config_fields}))
    return 0
