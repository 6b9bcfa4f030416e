"""The one place where errors become HTTP responses: a status code per error type and one JSON
shape, `{"error": {"type", "message", "field"?}}`."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from telerag.pipelines.errors import (
    EmbedderError,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    GenerationAborted,
    PipelineError,
    UnknownPipeline,
)
from telerag.retrieval.errors import DatastoreError, DeviceUnavailable, RetrievalError, SearchError
from telerag.server.protocol import ErrorDetail, ErrorResponse

log = logging.getLogger(__name__)


class ServerError(Exception):
    """Base class of the server's own errors; `code` is the body's `error.type`."""

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


class InvalidJSON(ServerError):
    """The body could not be read as JSON: not JSON, not UTF-8, or nested too deep."""

    code = "invalid_json"


class BodyTooLarge(ServerError):
    code = "body_too_large"


STATUS: list[tuple[type[Exception], int]] = [
    (InvalidJSON, 400),
    (InvalidField, 422),
    (UnknownPipeline, 422),
    (SearchError, 422),
    (Unauthorized, 401),
    (BodyTooLarge, 413),
    (Overloaded, 429),
    (EngineOverloaded, 429),
    (GenerationAborted, 503),
    (NotReady, 503),
    (TooManyConnections, 503),
    (RequestTimeout, 504),
    (EngineUnavailable, 503),
    (EmbedderError, 503),
    (DatastoreError, 503),
    (DeviceUnavailable, 503),
    (EngineError, 502),
    (PipelineError, 500),
    (RetrievalError, 500),
]
RETRY_AFTER_S = 1  # for a 429 or 503 whose error does not say
WHEN = {  # what each status means, for the OpenAPI schema
    400: "The body is not JSON (or not UTF-8, or nested too deep).",
    401: "Missing or wrong API key (`Authorization: Bearer <key>`).",
    413: "The body is over the server's `limits.max_body_bytes`.",
    422: "A field is invalid or out of the server's limits; `error.field` names it.",
    429: "Busy: retry after `Retry-After` seconds.",
    502: "The LLM engine failed.",
    503: "Not ready (loading) or a component is unavailable: retry after `Retry-After` seconds.",
    504: "The request took longer than `scheduler.request_timeout_s`.",
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}, "required": True}}
_HEADERS = {401: {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}, "required": True}},
            429: _RETRY_AFTER, 503: _RETRY_AFTER}


def status_of(exc: BaseException) -> int:
    return next((status for cls, status in STATUS if isinstance(exc, cls)), 500)


def error_detail(exc: BaseException) -> ErrorDetail:
    return ErrorDetail(type=getattr(exc, "code", "internal_error"), message=str(exc) or type(exc).__name__,
                       field=getattr(exc, "field", None) or None)


def error_response(status: int, detail: ErrorDetail, headers: dict[str, str] | None = None) -> JSONResponse:
    """The one error body, with `Retry-After` on every 429 and 503."""
    headers = dict(headers or {})
    if status in (429, 503):
        headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    return JSONResponse(ErrorResponse(error=detail).model_dump(exclude_none=True), status_code=status, headers=headers)


def response_for(exc: BaseException) -> JSONResponse:
    status = status_of(exc)
    if status >= 500 and not isinstance(exc, NotReady):  # loading and draining are states, not failures
        log.error("request failed: %s", exc, exc_info=exc)
    retry_after = getattr(exc, "retry_after", 1 if status == 429 else None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return error_response(status, error_detail(exc), headers)


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` of these error statuses: the error model, what it means, its headers."""
    return {status: {"model": ErrorResponse, "description": WHEN[status]} | ({"headers": _HEADERS[status]} if status in _HEADERS else {})
            for status in statuses}


def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return response_for(InvalidJSON(f"the body is not valid JSON: {reason}"))
    field = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    message = f"{field}: {first.get('msg')}" if field else str(first.get("msg"))
    return response_for(InvalidField(field, message))


def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own errors: 404 (no route), 405 (wrong method, with `Allow`),
    and 400 when FastAPI cannot parse the body (not UTF-8, nested too deep)."""
    if exc.status_code == 400:
        return response_for(InvalidJSON("the body could not be parsed as JSON: it is not UTF-8 or is nested too deeply"))
    message = {
        404: f"no route {request.url.path}",
        405: f"{request.method} is not allowed on {request.url.path} (allowed: {(exc.headers or {}).get('Allow', '')})",
    }.get(exc.status_code, str(exc.detail))
    code = HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_")
    return error_response(exc.status_code, ErrorDetail(type=code, message=message), exc.headers)


def _unhandled(_: Request, exc: Exception) -> JSONResponse:
    """A bug: 500 with the one error body and nothing of the exception (the server logs it)."""
    return error_response(500, ErrorDetail(type="internal_error", message="internal server error"))


def install(app: FastAPI) -> None:
    """Register the handlers on `app`."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unhandled)
    for cls in (ServerError, PipelineError, RetrievalError):
        app.add_exception_handler(cls, lambda _request, exc: response_for(exc))
