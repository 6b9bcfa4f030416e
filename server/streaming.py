"""Server-sent events: our stream (`stage`, `token`, `result`, `error`) and OpenAI's chunks."""

from __future__ import annotations

import json
from typing import Any


def sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def sse_data(data: Any) -> bytes:
    """An unnamed event, as OpenAI's streaming API sends them (`data: {...}`, then `data: [DONE]`)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()
