"""What operators and tools call: `/health`, `/ready`, `/metrics`, and the documentation
(`/openapi.json`, `/docs`, `/redoc`, ours so that they can sit behind the API key). These answer
whether or not the server is ready. (The endpoints have no docstrings: FastAPI would publish
them in the schema.)"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from telerag.pipelines.types import DatastoreInfo
from telerag.server import errors
from telerag.server.auth import Access
from telerag.server.process.lifecycle import Phase
from telerag.server.protocols.documents import live_info
from telerag.server.protocols.ops import Health, LiveInfo, LoadProgress, Ready
from telerag.server.service import Service

METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}
}


def router(access: Access) -> APIRouter:
    """The routes, the documentation and metrics behind `access.docs`."""
    routes = APIRouter()
    for path, endpoint in (("/openapi.json", openapi), ("/docs", docs), ("/redoc", redoc)):
        routes.add_api_route(path, endpoint, methods=["GET"], include_in_schema=False, dependencies=access.docs)
    routes.add_api_route("/health", health, methods=["GET"], response_model=Health)
    routes.add_api_route(
        "/ready",
        ready,
        methods=["GET"],
        response_model=Ready,
        responses={503: {"model": Ready, "description": "loading or draining"}},
    )
    routes.add_api_route(
        "/metrics",
        metrics,
        methods=["GET"],
        dependencies=access.docs,
        response_class=PlainTextResponse,
        responses={**METRICS_RESPONSES, **errors.responses(*access.docs_errors)},
    )
    return routes


async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


async def docs() -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title="telerag API")


async def redoc() -> HTMLResponse:
    return get_redoc_html(openapi_url="/openapi.json", title="telerag API")


async def health() -> Health:
    return Health()


async def ready(request: Request) -> Response:
    lifecycle, service = request.app.state.lifecycle, request.app.state.service
    progress, loading, now = lifecycle.progress, lifecycle.phase == Phase.LOADING, time.monotonic()
    tiers = await request.app.state.tiers() if request.app.state.tiers is not None else None
    body = Ready(
        ready=lifecycle.phase == Phase.READY and all(tier.running > 0 for tier in tiers or ()),
        status=lifecycle.phase.value,
        loading=lifecycle.step if loading else None,
        progress=None
        if progress is None
        else LoadProgress(
            task=progress.step,
            done=progress.done,
            total=progress.total,
            unit=progress.unit,
            fraction=progress.fraction,
        ),
        loading_s=round(now - lifecycle.started, 1) if loading else None,
        step_s=round(now - lifecycle.step_started, 1) if loading else None,
        engine=None if service is None else service.runtime.engine_name,
        datastore=None if service is None else _datastore(service),
        cache=None if service is None else service.runtime.cache_stats(),
        recall=None if service is None else service.runtime.search_recall(),
        live=None if service is None else _live(service),
        tiers=tiers,
    )
    one_process = {"tiers"} if tiers is None else None  # its body as it was before the tiers
    return Response(
        body.model_dump_json(exclude=one_process), media_type="application/json", status_code=200 if body.ready else 503
    )


def _datastore(service: Service) -> DatastoreInfo:
    """The datastore as loaded, its counts as they are now (documents come and go)."""
    info, stats = service.runtime.datastore_info, service.live_stats()
    return info if stats is None else dataclasses.replace(info, passages=stats.passages, documents=stats.documents)


def _live(service: Service) -> LiveInfo | None:
    writer = service.runtime.documents
    return None if writer is None else live_info(writer, service.ingestion_progress())


async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
