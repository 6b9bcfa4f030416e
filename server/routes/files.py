"""OpenAI's Files API: `POST /v1/files` (multipart: `file`, `purpose`), `GET /v1/files`,
`GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`; the files kept by
`file_search.file_store`, each seen only by the API key that uploaded it. (The endpoints have no
docstrings: FastAPI would publish them in the schema.)"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, File, Form, Path, Query, Request, UploadFile
from fastapi.responses import Response

from telerag.config.settings import FileSettings
from telerag.documents.conversion import FILE_FORMATS
from telerag.file_search.file_store import PURPOSES, FileStore, page
from telerag.server import errors
from telerag.server.auth import Access
from telerag.server.errors import UnsupportedField
from telerag.server.protocols.files import FileDeleted, FileList, FileObject
from telerag.server.routes.signature import typed

FILES = "/v1/files"
PATHS = frozenset({FILES})  # and every path under it: their errors speak OpenAI's dialect (middleware.ErrorDialect)
FileId = Annotated[str, Path(max_length=64, description="the file's id (`file-…`)")]
MAX_LIST = 10_000  # files one page may list, as OpenAI's


def router(access: Access, limits: FileSettings) -> APIRouter:
    """The routes, with this app's access and limits."""
    routes = APIRouter(tags=["files"])
    client = access.client_parameter()
    routes.add_api_route(
        FILES,
        typed(create_file, client=client),
        methods=["POST"],
        response_model=FileObject,
        responses=errors.responses(400, *access.api_errors, 413, 422, 503),
        summary=f"Upload a file (plain text, Markdown, HTML or PDF; at most {limits.max_bytes} bytes) for file search",
    )
    routes.add_api_route(
        FILES,
        typed(list_files, client=client),
        methods=["GET"],
        response_model=FileList,
        responses=errors.responses(*access.api_errors, 422, 503),
        summary="This API key's files",
    )
    routes.add_api_route(
        FILES + "/{file_id}",
        typed(get_file, client=client),
        methods=["GET"],
        response_model=FileObject,
        responses=errors.responses(*access.api_errors, 404, 422, 503),
        summary="A file's description",
    )
    routes.add_api_route(
        FILES + "/{file_id}/content",
        typed(file_content, client=client),
        methods=["GET"],
        response_class=Response,
        responses={
            200: {"content": {"application/octet-stream": {}}, "description": "the file's bytes, as uploaded"},
            **errors.responses(*access.api_errors, 404, 422, 503),
        },
        summary="A file's bytes, as uploaded",
    )
    routes.add_api_route(
        FILES + "/{file_id}",
        typed(delete_file, client=client),
        methods=["DELETE"],
        response_model=FileDeleted,
        responses=errors.responses(*access.api_errors, 404, 422, 503),
        summary="Delete a file",
    )
    return routes


def _store(request: Request) -> FileStore:
    return request.app.state.files


async def create_file(
    request: Request,
    file: Annotated[
        UploadFile,
        File(description=FILE_FORMATS),
    ],
    purpose: Annotated[
        str,
        Form(
            description=f"what the file is for: {' or '.join(PURPOSES)} (file search; another is a 400)",
            json_schema_extra={"enum": list(PURPOSES)},
        ),
    ],
    client: str | None,
) -> FileObject:
    if purpose not in PURPOSES:
        raise UnsupportedField("purpose", f"purpose: files for {' or '.join(PURPOSES)} only; {purpose!r} is not served")
    data = await file.read()
    name = file.filename or ""
    stored = await asyncio.to_thread(_store(request).add, data, name, purpose, client, file.content_type)
    return FileObject.of(stored)


async def list_files(
    request: Request,
    client: str | None,
    purpose: Annotated[str | None, Query(max_length=64, description="only the files of this purpose")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST, description="at most this many")] = MAX_LIST,
    order: Annotated[Literal["asc", "desc"], Query(description="by creation: desc, the newest first")] = "desc",
    after: Annotated[str | None, Query(max_length=64, description="the last id of the page before")] = None,
) -> FileList:
    held = await asyncio.to_thread(_store(request).files, client, purpose=purpose)
    shown, more = page(held, after=after, limit=limit, newest_first=order == "desc")
    return FileList(
        data=[FileObject.of(f) for f in shown],
        first_id=shown[0].id if shown else None,
        last_id=shown[-1].id if shown else None,
        has_more=more,
    )


async def get_file(file_id: FileId, request: Request, client: str | None) -> FileObject:
    return FileObject.of(await asyncio.to_thread(_store(request).get, file_id, client))


async def file_content(file_id: FileId, request: Request, client: str | None) -> Response:
    data = await asyncio.to_thread(_store(request).content, file_id, client)
    return Response(data, media_type="application/octet-stream")


async def delete_file(file_id: FileId, request: Request, client: str | None) -> FileDeleted:
    stored = await asyncio.to_thread(_store(request).delete, file_id, client)
    return FileDeleted(id=stored.id)
