"""The one place where errors become HTTP responses: a status code per error type and one JSON
shape, `{"error": {"type", "message", "field"?}}`."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from telerag.pipelines.errors import (
    EmbedderError,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    GenerationAborted,
    PipelineError,
    UnknownPipeline,
)
from telerag.retrieval.errors import DatastoreError, RetrievalError, SearchError

log = logging.getLogger(__name__)


class ServerError(Exception):
    code = "server_error"


class Overloaded(ServerError):
    """The queue is full; the client should retry after `retry_after` seconds."""

    code = "overloaded"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TooManyConnections(ServerError):
    """A connection opened past `server.max_connections` asked for something other than a probe."""

    code = "too_many_connections"


class Unauthorized(ServerError):
    code = "unauthorized"


class NotReady(ServerError):
    """Still loading, or draining before shutdown: come back (or go elsewhere) after `retry_after` s."""

    code = "not_ready"

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeout(ServerError):
    code = "timeout"


class InvalidField(ServerError):
    """A request field has a value the server cannot serve (e.g. nprobe above nlist)."""

    code = "invalid_request"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


STATUS: list[tuple[type[Exception], int]] = [
    (InvalidField, 422),
    (UnknownPipeline, 422),
    (SearchError, 422),
    (Unauthorized, 401),
    (Overloaded, 429),
    (EngineOverloaded, 429),
    (GenerationAborted, 503),
    (NotReady, 503),
    (TooManyConnections, 503),
    (RequestTimeout, 504),
    (EngineUnavailable, 503),
    (EmbedderError, 503),
    (DatastoreError, 503),
    (EngineError, 502),
    (PipelineError, 500),
    (RetrievalError, 500),
]


def status_of(exc: BaseException) -> int:
    return next((status for cls, status in STATUS if isinstance(exc, cls)), 500)


def error_body(exc: BaseException) -> dict:
    body: dict = {"type": getattr(exc, "code", "internal_error"), "message": str(exc) or type(exc).__name__}
    if isinstance(exc, InvalidField):
        body["field"] = exc.field
    return {"error": body}


def response_for(exc: BaseException) -> JSONResponse:
    status = status_of(exc)
    if status >= 500 and not isinstance(exc, NotReady):  # loading and draining are states, not failures
        log.error("request failed: %s", exc, exc_info=exc)
    retry_after = getattr(exc, "retry_after", 1 if status == 429 else None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    if isinstance(exc, Unauthorized):
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(error_body(exc), status_code=status, headers=headers)


def _validation_response(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    field = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    message = f"{field}: {first.get('msg')}" if field else str(first.get("msg"))
    return JSONResponse({"error": {"type": "invalid_request", "message": message, "field": field}}, status_code=422)


def install(app: FastAPI) -> None:
    """Register the handlers on `app`."""
    app.add_exception_handler(RequestValidationError, _validation_response)
    for cls in (ServerError, PipelineError, RetrievalError):
        app.add_exception_handler(cls, lambda _request, exc: response_for(exc))
