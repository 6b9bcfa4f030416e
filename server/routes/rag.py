"""Our API: `POST /v1/rag/query`, answered as JSON or as server-sent events, and
`GET /v1/pipelines`. (The endpoints have no docstrings: FastAPI would publish them in the schema.)"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel

from telerag.documents.ingestion import IngestionProgress
from telerag.pipelines.types import RagResult, ResultEvent, RunEvent, StageEvent, TokenEvent
from telerag.server import errors
from telerag.server.admission.admitted_run import EventStream
from telerag.server.auth import Access
from telerag.server.protocols.common import ErrorDetail
from telerag.server.protocols.ops import IngestionInfo, PipelineInfo, PipelineList, StageInfo
from telerag.server.protocols.rag import QueryRequest, QueryResponse, StageUpdate, TokenText
from telerag.server.routes.documented import generation_errors, json_or_events
from telerag.server.routes.signature import typed
from telerag.server.service import Service, serving
from telerag.server.streaming import event_schema, json_data, sse

QUERY_EVENTS = """JSON, or with `"stream": true` server-sent events: first, while the datastore's
corpus is still being written into it, `ingestion` (IngestionInfo: how much of it the answer
searched); `stage` (StageUpdate) as each stage starts and ends, `token` (TokenText) for each piece
of the answer, and last either `result` (the QueryResponse) or, if the run fails after the stream
began, `error` (ErrorDetail)."""
QUERY_STREAM = event_schema(
    {
        "ingestion": json_data(IngestionInfo),
        "stage": json_data(StageUpdate),
        "token": json_data(TokenText),
        "result": json_data(QueryResponse),
        "error": json_data(ErrorDetail),
    }
)
STREAMED: list[type[BaseModel]] = [
    IngestionInfo,
    StageUpdate,
    TokenText,
    QueryResponse,
    ErrorDetail,
]  # the models the stream's schema refers to


def router(query: type[QueryRequest], access: Access) -> APIRouter:
    """The routes, with this app's request model and access."""
    routes = APIRouter()
    routes.add_api_route(
        "/v1/pipelines",
        pipelines,
        methods=["GET"],
        response_model=PipelineList,
        dependencies=access.api,
        responses=errors.responses(*access.api_errors, 503),
    )
    routes.add_api_route(
        "/v1/rag/query",
        typed(rag_query, body=query, client=access.client_parameter()),
        methods=["POST"],
        responses={**json_or_events(QueryResponse, QUERY_STREAM, QUERY_EVENTS), **generation_errors(access)},
    )
    return routes


async def pipelines(service: Service = Depends(serving)) -> PipelineList:
    return PipelineList(
        pipelines=[
            PipelineInfo(name=name, description=p.description, stages=[StageInfo(name=s.name, role=s.role) for s in p.stages])
            for name, p in service.pipelines.items()
        ]
    )


async def rag_query(body: QueryRequest, request: Request, client: str | None, service: Service = Depends(serving)) -> Response:
    options = service.options(
        top_k=body.top_k,
        nprobe=body.nprobe,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        prefetch=body.prefetch,
        pipelining=body.pipelining,
        speculative_prefill=body.speculative_prefill,
        search_mode=body.search_mode,
    )
    run = service.admit(request, service.pipelines[body.pipeline], body.query, options, client)
    request_id = f"rag-{request.state.request_id}"
    ingestion = service.ingesting()
    answer = functools.partial(
        QueryResponse.from_result, request_id=request_id, with_documents=body.return_documents, ingestion=ingestion
    )
    if body.stream:
        events = functools.partial(query_events, answer=answer, ingestion=ingestion)
        return await run.stream(
            EventStream(events=events, error=lambda detail: sse("error", detail.model_dump(exclude_none=True)))
        )
    return await run.respond(answer)


async def query_events(
    events: AsyncIterator[RunEvent], *, answer: Callable[[RagResult], QueryResponse], ingestion: IngestionProgress | None
) -> AsyncGenerator[bytes, None]:
    """A run's events as our stream sends them: `ingestion` while the datastore is being written,
    `stage`, `token`, and last `result` (`answer`)."""
    if ingestion is not None:
        yield sse("ingestion", IngestionInfo.of(ingestion).model_dump())
    async for event in events:
        if isinstance(event, StageEvent):
            yield sse(
                "stage", StageUpdate(stage=event.stage.name, role=event.stage.role, status=event.status, ms=event.ms).model_dump()
            )
        elif isinstance(event, TokenEvent):
            yield sse("token", TokenText(text=event.text).model_dump())
        elif isinstance(event, ResultEvent):
            yield sse("result", answer(event.result).model_dump())
