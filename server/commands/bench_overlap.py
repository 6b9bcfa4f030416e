"""`telerag bench overlap`: the overlap study over a question file with the configured LLM and
datastore (see `benchmarks.overlap`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from dataclasses import asdict
from pathlib import Path

from telerag.benchmarks.overlap import overlap_study
from telerag.pipelines.questions import read_questions
from telerag.pipelines.registry import PIPELINES
from telerag.pipelines.types import RunOptions
from telerag.server.commands.serve import add_runtime_flags, overrides
from telerag.server.settings import load_settings, packaged_config


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("overlap", help="cluster overlap of q_in and q_out per pipeline (TeleRAG Table 3.1)")
    parser.add_argument("--pipelines", default="all", help="comma-separated names, or all")
    parser.add_argument("--questions", type=Path, default=packaged_config("questions_wiki_en.txt"))
    parser.add_argument("--limit", type=int, default=None, help="first N questions only")
    parser.add_argument("--prefetch-clusters", type=int, default=None,
                        help="prefetch depth in clusters of average size (default: nprobe)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    add_runtime_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from telerag.server.runtime import open_runtime

    names = list(PIPELINES) if args.pipelines == "all" else [n.strip() for n in args.pipelines.split(",")]
    settings = load_settings(args.config, overrides(args))
    # The plan needs a cache to plan into, even on a CPU: one that can hold the whole datastore
    # (the cache never allocates more than the datastore's size).
    settings.retrieval.cache_mb = settings.retrieval.cache_mb or float(1 << 20)
    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO, format="%(message)s")
    questions = read_questions(args.questions, args.limit)

    async def main() -> list:
        async with open_runtime(settings) as runtime:
            retriever = runtime.retriever
            info = runtime.datastore_info
            depth = args.prefetch_clusters or info.nprobe
            mean_cluster_bytes = retriever.engine.cache.cluster_bytes().mean()
            retriever.prefetch_budget_bytes = int(depth * mean_cluster_bytes)
            pipelines = runtime.pipelines(retriever, names)
            options = RunOptions(top_k=settings.retrieval.top_k, nprobe=args.nprobe, max_tokens=args.max_tokens)
            rows = await overlap_study(list(pipelines.values()), questions, options, progress=True)
            return [rows, depth, info]

    rows, depth, info = asyncio.run(main())
    print(f"{len(questions)} questions, nlist {info.nlist}, nprobe {args.nprobe or info.nprobe}, prefetch depth {depth} clusters")
    print(f"{'pipeline':<13}{'overlap':>9}{'pre-retrieval ms':>18}{'total ms':>10}{'article hit':>13}"
          f"{'empty answers':>15}{'cue answers':>13}")
    for row in rows:
        overlap = f"{row.overlap_rate:.3f}" if row.overlap_rate is not None else "-"
        hit = f"{row.article_hit_rate:.3f}" if row.article_hit_rate is not None else "-"
        print(f"{row.pipeline:<13}{overlap:>9}{row.pre_retrieval_ms:>18.1f}{row.total_ms:>10.1f}{hit:>13}"
              f"{row.empty_answers:>15}{row.cue_answers:>13}")
    if args.json:
        print(json.dumps({"questions": len(questions), "nlist": info.nlist, "prefetch_clusters": depth,
                          "nprobe": args.nprobe or info.nprobe, "rows": [asdict(r) for r in rows]}))
    return 0
