"""The server-sent events of a streamed response (`POST /v1/responses` with `"stream": true`), in
the order and shape the Responses API sends them (`routes/responses.py` sends them)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from telerag.server.protocols.file_search import FileCitation, FileSearchCall
from telerag.server.protocols.responses import OutputMessage, OutputText, ResponseObject


class ResponseEvent(BaseModel):
    """An event of a streamed response; `type` is also the SSE event's name."""

    type: str
    sequence_number: int


class ResponseLifecycleEvent(ResponseEvent):
    """response.created, response.in_progress, response.completed, response.incomplete."""

    response: ResponseObject


class OutputItemEvent(ResponseEvent):
    """response.output_item.added, response.output_item.done."""

    output_index: int = 0
    item: FileSearchCall | OutputMessage


class FileSearchCallEvent(ResponseEvent):
    """response.file_search_call.in_progress, .searching, .completed: the call's progress."""

    item_id: str
    output_index: int = 0


class PartEvent(ResponseEvent):
    """An event of the one text part of the one message: where it is."""

    item_id: str
    output_index: int = 0
    content_index: int = 0


class ContentPartEvent(PartEvent):
    """response.content_part.added, response.content_part.done."""

    part: OutputText


class TextDeltaEvent(PartEvent):
    """response.output_text.delta: the next piece of the answer."""

    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class AnnotationAddedEvent(PartEvent):
    """response.output_text.annotation.added: a citation of the answer's text."""

    annotation_index: int
    annotation: FileCitation


class TextDoneEvent(PartEvent):
    """response.output_text.done: the whole answer."""

    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ErrorEvent(ResponseEvent):
    """error: the run failed after the stream began (its last event)."""

    code: str | None
    message: str
    param: str | None = None
