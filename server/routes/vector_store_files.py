"""A vector store's files and file batches, as OpenAI's API has them: `POST`, `GET
/v1/vector_stores/{id}/files`, `GET`, `POST` (attributes) and `DELETE .../files/{file_id}`, `GET
.../files/{file_id}/content`; `POST .../file_batches`, `GET .../file_batches/{batch_id}`, `POST
.../cancel`, `GET .../files`. A file is processed in the background: in progress until then, and
its answers say when to look again (`openai-poll-after-ms`, which the SDK's polling heeds). (The
endpoints have no docstrings: FastAPI would publish them in the schema.)"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query, Request, Response

from telerag.file_search.vector_store_records import FileStatus, StoreFile, page
from telerag.server import errors
from telerag.server.auth import Access
from telerag.server.protocols.vector_store_files import (
    FileAttach,
    FileBatchCreate,
    FileBatchObject,
    FileUpdate,
    VectorStoreFileContent,
    VectorStoreFileDeleted,
    VectorStoreFileList,
    VectorStoreFileObject,
)
from telerag.server.protocols.vector_stores import TextContent
from telerag.server.routes.signature import typed
from telerag.server.routes.vector_stores import ERRORS, ONE, Before, Cursor, Limit, Order, StoreId, stores_of

FILES = ONE + "/files"
FILE = FILES + "/{file_id}"
BATCHES = ONE + "/file_batches"
BATCH = BATCHES + "/{batch_id}"
FileId = Annotated[str, Path(max_length=64, description="the file's id (`file-…`)")]
BatchId = Annotated[str, Path(max_length=64, description="the batch's id (`vsfb_…`)")]
Filter = Annotated[
    Literal["in_progress", "completed", "failed", "cancelled"] | None, Query(description="only the files of this status")
]
POLL_AFTER_MS = 200  # what an answer in progress tells a polling client to wait


def router(access: Access) -> APIRouter:
    """The routes, with this app's access."""
    routes = APIRouter(tags=["vector stores"])
    client = access.client_parameter()
    for path, endpoint, method, model, more, summary in (
        (FILES, attach_file, "POST", VectorStoreFileObject, (400, 413), "Attach a file (this key's, from /v1/files)"),
        (FILES, list_files, "GET", VectorStoreFileList, (), "The vector store's files"),
        (FILE, get_file, "GET", VectorStoreFileObject, (), "A vector store's file: its status, attributes, usage"),
        (FILE, update_file, "POST", VectorStoreFileObject, (400,), "A vector store's file's new attributes"),
        (FILE, detach_file, "DELETE", VectorStoreFileDeleted, (), "Detach a file: its passages leave the store's searches"),
        (FILE + "/content", file_content, "GET", VectorStoreFileContent, (), "A vector store's file's passages"),
        (BATCHES, create_batch, "POST", FileBatchObject, (400, 413), "Attach files as one batch"),
        (BATCH, get_batch, "GET", FileBatchObject, (), "A file batch: how far its files are"),
        (BATCH + "/cancel", cancel_batch, "POST", FileBatchObject, (), "Cancel a batch's files not processed yet"),
        (BATCH + "/files", batch_files, "GET", VectorStoreFileList, (), "A file batch's files"),
    ):
        routes.add_api_route(
            path,
            typed(endpoint, client=client),
            methods=[method],
            response_model=model,
            responses=errors.responses(*sorted({*more, *access.api_errors, *ERRORS})),
            summary=summary,
        )
    return routes


def _polled(response: Response, in_progress: bool) -> None:
    if in_progress:
        response.headers["openai-poll-after-ms"] = str(POLL_AFTER_MS)


async def attach_file(vector_store_id: StoreId, request: Request, body: FileAttach, client: str | None) -> VectorStoreFileObject:
    stored = await asyncio.to_thread(stores_of(request).attach, vector_store_id, client, body.attach)
    return VectorStoreFileObject.of(vector_store_id, stored)


def _listed(store_id: str, files: list[StoreFile], **paging: Any) -> VectorStoreFileList:
    shown, more = page(files, **paging)
    return VectorStoreFileList(
        data=[VectorStoreFileObject.of(store_id, f) for f in shown],
        first_id=shown[0].id if shown else None,
        last_id=shown[-1].id if shown else None,
        has_more=more,
    )


def _of_status(files: list[StoreFile], status: str | None) -> list[StoreFile]:
    """The files (oldest first), of `status` only if one is given."""
    ordered = sorted(files, key=lambda f: (f.attached_ns, f.id))
    return [f for f in ordered if status is None or f.status is FileStatus(status)]


async def list_files(
    vector_store_id: StoreId,
    request: Request,
    client: str | None,
    limit: Limit = 20,
    order: Order = "desc",
    after: Cursor = None,
    before: Before = None,
    filter: Filter = None,
) -> VectorStoreFileList:
    record = await asyncio.to_thread(stores_of(request).get, vector_store_id, client)
    files = _of_status(list(record.files.values()), filter)
    return _listed(record.id, files, after=after, before=before, limit=limit, newest_first=order == "desc")


async def get_file(
    vector_store_id: StoreId, file_id: FileId, request: Request, response: Response, client: str | None
) -> VectorStoreFileObject:
    stored = await asyncio.to_thread(stores_of(request).file, vector_store_id, client, file_id)
    _polled(response, stored.status is FileStatus.IN_PROGRESS)
    return VectorStoreFileObject.of(vector_store_id, stored)


async def update_file(
    vector_store_id: StoreId, file_id: FileId, request: Request, body: FileUpdate, client: str | None
) -> VectorStoreFileObject:
    stored = await asyncio.to_thread(stores_of(request).update_file, vector_store_id, client, file_id, body.attributes or {})
    return VectorStoreFileObject.of(vector_store_id, stored)


async def detach_file(vector_store_id: StoreId, file_id: FileId, request: Request, client: str | None) -> VectorStoreFileDeleted:
    stored = await asyncio.to_thread(stores_of(request).detach, vector_store_id, client, file_id)
    return VectorStoreFileDeleted(id=stored.id)


async def file_content(vector_store_id: StoreId, file_id: FileId, request: Request, client: str | None) -> VectorStoreFileContent:
    passages = await asyncio.to_thread(stores_of(request).content, vector_store_id, client, file_id)
    return VectorStoreFileContent(data=[TextContent(text=text) for text in passages])


async def create_batch(vector_store_id: StoreId, request: Request, body: FileBatchCreate, client: str | None) -> FileBatchObject:
    record, batch = await asyncio.to_thread(stores_of(request).add_batch, vector_store_id, client, body.attach)
    return FileBatchObject.of(record, batch)


async def get_batch(
    vector_store_id: StoreId, batch_id: BatchId, request: Request, response: Response, client: str | None
) -> FileBatchObject:
    record, batch = await asyncio.to_thread(stores_of(request).batch, vector_store_id, client, batch_id)
    answer = FileBatchObject.of(record, batch)
    _polled(response, answer.status == "in_progress")
    return answer


async def cancel_batch(vector_store_id: StoreId, batch_id: BatchId, request: Request, client: str | None) -> FileBatchObject:
    record, batch = await asyncio.to_thread(stores_of(request).cancel_batch, vector_store_id, client, batch_id)
    return FileBatchObject.of(record, batch)


async def batch_files(
    vector_store_id: StoreId,
    batch_id: BatchId,
    request: Request,
    client: str | None,
    limit: Limit = 20,
    order: Order = "desc",
    after: Cursor = None,
    before: Before = None,
    filter: Filter = None,
) -> VectorStoreFileList:
    record, batch = await asyncio.to_thread(stores_of(request).batch, vector_store_id, client, batch_id)
    files = _of_status(record.batch_files(batch), filter)
    return _listed(record.id, files, after=after, before=before, limit=limit, newest_first=order == "desc")
