"""`telerag bench pipelining`: iterative pipelines' requests in the modes sequential, pipelined,
early_stop, budgeted, speculative and early_stop_speculative, side by side over the datastore
scaled up (see `benchmarks.pipelining`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from telerag.cli.runtime_flags import add_runtime_flags, overrides
from telerag.cli.scaled_flags import add_scaled_flags, datastore_scale, llm_choice
from telerag.config.settings import load_settings, packaged_config
from telerag.pipelines.questions import read_questions
from telerag.pipelines.registry import pipeline_names

# benchmarks.pipelining.Mode's, without torch
MODE_NAMES = ("sequential", "pipelined", "early_stop", "budgeted", "speculative", "early_stop_speculative")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "pipelining",
        help="iterative pipelines: sequential, pipelined, exact early stop, nprobe auto, speculative prefill, and both",
    )
    parser.add_argument("--pipelines", default="iter_retgen,flare", help="comma-separated names (default iter_retgen,flare)")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=MODE_NAMES,
        default=list(MODE_NAMES),
        help="default all; sequential is always run (the others are compared with it)",
    )
    parser.add_argument("--requests", type=int, default=8, help="measured requests per pipeline and mode")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests per pipeline and mode first")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=None, help="documents per search (default: the config's)")
    parser.add_argument("--questions", type=Path, default=packaged_config("questions_wiki_en.txt"))
    parser.add_argument(
        "--cold", action="store_true", help="empty the cluster cache before each request (from disk: every list read anew)"
    )
    add_scaled_flags(parser)
    parser.add_argument("--json", action="store_true", help='print one JSON line last: {"rows": [...], ...}')
    add_runtime_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from telerag.benchmarks.pipelining import (
        Mode,
        PipeliningBenchConfig,
        format_table,
        run_configured_pipelining_bench,
    )  # brings torch: only when it runs

    llm, scale = llm_choice(args), datastore_scale(args)
    names = pipeline_names(args.pipelines)
    settings = load_settings(args.config, overrides(args))
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    config = PipeliningBenchConfig(
        pipelines=names,
        questions=tuple(q.text for q in read_questions(args.questions)),
        requests=args.requests,
        warmup=args.warmup,
        max_tokens=args.max_tokens,
        top_k=args.top_k or settings.retrieval.top_k,
        modes=tuple(Mode(m) for m in {"sequential", *args.modes}),
        cold=args.cold,
    )
    log = logging.getLogger("telerag.bench.pipelining").info
    report = run_configured_pipelining_bench(settings, config, llm=llm, scale=scale, log=log)
    print(format_table(report))
    if args.json:
        print(
            json.dumps(
                {
                    "llm": report.llm,
                    "datastore": asdict(report.datastore),
                    "requests": config.requests,
                    "max_tokens": config.max_tokens,
                    "top_k": config.top_k,
                    "cold": config.cold,
                    "rows": [asdict(r) for r in report.rows],
                }
            )
        )
    return 0
