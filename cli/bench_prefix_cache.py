"""`telerag bench prefix-cache`: real pipelines over a question stream with repeats, the
transformers engine's KV reuse off, exact (prefix cache) and per document (see
`benchmarks.prefix_cache`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from dataclasses import asdict
from pathlib import Path

from telerag.benchmarks.prefix_cache import CACHE_MODES
from telerag.cli.runtime_flags import add_runtime_flags, overrides
from telerag.config.settings import load_settings, packaged_config
from telerag.pipelines.questions import read_questions
from telerag.pipelines.registry import pipeline_names


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "prefix-cache",
        help="the transformers engine's KV reuse off, prefix and per document: time to first token, tokens reused, answers equal",
    )
    parser.add_argument("--pipelines", default="all", help="comma-separated names, or all")
    parser.add_argument("--questions", type=Path, default=packaged_config("questions_wiki_en.txt"))
    parser.add_argument("--limit", type=int, default=20, help="first N questions (default 20)")
    parser.add_argument("--repeat", type=_share, default=0.5, help="share of questions asked again two questions later (0.5)")
    parser.add_argument("--kv-cache-mb", type=float, default=256.0, help="each KV cache's size when on (256)")
    parser.add_argument(
        "--modes", nargs="+", choices=CACHE_MODES, default=list(CACHE_MODES), help="off first (default: all three)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true", help='print one JSON line last: {"rows": [...]}')
    add_runtime_flags(parser)
    parser.set_defaults(func=run)


def _share(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, not {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    from telerag.benchmarks.prefix_cache import (
        PrefixCacheConfig,
        configured_prefix_cache_study,
        format_table,
    )  # brings torch: only when it runs

    names = pipeline_names(args.pipelines)
    settings = load_settings(args.config, overrides(args))
    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO, format="%(message)s")
    config = PrefixCacheConfig(
        pipelines=names,
        questions=tuple(read_questions(args.questions, args.limit)),
        repeat=args.repeat,
        max_tokens=args.max_tokens,
        cache_mb=args.kv_cache_mb,
        modes=tuple(args.modes),
    )
    rows = asyncio.run(configured_prefix_cache_study(settings, config))
    print(format_table(rows))
    if args.json:
        print(json.dumps({"rows": [asdict(row) for row in rows]}))
    return 0
