"""`telerag serve`: load everything from the settings and serve the HTTP API with uvicorn."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from telerag.server.settings import load_settings


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve the HTTP API (the embedded default with no arguments)")
    add_runtime_flags(parser)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--engine", choices=["cpu", "sglang"])
    parser.add_argument("--cache-mb", type=float, help="GPU cluster cache size")
    parser.add_argument("--prefetch-budget-mb", type=float)
    parser.add_argument("--api-key", help="require Authorization: Bearer KEY on /v1")
    parser.set_defaults(func=run)


def add_runtime_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that choose what a command loads (settings file, models, datastore, device),
    for every command that opens the runtime; `overrides` reads them, and the serving-only
    flags a command lacks read as not given."""
    parser.add_argument("--config", type=Path, help="YAML settings file (default: config/default.yaml)")
    parser.add_argument("--model", type=Path, help="local model directory or .gguf file")
    parser.add_argument("--datastore", type=Path)
    parser.add_argument("--embedder", type=Path)
    parser.add_argument("--device", help="auto, cpu or cuda (retrieval and engine)")
    parser.add_argument("--nprobe", type=int)
    parser.set_defaults(host=None, port=None, api_key=None, engine=None, cache_mb=None, prefetch_budget_mb=None)


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Flags that were given, as nested settings (flags beat the environment and the file)."""
    chosen: dict[str, dict[str, Any]] = {}

    def put(section: str, key: str, value: Any) -> None:
        if value is not None:
            chosen.setdefault(section, {})[key] = value

    put("server", "host", args.host)
    put("server", "port", args.port)
    put("server", "api_key", args.api_key)
    put("engine", "kind", args.engine)
    put("engine", "model_path", args.model)
    put("engine", "device", args.device)
    put("retrieval", "datastore", args.datastore)
    put("retrieval", "embedder", args.embedder)
    put("retrieval", "device", args.device)
    put("retrieval", "cache_mb", args.cache_mb)
    put("retrieval", "prefetch_budget_mb", args.prefetch_budget_mb)
    put("retrieval", "nprobe", args.nprobe)
    return chosen


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from telerag.server.app import create_app
    from telerag.server.connections import uvicorn_options
    from telerag.server.runtime import open_runtime, run_event_loop

    settings = load_settings(args.config, overrides(args))
    logging.basicConfig(level=settings.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def main() -> None:
        async with open_runtime(settings) as runtime:
            config = uvicorn.Config(
                create_app(runtime), host=settings.server.host, port=settings.server.port,
                log_level=settings.server.log_level, timeout_graceful_shutdown=int(settings.scheduler.request_timeout_s),
                **uvicorn_options(settings.server),
            )
            logging.getLogger("telerag").info("serving on http://%s:%d", settings.server.host, settings.server.port)
            await uvicorn.Server(config).serve()

    run_event_loop(main(), settings)
    return 0
