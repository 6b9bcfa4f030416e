"""`telerag bench server`: HTTP and scheduling overhead against the same pipeline in-process (see
`benchmarks.server_overhead`)."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("server", help="HTTP + scheduling overhead vs in-process, tiny LM")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--articles", type=int, default=200, help="Wikipedia articles in the throwaway datastore")
    parser.add_argument("--pipeline", default="naive")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--batch-window-ms", type=float, help="the scheduler's batching window (default: the config's)")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from telerag.benchmarks.report import key_value_table
    from telerag.benchmarks.server_overhead import ServerOverheadConfig, run_server_overhead

    result = run_server_overhead(
        ServerOverheadConfig(
            requests=args.requests,
            articles=args.articles,
            pipeline=args.pipeline,
            max_tokens=args.max_tokens,
            batch_window_ms=args.batch_window_ms,
            progress=not args.json,
        )
    )
    print(key_value_table(result))
    if args.json:
        print(json.dumps(result))
    return 0
