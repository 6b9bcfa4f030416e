"""The OpenAI-compatible API: `POST /v1/chat/completions` (a pipeline answers the last user
message; JSON, or chunks as OpenAI streams them) and `GET /v1/models` (the pipelines). (The
endpoints have no docstrings: FastAPI would publish them in the schema.)"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel

from telerag.pipelines.types import ResultEvent, RunEvent, TokenEvent
from telerag.server import errors
from telerag.server.admitted_run import EventStream
from telerag.server.auth import Access
from telerag.server.protocol import (
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ErrorResponse,
    Model,
    ModelList,
    RequestModels,
    finish_reason,
)
from telerag.server.routes.responses import generation_errors, json_or_events
from telerag.server.routes.signature import typed
from telerag.server.service import Service, serving
from telerag.server.streaming import event_schema, json_data, sse_data

CHAT_EVENTS = """JSON, or with `"stream": true` server-sent events as OpenAI sends them: unnamed
events whose data is a ChatCompletionChunk (the first delta sets the role, the next ones add
content, the last has `finish_reason`), then `[DONE]`; a failure after the stream began comes
as `{"error": ErrorDetail}` before `[DONE]`."""
CHAT_STREAM = event_schema({"message": {"anyOf": [{"const": "[DONE]"}, json_data(ChatCompletionChunk, ErrorResponse)]}})
STREAMED: list[type[BaseModel]] = [ChatCompletionChunk, ErrorResponse]  # the models the stream's schema refers to


def router(models: RequestModels, access: Access) -> APIRouter:
    """The routes, with this app's request model and access."""
    routes = APIRouter()
    routes.add_api_route(
        "/v1/models",
        list_models,
        methods=["GET"],
        response_model=ModelList,
        dependencies=access.api,
        responses=errors.responses(*access.api_errors, 503),
        summary="The models a chat completion may name: the pipelines (OpenAI's model list)",
    )
    routes.add_api_route(
        "/v1/chat/completions",
        typed(chat_completions, body=models.chat, client=access.client_parameter()),
        methods=["POST"],
        responses={**json_or_events(ChatCompletion, CHAT_STREAM, CHAT_EVENTS), **generation_errors(access)},
    )
    return routes


async def list_models(request: Request, service: Service = Depends(serving)) -> ModelList:
    return ModelList(data=[Model(id=name, created=request.app.state.started) for name in service.pipelines])


async def chat_completions(
    body: ChatCompletionRequest, request: Request, client: str | None, service: Service = Depends(serving)
) -> Response:
    question = body.question
    limits = [n for n in (body.max_tokens, body.max_completion_tokens) if n is not None]  # both: the tighter honours both
    max_tokens = min(limits) if limits else request.app.state.default_max_tokens
    options = service.options(top_k=None, nprobe=None, max_tokens=max_tokens, temperature=body.temperature)
    run = service.admit(
        request, service.pipelines[body.model], question, options, client, query_field="messages", top_k_field=None
    )
    request_id = f"chatcmpl-{request.state.request_id}"
    if body.stream:
        return await run.stream(chunks(request_id, body.model))
    return await run.respond(lambda result: ChatCompletion.from_result(result, request_id=request_id, model=body.model))


def chunks(request_id: str, model: str) -> EventStream:
    """A run as OpenAI streams a completion: the role, the pieces of content, `finish_reason`, `[DONE]`."""

    def chunk(delta: ChatDelta, finish_reason: str | None = None) -> bytes:
        choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
        return sse_data(ChatCompletionChunk(id=request_id, model=model, choices=[choice]).model_dump())

    async def events(run: AsyncIterator[RunEvent]) -> AsyncGenerator[bytes, None]:
        yield chunk(ChatDelta(role="assistant", content=""))
        reason = "stop"
        async for event in run:
            if isinstance(event, TokenEvent):
                yield chunk(ChatDelta(content=event.text))
            elif isinstance(event, ResultEvent):
                reason = finish_reason(event.result)
        yield chunk(ChatDelta(), finish_reason=reason)

    return EventStream(
        events=events,
        error=lambda detail: sse_data(ErrorResponse(error=detail).model_dump(exclude_none=True)),
        end=sse_data("[DONE]"),
    )
