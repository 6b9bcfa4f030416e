"""The ASGI middleware in front of the routes: each acts before FastAPI sees the request."""

from __future__ import annotations

import re
from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from telerag.server import errors
from telerag.server.errors import BodyTooLarge, NotReady
from telerag.server.process.lifecycle import Lifecycle, Phase
from telerag.server.protocols.common import new_request_id

REQUEST_ID_HEADER = b"x-request-id"
CLIENT_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")  # what of a client's X-Request-ID is kept (it goes into logs)


class RequestId:
    """Every HTTP request gets an id: the client's `X-Request-ID` when it sends one of at most
    128 letters, digits and `._:-`, else a new one. Every response carries it in `X-Request-ID`,
    an answer's id is made of it (`rag-<id>`, `chatcmpl-<id>`), and a fault is logged with it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER, b"")
        rid = given.decode() if CLIENT_REQUEST_ID.fullmatch(given) else new_request_id()
        scope.setdefault("state", {})["request_id"] = rid
        errors.request_id.set(rid)  # not reset: the error handlers outside this middleware log it too

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if all(name.lower() != REQUEST_ID_HEADER for name, _ in headers):
                    message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class ErrorDialect:
    """The errors of a request to an OpenAI route name OpenAI's class of error in `error.type`
    (`errors.detail`), as OpenAI clients expect; the rest name the slug there."""

    def __init__(self, app: ASGIApp, openai_paths: frozenset[str]) -> None:
        self.app, self.openai_paths = app, openai_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]  # an OpenAI route, or a path under one (a file's, a model's)
            errors.openai_route.set(any(path == p or path.startswith(p + "/") for p in self.openai_paths))  # not reset,
            # as the request id is not
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse request bodies over `limit` bytes (413), whether they declare their length or arrive
    chunked; a path under one of `larger`'s prefixes has that limit instead (documents' uploads).
    The body is read here, before the app sees the request: an error raised while FastAPI reads
    it would reach the client as FastAPI's 400 ("error parsing the body")."""

    def __init__(self, app: ASGIApp, limit: int, larger: Mapping[str, int] | None = None) -> None:
        self.app, self.default, self.larger = app, limit, dict(larger or {})

    def _limit(self, path: str) -> int:
        return next((limit for prefix, limit in self.larger.items() if path.startswith(prefix)), self.default)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self._limit(scope["path"])
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await self._refuse(limit, scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body ended
                replay = [message]
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await self._refuse(limit, scope, receive, send)
                return
            if not message.get("more_body", False):
                replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
                break

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()  # then the disconnect, when it comes

        await self.app(scope, replayed, send)

    async def _refuse(self, limit: int, scope: Scope, receive: Receive, send: Send) -> None:
        await errors.response_for(BodyTooLarge(f"the request body is over {limit} bytes"))(scope, receive, send)


class ServingGate:
    """`/v1/*` answers 503 (with Retry-After, in the one error body) unless the server is ready:
    while it loads, and while it drains before stopping. The rest (`/health`, `/ready`,
    `/metrics`, the docs) always answers."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle) -> None:
        self.app, self.lifecycle = app, lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and self.lifecycle.phase != Phase.READY:
            refusal = NotReady(self.lifecycle.unavailable_reason)
            await errors.response_for(refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)
