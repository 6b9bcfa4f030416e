"""A datastore's vectors read from disk by explicit reads, for a datastore larger than memory
(AquaPipe's setting): the cluster cache's rows filled from the file (`FileRows`, a `RowSource`)
and the lists no cache holds read and scanned per search (`DiskListSearch`, a `ListSearch`).

Reads bypass the page cache (O_DIRECT, each read widened to the 4 KiB the kernel asks for and
copied out of an aligned scratch; where the file system refuses O_DIRECT, plain reads whose pages
are dropped after: POSIX_FADV_DONTNEED), so memory stays within the cache's budget, a cold search
is cold, and nothing measured is the page cache's. Several reads are in flight at once, each of
at most `READ_BYTES`, on a pool of reader threads (a read releases the GIL), and adjacent lists
are read together: a run of lists is one range of the file.
"""

from __future__ import annotations

import functools
import itertools
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from telerag.retrieval.cache import Copy, Issued, Segment
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.errors import DatastoreCorruptError
from telerag.retrieval.search import merge_topk, scan_resident
from telerag.retrieval.shards import FAISS_PAD_SCORE

ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and memory on the file systems it serves
READ_BYTES = 4 << 20  # one read's most: large enough to stream at the disk's rate, small enough to spread over readers
READERS = 8  # reads in flight at once (one thread each)
SCAN_BYTES = 256 << 20  # a search's lists read and scanned at a time: what it holds at once beside the cache
FIRST_SCAN_BYTES = 16 << 20  # a search's first part: its scan waits for it whole


@dataclass(eq=False)
class _Read:
    """One queued read (a hastened one is queued twice, run once): `read` until a reader takes
    it, then None, so that what the read writes into is not kept alive by whoever waited on it."""

    read: Callable[[], None] | None
    done: Future[None] = field(default_factory=Future)


class ReadPool:
    """Reader threads that take a search's reads before a prefetch's (a prefetch reads ahead for
    a search still to come; one waiting now must not queue behind it), first come, first served
    within each. A prefetch's read that a search comes to wait on is hastened: queued again as a
    search's, and run by whichever reader takes it first."""

    SEARCH, AHEAD = 0, 1

    def __init__(self, readers: int) -> None:
        self._queue: queue.PriorityQueue[tuple[int, int, _Read | None]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._claim = threading.Lock()
        self._threads = [threading.Thread(target=self._serve, name=f"disk-read-{i}", daemon=True) for i in range(readers)]
        for thread in self._threads:
            thread.start()

    def submit(self, priority: int, read: Callable[[], None]) -> _Read:
        task = _Read(read)
        self._queue.put((priority, next(self._order), task))
        return task

    def hasten(self, tasks: Sequence[_Read]) -> None:
        """Queue `tasks` not yet taken again, as a search's (behind the search reads queued now)."""
        with self._claim:
            waiting = [task for task in tasks if task.read is not None]
        for task in waiting:
            self._queue.put((self.SEARCH, next(self._order), task))

    def shutdown(self) -> None:
        """Let the reads queued finish, then end the readers."""
        for _ in self._threads:
            self._queue.put((self.AHEAD + 1, next(self._order), None))
        for thread in self._threads:
            thread.join()

    def _serve(self) -> None:
        while True:
            _, _, task = self._queue.get()
            if task is None:
                return
            self._run(task)

    def _run(self, task: _Read) -> None:
        """Run `task` unless a reader took it already; nothing of it is held after (an idle
        reader keeps no buffer alive)."""
        with self._claim:
            read, task.read = task.read, None
        if read is None:
            return  # hastened: a reader took its other entry
        if task.done.set_running_or_notify_cancel():
            try:
                read()
                task.done.set_result(None)
            except Exception as exc:  # noqa: BLE001 - handed to whoever waits on the read
                task.done.set_exception(exc)


class FileArrival:
    """Reads issued together, landing as the reader threads finish them."""

    def __init__(self, pool: ReadPool, reads: Sequence[_Read]) -> None:
        self.pool = pool
        self.tasks = list(reads)
        self.reads = [task.done for task in self.tasks]
        self.started = time.perf_counter()
        self._done_at: float | None = None
        self._lock = threading.Lock()
        if not self.reads:
            self._done_at = self.started
        for read in self.reads:
            read.add_done_callback(self._on_done)

    def _on_done(self, _: Future[None]) -> None:
        with self._lock:
            if self._done_at is None and all(read.done() for read in self.reads):
                self._done_at = time.perf_counter()

    def landed(self) -> bool:
        return all(read.done() for read in self.reads)

    def hasten(self) -> None:
        """A search waits on these reads now: they go before the reads only a prefetch wants."""
        if not self.landed():
            self.pool.hasten(self.tasks)

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Block until every read has landed (a failed read raises here, in the waiting search)."""
        for read in self.reads:
            read.result()

    def elapsed_ms(self) -> float | None:
        with self._lock:
            return None if self._done_at is None else (self._done_at - self.started) * 1e3


class FileRows:
    """The rows of a datastore's `vectors.npy`, read from the file: a `RowSource` for a cluster
    cache in host memory, and the reads of `DiskListSearch`."""

    def __init__(self, datastore: Datastore, *, readers: int = READERS, direct: bool = True) -> None:
        """`direct`: read with O_DIRECT where the file system serves it (else plain reads, their pages dropped)."""
        if datastore.path is None:
            raise DatastoreCorruptError(f"{datastore.where} is in memory: it has no file to read its lists from")
        self.path = Path(datastore.path) / "vectors.npy"
        self.numpy_dtype = datastore.vectors.dtype
        self._shape = (int(datastore.n_vectors), int(datastore.dim))
        self.row_bytes = datastore.dim * self.numpy_dtype.itemsize
        self.offset = _data_offset(self.path)
        self.direct = direct and hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(self.path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except OSError:  # a file system without O_DIRECT (tmpfs): plain reads, their pages dropped after
            self.direct = False
            self.fd = os.open(self.path, os.O_RDONLY)
        self.pool = ReadPool(readers)
        self._scratch = threading.local()  # each reader's aligned buffer (O_DIRECT)
        self.bytes_read = 0  # every byte read for rows (not the alignment's slack)
        self.bytes_read_for_scans = 0  # of those, read by `read_rows` (a search's, not the cache's)
        self._count = threading.Lock()

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return torch.from_numpy(np.empty(0, dtype=self.numpy_dtype)).dtype

    def copy_into(
        self, buffer: torch.Tensor, copies: Sequence[Copy], stream: torch.cuda.Stream | None, *, ahead: bool = False
    ) -> Issued:
        """Read each copy's rows into `buffer` (host memory) in reads of at most `READ_BYTES`,
        issued in the copies' order; a prefetch's (`ahead`) after any search's still queued."""
        if buffer.device.type != "cpu":
            raise NotImplementedError("rows are read from disk into host memory only")  # a device cache copies from it
        rows = buffer.numpy()
        priority = ReadPool.AHEAD if ahead else ReadPool.SEARCH
        each = [FileArrival(self.pool, [self._submit(priority, rows, part) for part in self._parts(copy)]) for copy in copies]
        return Issued(FileArrival(self.pool, [task for copy in each for task in copy.tasks]), list(each))

    def read_rows(self, out: np.ndarray, runs: Sequence[tuple[int, int, int]]) -> FileArrival:
        """Read `runs` (row of `out`, first row of the file, rows) into `out`, rows like the file's."""
        reads = [self._submit(ReadPool.SEARCH, out, part, scan=True) for run in runs for part in self._parts(run)]
        return FileArrival(self.pool, reads)

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)

    def _submit(self, priority: int, out: np.ndarray, part: Copy, *, scan: bool = False) -> _Read:
        return self.pool.submit(priority, functools.partial(self._read, out, *part, scan=scan))

    def _parts(self, copy: Copy) -> list[Copy]:
        start, first, rows = copy
        step = max(1, READ_BYTES // self.row_bytes)
        return [(start + at, first + at, min(step, rows - at)) for at in range(0, rows, step)]

    def _read(self, out: np.ndarray, start: int, first: int, rows: int, *, scan: bool = False) -> None:
        dest = out[start : start + rows].reshape(-1).view(np.uint8)
        begin = self.offset + first * self.row_bytes
        length = rows * self.row_bytes
        if self.direct:
            lo = begin - begin % ALIGN
            hi = -(-(begin + length) // ALIGN) * ALIGN
            scratch = self._scratch_of(hi - lo)
            got = _read_fully(self.fd, memoryview(scratch)[: hi - lo], lo)
            if got < begin + length - lo:
                raise DatastoreCorruptError(f"{self.path}: short read at byte {begin} (truncated?)")
            dest[:] = np.frombuffer(scratch, dtype=np.uint8, count=length, offset=begin - lo)
        else:
            if _read_fully(self.fd, memoryview(dest.data), begin) < length:
                raise DatastoreCorruptError(f"{self.path}: short read at byte {begin} (truncated?)")
            os.posix_fadvise(self.fd, begin, length, os.POSIX_FADV_DONTNEED)
        with self._count:
            self.bytes_read += length
            self.bytes_read_for_scans += length if scan else 0

    def _scratch_of(self, size: int) -> mmap.mmap:
        """This reader's page-aligned scratch of at least `size` bytes (an anonymous map is page aligned)."""
        scratch: mmap.mmap | None = getattr(self._scratch, "buffer", None)
        if scratch is None or len(scratch) < size:
            scratch = mmap.mmap(-1, max(size, READ_BYTES + 2 * ALIGN))
            self._scratch.buffer = scratch
        return scratch


class DiskListSearch:
    """The CPU half of a cooperative search over a datastore on disk: the given lists of each
    query read from the file (`FileRows`) and scanned list-major, a list read once for every
    query of the batch that probes it (`search.scan_resident`), a part of the lists at a time
    (`_batches`), the next part read while one is scanned. Exact: the top-k of those lists, as faiss's
    `search_preassigned` over them, answered as passage ids."""

    list_major = True  # a list is read once a call for every query probing it (`chunked_scan.reads_list_major`)

    def __init__(self, datastore: Datastore, rows: FileRows) -> None:
        self.datastore, self.rows = datastore, rows
        self.offsets = datastore.offsets
        self.codec = datastore.codec
        self.codec_params = None if datastore.codec_params is None else torch.from_numpy(datastore.codec_params)

    def search_lists(
        self, queries: np.ndarray, k: int, lists: np.ndarray, list_scores: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        n = len(queries)
        wanted = self._nonempty(np.unique(lists[lists >= 0]))
        q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
        parts = [_empty_part(n, k)]
        for part in self._read_ahead(self._batches(wanted)):
            part.arrival.wait()
            probes = [[c for c in row.tolist() if c in part.resident] for row in lists]
            parts.append(self._scan(part, q, probes, k))
        scores, ids = merge_topk(parts, k)
        return scores.numpy(), ids.numpy()

    def _scan(self, part: _Part, q: torch.Tensor, probes: list[list[int]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's top-k over the lists of `part` it probes (`probes`), as passage ids."""
        scores, rows = scan_resident(part.buffer, q, part.resident, probes, k, codec=self.codec, codec_params=self.codec_params)
        return scores, rows if self.datastore.ids is None else _ids_of(self.datastore.ids, rows)

    def _nonempty(self, clusters: np.ndarray) -> np.ndarray:
        return clusters[self.offsets[clusters + 1] > self.offsets[clusters]]

    def _batches(self, wanted: np.ndarray) -> list[list[int]]:
        """`wanted` in file order in parts: the first of at most `FIRST_SCAN_BYTES`, each next
        at most twice the one before, up to `SCAN_BYTES` (one list more, where one alone is
        larger). The first part is small so that the scan starts soon after the reads do: a
        search split in chunks (early stop's, the provisional top-k's) waits that long at each."""
        batches: list[list[int]] = []
        held, limit = 0, FIRST_SCAN_BYTES
        for cluster in wanted.tolist():
            size = int(self.offsets[cluster + 1] - self.offsets[cluster]) * self.rows.row_bytes
            if not batches or (held + size > limit and batches[-1]):
                if batches:
                    limit = min(2 * limit, SCAN_BYTES)
                batches.append([])
                held = 0
            batches[-1].append(cluster)
            held += size
        return batches

    def _read_ahead(self, batches: list[list[int]]) -> Iterator[_Part]:
        """Each part's read, handed over once the next part's is issued: it reads while this one is scanned."""
        ahead = None
        for batch in batches:
            current, ahead = ahead, self._read(batch)
            if current is not None:
                yield current
        if ahead is not None:
            yield ahead

    def _read(self, clusters: list[int]) -> _Part:
        """Read `clusters` into a buffer of their own, a run of adjacent lists in one range."""
        sizes = [int(self.offsets[c + 1] - self.offsets[c]) for c in clusters]
        buffer = torch.empty((sum(sizes), self.datastore.dim), dtype=self.rows.dtype)
        resident: dict[int, list[Segment]] = {}
        runs: list[tuple[int, int, int]] = []
        at = 0
        for cluster, size in zip(clusters, sizes, strict=True):
            first = int(self.offsets[cluster])
            resident[cluster] = [Segment(at, size, first)]
            if runs and runs[-1][0] + runs[-1][2] == at and runs[-1][1] + runs[-1][2] == first:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + size)
            else:
                runs.append((at, first, size))
            at += size
        return _Part(buffer, resident, self.rows.read_rows(buffer.numpy(), runs))


@dataclass(frozen=True)
class _Part:
    """Lists read into a buffer of their own: where each lies in it, and the reads filling it."""

    buffer: torch.Tensor
    resident: dict[int, list[Segment]]
    arrival: FileArrival


def _empty_part(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((n, k), float(FAISS_PAD_SCORE)), torch.full((n, k), -1, dtype=torch.int64)


def _ids_of(ids: np.ndarray, rows: torch.Tensor) -> torch.Tensor:
    """Passage ids of scanned rows (-1 stays -1)."""
    found = torch.from_numpy(np.asarray(ids))[rows.clamp(min=0)]
    return torch.where(rows >= 0, found, rows)


def _read_fully(fd: int, into: memoryview, offset: int) -> int:
    """`os.preadv` until `into` is full or the file ends; the bytes read."""
    got = 0
    while got < len(into):
        n = os.preadv(fd, [into[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _data_offset(path: Path) -> int:
    """Where a `.npy` file's array starts: after its header."""
    with path.open("rb") as handle:
        major, _ = np.lib.format.read_magic(handle)
        if major == 1:  # the shape and type are the manifest's, checked at load
            np.lib.format.read_array_header_1_0(handle)
        else:
            np.lib.format.read_array_header_2_0(handle)
        return handle.tell()
