"""The app's OpenAPI schema: FastAPI's, plus what FastAPI cannot see."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from telerag.server.streaming import component_schemas


def extend_schema(app: FastAPI, streamed: Sequence[type[BaseModel]]) -> None:
    """Make `app.openapi()` FastAPI's schema plus the `streamed` models (only streamed events
    refer to them, so FastAPI does not list them) and, once the datastore is loaded, what it
    decides: nprobe's upper bound (its nlist), the embedder an embedding request must name and
    its size (the app's models are built before they are known)."""
    of_routes = app.openapi
    components_of_streams = component_schemas(list(streamed))

    def schema() -> dict[str, Any]:
        schema = of_routes()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, definition in components_of_streams.items():
            components.setdefault(name, definition)
        if app.state.service is not None:
            datastore = app.state.service.runtime.datastore_info
            nprobe = components["QueryRequest"]["properties"]["nprobe"]["anyOf"][0]
            nprobe["maximum"] = datastore.nlist
            embedding = components["EmbeddingRequest"]["properties"]
            embedding["model"]["enum"] = [datastore.embedder]
            embedding["dimensions"]["anyOf"][0]["enum"] = [datastore.dim]
        return schema

    app.openapi = schema  # type: ignore[method-assign]
