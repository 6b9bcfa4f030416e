"""`telerag bench server`: the server's own overhead (HTTP, scheduling, serialisation) against
calling the same pipeline in-process, with the tiny random LM so the model adds little; same
questions, same engine, same retriever, side by side in one run."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("server", help="HTTP + scheduling overhead vs in-process, tiny LM")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--articles", type=int, default=200, help="Wikipedia articles in the throwaway datastore")
    parser.add_argument("--pipeline", default="naive")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--batch-window-ms", type=float, default=2.0)
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(func=run)


def _percentiles(values: list[float]) -> tuple[float, float]:
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


def run(args: argparse.Namespace) -> int:
    import httpx
    import uvicorn

    from pipelines.embedder import Embedder
    from pipelines.engines.cpu import CPUEngine, tiny_random_lm
    from pipelines.overlap import read_questions, run_one
    from pipelines.registry import build_pipelines
    from pipelines.retriever import open_retriever
    from pipelines.types import RunOptions
    from retrieval.builder import build_datastore
    from retrieval.corpus import read_wikipedia, split_passages
    from server.app import create_app
    from server.runtime import Runtime
    from server.settings import CONFIG_DIR, load_settings

    questions = [q.text for q in read_questions(CONFIG_DIR / "questions_wiki_en.txt")]
    questions = [questions[i % len(questions)] for i in range(args.requests)]
    embedder = Embedder.embedded_default()
    with tempfile.TemporaryDirectory() as tmp:
        articles = list(read_wikipedia())[: args.articles]
        build_datastore(split_passages(articles), embedder.encode, embedder=embedder.name, out_dir=Path(tmp) / "ds",
                        progress=not args.json)
        retriever = open_retriever(Path(tmp) / "ds", embedder, device="cpu")
        engine = CPUEngine(*tiny_random_lm(), name="tiny-random")
        settings = load_settings(overrides={"scheduler": {"batch_window_ms": args.batch_window_ms}})
        runtime = Runtime(settings=settings, engine=engine, retriever=retriever,
                          datastore_info=retriever.datastore_info(), cache_stats=retriever.cache_stats)
        options = RunOptions(max_tokens=args.max_tokens)

        async def measure() -> tuple[list[float], list[float]]:
            pipeline = build_pipelines(engine, retriever, names=[args.pipeline])[args.pipeline]
            direct = []
            for i, question in enumerate(questions):
                started = time.perf_counter()
                await run_one(pipeline, question, options)
                if i >= 3:
                    direct.append((time.perf_counter() - started) * 1e3)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            server = uvicorn.Server(uvicorn.Config(create_app(runtime), host="127.0.0.1", port=port, log_level="warning"))
            task = asyncio.create_task(server.serve())
            while not server.started:
                await asyncio.sleep(0.05)
            http = []
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                for i, question in enumerate(questions):
                    body = {"query": question, "pipeline": args.pipeline, "max_tokens": args.max_tokens}
                    started = time.perf_counter()
                    response = await client.post("/v1/rag/query", json=body)
                    response.raise_for_status()
                    if i >= 3:
                        http.append((time.perf_counter() - started) * 1e3)
            server.should_exit = True
            await task
            return direct, http

        direct, http = asyncio.run(measure())
        retriever.close()
    (d50, d99), (h50, h99) = _percentiles(direct), _percentiles(http)
    result = {
        "pipeline": args.pipeline, "requests": len(direct), "batch_window_ms": args.batch_window_ms,
        "in_process_ms_p50": d50, "in_process_ms_p99": d99, "http_ms_p50": h50, "http_ms_p99": h99,
        "overhead_ms_p50": h50 - d50, "overhead_ms_p99": h99 - d99, "overhead_ms_mean": statistics.fmean(http) - statistics.fmean(direct),
    }
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value:.3f}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    if args.json:
        print(json.dumps(result))
    return 0
