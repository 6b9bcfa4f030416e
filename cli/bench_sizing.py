"""`telerag bench sizing`: Chameleon's model of the two tiers from latencies measured here, and
the best split of a budget of replicas between them (see `benchmarks.sizing`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from telerag.cli.preconditions import built_datastore, require_ray
from telerag.cli.runtime_flags import add_runtime_flags, overrides
from telerag.config.settings import load_settings, packaged_config
from telerag.pipelines.questions import read_questions


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sizing", help="Chameleon's model: each tier's throughput from measured latencies, the best ratio of replicas"
    )
    add_runtime_flags(parser)
    parser.add_argument("--pipeline", default="naive")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8], help="requests in flight (default 1 4 8)")
    parser.add_argument("--shards", type=int, default=2, help="retrieval tier shards")
    parser.add_argument("--budget", type=int, default=16, help="replicas to split between the tiers")
    parser.add_argument("--requests", type=int, default=16, help="measured requests per batch")
    parser.add_argument("--searches", type=int, default=50, help="measured tier searches per batch")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--questions", type=Path, default=packaged_config("questions_wiki_en.txt"))
    parser.add_argument("--tiny", action="store_true", help="a tiny random LLM (seconds; its text is noise): for CI")
    parser.add_argument("--json", action="store_true", help='print one JSON line last: {"rows": [...], ...}')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require_ray("bench sizing")
    from telerag.benchmarks.e2e import E2EConfig, LLMChoice
    from telerag.benchmarks.e2e_modes import Mode
    from telerag.benchmarks.sizing import format_table, run_sizing
    from telerag.benchmarks.tier import TierBenchConfig

    settings = load_settings(args.config, overrides(args))
    datastore = built_datastore(settings.retrieval.datastore.expanduser())
    e2e = E2EConfig(
        pipelines=(args.pipeline,),
        questions=tuple(q.text for q in read_questions(args.questions)),
        batches=tuple(args.batch),
        requests=args.requests,
        max_tokens=args.max_tokens,
        top_k=settings.retrieval.top_k,
        nprobe=settings.retrieval.fixed_nprobe,
        modes=(Mode.CPU,),
    )
    tier = TierBenchConfig(
        datastore=datastore,
        shards=(args.shards,),
        batches=tuple(args.batch),
        searches=args.searches,
        k=settings.retrieval.top_k,
        nprobe=settings.retrieval.fixed_nprobe,
        cpus_per_replica=settings.cluster.shard_cpus,
    )
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    llm = LLMChoice.TINY if args.tiny else LLMChoice.CONFIGURED
    log = logging.getLogger("telerag.bench.sizing").info
    report = run_sizing(settings, e2e, tier, budget=args.budget, llm=llm, log=log)
    print(format_table(report))
    if args.json:
        print(json.dumps(asdict(report)))
    return 0
