"""`telerag bench overlap`: the overlap study over a question file with the configured LLM and
datastore (see `benchmarks.overlap`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from dataclasses import asdict
from pathlib import Path

from telerag.cli.runtime_flags import add_runtime_flags, overrides
from telerag.config.settings import load_settings, packaged_config
from telerag.pipelines.questions import read_questions
from telerag.pipelines.registry import pipeline_names


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("overlap", help="cluster overlap of q_in and q_out per pipeline (TeleRAG Table 3.1)")
    parser.add_argument("--pipelines", default="all", help="comma-separated names, or all")
    parser.add_argument("--questions", type=Path, default=packaged_config("questions_wiki_en.txt"))
    parser.add_argument("--limit", type=int, default=None, help="first N questions only")
    parser.add_argument(
        "--prefetch-clusters", type=int, default=None, help="prefetch depth in clusters of average size (default: nprobe)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    add_runtime_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from telerag.benchmarks.overlap import (
        OverlapConfig,
        configured_overlap_study,
        format_table,
    )  # brings torch: only when it runs

    names = pipeline_names(args.pipelines)
    settings = load_settings(args.config, overrides(args))
    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO, format="%(message)s")
    config = OverlapConfig(
        pipelines=names,
        questions=tuple(read_questions(args.questions, args.limit)),
        prefetch_clusters=args.prefetch_clusters,
        nprobe=args.nprobe if isinstance(args.nprobe, int) else None,  # auto: the default, as for any search not pipelined
        max_tokens=args.max_tokens,
    )
    report = asyncio.run(configured_overlap_study(settings, config))
    print(format_table(report))
    if args.json:
        print(json.dumps(asdict(report)))
    return 0
