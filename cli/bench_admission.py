"""`telerag bench admission`: the same load against the server under each admission policy
(`deadline`, `none`, `fixed` N swept), scored by goodput (see `benchmarks.admission`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from telerag.pipelines.registry import pipeline_names


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "admission", help="goodput under each admission policy (deadline, none, fixed N), a server of its own each"
    )
    parser.add_argument(
        "--modes", nargs="+", choices=["deadline", "deadline-kept", "none", "fixed"], default=["deadline", "none", "fixed"]
    )
    parser.add_argument(
        "--fixed", type=int, nargs="+", default=[2, 4, 8, 16], help="the N of the fixed policy (default 2 4 8 16)"
    )
    parser.add_argument(
        "--margins",
        type=float,
        nargs="*",
        default=[],
        help="deadline mode once per scheduler.admission_margin (default: the server's)",
    )
    parser.add_argument("--users", type=int, nargs="*", default=[4, 16, 64], help="loads of closed-loop users (default 4 16 64)")
    parser.add_argument("--bursts", type=int, nargs="*", default=[8, 16], help="requests sent at once to the idle server")
    parser.add_argument("--seconds", type=float, default=90.0, help="each load's duration (in each round)")
    parser.add_argument(
        "--rounds",
        type=_positive,
        default=1,
        help="measure every policy this many times, in turns, so that the machine's drift falls on all alike (default 1)",
    )
    parser.add_argument("--pipelines", default="naive", help="comma-separated names, taken in turn, or all (default naive)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--deadline", type=float, default=30.0, help="seconds: goodput's, and the deadline policy's")
    parser.add_argument("--questions", type=Path, help="one question a line (default: the packaged Wikipedia questions)")
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: more `telerag serve` arguments")
    parser.set_defaults(func=run)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be 1 or more")
    return value


def run(args: argparse.Namespace) -> int:
    from telerag.benchmarks.admission import AdmissionConfig, format_table, policies, run_admission_study
    from telerag.config.settings import packaged_config
    from telerag.pipelines.questions import read_questions

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    config = AdmissionConfig(
        policies=policies(args.modes, args.fixed, args.margins),
        users=tuple(args.users),
        bursts=tuple(args.bursts),
        duration_s=args.seconds,
        pipelines=pipeline_names(args.pipelines),
        max_tokens=args.max_tokens,
        deadline_s=args.deadline,
        serve_args=tuple(a for a in args.serve_args if a != "--"),
        rounds=args.rounds,
    )
    questions = [q.text for q in read_questions(args.questions or packaged_config("questions_wiki_en.txt"))]
    report = run_admission_study(config, questions, log=logging.getLogger("telerag.bench.admission").info)
    print(format_table(report))
    if args.json:
        print(json.dumps(report.to_dict()))
    return 0
