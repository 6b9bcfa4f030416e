"""Documents in and out of the live datastore while it serves: `POST /v1/documents` (one or a
batch as JSON, or a file as multipart, as `POST /v1/uploads` takes it: text, Markdown, HTML,
PDF), `PUT`, `GET` and `DELETE /v1/documents/{id}`, `GET /v1/documents` (paged). A write answers
once it is durable and every search that starts after the answer sees it. (The endpoints have no
docstrings: FastAPI would publish them in the schema.)"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, File, Form, Path, Query, Request, Response, UploadFile
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.routing import Match
from starlette.types import Scope

from telerag.config.settings import DocumentSettings
from telerag.documents.conversion import FILE_FORMATS, convert, file_format
from telerag.documents.writer import NON_BLANK, DocumentText, DocumentWriter
from telerag.retrieval.documents import WriteOutcome, WriteResult
from telerag.server import errors
from telerag.server.auth import Access
from telerag.server.errors import DocumentNotFound, IdMismatch, InvalidField
from telerag.server.observability.metrics import Metrics
from telerag.server.protocols.documents import (
    MAX_ID_CHARS,
    MAX_TITLE_CHARS,
    DeletedDocument,
    DocumentBatch,
    DocumentFields,
    DocumentIn,
    DocumentList,
    DocumentOut,
    DocumentSummary,
    PassageOut,
    WrittenDocument,
    WrittenDocuments,
)
from telerag.server.routes.signature import typed
from telerag.server.service import Service, serving

DOCUMENTS = "/v1/documents"
ONE = DOCUMENTS + "/{doc_id:path}"
UPLOADS = "/v1/uploads"  # not under /v1/documents/: there a path names a document (ids may hold slashes)
DocumentPathId = Annotated[str, Path(max_length=MAX_ID_CHARS, pattern=NON_BLANK, description="the document's id")]
WRITE_ERRORS = (400, 409, 413, 422, 429, 501, 503)  # 501: a deployment that writes none (Ray replicas)


class MultipartOnly(APIRoute):
    """A route that takes only a multipart/form-data body: the JSON route of the same path and
    method, registered after it, takes every other (Starlette tries a path's routes in order).
    Left out of the schema: the JSON route's operation names both bodies (`server.openapi`)."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        if match is Match.FULL and not Headers(scope=scope).get("content-type", "").startswith("multipart/form-data"):
            return Match.NONE, {}
        return match, child


def router(write: Any, fields: type[DocumentFields], access: Access, limits: DocumentSettings) -> APIRouter:
    """The routes, with this app's request models (`documents_protocol.documents_request_models`)."""
    routes = APIRouter(tags=["documents"], dependencies=access.api)
    written: dict[int | str, dict[str, Any]] = {
        200: {"description": "replaced or unchanged (each one's `outcome` says)"},
        201: {"description": "created"},
    }
    routes.add_api_route(
        DOCUMENTS,
        upload_document,
        methods=["POST"],
        response_model=WrittenDocument,
        status_code=201,
        include_in_schema=False,
        route_class_override=MultipartOnly,
    )
    routes.add_api_route(
        DOCUMENTS,
        typed(write_documents, body=write),
        methods=["POST"],
        response_model=WrittenDocument | WrittenDocuments,
        status_code=201,
        responses={**written, **errors.responses(*access.api_errors, *WRITE_ERRORS)},
        summary=f"Write one document, or a batch of at most {limits.max_documents} ({limits.max_passages} passages in all); "
        "or, as multipart, a file, as /v1/uploads takes it",
    )
    routes.add_api_route(
        UPLOADS,
        upload_document,
        methods=["POST"],
        response_model=WrittenDocument,
        status_code=201,
        responses={**written, **errors.responses(*access.api_errors, *WRITE_ERRORS)},
        summary="Write a file as a document: plain text, Markdown, HTML or PDF, converted to text",
    )
    routes.add_api_route(
        DOCUMENTS,
        list_documents,
        methods=["GET"],
        response_model=DocumentList,
        responses=errors.responses(*access.api_errors, 422, 501, 503),
        summary="Documents, ordered by id, a page at a time",
    )
    routes.add_api_route(
        ONE,
        get_document,
        methods=["GET"],
        response_model=DocumentOut,
        responses=errors.responses(*access.api_errors, 404, 422, 501, 503),
        summary="A document, its passages and version",
    )
    routes.add_api_route(
        ONE,
        typed(put_document, body=fields),
        methods=["PUT"],
        response_model=WrittenDocument,
        status_code=201,
        responses={**written, **errors.responses(*access.api_errors, *WRITE_ERRORS)},
        summary="Write a document under this id (created, replaced, or unchanged)",
    )
    routes.add_api_route(
        ONE,
        delete_document,
        methods=["DELETE"],
        response_model=DeletedDocument,
        responses=errors.responses(*access.api_errors, 404, 409, 422, 429, 501, 503),
        summary="Delete a document: its passages leave every search that starts after the answer",
    )
    return routes


def writer(service: Service = Depends(serving)) -> DocumentWriter:
    return service.documents()


async def write_documents(
    body: DocumentIn | DocumentBatch, request: Request, response: Response, documents: DocumentWriter = Depends(writer)
) -> WrittenDocument | WrittenDocuments:
    if isinstance(body, DocumentBatch):
        results = await _write(request, documents, [d.as_text() for d in body.documents])
        _created_or_not(response, results)
        return WrittenDocuments.of(results)
    (result,) = await _write(request, documents, [body.as_text()])
    _created_or_not(response, [result])
    return WrittenDocument.of(result)


async def put_document(
    doc_id: DocumentPathId,
    body: DocumentFields,
    request: Request,
    response: Response,
    documents: DocumentWriter = Depends(writer),
) -> WrittenDocument:
    if body.id is not None and body.id != doc_id:
        raise IdMismatch("id", f"id: the body's id {body.id!r} differs from the path's {doc_id!r}")
    (result,) = await _write(request, documents, [body.document(doc_id)])
    _created_or_not(response, [result])
    return WrittenDocument.of(result)


async def upload_document(
    request: Request,
    response: Response,
    file: Annotated[
        UploadFile,
        File(description=FILE_FORMATS),
    ],
    id: Annotated[str | None, Form(max_length=MAX_ID_CHARS, pattern=NON_BLANK, description="default: the file's name")] = None,
    title: Annotated[
        str | None, Form(max_length=MAX_TITLE_CHARS, description="default: the file's own title, else its name")
    ] = None,
    metadata: Annotated[str | None, Form(description="a JSON object, as a document's `metadata`")] = None,
    documents: DocumentWriter = Depends(writer),
) -> WrittenDocument:
    name = file.filename or ""
    doc_id = id if id is not None else name
    if not re.search(NON_BLANK, doc_id):
        raise InvalidField("id", "id: a document's id needs a character that is not blank (default: the file's name)")
    data = await file.read()
    converted = await asyncio.to_thread(convert, data, file_format(name, file.content_type, data))
    document = _fields(converted.text, title or converted.title or name or None, metadata)
    (result,) = await _write(request, documents, [document.document(doc_id)])
    _created_or_not(response, [result])
    return WrittenDocument.of(result)


async def list_documents(
    after: Annotated[str | None, Query(max_length=MAX_ID_CHARS, description="the last id of the page before")] = None,
    limit: Annotated[int, Query(ge=1, le=1000, description="at most this many (documents.max_list bounds it too)")] = 100,
    documents: DocumentWriter = Depends(writer),
    service: Service = Depends(serving),
) -> DocumentList:
    limit = min(limit, service.settings.documents.max_list)
    page = await asyncio.to_thread(documents.documents, after=after, limit=limit + 1)
    shown = page[:limit]
    return DocumentList(
        data=[DocumentSummary.of(entry) for entry in shown],
        has_more=len(page) > limit,
        last_id=shown[-1].doc_id if shown else None,
    )


async def get_document(doc_id: DocumentPathId, documents: DocumentWriter = Depends(writer)) -> DocumentOut:
    entry = await asyncio.to_thread(documents.document, doc_id)
    if entry is None:
        raise DocumentNotFound(f"no document {doc_id!r}")
    passages = documents.live.snapshot().passages_of(list(entry.passage_ids))
    summary = DocumentSummary.of(entry)
    return DocumentOut(
        **summary.model_dump(),
        passages=[PassageOut(id=i, text=p.text) for i, p in zip(entry.passage_ids, passages, strict=True)],
    )


async def delete_document(
    doc_id: DocumentPathId, request: Request, documents: DocumentWriter = Depends(writer)
) -> DeletedDocument:
    started = time.perf_counter()
    (result,) = await documents.delete([doc_id])
    _observe(request, [result], started)
    if result.outcome is WriteOutcome.NOT_FOUND:
        raise DocumentNotFound(f"no document {doc_id!r}")
    return DeletedDocument.of(result)


async def _write(request: Request, documents: DocumentWriter, texts: list[DocumentText]) -> list[WriteResult]:
    limits: DocumentSettings = request.app.state.service.settings.documents
    started = time.perf_counter()
    results = await documents.upsert(texts, max_passages=limits.max_passages)
    _observe(request, results, started)
    return results


def _observe(request: Request, results: list[WriteResult], started: float) -> None:
    metrics: Metrics = request.app.state.metrics
    metrics.documents.observe(results, time.perf_counter() - started)


def _created_or_not(response: Response, results: list[WriteResult]) -> None:
    """201 where a document was created, else 200 (replaced or unchanged)."""
    response.status_code = 201 if any(r.outcome is WriteOutcome.CREATED for r in results) else 200


def _fields(text: str, title: str | None, metadata: str | None) -> DocumentFields:
    """A converted file's document, checked as a JSON body's would be (`metadata`: a JSON object)."""
    try:
        parsed = {} if metadata is None else json.loads(metadata)
    except json.JSONDecodeError as exc:
        raise InvalidField("metadata", f"metadata: not JSON ({exc.msg})") from None
    try:
        return DocumentFields.model_validate({"text": text, "title": title, "metadata": parsed})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise InvalidField(field, f"{field}: {first['msg']}") from None
