"""A datastore searched from disk (`retrieval.disk`): lists read by explicit reads into a host cache
of any budget, the rest read and scanned per search; the answers are faiss's `IndexIVF` at the same
nprobe at every budget, cold or warm, batched or not, every codec, after prefetches and with writes
to a live datastore between searches."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from telerag.documents.writer import DocumentText, DocumentWriter
from telerag.retrieval import file_reads
from telerag.retrieval.codecs import Codec
from telerag.retrieval.disk import DiskListSearch
from telerag.retrieval.early_stop import EarlyStopSearch
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.errors import InvalidCall
from telerag.retrieval.file_reads import FileRows
from telerag.retrieval.ivf import ListSearch, same_results
from telerag.retrieval.live import opened
from telerag.retrieval.provisional import UNWATCHED, MergeToHost, Provisional, ProvisionalWatch, SearchHalves, SearchWatch
from telerag.retrieval.snapshot import search_snapshot
from tests.retrieval_helpers import assert_same_as_faiss, random_datastore, random_queries, topic_datastore

NLIST = 24


def disk_engine(ds, share: float) -> RetrievalEngine:
    """An engine reading `ds` from disk, its host cache `share` of the datastore's bytes."""
    return RetrievalEngine(ds, cache_bytes=int(ds.n_vectors * ds.dim * ds.vectors.itemsize * share), on_disk=True)


@pytest.mark.parametrize("share", [0.0, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("batch", [1, 8])
def test_every_cache_budget_answers_as_faiss_cold_and_warm(tmp_path, share, batch):
    ds = random_datastore(tmp_path / "ds", n=4000, nlist=NLIST, duplicates=3)
    engine = disk_engine(ds, share)
    try:
        for round_ in range(3):  # cold, then warm: what the cache holds changes, the answers do not
            queries = random_queries(batch, ds.dim, seed=round_ % 2)
            for nprobe in (1, 6, NLIST):
                assert_same_as_faiss(engine, queries, 10, nprobe)
        stats = engine.cache_stats()  # the reads scanned uncached included
        assert stats.pinned_clusters == 0 and stats.occupancy_bytes <= stats.capacity_bytes
        assert stats.bytes_copied + stats.bytes_read_for_scans > 0  # the misses were read, into the cache or to be scanned
        if share == 1.0:
            assert stats.occupancy_bytes > 0  # room for every list: what was read stays (a smaller one may evict it all)
    finally:
        engine.close()


@pytest.mark.parametrize("codec", [Codec.FP16, Codec.SQ8])
def test_the_codecs_read_from_disk_answer_as_faiss(tmp_path, codec):
    ds = random_datastore(tmp_path / "ds", n=3000, nlist=NLIST, codec=codec)
    engine = disk_engine(ds, 0.2)
    try:
        assert_same_as_faiss(engine, random_queries(4, ds.dim), 8, 6)
    finally:
        engine.close()


def test_a_prefetch_reads_its_lists_and_the_search_reads_the_rest(tmp_path):
    ds = random_datastore(tmp_path / "ds", n=4000, nlist=NLIST)
    engine = disk_engine(ds, 0.5)
    rows: FileRows = engine.rows  # type: ignore[assignment]
    try:
        q = random_queries(1, ds.dim, seed=3)
        before = rows.bytes_read
        handle = engine.prefetch(q, budget_bytes=engine.cache.capacity_bytes // 2)
        assert handle.lease is not None and handle.stats.bytes_copied > 0
        handle.lease.arrival.wait()  # the reads land while the pre-retrieval call would run
        assert rows.bytes_read - before == handle.stats.bytes_copied
        result = assert_same_as_faiss(engine, q, 10, 6, prefetch=handle)
        assert result.per_query[0].overlap_rate == 1.0 and result.per_query[0].clusters_device > 0
        stats = engine.cache_stats()  # read ahead, read on demand: what the metrics and /ready show
        assert stats.bytes_copied_ahead == handle.stats.bytes_copied == stats.bytes_copied == rows.bytes_read - before
        assert_same_as_faiss(engine, q, 10, NLIST)  # every list: half fit the cache, the rest are read and scanned
        stats = engine.cache_stats()  # the reads scanned uncached included
        assert stats.bytes_copied + stats.bytes_read_for_scans == rows.bytes_read - before
        assert stats.bytes_read_for_scans > 0 and stats.bytes_copied_ahead == handle.stats.bytes_copied
    finally:
        engine.close()


def test_a_prefetch_from_disk_reads_no_list_past_its_reach(tmp_path):
    """From disk a prefetch stops at q_in's nearest 1.5 nprobe lists, a whole cache's budget or
    not (the reads would cost the call they overlap); a reach given reads further, and in memory
    only the budget bounds it."""
    ds = random_datastore(tmp_path / "ds", n=4000, nlist=NLIST)
    q = random_queries(1, ds.dim, seed=5)
    nearest = ds_probe(ds, q, NLIST)[1][0]
    for reach, lists in ((None, 6), (3.0, 12)):
        engine = RetrievalEngine(ds, cache_bytes=ds.vectors.nbytes, on_disk=True, nprobe=4, prefetch_reach=reach)
        try:
            handle = engine.prefetch(q, budget_bytes=engine.cache.capacity_bytes)
            assert set(handle.plan.clusters) == set(nearest[:lists].tolist())
            assert_same_as_faiss(engine, q, 10, 4, prefetch=handle)
        finally:
            engine.close()
    engine = RetrievalEngine(ds, cache_bytes=ds.vectors.nbytes, nprobe=4)
    try:
        assert len(engine.prefetch(q, budget_bytes=engine.cache.capacity_bytes).plan.clusters) == NLIST
    finally:
        engine.close()


def ds_probe(ds, queries, nprobe):
    """Each query's `nprobe` lists, as faiss picks them."""
    engine = RetrievalEngine(ds)
    try:
        return engine.index.probe(queries, nprobe)
    finally:
        engine.close()


@pytest.mark.parametrize("batch", [1, 8])
def test_a_search_begun_while_its_prefetch_still_reads_answers_as_faiss_and_reads_each_list_once(tmp_path, monkeypatch, batch):
    """The pre-retrieval call ended before the prefetch's reads did: the search scans its lists as
    they land (hastened past the reads only the prefetch wants), never reading one again."""
    import threading

    ds = random_datastore(tmp_path / "ds", n=4000, nlist=NLIST)
    engine = disk_engine(ds, 1.0)
    rows: FileRows = engine.rows  # type: ignore[assignment]
    gate, read = threading.Event(), FileRows._read

    def slow_read(self, *args, **kwargs):
        gate.wait(5)
        read(self, *args, **kwargs)

    monkeypatch.setattr(FileRows, "_read", slow_read)
    try:
        q = random_queries(batch, ds.dim, seed=5)
        before = rows.bytes_read
        handle = engine.prefetch(q, budget_bytes=engine.cache.capacity_bytes)
        assert handle.lease is not None and not handle.lease.arrival.landed()
        threading.Timer(0.1, gate.set).start()
        result = assert_same_as_faiss(engine, q, 10, 6, prefetch=handle)
        assert all(query.clusters_late == 0 for query in result.per_query)
        handle.lease.arrival.wait()
        stats = engine.cache_stats()
        assert stats.bytes_copied + stats.bytes_read_for_scans == rows.bytes_read - before  # nothing read twice
        engine.cache.check_invariants()
    finally:
        engine.close()


def test_the_lists_no_cache_holds_are_read_once_for_the_whole_batch(tmp_path):
    ds = random_datastore(tmp_path / "ds", n=3000, nlist=NLIST)
    rows = FileRows(ds)
    try:
        search = DiskListSearch(ds, rows)
        queries = random_queries(8, ds.dim)
        list_scores, lists = ds_probe(ds, queries, 6)
        scores, ids = search.search_lists(queries, 10, lists, list_scores)
        union = np.unique(lists)
        assert rows.bytes_read == int(np.diff(ds.offsets)[union].sum()) * rows.row_bytes
        engine = RetrievalEngine(ds)  # faiss over the memory map: the reference
        ref_scores, ref_ids = engine.index.search_lists(queries, 10, lists, list_scores)
        engine.close()
        for i in range(len(queries)):
            assert same_results(ids[i], scores[i], ref_ids[i], ref_scores[i])
    finally:
        rows.close()


@pytest.mark.parametrize("direct", [True, False])
def test_reads_bypass_the_page_cache_or_drop_what_they_read(tmp_path, monkeypatch, direct):
    monkeypatch.setattr(file_reads, "READ_BYTES", 5000)  # a run of rows in several reads, each at an unaligned offset
    ds = random_datastore(tmp_path / "ds", n=2000, nlist=NLIST)
    rows = FileRows(ds, direct=direct)
    try:
        out = np.empty((1200, ds.dim), dtype=np.float32)
        arrival = rows.read_rows(out, [(0, 7, 50), (50, 700, 1150)])
        arrival.wait()
        assert len(arrival.reads) == 1 + -(-1150 * rows.row_bytes // 5000)
        np.testing.assert_array_equal(out[:50], ds.vectors[7:57])
        np.testing.assert_array_equal(out[50:], ds.vectors[700:1850])
        assert rows.direct == direct  # ext4 and xfs serve O_DIRECT: nothing enters the page cache
        assert rows.bytes_read == 1200 * rows.row_bytes
    finally:
        rows.close()


def test_a_datastore_on_disk_is_searched_by_its_own_reads(tmp_path):
    ds = random_datastore(tmp_path / "ds", n=1000, nlist=8)
    with pytest.raises(InvalidCall, match="by its own reads"):
        RetrievalEngine(ds, on_disk=True, cpu_half=DiskListSearch(ds, FileRows(ds)))


@pytest.mark.parametrize("share", [0.0, 0.3])
def test_early_stop_from_disk_answers_as_faiss_and_never_reads_the_lists_it_rules_out(tmp_path, share):
    """Few dimensions, queries at stored vectors: the bound rules lists out, and those are not read."""
    ds = random_datastore(tmp_path / "ds", n=20000, dim=4, nlist=NLIST)
    queries = np.array(ds.vectors[:: ds.n_vectors // 6][:6])  # a high k-th score early
    read = {}
    for early_stop in (False, True):
        engine = RetrievalEngine(ds, cache_bytes=int(ds.n_vectors * ds.dim * 4 * share), on_disk=True, early_stop=early_stop)
        rows: FileRows = engine.rows  # type: ignore[assignment]
        try:
            for nprobe in (6, NLIST):
                assert_same_as_faiss(engine, queries, 5, nprobe)
            read[early_stop] = rows.bytes_read
            if early_stop:
                stopping: EarlyStopSearch = engine.cpu_half  # type: ignore[assignment]
                assert stopping.counts.scanned < stopping.counts.probed
        finally:
            engine.close()
    assert read[True] < read[False]  # with a cache, the lists read into it are read either way


class DeviceHalfFirst:
    """A watch whose CPU half starts once the device half is done. A top-k so far is reported
    only once both halves have something and the CPU half has lists left; where the CPU half
    ends first the answer follows at once and nothing is reported, so a test that expects
    reports fixes the order the halves end in."""

    def __init__(self, watch: SearchWatch) -> None:
        self.watch = watch

    def halves(self, cpu_half: ListSearch, k: int, probed_lists: int, merge: MergeToHost) -> SearchHalves:
        halves = self.watch.halves(cpu_half, k, probed_lists, merge)
        device_done = threading.Event()

        class AfterTheDeviceHalf:
            def search_lists(self, queries, k, lists, list_scores):
                assert device_done.wait(60)
                return halves.cpu_half.search_lists(queries, k, lists, list_scores)

        def done(parts, lists):
            halves.device_done(parts, lists)
            device_done.set()

        return SearchHalves(AfterTheDeviceHalf(), done)

    def faiss_search(self, index, cpu_half, queries, k, nprobe, merge):
        return self.watch.faiss_search(index, cpu_half, queries, k, nprobe, merge)

    def mapped(self, keep):
        return DeviceHalfFirst(self.watch.mapped(keep))


@pytest.mark.parametrize("early_stop", [False, True])
@pytest.mark.parametrize("share", [0.0, 0.3])
def test_a_search_from_disk_reports_its_top_k_so_far_and_answers_as_faiss(tmp_path, early_stop, share):
    """Speculative prefill from disk: the lists read and scanned a chunk at a time (with early
    stop too), a top-k so far reported over more of them each time, the answer faiss's."""
    ds = random_datastore(tmp_path / "ds", n=4000, dim=8, nlist=NLIST)
    engine = RetrievalEngine(ds, cache_bytes=int(ds.vectors.nbytes * share), on_disk=True, early_stop=early_stop)
    try:
        queries = random_queries(4, ds.dim, seed=2)
        handle = engine.prefetch(queries, int(ds.vectors.nbytes * share) // 2) if share else None
        reports: list[Provisional] = []
        watch = DeviceHalfFirst(ProvisionalWatch(reports.append))
        result = assert_same_as_faiss(engine, queries, 10, 12, prefetch=handle, watch=watch)
        shares = [report.lists_share for report in reports]
        assert reports and shares == sorted(shares) and all(0 < s < 1 for s in shares)
        for report in reports:
            valid = report.ids >= 0
            assert np.all(report.scores[valid] <= result.scores[valid] + 1e-6)
        if handle is not None:
            handle.release()
    finally:
        engine.close()


def test_a_batch_reporting_its_top_k_so_far_reads_each_list_once(tmp_path):
    """The top-k so far over a batch from disk: a list one query's chunk takes is scanned then
    for every query probing it, so the batch reads what it reads unwatched, and answers as faiss."""
    ds = random_datastore(tmp_path / "ds", n=4000, dim=8, nlist=NLIST)
    engine = RetrievalEngine(ds, on_disk=True)
    rows: FileRows = engine.rows  # type: ignore[assignment]
    try:
        queries = random_queries(8, ds.dim, seed=3)
        read = []
        for watch in (UNWATCHED, ProvisionalWatch(lambda report: None)):
            before = rows.bytes_read_for_scans
            assert_same_as_faiss(engine, queries, 10, 12, watch=watch)
            read.append(rows.bytes_read_for_scans - before)
        assert read[0] == read[1] > 0
    finally:
        engine.close()


def test_early_stop_reporting_its_top_k_so_far_rules_lists_out_and_answers_as_faiss(tmp_path):
    """Both from disk: the top-k so far is reported over the lists early stop leaves, the lists
    it rules out are never read, and the answer is faiss's."""
    ds = random_datastore(tmp_path / "ds", n=20000, dim=4, nlist=NLIST)
    queries = np.array(ds.vectors[:: ds.n_vectors // 6][:6])  # a high k-th score early
    engine = RetrievalEngine(ds, on_disk=True, early_stop=True)
    rows: FileRows = engine.rows  # type: ignore[assignment]
    try:
        reports: list[Provisional] = []
        assert_same_as_faiss(engine, queries, 5, NLIST, watch=ProvisionalWatch(reports.append))
        stopping: EarlyStopSearch = engine.cpu_half  # type: ignore[assignment]
        assert stopping.counts.scanned < stopping.counts.probed
        assert rows.bytes_read_for_scans < ds.vectors.nbytes  # every query probes every list
        assert reports and all(0 < report.lists_share < 1 for report in reports)
    finally:
        engine.close()


def test_a_live_datastore_on_disk_answers_as_faiss_after_writes(tmp_path):
    """Writes between searches: the delta's rows and the tombstones are the live datastore's (in
    memory), the generation's lists are read from disk; the answers are a faiss index's after the
    same writes."""
    embedder, path = topic_datastore(tmp_path, per_topic=30, nlist=6)
    with opened(path, writable=True) as live:
        writer = DocumentWriter(live, embedder.encode)
        engine = disk_engine(live.datastore, 0.3)
        memory = RetrievalEngine(live.datastore)  # the same generation, from its memory map
        try:
            queries = embedder.encode(["river water boat", "piano concert", "bread oven yeast"])
            for step in range(4):
                writer.write_now([DocumentText(f"new-{step}", f"river piano bread {step} " * 30, f"New {step}")])
                writer.write_now([f"rivers-{step}"])
                snapshot = live.snapshot()
                for nprobe in (1, 3, 6):
                    ours = search_snapshot(engine, snapshot, queries, 5, nprobe)
                    ref = search_snapshot(memory, snapshot, queries, 5, nprobe, use_cache=False)
                    for i in range(len(queries)):
                        assert same_results(ours.ids[i], ours.scores[i], ref.ids[i], ref.scores[i])
        finally:
            engine.close()
            memory.close()
            writer.close()


async def test_a_server_answers_from_a_datastore_read_from_disk(tmp_path):
    """`retrieval.host_cache_mb` through the settings a server starts from: `/ready` says where
    the vectors come from, and a query's documents are the memory-mapped datastore's."""
    import httpx

    from telerag.server.app import create_app, start_serving
    from telerag.server.process.runtime import Runtime, open_configured_retriever
    from tests.fake_app import settings
    from tests.fakes import Reply, ScriptedEngine

    embedder, path = topic_datastore(tmp_path, per_topic=20, nlist=4)
    answers = {}
    for host_cache_mb in (None, 0.01):
        configured = settings(retrieval={"datastore": str(path), "host_cache_mb": host_cache_mb, "device": "cpu"})
        retriever = open_configured_retriever(load(path, embedder), embedder, configured.retrieval)
        runtime = Runtime(
            settings=configured,
            engine=ScriptedEngine(lambda prompt: Reply("an answer")),
            retriever=retriever,
            datastore_info=retriever.datastore_info(),
            cache_stats=retriever.cache_stats,
            closers=[retriever.close],
        )
        app = create_app(configured)
        start_serving(app, runtime)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                ready = (await client.get("/ready")).json()["datastore"]
                answer = await client.post("/v1/rag/query", json={"query": "river water boat fish", "top_k": 5})
                cache = (await client.get("/ready")).json()["cache"]
                metrics = (await client.get("/metrics")).text
            assert answer.status_code == 200, answer.text
            read_for_scans = f"telerag_disk_bytes_read_for_scans_total {float(cache['bytes_read_for_scans'])}"
            assert read_for_scans in metrics.splitlines(), "the metrics and /ready count the same reads"
            found = answer.json()["documents"]
            answers[host_cache_mb] = (np.array([d["id"] for d in found]), np.array([d["score"] for d in found], np.float32))
            assert ready["vectors"] == ("memory-mapped" if host_cache_mb is None else "read from disk")
            if host_cache_mb:
                assert 0 < ready["cache_bytes"] <= 0.01 * 2**20  # at most the budget (and the datastore)
                assert cache["bytes_copied"] + cache["bytes_read_for_scans"] > 0, "the lists searched were read from disk"
            else:
                assert cache["bytes_read_for_scans"] == 0, "a memory-mapped datastore reads nothing from disk itself"
        finally:
            retriever.close()
    assert same_results(*answers[0.01], *answers[None])  # the same documents (of tied scores, any may be kept)


def load(path, embedder):
    from telerag.pipelines.datastores import load_datastore

    return load_datastore(path, embedder)


def test_host_cache_mb_is_the_cache_on_the_cpu_and_the_host_tier_under_a_device_cache():
    from telerag.config.settings import RetrievalSettings
    from telerag.server.process.runtime import cluster_cache_bytes, host_tier_bytes

    retrieval = RetrievalSettings(host_cache_mb=64, cache_mb=128)
    assert (cluster_cache_bytes(retrieval, "cpu"), host_tier_bytes(retrieval, "cpu")) == (64 << 20, 0)
    assert (cluster_cache_bytes(retrieval, "cuda"), host_tier_bytes(retrieval, "cuda")) == (128 << 20, 64 << 20)
    assert host_tier_bytes(RetrievalSettings(cache_mb=128), "cuda") == 0  # memory-mapped: no host tier


def test_a_searchs_reads_go_before_the_prefetch_reads_still_queued():
    """One reader busy, a prefetch's reads queued: a search's read, queued after them, runs first."""
    import threading

    from telerag.retrieval.file_reads import ReadPool

    pool, order, busy = ReadPool(1), [], threading.Event()
    first = pool.submit(ReadPool.AHEAD, lambda: busy.wait(5))
    ahead = [pool.submit(ReadPool.AHEAD, lambda i=i: order.append(f"ahead {i}")) for i in range(2)]
    search = pool.submit(ReadPool.SEARCH, lambda: order.append("search"))
    failing = pool.submit(ReadPool.SEARCH, lambda: 1 / 0)
    busy.set()
    for read in (first, *ahead, search):
        read.done.result(5)
    with pytest.raises(ZeroDivisionError):
        failing.done.result(5)  # a read's error reaches whoever waits on it
    pool.shutdown()
    assert order == ["search", "ahead 0", "ahead 1"]


def test_a_landed_read_does_not_keep_what_it_read_into_alive(tmp_path):
    """A search's part of lists is freed once scanned, not when the garbage collector next runs:
    the reads that landed hold no reference to their buffer (a datastore larger than memory
    reads many such parts a search)."""
    import gc
    import weakref

    ds = random_datastore(tmp_path / "ds", n=1000, nlist=8)
    rows = FileRows(ds)
    gc.disable()
    try:
        out = np.empty((100, ds.dim), dtype=np.float32)
        arrival = rows.read_rows(out, [(0, 0, 100)])
        arrival.wait()
        alive = weakref.ref(out)
        del out
        assert alive() is None and arrival.landed()
    finally:
        gc.enable()
        rows.close()


def test_a_prefetch_read_a_search_waits_on_goes_before_the_rest_and_runs_once():
    """A prefetch's reads queued behind a busy reader; a search comes to wait on the last of them:
    it is hastened past the others, after the search's own reads already queued, and read once."""
    import threading

    from telerag.retrieval.file_reads import FileArrival, ReadPool

    pool, order, busy = ReadPool(1), [], threading.Event()
    first = pool.submit(ReadPool.AHEAD, lambda: busy.wait(5))
    ahead = [pool.submit(ReadPool.AHEAD, lambda i=i: order.append(f"ahead {i}")) for i in range(3)]
    search = pool.submit(ReadPool.SEARCH, lambda: order.append("search"))
    waited = FileArrival(pool, [ahead[2]])
    waited.hasten()
    busy.set()
    waited.wait()
    for read in (first, *ahead, search):
        read.done.result(5)
    pool.shutdown()
    assert order == ["search", "ahead 2", "ahead 0", "ahead 1"]
    waited.hasten()  # landed: nothing queued again
