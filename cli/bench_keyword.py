"""`telerag bench keyword`: the keyword half's engine, ours against SQLite FTS5 (and bm25s and
tantivy where installed), on the configured datastore's passages (see `benchmarks.keyword_engines`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from telerag.config.settings import load_settings, packaged_config
from telerag.pipelines.questions import read_questions


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "keyword", help="the keyword half's engine against SQLite FTS5, bm25s and tantivy: build, query, write, delete"
    )
    parser.add_argument("--datastore", type=Path, default=None, help="its directory (default: retrieval.datastore)")
    parser.add_argument("--questions", type=Path, default=packaged_config("questions_wiki_en.txt"))
    parser.add_argument("--config", help="YAML settings file")
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from telerag.benchmarks.keyword_engines import format_table, keyword_engines
    from telerag.retrieval.live import opened

    settings = load_settings(args.config, {})
    path = args.datastore or settings.retrieval.datastore
    questions = [q.text for q in read_questions(args.questions)]
    with opened(path, verify_checksums=False) as live:
        rows = keyword_engines(live, questions)
        passages = live.snapshot().passages
    print(format_table(rows, passages, len(questions)))
    if args.json:
        print(
            json.dumps(
                {"datastore": str(path), "passages": passages, "questions": len(questions), "rows": [asdict(r) for r in rows]}
            )
        )
    return 0
