"""A live datastore: documents added, replaced and deleted while it is searched; every write
exact, durable once acknowledged, and visible to every search that starts after.

A generation's files (`retrieval.datastore`) never change. Every write since is a record of the
write-ahead log (`retrieval.wal`), which carries its own embeddings, so that opening the datastore
replays it without embedding anything; applied (`retrieval.live_state`), it publishes a new
`Snapshot`, which searches read (`retrieval.snapshot`). An upsert is one record, so a snapshot holds
either all of a document's old passages or all of its new ones.

Writes are serialised (one writer, holding `live.lock`) and grouped: `write` takes a batch,
appends its records and syncs once (group commit) before anything is applied or acknowledged.
Other processes (an inference replica on any node of a Ray cluster, the directory on a volume
they all mount) open the datastore read-only and follow the writer: each read (a snapshot, a
document, a page) first applies what the writer appended since, in order, and moves to a
generation the writer switched to, so a request that starts after a write was acknowledged, in
any process, sees it. A record the writer is still appending (or that a crash cut short) is
left until it is whole; a record appended and not yet synced may be seen before its
acknowledgment, which a crash of the writer's process never takes back (the data is in the
page cache or the volume's server) and only the loss of the writer's machine before its sync
could.

The module is long because writing and following are the two sides of one log and one switch
of generations, each the mirror of the other's steps.

`compact` and `retrain` write a new generation (`retrieval.compaction`) from a snapshot while
writes go on, then switch under the write lock: the writes made meanwhile are carried into the new
generation's log, `live.json` is renamed into place (`retrieval.generations`), and the next
snapshot is the new generation's. A compaction changes no result; a retrain does, and says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from telerag.retrieval.compaction import write_generation
from telerag.retrieval.corpus import PassageShape
from telerag.retrieval.datastore import Datastore, Manifest
from telerag.retrieval.documents import DocumentEntry, Write, WriteRecord, WriteResult
from telerag.retrieval.errors import DatastoreBusy, DatastoreError, DatastoreReadOnly
from telerag.retrieval.generations import (
    LOCK,
    POINTER,
    Generation,
    generation_dir,
    read_generation,
    stale,
    switch_to,
    wal_name,
)
from telerag.retrieval.live_state import GenerationState
from telerag.retrieval.snapshot import Snapshot
from telerag.retrieval.wal import LogRecord, WriteAheadLog, read_log
from telerag.utils.storage import fsync_path

log = logging.getLogger(__name__)

FOLLOW_ATTEMPTS = 5  # a reader opening the generation a writer switched to, while it switches again
MOVED_ON = (-1, -1)  # a pointer stamp no file has: the writer switched since the files this reader opened


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
    published: int  # write batches made searchable since the datastore was opened
    publish_seconds: float  # their time from durable (the log synced) to searchable (the snapshot published), all together


@dataclass(frozen=True)
class Rebuilt:
    """What a compaction or retrain made: the new generation, as of which write, and how long."""

    generation: int
    lsn: int  # the last write its files include (later ones were carried into its log)
    passages: int
    carried: int  # writes made while it was built, carried into its log
    seconds: float
    retrained: bool  # new centroids: results may differ from the generation before


class LiveDatastore:
    """A datastore's current generation, the writes since, and the snapshot searches read now."""

    def __init__(self, datastore: Datastore, *, writable: bool = False) -> None:
        """Open the writes made since `datastore`'s generation was written: replayed from its log;
        with `writable`, the log open for appending under the datastore's lock (refused,
        `DatastoreBusy`, while another process holds it), and what earlier generations left removed."""
        self.where = datastore.where
        self.root = datastore.root
        self._lock = threading.Lock()  # the state, and the snapshot published from it
        self._write_lock = threading.Lock()  # one write (or switch) at a time, from its plan to its acknowledgment
        self._lock_file: int | None = None
        self._wal: WriteAheadLog | None = None
        self._read_bytes = 0  # read-only: where the whole records of the log read so far end
        self._following = threading.Lock()  # read-only: one catch-up with the writer at a time
        self._pointer: tuple[int, int] | None = None  # read-only: live.json's (inode, mtime) when last read
        self._published, self._publish_seconds = 0, 0.0  # write batches made searchable, and how long that took
        self._state = GenerationState(datastore)
        records: list[LogRecord] = []
        if self.root is None:  # held in memory: nothing was ever written to it
            if writable:
                raise DatastoreReadOnly(f"{self.where} is held in memory: it has no log to write")
        elif writable:
            self._lock_file = _lock(self.root / LOCK, self.where)
            try:
                self._remove_stale()
                self._wal = WriteAheadLog(self._wal_path(datastore), next_lsn=datastore.generation.lsn + 1)
                records = self._wal.take_records()
            except BaseException:
                self.close()
                raise
        else:
            stamp = _pointer_stamp(self.root)  # before the generation is read: a switch after it changes the stamp
            self._pointer = stamp if read_generation(self.root).number == self.generation else MOVED_ON
            contents = read_log(self._wal_path(datastore))
            records, self._read_bytes = contents.records, contents.end
        self._replay(self._state, records)
        self._snapshot = self._state.snapshot(self.generation)

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
        """The datastore at `path` (its current generation, `Datastore.load`'s checks), live."""
        datastore = Datastore.load(path, embedder=embedder, dim=dim, verify_checksums=verify_checksums, progress=progress)
        try:
            return cls(datastore, writable=writable)
        except BaseException:
            datastore.close()
            raise

    # -- reading --------------------------------------------------------------------------------

    @property
    def datastore(self) -> Datastore:
        """The current generation's files."""
        return self._state.datastore

    @property
    def generation(self) -> int:
        return self.datastore.generation.number

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
        """The latest acknowledged state (a search that starts now sees every acknowledged write,
        this process's or, read-only, the writer's)."""
        self.follow()
        return self._snapshot

    def snapshot_of(self, doc_ids: Iterable[str]) -> tuple[Snapshot, dict[str, DocumentEntry]]:
        """The latest snapshot and the entries, as of it, of those of `doc_ids` it holds: one
        version of both, for a search of some documents' passages alone."""
        self.follow()
        with self._lock:
            return self._snapshot, {d: e for d in doc_ids if (e := self._state.entry(d)) is not None}

    def document(self, doc_id: str) -> DocumentEntry | None:
        self.follow()
        with self._lock:
            return self._state.entry(doc_id)

    def documents(self, *, after: str | None = None, limit: int = 100) -> list[DocumentEntry]:
        """Up to `limit` documents, ordered by id, those after `after` (a page's last id)."""
        self.follow()
        with self._lock:
            return self._state.documents_page(after, limit)

    def follow(self) -> int:
        """Read-only: catch up with the writer (another process): the records appended to the log
        since it was last read, applied in order, or the generation it switched to, opened with
        its log replayed. Costs a `stat` of two files when nothing changed. Returns the LSN now
        applied (the writer's own, or one held in memory: nothing to follow)."""
        if self._wal is not None or self.root is None:
            return self._state.lsn
        with self._following:
            pointer = _pointer_stamp(self.root)
            if pointer != self._pointer:
                self._open_current()
                self._pointer = pointer
                return self._state.lsn
            path = self._wal_path(self.datastore)
            try:
                size = path.stat().st_size
            except FileNotFoundError:  # removed by a switch whose pointer this read missed: the next call sees it
                return self._state.lsn
            if size > self._read_bytes:
                contents = read_log(path, start=self._read_bytes, after_lsn=self._state.lsn)
                if contents.records:
                    with self._lock:
                        for record in contents.records:
                            self._state.apply(WriteRecord.decode(record, self.where), record.lsn)
                        self._snapshot = self._state.snapshot(self.generation)
                    self._published += 1
                self._read_bytes = contents.end
            return self._state.lsn

    def _open_current(self) -> None:
        """Read-only: the generation `live.json` names now, its log replayed (the writer switched:
        its files are whole before the pointer names them; a generation removed by a later switch
        while it was opened is passed over for that one)."""
        assert self.root is not None
        for attempt in range(FOLLOW_ATTEMPTS):
            try:
                datastore = Datastore.load(self.root, verify_checksums=False)
                contents = read_log(self._wal_path(datastore))
                break
            except (FileNotFoundError, DatastoreError):
                if attempt == FOLLOW_ATTEMPTS - 1:
                    raise
                time.sleep(0.01 * (attempt + 1))
        state = GenerationState(datastore)
        for record in contents.records:
            state.apply(WriteRecord.decode(record, self.where), record.lsn)
        with self._lock:
            self._state = state
            self._snapshot = state.snapshot(datastore.generation.number)
        self._read_bytes = contents.end
        log.info("%s: following the writer to generation %d (LSN %d)", self.where, datastore.generation.number, state.lsn)

    def stats(self) -> LiveStats:
        snapshot = self.snapshot()
        return LiveStats(
            lsn=snapshot.lsn,
            generation=snapshot.generation,
            documents=snapshot.documents,
            passages=snapshot.passages,
            delta_rows=len(snapshot.delta),
            tombstones=len(snapshot.deleted),
            wal_bytes=self._wal.bytes if self._wal is not None else self._read_bytes,
            imbalance=snapshot.imbalance(),
            published=self._published,
            publish_seconds=self._publish_seconds,
        )

    # -- writing --------------------------------------------------------------------------------

    def write(self, writes: Sequence[Write]) -> list[WriteResult]:
        """Apply `writes` in order, durably: their records appended and synced once, then applied
        and published. Returns one result per write, once every one of them is durable and visible.
        Two writes of one document in a batch apply in order (the second sees the first)."""
        with self._write_lock:
            wal = self._writable_log()
            with self._lock:
                records, results = self._state.plan(writes)
            if records:
                lsns = wal.append([record.encode() for record, _ in records])
                wal.sync()
                durable = time.perf_counter()
                with self._lock:
                    for (record, _), lsn in zip(records, lsns, strict=True):
                        self._state.apply(record, lsn)
                    self._snapshot = self._state.snapshot(self.generation)
                self._published += 1
                self._publish_seconds += time.perf_counter() - durable
                for (_, at), lsn in zip(records, lsns, strict=True):
                    result = results[at]
                    entry = None if result.document is None else replace(result.document, lsn=lsn)
                    results[at] = replace(result, lsn=lsn, document=entry)
            lsn = self._state.lsn
            return [result if result.lsn else replace(result, lsn=lsn) for result in results]

    def check_writable(self) -> None:
        """Refuse (`DatastoreReadOnly`) unless this process may write the datastore."""
        if self._wal is None:
            raise DatastoreReadOnly(f"{self.where} is open read-only here (another process holds it, or it cannot be written)")
        if not self.datastore.has_passages:
            raise DatastoreReadOnly(f"{self.where} holds vectors only, no passages: documents cannot be written to it")

    def _writable_log(self) -> WriteAheadLog:
        self.check_writable()
        assert self._wal is not None
        return self._wal

    # -- new generations --------------------------------------------------------------------------

    def compact(self, *, progress: bool = False) -> Rebuilt:
        """Fold the delta and the tombstones into a new generation's files (the same centroids:
        no result changes), while writes go on; then switch to it."""
        return self._rebuild(retrain=False, nlist=None, progress=progress)

    def retrain(self, *, nlist: int | None = None, progress: bool = False) -> Rebuilt:
        """A new generation with new centroids (`nlist`; default: the build's rule), every passage
        assigned again, while writes go on; then switch to it. Results change: the one operation
        that changes them."""
        return self._rebuild(retrain=True, nlist=nlist, progress=progress)

    def _rebuild(self, *, retrain: bool, nlist: int | None, progress: bool) -> Rebuilt:
        """The order of steps is the point: a snapshot and the documents as of its LSN, the new
        generation's files written from them (writes go on meanwhile), then, holding the write
        lock, the writes made since copied into the new generation's log, `live.json` renamed to
        name it (the switch, durable), the new generation opened with those writes replayed, and
        the old generation's files removed."""
        started = time.perf_counter()
        self._writable_log()
        assert self.root is not None
        with self._lock:
            snapshot, catalog, next_id = self._snapshot, self._state.catalog(), self._state.next_id
        number = snapshot.generation + 1
        out_dir = generation_dir(self.root, number)
        write_generation(out_dir, snapshot, catalog, retrain=retrain, nlist=nlist, progress=progress)
        with self._write_lock:
            assert self._wal is not None
            carried = [record for record in read_log(self._wal.path).records if record.lsn > snapshot.lsn]
            wal = WriteAheadLog(self.root / wal_name(number), next_lsn=snapshot.lsn + 1)
            try:
                if wal.take_records():
                    raise DatastoreError(f"{wal.path} holds writes already: a generation {number} was begun before")
                wal.append([record.payload for record in carried])
                wal.sync()
                switch_to(self.root, Generation(number, snapshot.lsn, next_id))
            except BaseException:
                wal.close()
                raise
            datastore = Datastore.load(self.root, verify_checksums=False)
            state = GenerationState(datastore)
            self._replay(state, carried)
            with self._lock:
                self._state = state
                self._snapshot = state.snapshot(number)
            self._wal.close()
            self._wal = wal
            self._remove_stale()
        rebuilt = Rebuilt(number, snapshot.lsn, datastore.n_vectors, len(carried), time.perf_counter() - started, retrain)
        log.info(
            "%s: generation %d written (%s, %d passages, up to LSN %d; %d writes made meanwhile carried) in %.1f s",
            self.where,
            number,
            "retrained: new centroids, results may differ" if retrain else "compacted: the same results",
            rebuilt.passages,
            rebuilt.lsn,
            rebuilt.carried,
            rebuilt.seconds,
        )
        return rebuilt

    # -- the files ----------------------------------------------------------------------------------

    def _wal_path(self, datastore: Datastore) -> Path:
        assert self.root is not None
        return self.root / wal_name(datastore.generation.number)

    def _replay(self, state: GenerationState, records: Sequence[LogRecord]) -> None:
        for record in records:
            state.apply(WriteRecord.decode(record, self.where), record.lsn)
        if records:
            log.info("%s: replayed %d writes from its log (up to LSN %d)", self.where, len(records), state.lsn)

    def _remove_stale(self) -> None:
        """Remove what earlier generations (or a build killed before its switch) left: the
        project's own folders and logs, never generation 0's files."""
        assert self.root is not None
        for path in stale(self.root, self.generation):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            log.info("%s: removed %s, left by an earlier generation", self.where, path.name)
        fsync_path(self.root)

    def close(self) -> None:
        if self._wal is not None:
            self._wal.close()
            self._wal = None
        if self._lock_file is not None:
            os.close(self._lock_file)  # releases the flock
            self._lock_file = None


def _pointer_stamp(root: Path) -> tuple[int, int] | None:
    """`live.json`'s inode and modification time (None: generation 0, no switch yet): a switch
    renames a new file into place, so either changes."""
    try:
        stat = (root / POINTER).stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_mtime_ns


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
