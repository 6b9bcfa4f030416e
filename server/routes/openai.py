"""OpenAI's chat API: `POST /v1/chat/completions` (a pipeline answers the last user message;
JSON, or chunks as OpenAI streams them) and `GET /v1/models` (the pipelines). (The
endpoints have no docstrings: FastAPI would publish them in the schema.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel

from telerag.documents.ingestion import IngestionProgress
from telerag.file_search.store_retriever import StoresRetriever
from telerag.pipelines.types import ResultEvent, RunEvent, TokenEvent
from telerag.server import errors
from telerag.server.admission.admitted_run import AdmittedRun, EventStream
from telerag.server.auth import Access
from telerag.server.protocols.common import ErrorResponse, passages_out
from telerag.server.protocols.conversation import Conversation
from telerag.server.protocols.openai import (
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Model,
    ModelList,
    Usage,
    finish_reason,
)
from telerag.server.protocols.ops import IngestionInfo
from telerag.server.routes.documented import TOOL_ERRORS, generation_errors, json_or_events
from telerag.server.routes.signature import typed
from telerag.server.service import Service, serving
from telerag.server.streaming import event_schema, json_data, sse_data

CHAT_EVENTS = """JSON, or with `"stream": true` server-sent events as OpenAI sends them: unnamed
events whose data is a ChatCompletionChunk (the first delta sets the role, the next ones add
content, the last has `finish_reason`), then `[DONE]`; a failure after the stream began comes
as `{"error": ErrorDetail}` before `[DONE]`."""
CHAT_STREAM = event_schema({"message": {"anyOf": [{"const": "[DONE]"}, json_data(ChatCompletionChunk, ErrorResponse)]}})
MODELS, CHAT = "/v1/models", "/v1/chat/completions"
PATHS = frozenset({MODELS, CHAT})  # their errors speak OpenAI's dialect (middleware.ErrorDialect)
STREAMED: list[type[BaseModel]] = [ChatCompletionChunk, ErrorResponse]  # the models the stream's schema refers to


def router(chat: type[ChatCompletionRequest], access: Access) -> APIRouter:
    """The routes, with this app's request model and access."""
    routes = APIRouter()
    routes.add_api_route(
        MODELS,
        list_models,
        methods=["GET"],
        response_model=ModelList,
        dependencies=access.api,
        responses=errors.responses(*access.api_errors, 503),
        summary="The models a chat completion may name: the pipelines (OpenAI's model list)",
    )
    routes.add_api_route(
        CHAT,
        typed(chat_completions, body=chat, client=access.client_parameter()),
        methods=["POST"],
        responses={**json_or_events(ChatCompletion, CHAT_STREAM, CHAT_EVENTS), **generation_errors(access, *TOOL_ERRORS)},
    )
    return routes


async def list_models(request: Request, service: Service = Depends(serving)) -> ModelList:
    return ModelList(data=[Model(id=name, created=request.app.state.started) for name in service.pipelines])


def admit(
    service: Service, request: Request, body: Conversation, client: str | None, stores: StoresRetriever | None = None
) -> AdmittedRun:
    """A chat completion's or a response's run, admitted (or refused at once, naming the
    request's own fields): its question, instructions, history, sampling and token limit; with
    a `file_search` tool, its pipeline retrieves from the tool's `stores`."""
    limit = body.token_limit
    tool = body.file_search
    options = service.options(
        top_k=None if tool is None else tool.max_num_results,
        nprobe=None,
        max_tokens=limit or request.app.state.default_max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stop=body.stops,
        instructions=body.instructions_for_answer,
        history=body.history,
    )
    pipeline = service.pipelines[body.model]
    return service.admit(
        request,
        pipeline if stores is None else pipeline.over(stores),
        body.question,
        options,
        client,
        query_field=body.QUERY_FIELD,
        top_k_field=None if tool is None or tool.max_num_results is None else "tools.0.max_num_results",
    )


async def chat_completions(
    body: ChatCompletionRequest, request: Request, client: str | None, service: Service = Depends(serving)
) -> Response:
    tool = body.file_search
    stores = (
        None
        if tool is None
        else await asyncio.to_thread(tool.retriever, request.app.state.vector_stores, client, service.ranking)
    )
    run = admit(service, request, body, client, stores)
    request_id = f"chatcmpl-{request.state.request_id}"
    ingestion = service.ingesting() if stores is None else None  # a file_search tool's answer searched no datastore
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return await run.stream(
            chunks(request_id, body.model, with_documents=body.return_documents, with_usage=usage, ingestion=ingestion)
        )
    return await run.respond(
        lambda result: ChatCompletion.from_result(
            result, request_id=request_id, model=body.model, with_documents=body.return_documents, ingestion=ingestion
        )
    )


def chunks(
    request_id: str, model: str, *, with_documents: bool, with_usage: bool, ingestion: IngestionProgress | None
) -> EventStream:
    """A run as OpenAI streams a completion: the role (with `ingestion`, an extension, while the
    datastore is being written), the pieces of content, `finish_reason` (with the documents, an
    extension), the usage when asked for (`stream_options`), `[DONE]`."""
    extensions = ("documents", "usage", "ingestion")

    def chunk(choices: list[ChatChunkChoice], **extra: Any) -> bytes:
        data = ChatCompletionChunk(id=request_id, model=model, choices=choices, **extra)
        return sse_data(data.model_dump(exclude={name for name in extensions if getattr(data, name) is None}))

    async def events(run: AsyncIterator[RunEvent]) -> AsyncGenerator[bytes, None]:
        first = ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))
        yield chunk([first], ingestion=None if ingestion is None else IngestionInfo.of(ingestion))
        result = None
        async for event in run:
            if isinstance(event, TokenEvent):
                yield chunk([ChatChunkChoice(delta=ChatDelta(content=event.text))])
            elif isinstance(event, ResultEvent):
                result = event.result
        reason = "stop" if result is None else finish_reason(result)
        documents = passages_out(result.documents) if result is not None and with_documents else None
        yield chunk([ChatChunkChoice(delta=ChatDelta(), finish_reason=reason)], documents=documents)
        if with_usage and result is not None:
            yield chunk([], usage=Usage.of(result))

    return EventStream(
        events=events,
        error=lambda detail: sse_data(ErrorResponse(error=detail).model_dump(exclude_none=True)),
        end=sse_data("[DONE]"),
    )
