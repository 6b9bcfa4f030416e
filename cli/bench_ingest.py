"""`telerag bench ingest`: document writes beside searches, on a copy of the configured datastore
(see `benchmarks.ingest`, whose `IngestConfig` holds the defaults)."""

from __future__ import annotations

import argparse
import json
import logging


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "ingest",
        help="a stream of document writes beside searches, on a copy of the datastore: acknowledgment, freshness, "
        "search latency with and without writes, the final state against faiss",
    )
    parser.add_argument("--writes", type=int, help="documents written, one request at a time (default 200)")
    parser.add_argument("--writes-per-s", type=float, help="a write begins this often (default 2); 0: back to back")
    parser.add_argument("--searches-per-s", type=float, help="a search begins this often (default 10); 0: --clients back to back")
    parser.add_argument("--delete-share", type=float, help="of the writes, deletes (default 0.2)")
    parser.add_argument("--questions", type=int, default=200, help="searches in each phase, alone and under writes")
    parser.add_argument("--clients", type=int, help="searching at once (default 2)")
    parser.add_argument("--datastore", help="the datastore to copy (default: the configured one, the embedded default)")
    parser.add_argument("--config", help="YAML settings file (default: config/default.yaml)")
    parser.add_argument("--json", action="store_true", help='print one JSON line last: {"rows": [...]}')
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from telerag.benchmarks.ingest import IngestConfig, format_table, run_ingest
    from telerag.config.settings import load_settings, packaged_config
    from telerag.pipelines.questions import read_questions
    from telerag.server.process.runtime import load_configured_datastore, load_embedder

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    given = {key: value for key in ("writes", "delete_share", "clients") if (value := getattr(args, key)) is not None}
    for key in ("writes_per_s", "searches_per_s"):  # 0: back to back
        if (rate := getattr(args, key)) is not None:
            given[key] = rate or None
    config = IngestConfig(**given)
    rates = [rate for rate in (config.writes_per_s, config.searches_per_s) if rate is not None]
    if (
        config.writes < 1
        or config.clients < 1
        or not 0 <= config.delete_share < 1
        or args.questions < 1
        or min(rates, default=1) < 0
    ):
        raise SystemExit("bench ingest: --writes, --clients and --questions at least 1, --delete-share in [0, 1), rates >= 0")
    overrides = {"retrieval": {"datastore": args.datastore}} if args.datastore else {}
    settings = load_settings(Path(args.config) if args.config else None, overrides)
    embedder = load_embedder(settings.retrieval)
    load_configured_datastore(settings.retrieval, embedder).close()  # built on the embedded default's first run, checked
    questions = [q.text for q in read_questions(packaged_config("questions_wiki_en.txt"))]
    questions = (questions * (args.questions // len(questions) + 1))[: args.questions]
    report = run_ingest(settings.retrieval.datastore, embedder, questions, config)
    print(format_table(report))
    if args.json:
        print(json.dumps(report.to_dict()))
    return 0
