"""Server-sent events: our stream (`stage`, `token`, `result`, `error`) and OpenAI's chunks, and
the OpenAPI schema of their events."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


def sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def sse_data(data: Any) -> bytes:
    """An unnamed event, as OpenAI's streaming API sends them (`data: {...}`, then `data: [DONE]`)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


def ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def json_data(*models: type[BaseModel]) -> dict[str, Any]:
    """An event's `data` that is one of `models` as JSON."""
    schema = ref(models[0]) if len(models) == 1 else {"anyOf": [ref(m) for m in models]}
    return {"type": "string", "contentMediaType": "application/json", "contentSchema": schema}


def event_schema(events: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The schema of one event of a `text/event-stream` response (what OpenAPI 3.1 reads its
    `schema` as, and 3.2 calls `itemSchema`): `event: NAME` ("message" when unnamed) with
    `data:` as `events[NAME]` describes."""
    return {
        "oneOf": [
            {"type": "object", "required": ["event", "data"], "properties": {"event": {"const": name}, "data": data}}
            for name, data in events.items()
        ]
    }


def component_schemas(models: list[type[BaseModel]]) -> dict[str, Any]:
    """The OpenAPI components that `models` (as the server sends them) and what they use need."""
    _, definitions = models_json_schema([(m, "serialization") for m in models], ref_template=REF)
    return definitions.get("$defs", {})
