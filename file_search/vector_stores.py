"""OpenAI's vector stores: each a named set of a key's uploaded files (`file_store`), their
passages in a live datastore of the store's own (`vector_store_index`), searched exactly.

A store is `<root>/<id>.json` (its description, `vector_store_records`, written by rename) and
`<root>/<id>/` (its datastore, once its first file is processed). A file is attached at once
(`in_progress`) and processed in the background, one file at a time in the order attached: read
from the Files API's store, converted as /v1/documents converts an upload, cut into passages,
embedded below queries' priority and written; then `completed`, or `failed` with its reason. A
file still in progress when the server stopped is processed again at its next start.

Each store belongs to the API key that made it (`owner`): another key gets 404 for it, as for a
store that does not exist. A key holds at most `max_stores` stores and `max_bytes` bytes in them
(its files' usage; a file in progress counts its uploaded size).

It is long because it is the one owner of the stores' records: every route of the Vector Stores
API (stores, their files, batches, search) reads and changes them here, under one lock.
"""

from __future__ import annotations

import logging
import queue
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from telerag.documents.conversion import convert
from telerag.documents.errors import FileUnreadable, UnsupportedFile
from telerag.file_search.attribute_filters import AttributeFilter
from telerag.file_search.errors import (
    FileBatchNotFound,
    FileNotFound,
    VectorStoreFileNotFound,
    VectorStoreNotFound,
    VectorStoresTooLarge,
    VectorStoresUnavailable,
)
from telerag.file_search.file_store import FileStore
from telerag.file_search.store_searcher import Batching, StoresSearch, StoresSearcher
from telerag.file_search.vector_store_index import StoreIndex, StoreResources, StoreView
from telerag.file_search.vector_store_records import (
    Attach,
    Attributes,
    ErrorCode,
    FileBatch,
    FileError,
    FileStatus,
    StoreFile,
    StoreHit,
    StoreRecord,
    open_records,
)
from telerag.pipelines.types import MeanQuery
from telerag.retrieval.ranking import DENSE, Ranking
from telerag.utils.storage import fsync_path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Job:
    store_id: str
    file_id: str
    attached_ns: int  # which attachment of the file


class VectorStores:
    """The stores under `root`, served once `serve` hands them the server's embedder."""

    def __init__(
        self,
        root: Path,
        files: FileStore,
        *,
        max_stores: int,
        max_bytes: int,
        compact_share: float | None = None,
        batching: Batching | None = None,
    ) -> None:
        self.root, self.files = Path(root), files
        self.max_stores, self.max_bytes, self.compact_share, self.batching = (
            max_stores,
            max_bytes,
            compact_share,
            batching or Batching(),
        )
        self._lock = threading.Lock()  # the records, and writing them
        self._stores: dict[str, StoreRecord] = {}
        self._indexes_lock = threading.Lock()  # opening a store's index
        self._indexes: dict[str, StoreIndex] = {}
        self._searcher: StoresSearcher | None = None
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._worker: threading.Thread | None = None

    # -- serving ----------------------------------------------------------------------------------

    def serve(self, resources: StoreResources | None) -> None:
        """Serve the stores with `resources` (None: this deployment embeds nothing in process, and
        every call is refused): read their descriptions, remove what a build or a deletion cut
        short left, and process again the files that were in progress."""
        if resources is None:
            return
        self._stores = open_records(self.root)
        left = [
            _Job(s.id, f.id, f.attached_ns)
            for s in self._stores.values()
            for f in s.files.values()
            if f.status is FileStatus.IN_PROGRESS
        ]
        for job in sorted(left, key=lambda job: job.attached_ns):
            self._jobs.put(job)
        self._searcher = StoresSearcher(resources, self.batching)
        self._worker = threading.Thread(target=self._work, name="telerag-vector-stores", daemon=True)
        self._worker.start()

    def _served(self) -> StoreResources:
        return self.searcher.resources

    def close(self) -> None:
        """Stop once the file being processed is done; let go of every store's datastore."""
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join()
            self._worker = None
        with self._indexes_lock:
            for index in self._indexes.values():
                index.close()
            self._indexes.clear()

    # -- stores -----------------------------------------------------------------------------------

    def create(
        self,
        owner: str | None,
        *,
        name: str,
        metadata: Mapping[str, str],
        description: str | None = None,
        attach: Sequence[Attach] = (),
    ) -> StoreRecord:
        """A new store, durable once this returns, with `attach`'s files attached (in progress)."""
        self._served()
        now = time.time_ns()
        record = StoreRecord(f"vs_{secrets.token_hex(12)}", name, owner, now, now, dict(metadata), description)
        with self._lock:
            held = [s for s in self._stores.values() if s.owner == owner]
            if len(held) >= self.max_stores:
                raise VectorStoresTooLarge(
                    f"this key holds {len(held)} vector stores, vector_stores.max_stores_per_key ({self.max_stores}): "
                    "delete some first"
                )
            record = self._attached(record, attach, None, now)
            self._keep(record)
        return record

    def get(self, store_id: str, owner: str | None) -> StoreRecord:
        self._served()
        with self._lock:
            record = self._stores.get(store_id)
        if record is None or record.owner != owner:
            raise VectorStoreNotFound(f"no vector store {store_id!r}")
        return record

    def stores(self, owner: str | None) -> list[StoreRecord]:
        """The owner's stores, oldest first."""
        self._served()
        with self._lock:
            held = [s for s in self._stores.values() if s.owner == owner]
        return sorted(held, key=lambda s: (s.created_ns, s.id))

    def modify(self, store_id: str, owner: str | None, *, name: str | None, metadata: Mapping[str, str] | None) -> StoreRecord:
        """A new name, new metadata (each None: as it was)."""

        def change(record: StoreRecord) -> StoreRecord:
            return replace(
                record,
                name=record.name if name is None else name,
                metadata=record.metadata if metadata is None else dict(metadata),
                active_ns=time.time_ns(),
            )

        return self._change(store_id, owner, change)

    def delete(self, store_id: str, owner: str | None) -> StoreRecord:
        """Gone once this returns: its description first (a store is there while it is), then,
        once the change and searches under way end, its datastore."""
        record = self.get(store_id, owner)
        with self._lock:
            if self._stores.pop(record.id, None) is None:
                raise VectorStoreNotFound(f"no vector store {store_id!r}")  # deleted by another request meanwhile
            (self.root / f"{record.id}.json").unlink()
            fsync_path(self.root)
        with self._indexes_lock:
            index = self._indexes.pop(record.id, None)
        if index is not None:
            index.close()
        shutil.rmtree(self.root / record.id, ignore_errors=True)
        return record

    # -- files ------------------------------------------------------------------------------------

    def attach(self, store_id: str, owner: str | None, attach: Attach) -> StoreFile:
        """Attach a file (again, if it was: its passages replaced once it is processed)."""
        record = self._change(store_id, owner, lambda r: self._attached(r, [attach], None, time.time_ns()))
        return record.files[attach.file_id]

    def add_batch(self, store_id: str, owner: str | None, attach: Sequence[Attach]) -> tuple[StoreRecord, FileBatch]:
        """Attach `attach`'s files as one batch."""
        now = time.time_ns()
        batch = FileBatch(f"vsfb_{secrets.token_hex(12)}", now, tuple(dict.fromkeys(a.file_id for a in attach)))

        def change(record: StoreRecord) -> StoreRecord:
            record = self._attached(record, attach, batch.id, now)
            return replace(record, batches={**record.batches, batch.id: batch})

        return self._change(store_id, owner, change), batch

    def batch(self, store_id: str, owner: str | None, batch_id: str) -> tuple[StoreRecord, FileBatch]:
        record = self.get(store_id, owner)
        batch = record.batches.get(batch_id)
        if batch is None:
            raise FileBatchNotFound(f"no file batch {batch_id!r} in vector store {store_id!r}")
        return record, batch

    def cancel_batch(self, store_id: str, owner: str | None, batch_id: str) -> tuple[StoreRecord, FileBatch]:
        """Its files not processed yet are cancelled (one being written ends, then leaves the store's searches)."""
        _, batch = self.batch(store_id, owner, batch_id)
        record = self._change(store_id, owner, lambda r: r.cancelled(batch, time.time_ns()))
        return record, record.batches[batch.id]

    def file(self, store_id: str, owner: str | None, file_id: str) -> StoreFile:
        stored = self.get(store_id, owner).files.get(file_id)
        if stored is None:
            raise VectorStoreFileNotFound(f"no file {file_id!r} in vector store {store_id!r}")
        return stored

    def update_file(self, store_id: str, owner: str | None, file_id: str, attributes: Attributes) -> StoreFile:
        self.file(store_id, owner, file_id)

        def change(record: StoreRecord) -> StoreRecord:
            if file_id not in record.files:
                raise VectorStoreFileNotFound(f"no file {file_id!r} in vector store {store_id!r}")
            return record.with_file(replace(record.files[file_id], attributes=dict(attributes)), time.time_ns())

        return self._change(store_id, owner, change).files[file_id]

    def detach(self, store_id: str, owner: str | None, file_id: str) -> StoreFile:
        """Gone once this returns: its passages leave every search that starts after (the file
        stays in the Files API)."""
        stored = self.file(store_id, owner, file_id)
        self._change(store_id, owner, lambda record: record.without_file(file_id, time.time_ns()))
        self._index(store_id).delete(file_id)
        return stored

    def content(self, store_id: str, owner: str | None, file_id: str) -> list[str]:
        """The file's passages, as the store holds them."""
        self.file(store_id, owner, file_id)
        return self._index(store_id).passages(file_id)

    # -- search -----------------------------------------------------------------------------------

    @property
    def searcher(self) -> StoresSearcher:
        """Every request's searches of the stores, batched, with the server's embedder (501 where
        none is served)."""
        if self._searcher is None:
            raise VectorStoresUnavailable("this deployment serves no vector stores (a Ray cluster's inference replicas)")
        return self._searcher

    def views(self, store_ids: Sequence[str], owner: str | None, where: AttributeFilter | None = None) -> list[StoreView]:
        """The owner's stores as a request reads them from now on: each one's snapshot (of the
        files `where` holds for, all: None) and its files as of now; an unknown store or another
        key's is `VectorStoreNotFound`."""
        views = []
        for store_id in dict.fromkeys(store_ids):
            record = self.get(store_id, owner)
            matching = None if where is None else [f.id for f in record.files.values() if where.holds(f.attributes)]
            index = self._index(store_id)
            views.append(StoreView(store_id, index, index.view(matching), record.files))
            with self._lock:
                latest = self._stores.get(store_id)
                if latest is not None:
                    self._stores[store_id] = replace(latest, active_ns=time.time_ns())  # kept with its next change
        return views

    def search(
        self,
        store_id: str,
        owner: str | None,
        queries: Sequence[str],
        k: int,
        score_threshold: float | None = None,
        where: AttributeFilter | None = None,
        ranking: Ranking = DENSE,
    ) -> list[StoreHit]:
        """The store's top k passages for the queries (by `ranking`: their mean embedding, their
        words, or both), exact at the store's default nprobe, over the files whose attributes
        `where` holds for (all: None); those under `score_threshold` left out. In a worker thread: it embeds."""
        (view,) = self.views([store_id], owner, where)
        query = MeanQuery(tuple(queries)) if len(queries) > 1 else queries[0]
        (outcome,) = self.searcher.search_now([StoresSearch([view], [query], k, ranking, score_threshold)])
        return [StoreHit(d.doc_id, d.title, d.score, view.files[d.doc_id].attributes, d.text) for d in outcome.documents[0]]

    # -- records ----------------------------------------------------------------------------------

    def _change(self, store_id: str, owner: str | None, change: Callable[[StoreRecord], StoreRecord]) -> StoreRecord:
        """`change` made to the owner's store and written, under the records' lock."""
        self.get(store_id, owner)
        with self._lock:
            record = self._stores.get(store_id)
            if record is None:
                raise VectorStoreNotFound(f"no vector store {store_id!r}")  # deleted by another request meanwhile
            changed = change(record)
            self._keep(changed)
        return changed

    def _keep(self, record: StoreRecord) -> None:
        """Written, then held (the lock held)."""
        self.root.mkdir(parents=True, exist_ok=True)
        record.write(self.root / f"{record.id}.json")
        self._stores[record.id] = record

    def _attached(self, record: StoreRecord, attach: Sequence[Attach], batch_id: str | None, now: int) -> StoreRecord:
        """`record` with `attach`'s files attached, in progress and queued (the lock held): each
        the owner's (else `FileNotFound`), within the owner's bytes."""
        uploaded = [self.files.get(a.file_id, record.owner) for a in attach]
        held = sum(s.usage_bytes for s in self._stores.values() if s.owner == record.owner and s.id != record.id)
        replaced = {a.file_id for a in attach}
        kept = sum(f.usage_bytes for f in record.files.values() if f.id not in replaced)
        total = held + kept + sum({u.id: u.bytes for u in uploaded}.values())
        if total > self.max_bytes:
            raise VectorStoresTooLarge(
                f"this key's vector stores would hold {total} bytes, over vector_stores.max_bytes_per_key ({self.max_bytes}): "
                "delete some files or stores first"
            )
        for a, u in zip(attach, uploaded, strict=True):
            stored = StoreFile(
                u.id, u.filename, now, FileStatus.IN_PROGRESS, dict(a.attributes), a.chunking, u.bytes, None, batch_id
            )
            record = record.with_file(stored, now)
            self._jobs.put(_Job(record.id, u.id, now))
        return record

    # -- processing -------------------------------------------------------------------------------

    def _index(self, store_id: str) -> StoreIndex:
        """The store's index, opened at its first use."""
        resources = self._served()
        with self._indexes_lock:
            index = self._indexes.get(store_id)
            if index is None:
                with self._lock:
                    record = self._stores.get(store_id)
                if record is None:
                    raise VectorStoreNotFound(f"no vector store {store_id!r}")
                index = StoreIndex(
                    self.root / store_id, resources, trained_on=record.trained_on, compact_share=self.compact_share
                )
                self._indexes[store_id] = index
            return index

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._process(job)
            except VectorStoreNotFound:  # deleted meanwhile: nothing to say it to
                continue
            except Exception:  # the file says so; the next file goes on
                log.exception("vector store %s: processing file %s failed", job.store_id, job.file_id)
                self._finish(job, FileStatus.FAILED, FileError(ErrorCode.SERVER_ERROR, "the server failed to process the file"))

    def _process(self, job: _Job) -> None:
        """Read, convert, cut, embed and write one file, unless it was detached or attached again meanwhile."""
        with self._lock:
            record = self._stores.get(job.store_id)
            stored = None if record is None else _in_progress(record, job)
        if record is None or stored is None:
            return
        try:
            uploaded = self.files.get(stored.id, record.owner)
            converted = convert(self.files.content(stored.id, record.owner), uploaded.format)
        except (FileNotFound, UnsupportedFile, FileUnreadable) as exc:
            code = ErrorCode.UNSUPPORTED_FILE if isinstance(exc, UnsupportedFile) else ErrorCode.INVALID_FILE
            why = "the file was deleted from /v1/files" if isinstance(exc, FileNotFound) else str(exc)
            self._finish(job, FileStatus.FAILED, FileError(code, why))
            return
        index = self._index(job.store_id)
        title = converted.title or stored.filename
        usage = index.write(stored.id, title, converted.text, stored.chunking, wanted=lambda: self._current(job))
        if usage is not None:
            self._finish(job, FileStatus.COMPLETED, None, usage, index)

    def _current(self, job: _Job) -> bool:
        """Whether the job's attachment is still attached and in progress."""
        with self._lock:
            record = self._stores.get(job.store_id)
            return record is not None and _in_progress(record, job) is not None

    def _finish(
        self, job: _Job, status: FileStatus, error: FileError | None, usage: int = 0, index: StoreIndex | None = None
    ) -> None:
        """The attachment's outcome, written; the store's trained size with it. Passages written
        for an attachment cancelled meanwhile are deleted."""
        with self._lock:
            record = self._stores.get(job.store_id)
            if record is None:
                return
            stored = _in_progress(record, job)
            if index is not None:
                record = replace(record, trained_on=index.trained_on)
            if stored is not None:
                record = record.with_file(replace(stored, status=status, last_error=error, usage_bytes=usage), time.time_ns())
            self._keep(record)
            cancelled = (
                stored is None and (other := record.files.get(job.file_id)) is not None and other.attached_ns == job.attached_ns
            )
        if index is not None and cancelled:
            index.delete(job.file_id)


def _in_progress(record: StoreRecord, job: _Job) -> StoreFile | None:
    """The job's attachment, if it is still attached and in progress."""
    stored = record.files.get(job.file_id)
    current = stored is not None and stored.attached_ns == job.attached_ns and stored.status is FileStatus.IN_PROGRESS
    return stored if current else None
