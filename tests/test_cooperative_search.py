"""Cooperative search must return exactly what faiss returns at the same nprobe, whatever was prefetched."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from telerag.retrieval.cache import Segment
from telerag.retrieval.codecs import Codec
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.errors import DeviceMemoryError, InvalidCall, SearchError
from telerag.retrieval.ivf import same_results
from telerag.retrieval.search import scan_resident
from tests.retrieval_helpers import DEVICES, CopyEveryMiss, assert_same_as_faiss, random_datastore, random_queries


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("seed", range(4))
def test_parity_over_nprobe_and_budget(tmp_path, device, codec, seed):
    rng = np.random.default_rng(seed)
    nlist = int(rng.integers(4, 48))
    ds = random_datastore(
        tmp_path / "ds", n=int(rng.integers(800, 3000)), dim=int(rng.choice([8, 24, 40])), nlist=nlist, codec=codec, seed=seed
    )
    total = int(ds.vectors.nbytes)
    q_in = random_queries(6, ds.dim, seed)
    q_out = q_in + 0.3 * random_queries(6, ds.dim, seed + 100)
    for budget in (0, total // 7, total // 2, total):
        engine = RetrievalEngine(ds, device=device, cache_bytes=max(budget, total // 3))
        for nprobe in sorted({1, 2, nlist // 3 or 1, nlist}):
            for batch in (1, 4, 6):
                handle = engine.prefetch(q_in[:batch], budget)
                assert_same_as_faiss(engine, q_out[:batch], k=int(rng.integers(1, 30)), nprobe=nprobe, prefetch=handle)
                handle.release()
        engine.cache.check_invariants()
        engine.close()


@pytest.mark.parametrize("device", DEVICES)
def test_k_larger_than_candidates_pads_like_faiss(tmp_path, device):
    ds = random_datastore(tmp_path / "ds", n=400, nlist=16)
    engine = RetrievalEngine(ds, device=device, cache_bytes=10**6)
    q = random_queries(3, ds.dim)
    handle = engine.prefetch(q, 10**6)
    result = engine.search(q, 300, nprobe=2, prefetch=handle)
    ref_scores, ref_ids = engine.index.search(q, 300, 2)
    assert (result.ids == -1).any(), "two lists of a 400-vector datastore hold fewer than 300 vectors"
    np.testing.assert_array_equal(result.ids == -1, ref_ids == -1)
    np.testing.assert_array_equal(result.scores[result.ids == -1], ref_scores[ref_ids == -1])
    for i in range(len(q)):
        assert same_results(result.ids[i], result.scores[i], ref_ids[i], ref_scores[i])


@pytest.mark.parametrize("device", DEVICES)
def test_ties_and_empty_lists(tmp_path, device):
    ds = random_datastore(tmp_path / "ds", n=1500, nlist=20, duplicates=12, empty_lists=5)
    sizes = np.diff(ds.offsets)
    assert (sizes == 0).sum() >= 5
    engine = RetrievalEngine(ds, device=device, cache_bytes=ds.n_vectors * ds.dim * 4)
    duplicate = np.asarray(ds.vectors[ds.offsets[np.argmax(sizes > 0)]], dtype=np.float32)[None]
    q = np.concatenate([random_queries(4, ds.dim), np.asarray(ds.vectors[:3], dtype=np.float32), duplicate])
    for budget in (0, ds.n_vectors * ds.dim * 2, ds.n_vectors * ds.dim * 4):
        handle = engine.prefetch(q, budget)
        for nprobe in (1, 5, ds.nlist):
            assert_same_as_faiss(engine, q, 8, nprobe, prefetch=handle)
        handle.release()
    # ties are ordered by id
    result = engine.search(q, 8, ds.nlist)
    for scores, ids in zip(result.scores, result.ids, strict=True):
        for j in range(1, 8):
            assert scores[j] < scores[j - 1] or ids[j] > ids[j - 1]


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_off_searches_everything_on_cpu(tmp_path, device):
    ds = random_datastore(tmp_path / "ds")
    engine = RetrievalEngine(ds, device=device, cache_bytes=ds.n_vectors * ds.dim * 4)
    q = random_queries(4, ds.dim)
    handle = engine.prefetch(q, 10**9)
    result = engine.search(q, 5, 8, prefetch=handle, use_cache=False)
    assert all(s.clusters_device == 0 and s.clusters_cpu == 8 for s in result.per_query)
    assert_same_as_faiss(engine, q, 5, 8, use_cache=False)
    handle.release()


@pytest.mark.parametrize("device", DEVICES)
def test_overlap_rate_is_eq_3_1(tmp_path, device):
    ds = random_datastore(tmp_path / "ds", nlist=32)
    engine = RetrievalEngine(ds, device=device, cache_bytes=ds.n_vectors * ds.dim * 4)
    q = random_queries(1, ds.dim)
    handle = engine.prefetch(q, ds.n_vectors * ds.dim * 4 // 4)
    result = engine.search(q, 5, 8, prefetch=handle)
    c_in = set(handle.plan.per_query[0])
    c_out = set(engine.index.probe(q, 8)[1][0].tolist())
    assert result.per_query[0].overlap_rate == pytest.approx(len(c_in & c_out) / len(c_out))
    same = engine.search(q, 5, 8, prefetch=engine.prefetch(q, ds.n_vectors * ds.dim * 4))
    assert same.per_query[0].overlap_rate == 1.0


def search_at_once(work: list[tuple[RetrievalEngine, int]], budgets: tuple[int, int]) -> None:
    """Each (engine, seed) in a thread of its own: 15 searches of 1 to 3 random queries, each after
    a prefetch within `budgets` (low, high) and at a random nprobe, each equal to faiss's; the first
    failure raised here."""
    errors: list[BaseException] = []

    def worker(engine: RetrievalEngine, seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            for _ in range(15):
                q = random_queries(int(rng.integers(1, 4)), engine.datastore.dim, int(rng.integers(1 << 30)))
                handle = engine.prefetch(q, int(rng.integers(*budgets)))
                assert_same_as_faiss(engine, q, 10, int(rng.integers(1, engine.nlist)), prefetch=handle)
                handle.release()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=pair) for pair in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("demand_copy", [False, True])
def test_concurrent_searches_over_overlapping_clusters(tmp_path, device, demand_copy):
    ds = random_datastore(tmp_path / "ds", n=4000, nlist=40)
    total = ds.n_vectors * ds.dim * 4
    engine = RetrievalEngine(ds, device=device, cache_bytes=total // 3, demand_copy=demand_copy)
    if demand_copy:
        engine.demand = CopyEveryMiss()
    search_at_once([(engine, seed) for seed in range(6)], (0, total // 4))
    engine.cache.check_invariants()
    stats = engine.cache.stats()
    assert stats.pinned_clusters == 0
    assert stats.occupancy_bytes <= stats.capacity_bytes <= total // 3


@pytest.mark.parametrize("device", DEVICES)
def test_datastores_sharing_one_cache_buffer_search_exactly_at_once(tmp_path, device):
    """The server's datastore and vector stores on one cluster cache buffer: each engine's lists
    are evicted for the other's, concurrently, and every search stays faiss's."""
    first = random_datastore(tmp_path / "a", n=3000, nlist=30, seed=1)
    second = random_datastore(tmp_path / "b", n=2000, nlist=20, seed=2)
    total = first.n_vectors * first.dim * 4
    server = RetrievalEngine(first, device=device, cache_bytes=total // 3)
    store = RetrievalEngine(second, device=device, cache_buffer=server.cache.shared)
    assert store.cache.shared is server.cache.shared and store.copy_bytes_per_ms == server.copy_bytes_per_ms
    held = [engine.prefetch(random_queries(1, engine.datastore.dim, 7), total // 8) for engine in (server, store)]
    assert server.cache.resident_mask().any() and store.cache.resident_mask().any()  # both at once, in one buffer
    for handle in held:
        handle.release()
    search_at_once([(engine, seed) for seed, engine in enumerate([server, store] * 2)], (total // 8, total // 3))
    server.cache.check_invariants()
    assert server.cache.stats().pinned_clusters == 0
    store.close()  # its lists leave the buffer; the server's stay
    assert not store.cache.resident_mask().any() and server.cache.shared.caches == [server.cache]
    with pytest.raises(InvalidCall, match="cannot hold"):
        RetrievalEngine(random_datastore(tmp_path / "c", n=500, dim=8, nlist=4), device=device, cache_buffer=server.cache.shared)
    server.close()


def test_bad_arguments(tmp_path):
    ds = random_datastore(tmp_path / "ds", nlist=16)
    engine = RetrievalEngine(ds, cache_bytes=0)
    q = random_queries(2, ds.dim)
    with pytest.raises(SearchError, match="nprobe"):
        engine.search(q, 5, nprobe=17)
    with pytest.raises(SearchError, match="nprobe"):
        engine.search(q, 5, nprobe=-1)
    with pytest.raises(SearchError, match="k must be positive"):
        engine.search(q, 0, nprobe=4)
    with pytest.raises(SearchError, match="shape"):
        engine.search(q[:, :-1], 5, nprobe=4)


def test_a_broken_contract_with_the_engine_is_a_server_fault_not_a_bad_request(tmp_path):
    """What only the code calling the engine can get wrong is `InvalidCall`: a 500, never the
    422 of a bad search request."""
    from telerag.server.errors import status_of

    ds = random_datastore(tmp_path / "ds", nlist=16)
    engine = RetrievalEngine(ds, cache_bytes=1 << 20)
    q = random_queries(2, ds.dim)
    handle = engine.prefetch(q[:1], budget_bytes=1 << 20)
    with pytest.raises(InvalidCall, match="1 prefetch handles for 2 queries") as mismatch:
        engine.search(q, 5, nprobe=4, prefetch=[handle])
    with pytest.raises(InvalidCall, match="pinned") as resize:
        engine.resize_cache(1 << 21)
    handle.release()
    assert status_of(mismatch.value) == status_of(resize.value) == 500
    with pytest.raises(SearchError) as bad_request:
        engine.search(q, 5, nprobe=17)
    assert status_of(bad_request.value) == 422


@pytest.mark.parametrize("device", DEVICES)
def test_groups_prefetched_together_share_the_cache(tmp_path, device):
    """Three requests each asking for the whole cache: one plan interleaves their ranks, so
    each gets its nearest clusters (none is left out) and together they fit the cache."""
    ds = random_datastore(tmp_path / "ds", n=3000, nlist=30)
    total = ds.n_vectors * ds.dim * 4
    engine = RetrievalEngine(ds, device=device, cache_bytes=total // 2)
    groups = [random_queries(1, ds.dim, seed) for seed in (1, 2, 3)]
    handles = engine.prefetch_batch(groups, [total] * 3)
    for group, handle in zip(groups, handles, strict=True):
        nearest = engine.rank_clusters(group)[0, :3].tolist()
        assert set(nearest) <= set(handle.plan.clusters) <= set(handle.lease.resident)
        assert handle.stats.clusters_skipped == 0
    assert sum(h.stats.bytes_copied for h in handles) <= engine.cache.capacity_bytes
    stats = engine.cache.stats()
    assert stats.occupancy_bytes <= stats.capacity_bytes
    for group, handle in zip(groups, handles, strict=True):
        assert_same_as_faiss(engine, group, 5, 10, prefetch=handle)
        handle.release()
    assert engine.cache.stats().pinned_clusters == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a device memory that runs out: CUDA (scripts/gpu_check)")
def test_a_cache_larger_than_the_device_is_refused_and_the_old_one_kept(tmp_path):
    ds = random_datastore(tmp_path / "ds", n=2000, nlist=16)
    engine = RetrievalEngine(ds, device="cuda", cache_bytes=int(ds.vectors.nbytes) // 2)
    capacity = engine.cache.capacity_bytes
    _, total = torch.cuda.mem_get_info()
    with pytest.raises(DeviceMemoryError, match="does not fit"):
        engine.resize_cache(2 * total)
    assert engine.cache.capacity_bytes == capacity
    q = random_queries(4, ds.dim)
    assert_same_as_faiss(engine, q, k=5, nprobe=8, prefetch=engine.prefetch(q, capacity))
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory: CUDA (scripts/gpu_check)")
def test_vectors_pinned_already_are_copied_from_in_place(tmp_path):
    """A datastore made in memory (benchmarks.scaled) is pinned as it is made: the engine copies
    clusters from that memory, never from a second pinned copy of tens of GB."""
    loaded = random_datastore(tmp_path / "ds", n=2000, nlist=16)
    pinned = torch.from_numpy(np.array(loaded.vectors)).pin_memory()
    ds = Datastore(loaded.manifest, centroids=loaded.centroids, offsets=loaded.offsets, vectors=pinned.numpy(), where="memory")
    engine = RetrievalEngine(ds, device="cuda", cache_bytes=int(pinned.nbytes) // 2)
    assert engine.host_vectors.data_ptr() == pinned.data_ptr()
    q = random_queries(4, ds.dim)
    assert_same_as_faiss(engine, q, k=5, nprobe=8, prefetch=engine.prefetch(q, engine.cache.capacity_bytes))
    engine.close()


@pytest.mark.parametrize("codec", list(Codec))
def test_the_host_scan_in_place_equals_the_gathered_one(codec):
    """On the CPU the resident rows are scored in place by faiss's inner products, list-major:
    the same top-k as gathering them and multiplying, with clusters split into pieces, lists
    probed by some queries of the batch and not others, an empty segment, and k past the rows."""
    rng = np.random.default_rng(3)
    dim, rows = 24, 900
    vectors = rng.standard_normal((rows, dim)).astype(np.float32)
    params = codec.train(vectors) if codec.has_params else None
    buffer = torch.from_numpy(np.ascontiguousarray(codec.to_codes(vectors, params)))
    resident = {
        0: [Segment(0, 50, 500), Segment(700, 30, 550)],
        1: [Segment(50, 200, 0)],
        2: [Segment(250, 0, 580)],
        3: [Segment(300, 300, 200)],
        5: [Segment(600, 100, 600)],
    }
    queries = torch.from_numpy(rng.standard_normal((5, dim)).astype(np.float32))
    probes = [[0, 1], [3], [0, 1, 2, 3, 5], [], [5, 2]]
    sq8 = None if params is None else torch.from_numpy(params)
    for k in (1, 7, 400):
        host = scan_resident(buffer, queries, resident, probes, k, codec=codec, codec_params=sq8)
        gathered = scan_resident(buffer, queries, resident, probes, k, codec=codec, codec_params=sq8, use_kernel=False)
        for i in range(len(probes)):
            assert same_results(host[1][i].numpy(), host[0][i].numpy(), gathered[1][i].numpy(), gathered[0][i].numpy(), 1e-5)
        assert (host[1][3] == -1).all() and torch.isinf(host[0][3]).all(), "a query probing nothing resident finds nothing"
