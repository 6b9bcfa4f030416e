"""The models of a vector store's files and file batches (`routes/vector_store_files.py`), in
OpenAI's shape, so that the openai SDK's `client.vector_stores.files` and `.file_batches` (their
`create_and_poll` and `upload_and_poll` too) read them unchanged."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from telerag.pipelines.vector_store_records import Attach, FileBatch, FileCounts, FileStatus, StoreFile, StoreRecord
from telerag.server.protocols.common import refuse
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


class FileBatchCreate(Request):
    """`file_ids` with the batch's `attributes` and `chunking_strategy`, or `files`, each with its own."""

    file_ids: Annotated[list[FileId], Field(min_length=1, max_length=MAX_BATCH_FILES)] | None = None
    files: Annotated[list[FileAttach], Field(min_length=1, max_length=MAX_BATCH_FILES)] | None = None
    attributes: Attributes | None = None
    chunking_strategy: ChunkingIn | None = None

    @model_validator(mode="after")
    def _one_of(self) -> FileBatchCreate:
        if (self.files is None) == (self.file_ids is None):
            raise ValueError("give file_ids or files, one of them")
        return self

    @field_validator("attributes", "chunking_strategy")
    @classmethod
    def _batch_wide(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("files") is not None:
            raise refuse("with files, each file's own: give it in each of files")
        return value

    @property
    def attach(self) -> list[Attach]:
        if self.files is not None:
            return [f.attach for f in self.files]
        assert self.file_ids is not None
        return [Attach(i, self.attributes or {}, chunking_of(self.chunking_strategy)) for i in self.file_ids]


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
