"""`telerag bench retrieval`: the flags of `benchmarks.retrieval`'s `BenchConfig`, and its report."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from telerag.retrieval.codecs import Codec


def register(subparsers: argparse._SubParsersAction) -> None:
    # a flag left out keeps `BenchConfig`'s default, which `run` fills in: the benchmark (and
    # torch) load only when it runs, not whenever the command line is parsed
    parser = subparsers.add_parser(
        "retrieval",
        help="faiss CPU vs. prefetch + cooperative search vs. all-resident, and vs. exact early stop, on a synthetic "
        "datastore or the configured one (scaled up, or not)",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--vectors", type=int)
    parser.add_argument("--dim", type=int)
    parser.add_argument("--nlist", type=int, help="lists of the synthetic (default 1024) or scaled (4*sqrt(n)) datastore")
    parser.add_argument("--nprobe", type=int, help="default: 4*sqrt(nlist), the server's")
    parser.add_argument("--topk", type=int)
    parser.add_argument("--batch", type=int, help="queries per search call")
    parser.add_argument("--queries", type=int)
    parser.add_argument("--budget-mb", type=float, help="prefetch budget per batch")
    parser.add_argument("--cache-mb", type=float, help="device cluster cache (default: the budget)")
    parser.add_argument(
        "--demand-mb",
        type=float,
        help="extra cache for the demand-copy run (default 0: the same cache as the other runs)",
    )
    parser.add_argument("--overlap-noise", type=float, help="q_out = q_in + noise")
    parser.add_argument(
        "--distinct-queries",
        type=int,
        help="draw the --queries stream from this many distinct queries by a Zipf law, so popular ones repeat "
        "(default: no repeats)",
    )
    parser.add_argument("--codec", choices=[c.value for c in Codec])
    parser.add_argument("--device", help="auto, cpu or cuda")
    parser.add_argument("--cpu-threads", type=int, help="faiss threads of our CPU half (default: all cores, one fewer on CUDA)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--datastore-dir", type=Path, help="where synthetic datastores are kept")
    parser.add_argument(
        "--configured",
        action="store_true",
        help="the configured datastore (the embedded default's unless configured otherwise) instead of a synthetic one",
    )
    parser.add_argument(
        "--scale-vectors",
        type=int,
        help="the configured datastore scaled up in memory to this many vectors, as bench e2e scales it",
    )
    parser.add_argument("--replica-noise", type=float, help="of the scaled datastore: replica = normalise(v + noise*g/sqrt(dim))")
    parser.add_argument(
        "--profile-dir",
        type=Path,
        help="also write a torch profiler trace (gzipped Chrome JSON) and top-ops tables of a few searches of each phase here",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from telerag.benchmarks.retrieval import BenchConfig, config_dict, format_table
    from telerag.benchmarks.retrieval import run as run_bench

    given = vars(args)
    config = BenchConfig(**{f.name: given[f.name] for f in dataclasses.fields(BenchConfig) if f.name in given})
    result = run_bench(config, progress=not given.get("json", False))
    print(format_table(result))
    if given.get("json", False):
        print(json.dumps({**result, "config": config_dict(config)}))
    return 0
