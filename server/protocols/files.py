"""The models of OpenAI's Files API (`routes/files.py`), in OpenAI's shape, so that the openai
SDK's `client.files` reads them unchanged."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from telerag.file_search.file_store import StoredFile


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int = Field(description="Unix seconds")
    filename: str
    purpose: str
    status: Literal["processed"] = Field("processed", description="stored and readable once the upload is answered")
    expires_at: int | None = Field(None, description="never: a file stays until it is deleted")
    status_details: str | None = None

    @classmethod
    def of(cls, stored: StoredFile) -> FileObject:
        return cls(
            id=stored.id, bytes=stored.bytes, created_at=stored.created_at, filename=stored.filename, purpose=stored.purpose
        )


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: Literal[True] = True
