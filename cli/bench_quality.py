"""`telerag bench quality`: retrieval recall, answer quality and stage latency per pipeline over a
question file with the configured LLM and datastore (see `benchmarks.quality`)."""

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
    parser = subparsers.add_parser("quality", help="recall, exact match, F1 and stage latency per pipeline")
    parser.add_argument("--pipelines", default="all", help="comma-separated names, or all")
    parser.add_argument("--questions", type=Path, default=packaged_config("questions_wiki_en.txt"))
    parser.add_argument("--limit", type=int, default=None, help="first N questions only")
    parser.add_argument("--k", type=int, default=None, help="documents per search (default: retrieval.top_k)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--concurrency",
        type=_at_least_one,
        default=1,
        help="questions at a time (the engine batches them; stage times then include their neighbours')",
    )
    parser.add_argument(
        "--pipelining",
        choices=["on", "off"],
        help="the requests' pipelining (iter_retgen, flare, iterative; default: experiments.pipelining)",
    )
    parser.add_argument(
        "--retrieval-only",
        action="store_true",
        help="no LLM: each question's own top-k (naive's retrieval), to compare datastores and search modes",
    )
    parser.add_argument(
        "--search-modes",
        type=_modes,
        default=None,
        help="with --retrieval-only: comma-separated search modes, a row each (dense, keyword, hybrid; default: "
        "retrieval.search_mode)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    add_runtime_flags(parser)
    parser.set_defaults(func=run)


def _modes(text: str) -> list[str]:
    modes = [mode.strip() for mode in text.split(",") if mode.strip()]
    unknown = [mode for mode in modes if mode not in ("dense", "keyword", "hybrid")]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"search modes are dense, keyword and hybrid, not {', '.join(unknown) or text!r}")
    return modes


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return int(text)


def run(args: argparse.Namespace) -> int:
    from telerag.benchmarks.quality import (
        configured_quality_study,
        configured_retrieval_study,
        format_table,
    )  # brings torch: only when it runs

    names = list(pipeline_names(args.pipelines))
    given = overrides(args)
    if args.pipelining is not None:
        given.setdefault("experiments", {})["pipelining"] = args.pipelining == "on"
    settings = load_settings(args.config, given)
    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO, format="%(message)s")
    questions = read_questions(args.questions, args.limit)
    k = args.k or settings.retrieval.top_k
    if args.retrieval_only:
        modes = args.search_modes or [settings.retrieval.search_mode]
        rows = asyncio.run(configured_retrieval_study(settings, questions, k, modes))
    else:
        rows = asyncio.run(configured_quality_study(settings, names, questions, k, args.max_tokens, args.concurrency))
    print(format_table(rows, settings.retrieval.datastore))
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows]}))
    return 0
