"""The one place where errors become HTTP responses: a status code per error type, one JSON
shape, `{"error": {"type", "message", "code", "field"?, "param"?}}` (OpenAI's keys, so that its
clients read it; on the OpenAI routes `type` is OpenAI's class of error), and one policy for
`Retry-After`.

A client's mistake is a 4xx naming what was wrong; a refusal of a busy or unready server is a
429 or 503 with `Retry-After`; a fault of the server is a 5xx, logged with the request's id
(`X-Request-ID`, which every response carries). A 500 is a bug: its body says only that, and
the request's id, so the log can be found; nothing of the exception leaves the server. It is
long because every layer's error types are mapped here, and only here.
"""

from __future__ import annotations

import contextvars
import logging
import math
from collections.abc import Mapping, Sequence
from enum import StrEnum
from http import HTTPStatus
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from telerag.documents.errors import (
    DocumentError,
    DocumentsTooLarge,
    FileUnreadable,
    InvalidDocument,
    RebuildRunning,
    UnsupportedFile,
    WritesBusy,
)
from telerag.engines.errors import EngineError, EngineOverloaded, EngineUnavailable, GenerationAborted
from telerag.file_search.errors import (
    FileBatchNotFound,
    FileNotFound,
    FileSearchError,
    FilesTooLarge,
    VectorStoreFileNotFound,
    VectorStoreNotFound,
    VectorStoresTooLarge,
    VectorStoresUnavailable,
)
from telerag.pipelines.errors import EmbedderError, EngineLacksCapability, PipelineError, UnknownPipeline
from telerag.retrieval.errors import (
    DatastoreError,
    DatastoreReadOnly,
    DeviceUnavailable,
    RetrievalError,
    SearchError,
    TierBusy,
    TierUnavailable,
)
from telerag.server.protocols.common import UNSUPPORTED, ErrorDetail, ErrorResponse

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # a 429 or 503 whose cause has no better estimate of when to come back
NOT_READY_RETRY_AFTER_S = 5  # loading or draining: a load takes seconds to minutes, a drain up to its grace

# set by middleware.RequestId
request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("telerag_request_id", default=None)
openai_route: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "telerag_openai_route", default=False
)  # set by middleware.ErrorDialect: this request's errors name OpenAI's class of error in `type`
OPENAI_TYPES = {401: "authentication_error", 429: "rate_limit_error"}  # else invalid_request_error (4xx), server_error


def retry_after_s(estimate_s: float | None, default: int = RETRY_AFTER_S) -> int:
    """The one `Retry-After` policy: an estimate in whole seconds, rounded up, at least 1; `default`
    without one."""
    return default if estimate_s is None else max(1, math.ceil(estimate_s))


class Refusal(StrEnum):
    """Why admission refused a request: the body's `error.type` of its 429 (422 for
    `prompt_tokens`), and the `reason` label of `telerag_admission_refusals_total`."""

    DEADLINE = "deadline"  # its expected finish is past the deadline
    QUEUE_FULL = "queue_full"  # max_concurrency running and max_queue waiting
    KEY_LIMIT = "key_limit"  # its API key has max_in_flight_per_key requests admitted
    CALIBRATING = "calibrating"  # the rate or the estimates' error is not measured yet (one request in flight), or
    # fewer estimates have been checked than requests would be in flight
    PROMPT_TOKENS = "prompt_tokens"  # over limits.max_prompt_tokens (422, counted here too)


class ServerError(Exception):
    """Base class of the server's own errors; `code` is the body's `error.type`."""

    code: str = "server_error"


class Refused(ServerError):
    """The server is not taking this request now (busy, loading, draining): a state of the
    server, not a fault of it nor of the client, so it is not logged as an error. `retry_after`
    is the `Retry-After` a client gets (`retry_after_s`)."""

    default_retry_after_s = RETRY_AFTER_S

    def __init__(self, message: str, retry_after_estimate_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after_s(retry_after_estimate_s, self.default_retry_after_s)


class Overloaded(Refused):
    """Admission refused the request; `reason` says why (and is the body's `error.type`, and the
    `reason` of `telerag_admission_refusals_total`)."""

    def __init__(self, reason: Refusal, message: str, retry_after_estimate_s: float | None = None) -> None:
        super().__init__(message, retry_after_estimate_s)
        self.reason = reason
        self.code = reason.value


class TooManyConnections(Refused):
    """A connection opened past `server.max_connections` asked for something other than a probe."""

    code = "too_many_connections"


class Unauthorized(ServerError):
    code = "unauthorized"


class NotReady(Refused):
    """Still loading, or draining before shutdown: come back (or go elsewhere) later."""

    code = "not_ready"
    default_retry_after_s = NOT_READY_RETRY_AFTER_S


class RequestTimeout(ServerError):
    code = "timeout"


class ReplicasUnavailable(ServerError):
    """The inference replica running a request failed (on a Ray cluster, `server.ray_serve.replicas`),
    after its run had begun or on every attempt: the request fails whole, with this 503."""

    code = "inference_replica_unavailable"


class InvalidField(ServerError):
    """A request field has a value the server cannot serve (e.g. nprobe above nlist)."""

    code = "invalid_request"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class IdMismatch(InvalidField):
    """A body names an id other than its path's (`PUT /v1/documents/{id}`)."""

    code = "id_mismatch"


class UnsupportedField(InvalidField):
    """A request field (or a value of it) asks for what this server does not do: an OpenAI
    field it does not serve (`tools`, `n: 2`, an image part), or a field it does not know."""

    code = "unsupported_field"


class DocumentNotFound(ServerError):
    """No document of that id in the datastore."""

    code = "document_not_found"


class DocumentsUnavailable(ServerError):
    """This deployment writes no documents (a runtime without a writer of its datastore)."""

    code = "documents_unavailable"


class InvalidJSON(ServerError):
    """The body could not be read as JSON: not JSON, not UTF-8, or nested too deep."""

    code = "invalid_json"


class BodyTooLarge(ServerError):
    code = "body_too_large"


STATUS: list[tuple[type[Exception], int]] = [
    (InvalidJSON, 400),
    (UnsupportedField, 400),
    (IdMismatch, 400),
    (UnsupportedFile, 400),
    (FileUnreadable, 422),
    (InvalidDocument, 422),
    (InvalidField, 422),
    (DocumentNotFound, 404),
    (FileNotFound, 404),
    (FilesTooLarge, 413),
    (VectorStoreNotFound, 404),
    (VectorStoreFileNotFound, 404),
    (FileBatchNotFound, 404),
    (VectorStoresTooLarge, 413),
    (VectorStoresUnavailable, 501),
    (DatastoreReadOnly, 409),
    (RebuildRunning, 409),
    (DocumentsTooLarge, 413),
    (WritesBusy, 429),
    (DocumentsUnavailable, 501),
    (UnknownPipeline, 422),
    (EngineLacksCapability, 400),
    (SearchError, 422),
    (Unauthorized, 401),
    (BodyTooLarge, 413),
    (Overloaded, 429),
    (EngineOverloaded, 429),
    (TierBusy, 429),
    (GenerationAborted, 503),
    (NotReady, 503),
    (TooManyConnections, 503),
    (RequestTimeout, 504),
    (EngineUnavailable, 503),
    (EmbedderError, 503),
    (DatastoreError, 503),
    (DeviceUnavailable, 503),
    (TierUnavailable, 503),
    (ReplicasUnavailable, 503),
    (EngineError, 502),
    (PipelineError, 500),
    (RetrievalError, 500),
]
WHEN = {  # what each status means, for the OpenAPI schema
    400: "The body is not JSON (or not UTF-8, or nested too deep), or it asks for what this server does not do "
    "(a field it does not know or serve, a value it does not serve, a file of a type it does not convert), or "
    "its id differs from the path's; `error.field` names it.",
    401: "Missing or wrong API key (`Authorization: Bearer <key>`).",
    404: "No such document (or file, vector store or file batch, or none the API key may see).",
    409: "The datastore is read-only here (another process holds it for writing, or it holds no passages), or a "
    "compaction or retrain is running already.",
    413: "The body is over the server's `limits.max_body_bytes` (`documents.max_body_bytes` on /v1/documents, "
    "`files.max_bytes` on /v1/files), a write's documents are cut into more than `documents.max_passages` passages, "
    "or an upload would take its key's files over `files.max_bytes_per_key` (its vector stores over "
    "`vector_stores.max_stores_per_key` or `max_bytes_per_key`).",
    422: "A field is invalid or out of the server's limits; `error.field` names it.",
    429: "Busy: retry after `Retry-After` seconds.",
    502: "The LLM engine failed.",
    503: "Not ready (loading) or a component is unavailable: retry after `Retry-After` seconds.",
    501: "Not served by this deployment (vector stores on a Ray cluster).",
    504: "The request took longer than `scheduler.request_timeout_s`.",
}
_REQUEST_ID = {
    "X-Request-ID": {
        "description": "the request's id (the client's, where it sent a valid one); a fault is logged with it",
        "schema": {"type": "string"},
        "required": True,
    }
}
_RETRY_AFTER = {
    "Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}, "required": True}
}
_HEADERS = {
    401: {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}, "required": True}},
    429: _RETRY_AFTER,
    503: _RETRY_AFTER,
}


def status_of(exc: BaseException) -> int:
    return next((status for cls, status in STATUS if isinstance(exc, cls)), 500)


def error_detail(exc: BaseException) -> ErrorDetail:
    """What the client is told of `exc`, logged first where it is the server's fault (a 5xx that
    is not a refusal). A 500 is a bug: the client gets its request's id, the log the rest."""
    status = status_of(exc)
    if status >= 500 and status != 501 and not isinstance(exc, Refused):  # 501: what this deployment does not do
        log.error("request %s failed: %s", request_id.get() or "-", exc, exc_info=exc)
    if status == 500:
        return detail(500, "internal_error", f"internal server error (request {request_id.get() or '-'})")
    return detail(status, getattr(exc, "code", "internal_error"), str(exc) or type(exc).__name__, getattr(exc, "field", None))


def detail(status: int, code: str, message: str, field: str | None = None) -> ErrorDetail:
    """The one error detail: `code` is the slug, and `type` too except on the OpenAI routes,
    where it is OpenAI's class of error, by status."""
    kind = code
    if openai_route.get():
        kind = OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return ErrorDetail(type=kind, message=message, field=field or None, param=field or None, code=code)


def error_response(status: int, detail: ErrorDetail, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The one error body, with `Retry-After` on every 429 and 503 (the policy's default unless
    `headers` has one) and the request's id."""
    headers = dict(headers or {})
    if status in (429, 503):
        headers.setdefault("Retry-After", str(RETRY_AFTER_S))
    if (rid := request_id.get()) is not None:
        headers.setdefault("X-Request-ID", rid)
    return JSONResponse(ErrorResponse(error=detail).model_dump(exclude_none=True), status_code=status, headers=headers)


def response_for(exc: BaseException) -> JSONResponse:
    headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, Refused) else {}
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return error_response(status_of(exc), error_detail(exc), headers)


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` of these error statuses: the error model, what it means, its headers."""
    return {
        status: {"model": ErrorResponse, "description": WHEN[status], "headers": _REQUEST_ID | _HEADERS.get(status, {})}
        for status in statuses
    }


def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    errors = cast(RequestValidationError, exc).errors()
    first: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return response_for(InvalidJSON(f"the body is not valid JSON: {reason}"))
    body = cast(RequestValidationError, exc).body
    refused = next((e for e in errors if e.get("type") in (UNSUPPORTED, "extra_forbidden")), None)
    if refused is not None:
        field = _field_path(refused, body)
        why = "not supported by this server" if refused["type"] == "extra_forbidden" else refused.get("msg")
        return response_for(UnsupportedField(field, f"{field}: {why}"))
    field = _field_path(first, body)
    # of a union's errors (one a member), the one that reaches deepest into what was sent: a list
    # of messages is blamed for its message, not for not being a string
    same_field = [(path, e) for e in errors if (path := _field_path(e, body)).split(".")[0] == field.split(".")[0]]
    field, first = max(same_field, key=lambda found: found[0].count(".") + bool(found[0]), default=(field, first))
    message = f"{field}: {first.get('msg')}" if field else str(first.get("msg"))
    if first.get("type") == "missing" and request.headers.get("content-type", "").startswith("multipart/form-data"):
        message += " (a form field sent empty is one not sent)"  # as FastAPI reads a form
    return response_for(InvalidField(field, message))


def _field_path(error: Mapping[str, Any], body: Any) -> str:
    """A validation error's location as the dotted path of the field a client sent: of pydantic's
    location, the keys and indexes found walking the request's `body`, without the names it gives
    the member of a union (a tagged one's tag, `messages.0.user.content`'s `user`; a type's, `bool`,
    `list[TextPart]`), but the missing field of a `missing` error; a parameter's location (`path.id`,
    `query.limit`) as it is."""
    loc: Sequence[str | int] = error.get("loc", ())
    if not loc or loc[0] != "body":
        return ".".join(str(part) for part in loc if isinstance(part, int) or part.isidentifier())
    parts: list[str] = []
    node: Any = body
    for at, part in enumerate(loc[1:], start=1):
        found = isinstance(node, Mapping) and part in node
        if found or (isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)):
            parts.append(str(part))
            node = node[part]
        elif at == len(loc) - 1 and error.get("type") == "missing":
            parts.append(str(part))
    return ".".join(parts)


def _http_error(request: Request, error: Exception) -> JSONResponse:
    """Starlette's and FastAPI's own errors: 404 (no route), 405 (wrong method, with `Allow`),
    and 400 when FastAPI cannot parse the body (not UTF-8, nested too deep)."""
    exc = cast(StarletteHTTPException, error)
    if exc.status_code == 400:
        return response_for(InvalidJSON("the body could not be parsed as JSON: it is not UTF-8 or is nested too deeply"))
    headers = dict(exc.headers or {})
    if exc.status_code == 405:  # Starlette names the first route of the path's; a path has a route per method
        headers["Allow"] = ", ".join(_methods_of(request))
    message = {
        404: f"no route {request.url.path}",
        405: f"{request.method} is not allowed on {request.url.path} (allowed: {headers.get('Allow', '')})",
    }.get(exc.status_code, str(exc.detail))
    code = HTTPStatus(exc.status_code).phrase.lower().replace(" ", "_")
    return error_response(exc.status_code, detail(exc.status_code, code, message), headers)


def _methods_of(request: Request) -> list[str]:
    """Every method the app's routes serve at the request's path (asked of the routes themselves:
    FastAPI wraps included routers)."""
    methods = ("GET", "POST", "PUT", "PATCH", "DELETE")
    routes = request.app.router.routes
    return [m for m in methods if any(r.matches({**request.scope, "method": m})[0] is Match.FULL for r in routes)]


def _unhandled(_: Request, exc: Exception) -> JSONResponse:
    """A bug: 500 with the one error body and nothing of the exception (the server logs it)."""
    return response_for(exc)


def install(app: FastAPI) -> None:
    """Register the handlers on `app`."""
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unhandled)
    for cls in (ServerError, PipelineError, DocumentError, FileSearchError, EngineError, RetrievalError):
        app.add_exception_handler(cls, lambda _request, exc: response_for(exc))
