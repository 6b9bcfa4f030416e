"""`telerag bench server`: the server's own overhead (HTTP, scheduling, serialisation) against
calling the same pipeline in-process, with the tiny random LM so the model adds little; same
questions, same engine, same retriever, side by side in one run.

Each question runs in-process and then over HTTP, back to back, and the overhead is the paired
difference (the pipeline's own run-to-run noise would swamp a difference of two separate
distributions). The HTTP client is a bare keep-alive HTTP/1.1 client on the same event loop,
so what is measured is the server's work, not an HTTP library's."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import uvicorn

from telerag.benchmarks.random_llm import tiny_random_lm
from telerag.config.settings import Settings, load_settings, packaged_config
from telerag.engines.transformers.engine import TransformersEngine
from telerag.pipelines.datastores import open_retriever
from telerag.pipelines.embedder import Embedder
from telerag.pipelines.questions import read_questions, run_one
from telerag.pipelines.types import RunOptions
from telerag.retrieval.builder import build_datastore
from telerag.retrieval.corpus import read_wikipedia, split_passages
from telerag.server.app import create_app, start_serving
from telerag.server.process.event_loop import run_event_loop
from telerag.server.process.runtime import Runtime

WARMUP = 3  # first requests left out of the figures


@dataclass(frozen=True)
class ServerOverheadConfig:
    requests: int = 100
    articles: int = 200  # Wikipedia articles in the throwaway datastore
    pipeline: str = "naive"
    max_tokens: int = 8
    batch_window_ms: float | None = None  # the scheduler's batching window; None: the config's
    progress: bool = True  # the datastore build's progress bars


def _percentiles(values: list[float]) -> tuple[float, float]:
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


class _BareClient:
    """One keep-alive HTTP/1.1 connection: write a request, read the status and the body."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int) -> _BareClient:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def post_json(self, path: str, body: dict) -> bytes:
        data = json.dumps(body).encode()
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n".encode()
            + data
        )
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in head[1:] if line)
        payload = await self.reader.readexactly(int(headers["content-length"]))
        if head[0].split()[1] != "200":
            raise RuntimeError(f"{head[0]}: {payload[:200]!r}")
        return payload

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


def run_server_overhead(config: ServerOverheadConfig) -> dict:
    """Build a throwaway datastore of the first `articles` Wikipedia articles with the embedded
    embedder, serve it with the tiny random LM, and time every question both ways; the report."""
    questions = [q.text for q in read_questions(packaged_config("questions_wiki_en.txt"))]
    questions = [questions[i % len(questions)] for i in range(config.requests)]
    embedder = Embedder.embedded_default()
    with tempfile.TemporaryDirectory() as tmp:
        articles = list(read_wikipedia())[: config.articles]
        build_datastore(
            split_passages(articles), embedder.encode, embedder=embedder.name, out_dir=Path(tmp) / "ds", progress=config.progress
        )
        retriever = open_retriever(Path(tmp) / "ds", embedder, device="cpu")
        engine = TransformersEngine(*tiny_random_lm(), name="tiny-random")
        window = {} if config.batch_window_ms is None else {"scheduler": {"batch_window_ms": config.batch_window_ms}}
        settings = load_settings(overrides=window)
        runtime = Runtime(
            settings=settings,
            engine=engine,
            retriever=retriever,
            datastore_info=retriever.datastore_info(),
            cache_stats=retriever.cache_stats,
        )
        direct, http = run_event_loop(_paired_latencies(settings, runtime, questions, config), settings)  # both sides run in it
        retriever.close()
    overhead = [h - d for d, h in zip(direct, http, strict=True)]
    (d50, d99), (h50, h99), (o50, o99) = _percentiles(direct), _percentiles(http), _percentiles(overhead)
    return {
        "pipeline": config.pipeline,
        "requests": len(direct),
        "batch_window_ms": settings.scheduler.batch_window_ms,
        "in_process_ms_p50": d50,
        "in_process_ms_p99": d99,
        "http_ms_p50": h50,
        "http_ms_p99": h99,
        "overhead_ms_p50": o50,
        "overhead_ms_p99": o99,
        "overhead_ms_mean": statistics.fmean(overhead),
    }


async def _paired_latencies(
    settings: Settings, runtime: Runtime, questions: Sequence[str], config: ServerOverheadConfig
) -> tuple[list[float], list[float]]:
    """Milliseconds of each question in-process and then over HTTP to the app serving `runtime`
    on a free loopback port (the first WARMUP left out)."""
    pipeline = runtime.pipelines(runtime.retriever, [config.pipeline])[config.pipeline]  # as the server builds it
    options = RunOptions(max_tokens=config.max_tokens)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(settings)
    start_serving(app, runtime)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn's Server has no event for it
        await asyncio.sleep(0.05)
    client = await _BareClient.connect(port)
    direct, http = [], []
    for i, question in enumerate(questions):
        started = time.perf_counter()
        await run_one(pipeline, question, options)
        between = time.perf_counter()
        await client.post_json("/v1/rag/query", {"query": question, "pipeline": config.pipeline, "max_tokens": config.max_tokens})
        if i >= WARMUP:
            direct.append((between - started) * 1e3)
            http.append((time.perf_counter() - between) * 1e3)
    await client.close()
    server.should_exit = True
    await task
    return direct, http
