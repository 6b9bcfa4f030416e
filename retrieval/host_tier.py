"""The host tier between a datastore on disk and a device cluster cache: disk → host cache →
device cache (TeleRAG's device cache over AquaPipe's datastore larger than memory).

`HostTierRows` is the device cache's `RowSource`. A copy of rows acquires the lists holding them in
the host cache (a `ClusterCache` over `FileRows`: read from disk unless resident there), and once
their reads land copies the host rows to the device, on the copy stream; the host lists stay
pinned until the device copy has landed, so nothing is read over them meanwhile. Both tiers are
`ClusterCache`s, one eviction mechanism each on its own buffer and clock. Rows whose lists the
host cache cannot hold (everything else there pinned) are read into a staging buffer instead.

The device halves chain on a thread of their own: the last read of a copy landing (on a reader
thread) queues its device copy, which that thread issues and waits for. A copy a search hastened
therefore goes as soon as its reads land, never behind a prefetch's copy whose reads are still queued.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from telerag.retrieval.cache import Arrival, CacheBuffer, ClusterCache, Copy, Issued, Landed, Lease, Segment
from telerag.retrieval.errors import InvalidCall
from telerag.retrieval.file_reads import FileArrival, FileRows

log = logging.getLogger(__name__)

Piece = tuple[int, torch.Tensor]  # (first row of the device buffer, the host rows copied there)


@dataclass(eq=False)
class TierArrival:
    """Copies from disk to the device: landed once their reads into host memory have and the device copies after them."""

    reads: list[Arrival]  # the host reads the copies wait on (a search hastens them)
    started: float = field(default_factory=time.perf_counter)
    error: BaseException | None = None
    _done: threading.Event = field(default_factory=threading.Event)
    _done_at: float | None = None

    def landed(self) -> bool:
        return self._done.is_set()

    def hasten(self) -> None:
        for read in self.reads:
            read.hasten()

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Block until the copies landed (a device copy is issued only after its reads, so a
        stream cannot be told to wait for it before then); a failed read raises here."""
        self._done.wait()
        if self.error is not None:
            raise self.error

    def elapsed_ms(self) -> float | None:
        return None if self._done_at is None else (self._done_at - self.started) * 1e3

    def finish(self, error: BaseException | None = None) -> None:
        self.error = self.error or error
        self._done_at = time.perf_counter()
        self._done.set()


@dataclass(eq=False)
class _DeviceCopy:
    """One copy's device half: its pieces of host rows, copied into `buffer` (on `stream`, CUDA's
    copy stream) once `reads` landed."""

    arrival: TierArrival
    buffer: torch.Tensor
    stream: torch.cuda.Stream | None
    pieces: list[Piece]
    reads: list[Future[None]]
    call: _Call


@dataclass(eq=False)
class _Call:
    """The copies of one `copy_into`: the host lists they pin, released once every device copy has landed."""

    whole: TierArrival
    lease: Lease
    pending: int
    lock: threading.Lock = field(default_factory=threading.Lock)

    def copy_landed(self, error: BaseException | None) -> None:
        with self.lock:
            self.pending -= 1
            self.whole.error = self.whole.error or error
            last = self.pending == 0
        if last:
            self.lease.release()
            self.whole.finish()


class _Countdown:
    """Queues a copy once its last read lands, then forgets it: a read's future keeps its callbacks,
    and the future outlives the copy (a host list's read), the copy's device buffer must not."""

    def __init__(self, copy: _DeviceCopy, ready: queue.SimpleQueue[_DeviceCopy | None]) -> None:
        self.copy: _DeviceCopy | None = copy
        self.left, self.ready = len(copy.reads), ready
        self.lock = threading.Lock()

    def read_landed(self, _: Future[None]) -> None:
        with self.lock:
            self.left -= 1
            copy, self.copy = (self.copy, None) if self.left == 0 else (None, self.copy)
        if copy is not None:
            self.ready.put(copy)


class _Chain:
    """The thread that issues each device copy once its reads landed, and waits for it."""

    def __init__(self) -> None:
        self.ready: queue.SimpleQueue[_DeviceCopy | None] = queue.SimpleQueue()
        self.outstanding = 0  # submitted, not yet copied
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="host-tier-copies", daemon=True)
        self.thread.start()

    def submit(self, copy: _DeviceCopy) -> None:
        """Queue `copy` once its last read lands (at once if they all have)."""
        with self.lock:
            self.outstanding += 1
        if not copy.reads:
            self.ready.put(copy)
        countdown = _Countdown(copy, self.ready)
        for read in copy.reads:
            read.add_done_callback(countdown.read_landed)

    def close(self) -> None:
        """End the thread once every copy submitted is done (their reads must land: close the reads first)."""
        self.ready.put(None)
        self.thread.join()

    def _run(self) -> None:
        closing = False
        while True:
            copy = self.ready.get()
            if copy is None:
                closing = True
            else:
                self._land(copy)
            copy = None  # not held while waiting: its device buffer may be freed
            with self.lock:
                if closing and not self.outstanding:
                    return

    def _land(self, copy: _DeviceCopy) -> None:
        error = next((e for read in copy.reads if (e := read.exception()) is not None), None)
        try:
            if error is None:
                _copy(copy)
        except Exception as failed:  # noqa: BLE001 - handed to whoever waits on the copy, as a read's error is
            error = failed
        copy.arrival.finish(error)
        copy.call.copy_landed(error)
        with self.lock:
            self.outstanding -= 1


class HostTierRows:
    """A datastore's rows on disk, as a device cache's `RowSource`, through `host`, a cluster cache
    in host memory over `files` (pinned on CUDA: `pin_host_rows`)."""

    lands_in_order = False  # reads on several threads

    def __init__(self, host: ClusterCache, files: FileRows) -> None:
        if host.source is not files or host.device.type != "cpu":
            raise ValueError("the host tier is a cluster cache in host memory over the datastore's file rows")
        self.host, self.files = host, files
        self.offsets = host.offsets
        self._chain = _Chain()

    @property
    def shape(self) -> tuple[int, int]:
        return self.files.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.files.dtype

    def buffer_rows(self, rows: int, device: torch.device) -> torch.Tensor:
        return torch.empty((rows, self.shape[1]), dtype=self.dtype, device=device)

    def copy_into(
        self, buffer: torch.Tensor, copies: Sequence[Copy], stream: torch.cuda.Stream | None, *, ahead: bool = False
    ) -> Issued:
        """Acquire the lists holding `copies`' rows in the host cache (read from disk where missing;
        `ahead`: as a prefetch, after any search's reads), then copy each to `buffer` as its reads land."""
        if not copies:
            return Issued(Landed(0.0), [])
        covering = [self._clusters(first, rows) for _, first, rows in copies]
        lease = self.host.acquire(np.concatenate(covering), fetch=True, ahead=ahead)
        staging, staged = self._stage(lease, copies, covering, ahead)
        whole = TierArrival(list(lease.arrivals) + ([staged] if staged is not None else []))
        call = _Call(whole, lease, len(copies))  # the staged rows live as long as the pieces viewing them
        each: list[Arrival] = []
        at_stage = 0
        for (start, first, rows), clusters in zip(copies, covering, strict=True):
            pieces: list[Piece] = []
            reads = list({id(a): a for c in clusters.tolist() if (a := lease.arrival_of.get(c)) is not None}.values())
            for cluster, lo, hi in self._spans(clusters, first, rows):
                if cluster in lease.resident:
                    pieces.extend(self._held(lease.resident[cluster], start - first, lo, hi))
                else:
                    assert staging is not None and staged is not None  # made for every list not held
                    pieces.append((start + lo - first, staging[at_stage : at_stage + hi - lo]))
                    at_stage += hi - lo
                    if staged not in reads:
                        reads.append(staged)
            arrival = TierArrival(reads)
            self._chain.submit(_DeviceCopy(arrival, buffer, stream, pieces, [f for read in reads for f in _futures(read)], call))
            each.append(arrival)
        return Issued(whole, each)

    def close(self) -> None:
        """The tier ends: the chain's thread once the copies queued are done (after `files` is closed:
        its reads drained), then the host cache (its lists leave, each once unpinned)."""
        self._chain.close()
        self.host.close()

    def _clusters(self, first: int, rows: int) -> np.ndarray:
        """The lists holding source rows [first, first + rows), empty ones left out."""
        lo = int(np.searchsorted(self.offsets, first, side="right")) - 1
        hi = int(np.searchsorted(self.offsets, first + rows, side="left"))
        clusters = np.arange(lo, hi, dtype=np.int64)
        return clusters[self.offsets[clusters + 1] > self.offsets[clusters]]

    def _spans(self, clusters: np.ndarray, first: int, rows: int) -> list[tuple[int, int, int]]:
        """Each of `clusters` with the source rows [lo, hi) of it that [first, first + rows) covers."""
        return [(c, max(first, int(self.offsets[c])), min(first + rows, int(self.offsets[c + 1]))) for c in clusters.tolist()]

    def _held(self, segments: list[Segment], shift: int, lo: int, hi: int) -> list[Piece]:
        """Source rows [lo, hi) where the host cache holds them (`segments`), each piece with its
        device row (source row + `shift`)."""
        host = self.host.buffer
        pieces: list[Piece] = []
        for segment in segments:
            a, b = max(lo, segment.host_start), min(hi, segment.host_start + segment.length)
            if a < b:
                at = segment.start + a - segment.host_start
                pieces.append((a + shift, host[at : at + b - a]))
        return pieces

    def _stage(
        self, lease: Lease, copies: Sequence[Copy], covering: list[np.ndarray], ahead: bool
    ) -> tuple[torch.Tensor | None, Arrival | None]:
        """Read the rows of the lists the host cache could not hold into a staging buffer, in the
        order `copy_into` takes them; (None, None) when it holds them all."""
        runs: list[Copy] = []
        staged = 0
        for (_, first, rows), clusters in zip(copies, covering, strict=True):
            for cluster, lo, hi in self._spans(clusters, first, rows):
                if cluster not in lease.resident:
                    runs.append((staged, lo, hi - lo))
                    staged += hi - lo
        if not runs:
            return None, None
        staging = self.files.buffer_rows(staged, torch.device("cpu"))
        return staging, self.files.copy_into(staging, runs, None, ahead=ahead).whole


def _copy(copy: _DeviceCopy) -> None:
    """`copy`'s pieces into its buffer: on CUDA on its copy stream, waited for (so the host rows may go once it returns)."""
    if copy.stream is None:
        for start, rows in copy.pieces:
            copy.buffer[start : start + len(rows)].copy_(rows)
        return
    with torch.cuda.stream(copy.stream):
        for start, rows in copy.pieces:
            copy.buffer[start : start + len(rows)].copy_(rows, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record(copy.stream)
    landed.synchronize()


def _futures(arrival: Arrival) -> list[Future[None]]:
    """The reads `arrival` lands with (a host cache's arrivals are its file reads'), none where it has landed."""
    if isinstance(arrival, FileArrival):
        return list(arrival.reads)
    if arrival.landed():
        return []
    raise TypeError(f"a host tier's copy waits on file reads, not on {type(arrival).__name__}")


def pin_host_rows(shared: CacheBuffer) -> bool:
    """Page-lock a host cache's rows (CUDA), so that each copy from them to the device is an
    asynchronous DMA; unlocked when the buffer is freed. False (and a warning) where the driver refuses."""
    rows = shared.rows
    if not rows.numel():
        return True
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(rows.data_ptr(), rows.numel() * rows.element_size(), 0)) != 0:
        log.warning(
            "could not page-lock the host cache's %.1f GB: its copies to the device are synchronous", shared.capacity_bytes / 1e9
        )
        return False
    weakref.finalize(shared, cudart.cudaHostUnregister, rows.data_ptr())
    return True


def host_cache_on(
    files: FileRows, offsets: np.ndarray, shared: CacheBuffer | None, cache_bytes: int, device: torch.device
) -> ClusterCache:
    """A datastore's host tier under a cache on `device`: on `shared` (another engine's host
    cache, to share), or on a buffer of `cache_bytes` of its own, page-locked on CUDA."""
    if shared is None:
        shared = CacheBuffer.for_vectors(files, cache_bytes, torch.device("cpu"))
        if device.type == "cuda":
            pin_host_rows(shared)
    elif cache_bytes:
        raise InvalidCall("a shared host cache buffer has its own size: host_cache_bytes must be 0")
    if shared.device.type != "cpu" or not shared.holds(files):
        raise InvalidCall(f"a host cache of ({shared.dim},) {shared.dtype} rows on {shared.device} cannot hold {files.path}'s")
    return ClusterCache(files, offsets, shared)
