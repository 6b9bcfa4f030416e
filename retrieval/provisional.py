"""A search's provisional top-k before it ends (AquaPipe's early return of
partial results, for speculative prefill).

faiss's half scans each query's lists in centroid order a chunk at a time (`ProvisionalSearch`,
a `ListSearch` wrapping the search's CPU half), in calls that end after a 64th of its lists, then
each after twice the lists of the one before, up to a half, and then all of them; after each call
but the last, the top-k so far (merged with the device half's, once that half is done) is
reported. The lists nearest a query hold most of its neighbours, so the top-k settles early, and
the sooner a report finds it the sooner the prefill it feeds begins (AquaPipe checks its results
every few steps of a search, at intervals that grow as they settle). The final top-k
merges the chunks, whose lists are disjoint: it is the full scan's (`ivf.same_results`: the same
ids in the same order, up to ties at the k-th place), whatever was reported on the way.

A search is watched or not by the `SearchWatch` its caller chooses once (`ProvisionalWatch`, or
`UNWATCHED`, the default), so a search nobody watches asks nothing about it on the way.

Whether a provisional top-k is worth acting on is not decided here: the caller's rule decides
(`pipelines.speculation`).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from telerag.retrieval.chunked_scan import TopK, in_centroid_order, reads_list_major, scan_in_chunks
from telerag.retrieval.ivf import CPUIndex, ListSearch
from telerag.retrieval.shards import merge_shard_results

if TYPE_CHECKING:  # torch's: this module is imported where torch is not yet (`pipelines.types`)
    from telerag.retrieval.search import Part

# of a query's lists scanned (centroid order) when a top-k so far is reported
PROVISIONAL_SHARES = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)


@dataclass(frozen=True)
class Provisional:
    """A search's top-k so far, and the share of its probed lists scanned for it."""

    scores: np.ndarray
    ids: np.ndarray
    lists_share: float


ProvisionalReport = Callable[[Provisional], None]  # called from the search's threads, never after the search returns
DeviceHalfDone = Callable[[Sequence["Part"], int], None]  # the device half's results (on the device) and its lists
MergeToHost = Callable[[Sequence["Part"], int], TopK]  # parts' top-k merged and read to the host (`search.merge_to_host`)


def chunk_bounds(width: int) -> list[int]:
    """The column bounds of the calls scanning `width` lists per query: at each share of
    PROVISIONAL_SHARES (a call of at least one list), then all of them."""
    inner = sorted({min(width, max(1, round(share * width))) for share in PROVISIONAL_SHARES} - {width})
    return [0, *inner, width]


@dataclass(frozen=True)
class SearchHalves:
    """Who scans a search's CPU half, and who hears when its device half is done (`SearchWatch.halves`)."""

    cpu_half: ListSearch
    device_done: DeviceHalfDone


class SearchWatch(Protocol):
    """What a search shows before it ends, chosen once per search by its caller: nothing
    (`UNWATCHED`, every search's default) or its provisional top-k (`ProvisionalWatch`)."""

    def halves(self, cpu_half: ListSearch, k: int, probed_lists: int, merge: MergeToHost) -> SearchHalves:
        """The search's CPU half as it is to be scanned, and who hears when its device half is done."""
        ...

    def faiss_search(
        self, index: CPUIndex, cpu_half: ListSearch, queries: np.ndarray, k: int, nprobe: int, merge: MergeToHost
    ) -> TopK:
        """A search with nothing on the device: probed by `index`, scanned by `cpu_half` (the
        index itself, or what stands in for it)."""
        ...

    def mapped(self, keep: Callable[[Provisional], Provisional]) -> SearchWatch:
        """This watch, hearing each provisional top-k through `keep` (a snapshot's living entries)."""
        ...


class Unwatched:
    """A search nobody watches: its halves as they are, faiss's own search where faiss is its CPU half."""

    def halves(self, cpu_half: ListSearch, k: int, probed_lists: int, merge: MergeToHost) -> SearchHalves:
        return SearchHalves(cpu_half, _unheard)

    def faiss_search(
        self, index: CPUIndex, cpu_half: ListSearch, queries: np.ndarray, k: int, nprobe: int, merge: MergeToHost
    ) -> TopK:
        if cpu_half is index:
            return index.search(queries, k, nprobe)  # the probe and the scan in one call
        list_scores, lists = index.probe(queries, nprobe)
        return cpu_half.search_lists(queries, k, lists, list_scores)

    def mapped(self, keep: Callable[[Provisional], Provisional]) -> SearchWatch:
        return self


UNWATCHED: SearchWatch = Unwatched()


def _unheard(parts: Sequence[Part], lists: int) -> None:
    """An unwatched search's device half: its end is nobody's business."""


@dataclass(frozen=True)
class ProvisionalWatch:
    """A search whose top-k so far is told to `report`: its CPU half scanned chunk by chunk
    (`ProvisionalSearch`), the top-k of both halves merged (the device half's by `merge`)."""

    report: ProvisionalReport

    def halves(self, cpu_half: ListSearch, k: int, probed_lists: int, merge: MergeToHost) -> SearchHalves:
        tracker = ProvisionalTopK(k, probed_lists, self.report, merge)
        return SearchHalves(ProvisionalSearch(cpu_half, tracker), tracker.device_done)

    def faiss_search(
        self, index: CPUIndex, cpu_half: ListSearch, queries: np.ndarray, k: int, nprobe: int, merge: MergeToHost
    ) -> TopK:
        list_scores, lists = index.probe(queries, nprobe)
        halves = self.halves(cpu_half, k, int((lists >= 0).sum()), merge)
        halves.device_done([], 0)
        return halves.cpu_half.search_lists(queries, k, lists, list_scores)

    def mapped(self, keep: Callable[[Provisional], Provisional]) -> SearchWatch:
        report = self.report
        return ProvisionalWatch(lambda found: report(keep(found)))


class ProvisionalSearch:
    """A `ListSearch` that scans through another one chunk by chunk in centroid order
    (`chunk_bounds`) and tells `tracker` each call's top-k so far after every chunk but its last.
    Its answer is the inner search's."""

    def __init__(self, inner: ListSearch, tracker: ProvisionalTopK) -> None:
        self.inner, self.tracker = inner, tracker

    def search_lists(
        self, queries: np.ndarray, k: int, lists: np.ndarray, list_scores: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        lists, list_scores = in_centroid_order(lists, list_scores)
        width = max(1, int((lists >= 0).sum(axis=1).max(initial=0)))
        ends = iter(chunk_bounds(width)[1:])
        columns = np.arange(lists.shape[1])
        list_major = reads_list_major(self.inner)

        def next_chunk(pending: np.ndarray, found: TopK) -> np.ndarray:
            """The pending lists up to the next bound that leaves any (a search that rules lists
            out, early stop's, may have left none below one); read list-major, with every other
            query's pending entries of the lists taken."""
            for end in ends:
                if (take := pending & (columns < end)).any():
                    return take | (pending & np.isin(lists, lists[take])) if list_major else take
            return np.zeros_like(pending)

        call = self.tracker.new_call()
        found, _ = scan_in_chunks(
            self.inner,
            queries,
            k,
            lists,
            list_scores,
            next_chunk,
            lambda top, scanned, more: self.tracker.faiss_chunk(call, top, scanned, more),
        )
        return found


class ProvisionalTopK:
    """One search's provisional top-k, from its halves as they progress: each CPU call's chunks
    (from faiss's worker threads) and the device half's result (from the search's thread),
    reported each time one arrives once both have something and some CPU call has lists left.
    The report is the merge of the latest of each."""

    def __init__(self, k: int, probed_lists: int, report: ProvisionalReport, merge: MergeToHost) -> None:
        self.k, self.probed_lists, self.report, self.merge = k, probed_lists, report, merge
        self._lock = threading.Lock()
        self._calls = itertools.count()
        self._device: list[TopK] | None = None  # None until the device half is done; empty without one
        self._device_lists = 0
        self._cpu: dict[int, tuple[TopK, int, bool]] = {}  # per CPU call: its top-k so far, lists scanned, any left

    def new_call(self) -> int:
        return next(self._calls)

    def device_done(self, parts: Sequence[Part], lists: int) -> None:
        """The device half's results over its `lists` (none: no device half)."""
        found = self.merge(parts, self.k) if parts else None
        with self._lock:
            self._device, self._device_lists = ([] if found is None else [found]), lists
            self._report()

    def faiss_chunk(self, call: int, found: TopK, lists: int, more: bool) -> None:
        """CPU call `call`'s top-k over its first `lists` lists; `more`: it has lists left."""
        with self._lock:
            self._cpu[call] = (found, lists, more)
            self._report()

    def _report(self) -> None:
        """Once both halves have something, unless every CPU call is done (the answer follows)."""
        if self._device is None or not any(more for _, _, more in self._cpu.values()):
            return
        scores, ids = merge_shard_results([*self._device, *(found for found, _, _ in self._cpu.values())], self.k)
        share = (self._device_lists + sum(lists for _, lists, _ in self._cpu.values())) / max(1, self.probed_lists)
        self.report(Provisional(scores, ids, share))
