"""`telerag bench cluster-cache`: the cluster cache's bookkeeping per acquisition (see
`benchmarks.cluster_cache`, whose `ClusterCacheConfig` holds the defaults)."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "cluster-cache", help="the cluster cache kept full: host time of each prefetch and demand acquisition, copies per cluster"
    )
    parser.add_argument("--nlist", type=int, help="lists (default 4096)")
    parser.add_argument("--mean-rows", type=int, help="mean rows of a list (default 976: 4M vectors in 4096)")
    parser.add_argument("--dim", type=int, help="default 2: small, as on the CPU copies run as they are issued")
    parser.add_argument("--cache-fraction", type=float, help="of the rows (default a fifth)")
    parser.add_argument("--prefetch", type=int, help="clusters each search prefetches (default 192)")
    parser.add_argument("--demand", type=int, help="clusters each search then copies on demand (default 31)")
    parser.add_argument("--searches", type=int, help="timed, after 20 that fill the cache (default 300)")
    parser.add_argument("--device", help="cpu (default) or cuda")
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from telerag.benchmarks.cluster_cache import ClusterCacheConfig, format_table, run_cluster_cache

    given = {
        key: value
        for key in ("nlist", "mean_rows", "dim", "cache_fraction", "prefetch", "demand", "searches", "device")
        if (value := getattr(args, key)) is not None
    }
    config = ClusterCacheConfig(**given)
    if min(config.nlist, config.mean_rows, config.dim, config.prefetch, config.searches) < 1 or config.demand < 0:
        raise SystemExit(
            "bench cluster-cache: --nlist, --mean-rows, --dim, --prefetch and --searches must be at least 1, --demand at least 0"
        )
    if config.prefetch + config.demand > config.nlist or not 0 < config.cache_fraction <= 1:
        raise SystemExit("bench cluster-cache: --prefetch + --demand must be at most --nlist, and --cache-fraction in (0, 1]")
    if config.device not in ("cpu", "cuda") or (config.device == "cuda" and not torch.cuda.is_available()):
        raise SystemExit(f"bench cluster-cache: --device {config.device}: cpu, or cuda where there is a CUDA device")
    report = run_cluster_cache(config)
    print(format_table(report))
    if args.json:
        print(json.dumps(report.to_dict()))
    return 0
