"""The OpenAPI `responses` the generation routes share."""

from __future__ import annotations

from typing import Any

from telerag.server import errors
from telerag.server.auth import Access


def json_or_events(model: type, events: dict[str, Any], description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that is `model` as JSON, or with `"stream": true` the `events` as server-sent events."""
    return {200: {"model": model, "description": description, "content": {"text/event-stream": {"schema": events}}}}


TOOL_ERRORS = (404, 501)  # a file_search tool's store that is not the key's; no stores served (Ray's inference replicas)


def generation_errors(access: Access, *more: int) -> dict[int | str, dict[str, Any]]:
    """Every error a route that runs a pipeline may answer, and `more` of its own."""
    return errors.responses(400, *access.api_errors, *more, 413, 422, 429, 502, 503, 504)
