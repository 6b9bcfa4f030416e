"""`telerag bench cluster-cache`: the cluster cache's bookkeeping per acquisition (see `benchmarks.cluster_cache`)."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cluster-cache", help="the cluster cache kept full: host time of each prefetch and demand acquisition, copies per cluster"
    )
    parser.add_argument("--nlist", type=int, default=4096)
    parser.add_argument("--mean-rows", type=int, default=976, help="mean rows of a list (default: 4M vectors in 4096)")
    parser.add_argument("--dim", type=int, default=2, help="small on the CPU, where copies run as they are issued")
    parser.add_argument("--cache-fraction", type=float, default=0.2, help="of the rows (default a fifth)")
    parser.add_argument("--prefetch", type=int, default=192, help="clusters each search prefetches")
    parser.add_argument("--demand", type=int, default=31, help="clusters each search then copies on demand")
    parser.add_argument("--searches", type=int, default=300, help="timed, after 20 that fill the cache")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from telerag.benchmarks.cluster_cache import CacheBenchConfig, format_table, run_cache_bench

    if args.prefetch + args.demand > args.nlist or not 0 < args.cache_fraction <= 1:
        raise SystemExit("bench cluster-cache: --prefetch + --demand must be at most --nlist, and --cache-fraction in (0, 1]")
    report = run_cache_bench(
        CacheBenchConfig(
            nlist=args.nlist,
            mean_rows=args.mean_rows,
            dim=args.dim,
            cache_fraction=args.cache_fraction,
            prefetch=args.prefetch,
            demand=args.demand,
            searches=args.searches,
            device=args.device,
        )
    )
    print(format_table(report))
    if args.json:
        print(json.dumps(report.to_dict()))
    return 0
