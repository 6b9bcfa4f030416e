"""A datastore's rows read from its `vectors.npy` by explicit reads, for a datastore larger than
memory (AquaPipe's setting): `FileRows`, the cluster cache's `RowSource` in host memory and the
reads of a search from disk (`retrieval.disk`).

Reads bypass the page cache (O_DIRECT, each read widened to the 4 KiB the kernel may ask for: a
search's straight into its buffer, laid out so that its rows meet the file's alignment; a cache's
straight into its rows, which lie where the file's do modulo 4 KiB, wherever O_DIRECT's alignment
(512 bytes on a disk of 512-byte blocks) lets a row be read in place, else copied out of an
aligned scratch; where the file system refuses O_DIRECT, plain reads whose pages are dropped
after: POSIX_FADV_DONTNEED), so memory stays within the cache's budget, a cold search
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
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from telerag.retrieval.buffer_pool import aligned_bytes
from telerag.retrieval.cache import Copy, Issued
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.errors import DatastoreCorruptError

ALIGN = 4096  # O_DIRECT's alignment of offsets, lengths and memory on the file systems it serves
READ_BYTES = 4 << 20  # one read's most: large enough to stream at the disk's rate, small enough to spread over readers
READERS = 8  # reads in flight at once (one thread each)
DIRECT_PERIOD_BYTES = 64 << 10  # the most room a run may leave unused so that its rows are read in place


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
        self._first_pending = 0  # reads before it have landed: each read checked until it lands, not at every landing
        self._lock = threading.Lock()
        if not self.reads:
            self._done_at = self.started
        for read in self.reads:
            read.add_done_callback(self._on_done)

    def _on_done(self, _: Future[None]) -> None:
        with self._lock:
            if self._done_at is None and self._all_done():
                self._done_at = time.perf_counter()

    def _all_done(self) -> bool:
        """Whether every read has landed, moving past those that have (called with the lock held)."""
        while self._first_pending < len(self.reads) and self.reads[self._first_pending].done():
            self._first_pending += 1
        return self._first_pending == len(self.reads)

    def landed(self) -> bool:
        with self._lock:
            return self._all_done()

    def hasten(self) -> None:
        """A search waits on these reads now: they go before the reads only a prefetch wants."""
        if not self.landed():
            self.pool.hasten(self.tasks)

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Block until every read has landed (a failed read raises here, in the waiting search)."""
        for read in self.reads:
            read.result()

    def settle(self) -> None:
        """Block until no read is running or queued, failed or not: then nothing writes where they read into."""
        wait(self.reads)

    def elapsed_ms(self) -> float | None:
        with self._lock:
            return None if self._done_at is None else (self._done_at - self.started) * 1e3


class FileRows:
    """The rows of a datastore's `vectors.npy`, read from the file: a `RowSource` for a cluster
    cache in host memory, and the reads of `DiskListSearch`."""

    lands_in_order = False  # reads on several threads

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
        self.direct_align = _direct_alignment(self.fd) if self.direct else ALIGN  # the least O_DIRECT takes here
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

    def buffer_rows(self, rows: int, device: torch.device) -> torch.Tensor:
        """A cache's rows in host memory, placed so that each lies where its file rows do modulo
        `ALIGN` (a row size that is a multiple of `direct_align` then reads in place wherever the
        cache puts it) and touched once now: memory fresh from the kernel faults in page by page
        at its first read, about 1.8 s of CPU a GB read here against 0.25 once touched."""
        if device.type != "cpu":
            raise NotImplementedError("rows are read from disk into host memory only")
        nbytes = rows * self.row_bytes
        placed = aligned_bytes(nbytes, ALIGN, at=self.offset)
        placed.fill_(0)
        return placed.view(self.dtype).view(rows, self._shape[1])

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

    def lay_out(self, runs: Sequence[tuple[int, int]]) -> RowLayout:
        """Where `runs` (first row of the file, rows) go in a buffer that `read_laid_out` fills.
        With O_DIRECT each run is placed so that its rows lie at the file's offsets modulo
        `ALIGN`, with room on both sides for the widened read: the disk writes straight into the
        buffer, no copy. Where that would waste much room (a row size sharing few factors of 2
        with `ALIGN`) or reads are plain, the runs lie end to end."""
        period = ALIGN // np.gcd(self.row_bytes, ALIGN)  # rows between two that start at the same offset modulo ALIGN
        if not self.direct or period * self.row_bytes > DIRECT_PERIOD_BYTES:
            starts = np.concatenate([[0], np.cumsum([rows for _, rows in runs])]).tolist()
            return RowLayout(0, starts[:-1], starts[-1] * self.row_bytes, direct=False)
        base = self.offset % ALIGN  # the view's row 0 lies where the file's row 0 does, modulo ALIGN
        end = -base  # the end of the last run's widened window, in bytes from the view's row 0
        at: list[int] = []
        for first, rows in runs:
            begin = self.offset + first * self.row_bytes
            before, after = begin % ALIGN, -(begin + rows * self.row_bytes) % ALIGN
            row = first % period  # the least row at the run's offset modulo ALIGN, then on by periods
            short = end + before - row * self.row_bytes
            row += max(0, -(-short // (period * self.row_bytes))) * period
            at.append(row)
            end = (row + rows) * self.row_bytes + after
        return RowLayout(base, at, base + max(end, 0), direct=True)

    def read_laid_out(
        self, storage: np.ndarray, layout: RowLayout, runs: Sequence[tuple[int, int]]
    ) -> tuple[np.ndarray, FileArrival]:
        """Read `runs` into `storage` (bytes, `ALIGN`-aligned, at least `layout.nbytes`) as
        `layout` places them; returns the rows' view of it (row i of run j at `layout.at[j]` + i)
        and the reads."""
        rows = (layout.nbytes - layout.base) // self.row_bytes
        view = storage[layout.base : layout.base + rows * self.row_bytes].view(self.numpy_dtype).reshape(rows, -1)
        if not layout.direct:
            return view, self.read_rows(view, [(at, first, n) for at, (first, n) in zip(layout.at, runs, strict=True)])
        reads = []
        for at, (first, n) in zip(layout.at, runs, strict=True):
            begin = self.offset + first * self.row_bytes
            lo, hi = begin - begin % ALIGN, begin + n * self.row_bytes
            window = layout.base + at * self.row_bytes - (begin - lo)  # where `lo` lands in `storage`
            step = max(ALIGN, READ_BYTES - READ_BYTES % ALIGN)
            for piece in range(lo, hi, step):
                read = functools.partial(self._read_direct, storage, window + piece - lo, piece, min(piece + step, hi), begin)
                reads.append(self.pool.submit(ReadPool.SEARCH, read))
        return view, FileArrival(self.pool, reads)

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
        if not self.direct:
            self._read_at_least(memoryview(dest.data), begin, length)
            os.posix_fadvise(self.fd, begin, length, os.POSIX_FADV_DONTNEED)
        elif (dest.ctypes.data - begin) % self.direct_align == 0:
            self._read_in_place(dest, begin)
        else:
            self._read_through_scratch(dest, begin)
        self._counted(length, scan=scan)

    def _read_in_place(self, dest: np.ndarray, begin: int) -> None:
        """O_DIRECT straight into `dest`, which lies at the file's byte `begin` modulo
        `direct_align`: its aligned middle in place (no copy: on this box a copy out of a scratch
        was three quarters of a read's CPU), the part blocks at either end through the scratch."""
        align, end = self.direct_align, begin + len(dest)
        lo, hi = -(-begin // align) * align, end // align * align
        if hi <= lo:
            self._read_through_scratch(dest, begin)
            return
        self._read_at_least(memoryview(dest.data)[lo - begin : hi - begin], lo, hi - lo)
        self._read_through_scratch(dest[: lo - begin], begin)
        self._read_through_scratch(dest[hi - begin :], hi)

    def _read_through_scratch(self, dest: np.ndarray, begin: int) -> None:
        """The file's bytes from `begin` into `dest` (any alignment): O_DIRECT into this reader's
        aligned scratch, widened to `ALIGN`, then copied."""
        length = len(dest)
        if not length:
            return
        lo = begin - begin % ALIGN
        hi = -(-(begin + length) // ALIGN) * ALIGN
        scratch = self._scratch_of(hi - lo)
        self._read_at_least(memoryview(scratch)[: hi - lo], lo, begin + length - lo)
        dest[:] = np.frombuffer(scratch, dtype=np.uint8, count=length, offset=begin - lo)

    def _read_direct(self, storage: np.ndarray, into: int, lo: int, hi: int, begin: int) -> None:
        """O_DIRECT read of the file's bytes [`lo`, `hi`) widened to `ALIGN` (`lo` aligned) straight
        into `storage` from byte `into`; counts the bytes from `begin` on (a run's rows)."""
        end = -(-hi // ALIGN) * ALIGN
        self._read_at_least(storage.data[into : into + end - lo], lo, hi - lo)
        self._counted(hi - max(lo, begin), scan=True)

    def _read_at_least(self, into: memoryview, offset: int, needed: int) -> None:
        """Fill `into` from the file's byte `offset`; fewer than `needed` bytes there is a truncated file."""
        if _read_fully(self.fd, into, offset) < needed:
            raise DatastoreCorruptError(f"{self.path}: short read at byte {offset} (truncated?)")

    def _counted(self, length: int, *, scan: bool) -> None:
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


@dataclass(frozen=True)
class RowLayout:
    """Runs of a file's rows placed in a buffer (`FileRows.lay_out`): the rows' view starts at
    byte `base` of it, run j at row `at[j]` of the view; `nbytes` of buffer needed; `direct`: read
    in place by O_DIRECT (else copied or read plainly)."""

    base: int
    at: list[int]
    nbytes: int
    direct: bool


def _read_fully(fd: int, into: memoryview, offset: int) -> int:
    """`os.preadv` until `into` is full or the file ends; the bytes read."""
    got = 0
    while got < len(into):
        n = os.preadv(fd, [into[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _direct_alignment(fd: int) -> int:
    """The least alignment O_DIRECT takes on `fd`'s file (offsets, lengths, memory): 512 bytes where
    a read at that alignment succeeds (a disk of 512-byte blocks), else `ALIGN`."""
    small = 512
    probe = mmap.mmap(-1, 2 * ALIGN)
    view = memoryview(probe)
    part = view[small : 2 * small]
    try:
        return small if os.preadv(fd, [part], small) == small else ALIGN
    except OSError:  # EINVAL: the file system or the disk wants more
        return ALIGN
    finally:
        part.release()
        view.release()
        probe.close()


def _data_offset(path: Path) -> int:
    """Where a `.npy` file's array starts: after its header."""
    with path.open("rb") as handle:
        major, _ = np.lib.format.read_magic(handle)
        if major == 1:  # the shape and type are the manifest's, checked at load
            np.lib.format.read_array_header_1_0(handle)
        else:
            np.lib.format.read_array_header_2_0(handle)
        return handle.tell()
