"""The app's OpenAPI schema: FastAPI's, plus what FastAPI cannot see: the streamed events' models,
what the loaded datastore decides, the multipart body `POST /v1/documents` takes beside JSON, and
the links from each answer that makes a resource to the routes that take its id."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

from telerag.server.routes import documents, files, vector_store_files, vector_stores
from telerag.server.streaming import component_schemas


@dataclass(frozen=True)
class Link:
    """An OpenAPI link: the answer `status` of `source` (method, path) gives what `target` takes,
    its path `parameters` and fields of its `body`, as runtime expressions (`$response.body#/id`),
    so that a client generator or a fuzzer's stateful phase reaches the target with a real id."""

    source: tuple[str, str]
    statuses: tuple[str, ...]
    target: tuple[str, str]
    parameters: dict[str, str] = field(default_factory=dict)
    body: dict[str, Any] | None = None


def _links() -> list[Link]:
    file_id = "$response.body#/id"
    store = {"vector_store_id": "$response.body#/id"}
    listed_file = {"vector_store_id": "$response.body#/data/0/vector_store_id", "file_id": "$response.body#/data/0/id"}
    store_file = {"vector_store_id": "$response.body#/vector_store_id", "file_id": "$response.body#/id"}
    batch = {"vector_store_id": "$response.body#/vector_store_id", "batch_id": "$response.body#/id"}
    document = {"doc_id": "$response.body#/id"}
    files_one = files.FILES + "/{file_id}"
    doc_one = documents.DOCUMENTS + "/{doc_id}"
    store_files, store_file_one = vector_store_files.FILES, vector_store_files.FILE
    batches, batch_one = vector_store_files.BATCHES, vector_store_files.BATCH
    created_document = ("200", "201")  # replaced or unchanged, created
    return [
        *(Link(("post", files.FILES), ("200",), t, {"file_id": file_id}) for t in (
            ("get", files_one), ("get", files_one + "/content"), ("delete", files_one))),
        Link(("post", files.FILES), ("200",), ("post", vector_stores.VECTOR_STORES), body={"file_ids": [file_id]}),
        # a store's answer names no file: attaching one (alone or in a batch) takes its id from a listing of the store's
        *(Link(("post", vector_stores.VECTOR_STORES), ("200",), t, store) for t in (
            ("get", vector_stores.ONE), ("post", vector_stores.ONE), ("delete", vector_stores.ONE),
            ("post", vector_stores.ONE + "/search"), ("get", store_files))),
        *(Link(source, ("200",), t, parameters) for source, parameters in (
            (("get", store_files), listed_file), (("post", store_files), store_file)) for t in (
            ("get", store_file_one), ("post", store_file_one), ("delete", store_file_one),
            ("get", store_file_one + "/content"))),
        Link(("get", store_files), ("200",), ("post", store_files), {"vector_store_id": listed_file["vector_store_id"]},
             body={"file_id": listed_file["file_id"]}),
        Link(("get", store_files), ("200",), ("post", batches), {"vector_store_id": listed_file["vector_store_id"]},
             body={"file_ids": [listed_file["file_id"]]}),
        *(Link(("post", batches), ("200",), t, batch) for t in (
            ("get", batch_one), ("post", batch_one + "/cancel"), ("get", batch_one + "/files"))),
        *(Link(source, created_document, t, document) for source in (
            ("post", documents.DOCUMENTS), ("post", documents.UPLOADS), ("put", doc_one)) for t in (
            ("get", doc_one), ("put", doc_one), ("delete", doc_one))),
        *(Link(("get", documents.DOCUMENTS), ("200",), t, {"doc_id": "$response.body#/data/0/id"}) for t in (
            ("get", doc_one), ("put", doc_one), ("delete", doc_one))),
    ]  # fmt: skip


def _add_links(paths: dict[str, Any]) -> None:
    """Each `Link` in its source's answers, by the target's operationId (FastAPI's, so as the schema names it)."""
    for link in _links():
        (method, path), (target_method, target_path) = link.source, link.target
        target = paths[target_path][target_method]["operationId"]
        definition: dict[str, Any] = {"operationId": target, "parameters": dict(link.parameters)}
        if link.body is not None:
            definition["requestBody"] = link.body
        for status in link.statuses:
            paths[path][method]["responses"][status].setdefault("links", {})[target] = definition


def _documents_take_files_too(paths: dict[str, Any]) -> None:
    """`POST /v1/documents` takes, as multipart, the body `POST /v1/uploads` takes (`routes.documents.MultipartOnly`)."""
    upload = paths[documents.UPLOADS]["post"]["requestBody"]["content"]["multipart/form-data"]
    paths[documents.DOCUMENTS]["post"]["requestBody"]["content"]["multipart/form-data"] = upload


def extend_schema(app: FastAPI, streamed: Sequence[type[BaseModel]]) -> None:
    """Make `app.openapi()` FastAPI's schema plus the `streamed` models (only streamed events
    refer to them, so FastAPI does not list them), the documents' multipart body, the links and,
    once the datastore is loaded, what it decides: the embedder an embedding request must name
    and its size (the app's models are built before they are known)."""
    of_routes = app.openapi
    components_of_streams = component_schemas(list(streamed))
    amended: list[bool] = []

    def schema() -> dict[str, Any]:
        schema = of_routes()  # made once, then kept (and amended once)
        if not amended:
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in components_of_streams.items():
                components.setdefault(name, definition)
            _documents_take_files_too(schema["paths"])
            _add_links(schema["paths"])
            amended.append(True)
        if app.state.service is not None:
            datastore = app.state.service.runtime.datastore_info
            embedding = schema["components"]["schemas"]["EmbeddingRequest"]["properties"]
            embedding["model"]["enum"] = [datastore.embedder]
            embedding["dimensions"]["anyOf"][0]["enum"] = [datastore.dim]
        return schema

    app.openapi = schema  # type: ignore[method-assign]
