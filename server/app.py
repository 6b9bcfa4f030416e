"""The FastAPI application, assembled: state, middleware, error handlers, the routes of each API
(`server/routes/`), the schema."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from telerag.config.settings import Settings
from telerag.file_search.file_store import FileStore
from telerag.file_search.store_searcher import Batching
from telerag.file_search.vector_store_index import StoreResources
from telerag.file_search.vector_stores import VectorStores
from telerag.pipelines.registry import PIPELINES
from telerag.retrieval.stats import CacheStats
from telerag.server import errors
from telerag.server.auth import Access
from telerag.server.middleware import BodyLimit, ErrorDialect, RequestId, ServingGate
from telerag.server.observability.metrics import Metrics
from telerag.server.openapi import extend_schema
from telerag.server.process.lifecycle import Lifecycle
from telerag.server.protocols.common import default_max_tokens
from telerag.server.protocols.documents import documents_request_models
from telerag.server.protocols.embeddings import embedding_request_model
from telerag.server.protocols.openai import chat_request_model
from telerag.server.protocols.rag import query_request_model
from telerag.server.protocols.responses import response_request_model
from telerag.server.protocols.vector_stores import search_request_model
from telerag.server.routes import (
    datastore,
    documents,
    embeddings,
    files,
    openai,
    ops,
    rag,
    responses,
    vector_store_files,
    vector_stores,
)
from telerag.server.service import Service

if TYPE_CHECKING:
    from telerag.server.service import ServedRuntime

MULTIPART_OVERHEAD_BYTES = 64 * 1024  # a file upload's body: the file, its form's other fields and boundaries


def create_app(settings: Settings, lifecycle: Lifecycle | None = None) -> FastAPI:
    """The HTTP API, before anything is loaded: `/health` answers at once, `/ready` and `/v1/*`
    answer 503 until `start_serving` hands it a loaded runtime."""
    lifecycle = lifecycle or Lifecycle()
    # the request models carry the configured limits and the pipelines
    query, chat = query_request_model(settings.limits, list(PIPELINES)), chat_request_model(settings.limits, list(PIPELINES))
    access = Access.from_settings(settings.server)
    # the documentation routes are ours (routes/ops.py), so that they can sit behind the API key
    app = FastAPI(
        title="telerag",
        version="0.1.0",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        description="RAG inference server with lookahead retrieval (TeleRAG). Every error, whatever its "
        'status, has the body `{"error": {"type", "message", "code", "field"?, "param"?}}` (ErrorResponse); '
        "on the OpenAI routes `type` is OpenAI's class of error and `code` the reason.",
    )
    app.state.lifecycle = lifecycle
    app.state.service = None
    app.state.tiers = None  # on a Ray cluster: what each tier's deployments run (server.ray_serve.applications)
    app.state.metrics = Metrics(
        lambda: app.state.service.runtime.cache_stats() if app.state.service else CacheStats(),
        lambda: app.state.service.runtime.prefix_cache_bytes() if app.state.service else None,
        lambda: app.state.service.live_report() if app.state.service else None,
        lambda: app.state.service.runtime.search_recall() if app.state.service else None,
    )
    app.state.started = int(time.time())  # when /v1/models says its models were created
    app.state.default_max_tokens = default_max_tokens(settings.limits)  # a chat completion's, as a query's
    app.state.files = FileStore(
        settings.files.dir, max_bytes=settings.files.max_bytes, max_bytes_per_owner=settings.files.max_bytes_per_key
    )
    app.state.vector_stores = VectorStores(  # served once a runtime gives them its embedder (`publish`)
        settings.vector_stores.dir,
        app.state.files,
        max_stores=settings.vector_stores.max_stores_per_key,
        max_bytes=settings.vector_stores.max_bytes_per_key,
        compact_share=settings.documents.compact_share,
        batching=Batching(
            settings.scheduler.batch_window_ms,
            settings.scheduler.max_batch,
            lambda size: app.state.metrics.batch_size.labels("file_search").observe(size),
        ),
    )
    extend_schema(app, rag.STREAMED + openai.STREAMED + responses.STREAMED)
    errors.install(app)
    app.add_middleware(ServingGate, lifecycle=lifecycle)
    app.add_middleware(
        BodyLimit,
        limit=settings.limits.max_body_bytes,
        larger={
            **dict.fromkeys((documents.DOCUMENTS, documents.UPLOADS), settings.documents.max_body_bytes),
            files.FILES: settings.files.max_bytes + MULTIPART_OVERHEAD_BYTES,
        },
    )
    if settings.server.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.server.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-ID", "Retry-After"],
        )
    app.add_middleware(
        ErrorDialect, openai_paths=openai.PATHS | responses.PATHS | embeddings.PATHS | files.PATHS | vector_stores.PATHS
    )  # before the refusals above are made
    app.add_middleware(RequestId)  # outermost: every response, refusals included, carries the id
    app.include_router(ops.router(access))
    app.include_router(rag.router(query, access))
    app.include_router(openai.router(chat, access))
    app.include_router(responses.router(response_request_model(settings.limits, list(PIPELINES)), access))
    app.include_router(embeddings.router(embedding_request_model(settings.limits), access))
    app.include_router(documents.router(*documents_request_models(settings.documents), access, settings.documents))
    app.include_router(datastore.router(access))
    app.include_router(files.router(access, settings.files))
    app.include_router(vector_stores.router(access, search_request_model(settings.limits)))
    app.include_router(vector_store_files.router(access))
    return app


@runtime_checkable
class EmbedsInProcess(Protocol):
    """A runtime whose embedder runs in this process (`runtime.Runtime`), which the vector stores use."""

    store_resources: StoreResources | None


def start_serving(app: FastAPI, runtime: ServedRuntime) -> Service:
    """Serve `/v1/*` from `runtime`, now loaded (not warmed up): `/ready` turns 200."""
    return publish(app, Service(runtime, app.state.metrics))


def publish(app: FastAPI, service: Service) -> Service:
    """Serve `/v1/*` from `service` (made with `app.state.metrics`): `/ready` turns 200. The vector
    stores are served with its runtime's embedder, where it runs in this process."""
    runtime = service.runtime
    app.state.vector_stores.serve(runtime.store_resources if isinstance(runtime, EmbedsInProcess) else None)
    app.state.service = service
    app.state.lifecycle.ready()
    return service
