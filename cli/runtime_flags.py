"""The flags of every command that opens the runtime (`serve`, `ask`, the benchmarks that load
the configured models and datastore), and how they become settings."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


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
