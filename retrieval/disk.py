"""The lists of a datastore on disk that no cache holds, read and scanned per search
(`DiskListSearch`, a `ListSearch`; the reads: `retrieval.file_reads`), for a datastore larger
than memory (AquaPipe's setting).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import numpy as np
import torch

from telerag.retrieval.buffer_pool import BufferPool
from telerag.retrieval.cache import ClusterCache, Segment
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.file_reads import ALIGN, FileRows
from telerag.retrieval.search import merge_topk, scan_resident
from telerag.retrieval.shards import FAISS_PAD_SCORE

SCAN_BYTES = 256 << 20  # a search's lists read and scanned at a time: what it holds at once beside the cache
FIRST_SCAN_BYTES = 16 << 20  # a search's first part: its scan waits for it whole
KEPT_BUFFERS = 2  # a search's parts in hand at once (one scanned, the next read): the buffers kept idle between parts


class DiskListSearch:
    """The CPU half of a cooperative search over a datastore on disk: the given lists of each
    query read from the file (`FileRows`) and scanned list-major, a list read once for every
    query of the batch that probes it (`search.scan_resident`), a part of the lists at a time
    (`_batches`), the next part read while one is scanned, into buffers used again part after part
    (`buffer_pool`). Exact: the top-k of those lists, as faiss's `search_preassigned` over them,
    answered as passage ids."""

    list_major = True  # a list is read once a call for every query probing it (`chunked_scan.reads_list_major`)

    def __init__(self, datastore: Datastore, rows: FileRows, *, host_cache: ClusterCache | None = None) -> None:
        """`host_cache`: a host tier's (`retrieval.host_tier`): the lists it holds are scanned where they
        are (first, while the others are read), not read again."""
        self.datastore, self.rows, self.host_cache = datastore, rows, host_cache
        self.offsets = datastore.offsets
        self.codec = datastore.codec
        self.codec_params = None if datastore.codec_params is None else torch.from_numpy(datastore.codec_params)
        self.buffers = BufferPool(SCAN_BYTES, KEPT_BUFFERS, align=ALIGN)

    def search_lists(
        self, queries: np.ndarray, k: int, lists: np.ndarray, list_scores: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        n = len(queries)
        wanted = self._nonempty(np.unique(lists[lists >= 0]))
        q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
        parts = [_empty_part(n, k)]
        held = self._held(wanted)
        rest = wanted if held is None else wanted[~np.isin(wanted, list(held.resident))]
        reading = self._held_first(held, self._read_ahead(self._batches(rest)))
        try:
            for part in reading:
                try:
                    part.wait()
                    probes = [[c for c in row.tolist() if c in part.resident] for row in lists]
                    parts.append(self._scan(part, q, probes, k))
                finally:
                    part.release()
        finally:
            reading.close()  # a part read ahead and never scanned is released too
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

    def _held(self, wanted: np.ndarray) -> _Part | None:
        """The lists of `wanted` the host tier holds, pinned there (those still being read hastened), as one part."""
        if self.host_cache is None or not len(wanted):
            return None
        lease = self.host_cache.acquire(wanted, fetch=False)
        if not lease.resident:
            lease.release()
            return None

        def wait() -> None:
            for arrival in lease.arrivals:
                arrival.wait()

        return _Part(self.host_cache.buffer, dict(lease.resident), wait, lease.release)

    def _held_first(self, held: _Part | None, reading: Generator[_Part, None, None]) -> Generator[_Part, None, None]:
        """`held` (if any) once the first parts' reads are issued, then the parts read: the reads
        land while the host tier's lists are scanned. What is not handed over is released here."""
        pending = [] if held is None else [held]
        try:
            if pending and (first := next(reading, None)) is not None:
                pending.append(first)
            while pending:
                yield pending.pop(0)
            yield from reading
        finally:
            for part in pending:
                part.release()
            reading.close()

    def _read_ahead(self, batches: list[list[int]]) -> Generator[_Part, None, None]:
        """Each part's read, handed over once the next part's is issued: it reads while this one
        is scanned. A part handed over is the caller's to release; one still ahead when the
        caller stops is released here."""
        ahead = None
        try:
            for batch in batches:
                current, ahead = ahead, self._read(batch)
                if current is not None:
                    yield current
            current, ahead = ahead, None
            if current is not None:
                yield current
        finally:
            if ahead is not None:
                ahead.release()

    def _read(self, clusters: list[int]) -> _Part:
        """Read `clusters` (in file order) into a buffer of the pool's, a run of adjacent lists in one range."""
        runs: list[tuple[int, int]] = []  # (first row of the file, rows)
        placed: list[tuple[int, int, int]] = []  # each cluster's run, its first row in the run, its rows
        for cluster in clusters:
            first, size = int(self.offsets[cluster]), int(self.offsets[cluster + 1] - self.offsets[cluster])
            if runs and sum(runs[-1]) == first:
                placed.append((len(runs) - 1, runs[-1][1], size))
                runs[-1] = (runs[-1][0], runs[-1][1] + size)
            else:
                placed.append((len(runs), 0, size))
                runs.append((first, size))
        layout = self.rows.lay_out(runs)
        storage = self.buffers.take(layout.nbytes)
        view, arrival = self.rows.read_laid_out(storage.numpy(), layout, runs)
        resident = {
            cluster: [Segment(layout.at[run] + within, size, runs[run][0] + within)]
            for cluster, (run, within, size) in zip(clusters, placed, strict=True)
        }

        def release() -> None:  # the buffer back to the pool, once no read of it is running
            arrival.settle()
            self.buffers.give(storage)

        return _Part(torch.from_numpy(view), resident, arrival.wait, release)


@dataclass(frozen=True)
class _Part:
    """Lists in a buffer (one of the pool's, read into, or the host tier's): where each lies in
    it, how to wait for them to be there, and how to give the buffer back once scanned."""

    buffer: torch.Tensor
    resident: dict[int, list[Segment]]
    wait: Callable[[], None]
    release: Callable[[], None]


def _empty_part(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((n, k), float(FAISS_PAD_SCORE)), torch.full((n, k), -1, dtype=torch.int64)


def _ids_of(ids: np.ndarray, rows: torch.Tensor) -> torch.Tensor:
    """Passage ids of scanned rows (-1 stays -1)."""
    found = torch.from_numpy(np.asarray(ids))[rows.clamp(min=0)]
    return torch.where(rows >= 0, found, rows)
