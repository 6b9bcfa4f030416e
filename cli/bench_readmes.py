"""`telerag bench readmes`: write the second corpus of `bench quality` (the installed packages'
READMEs, `benchmarks.readmes`) as a JSONL corpus to build a datastore from."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from telerag.benchmarks.readmes import installed_readmes, write_corpus


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "readmes",
        help="the installed packages' READMEs as a corpus (bench quality's second, with config/questions_readmes.txt)",
        description="Write the READMEs of the packages installed here as a JSONL corpus, then: telerag datastore "
        "build --corpus FILE --out DIR; telerag bench quality --retrieval-only --datastore DIR --questions "
        "config/questions_readmes.txt --search-modes dense,keyword,hybrid",
    )
    parser.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    parser.add_argument("--json", action="store_true", help="print one JSON line last")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    readmes, missing = installed_readmes()
    if not readmes:
        raise SystemExit("telerag bench readmes: none of the corpus's packages is installed here")
    write_corpus(readmes, args.out)
    print(f"{'package':<24}{'version':>14}{'words':>9}")
    for readme in readmes:
        print(f"{readme.package:<24}{readme.version:>14}{readme.words:>9}")
    print(f"{len(readmes)} READMEs, {sum(r.words for r in readmes)} words, written to {args.out}")
    if missing:
        print(f"not installed here (or without a README): {', '.join(missing)}")
    if args.json:
        print(
            json.dumps(
                {"packages": {r.package: r.version for r in readmes}, "words": sum(r.words for r in readmes), "missing": missing}
            )
        )
    return 0
