"""What a vector store says of itself (`vector_stores`): its name, metadata, owner, files and
batches, as typed records, kept as one JSON file per store, written by rename (a reader, or a
restart, finds the old description or the new one, whole).

A record never changes: a change is a new record (`dataclasses.replace`), written and then held,
so what a request reads is one version of the store.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol, TypeVar

from telerag.file_search.attribute_filters import Attributes
from telerag.utils.storage import write_by_rename


class FileStatus(StrEnum):
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"


class ErrorCode(StrEnum):
    """Why a file failed, in OpenAI's words (a file's `last_error.code`)."""

    SERVER_ERROR = "server_error"
    UNSUPPORTED_FILE = "unsupported_file"
    INVALID_FILE = "invalid_file"


@dataclass(frozen=True)
class StaticChunking:
    """OpenAI's `static` chunking: passages of at most `max_tokens` of the embedder's tokens, each
    repeating `overlap_tokens` of the one before (the request model holds them to OpenAI's bounds)."""

    max_tokens: int
    overlap_tokens: int


@dataclass(frozen=True)
class FileError:
    code: ErrorCode
    message: str


@dataclass(frozen=True)
class StoreFile:
    """A file attached to a store. `attached_ns` tells one attachment from the next: processing
    that ends after the file was attached again (or detached) changes nothing."""

    id: str  # the file's id in the Files API
    filename: str
    attached_ns: int
    status: FileStatus
    attributes: Attributes
    chunking: StaticChunking | None  # None: auto, the server's own passage rule
    usage_bytes: int = 0  # its passages' text and vectors, once processed
    last_error: FileError | None = None
    batch_id: str | None = None  # the batch that attached it, if one did

    @property
    def created_at(self) -> int:
        return self.attached_ns // 1_000_000_000


@dataclass(frozen=True)
class Attach:
    """A file to attach to a store, with its attributes and how it is cut (None: auto)."""

    file_id: str
    attributes: Attributes
    chunking: StaticChunking | None = None


@dataclass(frozen=True)
class StoreHit:
    file_id: str
    filename: str
    score: float
    attributes: Attributes
    text: str


@dataclass(frozen=True)
class FileBatch:
    id: str
    created_ns: int
    file_ids: tuple[str, ...]
    cancelled: bool = False

    @property
    def created_at(self) -> int:
        return self.created_ns // 1_000_000_000


@dataclass(frozen=True)
class FileCounts:
    in_progress: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0

    @property
    def total(self) -> int:
        return self.in_progress + self.completed + self.failed + self.cancelled

    @classmethod
    def of(cls, files: Sequence[StoreFile]) -> FileCounts:
        statuses = [f.status for f in files]
        return cls(
            *(
                statuses.count(status)
                for status in (FileStatus.IN_PROGRESS, FileStatus.COMPLETED, FileStatus.FAILED, FileStatus.CANCELLED)
            )
        )


@dataclass(frozen=True)
class StoreRecord:
    """A vector store. `trained_on`: the passages its lists were last trained on (0: it has no
    datastore yet, as an IVF cannot be trained on nothing)."""

    id: str
    name: str
    owner: str | None
    created_ns: int
    active_ns: int  # its last change, or search
    metadata: Mapping[str, str] = field(default_factory=dict)
    description: str | None = None
    files: Mapping[str, StoreFile] = field(default_factory=dict)  # by id, in the order attached
    batches: Mapping[str, FileBatch] = field(default_factory=dict)
    trained_on: int = 0

    @property
    def created_at(self) -> int:
        return self.created_ns // 1_000_000_000

    @property
    def last_active_at(self) -> int:
        return self.active_ns // 1_000_000_000

    @property
    def usage_bytes(self) -> int:
        return sum(f.usage_bytes for f in self.files.values())

    @property
    def counts(self) -> FileCounts:
        return FileCounts.of(list(self.files.values()))

    @property
    def in_progress(self) -> bool:
        return self.counts.in_progress > 0

    def with_file(self, stored: StoreFile, now_ns: int) -> StoreRecord:
        """The record with `stored` attached (again, if it was: in its place)."""
        return replace(self, files={**self.files, stored.id: stored}, active_ns=now_ns)

    def without_file(self, file_id: str, now_ns: int) -> StoreRecord:
        return replace(self, files={k: f for k, f in self.files.items() if k != file_id}, active_ns=now_ns)

    def cancelled(self, batch: FileBatch, now_ns: int) -> StoreRecord:
        """The record with `batch` cancelled: its files still in progress too."""
        files = dict(self.files)
        for f in self.batch_files(batch):
            if f.status is FileStatus.IN_PROGRESS:
                files[f.id] = replace(f, status=FileStatus.CANCELLED, usage_bytes=0)
        batches = {**self.batches, batch.id: replace(batch, cancelled=True)}
        return replace(self, files=files, batches=batches, active_ns=now_ns)

    def batch_files(self, batch: FileBatch) -> list[StoreFile]:
        """The batch's files still attached by it (one attached again since belongs to its new attachment)."""
        return [f for i in batch.file_ids if (f := self.files.get(i)) is not None and f.batch_id == batch.id]

    def write(self, path: Path) -> None:
        write_by_rename(path, json.dumps(asdict(self)).encode("utf-8"))

    @classmethod
    def read(cls, path: Path) -> StoreRecord:
        described: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        files = {i: _file(f) for i, f in described.pop("files").items()}
        batches = {i: FileBatch(**{**b, "file_ids": tuple(b["file_ids"])}) for i, b in described.pop("batches").items()}
        return cls(**described, files=files, batches=batches)


def _file(described: dict[str, Any]) -> StoreFile:
    chunking, error = described.pop("chunking"), described.pop("last_error")
    return StoreFile(
        **{**described, "status": FileStatus(described["status"])},
        chunking=None if chunking is None else StaticChunking(**chunking),
        last_error=None if error is None else FileError(ErrorCode(error["code"]), error["message"]),
    )


def open_records(root: Path) -> dict[str, StoreRecord]:
    """The stores' records under `root`, by id; what a deletion or a first build cut short left
    (a folder no record names, or one of a store whose record has no datastore yet) and temporary
    files are removed (the files of a store still in progress are processed again)."""
    if not root.is_dir():
        return {}  # made with the first store
    records = {r.id: r for r in (StoreRecord.read(path) for path in root.glob("*.json"))}
    for path in root.iterdir():
        if path.is_dir() and (path.name not in records or not records[path.name].trained_on or path.name.startswith(".")):
            shutil.rmtree(path)
        elif path.name.startswith("."):  # `write_by_rename`'s
            path.unlink()
    return records


class HasId(Protocol):
    @property
    def id(self) -> str: ...


T = TypeVar("T", bound=HasId)


def page(items: Sequence[T], *, after: str | None, before: str | None, limit: int, newest_first: bool) -> tuple[list[T], bool]:
    """One page of `items` (oldest first) in the order asked: those after the item `after` and
    before the item `before` (ids not among them: no bound), the first `limit` of them (the last
    `limit` with `before` alone: the page just before it), and whether more lie beyond the page."""
    ordered = list(reversed(items)) if newest_first else list(items)
    ids = [item.id for item in ordered]
    start = ids.index(after) + 1 if after in ids else 0
    end = ids.index(before) if before in ids else len(ordered)
    window = ordered[start:end]
    chosen = window[-limit:] if before in ids and after not in ids else window[:limit]
    return chosen, len(window) > limit
