"""The dense search's recall, estimated on the server's own traffic: a sampled share of real
searches repeated exhaustively (every list probed) in idle time, each query's recall the share of
the exhaustive top k its search found (a passage found with a score at least the exhaustive k-th
counts, so ties at the boundary are no loss). Nobody else can see this number: the IVF's misses
depend on how the lists fell and on what users ask, and both change while it serves.

The sampling keeps to a budget: a search is sampled only while the exhaustive searches so far took
at most `budget` of the time the searches did (0.02: about one search in 200 on the embedded
default, whose exhaustive search probes 4x its lists). A sample whose generation has been replaced
by a compaction or retrain is dropped. Below `target` (over `WARN_AFTER` queries at least) it is
logged, once until it recovers.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from telerag.retrieval.snapshot import Snapshot, search_snapshot

if TYPE_CHECKING:
    from telerag.retrieval.engine import RetrievalEngine

log = logging.getLogger(__name__)

RECALL_WINDOW = 256  # the latest sampled queries the estimate is the mean of
MAX_WAITING = 8  # samples waiting for idle time at most; more are not taken
WARN_AFTER = 10  # sampled queries before a recall below target is logged (fewer say little)
SCORE_TOLERANCE = 1e-5  # a found passage scoring this close to the exhaustive k-th is one of the top k (a tie)


@dataclass(frozen=True)
class RecallEstimate:
    datastore: str  # its name
    recall: float | None  # the mean over the latest sampled queries (None: none measured yet)
    samples: int  # queries measured since start
    window: int  # of those, the ones behind `recall`
    target: float


@dataclass(frozen=True)
class _Sample:
    engine: RetrievalEngine
    snapshot: Snapshot
    queries: np.ndarray
    k: int
    ids: np.ndarray
    scores: np.ndarray
    reserved: float  # the budget it was taken against until its exhaustive search is timed: its search's time


def query_recall(ids: np.ndarray, scores: np.ndarray, exact_ids: np.ndarray, exact_scores: np.ndarray) -> float | None:
    """The share of one query's exhaustive top k that its search found (None: the exhaustive found nothing)."""
    wanted = int((exact_ids >= 0).sum())
    if not wanted:
        return None
    kth = float(exact_scores[wanted - 1])
    found = int(((ids >= 0) & (scores >= kth - SCORE_TOLERANCE)).sum())
    return min(1.0, found / wanted)


class RecallSampler:
    """Takes searches as they end (`offer`), repeats a budgeted share of them exhaustively on a
    thread of its own once `idle()` returns, and keeps the latest queries' recall."""

    def __init__(
        self,
        datastore: str = "",
        *,
        budget: float = 0.02,
        target: float = 0.99,
        idle: Callable[[], None] = lambda: None,
        current: Callable[[Snapshot], bool] = lambda snapshot: True,
    ) -> None:
        """`idle()` returns when the searches leave room (the retriever's priority); `current(snapshot)`
        says whether a sample's generation is still the one served."""
        self.datastore, self.budget, self.target = datastore, budget, target
        self._idle, self._current = idle, current
        self._lock = threading.Lock()
        self._recalls: collections.deque[float] = collections.deque(maxlen=RECALL_WINDOW)
        self._samples = 0
        self._searched_s = 0.0  # every offered search's time
        self._exhaustive_s = 0.0  # the exhaustive searches' time
        self._below = False
        self._waiting: queue.Queue[_Sample | None] = queue.Queue(MAX_WAITING)
        self._thread: threading.Thread | None = None

    def offer(
        self,
        engine: RetrievalEngine,
        snapshot: Snapshot,
        queries: np.ndarray,
        k: int,
        ids: np.ndarray,
        scores: np.ndarray,
        seconds: float,
    ) -> None:
        """A search that took `seconds` found `ids` (and `scores`) for `queries` in `snapshot`: taken
        as a sample if the budget has room (a cheap check: nothing is copied otherwise)."""
        with self._lock:
            self._searched_s += seconds
            if self.budget <= 0 or self._exhaustive_s > self.budget * self._searched_s or self._waiting.full():
                return
            self._exhaustive_s += seconds  # reserved: what it costs at least, until its exhaustive search is timed
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="recall-sampler", daemon=True)
                self._thread.start()
        self._waiting.put(_Sample(engine, snapshot, np.array(queries, copy=True), k, ids.copy(), scores.copy(), seconds))

    def estimate(self) -> RecallEstimate:
        with self._lock:
            recall = float(np.mean(self._recalls)) if self._recalls else None
            return RecallEstimate(self.datastore, recall, self._samples, len(self._recalls), self.target)

    def drain(self) -> None:
        """Wait until every sample taken is measured (tests, benchmarks)."""
        self._waiting.join()

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._waiting.put(None)
            thread.join()

    def _run(self) -> None:
        while (sample := self._waiting.get()) is not None:
            try:
                self._measure(sample)
            except Exception:  # an engine closed by a switch meanwhile: the sample is dropped, the estimate goes on
                log.debug("a recall sample was dropped", exc_info=True)
                with self._lock:
                    self._exhaustive_s -= sample.reserved
            finally:
                self._waiting.task_done()
        self._waiting.task_done()

    def _measure(self, sample: _Sample) -> None:
        self._idle()
        if not self._current(sample.snapshot):
            with self._lock:
                self._exhaustive_s -= sample.reserved
            return
        started = time.perf_counter()
        exact = search_snapshot(sample.engine, sample.snapshot, sample.queries, sample.k, sample.snapshot.datastore.nlist)
        spent = time.perf_counter() - started
        recalls = [
            r
            for row in range(len(sample.queries))
            if (r := query_recall(sample.ids[row], sample.scores[row], exact.ids[row], exact.scores[row])) is not None
        ]
        with self._lock:
            self._exhaustive_s += spent - sample.reserved
            self._recalls.extend(recalls)
            self._samples += len(recalls)
            recall = float(np.mean(self._recalls)) if self._recalls else None
            below = recall is not None and recall < self.target and len(self._recalls) >= WARN_AFTER
            fell, self._below = below and not self._below, below
        if fell:
            log.warning(
                "%s: the search's recall against an exhaustive search is %.3f over the latest %d sampled queries, below "
                "retrieval.target_recall (%.3f): raise nprobe, or retrain the datastore if its lists grew uneven",
                sample.snapshot.datastore.where,
                recall,
                len(self._recalls),
                self.target,
            )
