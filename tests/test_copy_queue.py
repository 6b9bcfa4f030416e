"""The copy stream is one queue shared by every request: budgets subtract what is queued ahead,
and a search hands a cluster whose copy is still queued to faiss when faiss would finish first.
On a CPU box copies are synchronous, so queued copies are simulated: the cache's copies run as
usual but report "landed" only when the test says so (as a CUDA event would)."""

from __future__ import annotations

import numpy as np
import pytest

from telerag.retrieval.cache import Issued
from telerag.retrieval.demand import DemandCopyPolicy
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.prefetch import plan_prefetch
from tests.retrieval_helpers import assert_same_as_faiss, random_datastore, random_queries


class QueuedCopy:
    """Copies queued on a copy stream, standing in for CUDA's: they land when told to."""

    def __init__(self) -> None:
        self.arrived = False

    def landed(self) -> bool:
        return self.arrived

    def hasten(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        self.arrived = True  # its rows are there already: waited on, it lands

    def elapsed_ms(self) -> float | None:
        return 1.0 if self.arrived else None


@pytest.fixture()
def queued_copies(monkeypatch):
    """Every cache copy from now on stays "in flight" until the test lands it."""
    windows: list[QueuedCopy] = []

    def install(engine: RetrievalEngine) -> list[QueuedCopy]:
        issue = engine.cache._issue_copies

        def queued(copies, *, ahead=False):
            issue(copies, ahead=ahead)  # the rows really arrive (synchronously, on the CPU)
            windows.append(QueuedCopy())
            return Issued(windows[-1], [windows[-1]] * len(copies))  # one window: they land together

        monkeypatch.setattr(engine.cache, "_issue_copies", queued)
        return windows

    return install


def engine_over(tmp_path, cache_fraction: float = 0.5) -> RetrievalEngine:
    ds = random_datastore(tmp_path / "ds", n=3000, nlist=30)
    return RetrievalEngine(ds, cache_bytes=int(ds.n_vectors * ds.dim * 4 * cache_fraction))


def test_plan_puts_clusters_several_queries_want_first():
    ranked = np.array([[0, 1, 2, 3], [4, 5, 6, 3]])
    sizes = np.array([10] * 8)
    # 3 is rank 3 for both: wanted twice, it moves up to rank 1.5, ahead of the rank-2 clusters
    assert plan_prefetch(ranked, sizes, 50).clusters == [0, 4, 1, 5, 3]
    assert plan_prefetch(ranked, sizes, 50, depth=3).clusters == [0, 4, 1, 5, 2]  # beyond depth it counts once


def test_plan_pins_resident_clusters_for_free():
    ranked = np.array([[0, 1, 2, 3], [4, 5, 6, 3]])
    sizes = np.array([10] * 8)
    resident = np.isin(np.arange(8), [1, 6])
    plan = plan_prefetch(ranked, sizes, 30, resident=resident)
    assert plan.bytes == 30 and set(plan.clusters) == {0, 4, 1, 5, 6}  # 1 and 6 cost nothing
    assert plan.per_query == [frozenset({0, 1}), frozenset({4, 5, 6})]


def test_cache_tracks_what_is_queued(tmp_path, queued_copies):
    engine = engine_over(tmp_path)
    windows = queued_copies(engine)
    first = engine.cache.acquire([0, 1], fetch=True)
    second = engine.cache.acquire([5], fetch=True)
    row = engine.cache.row_bytes

    def size(*cs: int) -> int:
        return int(engine.cache.sizes[list(cs)].sum()) * row

    assert engine.cache.queued_bytes() == size(0, 1, 5)
    # each cluster: the bytes queued up to and including its own copy
    assert engine.cache.pending(second) == {5: size(0, 1, 5)}
    assert engine.cache.pending(first) == {0: size(0, 1), 1: size(0, 1)}
    windows[0].arrived = True
    assert engine.cache.queued_bytes() == size(5) and engine.cache.pending(first) == {}
    assert engine.cache.pending(second) == {5: size(5)}
    windows[1].arrived = True
    assert engine.cache.queued_bytes() == 0
    first.release()
    second.release()


def test_a_new_prefetch_budget_subtracts_what_is_queued_ahead(tmp_path, queued_copies):
    engine = engine_over(tmp_path, cache_fraction=1.0)
    queued_copies(engine)
    budget = engine.cache.capacity_bytes // 4
    q = random_queries(2, engine.datastore.dim)
    ahead = engine.prefetch(-q[:1], budget)  # another request's copies, still queued
    queued = ahead.stats.bytes_copied
    assert queued > 0 and engine.cache.queued_bytes() == queued
    handle = engine.prefetch(q[1:], budget)
    assert handle.stats.bytes_queued_ahead == queued
    assert handle.plan.bytes <= budget - queued
    alone = engine_over(tmp_path / "alone", cache_fraction=1.0).prefetch(q[1:], budget)
    assert alone.plan.bytes > handle.plan.bytes  # without the queue ahead it would have copied more
    ahead.release()
    handle.release()


def test_late_copies_go_to_faiss_only_when_faiss_finishes_first():
    policy = DemandCopyPolicy(copy_bytes_per_ms=100.0)
    policy.cpu_bytes_per_ms = 100.0
    # (cluster, queued bytes up to its copy, bytes faiss would read for it)
    waiting = [(1, 1_000, 100), (2, 50_000, 100)]
    # cluster 2 lands in 500 ms; faiss reads 1,000 + 100 bytes in 11 ms: hand it over, keep 1 (10 ms)
    assert policy.late_to_cpu(waiting, cpu_bytes=1_000) == [2]
    # faiss is busy for 1,000 ms anyway: waiting 500 ms costs nothing
    assert policy.late_to_cpu(waiting, cpu_bytes=100_000) == []
    assert DemandCopyPolicy().late_to_cpu(waiting, 1_000) == []  # nothing measured yet: wait


@pytest.mark.parametrize("copy_is_slow", [True, False], ids=["hand-to-faiss", "wait"])
def test_search_waits_or_hands_queued_copies_to_faiss_with_the_same_answer(tmp_path, queued_copies, copy_is_slow):
    engine = engine_over(tmp_path)
    queued_copies(engine)
    q = random_queries(1, engine.datastore.dim)
    nprobe = 8
    handle = engine.prefetch(q, engine.cache.capacity_bytes)
    assert handle.stats.bytes_copied > 0  # all of it still queued
    engine.demand.copy_bytes_per_ms = 1e-3 if copy_is_slow else 1e12
    engine.demand.cpu_bytes_per_ms = 1e12 if copy_is_slow else 1e-3
    engine.demand.observe_cpu = lambda *args: None  # keep the rates the test set
    result = assert_same_as_faiss(engine, q, 10, nprobe, prefetch=handle)
    stats = result.per_query[0]
    if copy_is_slow:
        assert stats.clusters_late > 0 and stats.clusters_device == 0 and stats.clusters_cpu == nprobe
    else:
        assert stats.clusters_late == 0 and stats.clusters_device > 0
    assert engine.cache.stats().pinned_clusters == 0
