"""The models of a vector store's files and file batches (`routes/vector_store_files.py`), in
OpenAI's shape, so that the openai SDK's `client.vector_stores.files` and `.file_batches` (their
`create_and_poll` and `upload_and_poll` too) read them unchanged."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from telerag.file_search.vector_store_records import Attach, FileBatch, FileCounts, FileStatus, StoreFile, StoreRecord
from telerag.server.protocols.common import NullOnly
from telerag.server.protocols.vector_stores import (
    MAX_BATCH_FILES,
    Attributes,
    ChunkingIn,
    FileCountsOut,
    FileId,
    Request,
    TextContent,
    chunking_of,
)


class FileAttach(Request):
    file_id: FileId
    attributes: Attributes | None = None
    chunking_strategy: ChunkingIn | None = None

    @property
    def attach(self) -> Attach:
        return Attach(self.file_id, self.attributes or {}, chunking_of(self.chunking_strategy))


class FileUpdate(Request):
    attributes: Attributes | None


ONE_OF = "give file_ids or files, one of them"
EACH_FILES_OWN = "with files, each file's own: give it in each of files"


class FileIdsBatch(Request):
    """`file_ids`, each attached with the batch's `attributes` and `chunking_strategy`."""

    file_ids: Annotated[list[FileId], Field(min_length=1, max_length=MAX_BATCH_FILES)]
    attributes: Attributes | None = None
    chunking_strategy: ChunkingIn | None = None
    files: Annotated[None, NullOnly(ONE_OF)] = None

    @property
    def attach(self) -> list[Attach]:
        return [Attach(i, self.attributes or {}, chunking_of(self.chunking_strategy)) for i in self.file_ids]


class FilesBatch(Request):
    """`files`, each with its own `attributes` and `chunking_strategy`."""

    files: Annotated[list[FileAttach], Field(min_length=1, max_length=MAX_BATCH_FILES)]
    file_ids: Annotated[None, NullOnly(ONE_OF)] = None
    attributes: Annotated[None, NullOnly(EACH_FILES_OWN)] = None
    chunking_strategy: Annotated[None, NullOnly(EACH_FILES_OWN)] = None

    @property
    def attach(self) -> list[Attach]:
        return [f.attach for f in self.files]


def _batch_kind(body: Any) -> str:
    return "by files" if isinstance(body, dict) and body.get("files") is not None else "by file_ids"


FileBatchCreate = Annotated[  # the tags are no field names, so that an error's field path leaves them out
    Annotated[FileIdsBatch, Tag("by file_ids")] | Annotated[FilesBatch, Tag("by files")], Discriminator(_batch_kind)
]


# -- responses ----------------------------------------------------------------------------------


class LastError(BaseModel):
    code: Literal["server_error", "unsupported_file", "invalid_file"]
    message: str


class StaticSizesOut(BaseModel):
    max_chunk_size_tokens: int
    chunk_overlap_tokens: int


class StaticChunkingOut(BaseModel):
    type: Literal["static"] = "static"
    static: StaticSizesOut


class OtherChunkingOut(BaseModel):
    type: Literal["other"] = Field("other", description="auto: the server's own passage rule, in words, not tokens")


class VectorStoreFileObject(BaseModel):
    id: str
    object: Literal["vector_store.file"] = "vector_store.file"
    created_at: int = Field(description="Unix seconds: when it was attached")
    vector_store_id: str
    status: Literal["in_progress", "completed", "cancelled", "failed"]
    usage_bytes: int = Field(description="its passages' text and float32 vectors (until processed: its uploaded size)")
    last_error: LastError | None = None
    attributes: dict[str, bool | float | str]
    chunking_strategy: StaticChunkingOut | OtherChunkingOut

    @classmethod
    def of(cls, store_id: str, stored: StoreFile) -> VectorStoreFileObject:
        error = stored.last_error
        chunking = stored.chunking
        return cls(
            id=stored.id,
            created_at=stored.created_at,
            vector_store_id=store_id,
            status=stored.status.value,
            usage_bytes=stored.usage_bytes,
            last_error=None if error is None else LastError(code=error.code.value, message=error.message),
            attributes=dict(stored.attributes),
            chunking_strategy=OtherChunkingOut()
            if chunking is None
            else StaticChunkingOut(
                static=StaticSizesOut(max_chunk_size_tokens=chunking.max_tokens, chunk_overlap_tokens=chunking.overlap_tokens)
            ),
        )


class VectorStoreFileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VectorStoreFileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class VectorStoreFileDeleted(BaseModel):
    id: str
    object: Literal["vector_store.file.deleted"] = "vector_store.file.deleted"
    deleted: Literal[True] = True


class VectorStoreFileContent(BaseModel):
    object: Literal["vector_store.file_content.page"] = "vector_store.file_content.page"
    data: list[TextContent] = Field(description="its passages, in order (none until it is processed)")
    has_more: Literal[False] = False
    next_page: None = None


class FileBatchObject(BaseModel):
    id: str
    object: Literal["vector_store.files_batch"] = "vector_store.files_batch"
    created_at: int
    vector_store_id: str
    status: Literal["in_progress", "completed", "cancelled", "failed"]
    file_counts: FileCountsOut

    @classmethod
    def of(cls, record: StoreRecord, batch: FileBatch) -> FileBatchObject:
        files = record.batch_files(batch)
        counts = FileCounts.of(files)
        status: Literal["in_progress", "completed", "cancelled", "failed"] = "completed"
        if counts.in_progress:
            status = "in_progress"
        elif batch.cancelled:
            status = "cancelled"
        elif files and all(f.status is FileStatus.FAILED for f in files):
            status = "failed"
        return cls(
            id=batch.id,
            created_at=batch.created_at,
            vector_store_id=record.id,
            status=status,
            file_counts=FileCountsOut.of(counts),
        )
