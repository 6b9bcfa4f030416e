"""`telerag ask "QUESTION" --pipeline NAME`: one question end to end on the configured engine and
datastore (the embedded default when nothing is configured), no HTTP."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from typing import TYPE_CHECKING

from telerag.cli.runtime_flags import add_runtime_flags, overrides
from telerag.config.settings import load_settings
from telerag.pipelines.registry import PIPELINES
from telerag.pipelines.stats import SearchStats
from telerag.pipelines.types import RagResult, RunEvent, RunOptions, TokenEvent, ignore_events

if TYPE_CHECKING:
    from telerag.documents.ingestion import IngestionProgress


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ask", help="answer one question end to end and print the trace")
    parser.add_argument("question")
    parser.add_argument("--pipeline", default="naive", choices=sorted(PIPELINES))
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--no-prefetch", action="store_true", help="search every cluster on the CPU (the baseline)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    add_runtime_flags(parser)
    parser.set_defaults(func=run)


def print_result(result: RagResult) -> None:
    print(f"\n{result.answer}\n")
    for i, doc in enumerate(result.documents, 1):
        print(f"[{i}] {doc.title} (score {doc.score:.3f}, passage {doc.id})")
    print("\nstage                 ms  detail")
    for step in result.steps:
        overlap = step.stats.overlap_rate if isinstance(step.stats, SearchStats) else None
        extra = f"overlap {overlap:.2f}" if overlap is not None else (f"{step.tokens_out} tokens" if step.kind == "llm" else "")
        print(f"{step.stage.name:<18}{step.ms:>8.1f}  {extra}")
    print(f"{'total':<18}{result.timings.total_ms:>8.1f}")


def ingestion_line(ingesting: IngestionProgress) -> str:
    return (
        f"note: the datastore holds {ingesting.documents:,} of the {ingesting.total_documents:,} documents of "
        f"{ingesting.source}: its ingestion has not ended (`telerag serve` writes the rest), so the answer may miss them"
    )


def print_token(event: RunEvent) -> None:
    if isinstance(event, TokenEvent):
        print(event.text, end="", flush=True)


def run(args: argparse.Namespace) -> int:
    # imported here, not at the top: every other command would pay for them
    from telerag.documents.ingestion import unfinished_ingestion
    from telerag.server.process.runtime import open_runtime
    from telerag.server.protocols.rag import QueryResponse

    settings = load_settings(args.config, overrides(args))
    logging.basicConfig(level=logging.WARNING if args.json else logging.INFO, format="%(message)s")

    async def main() -> tuple[RagResult, IngestionProgress | None]:
        async with open_runtime(settings) as runtime:
            ingesting = None if runtime.documents is None else unfinished_ingestion(runtime.documents.live)
            if ingesting is not None and not args.json:
                print(ingestion_line(ingesting))
            pipeline = runtime.pipelines(runtime.retriever, [args.pipeline])[args.pipeline]
            options = RunOptions(
                top_k=args.top_k or settings.retrieval.top_k,
                nprobe=settings.retrieval.nprobe,  # --nprobe sets it
                max_tokens=args.max_tokens,
                prefetch=not args.no_prefetch,
                pipelining=settings.experiments.pipelining,
                speculative_prefill=settings.experiments.speculative_prefill,
            )
            return await pipeline.run(args.question, options, ignore_events if args.json else print_token), ingesting

    result, ingesting = asyncio.run(main())
    if args.json:
        response = QueryResponse.from_result(result, request_id="", with_documents=True, ingestion=ingesting)
        print(json.dumps(response.model_dump(exclude={"id"}), ensure_ascii=False))
    else:
        print_result(result)
    return 0
