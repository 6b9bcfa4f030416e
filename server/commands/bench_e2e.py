"""`telerag bench e2e`: whole RAG requests in the modes cpu, lookahead and resident, side by side
(see `benchmarks.e2e`); optionally over the datastore scaled up (`benchmarks.scaled`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from telerag.pipelines.questions import read_questions
from telerag.pipelines.registry import PIPELINES
from telerag.retrieval.files import user_cache_dir
from telerag.server.commands.serve import add_runtime_flags, overrides
from telerag.server.settings import ENGINE_KIND_ALIASES, load_settings, packaged_config


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "e2e", help="whole requests through pipelines, scheduler and retriever: cpu vs lookahead vs all-resident"
    )
    parser.add_argument("--pipelines", default="all", help="comma-separated names, or all (default)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8], help="concurrent requests (default 1 4 8)")
    parser.add_argument("--requests", type=int, default=16, help="measured requests per pipeline, batch and mode")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each measured run")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=None, help="documents per search (default: the config's)")
    parser.add_argument("--questions", type=Path, default=packaged_config("questions_wiki_en.txt"))
    parser.add_argument("--tiny", action="store_true", help="a tiny random LLM (seconds; its text is noise): for CI")
    parser.add_argument("--random-weights", action="store_true",
                        help="with --model DIR: DIR's architecture (config.json, tokenizer) with random weights, built in "
                             "process on the engine's device: timing at a model's real size, nothing loaded")
    parser.add_argument("--engine", choices=["transformers", "sglang", *ENGINE_KIND_ALIASES])
    parser.add_argument("--cache-mb", type=float, help="the lookahead mode's cluster cache (default: the config's)")
    parser.add_argument("--prefetch-budget-mb", type=float, help="one fixed budget (default: B x each pipeline's t_LLM)")
    scale = parser.add_argument_group("datastore scale (noisy replicas of the datastore's vectors, mapped to their passages)")
    scale.add_argument("--scale-vectors", type=int, help="scale the datastore up to this many vectors")
    scale.add_argument("--nlist", type=int, help="IVF lists of the scaled datastore (default 4*sqrt(n))")
    scale.add_argument("--replica-noise", type=float, default=0.5, help="replica = normalise(v + noise*g/sqrt(dim))")
    scale.add_argument("--scale-dir", type=Path, default=None, help="where scaled datastores are kept (default: the cache dir)")
    scale.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot-dir", type=Path, help="write latency_breakdown.png and throughput.png here")
    parser.add_argument("--json", action="store_true", help="print one JSON line last: {\"rows\": [...], ...}")
    add_runtime_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from telerag.benchmarks.e2e import E2EConfig, format_table, run_e2e
    from telerag.benchmarks.random_llm import random_weight_engine, tiny_random_lm
    from telerag.benchmarks.scaled import scaled_datastore
    from telerag.pipelines.engines.transformers import TransformersEngine
    from telerag.retrieval.datastore import Datastore
    from telerag.retrieval.device import resolve_device
    from telerag.server.runtime import build_engine, load_datastore, load_embedder, open_configured_retriever, run_event_loop

    if args.tiny and args.model:
        raise SystemExit("--tiny and --model exclude each other")
    if args.random_weights and not args.model:
        raise SystemExit("--random-weights needs --model DIR (a config.json and a tokenizer)")
    if args.nlist and not args.scale_vectors:
        raise SystemExit("--nlist sets the lists of a scaled datastore: give --scale-vectors too")
    names = tuple(PIPELINES) if args.pipelines == "all" else tuple(n.strip() for n in args.pipelines.split(","))
    settings = load_settings(args.config, overrides(args))
    retrieval = settings.retrieval
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    log = logging.getLogger("telerag.bench.e2e")

    # the engine first, so the default cluster cache gets what the LLM leaves of the GPU (as `serve`)
    if args.tiny:
        engine = TransformersEngine(*tiny_random_lm(0), name="tiny-random", device=str(resolve_device(settings.engine.device)))
    elif args.random_weights:
        engine = random_weight_engine(args.model, device=str(resolve_device(settings.engine.device)))
    else:
        engine = build_engine(settings)
    embedder = load_embedder(retrieval)
    datastore = load_datastore(retrieval, embedder)
    if args.scale_vectors:
        try:
            scaled = scaled_datastore(datastore, args.scale_dir or user_cache_dir() / "bench", n_vectors=args.scale_vectors,
                                      nlist=args.nlist, noise=args.replica_noise, seed=args.seed)
        finally:
            datastore.close()
        datastore = Datastore.load(scaled, embedder=embedder.name, verify_checksums=retrieval.verify_checksums, progress=True)
    retriever = open_configured_retriever(datastore, embedder, retrieval)
    config = E2EConfig(
        pipelines=names,
        questions=tuple(q.text for q in read_questions(args.questions)),
        batches=tuple(args.batch),
        requests=args.requests,
        max_tokens=args.max_tokens,
        top_k=args.top_k or retrieval.top_k,
        warmup=args.warmup,
        batch_window_ms=settings.scheduler.batch_window_ms,
        max_batch=settings.scheduler.max_batch,
    )

    async def main() -> list:
        try:
            return await run_e2e(engine, retriever, config, log=log.info)
        finally:
            await engine.close()

    try:
        rows = run_event_loop(main(), settings)
        info = retriever.datastore_info()
    finally:
        retriever.close()
    print(f"LLM {engine.name}; datastore {info.passages} vectors, nlist {info.nlist}, nprobe {info.nprobe}, "
          f"device {info.device}, lookahead cache {info.cache_bytes / 2**20:.3g} MB; "
          f"{config.requests} requests per row, top-{config.top_k}, {config.max_tokens} tokens")
    print(format_table(rows))
    plots = []
    if args.plot_dir is not None:
        from telerag.benchmarks.plots import write_plots

        plots = [str(p) for p in write_plots(rows, args.plot_dir)]
        print("plots: " + ", ".join(plots))
    if args.json:
        print(json.dumps({"llm": engine.name, "datastore": asdict(info), "requests": config.requests, "max_tokens": config.max_tokens,
                          "top_k": config.top_k, "plots": plots, "rows": [asdict(r) for r in rows]}))
    return 0
