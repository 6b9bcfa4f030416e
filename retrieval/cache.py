"""The device cluster cache: one preallocated buffer, shared by every in-flight request and by
every datastore the server searches.

The buffer (`CacheBuffer`) is one per device; each datastore searched on it (the server's
datastore, each generation of it while requests still read the one before, each vector store)
has a `ClusterCache` on it: a cached list is a (datastore, list) pair, and eviction weighs every
datastore's lists on one clock, so the lists searched most stay whichever datastore they are of.
Rows of the buffer are handed out in extents. A cluster is resident when all its rows are in
the buffer, in one or more pieces; clusters that are adjacent on the host and missing together
are placed in one extent when one is free, so they arrive in one copy. A cluster that a search
or a prefetch holds is pinned (reference-counted) and never evicted; eviction takes unpinned
clusters in order of a decaying hotness score, so popular clusters stay across requests, and
where a run would otherwise arrive in pieces over the holes they left, one of the coldest whose
rows, with the free rows beside them, hold it whole.
Where a cache's rows come from is its `RowSource`: a host tensor (`TensorRows`: the datastore's
memory map, or its pinned copy on CUDA) or, for a datastore larger than memory, its file on disk
(`retrieval.file_reads.FileRows`). Each acquisition's copies are one `Arrival`, and a search waits only
on the arrivals of the clusters it reads. On CUDA copies run on a dedicated copy stream; the
stream is one queue shared by every request: the cache tracks what is issued and has not landed,
so a new prefetch's budget can subtract what queues ahead of it and a search can tell how long a
copy may still take. Without CUDA the buffer is plain CPU memory and a tensor's copies are
synchronous (nothing is ever in flight), so the same code runs (and is tested) everywhere.

The module is long because the buffer and the caches on it are one mechanism: one lock, one set
of free extents and one eviction order over every datastore's lists.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from telerag.retrieval.extents import FreeRows
from telerag.retrieval.stats import CacheStats

HALF_LIFE_ACCESSES = 4096.0  # a cluster's hotness halves after this many cluster accesses (of any datastore)
OPEN_EXTENT_CANDIDATES = 32  # how many of the coldest clusters eviction looks at for room for a run in one piece


Copy = tuple[int, int, int]  # (buffer row, source row, rows): rows of a source copied into a buffer


class Arrival(Protocol):
    """Copies issued together (one acquisition's), landing later: what a search reading them waits on."""

    def landed(self) -> bool: ...

    def hasten(self) -> None:
        """A search waits on these copies now: let them go before copies only a prefetch wants
        (a disk's reads; a stream's copies run in the order issued, and this does nothing)."""
        ...

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream`'s later work wait for the copies (CUDA), or, with none, block until they landed."""
        ...

    def elapsed_ms(self) -> float | None:
        """How long the copies took, once they landed (None before)."""
        ...


@dataclass(frozen=True)
class Landed:
    """Copies done by the time they were issued (a tensor's into a CPU buffer), and how long they took."""

    ms: float

    def landed(self) -> bool:
        return True

    def hasten(self) -> None:
        return None

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        return None

    def elapsed_ms(self) -> float | None:
        return self.ms


@dataclass(frozen=True)
class CopyWindow:
    """Copies queued on a CUDA stream between two timing events."""

    begin: torch.cuda.Event
    end: torch.cuda.Event

    def landed(self) -> bool:
        return bool(self.end.query())

    def hasten(self) -> None:
        return None

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        if stream is None:
            self.end.synchronize()
        else:
            stream.wait_event(self.end)

    def elapsed_ms(self) -> float | None:
        return self.begin.elapsed_time(self.end) if self.end.query() else None


@dataclass(frozen=True)
class Issued:
    """Copies issued together: all of them (`whole`), and each one (`each`, in issue order), so
    that a search waits only for the copies of the lists it reads."""

    whole: Arrival
    each: list[Arrival]


class RowSource(Protocol):
    """Where a cache's lists come from: a datastore's rows, list after list, copied into a buffer."""

    @property
    def shape(self) -> tuple[int, int]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    # Whether copies land in the order issued (a stream's, or done when issued): rows whose copy is
    # in flight may then be given to the next copy, which lands after it. Else (reads on several
    # threads) they are evicted only once it landed: the older copy could land over the newer.
    lands_in_order: bool

    def buffer_rows(self, rows: int, device: torch.device) -> torch.Tensor:
        """A cache's buffer of `rows` rows on `device`, for this source's copies to land in."""
        ...

    def copy_into(
        self, buffer: torch.Tensor, copies: Sequence[Copy], stream: torch.cuda.Stream | None, *, ahead: bool = False
    ) -> Issued:
        """Issue `copies` into `buffer` in their order (on `stream`, CUDA's copy stream, where there
        is one). `ahead`: a prefetch's, which a source may serve after a search's."""
        ...


class TensorRows:
    """The rows of a host tensor: the datastore's memory map, or its pinned copy on CUDA, whose copies
    are true asynchronous DMA on the copy stream; into a CPU buffer they are synchronous."""

    lands_in_order = True

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.host.shape[0]), int(self.host.shape[1]))

    @property
    def dtype(self) -> torch.dtype:
        return self.host.dtype

    def buffer_rows(self, rows: int, device: torch.device) -> torch.Tensor:
        return torch.empty((rows, self.shape[1]), dtype=self.dtype, device=device)

    def copy_into(
        self, buffer: torch.Tensor, copies: Sequence[Copy], stream: torch.cuda.Stream | None, *, ahead: bool = False
    ) -> Issued:
        if stream is None:
            started = time.perf_counter()
            for start, host, rows in copies:
                buffer[start : start + rows].copy_(self.host[host : host + rows])
            landed = Landed((time.perf_counter() - started) * 1e3)
            return Issued(landed, [landed] * len(copies))
        begin = torch.cuda.Event(enable_timing=True)
        ends = [torch.cuda.Event(enable_timing=True) for _ in copies]
        with torch.cuda.stream(stream):
            begin.record(stream)
            for (start, host, rows), end in zip(copies, ends, strict=True):
                buffer[start : start + rows].copy_(self.host[host : host + rows], non_blocking=True)
                end.record(stream)
        windows: list[Arrival] = [CopyWindow(begin, end) for end in ends]  # the stream runs them in order
        return Issued(windows[-1] if windows else Landed(0.0), windows)


@dataclass
class Segment:
    """Rows [start, start + length) of the buffer hold host rows [host_start, host_start + length)."""

    start: int
    length: int
    host_start: int


@dataclass
class _Slot:
    segments: list[Segment]
    arrival: Arrival | None
    pins: int = 0
    unread: bool = False  # copied ahead by a prefetch, and no search has read it yet


@dataclass
class Lease:
    """Clusters pinned for one prefetch or one search; release exactly once (idempotent)."""

    cache: ClusterCache
    resident: dict[int, list[Segment]]  # cluster -> where it is
    arrivals: list[Arrival] = field(default_factory=list)  # the copies these clusters wait on
    arrival_of: dict[int, Arrival] = field(default_factory=dict)  # cluster -> the copy it waits on (if any)
    clusters_copied: int = 0
    clusters_already_resident: int = 0
    clusters_skipped: int = 0  # wanted but did not fit beside pinned clusters
    bytes_copied: int = 0
    copies: int = 0
    arrival: Arrival | None = None  # this lease's own copies
    released: bool = False

    def release(self) -> None:
        self.cache.release(self)

    def copy_elapsed_ms(self) -> float | None:
        """How long this lease's copies took, once they are done (None before, or if none)."""
        return None if self.arrival is None else self.arrival.elapsed_ms()


class CacheBuffer:
    """The device rows every `ClusterCache` on it shares, their copy stream, and what they share
    beside: the free extents, the hotness clock, the copies in flight, the counters, one lock."""

    def __init__(
        self, rows: int, dim: int, dtype: torch.dtype, device: torch.device, *, storage: torch.Tensor | None = None
    ) -> None:
        """`storage`: the (rows, dim) tensor to hold them (a source's `buffer_rows`; None: a new one)."""
        self.device, self.dim, self.dtype = device, dim, dtype
        self.row_bytes = dim * torch.empty((), dtype=dtype).element_size()
        self.capacity_rows = max(0, int(rows))
        # made on the caller's current stream (the retrieval engine's), and written on the copy
        # stream: once freed, its memory waits for the copies still queued there before reuse
        self.rows = torch.empty((self.capacity_rows, dim), dtype=dtype, device=device) if storage is None else storage
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self.copy_stream is not None and self.capacity_rows:
            self.rows.record_stream(self.copy_stream)
        self.copy_bytes_per_ms: float | None = None  # measured by the first cache on it (`measure_copy_rate`)
        self.lock = threading.Lock()
        self.free = FreeRows(self.capacity_rows)
        self.caches: list[ClusterCache] = []  # those on it, until closed with nothing pinned
        self.clock = 0.0
        self.hits = self.misses = self.evictions = self.bytes_copied = self.copies = 0
        self.bytes_copied_ahead = self.bytes_evicted_unread = 0
        self.in_flight: deque[tuple[Arrival, int]] = deque()  # (copies not landed, their bytes), issue order

    @classmethod
    def for_vectors(cls, source: RowSource, capacity_bytes: int, device: torch.device) -> CacheBuffer:
        """A buffer for rows like `source`'s, of `capacity_bytes` but never more rows than it has
        (a larger one could hold nothing more of them)."""
        rows, dim = source.shape
        row_bytes = dim * torch.empty((), dtype=source.dtype).element_size()
        capacity_rows = max(0, min(int(capacity_bytes) // row_bytes, rows))
        return cls(capacity_rows, dim, source.dtype, device, storage=source.buffer_rows(capacity_rows, device))

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_rows * self.row_bytes

    def holds(self, source: RowSource) -> bool:
        """Whether rows of `source` fit its rows (the same width and type)."""
        return source.shape[1] == self.dim and source.dtype == self.dtype

    def stats(self) -> CacheStats:
        with self.lock:
            slots = [slot for cache in self.caches for slot in cache._slots.values()]
            return CacheStats(
                capacity_bytes=self.capacity_bytes,
                occupancy_bytes=(self.capacity_rows - self.free.total) * self.row_bytes,
                resident_clusters=len(slots),
                pinned_clusters=sum(1 for slot in slots if slot.pins > 0),
                hits=self.hits,
                misses=self.misses,
                evictions=self.evictions,
                bytes_copied=self.bytes_copied,
                copies=self.copies,
                bytes_copied_ahead=self.bytes_copied_ahead,
                bytes_evicted_unread=self.bytes_evicted_unread,
            )

    def check_invariants(self) -> None:
        """Every row is either free or owned by exactly one resident cluster (for tests)."""
        with self.lock:
            spans = self.free.extents()
            for cache in self.caches:
                for cluster, slot in cache._slots.items():
                    assert sum(seg.length for seg in slot.segments) == cache.sizes[cluster], cluster
                    spans.extend((seg.start, seg.length) for seg in slot.segments)
                    assert slot.pins >= 0
            spans.sort()
            position = 0
            for start, length in spans:
                assert start == position and length > 0, (start, position)
                position += length
            assert position == self.capacity_rows

    # -- internals (called with the lock held) -------------------------------------------------

    def forget_landed(self) -> None:
        """Drop the copy windows that have landed (the stream runs them in issue order)."""
        while self.in_flight and self.in_flight[0][0].landed():
            self.in_flight.popleft()

    def evictable(self, asking: ClusterCache, protected: set[int]) -> list[tuple[ClusterCache, int]]:
        """The clusters that may be evicted (unpinned, and of `asking`'s not among `protected`,
        the ones its acquisition wants), coldest first, of every cache on the buffer."""
        keys: list[tuple[ClusterCache, int]] = []
        hotness: list[np.ndarray] = []
        for cache in self.caches:
            clusters = np.fromiter(
                (
                    c
                    for c, s in cache._slots.items()
                    if s.pins == 0 and not (cache is asking and c in protected) and cache.settled(s)
                ),
                dtype=np.int64,
            )
            keys.extend((cache, int(c)) for c in clusters)
            hotness.append(cache._current_hotness(clusters))
        if not keys:
            return []
        order = np.argsort(np.concatenate(hotness), kind="stable")
        return [keys[i] for i in order]

    def drop(self, cache: ClusterCache, cluster: int) -> int:
        """Evict `cache`'s `cluster`; the rows freed."""
        slot = cache._slots.pop(cluster)
        for segment in slot.segments:
            self.free.give_back(segment.start, segment.length)
        self.evictions += 1
        if slot.unread:
            self.bytes_evicted_unread += int(cache.sizes[cluster]) * self.row_bytes
        if cache.closed and not cache._slots:
            self.caches.remove(cache)
        return sum(segment.length for segment in slot.segments)


class ClusterCache:
    """One datastore's IVF lists (the rows of its `source`, split at `offsets`) in a `CacheBuffer`,
    keyed by list id; the buffer's other caches are other datastores'."""

    def __init__(self, source: RowSource, offsets: np.ndarray, shared: CacheBuffer) -> None:
        if not shared.holds(source):
            raise ValueError(
                f"rows of ({source.shape[1]},) {source.dtype} do not fit a cache buffer of ({shared.dim},) {shared.dtype}"
            )
        self.source = source
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.sizes = np.diff(self.offsets)
        self.shared = shared
        self.device, self.row_bytes = shared.device, shared.row_bytes
        self.closed = False
        self._slots: dict[int, _Slot] = {}
        nlist = len(self.sizes)
        self._hotness = np.zeros(nlist, dtype=np.float64)
        self._last_touch = np.zeros(nlist, dtype=np.float64)
        with shared.lock:
            shared.caches.append(self)

    # -- public API ---------------------------------------------------------------------------

    @property
    def buffer(self) -> torch.Tensor:
        """The device rows the lists are copied into (the shared buffer's)."""
        return self.shared.rows

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        return self.shared.copy_stream

    @property
    def capacity_rows(self) -> int:
        return self.shared.capacity_rows

    @property
    def capacity_bytes(self) -> int:
        return self.shared.capacity_bytes

    def measure_copy_rate(self, nbytes: int = 64 << 20) -> float | None:
        """Bytes per ms of the buffer's copy path (pinned DMA on CUDA), measured once per buffer
        on the largest run of this datastore's source rows that fits in `nbytes` and the buffer.
        Only while nothing is resident: it writes over the start of the buffer."""
        shared = self.shared
        if shared.copy_bytes_per_ms is not None:
            return shared.copy_bytes_per_ms
        rows = min(self.capacity_rows, self.source.shape[0], max(1, nbytes // self.row_bytes))
        with shared.lock:
            if not rows or any(cache._slots for cache in shared.caches):
                return None
            probe = Lease(cache=self, resident={})
            for _ in range(2):  # the first copy pays for warming up the path
                probe.arrival = self._issue_copies([(0, 0, rows)]).whole
                probe.arrival.wait()
        elapsed = probe.copy_elapsed_ms()
        shared.copy_bytes_per_ms = rows * self.row_bytes / elapsed if elapsed else None
        return shared.copy_bytes_per_ms

    def cluster_bytes(self, clusters: Iterable[int] | None = None) -> np.ndarray:
        sizes = self.sizes if clusters is None else self.sizes[np.fromiter(clusters, dtype=np.int64)]
        return sizes * self.row_bytes

    def resident_mask(self) -> np.ndarray:
        """Which clusters are resident now (landed or in flight): a prefetch pins them for free."""
        mask = np.zeros(len(self.sizes), dtype=bool)
        with self.shared.lock:
            mask[list(self._slots)] = True
        return mask

    def landed_mask(self) -> np.ndarray:
        """Which clusters are resident with their copies landed now: a search reads them at once."""
        mask = np.zeros(len(self.sizes), dtype=bool)
        with self.shared.lock:
            mask[[c for c, slot in self._slots.items() if slot.arrival is None or slot.arrival.landed()]] = True
        return mask

    def pinned_clusters(self) -> int:
        """How many of this datastore's clusters a search or a prefetch holds now."""
        with self.shared.lock:
            return sum(1 for slot in self._slots.values() if slot.pins > 0)

    def queued_bytes(self) -> int:
        """Bytes issued on the copy stream that have not landed: what a new copy waits behind."""
        with self.shared.lock:
            self.shared.forget_landed()
            return sum(nbytes for _, nbytes in self.shared.in_flight)

    def pending(self, lease: Lease) -> dict[int, int]:
        """The lease's clusters whose copies have not landed, each with the bytes queued on the
        copy stream up to and including its own copy (at the copy rate, how long it may take)."""
        with self.shared.lock:
            self.shared.forget_landed()
            ahead: dict[int, int] = {}
            queued = 0
            for arrival, nbytes in self.shared.in_flight:
                queued += nbytes
                ahead[id(arrival)] = queued
            return {
                cluster: ahead[id(copy)]
                for cluster in lease.resident
                if (copy := self._slots[cluster].arrival) is not None and id(copy) in ahead
            }

    def acquire(self, clusters: Sequence[int] | np.ndarray, *, fetch: bool, ahead: bool = False) -> Lease:
        """Pin the resident clusters among `clusters`; with `fetch`, copy in the missing ones too.
        `ahead`: a prefetch's, for a search still to come (else a search's own, which reads what
        it pins: the counters tell the bytes copied ahead and those evicted before any search read them).

        Empty clusters are skipped (there is nothing to search). Clusters that cannot be placed
        because everything else is pinned are counted as skipped and simply stay on the CPU; so
        are all of a closed cache's (its datastore is no longer searched).
        """
        ids = np.asarray(clusters, dtype=np.int64).ravel()
        ids = ids[self.sizes[ids] > 0]
        _, first = np.unique(ids, return_index=True)
        wanted: list[int] = ids[np.sort(first)].tolist()  # each once, in the order asked
        lease = Lease(cache=self, resident={})
        with self.shared.lock:
            self._touch(wanted)
            missing: list[int] = []
            arrivals: set[int] = set()
            for cluster in wanted:
                slot = self._slots.get(cluster)
                if slot is None:
                    missing.append(cluster)
                    continue
                slot.pins += 1
                slot.unread = slot.unread and ahead
                lease.resident[cluster] = slot.segments
                lease.clusters_already_resident += 1
                if slot.arrival is not None:
                    lease.arrival_of[cluster] = slot.arrival
                if slot.arrival is not None and id(slot.arrival) not in arrivals:
                    arrivals.add(id(slot.arrival))
                    lease.arrivals.append(slot.arrival)
                    if not ahead:
                        slot.arrival.hasten()  # a search reads it next
            if not fetch:
                self.shared.hits += len(lease.resident)
                self.shared.misses += len(missing)
            elif self.closed:
                lease.clusters_skipped += len(missing)
            elif missing:
                self._fetch(missing, set(wanted), lease, ahead)
        return lease

    def release(self, lease: Lease) -> None:
        with self.shared.lock:
            if lease.released:
                return
            lease.released = True
            for cluster in lease.resident:
                slot = self._slots[cluster]
                slot.pins -= 1
                if self.closed and not slot.pins and self.settled(slot):
                    self.shared.drop(self, cluster)

    def evict_all(self) -> None:
        """Every cluster nothing pins leaves the buffer, once the copies still landing in it have: a
        cold cache on the same buffer (what a benchmark's cold run starts from)."""
        with self.shared.lock:
            landing = [slot.arrival for slot in self._slots.values() if not slot.pins and slot.arrival is not None]
        for arrival in landing:
            with contextlib.suppress(Exception):  # a copy that failed leaves its rows all the same
                arrival.wait()
        with self.shared.lock:
            self._drop_unpinned()

    def close(self) -> None:
        """Its datastore is no longer searched: its clusters leave the buffer, each once unpinned
        (and, from a source whose copies land out of order, once its copy landed: till then eviction's)."""
        with self.shared.lock:
            self.closed = True
            self._drop_unpinned()
            if not self._slots and self in self.shared.caches:
                self.shared.caches.remove(self)

    def stats(self) -> CacheStats:
        """The buffer's: its state and counters over every datastore on it."""
        return self.shared.stats()

    def check_invariants(self) -> None:
        self.shared.check_invariants()

    # -- internals (called with the buffer's lock held) ----------------------------------------

    def _drop_unpinned(self) -> None:
        for cluster in [c for c, slot in self._slots.items() if not slot.pins and self.settled(slot)]:
            self.shared.drop(self, cluster)

    def settled(self, slot: _Slot) -> bool:
        """Whether `slot`'s rows may be given to another copy: no copy of its own still to land over
        them (see `RowSource.lands_in_order`). A landed copy is forgotten, so each is asked until then."""
        if slot.arrival is not None and not self.source.lands_in_order and slot.arrival.landed():
            slot.arrival = None
        return slot.arrival is None or self.source.lands_in_order

    def _touch(self, clusters: list[int]) -> None:
        if not clusters:
            return
        ids = np.asarray(clusters, dtype=np.int64)
        clock = self.shared.clock
        decay = 0.5 ** ((clock - self._last_touch[ids]) / HALF_LIFE_ACCESSES)
        self._hotness[ids] = self._hotness[ids] * decay + 1.0
        self._last_touch[ids] = clock
        self.shared.clock += len(clusters)

    def _current_hotness(self, clusters: np.ndarray) -> np.ndarray:
        return self._hotness[clusters] * 0.5 ** ((self.shared.clock - self._last_touch[clusters]) / HALF_LIFE_ACCESSES)

    def _fetch(self, missing: list[int], protected: set[int], lease: Lease, ahead: bool) -> None:
        """Place and copy `missing` (in the order asked: a prefetch's plan puts the clusters its
        queries want most first), adjacent ones in one copy, the copies issued in the order of
        their first cluster asked, so that a slow source (a disk) lands the wanted ones first."""
        shared = self.shared
        copies: list[Copy] = []
        placed: list[int] = []
        evictable: list[tuple[ClusterCache, int]] | None = None  # unpinned clusters, coldest first: made when due
        need = int(self.sizes[missing].sum())
        if shared.free.total < need:
            evictable = shared.evictable(self, protected)
            self._evict(need - shared.free.total, evictable)
        asked = {cluster: i for i, cluster in enumerate(missing)}
        copied_by: dict[int, list[int]] = {}  # cluster -> the copies that hold its rows
        for run in sorted(self._runs(sorted(missing)), key=lambda run: min(asked[c] for c in run)):
            rows = int(self.sizes[run].sum())
            if not shared.free.fits(rows):
                evictable = shared.evictable(self, protected) if evictable is None else evictable
                self._open_extent(rows, evictable)
            if rows <= shared.free.total:
                copied_by.update(self._place(run, rows, copies, lease, ahead))
                placed.extend(run)
            else:
                lease.clusters_skipped += len(run)
        if not copies:
            return
        issued = self._issue_copies(copies, ahead=ahead)
        lease.arrival = issued.whole
        for cluster in placed:  # what a search reading it waits for: its own copy (the whole, if it is in pieces)
            held_by = copied_by[cluster]
            arrival = issued.each[held_by[0]] if len(held_by) == 1 else issued.whole
            self._slots[cluster].arrival = lease.arrival_of[cluster] = arrival
        lease.arrivals.append(issued.whole)
        for copy, (_, _, rows) in zip(issued.each, copies, strict=True):
            if not copy.landed():
                shared.in_flight.append((copy, rows * self.row_bytes))
        rows_copied = sum(rows for _, _, rows in copies)
        lease.bytes_copied += rows_copied * self.row_bytes
        lease.copies += len(copies)
        shared.bytes_copied += rows_copied * self.row_bytes
        shared.bytes_copied_ahead += rows_copied * self.row_bytes if ahead else 0
        shared.copies += len(copies)

    def _runs(self, clusters: list[int]) -> list[list[int]]:
        """Split sorted cluster ids into runs of consecutive ids (contiguous on the host)."""
        runs: list[list[int]] = []
        for cluster in clusters:
            if runs and runs[-1][-1] == cluster - 1:
                runs[-1].append(cluster)
            else:
                runs.append([cluster])
        return runs

    def _place(self, run: list[int], rows: int, copies: list[Copy], lease: Lease, ahead: bool) -> dict[int, list[int]]:
        """Allocate rows for a run of host-adjacent clusters (one extent if one fits) and queue
        copies; returns which copies (their place in `copies`) hold each cluster's rows."""
        pieces = self.shared.free.allocate(rows)
        host = int(self.offsets[run[0]])
        segments_by_cluster: dict[int, list[Segment]] = {c: [] for c in run}
        copied_by: dict[int, list[int]] = {c: [] for c in run}
        bounds = self.offsets[run[0] : run[-1] + 2]
        for start, length in pieces:
            copies.append((start, host, length))
            # split this piece among the clusters it holds
            cursor_host, cursor_buf, left = host, start, length
            while left:
                cluster = run[int(np.searchsorted(bounds, cursor_host, side="right")) - 1]
                take = min(left, int(self.offsets[cluster + 1]) - cursor_host)
                segments_by_cluster[cluster].append(Segment(cursor_buf, take, cursor_host))
                copied_by[cluster].append(len(copies) - 1)
                cursor_host += take
                cursor_buf += take
                left -= take
            host += length
        for cluster, segments in segments_by_cluster.items():
            self._slots[cluster] = _Slot(segments=segments, arrival=None, pins=1, unread=ahead)
            lease.resident[cluster] = segments
            lease.clusters_copied += 1
        return copied_by

    def _open_extent(self, rows: int, evictable: list[tuple[ClusterCache, int]]) -> bool:
        """Evict one of the coldest `OPEN_EXTENT_CANDIDATES` clusters whose rows, with the free
        rows beside them, make one extent of `rows`: the run then arrives in one copy, not in
        pieces scattered over the holes the coldest left. At `bench cluster-cache`'s defaults (a cache
        kept full) it took copies per copied cluster from 4.3 to 1.04 and the hit rate from 0.194
        to 0.190. False when none does."""
        for i, (cache, cluster) in enumerate(evictable[:OPEN_EXTENT_CANDIDATES]):
            segments = cache._slots[cluster].segments
            if len(segments) == 1 and self.shared.free.around(segments[0].start, segments[0].length) >= rows:
                self.shared.drop(*evictable.pop(i))
                return True
        return False

    def _evict(self, rows: int, evictable: list[tuple[ClusterCache, int]]) -> None:
        """Free at least `rows` rows by evicting the coldest of `evictable` (or all of them)."""
        freed = 0
        while evictable and freed < rows:
            freed += self.shared.drop(*evictable.pop(0))

    def _issue_copies(self, copies: Sequence[Copy], *, ahead: bool = False) -> Issued:
        """Copy source rows into the buffer, by the source's own means (see `RowSource`)."""
        return self.source.copy_into(self.shared.rows, copies, self.shared.copy_stream, ahead=ahead)
