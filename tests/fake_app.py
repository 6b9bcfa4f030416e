"""The HTTP app on a runtime of fakes (a scripted engine, a recording retriever): in process
through an ASGI client (`Harness`), or under a real uvicorn on loopback with the server's
connection limits (`serving_on_fakes`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import openai

from telerag.config.settings import Settings
from telerag.pipelines.types import DatastoreInfo
from telerag.retrieval.stats import CacheStats
from telerag.server.app import create_app, start_serving
from telerag.server.process.connections import ConnectionLimits, guarded_protocol
from telerag.server.process.runtime import Runtime
from tests.fakes import RecordingRetriever, Reply, ScriptedEngine
from tests.serving import serving


def settings(**sections) -> Settings:
    """Small scheduler limits, with `sections` merged over them."""
    base = {"scheduler": {"batch_window_ms": 20, "max_concurrency": 8, "max_queue": 8}}
    for key, value in sections.items():
        base.setdefault(key, {}).update(value)
    return Settings(**base)


# every metric the dashboard and the docs name, with the labels one naive/hyde request must produce
METRIC_SERIES = (
    ("telerag_request_seconds_bucket", ('pipeline="hyde"', 'outcome="ok"')),
    ("telerag_stage_seconds_bucket", ('pipeline="hyde"', 'stage="search"')),
    ("telerag_cluster_overlap_rate_bucket", ('pipeline="hyde"', 'le="0.8"')),
    ("telerag_prefetched_bytes_total", ('pipeline="hyde"',)),
    ("telerag_cache_hits_total", ()),
    ("telerag_cache_misses_total", ()),
    ("telerag_cache_evictions_total", ()),
    ("telerag_cache_occupancy_bytes", ()),
    ("telerag_clusters_searched_total", ('pipeline="hyde"', 'where="device"')),
    ("telerag_clusters_searched_total", ('pipeline="hyde"', 'where="cpu"')),
    ("telerag_clusters_copied_on_demand_total", ('pipeline="hyde"',)),
    ("telerag_queue_depth", ()),
    ("telerag_queue_wait_seconds_bucket", ('le="0.005"',)),
    ("telerag_batch_size_bucket", ('kind="search"',)),
    ("telerag_tokens_generated_total", ('pipeline="hyde"',)),
    ("telerag_time_to_first_token_seconds_bucket", ('pipeline="hyde"',)),
)
EXPECTED_METRICS = sorted({name.removesuffix("_bucket") for name, _ in METRIC_SERIES})


DATASTORE_INFO = DatastoreInfo(
    passages=100,
    documents=10,
    passage_words=100,
    nlist=64,
    dim=32,
    embedder="hash-32",
    codec="fp32",
    nprobe=8,
    device="cpu",
    cache_bytes=0,
    prefetch_budget_bytes=None,
    copy_gbps=None,
)


class Harness:
    """The app over a scripted engine and a batch-recording retriever, with `sections` of
    settings; `client()` talks to it in process."""

    def __init__(self, delay: float = 0.0, engine=None, **sections) -> None:
        """`engine`: another than the scripted one, which answers every question the same."""
        self.retriever = BatchRecorder()
        self.engine = engine or ScriptedEngine(lambda prompt: Reply("Paris is the capital of France"), delay=delay)
        self.runtime = Runtime(
            settings=settings(**sections),
            engine=self.engine,
            retriever=self.retriever,
            datastore_info=DATASTORE_INFO,
            cache_stats=lambda: CacheStats(hits=3, occupancy_bytes=10),
        )
        self.app = create_app(self.runtime.settings)
        start_serving(self.app, self.runtime)

    def client(self, **kwargs) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://test", timeout=30, **kwargs)


class BatchRecorder(RecordingRetriever):
    """Records how many callers each batched call served."""

    def __init__(self) -> None:
        super().__init__()
        self.search_batches: list[int] = []

    async def search_batch(self, requests):
        self.search_batches.append(len(requests))
        return await super().search_batch(requests)


HEADER_TIMEOUT_S = 1.0
KEEP_ALIVE_S = 1.0
MAX_CONNECTIONS = 6


@contextlib.contextmanager
def serving_on_fakes(
    implementation: str = "auto",
    delay: float = 0.0,
    max_connections: int = MAX_CONNECTIONS,
    timeout_s: float = HEADER_TIMEOUT_S,
    **sections,
) -> Iterator[tuple[str, int]]:
    """A real uvicorn server in a thread, with the connection limits above (`timeout_s`: the
    header and keep-alive timeouts), on a free loopback port; the app on fakes (an engine taking
    `delay` per call), with `sections` of settings."""
    configured = Settings(**sections)
    runtime = Runtime(
        settings=configured,
        engine=ScriptedEngine(lambda prompt: Reply("an answer"), delay=delay),
        retriever=RecordingRetriever(),
        datastore_info=DATASTORE_INFO,
    )
    app = create_app(configured)
    start_serving(app, runtime)
    limits = ConnectionLimits(header_timeout_s=timeout_s, max_connections=max_connections)
    with serving(
        app,
        http=guarded_protocol(limits, implementation, observer=app.state.metrics.connections),
        timeout_keep_alive=max(KEEP_ALIVE_S, timeout_s),
        lifespan="off",
    ) as base:
        yield "127.0.0.1", int(base.rsplit(":", 1)[1])


def sdk(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    """The official SDK over an in-process client of the app (`Harness.client()`), no retries."""
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)
