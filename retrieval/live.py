"""A live datastore: documents added, replaced and deleted while it is searched; every write
exact, durable once acknowledged, and visible to every search that starts after.

The generation's files (`retrieval.datastore`) never change. Every write since is a record of the
write-ahead log (`retrieval.wal`), which carries its own embeddings, so that opening the datastore
replays it without embedding anything. Applied, a write appends rows to the delta (each in the
list of its nearest centroid, as faiss's `add_with_ids` puts it) and tombstones the ids it
removes (as `remove_ids` would); then a new `Snapshot` is published, which searches read
(`retrieval.snapshot`). An upsert is one record, so a snapshot holds either all of a document's
old passages or all of its new ones.

Writes are serialised (one writer, holding `live.lock`; another process may open the datastore
read-only) and grouped: `write` takes a batch, appends its records and syncs once (group commit)
before anything is applied or acknowledged.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from telerag.retrieval.corpus import Passage, PassageShape
from telerag.retrieval.datastore import LOCK, Datastore, Manifest, wal_name
from telerag.retrieval.documents import (
    DocumentDelete,
    DocumentEntry,
    DocumentUpsert,
    Write,
    WriteOutcome,
    WriteRecord,
    WriteResult,
)
from telerag.retrieval.errors import DatastoreBusy, DatastoreCorruptError, DatastoreError, DatastoreReadOnly
from telerag.retrieval.snapshot import DeltaRows, Snapshot
from telerag.retrieval.wal import WriteAheadLog, read_log

log = logging.getLogger(__name__)

BASE_LIST_BLOCK = 4096  # rows of the generation's passages read at once when its documents are first listed


# -- the datastore ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LiveStats:
    lsn: int
    generation: int
    documents: int
    passages: int
    delta_rows: int  # rows added since the generation was written (deleted ones included)
    tombstones: int  # deleted ids not yet compacted away
    wal_bytes: int
    imbalance: float  # the largest list over the mean list


class _Growing:
    """An array that rows are appended to, and whose prefixes stay valid views: growing makes a
    new array (the views hold the old one), and appends land past every view's end."""

    def __init__(self, dtype: np.dtype | type, width: int | None = None) -> None:
        self._shape = () if width is None else (width,)
        self._data = np.empty((64, *self._shape), dtype=dtype)
        self.size = 0

    def append(self, rows: np.ndarray) -> None:
        needed = self.size + len(rows)
        if needed > len(self._data):
            grown = np.empty((max(needed, 2 * len(self._data)), *self._shape), dtype=self._data.dtype)
            grown[: self.size] = self._data[: self.size]
            self._data = grown
        self._data[self.size : needed] = rows
        self.size = needed

    def view(self) -> np.ndarray:
        return self._data[: self.size]


class LiveDatastore:
    """A datastore's generation, the writes since, and the snapshot searches read now."""

    def __init__(self, datastore: Datastore, *, generation: int = 0, writable: bool = False) -> None:
        """Open the writes made since `datastore` (generation `generation`) was written: replayed
        from its log; with `writable`, the log open for appending under the datastore's lock
        (refused, `DatastoreBusy`, while another process holds it)."""
        self.datastore = datastore
        self.path = datastore.path
        self.generation = generation
        self.where = datastore.where
        self._lock = threading.Lock()  # the state below, and the snapshot published from it
        self._write_lock = threading.Lock()  # one write at a time, from its plan to its acknowledgment
        self._lock_file: int | None = None
        self._wal: WriteAheadLog | None = None
        self._read_bytes = 0  # read-only: the log's size when it was read
        self._quantizer = faiss.IndexFlatIP(datastore.dim)
        self._quantizer.add(np.ascontiguousarray(datastore.centroids, dtype=np.float32))
        dtype = datastore.codec.numpy_dtype
        self._delta_ids, self._delta_lists = _Growing(np.int64), _Growing(np.int64)
        self._delta_codes = _Growing(dtype, datastore.dim)
        self._tomb_ids, self._tomb_lists = _Growing(np.int64), _Growing(np.int64)
        self._passages: dict[int, Passage] = {}
        self._overlay: dict[str, DocumentEntry | None] = {}  # documents written since the generation (None: deleted)
        self._base: dict[str, DocumentEntry] | None = None  # the generation's documents, read when first needed
        self._documents = datastore.manifest.n_documents
        self._next_id = datastore.n_vectors
        self._lsn = 0
        wal_path = None if self.path is None else self.path / wal_name(generation)
        if wal_path is None:
            if writable:
                raise DatastoreReadOnly(f"{self.where} is held in memory: it has no log to write")
            records = []
        elif writable:
            self._lock_file = _lock(wal_path.parent / LOCK, self.where)
            try:
                self._wal = WriteAheadLog(wal_path, next_lsn=1)
                records = self._wal.records
            except BaseException:
                self.close()
                raise
        else:
            contents = read_log(wal_path)
            records, self._read_bytes = contents.records, contents.end
        for record in records:
            self._apply(WriteRecord.decode(record, self.where), record.lsn)
        if records:
            log.info("%s: replayed %d writes from its log (up to LSN %d)", self.where, len(records), self._lsn)
        self._snapshot = self._make_snapshot()

    @classmethod
    def open(
        cls,
        path: Path | str,
        *,
        embedder: str | None = None,
        dim: int | None = None,
        verify_checksums: bool = True,
        writable: bool = False,
        progress: bool = False,
    ) -> LiveDatastore:
        """The datastore at `path` (`Datastore.load`'s checks), live."""
        datastore = Datastore.load(path, embedder=embedder, dim=dim, verify_checksums=verify_checksums, progress=progress)
        try:
            return cls(datastore, writable=writable)
        except BaseException:
            datastore.close()
            raise

    # -- reading --------------------------------------------------------------------------------

    @property
    def writable(self) -> bool:
        return self._wal is not None

    @property
    def manifest(self) -> Manifest:
        return self.datastore.manifest

    @property
    def shape(self) -> PassageShape:
        """How this datastore cuts documents into passages and what of each it embeds (the
        default shape where its build did not record one)."""
        return self.manifest.shape or PassageShape()

    def snapshot(self) -> Snapshot:
        """The latest acknowledged state (a search that starts now sees every acknowledged write)."""
        return self._snapshot

    def document(self, doc_id: str) -> DocumentEntry | None:
        with self._lock:
            return self._entry(doc_id)

    def documents(self, *, after: str | None = None, limit: int = 100) -> list[DocumentEntry]:
        """Up to `limit` documents, ordered by id, those after `after` (a page's last id)."""
        with self._lock:
            ids = set(self._base_documents()) | set(self._overlay)
            page = sorted(i for i in ids if after is None or i > after)
            out = []
            for doc_id in page:
                entry = self._entry(doc_id)
                if entry is not None:
                    out.append(entry)
                    if len(out) == limit:
                        break
            return out

    def stats(self) -> LiveStats:
        snapshot = self._snapshot
        return LiveStats(
            lsn=snapshot.lsn,
            generation=self.generation,
            documents=snapshot.documents,
            passages=snapshot.passages,
            delta_rows=len(snapshot.delta),
            tombstones=len(snapshot.deleted),
            wal_bytes=self._wal.bytes if self._wal is not None else self._read_bytes,
            imbalance=snapshot.imbalance(),
        )

    # -- writing --------------------------------------------------------------------------------

    def write(self, writes: Sequence[Write]) -> list[WriteResult]:
        """Apply `writes` in order, durably: their records appended and synced once, then applied
        and published. Returns one result per write, once every one of them is durable and visible.
        Two writes of one document in a batch apply in order (the second sees the first)."""
        if self._wal is None:
            raise DatastoreReadOnly(f"{self.where} is open read-only here (another process holds it, or it cannot be written)")
        if not self.datastore.has_passages:
            raise DatastoreReadOnly(f"{self.where} holds vectors only, no passages: documents cannot be written to it")
        with self._write_lock:
            records, results = self._plan(writes)
            if records:
                lsns = self._wal.append([record.encode() for record, _ in records])
                self._wal.sync()
                with self._lock:
                    for (record, _), lsn in zip(records, lsns, strict=True):
                        self._apply(record, lsn)
                    self._snapshot = self._make_snapshot()
                for (_, at), lsn in zip(records, lsns, strict=True):
                    result = results[at]
                    entry = None if result.document is None else replace(result.document, lsn=lsn)
                    results[at] = replace(result, lsn=lsn, document=entry)
            lsn = self._lsn
            return [result if result.lsn else replace(result, lsn=lsn) for result in results]

    def _plan(self, writes: Sequence[Write]) -> tuple[list[tuple[WriteRecord, int]], list[WriteResult]]:
        """What each write does against the state before it (the batch's earlier writes
        included): its record (with the index of its result), or no record for one that changes nothing."""
        pending: dict[str, DocumentEntry | None] = {}
        records: list[tuple[WriteRecord, int]] = []
        results: list[WriteResult] = []
        next_id = self._next_id
        now = time.time()
        with self._lock:
            for write in writes:
                current = pending[write.doc_id] if write.doc_id in pending else self._entry(write.doc_id)
                if isinstance(write, DocumentDelete):
                    if current is None:
                        results.append(WriteResult(WriteOutcome.NOT_FOUND, write.doc_id, 0, None))
                        continue
                    pending[write.doc_id] = None
                    records.append((WriteRecord(write.doc_id, now, current.passage_ids, None), len(results)))
                    results.append(WriteResult(WriteOutcome.DELETED, write.doc_id, 0, None))
                    continue
                if current is not None and current.content_hash == write.content_hash:
                    results.append(WriteResult(WriteOutcome.UNCHANGED, write.doc_id, 0, current))
                    continue
                vectors = self._checked_vectors(write)
                ids = tuple(range(next_id, next_id + len(write.passages)))
                next_id += len(ids)
                entry = DocumentEntry(
                    doc_id=write.doc_id,
                    title=write.title,
                    version=1 if current is None else current.version + 1,
                    passage_ids=ids,
                    content_hash=write.content_hash,
                    metadata=dict(write.metadata),
                    lsn=0,
                    updated_at=now,
                )
                pending[write.doc_id] = entry
                lists = self._quantizer.search(vectors, 1)[1][:, 0].astype(np.int64) if len(vectors) else np.empty(0, np.int64)
                removed = () if current is None else current.passage_ids
                records.append((WriteRecord(write.doc_id, now, removed, entry, write.passages, lists, vectors), len(results)))
                outcome = WriteOutcome.CREATED if current is None else WriteOutcome.REPLACED
                results.append(WriteResult(outcome, write.doc_id, 0, entry))
        return records, results

    def _checked_vectors(self, write: DocumentUpsert) -> np.ndarray:
        if write.vectors is None:
            raise DatastoreError(f"document {write.doc_id!r} changed, but its passages were not embedded")
        vectors = np.ascontiguousarray(write.vectors, dtype=np.float32)
        if vectors.shape != (len(write.passages), self.datastore.dim):
            raise DatastoreError(
                f"document {write.doc_id!r}: vectors of shape {vectors.shape} for {len(write.passages)} passages "
                f"of dim {self.datastore.dim}"
            )
        if not write.passages:
            raise DatastoreError(f"document {write.doc_id!r} has no passages")
        return vectors

    # -- state ------------------------------------------------------------------------------------

    def _apply(self, record: WriteRecord, lsn: int) -> None:
        """`record`'s effect on the state (under `_lock`, or while opening)."""
        if record.removed:
            removed = np.asarray(record.removed, dtype=np.int64)
            self._tomb_lists.append(self._lists_of(removed))
            self._tomb_ids.append(removed)
        entry = record.entry
        if entry is not None:
            assert record.vectors is not None
            ids = np.asarray(entry.passage_ids, dtype=np.int64)
            codes = self.datastore.codec.to_codes(record.vectors, self.datastore.codec_params)
            self._delta_ids.append(ids)
            self._delta_lists.append(record.lists)
            self._delta_codes.append(codes)
            for passage_id, text in zip(entry.passage_ids, record.texts, strict=True):
                self._passages[passage_id] = Passage(doc_id=entry.doc_id, title=entry.title, text=text)
            self._next_id = max(self._next_id, int(ids[-1]) + 1) if len(ids) else self._next_id
            entry = replace(entry, lsn=lsn)
        existed = self._entry(record.doc_id) is not None
        self._documents += (entry is not None) - existed
        self._overlay[record.doc_id] = entry
        self._lsn = lsn

    def _lists_of(self, ids: np.ndarray) -> np.ndarray:
        """The list each id lies in: a generation row by the offsets, a delta row as it was added."""
        base = ids < self.datastore.n_vectors
        out = np.empty(len(ids), dtype=np.int64)
        out[base] = np.searchsorted(self.datastore.offsets, ids[base], side="right") - 1
        if (~base).any():
            delta_ids = self._delta_ids.view()
            at = np.searchsorted(delta_ids, ids[~base])
            if np.any(at >= len(delta_ids)) or np.any(delta_ids[np.minimum(at, len(delta_ids) - 1)] != ids[~base]):
                raise DatastoreCorruptError(f"{self.where}: the log removes ids it never added")
            out[~base] = self._delta_lists.view()[at]
        return out

    def _entry(self, doc_id: str) -> DocumentEntry | None:
        if doc_id in self._overlay:
            return self._overlay[doc_id]
        return self._base_documents().get(doc_id)

    def _base_documents(self) -> dict[str, DocumentEntry]:
        """The generation's documents, from its passages (read once, on first need)."""
        if self._base is None:
            rows: dict[str, list[int]] = {}
            titles: dict[str, str] = {}
            if self.datastore.has_passages:
                for start in range(0, self.datastore.n_vectors, BASE_LIST_BLOCK):
                    block = range(start, min(start + BASE_LIST_BLOCK, self.datastore.n_vectors))
                    for row, passage in zip(block, self.datastore.passages(block), strict=True):
                        rows.setdefault(passage.doc_id, []).append(row)
                        titles.setdefault(passage.doc_id, passage.title)
            self._base = {
                doc_id: DocumentEntry(doc_id, titles[doc_id], 1, tuple(ids), None, {}, 0, None) for doc_id, ids in rows.items()
            }
        return self._base

    def _make_snapshot(self) -> Snapshot:
        tomb_ids = self._tomb_ids.view()
        return Snapshot(
            lsn=self._lsn,
            generation=self.generation,
            datastore=self.datastore,
            delta=DeltaRows(self._delta_ids.view(), self._delta_lists.view(), self._delta_codes.view()),
            deleted=np.sort(tomb_ids),
            deleted_per_list=np.bincount(self._tomb_lists.view(), minlength=self.datastore.nlist).astype(np.int64),
            delta_passages=self._passages,
            documents=self._documents,
        )

    def close(self) -> None:
        if self._wal is not None:
            self._wal.close()
            self._wal = None
        if self._lock_file is not None:
            os.close(self._lock_file)  # releases the flock
            self._lock_file = None


def _lock(path: Path, where: str) -> int:
    """Hold the datastore's write lock (an flock on `path`, created if missing): released when
    the process ends, however it ends."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DatastoreBusy(
            f"{where} is held for writing by another process (a server?): write to it through that server, or stop it first"
        ) from None
    return fd


@contextlib.contextmanager
def opened(path: Path | str, **options: Any) -> Iterator[LiveDatastore]:
    """`LiveDatastore.open`, closed on exit (the datastore's files too)."""
    live = LiveDatastore.open(path, **options)
    try:
        yield live
    finally:
        live.close()
        live.datastore.close()
