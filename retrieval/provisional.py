"""A search's provisional top-k before it ends (issue 28, item 4: AquaPipe's early return of
partial results, for speculative prefill).

faiss's half scans each query's lists in centroid order a chunk at a time, in calls that end
after an eighth, a quarter and a half of its lists and then all of them; after each call but the
last, the top-k so far (merged with the device half's, once that half is done) is reported. The
lists nearest a query hold most of its neighbours, so the top-k settles early. The final top-k
merges the chunks, whose lists are disjoint: it is the full scan's (`ivf.same_results`: the same
ids in the same order, up to ties at the k-th place), whatever was reported on the way.

Whether a provisional top-k is worth acting on is not decided here: the caller's rule decides
(`pipelines.speculation`).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from telerag.retrieval.ivf import ListSearch
from telerag.retrieval.shards import merge_shard_results

PROVISIONAL_SHARES = (0.125, 0.25, 0.5)  # of a query's lists scanned (centroid order) when a top-k so far is reported

TopK = tuple[np.ndarray, np.ndarray]  # (scores, ids), (n, k), padded like faiss


@dataclass(frozen=True)
class Provisional:
    """A search's top-k so far, and the share of its probed lists scanned for it."""

    scores: np.ndarray
    ids: np.ndarray
    lists_share: float


ProvisionalReport = Callable[[Provisional], None]  # called from the search's threads, never after the search returns


def chunk_bounds(width: int) -> list[int]:
    """The column bounds of the calls scanning `width` lists per query: at each share of
    PROVISIONAL_SHARES (a call of at least one list), then all of them."""
    inner = sorted({min(width, max(1, round(share * width))) for share in PROVISIONAL_SHARES} - {width})
    return [0, *inner, width]


def scan_in_chunks(
    cpu_half: ListSearch,
    queries: np.ndarray,
    k: int,
    lists: np.ndarray,
    list_scores: np.ndarray,
    on_chunk: Callable[[TopK, int], None],
) -> TopK:
    """`cpu_half.search_lists` over `lists` (-1 entries skipped), each query's lists scanned in
    centroid-score order, chunk by chunk (`chunk_bounds`); after each chunk but the last,
    `on_chunk(top-k so far, lists scanned so far)`. Returns the top-k over all of them."""
    lists = np.asarray(lists, dtype=np.int64)
    order = np.argsort(np.where(lists >= 0, -np.asarray(list_scores, dtype=np.float64), np.inf), axis=1, kind="stable")
    width = max(1, int((lists >= 0).sum(axis=1).max(initial=0)))  # the -1 entries, sorted last, dropped
    lists = np.take_along_axis(lists, order, axis=1)[:, :width]
    list_scores = np.take_along_axis(np.asarray(list_scores, dtype=np.float32), order, axis=1)[:, :width]
    bounds = chunk_bounds(width)
    found: TopK | None = None
    for start, end in itertools.pairwise(bounds):
        chunk = cpu_half.search_lists(
            queries, k, np.ascontiguousarray(lists[:, start:end]), np.ascontiguousarray(list_scores[:, start:end])
        )
        found = chunk if found is None else merge_shard_results([found, chunk], k)
        if end < bounds[-1]:
            on_chunk(found, int((lists[:, :end] >= 0).sum()))
    assert found is not None
    return found


class ProvisionalTopK:
    """One search's provisional top-k, from its halves as they progress: faiss's chunks (from
    its worker thread) and the device half's result (from the search's thread), reported each
    time one arrives once both have something. The report is the merge of what both have."""

    def __init__(self, k: int, probed_lists: int, report: ProvisionalReport) -> None:
        self.k, self.probed_lists, self.report = k, probed_lists, report
        self._lock = threading.Lock()
        self._device: list[TopK] | None = None  # None until the device half is done; empty without one
        self._device_lists = 0
        self._faiss: TopK | None = None
        self._faiss_lists = 0

    def device_done(self, found: TopK | None, lists: int) -> None:
        """The device half's top-k over its `lists`, on the host (None: no device half)."""
        with self._lock:
            self._device, self._device_lists = ([] if found is None else [found]), lists
            self._report()

    def faiss_chunk(self, found: TopK, lists: int) -> None:
        """faiss's top-k over its first `lists` lists."""
        with self._lock:
            self._faiss, self._faiss_lists = found, lists
            self._report()

    def _report(self) -> None:
        if self._device is None or self._faiss is None:
            return
        scores, ids = merge_shard_results([*self._device, self._faiss], self.k)
        share = (self._device_lists + self._faiss_lists) / max(1, self.probed_lists)
        self.report(Provisional(scores, ids, share))
