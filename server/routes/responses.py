"""OpenAI's Responses API: `POST /v1/responses`, the SDK's primary API (a pipeline answers the
last user message; one response object, or the API's events as they come). (The endpoint has no
docstring: FastAPI would publish it in the schema.)"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel

from telerag.pipelines.types import ResultEvent, RunEvent, TokenEvent
from telerag.server.admission.admitted_run import EventStream
from telerag.server.auth import Access
from telerag.server.protocols.common import ErrorDetail
from telerag.server.protocols.file_search import FileSearchCall
from telerag.server.protocols.response_events import (
    AnnotationAddedEvent,
    ContentPartEvent,
    ErrorEvent,
    FileSearchCallEvent,
    OutputItemEvent,
    ResponseEvent,
    ResponseLifecycleEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from telerag.server.protocols.responses import (
    FILE_SEARCH_RESULTS,
    FileSearchOutput,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseRequest,
)
from telerag.server.routes.documented import TOOL_ERRORS, generation_errors, json_or_events
from telerag.server.routes.openai import admit
from telerag.server.routes.signature import typed
from telerag.server.service import Service, serving
from telerag.server.streaming import event_schema, json_data, sse

RESPONSES = "/v1/responses"
PATHS = frozenset({RESPONSES})  # its errors speak OpenAI's dialect (middleware.ErrorDialect)
EVENTS: dict[str, type[ResponseEvent]] = {
    "response.created": ResponseLifecycleEvent,
    "response.in_progress": ResponseLifecycleEvent,
    "response.output_item.added": OutputItemEvent,
    "response.file_search_call.in_progress": FileSearchCallEvent,
    "response.file_search_call.searching": FileSearchCallEvent,
    "response.content_part.added": ContentPartEvent,
    "response.output_text.delta": TextDeltaEvent,
    "response.file_search_call.completed": FileSearchCallEvent,
    "response.output_text.done": TextDoneEvent,
    "response.output_text.annotation.added": AnnotationAddedEvent,
    "response.content_part.done": ContentPartEvent,
    "response.output_item.done": OutputItemEvent,
    "response.completed": ResponseLifecycleEvent,
    "response.incomplete": ResponseLifecycleEvent,
    "error": ErrorEvent,
}
RESPONSE_EVENTS = """JSON, or with `"stream": true` the Responses API's server-sent events, in this order:
response.created, response.in_progress, response.output_item.added, response.content_part.added,
response.output_text.delta (a piece of the answer, as generated), response.output_text.done,
response.content_part.done, response.output_item.done, then response.completed (or
response.incomplete when the token limit cut the answer). With a file_search tool, the call is
output item 0 and the message item 1: the call's item is added, then
response.file_search_call.in_progress and .searching, before the message's events; once the run
has ended, response.file_search_call.completed and the call's response.output_item.done (its
queries, and its results when `include` asks), then the message's text done,
response.output_text.annotation.added for each file cited, and the message's item done. A
failure after the stream began is an `error` event, the last."""
RESPONSE_STREAM = event_schema({name: json_data(model) for name, model in EVENTS.items()})
STREAMED: list[type[BaseModel]] = list(dict.fromkeys(EVENTS.values()))  # the models the stream's schema refers to


def router(body: type[ResponseRequest], access: Access) -> APIRouter:
    """The route, with this app's request model and access."""
    routes = APIRouter()
    routes.add_api_route(
        RESPONSES,
        typed(create_response, body=body, client=access.client_parameter()),
        methods=["POST"],
        responses={**json_or_events(ResponseObject, RESPONSE_STREAM, RESPONSE_EVENTS), **generation_errors(access, *TOOL_ERRORS)},
    )
    return routes


async def create_response(
    body: ResponseRequest, request: Request, client: str | None, service: Service = Depends(serving)
) -> Response:
    tool = body.file_search
    stores = (
        None
        if tool is None
        else await asyncio.to_thread(tool.retriever, request.app.state.vector_stores, client, service.ranking)
    )
    run = admit(service, request, body, client, stores)
    ingestion = service.ingesting() if stores is None else None  # a file_search tool's answer searched no datastore
    begun = ResponseObject.begun(body, response_id=f"resp_{request.state.request_id}", ingestion=ingestion)
    message_id = f"msg_{request.state.request_id}"
    file_search = (
        None
        if stores is None
        else FileSearchOutput(f"fs_{request.state.request_id}", stores, with_results=FILE_SEARCH_RESULTS in (body.include or ()))
    )
    if body.stream:
        return await run.stream(events(begun, message_id, with_documents=body.return_documents, file_search=file_search))
    return await run.respond(
        lambda result: begun.finished(
            result, message_id=message_id, with_documents=body.return_documents, file_search=file_search
        )
    )


def events(
    begun: ResponseObject, message_id: str, *, with_documents: bool, file_search: FileSearchOutput | None = None
) -> EventStream:
    """A run as the Responses API streams one: the response begun, its message and text part
    opened (after the file search's call, if any, is opened), the text's pieces, everything
    closed again, the response finished."""
    numbers = itertools.count()

    def event(kind: str, **fields: object) -> bytes:
        data = EVENTS[kind](type=kind, sequence_number=next(numbers), **fields)
        return sse(kind, data.model_dump())

    async def stream(run: AsyncIterator[RunEvent]) -> AsyncGenerator[bytes, None]:
        index = 0 if file_search is None else 1  # the message's
        message = OutputMessage(id=message_id, status="in_progress", content=[])
        where = {"item_id": message_id, "output_index": index, "content_index": 0}
        yield event("response.created", response=begun)
        yield event("response.in_progress", response=begun)
        if file_search is not None:
            call = {"item_id": file_search.call_id, "output_index": 0}
            yield event(
                "response.output_item.added", output_index=0, item=FileSearchCall(id=file_search.call_id, status="in_progress")
            )
            yield event("response.file_search_call.in_progress", **call)
            yield event("response.file_search_call.searching", **call)
        yield event("response.output_item.added", output_index=index, item=message)
        yield event("response.content_part.added", **where, part=OutputText(text=""))
        result = None
        async for item in run:
            if isinstance(item, TokenEvent):
                yield event("response.output_text.delta", **where, delta=item.text)
            elif isinstance(item, ResultEvent):
                result = item.result
        if result is None:  # the run ended without a result: its error follows
            return
        finished = begun.finished(result, message_id=message_id, with_documents=with_documents, file_search=file_search)
        answer = finished.output[index]
        assert isinstance(answer, OutputMessage)
        if file_search is not None:
            yield event("response.file_search_call.completed", **call)
            yield event("response.output_item.done", output_index=0, item=finished.output[0])
        yield event("response.output_text.done", **where, text=result.answer)
        for at, citation in enumerate(answer.content[0].annotations):
            yield event("response.output_text.annotation.added", **where, annotation_index=at, annotation=citation)
        yield event("response.content_part.done", **where, part=answer.content[0])
        yield event("response.output_item.done", output_index=index, item=answer)
        yield event(f"response.{finished.status}", response=finished)

    def error(detail: ErrorDetail) -> bytes:
        failure = ErrorEvent(
            type="error", sequence_number=next(numbers), code=detail.code, message=detail.message, param=detail.param
        )
        return sse("error", failure.model_dump())

    return EventStream(events=stream, error=error)
