"""`telerag bench retrieval`: the flags of `benchmarks.retrieval`'s `BenchConfig`, and its report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from telerag.benchmarks.retrieval import BenchConfig, config_dict, format_table, run as run_bench
from telerag.retrieval.codecs import Codec


def register(subparsers: argparse._SubParsersAction) -> None:
    defaults = BenchConfig()
    parser = subparsers.add_parser(
        "retrieval",
        help="faiss CPU vs. prefetch + cooperative search vs. all-resident, on a synthetic datastore",
    )
    parser.add_argument("--vectors", type=int, default=defaults.vectors)
    parser.add_argument("--dim", type=int, default=defaults.dim)
    parser.add_argument("--nlist", type=int, default=defaults.nlist)
    parser.add_argument("--nprobe", type=int, default=defaults.nprobe)
    parser.add_argument("--topk", type=int, default=defaults.topk)
    parser.add_argument("--batch", type=int, default=defaults.batch, help="queries per search call")
    parser.add_argument("--queries", type=int, default=defaults.queries)
    parser.add_argument("--budget-mb", type=float, default=defaults.budget_mb, help="prefetch budget per batch")
    parser.add_argument("--cache-mb", type=float, default=None, help="device cluster cache (default: the budget)")
    parser.add_argument(
        "--demand-mb",
        type=float,
        default=defaults.demand_mb,
        help="extra cache for the demand-copy run (default 0: the same cache as the other runs)",
    )
    parser.add_argument("--overlap-noise", type=float, default=defaults.overlap_noise, help="q_out = q_in + noise")
    parser.add_argument(
        "--distinct-queries",
        type=int,
        default=None,
        help="draw the --queries stream from this many distinct queries by a Zipf law, so popular ones repeat (default: no repeats)",
    )
    parser.add_argument("--codec", choices=[c.value for c in Codec], default=defaults.codec)
    parser.add_argument("--device", default=defaults.device, help="auto, cpu or cuda")
    parser.add_argument(
        "--cpu-threads", type=int, default=None, help="faiss threads of our CPU half (default: all cores, one fewer on CUDA)"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--datastore-dir", type=Path, default=defaults.datastore_dir, help="where synthetic datastores are kept")
    parser.add_argument(
        "--profile-dir",
        type=Path,
        default=None,
        help="also write a torch profiler trace (gzipped Chrome JSON) and top-ops tables of a few searches of each phase here",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = BenchConfig(
        vectors=args.vectors,
        dim=args.dim,
        nlist=args.nlist,
        nprobe=args.nprobe,
        topk=args.topk,
        batch=args.batch,
        queries=args.queries,
        budget_mb=args.budget_mb,
        cache_mb=args.cache_mb,
        demand_mb=args.demand_mb,
        overlap_noise=args.overlap_noise,
        distinct_queries=args.distinct_queries,
        codec=args.codec,
        device=args.device,
        cpu_threads=args.cpu_threads,
        seed=args.seed,
        datastore_dir=args.datastore_dir,
        profile_dir=args.profile_dir,
    )
    result = run_bench(config, progress=not args.json)
    print(format_table(result))
    if args.json:
        print(json.dumps({**result, "config": config_dict(config)}))
    return 0
