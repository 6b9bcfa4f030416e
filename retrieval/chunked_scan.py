"""A scan of each query's lists a chunk at a time, best centroid score first, through another
`ListSearch`: the loop shared by exact early stop (chunks chosen by a bound, `experiments.early_stop`)
and the provisional top-k (chunks at fixed shares, `retrieval.provisional`).

The chunks of one query are disjoint, so merging their top-ks (`merge_shard_results`) gives the
top-k over every list scanned: the full scan's when every list is, whatever the chunks were.

A search that runs the loop itself says so (`ScansInChunks`): early stop narrows the chunks a
caller chooses to the lists its bound leaves (`retrieval.early_stop`), so a provisional top-k
over an early-stopping search is one scan, not one per chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

from telerag.retrieval.ivf import ListSearch
from telerag.retrieval.shards import FAISS_PAD_SCORE, merge_shard_results

TopK = tuple[np.ndarray, np.ndarray]  # (scores, ids), (n, k), padded like faiss

# Given the lists not scanned yet (bool over the sorted lists) and the top-k so far, which to
# scan next (a subset of them); nothing chosen ends the scan.
NextChunk = Callable[[np.ndarray, TopK], np.ndarray]
# After each chunk: the top-k so far (a copy, the caller's to keep), how many lists it is
# over, and whether any are left.
ChunkDone = Callable[[TopK, int, bool], None]


def in_centroid_order(lists: np.ndarray, list_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each query's lists (int64) and their centroid scores (float32), best score first and the
    -1 entries last."""
    lists = np.asarray(lists, dtype=np.int64)
    order = np.argsort(np.where(lists >= 0, -np.asarray(list_scores, dtype=np.float64), np.inf), axis=1, kind="stable")
    return (
        np.take_along_axis(lists, order, axis=1),
        np.take_along_axis(np.asarray(list_scores, dtype=np.float32), order, axis=1),
    )


def reads_list_major(search: ListSearch) -> bool:
    """Whether `search` reads each list once for its whole batch (from disk: `list_major`), so
    that a list one query's chunk takes is best taken for every query that has it pending: one
    read, where chunks per query would read it once in each."""
    return bool(getattr(search, "list_major", False))


def no_report(found: TopK, lists: int, more: bool) -> None:
    """A scan whose caller wants only its answer."""


@runtime_checkable
class ScansInChunks(Protocol):
    """A `ListSearch` that runs `scan_in_chunks`'s loop itself, to the same contract."""

    def scan_in_chunks(
        self,
        queries: np.ndarray,
        k: int,
        lists: np.ndarray,
        list_scores: np.ndarray,
        next_chunk: NextChunk,
        on_chunk: ChunkDone,
    ) -> tuple[TopK, int]: ...


def scan_in_chunks(
    inner: ListSearch,
    queries: np.ndarray,
    k: int,
    lists: np.ndarray,
    list_scores: np.ndarray,
    next_chunk: NextChunk,
    on_chunk: ChunkDone = no_report,
) -> tuple[TopK, int]:
    """`inner.search_lists` over `lists` (in centroid order: `in_centroid_order`; -1 entries
    skipped) a chunk at a time as `next_chunk` chooses, each round one call for every query with
    lists in its chunk (or `inner`'s own loop, where it has one). Returns the top-k over the
    lists scanned and how many were."""
    if isinstance(inner, ScansInChunks):
        return inner.scan_in_chunks(queries, k, lists, list_scores, next_chunk, on_chunk)
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    n = len(lists)
    scores = np.full((n, k), FAISS_PAD_SCORE, dtype=np.float32)
    ids = np.full((n, k), -1, dtype=np.int64)
    pending = lists >= 0
    scanned = 0
    while True:
        take = next_chunk(pending, (scores, ids)) & pending
        active = np.flatnonzero(take.any(axis=1))
        if not len(active):
            return (scores, ids), scanned
        # the taken entries of each active query first (in order), then -1
        picked = np.argsort(~take[active], axis=1, kind="stable")[:, : int(take.sum(axis=1).max())]
        chunk_lists = np.where(
            np.take_along_axis(take[active], picked, axis=1), np.take_along_axis(lists[active], picked, axis=1), -1
        )
        chunk_scores = np.take_along_axis(list_scores[active], picked, axis=1)
        found = inner.search_lists(queries[active], k, np.ascontiguousarray(chunk_lists), np.ascontiguousarray(chunk_scores))
        scores[active], ids[active] = merge_shard_results([(scores[active], ids[active]), found], k)
        pending &= ~take
        scanned += int(take.sum())
        on_chunk((scores.copy(), ids.copy()), scanned, bool(pending.any()))
