"""Copying missed clusters on demand changes which half scans them, never the answer."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from telerag.retrieval.demand import DemandCopyPolicy
from telerag.retrieval.engine import RetrievalEngine
from tests.retrieval_helpers import DEVICES, CopyEveryMiss, assert_same_as_faiss, random_datastore, random_queries

MB = 1 << 20


def policy(copy_rate: float | None, cpu_rate: float | None) -> DemandCopyPolicy:
    p = DemandCopyPolicy(copy_rate)
    if cpu_rate is not None:
        p.observe_cpu(int(cpu_rate * 10), 10.0)
    return p


def test_nothing_is_copied_until_both_rates_are_known():
    sizes = dict.fromkeys(range(8), MB)
    missed = dict.fromkeys(range(8), 1)
    assert policy(None, 1000.0).choose(missed, sizes) == []
    assert policy(1000.0, None).choose(missed, sizes) == []


def test_equal_rates_split_the_misses_in_half():
    sizes = dict.fromkeys(range(10), MB)
    chosen = policy(1000.0, 1000.0).choose(dict.fromkeys(range(10), 1), sizes)
    assert len(chosen) == 5


def test_copy_twice_as_fast_takes_two_thirds():
    sizes = dict.fromkeys(range(9), MB)
    chosen = policy(2000.0, 1000.0).choose(dict.fromkeys(range(9), 1), sizes)
    assert len(chosen) == 6


def test_slow_copy_leaves_everything_to_the_cpu():
    sizes = dict.fromkeys(range(4), MB)
    assert policy(10.0, 1e6).choose(dict.fromkeys(range(4), 1), sizes) == []


def test_clusters_probed_by_more_queries_go_first():
    sizes = dict.fromkeys(range(6), MB)
    missed = {0: 1, 1: 1, 2: 4, 3: 1, 4: 3, 5: 1}
    chosen = policy(1000.0, 1000.0).choose(missed, sizes)
    assert chosen[:2] == [2, 4]


def test_rates_are_moving_averages():
    p = DemandCopyPolicy()
    p.observe_copy(1000, 1.0)
    p.observe_copy(2000, 1.0)
    assert p.copy_bytes_per_ms == pytest.approx(1200.0)
    p.observe_copy(0, 1.0)  # nothing measured: unchanged
    assert p.copy_bytes_per_ms == pytest.approx(1200.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(3))
def test_parity_with_demand_copies(tmp_path, device, seed):
    rng = np.random.default_rng(seed)
    nlist = int(rng.integers(8, 40))
    ds = random_datastore(tmp_path / "ds", n=int(rng.integers(1000, 3000)), dim=24, nlist=nlist, seed=seed, empty_lists=2)
    total = ds.n_vectors * ds.dim * 4
    engine = RetrievalEngine(ds, device=device, cache_bytes=total // 2, demand_copy=True)
    assert engine.demand is not None and engine.demand.copy_bytes_per_ms, "the copy rate is measured at start"
    engine.demand = CopyEveryMiss()
    q_in = random_queries(6, ds.dim, seed)
    q_out = q_in + 0.5 * random_queries(6, ds.dim, seed + 100)
    copied_on_demand = 0
    for budget in (0, total // 8, total // 3):
        for nprobe in sorted({1, 3, nlist // 2, ds.nlist}):
            for batch in (1, 6):
                other = engine.prefetch(-q_in[:batch], budget // 2)  # another request's, still waiting
                handle = engine.prefetch(q_in[:batch], budget)
                result = assert_same_as_faiss(engine, q_out[:batch], int(rng.integers(1, 20)), nprobe, prefetch=handle)
                copied_on_demand += sum(s.clusters_copied_on_demand for s in result.per_query)
                assert all(s.clusters_copied_on_demand <= s.clusters_device for s in result.per_query)
                assert handle.lease is None or handle.lease.released, "the search ends its prefetch"
                # what the other prefetch holds is still there, whatever demand evicted
                assert other.lease is None or all(engine.cache._slots[c].pins > 0 for c in other.lease.resident)
                other.release()
        engine.cache.check_invariants()
    assert copied_on_demand > 0, "the policy never copied a missed cluster"
    assert engine.cache.stats().pinned_clusters == 0
    engine.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("own", [False, True], ids=["another-request's", "its-own"])
def test_which_prefetched_clusters_demand_copies_may_evict(tmp_path, device, own):
    """A prefetch fills the cache (a quarter of the datastore) with clusters the search does
    not read. Another request's prefetch, still waiting for its own search, is never evicted:
    faiss scans what does not fit. The search's own prefetch ends when the search starts, so
    what it guessed wrong makes room for the demand copies. The answer is faiss's either way."""
    ds = random_datastore(tmp_path / "ds", n=2000, nlist=20)
    total = ds.n_vectors * ds.dim * 4
    engine = RetrievalEngine(ds, device=device, cache_bytes=total // 4, demand_copy=True)
    engine.demand = CopyEveryMiss()
    q = random_queries(1, ds.dim)
    handle = engine.prefetch(-q, total // 4)
    held = set(handle.lease.resident)
    assert engine.cache.stats().occupancy_bytes > engine.cache.capacity_bytes - np.diff(ds.offsets).max() * ds.dim * 4
    result = assert_same_as_faiss(engine, q, 5, 8, prefetch=handle if own else None)
    if own:
        assert handle.lease.released
        assert result.per_query[0].clusters_copied_on_demand > 0
    else:
        assert result.per_query[0].clusters_cpu > 0
        assert all(engine.cache._slots[c].pins == 1 for c in held)
    handle.release()  # harmless when the search already ended it
    engine.cache.check_invariants()
    assert engine.cache.stats().pinned_clusters == 0


def test_cpu_half_thread_count(tmp_path):
    ds = random_datastore(tmp_path / "ds")
    engine = RetrievalEngine(ds, cache_bytes=MB, cpu_threads=1)
    assert engine._cpu_pool.submit(faiss.omp_get_max_threads).result() == 1
    engine.close()
