"""A live datastore's documents and writes: what a write asks (`DocumentUpsert`, `DocumentDelete`),
what it did (`WriteResult`), a document as the datastore holds it (`DocumentEntry`), and a write as
its write-ahead log keeps it (`WriteRecord`: a JSON header, then the passages' float32 embeddings,
so that a replay embeds nothing)."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from telerag.retrieval.errors import DatastoreCorruptError
from telerag.retrieval.wal import LogRecord


@dataclass(frozen=True)
class DocumentUpsert:
    """A document's new version, split and embedded (the caller's work: retrieval embeds nothing)."""

    doc_id: str
    title: str
    passages: tuple[str, ...]
    vectors: np.ndarray | None  # float32 (len(passages), dim) as the embedder makes them; None: not embedded, for
    # the caller found the document's content hash unchanged
    content_hash: str  # of what the caller was given; an upsert with the document's current hash changes nothing
    metadata: Mapping[str, Any] = field(default_factory=dict)
    if_absent: bool = False  # written only where no document of its id is held (an ingestion's: never over a client's)


@dataclass(frozen=True)
class DocumentDelete:
    doc_id: str


Write = DocumentUpsert | DocumentDelete


class WriteOutcome(StrEnum):
    CREATED = "created"
    REPLACED = "replaced"
    UNCHANGED = "unchanged"  # the same content hash: nothing written
    DELETED = "deleted"
    NOT_FOUND = "not_found"  # a delete of a document the datastore does not hold


@dataclass(frozen=True)
class DocumentEntry:
    """A document as the datastore holds it now."""

    doc_id: str
    title: str
    version: int  # 1 for the version the datastore was built or first written with, then one more per replacement
    passage_ids: tuple[int, ...]
    content_hash: str | None  # None: built offline, before content hashes were kept
    metadata: Mapping[str, Any]
    lsn: int  # the write that made this version (0: the generation's build)
    updated_at: float | None  # when that write was made (None: at the build)

    def to_json(self) -> dict[str, Any]:
        return {
            "doc_id": self.doc_id,
            "title": self.title,
            "version": self.version,
            "passage_ids": list(self.passage_ids),
            "content_hash": self.content_hash,
            "metadata": dict(self.metadata),
            "lsn": self.lsn,
            "updated_at": self.updated_at,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DocumentEntry:
        return cls(**{**data, "passage_ids": tuple(data["passage_ids"])})


def read_documents(path: Path) -> dict[str, DocumentEntry]:
    """A generation's `documents.jsonl` (one `DocumentEntry` a line), by document id."""
    with path.open(encoding="utf-8") as handle:
        entries = [DocumentEntry.from_json(json.loads(line)) for line in handle]
    return {entry.doc_id: entry for entry in entries}


@dataclass(frozen=True)
class WriteResult:
    outcome: WriteOutcome
    doc_id: str
    lsn: int  # the first snapshot that shows this outcome
    document: DocumentEntry | None  # as it is after the write (None once deleted, or never there)


# -- the log's records ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WriteRecord:
    """One write as the log keeps it: what it removes and adds, decided when it was made. Not the
    lists its passages go to: those are the centroids' of the generation it is applied to (a
    retrain carries the writes made meanwhile into a generation of other centroids)."""

    doc_id: str
    at: float
    removed: tuple[int, ...]
    entry: DocumentEntry | None  # None: a delete
    texts: tuple[str, ...] = ()
    vectors: np.ndarray | None = None  # float32, one row per text

    def encode(self) -> bytes:
        header: dict[str, Any] = {"op": "delete" if self.entry is None else "upsert", "doc_id": self.doc_id, "at": self.at}
        header["removed"] = list(self.removed)
        body = b""
        if self.entry is not None:
            assert self.vectors is not None
            ids = self.entry.passage_ids
            header |= {
                "title": self.entry.title,
                "version": self.entry.version,
                "hash": self.entry.content_hash,
                "metadata": dict(self.entry.metadata),
                "first_id": ids[0] if ids else 0,
                "texts": list(self.texts),
                "dim": int(self.vectors.shape[1]),
            }
            body = np.ascontiguousarray(self.vectors, dtype="<f4").tobytes()
        encoded = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        return struct.pack("<I", len(encoded)) + encoded + body

    @classmethod
    def decode(cls, record: LogRecord, where: str) -> WriteRecord:
        try:
            (length,) = struct.unpack_from("<I", record.payload)
            header = json.loads(record.payload[4 : 4 + length])
            removed = tuple(int(i) for i in header["removed"])
            if header["op"] == "delete":
                return cls(header["doc_id"], float(header["at"]), removed, None)
            texts = tuple(header["texts"])
            first = int(header["first_id"])
            vectors = np.frombuffer(record.payload[4 + length :], dtype="<f4").reshape(len(texts), int(header["dim"]))
            entry = DocumentEntry(
                doc_id=header["doc_id"],
                title=header["title"],
                version=int(header["version"]),
                passage_ids=tuple(range(first, first + len(texts))),
                content_hash=header["hash"],
                metadata=header["metadata"],
                lsn=record.lsn,
                updated_at=float(header["at"]),
            )
            return cls(entry.doc_id, entry.updated_at or 0.0, removed, entry, texts, vectors.astype(np.float32))
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            raise DatastoreCorruptError(f"{where}: the log's record {record.lsn} is unreadable ({exc})") from None
