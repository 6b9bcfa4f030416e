"""One generation of a live datastore in memory: its files, the writes applied to it since, and the
documents it holds; what a snapshot is made of (`retrieval.live` owns it and its locking).

Applied, a write appends rows to the delta (each in the list of its nearest centroid, as faiss's
`add_with_ids` puts it) and tombstones the ids it removes (as `remove_ids` would). The delta's
arrays only grow, and a snapshot holds their prefixes, which stay valid as they grow.
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections.abc import Sequence
from dataclasses import replace

import faiss
import numpy as np

from telerag.retrieval.corpus import Passage
from telerag.retrieval.datastore import DOCUMENTS, Datastore
from telerag.retrieval.documents import (
    DocumentDelete,
    DocumentEntry,
    DocumentUpsert,
    Write,
    WriteOutcome,
    WriteRecord,
    WriteResult,
    read_documents,
)
from telerag.retrieval.errors import DatastoreCorruptError, DatastoreError
from telerag.retrieval.keywords import DeltaKeywords, GenerationKeywords, KeywordIndex
from telerag.retrieval.snapshot import DeltaRows, Snapshot

BASE_LIST_BLOCK = 4096  # rows of the generation's passages read at once when its documents are first listed


class Growing:
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


class GenerationState:
    """A generation's files and the writes applied to them since (not thread-safe: its owner locks)."""

    def __init__(self, datastore: Datastore) -> None:
        self.datastore = datastore
        self._quantizer = faiss.IndexFlatIP(datastore.dim)
        self._quantizer.add(np.ascontiguousarray(datastore.centroids, dtype=np.float32))
        self._delta_ids, self._delta_lists = Growing(np.int64), Growing(np.int64)
        self._delta_codes = Growing(datastore.codec.numpy_dtype, datastore.dim)
        self._tomb_ids, self._tomb_lists = Growing(np.int64), Growing(np.int64)
        self._passages: dict[int, Passage] = {}
        self._keywords, self._delta_keywords = GenerationKeywords(datastore), DeltaKeywords()
        self._overlay: dict[str, DocumentEntry | None] = {}  # documents written since the generation (None: deleted)
        self._base: dict[str, DocumentEntry] | None = None  # the generation's documents, read when first needed
        self._base_ids: list[str] | None = None  # their ids, sorted, when first paged
        self.documents = datastore.manifest.n_documents
        generation = datastore.generation
        largest = int(datastore.ids.max()) + 1 if datastore.ids is not None and len(datastore.ids) else datastore.n_vectors
        self.next_id = max(largest, generation.next_id or 0)
        self.lsn = generation.lsn

    # -- reading ----------------------------------------------------------------------------------

    def entry(self, doc_id: str) -> DocumentEntry | None:
        if doc_id in self._overlay:
            return self._overlay[doc_id]
        return self._base_documents().get(doc_id)

    def documents_page(self, after: str | None, limit: int) -> list[DocumentEntry]:
        """The first `limit` living documents by id after `after`: the generation's ids (sorted
        once) and the writes' since (sorted each page, fewer) merged, not every id sorted a page."""
        if self._base_ids is None:
            self._base_ids = sorted(self._base_documents())
        base, overlay = self._base_ids, sorted(self._overlay)
        starts = (0, 0) if after is None else (bisect.bisect_right(base, after), bisect.bisect_right(overlay, after))
        merged = heapq.merge((base[i] for i in range(starts[0], len(base))), (overlay[i] for i in range(starts[1], len(overlay))))
        out: list[DocumentEntry] = []
        last = None
        for doc_id in merged:
            if doc_id == last:  # in both: the overlay's entry is the one `entry` gives
                continue
            last = doc_id
            entry = self.entry(doc_id)
            if entry is not None:
                out.append(entry)
                if len(out) == limit:
                    break
        return out

    def catalog(self) -> dict[str, DocumentEntry]:
        """Every living document (what a new generation's files keep of them)."""
        merged: dict[str, DocumentEntry | None] = {**self._base_documents(), **self._overlay}
        return {doc_id: entry for doc_id, entry in merged.items() if entry is not None}

    def snapshot(self, generation: int) -> Snapshot:
        delta_ids = self._delta_ids.view()
        return Snapshot(
            lsn=self.lsn,
            generation=generation,
            datastore=self.datastore,
            delta=DeltaRows(delta_ids, self._delta_lists.view(), self._delta_codes.view()),
            deleted=np.sort(self._tomb_ids.view()),
            deleted_per_list=np.bincount(self._tomb_lists.view(), minlength=self.datastore.nlist).astype(np.int64),
            delta_passages=self._passages,
            documents=self.documents,
            keywords=KeywordIndex(self._keywords, self._delta_keywords, int(delta_ids[-1]) if len(delta_ids) else -1),
        )

    # -- writing ----------------------------------------------------------------------------------

    def plan(self, writes: Sequence[Write]) -> tuple[list[tuple[WriteRecord, int]], list[WriteResult]]:
        """What each write does against the state before it (the batch's earlier writes
        included): its record (with the index of its result), or no record for one that changes nothing."""
        pending: dict[str, DocumentEntry | None] = {}
        records: list[tuple[WriteRecord, int]] = []
        results: list[WriteResult] = []
        next_id = self.next_id
        now = time.time()
        for write in writes:
            current = pending[write.doc_id] if write.doc_id in pending else self.entry(write.doc_id)
            if isinstance(write, DocumentDelete):
                if current is None:
                    results.append(WriteResult(WriteOutcome.NOT_FOUND, write.doc_id, 0, None))
                    continue
                pending[write.doc_id] = None
                records.append((WriteRecord(write.doc_id, now, current.passage_ids, None), len(results)))
                results.append(WriteResult(WriteOutcome.DELETED, write.doc_id, 0, None))
                continue
            if current is not None and (write.if_absent or current.content_hash == write.content_hash):
                results.append(WriteResult(WriteOutcome.UNCHANGED, write.doc_id, 0, current))
                continue
            if write.if_absent and write.vectors is None:  # held when its writer looked, deleted since: it stays so
                results.append(WriteResult(WriteOutcome.UNCHANGED, write.doc_id, 0, None))
                continue
            vectors = self._checked_vectors(write)
            ids = tuple(range(next_id, next_id + len(write.passages)))
            next_id += len(ids)
            version = 1 if current is None else current.version + 1
            entry = DocumentEntry(write.doc_id, write.title, version, ids, write.content_hash, dict(write.metadata), 0, now)
            pending[write.doc_id] = entry
            removed = () if current is None else current.passage_ids
            records.append((WriteRecord(write.doc_id, now, removed, entry, write.passages, vectors), len(results)))
            results.append(
                WriteResult(WriteOutcome.CREATED if current is None else WriteOutcome.REPLACED, write.doc_id, 0, entry)
            )
        return records, results

    def _checked_vectors(self, write: DocumentUpsert) -> np.ndarray:
        if not write.passages:
            raise DatastoreError(f"document {write.doc_id!r} has no passages")
        if write.vectors is None:
            raise DatastoreError(f"document {write.doc_id!r} changed, but its passages were not embedded")
        vectors = np.ascontiguousarray(write.vectors, dtype=np.float32)
        if vectors.shape != (len(write.passages), self.datastore.dim):
            raise DatastoreError(
                f"document {write.doc_id!r}: vectors of shape {vectors.shape} for {len(write.passages)} passages "
                f"of dim {self.datastore.dim}"
            )
        return vectors

    def apply(self, record: WriteRecord, lsn: int) -> None:
        """`record`'s effect on the state."""
        if record.removed:
            removed = np.asarray(record.removed, dtype=np.int64)
            self._tomb_lists.append(self._lists_of(removed))
            self._tomb_ids.append(removed)
        entry = record.entry
        if entry is not None:
            assert record.vectors is not None
            ids = np.asarray(entry.passage_ids, dtype=np.int64)
            self._delta_ids.append(ids)
            self._delta_lists.append(self._quantizer.search(record.vectors, 1)[1][:, 0].astype(np.int64))
            self._delta_codes.append(self.datastore.codec.to_codes(record.vectors, self.datastore.codec_params))
            for passage_id, text in zip(entry.passage_ids, record.texts, strict=True):
                passage = Passage(doc_id=entry.doc_id, title=entry.title, text=text)
                self._passages[passage_id] = passage
                self._delta_keywords.add(passage_id, passage)
            self.next_id = max(self.next_id, int(ids[-1]) + 1)
            entry = replace(entry, lsn=lsn)
        existed = self.entry(record.doc_id) is not None
        self.documents += (entry is not None) - existed
        self._overlay[record.doc_id] = entry
        self.lsn = lsn

    def _lists_of(self, ids: np.ndarray) -> np.ndarray:
        """The list each id lies in: a generation row by the offsets, a delta row as it was added."""
        rows = self.datastore.rows_of(ids)
        base = rows >= 0
        out = np.empty(len(ids), dtype=np.int64)
        out[base] = np.searchsorted(self.datastore.offsets, rows[base], side="right") - 1
        if (~base).any():
            delta_ids = self._delta_ids.view()
            at = np.searchsorted(delta_ids, ids[~base])
            if np.any(at >= len(delta_ids)) or np.any(delta_ids[np.minimum(at, len(delta_ids) - 1)] != ids[~base]):
                raise DatastoreCorruptError(f"{self.datastore.where}: the log removes ids it never added")
            out[~base] = self._delta_lists.view()[at]
        return out

    def _base_documents(self) -> dict[str, DocumentEntry]:
        """The generation's documents (read once, on first need): from its `documents.jsonl`,
        written with a compacted generation, else from its passages (a build's)."""
        if self._base is None:
            datastore = self.datastore
            if datastore.path is not None and DOCUMENTS in datastore.manifest.files:
                self._base = read_documents(datastore.path / DOCUMENTS)
                return self._base
            ids: dict[str, list[int]] = {}
            titles: dict[str, str] = {}
            if datastore.has_passages:
                for start in range(0, datastore.n_vectors, BASE_LIST_BLOCK):
                    block = datastore.ids_of(np.arange(start, min(start + BASE_LIST_BLOCK, datastore.n_vectors)))
                    for passage_id, passage in zip(block.tolist(), datastore.passages(block), strict=True):
                        ids.setdefault(passage.doc_id, []).append(passage_id)
                        titles.setdefault(passage.doc_id, passage.title)
            self._base = {
                doc_id: DocumentEntry(doc_id, titles[doc_id], 1, tuple(sorted(found)), None, {}, 0, None)
                for doc_id, found in ids.items()
            }
        return self._base
