"""`telerag bench soak`: hold N users against a running server for a while and report answers,
429s, failures (apart), the latency of answers and the server's memory (see `benchmarks.soak`)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("soak", help="N users for a duration against a running server; 429s and failures apart")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--pipeline", default="naive", help="a pipeline, several comma-separated (taken in turn), or all")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before an unanswered request counts as a failure")
    parser.add_argument(
        "--ramp-seconds", type=float, help="users start evenly spread over this long (default 10; 0: all at once)"
    )
    parser.add_argument("--api-key")
    parser.add_argument("--pid", type=int, help="the server's pid, to read its memory from /proc (default: its /metrics)")
    parser.add_argument("--questions", type=Path, help="one question a line (default: the packaged Wikipedia questions)")
    parser.add_argument("--json", action="store_true", help="also print the report as one JSON line")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from telerag.benchmarks.soak import SoakConfig, format_table, soak
    from telerag.config.settings import packaged_config
    from telerag.pipelines.questions import read_questions
    from telerag.pipelines.registry import pipeline_names

    questions = [q.text for q in read_questions(args.questions or packaged_config("questions_wiki_en.txt"))]
    config = SoakConfig(
        url=args.url,
        users=args.users,
        duration_s=args.seconds,
        pipelines=pipeline_names(args.pipeline),
        max_tokens=args.max_tokens,
        api_key=args.api_key,
        pid=args.pid,
        timeout_s=args.timeout,
        **({} if args.ramp_seconds is None else {"ramp_s": args.ramp_seconds}),
    )
    report = asyncio.run(soak(config, questions))
    print(format_table(report))
    if args.json:
        print(json.dumps(report.to_dict()))
    return 0
