"""`telerag bench generate`: the transformers engine against plain `model.generate` (see
`benchmarks.generate`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import get_args

from telerag.config.settings import EngineDtype


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="the transformers engine vs. plain model.generate: time to first token and tokens/s"
    )
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--tiny", action="store_true", help="a tiny random model (runs in seconds; its text is noise)")
    model.add_argument("--model", help="a transformers model directory or a .gguf file (default: the embedded Gemma 3 270M)")
    parser.add_argument("--prompts", type=int, default=8, help="requests (default 8)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default 32)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["auto"],
        choices=get_args(EngineDtype),
        help="number types compared side by side, the first the reference (default: auto, float32 on the CPU)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from telerag.benchmarks.generate import GenerateConfig, format_table, resolved_dtypes, run_generate

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # to stderr: the GGUF conversion's progress
    config = GenerateConfig(
        tiny=args.tiny,
        model=args.model,
        prompts=args.prompts,
        max_tokens=args.max_tokens,
        device=args.device,
        threads=args.threads,
        dtypes=tuple(args.dtype),
    )
    try:
        resolved_dtypes(config)
    except ValueError as exc:
        print(f"telerag bench generate: {exc}", file=sys.stderr)
        return 2
    report = run_generate(config)
    print(format_table(report))
    if args.json:
        print(json.dumps(report.to_dict()))
    return 0
