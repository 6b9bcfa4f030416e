"""API keys: which routes need one, and which key a client presented (admission limits
requests in flight per key)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends
from fastapi.params import Depends as Dependency
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from telerag.config.settings import ServerSettings
from telerag.server.errors import Unauthorized

BEARER = HTTPBearer(auto_error=False, description="one of the server's API keys (`server.api_key`, `server.api_keys`)")


class ApiKeys:
    """The dependency that lets a request through only with one of `keys` as its bearer token;
    it names the client by a fingerprint of its key (`key-` and 12 hex digits of its SHA-256):
    the same name across restarts and however the keys are listed, never the key itself, for
    what a key owns outlives the process (its files)."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys
        self.names = [f"key-{hashlib.sha256(key).hexdigest()[:12]}" for key in keys]

    async def __call__(self, credentials: HTTPAuthorizationCredentials | None = Depends(BEARER)) -> str:
        token = credentials.credentials.encode() if credentials is not None else b""
        matches = [hmac.compare_digest(token, key) for key in self.keys]  # every key compared: constant time
        if credentials is None or not any(matches):
            raise Unauthorized("missing or wrong API key (Authorization: Bearer …)")
        return self.names[matches.index(True)]


async def anyone() -> None:
    """The client of an open API: nobody in particular."""


@dataclass(frozen=True)
class Access:
    """Who may call what: with API keys set, `/v1/*` needs one, and with `server.protect_docs`
    the documentation and metrics too. Each part is what a route registration takes."""

    client: Callable[..., Awaitable[str | None]]  # the dependency naming the client (None: an open API)
    api: list[Dependency]  # the dependencies of a /v1 route that does not need to know the client
    api_errors: tuple[int, ...]  # the error statuses those add (401)
    docs: list[Dependency]  # the same for the documentation and metrics
    docs_errors: tuple[int, ...]

    @classmethod
    def from_settings(cls, server: ServerSettings) -> Access:
        keys = [key.get_secret_value().encode() for key in server.keys()]  # noqa: SIM118 - ServerSettings.keys(), not a dict
        if not keys:
            return cls(client=anyone, api=[], api_errors=(), docs=[], docs_errors=())
        client = ApiKeys(keys)
        guarded = server.protect_docs
        return cls(
            client=client,
            api=[Depends(client)],
            api_errors=(401,),
            docs=[Depends(client)] if guarded else [],
            docs_errors=(401,) if guarded else (),
        )

    def client_parameter(self) -> Any:
        """The type of a route's `client` parameter: the key's name, from `client`."""
        return Annotated[str | None, Depends(self.client)]
