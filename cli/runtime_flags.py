"""The flags of every command that opens the runtime (`serve`, `ask`, the benchmarks that load
the configured models and datastore), and how they become settings."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class Null:
    """A flag given as `null`: the setting is None (its default behaviour, e.g. the embedded
    model), whatever the file or the environment say, as `null` in the file would make it."""

    def __repr__(self) -> str:
        return "null"

    def __bool__(self) -> bool:
        return False  # as the None it stands for


NULL = Null()


def nullable(kind: Callable[[str], T]) -> Callable[[str], T | Null]:
    """An argparse type for a setting that may be null: `null`, or a value of `kind`."""

    def parse(text: str) -> T | Null:
        return NULL if text == "null" else kind(text)

    parse.__name__ = getattr(kind, "__name__", "value")  # argparse names the type in its message
    return parse


def nprobe_value(text: str) -> int | str:
    """nprobe as a flag gives it: a whole number, or `auto`."""
    return text if text == "auto" else int(text)


def add_runtime_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that choose what a command loads (settings file, models, datastore, device),
    for every command that opens the runtime; `overrides` reads them, and the serving-only
    flags a command lacks read as not given. A flag whose setting may be null takes `null`."""
    parser.add_argument("--config", type=Path, help="YAML settings file (default: config/default.yaml)")
    parser.add_argument("--model", type=nullable(Path), help="local model directory or .gguf file (null: the embedded one)")
    parser.add_argument("--datastore", type=Path)
    parser.add_argument("--embedder", type=nullable(Path), help="sentence-transformers model directory (null: the packaged one)")
    parser.add_argument("--device", help="auto, cpu or cuda (retrieval and engine)")
    parser.add_argument("--dtype", help="the engine's number type: auto, float32, bfloat16 or float16 (engine.dtype)")
    parser.add_argument(
        "--nprobe", type=nullable(nprobe_value), help="IVF lists searched (null: 4*sqrt(nlist); auto: see retrieval.nprobe)"
    )
    parser.add_argument(
        "--host-cache-mb",
        type=nullable(float),
        help="read the datastore from disk into a host cache of this many MB (null: memory-mapped; retrieval.host_cache_mb)",
    )
    parser.set_defaults(
        host=None,
        port=None,
        api_key=None,
        engine=None,
        cache_mb=None,
        prefetch_budget_mb=None,
        prefetch_reach=None,
        cpu_threads=None,
        replicas=None,
        shards=None,
        max_replicas=None,
        max_shard_replicas=None,
    )


def add_cluster_flags(parser: argparse.ArgumentParser, *, given_how: str) -> None:
    """The flags that size a Ray Serve deployment (`serve --ray`, `config serve`); `given_how`
    says when they apply."""
    parser.add_argument("--replicas", type=int, help=f"{given_how}inference replicas (cluster.replicas)")
    parser.add_argument("--shards", type=int, help=f"{given_how}retrieval tier shards; 0: none (cluster.shards)")
    parser.add_argument(
        "--max-replicas", type=int, help=f"{given_how}autoscale inference replicas up to this many (cluster.max_replicas)"
    )
    parser.add_argument(
        "--max-shard-replicas", type=int, help=f"{given_how}autoscale each shard's replicas up to this many (max_shard_replicas)"
    )


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Flags that were given, as nested settings (flags beat the environment and the file)."""
    chosen: dict[str, dict[str, Any]] = {}

    def put(section: str, key: str, value: Any) -> None:
        if value is not None:  # None: not given
            chosen.setdefault(section, {})[key] = None if value is NULL else value

    put("server", "host", args.host)
    put("server", "port", args.port)
    put("server", "api_key", args.api_key)
    put("engine", "kind", args.engine)
    put("engine", "model_path", args.model)
    put("engine", "device", args.device)
    put("engine", "dtype", args.dtype)
    put("retrieval", "datastore", args.datastore)
    put("retrieval", "embedder", args.embedder)
    put("retrieval", "device", args.device)
    put("retrieval", "cache_mb", args.cache_mb)
    put("retrieval", "host_cache_mb", args.host_cache_mb)
    put("retrieval", "prefetch_budget_mb", args.prefetch_budget_mb)
    put("retrieval", "prefetch_reach", args.prefetch_reach)
    put("retrieval", "cpu_threads", args.cpu_threads)
    put("retrieval", "nprobe", args.nprobe)
    put("cluster", "replicas", args.replicas)
    put("cluster", "shards", args.shards)
    put("cluster", "max_replicas", args.max_replicas)
    put("cluster", "max_shard_replicas", args.max_shard_replicas)
    return chosen
