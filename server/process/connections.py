"""Connection-level protection for uvicorn: a header-read timeout, the idle keep-alive timeout
and a bound on open connections that leaves the health probes answering.

uvicorn has an idle keep-alive timeout but no header-read timeout: a client that opens a
connection and sends nothing, or sends its headers a byte at a time, holds a file descriptor
for ever. And its `limit_concurrency` answers 503 to every request past the bound, `/health`
included. Here the HTTP protocol (httptools or h11, as uvicorn would pick) is subclassed:

- from the moment a connection opens, and from the first byte of each later request on it, the
  request's headers must be complete within `header_timeout_s`, or the connection is closed;
- a connection opened while `max_connections` are already open gets `OVER_BOUND_GRACE_S` to send
  its headers; it may then ask for a probe path (`/health`, `/ready`, `/metrics`), which is
  answered, and anything else gets a 503 at once; either way it is closed after that one
  response. A flood past the bound costs a descriptor for at most the grace each.

What the guards do is reported to a `ConnectionObserver` (the app's metrics): the connections
open, and each one they act on.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from telerag.config.settings import ServerSettings
from telerag.server.errors import TooManyConnections, response_for

log = logging.getLogger(__name__)

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})  # answered even past the connection bound
OVER_BOUND_GRACE_S = 1.0  # how long a connection past the bound may take to send its headers (a probe sends them at once)


GuardAction = Literal["header_timeout", "over_bound"]


class ConnectionObserver(Protocol):
    def connections_open(self, count: int) -> None:
        """The connections open now (called as each opens and closes)."""

    def guarded(self, action: GuardAction) -> None:
        """A connection closed for late headers, or opened past the bound."""


class _Unobserved:
    def connections_open(self, count: int) -> None:
        pass

    def guarded(self, action: GuardAction) -> None:
        pass


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    max_connections: int

    @classmethod
    def from_settings(cls, server: ServerSettings) -> ConnectionLimits:
        return cls(header_timeout_s=server.header_timeout_s, max_connections=server.max_connections)


def uvicorn_options(server: ServerSettings, observer: ConnectionObserver | None = None) -> dict[str, Any]:
    """The keyword arguments of `uvicorn.Config` that enforce these limits (reporting to `observer`)."""
    return {
        "http": guarded_protocol(ConnectionLimits.from_settings(server), observer=observer),
        "timeout_keep_alive": server.keep_alive_timeout_s,
    }


class _ProbesOnly:
    """The app of a connection past the bound: probes are served, anything else refused (503);
    the connection closes after its one response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def closing(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        if scope["type"] == "http" and scope["path"] in PROBE_PATHS:
            await self.app(scope, receive, closing)
            return
        refusal = TooManyConnections(
            "too many open connections; retry shortly"
        )  # a refusal: not logged (a flood would flood the log)
        await response_for(refusal)(scope, receive, closing)


class _HeaderDeadline(asyncio.Protocol):
    """Mixed into uvicorn's HTTP protocol classes (both call the app through `self.app`, create
    `self.cycle` when a request's headers are complete, and feed bytes through `data_received`).

    The attributes declared below are uvicorn's own, not a public interface: pyproject.toml pins
    uvicorn to the minor version that tests/test_connections.py covers, with both of its HTTP
    implementations."""

    limits: ConnectionLimits
    observer: ConnectionObserver
    _header_timer: asyncio.TimerHandle | None = None
    # set by uvicorn's HttpToolsProtocol and H11Protocol
    app: ASGIApp
    connections: set[asyncio.Protocol]  # every open connection of the server
    cycle: Any  # the request whose headers are complete (None before the first)
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    client: tuple[str, int] | None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.observer.connections_open(len(self.connections))
        timeout = self.limits.header_timeout_s
        if len(self.connections) > self.limits.max_connections:
            self.app = _ProbesOnly(self.app)
            self.observer.guarded("over_bound")
            timeout = min(timeout, OVER_BOUND_GRACE_S)
        self._arm(timeout)

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        if self._header_timer is None and (cycle is None or cycle.response_complete):
            self._arm(self.limits.header_timeout_s)  # the first bytes of the next request on this connection
        super().data_received(data)
        if self.cycle is not cycle:  # its headers are complete: the app has it now
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
        self.observer.connections_open(len(self.connections))

    def _arm(self, timeout: float) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        log.debug("closing a connection from %s: request headers not complete in time", self.client)
        if not self.transport.is_closing():
            self.observer.guarded("header_timeout")
            self.transport.close()


def guarded_protocol(
    limits: ConnectionLimits, implementation: str = "auto", observer: ConnectionObserver | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (`auto`: httptools when installed, else h11) with these limits."""
    if implementation == "auto":
        implementation = "httptools" if importlib.util.find_spec("httptools") else "h11"
    base: type[asyncio.Protocol]
    if implementation == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    elif implementation == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    else:
        raise ValueError(f"unknown HTTP implementation {implementation!r}: auto, httptools or h11")
    return type(f"Guarded{base.__name__}", (_HeaderDeadline, base), {"limits": limits, "observer": observer or _Unobserved()})
