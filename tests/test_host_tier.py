"""A datastore on disk under a device cache through a host tier (`retrieval.host_tier`): disk →
host cache → device cache, on CUDA (`scripts/gpu_check`: the copies on the copy stream from
page-locked host rows) and with the CPU as the "device" (the same copies, leases and chains,
everywhere); the answers are faiss's `IndexIVF` at every pair of budgets, and what each tier holds
is the file's rows."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
import torch

from telerag.retrieval.cache import CacheBuffer, ClusterCache
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.file_reads import FileRows
from telerag.retrieval.host_tier import HostTierRows, host_cache_on
from tests.retrieval_helpers import DEVICES, assert_same_as_faiss, random_datastore, random_queries

NLIST = 24


def tiered_engine(ds, device_share: float, host_share: float, **kwargs) -> RetrievalEngine:
    """An engine reading `ds` from disk through a host tier, each cache a share of the datastore's bytes."""
    nbytes = ds.n_vectors * ds.dim * ds.vectors.itemsize
    return RetrievalEngine(
        ds, cache_bytes=int(nbytes * device_share), host_cache_bytes=int(nbytes * host_share), on_disk=True, **kwargs
    )


def tiers(ds, device_rows: int, host_rows: int, device: str = "cpu") -> tuple[ClusterCache, ClusterCache, FileRows]:
    """A cache on `device` over a host tier over `ds`'s file, of so many rows each."""
    files = FileRows(ds)
    host = host_cache_on(files, ds.offsets, None, host_rows * files.row_bytes, torch.device(device))
    rows = HostTierRows(host, files)
    cache = ClusterCache(rows, ds.offsets, CacheBuffer(device_rows, ds.dim, rows.dtype, torch.device(device)))
    return cache, host, files
    return device, host, files


def assert_holds_the_files_rows(cache: ClusterCache, vectors: np.ndarray, clusters) -> None:
    lease = cache.acquire(clusters, fetch=False)
    try:
        for segments in lease.resident.values():
            for s in segments:
                np.testing.assert_array_equal(
                    cache.buffer[s.start : s.start + s.length].numpy(), vectors[s.host_start : s.host_start + s.length]
                )
    finally:
        lease.release()


@pytest.mark.parametrize(("device_share", "host_share"), [(0.05, 0.02), (0.05, 0.5), (0.3, 0.1), (0.5, 1.0), (1.0, 1.0)])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("device", DEVICES)
def test_every_pair_of_tier_budgets_answers_as_faiss_cold_and_warm_after_prefetches(
    tmp_path, device_share, host_share, batch, device
):
    ds = random_datastore(tmp_path / "ds", n=4000, nlist=NLIST, duplicates=3)
    engine = tiered_engine(ds, device_share, host_share, device=device)
    try:
        for round_ in range(3):  # cold, then warm: what each tier holds changes, the answers do not
            queries = random_queries(batch, ds.dim, seed=round_ % 2)
            handle = engine.prefetch(queries, budget_bytes=engine.cache.capacity_bytes)
            assert_same_as_faiss(engine, queries, 10, 6, prefetch=handle)
            for nprobe in (1, NLIST):
                assert_same_as_faiss(engine, queries, 10, nprobe)
        assert engine.host_cache is not None
        for cache in (engine.cache, engine.host_cache):
            stats = cache.stats()
            assert stats.pinned_clusters == 0 and stats.occupancy_bytes <= stats.capacity_bytes
        assert engine.cache.stats().bytes_copied > 0  # lists reached the device
        assert engine.files is not None  # read from disk for the tiers (into the host tier, or staged where it is too small)
        assert engine.files.bytes_read > engine.files.bytes_read_for_scans
    finally:
        engine.close()


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("on", DEVICES)
def test_a_device_copy_lands_the_files_rows_and_unpins_the_host_tier(tmp_path, ahead, on):
    ds = random_datastore(tmp_path / "ds", n=3000, nlist=NLIST)
    device, host, files = tiers(ds, device_rows=1200, host_rows=900, device=on)
    try:
        rng = np.random.default_rng(4)
        for _ in range(12):
            wanted = rng.choice(NLIST, size=int(rng.integers(1, 8)), replace=False)
            lease = device.acquire(wanted, fetch=True, ahead=ahead)
            for arrival in lease.arrivals:
                arrival.wait()
            assert_holds_the_files_rows(device, ds.vectors, wanted)
            assert_holds_the_files_rows(host, ds.vectors, range(NLIST))  # the host tier too: what it read, where it put it
            if lease.arrival is not None:
                assert lease.arrival.landed() and lease.arrival.elapsed_ms() is not None
            assert host.pinned_clusters() == 0  # the host rows were pinned until the device copy landed, no longer
            lease.release()
            device.check_invariants()
            host.check_invariants()
        assert device.stats().bytes_copied >= host.stats().bytes_copied > 0  # a list the host holds is not read again
    finally:
        files.close()
        device.source.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("host_lists", [0, 1])
@pytest.mark.parametrize("on", DEVICES)
def test_lists_the_host_tier_cannot_hold_reach_the_device_through_a_staging_buffer(tmp_path, host_lists, on):
    ds = random_datastore(tmp_path / "ds", n=3000, nlist=NLIST)
    largest = int(np.diff(ds.offsets).max())
    device, host, files = tiers(
        ds, device_rows=ds.n_vectors, host_rows=largest * host_lists, device=on
    )  # no list, or one at most
    try:
        lease = device.acquire(range(NLIST), fetch=True)
        assert lease.arrival is not None
        lease.arrival.wait()
        assert len(lease.resident) == NLIST  # every list on the device, though the host tier held one at a time
        assert_holds_the_files_rows(device, ds.vectors, range(NLIST))
        assert host.pinned_clusters() == 0
        lease.release()
    finally:
        files.close()
        device.source.close()  # type: ignore[attr-defined]


def test_a_failed_read_reaches_the_search_waiting_on_the_device_copy(tmp_path, monkeypatch):
    ds = random_datastore(tmp_path / "ds", n=2000, nlist=NLIST)
    device, host, files = tiers(ds, device_rows=2000, host_rows=2000)

    def failing(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr(files, "_read", failing)
    try:
        lease = device.acquire([0, 5], fetch=True)
        assert lease.arrival is not None
        with pytest.raises(OSError, match="disk gone"):
            lease.arrival.wait()
        assert host.pinned_clusters() == 0  # nothing left pinned by the copy that failed
        lease.release()
    finally:
        files.close()
        device.source.close()  # type: ignore[attr-defined]


@pytest.mark.parametrize("device", DEVICES)
def test_the_cpu_half_scans_the_lists_the_host_tier_holds_without_reading_them(tmp_path, device):
    ds = random_datastore(tmp_path / "ds", n=4000, nlist=NLIST)
    nbytes = ds.n_vectors * ds.dim * ds.vectors.itemsize
    largest = int(np.diff(ds.offsets).max()) * ds.dim * ds.vectors.itemsize
    engine = RetrievalEngine(ds, device=device, cache_bytes=largest, host_cache_bytes=nbytes, on_disk=True, nprobe=NLIST)
    assert engine.files is not None and engine.host_cache is not None
    try:
        queries = random_queries(4, ds.dim, seed=9)
        # lists reach the host tier as the device tier asks for them; the device keeps one at most
        for cluster in range(NLIST):
            lease = engine.cache.acquire([cluster], fetch=True)
            for arrival in lease.arrivals:
                arrival.wait()  # its rows are given to the next list only once its copy landed
            lease.release()
        assert engine.host_cache.stats().resident_clusters == NLIST - int((np.diff(ds.offsets) == 0).sum())
        read_before = engine.files.bytes_read
        assert_same_as_faiss(engine, queries, 10, NLIST)  # every list: one at most on the device, the rest in host memory
        assert engine.files.bytes_read == read_before  # none read again from disk
        stats = engine.cache_stats()  # what /ready's cache and the metrics' telerag_host_cache_* show
        assert stats.host_hits == engine.host_cache.stats().hits > 0
        assert stats.host_bytes_read == engine.host_cache.stats().bytes_copied > 0
        assert stats.host_capacity_bytes == nbytes and 0 < stats.host_occupancy_bytes <= nbytes
    finally:
        engine.close()


def test_a_new_generation_shares_both_tiers(tmp_path):
    """A compaction's or a retrain's engine (`new_engine(datastore, previous)`) keeps the buffers of both tiers."""
    ds = random_datastore(tmp_path / "ds", n=2000, nlist=NLIST)
    first = tiered_engine(ds, 0.2, 0.4)
    second = RetrievalEngine(
        ds,
        cache_buffer=first.cache.shared,
        host_cache_buffer=first.host_cache.shared,
        on_disk=True,  # type: ignore[union-attr]
    )
    try:
        assert second.cache.shared is first.cache.shared
        assert second.host_cache is not None and second.host_cache.shared is first.host_cache.shared  # type: ignore[union-attr]
        assert_same_as_faiss(second, random_queries(2, ds.dim), 10, 6)
    finally:
        second.close()
        first.close()


def test_a_resized_device_cache_leaves_its_old_buffer_to_be_freed(tmp_path):
    """On a GPU the old buffer is the device memory a resize means to give back: nothing of the tier holds it."""
    ds = random_datastore(tmp_path / "ds", n=3000, nlist=NLIST)
    engine = tiered_engine(ds, 0.3, 0.3)
    try:
        queries = random_queries(2, ds.dim)
        assert_same_as_faiss(engine, queries, 10, 6, prefetch=engine.prefetch(queries, engine.cache.capacity_bytes))
        old = weakref.ref(engine.cache.buffer)
        engine.resize_cache(engine.cache.capacity_bytes)
        gc.collect()
        assert old() is None
        assert_same_as_faiss(engine, queries, 10, 6)  # the new cache, through the same host tier
    finally:
        engine.close()


@pytest.mark.parametrize("tiered", [False, True])
def test_concurrent_requests_on_caches_under_pressure_answer_as_faiss(tmp_path, tiered):
    """Requests as a server runs them, several at once: each prefetches its q_in, then searches its
    q_out, on caches a list or two large (acquisitions evict); from disk alone or through the host
    tier. Every answer is faiss's, nothing stays pinned, and each tier holds the file's rows."""
    ds = random_datastore(tmp_path / "ds", n=4000, nlist=NLIST, duplicates=2)
    nbytes = ds.n_vectors * ds.dim * ds.vectors.itemsize
    engine = tiered_engine(ds, 0.06, 0.1) if tiered else RetrievalEngine(ds, cache_bytes=int(nbytes * 0.06), on_disk=True)
    failures: list[BaseException] = []

    def requests(worker: int) -> None:
        try:
            for n in range(12):
                q_out = random_queries(1 + n % 3, ds.dim, seed=100 * worker + n)
                q_in = q_out + np.float32(0.05) * random_queries(len(q_out), ds.dim, seed=7 + n)
                handle = engine.prefetch(q_in, budget_bytes=engine.cache.capacity_bytes)
                assert_same_as_faiss(engine, q_out, 10, 6, prefetch=handle)
        except BaseException as failed:  # noqa: BLE001 - reported in the test's thread
            failures.append(failed)

    threads = [threading.Thread(target=requests, args=(w,)) for w in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not failures, failures[0]
        assert not any(thread.is_alive() for thread in threads)
        for cache in (engine.cache, engine.host_cache):
            if cache is not None:
                assert cache.pinned_clusters() == 0
                cache.check_invariants()
                held = cache.acquire(range(NLIST), fetch=False)
                for arrival in held.arrivals:
                    arrival.wait()
                held.release()
        for cache in (engine.cache, engine.host_cache):
            if cache is not None:  # what each holds is what the file holds there: no read landed over a newer one
                assert_holds_the_files_rows(cache, ds.vectors, range(NLIST))
    finally:
        engine.close()
