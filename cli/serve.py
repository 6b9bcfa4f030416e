"""`telerag serve`: the HTTP API with uvicorn, listening first and loading after, draining at SIGTERM
(`server/process/serve.py`)."""

from __future__ import annotations

import argparse
import logging

from telerag.cli.preconditions import require_ray
from telerag.cli.runtime_flags import add_cluster_flags, add_runtime_flags, nullable, overrides
from telerag.config.settings import ENGINE_KIND_ALIASES, load_settings


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve the HTTP API (the embedded default with no arguments)")
    add_runtime_flags(parser)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--engine", choices=["transformers", "sglang", *ENGINE_KIND_ALIASES])
    parser.add_argument("--cache-mb", type=nullable(float), help="GPU cluster cache size (null: what the LLM leaves)")
    parser.add_argument("--prefetch-budget-mb", type=nullable(float), help="one budget for every prefetch (null: B x t_LLM)")
    parser.add_argument(
        "--prefetch-reach",
        type=nullable(float),
        help="how far down q_in's ranking a prefetch reads, x nprobe (null: 1.5 from disk, else unbounded)",
    )
    parser.add_argument("--api-key", type=nullable(str), help="require Authorization: Bearer KEY on /v1 (null: open)")
    parser.add_argument(
        "--ray",
        action="store_true",
        help="on a Ray cluster (RAY_ADDRESS, else a local one): inference replicas and retrieval shards",
    )
    add_cluster_flags(parser, given_how="with --ray: ")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # the server (fastapi, uvicorn) imported here, not at the top: every other command would pay for it
    from telerag.server.process.event_loop import run_event_loop
    from telerag.server.process.serve import serve

    settings = load_settings(args.config, overrides(args))
    logging.basicConfig(level=settings.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.ray:
        require_ray("serve --ray")
        from telerag.server.ray_serve.applications import serve_on_ray

        return serve_on_ray(settings)
    if any(value is not None for value in (args.replicas, args.shards, args.max_replicas, args.max_shard_replicas)):
        raise SystemExit("--replicas, --shards, --max-replicas and --max-shard-replicas need --ray")
    return run_event_loop(serve(settings), settings)
