"""Exact early stop of an IVF scan (AquaPipe's early stop, made exact).

Every vector x of list l lies within the list's radius r_l of its centroid c_l (stored in the
datastore with two more statistics, computed from the decoded vectors: `ListStats`), so for
inner product q·x <= q·c_l + |q|·r_l (Cauchy-Schwarz); a second bound, from the vectors' largest
norm and least projection on the centroid's direction, is tighter for vectors of about one norm
(`ListBounds`). A query's lists are scanned a chunk at a time in centroid-score order; once
its k-th best score so far is at least an unscanned list's bound, that list cannot change the
top-k (a vector scoring exactly the k-th score could only tie with it, and among ties at the
k-th place either may be kept, as `ivf.same_results` defines), so it is skipped. The bound is
widened by what float32 rounding may add to the scores faiss computes, so it holds for the
computed scores, not only for exact ones: the answer is always the full scan's.

How much it skips depends on how tight the lists are against the scores queries reach. In high
dimensions both are loose: on the embedded datastore (MiniLM, 384-d, unit vectors, 273 lists)
a list's radius is about 1.1 while a query's 3rd-best score is about 0.5, so no list is ever
skipped (see docs/benchmarks.md, "Exact early stop"); `experiments.early_stop` is off by
default for that reason.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from telerag.retrieval.chunked_scan import (
    ChunkDone,
    NextChunk,
    TopK,
    in_centroid_order,
    no_report,
    reads_list_major,
    scan_in_chunks,
)
from telerag.retrieval.codecs import Codec
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.errors import DatastoreMismatchError
from telerag.retrieval.ivf import ListSearch

STATS_BLOCK_ROWS = 8192  # rows decoded at once in float64 while list statistics are computed, at most
STATS_BLOCK_BYTES = 16 << 20  # and at most this many bytes of them: what the allocator keeps, not fresh memory each block
FIRST_CHUNK_SHARE = 0.25  # of a query's lists, scanned before the first test of the bound
CHUNK_GROWTH = 2  # each later chunk this many times the one before
# float32's unit roundoff: a computed dot product of d terms strays from the exact one by at
# most about d of these times |q|·|x| (in any summation order); twice that is kept as margin
UNIT_ROUNDOFF = 2.0**-24


def require_list_stats(datastore: Datastore) -> np.ndarray:
    """The datastore's list statistics; refused, in one line that names the command adding
    them, for a datastore written before they were stored."""
    if datastore.list_stats is None:
        raise DatastoreMismatchError(
            f"{datastore.where} has no list statistics, which experiments.early_stop needs: add them with "
            f"`telerag datastore upgrade {datastore.where}` (writes one new file beside the others), "
            "or set experiments.early_stop to false"
        )
    return datastore.list_stats


class ListStats:
    """What bounds a list's scores, per list: its radius about its centroid, the largest norm
    of its vectors, and the least projection of its vectors on its centroid's direction;
    accumulated over blocks of a datastore's codes in row order (cluster after cluster), as they
    are written or read. Each is computed in float64 from the exact decoding, widened by how far
    faiss's own float32 decoding may stray (`Codec.decode_slack`), and rounded outwards to float32:
    it holds for every vector faiss scores. An empty list gets zeros."""

    def __init__(self, centroids: np.ndarray, offsets: np.ndarray, codec: Codec, params: np.ndarray | None) -> None:
        self.centroids = np.asarray(centroids, dtype=np.float64)
        norms = np.linalg.norm(self.centroids, axis=1, keepdims=True)
        self.directions = np.divide(self.centroids, norms, out=np.zeros_like(self.centroids), where=norms > 0)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.codec, self.params = codec, params
        nlist = len(self.centroids)
        self.radius2, self.norm2 = np.zeros(nlist), np.zeros(nlist)  # the largest squares so far
        self.projection = np.full(nlist, np.inf)  # the least so far

    def add(self, start: int, codes: np.ndarray) -> None:
        """Rows `start`, `start` + 1, ... of the datastore, as its codec's codes."""
        step = max(1, min(STATS_BLOCK_ROWS, STATS_BLOCK_BYTES // (8 * self.centroids.shape[1])))
        for first in range(0, len(codes), step):
            block = self.codec.decode_exact(codes[first : first + step], self.params)
            rows = np.arange(start + first, start + first + len(block))
            owner = np.searchsorted(self.offsets, rows, side="right") - 1
            np.maximum.at(self.radius2, owner, ((block - self.centroids[owner]) ** 2).sum(axis=1))
            np.maximum.at(self.norm2, owner, (block**2).sum(axis=1))
            np.minimum.at(self.projection, owner, np.einsum("nd,nd->n", block, self.directions[owner]))

    def result(self) -> np.ndarray:
        """float32 (nlist, 3): radius, largest norm, least projection (`datastore.LIST_STATS`)."""
        slack = self.codec.decode_slack(self.params, self.centroids.shape[1])
        empty = np.diff(self.offsets) == 0
        up = np.where(empty, 0.0, np.stack([np.sqrt(self.radius2) + slack, np.sqrt(self.norm2) + slack]))
        down = np.where(empty, 0.0, self.projection - slack)
        return np.column_stack([_round(up[0], np.inf), _round(up[1], np.inf), _round(down, -np.inf)])

    @classmethod
    def of(
        cls,
        centroids: np.ndarray,
        offsets: np.ndarray,
        vectors: np.ndarray,
        codec: Codec,
        params: np.ndarray | None,
        *,
        step_rows: int = 1 << 16,
        on_block: Callable[[int], None] = lambda rows: None,
    ) -> np.ndarray:
        """The statistics of a datastore's codes `vectors` (read `step_rows` at a time, so a
        memory map is never read whole into RAM); `on_block` hears each block's row count."""
        stats = cls(centroids, offsets, codec, params)
        for start in range(0, len(vectors), step_rows):
            block = np.asarray(vectors[start : start + step_rows])
            stats.add(start, block)
            on_block(len(block))
        return stats.result()


def _round(values: np.ndarray, towards: float) -> np.ndarray:
    """float64 -> the nearest float32 on the side of `towards` (+inf: not below; -inf: not above)."""
    rounded = values.astype(np.float32)
    off = rounded < values if towards > 0 else rounded > values
    return np.where(off, np.nextafter(rounded, np.float32(towards)), rounded)


@dataclass(frozen=True)
class ListBounds:
    """The bound of a query's scores in each list, from the lists' centroids and `ListStats`:
    the least of two bounds, each exact. Ball: x within r of c gives q·x <= q·c + |q|·r.
    Cap: |x| <= rho and x·u >= m (u = c/|c|) give, for q at angle phi to u, q·x <= |q|·rho
    where rho·cos(phi) >= m, else |q|·(m·cos(phi) + sqrt(rho² - m²)·sin(phi)); on the unit
    sphere that is the cap of the list's vectors about its centroid's direction."""

    centroids: np.ndarray  # float64 (nlist, dim)
    centroid_norms: np.ndarray  # float64 (nlist,)
    stats: np.ndarray  # float64 (nlist, 3): `ListStats`
    empty: np.ndarray  # bool (nlist,)

    @classmethod
    def of(cls, datastore: Datastore) -> ListBounds:
        """The bounds of a datastore's lists (refused for one without list statistics)."""
        centroids = np.asarray(datastore.centroids, dtype=np.float64)
        stats = require_list_stats(datastore).astype(np.float64)
        return cls(centroids, np.linalg.norm(centroids, axis=1), stats, np.diff(datastore.offsets) == 0)

    def of_queries(self, queries: np.ndarray, lists: np.ndarray) -> np.ndarray:
        """float64 (n, width): no score faiss computes for a vector of list `lists[i, j]` and
        query i exceeds entry (i, j) (-inf for -1 entries and empty lists)."""
        valid = lists >= 0
        safe = np.where(valid, lists, 0)
        q = np.asarray(queries, dtype=np.float64)
        q_norm = np.linalg.norm(q, axis=1, keepdims=True)
        radius, rho, least = (self.stats[safe, column] for column in range(3))
        q_dot_c = np.einsum("nwd,nd->nw", self.centroids[safe], q)
        ball = q_dot_c + q_norm * radius
        scale = q_norm * self.centroid_norms[safe]  # cos(phi) = q·c / (|q|·|c|); 0 where either is 0
        cos = np.clip(np.divide(q_dot_c, scale, out=np.zeros_like(q_dot_c), where=scale > 0), -1.0, 1.0)
        least = np.clip(least, -rho, rho)
        cap = q_norm * np.where(
            rho * cos >= least, rho, least * cos + np.sqrt(np.maximum(rho**2 - least**2, 0.0)) * np.sqrt(1.0 - cos**2)
        )
        # a computed q·x strays from the exact one by at most about dim roundoffs of |q|·|x| (|x| <= rho)
        margin = 2 * (q.shape[1] + 4) * UNIT_ROUNDOFF * q_norm * rho
        return np.where(valid & ~self.empty[safe], np.minimum(ball, cap) + margin, -np.inf)


@dataclass
class ScanCounts:
    """Lists probed (given to the search) and scanned, over the searcher's life: their ratio is
    the share of the scan early stop kept."""

    probed: int = 0
    scanned: int = 0

    @property
    def scanned_fraction(self) -> float | None:
        return self.scanned / self.probed if self.probed else None


class EarlyStopSearch:
    """A `ListSearch` that scans the given lists through another one (faiss in process, or a
    shard of the retrieval tier) a chunk at a time per query, in centroid-score order, and
    skips every list the bound proves cannot change the top-k: exactly the full scan's answer.

    Each round (`retrieval.chunked_scan`) asks the inner search once for every query that still
    has lists to scan, so a batch stays one faiss call per round; the chunks double (`CHUNK_GROWTH`) from a quarter of
    the lists (`FIRST_CHUNK_SHARE`), and lists no round could rule out go at once
    (`_next_chunk`), so a search takes two or three calls where faiss takes one. A caller that
    chooses its own chunks (the provisional top-k's) has them narrowed to the lists still live
    (`scan_in_chunks`)."""

    def __init__(self, inner: ListSearch, bounds: ListBounds, *, list_major: bool | None = None) -> None:
        """`list_major`: the inner search reads each list once for the whole batch (from disk), so
        a list one query's round takes is scanned in that round for every query that has it left:
        no list is read in two rounds (default: as the inner search says, `reads_list_major`)."""
        self.inner, self.bounds = inner, bounds
        self.list_major = reads_list_major(inner) if list_major is None else list_major
        self.counts = ScanCounts()
        self._lock = threading.Lock()

    def search_lists(
        self, queries: np.ndarray, k: int, lists: np.ndarray, list_scores: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        lists, list_scores = in_centroid_order(lists, list_scores)
        bound = self.bounds.of_queries(queries, lists)
        chunk = max(1, int(np.ceil(FIRST_CHUNK_SHARE * lists.shape[1])))

        def growing(pending: np.ndarray, found: TopK) -> np.ndarray:
            nonlocal chunk
            scores, ids = found
            take = self._next_chunk(pending, bound, scores[:, 0], ids[:, 0] >= 0, chunk)
            chunk *= CHUNK_GROWTH
            if self.list_major:
                take |= pending & np.isin(lists, lists[take])
            return take

        found, _ = self._scan(queries, k, lists, list_scores, bound, growing, no_report)
        return found

    def scan_in_chunks(
        self,
        queries: np.ndarray,
        k: int,
        lists: np.ndarray,
        list_scores: np.ndarray,
        next_chunk: NextChunk,
        on_chunk: ChunkDone,
    ) -> tuple[TopK, int]:
        """The chunks `next_chunk` chooses (`lists` in centroid order), less the lists the bound
        has ruled out by then: to `next_chunk` those are no longer pending."""
        return self._scan(queries, k, lists, list_scores, self.bounds.of_queries(queries, lists), next_chunk, on_chunk)

    def _scan(
        self,
        queries: np.ndarray,
        k: int,
        lists: np.ndarray,
        list_scores: np.ndarray,
        bound: np.ndarray,
        next_chunk: NextChunk,
        on_chunk: ChunkDone,
    ) -> tuple[TopK, int]:
        """Through the inner search, chunk by chunk as `next_chunk` chooses among the lists the
        bound has not ruled out (a chooser reading list-major takes a list for every query
        that still has it live)."""

        def live_chunk(pending: np.ndarray, found: TopK) -> np.ndarray:
            scores, ids = found
            kth = np.where(ids[:, k - 1] >= 0, scores[:, k - 1], -np.inf)
            live = pending & (bound > kth[:, None])  # valid, not empty, not ruled out
            return next_chunk(live, found) & live

        queries = np.ascontiguousarray(queries, dtype=np.float32)
        found, scanned = scan_in_chunks(self.inner, queries, k, lists, list_scores, live_chunk, on_chunk)
        with self._lock:
            self.counts.probed += int((lists >= 0).sum())
            self.counts.scanned += scanned
        return found, scanned

    @staticmethod
    def _next_chunk(pending: np.ndarray, bound: np.ndarray, best: np.ndarray, found: np.ndarray, chunk: int) -> np.ndarray:
        """Which pending lists the next round scans: the next `chunk` in order, and every list
        whose bound exceeds even the best score found so far (`best`, where `found`): to rule it
        out would take k vectors better than any seen yet, so it is scanned now rather than in
        rounds of its own. Where the bound is loose (high dimensions) that is every list left,
        and a search takes two rounds."""
        hopeless = pending & found[:, None] & (bound > best[:, None])
        rest = pending & ~hopeless
        return hopeless | (rest & (np.cumsum(rest, axis=1) <= chunk))
