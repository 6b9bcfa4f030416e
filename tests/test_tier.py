"""The retrieval tier on a local Ray cluster: shards deployed as Serve applications and searched
through their handles equal one faiss index; a replica killed mid-load loses no search; a shard
that never answers fails the search whole (503), never with a partial top-k; `telerag bench
tier`. One module, so that one worker runs one Ray cluster at a time."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from telerag.cli.main import main
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.documents import DocumentDelete
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.errors import GenerationGone, TierBusy, TierUnavailable
from telerag.retrieval.ivf import CPUIndex, faiss, same_results
from telerag.retrieval.live import LiveDatastore
from telerag.retrieval.snapshot import search_snapshot
from telerag.server.ray_serve.tier import APP, RetrievalTier, TierShape, deploy_tier
from tests.retrieval_helpers import random_datastore, random_queries
from tests.test_live_datastore import Reference, passage_datastore, unit_vectors, upsert

ray = pytest.importorskip("ray", reason="the retrieval tier needs the `ray` extra")
serve = pytest.importorskip("ray.serve")


def searches(index: CPUIndex, n: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(queries, lists, list scores) as a cooperative search's CPU half gets them: each query's
    nearest lists at some nprobe, some entries -1 (lists the device scans)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        q = random_queries(int(rng.integers(1, 9)), index.datastore.dim, seed=seed * 1000 + i)
        list_scores, lists = index.probe(q, int(rng.integers(1, index.nlist + 1)))
        yield q, np.where(rng.random(lists.shape) < 0.2, -1, lists), list_scores


def assert_same(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray]) -> None:
    for i in range(len(want[0])):
        assert same_results(got[1][i], got[0][i], want[1][i], want[0][i]), (i, got[1][i], want[1][i])


class FailingCall:
    def __init__(self, handle: FakeHandle) -> None:
        self.handle = handle

    def result(self, timeout_s: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError

        self.handle.calls += 1
        if self.handle.busy:
            raise BackPressureError(num_queued_requests=1, max_queued_requests=1)
        if self.handle.failures > 0:
            self.handle.failures -= 1
            raise RayActorError()
        if self.handle.gone > 0:  # a replica started after the switch away from the search's generation
            self.handle.gone -= 1
            raise GenerationGone("generation 0 is not held here")
        return self.handle.answer


class FakeHandle:
    """A shard's handle whose first `failures` calls fail as a dead replica's do."""

    def __init__(self, answer: tuple[np.ndarray, np.ndarray], failures: int = 0, busy: bool = False, gone: int = 0) -> None:
        self.answer, self.failures, self.busy, self.gone, self.calls = answer, failures, busy, gone, 0
        self.search_lists = self

    def remote(self, *args: object) -> FailingCall:
        return FailingCall(self)


def test_a_failed_shard_call_is_asked_again_and_one_that_never_answers_fails_the_search_whole():
    k = 3
    part = (np.array([[0.9, 0.5, 0.1]], dtype=np.float32), np.array([[4, 2, 7]]))
    other = (np.array([[0.8, 0.7, 0.0]], dtype=np.float32), np.array([[1, 3, 5]]))
    args = (np.zeros((1, 4), dtype=np.float32), k, np.zeros((1, 2), dtype=np.int64), np.zeros((1, 2), dtype=np.float32))
    flaky = FakeHandle(part, failures=2)
    tier = RetrievalTier([flaky, FakeHandle(other)], attempts=3, retry_wait_s=0)
    scores, ids = tier.search_lists(*args)
    assert ids.tolist() == [[4, 1, 3]] and np.allclose(scores, [[0.9, 0.8, 0.7]])
    assert tier.retries == 2 and flaky.calls == 3
    behind = FakeHandle(part, gone=1)  # the first replica asked lacks the generation: another holds it
    assert RetrievalTier([behind, FakeHandle(other)], attempts=3, retry_wait_s=0).search_lists(*args)[1].tolist() == [[4, 1, 3]]
    assert behind.calls == 2
    dead = RetrievalTier([FakeHandle(part, failures=5), FakeHandle(other)], attempts=3, retry_wait_s=0)
    with pytest.raises(TierUnavailable, match="shard 0 did not answer in 3 attempts"):
        dead.search_lists(*args)
    with pytest.raises(TierBusy, match="shard 1"):
        RetrievalTier([FakeHandle(part), FakeHandle(other, busy=True)], retry_wait_s=0).search_lists(*args)


def test_a_shard_replica_searches_with_its_share_of_the_cores_in_the_thread_that_searches(tmp_path):
    """Serve calls a replica's methods in another thread than its constructor's, and OpenMP's
    thread count is per thread: the replica sets it where it searches."""
    import asyncio

    from telerag.server.ray_serve.tier import ShardReplica

    ds = random_datastore(tmp_path / "ds", n=500, dim=8, nlist=4)
    replica = ShardReplica(str(ds.path), 0, 2, threads=1, verify_checksums=False)
    whole = CPUIndex(ds)
    q, lists, list_scores = next(searches(whole, 1, seed=3))
    seen: list[int] = []

    def search() -> None:
        faiss.omp_set_num_threads(2)  # as a thread of Serve's starts: every core
        got = asyncio.run(replica.search_lists(q, 5, lists, list_scores))
        seen.append(faiss.omp_get_max_threads())
        assert got[0].shape == (len(q), 5)

    worker = threading.Thread(target=search)
    worker.start()
    worker.join()
    assert seen == [1]


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A local Ray cluster with Serve (no HTTP proxy: the tier is called through handles)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing reported to Ray's servers
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(proxy_location="Disabled")
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow
def test_the_deployed_tier_equals_one_faiss_index_with_1_2_and_3_shards(cluster, tmp_path):
    ds = random_datastore(tmp_path / "ds", n=3000, dim=16, nlist=24, empty_lists=1)
    whole = CPUIndex(ds)
    for shards in (1, 2, 3):
        # with 2 shards, each scans its part of the lists with exact early stop (the whole lists' bounds)
        tier = deploy_tier(ds.path, TierShape(shards=shards, cpus_per_replica=0.5, early_stop=shards == 2))
        try:
            for q, lists, list_scores in searches(whole, 25, seed=shards):
                for k in (1, 10):
                    assert_same(tier.search_lists(q, k, lists, list_scores), whole.search_lists(q, k, lists, list_scores))
            # the engine with the tier as its CPU half: faiss's path (no cache) and the cooperative one
            for cache_bytes in (0, ds.vectors.nbytes // 3):
                local = RetrievalEngine(ds, cache_bytes=cache_bytes, nprobe=6)
                remote = RetrievalEngine(ds, cache_bytes=cache_bytes, nprobe=6, cpu_half=tier)
                q = random_queries(8, ds.dim, seed=shards)
                budget = ds.vectors.nbytes
                want = local.search(q, 10, prefetch=local.prefetch(q, budget))
                got = remote.search(q, 10, prefetch=remote.prefetch(q, budget))
                if cache_bytes:  # both halves took part: the device's (the cache) and the tier
                    assert 0 < sum(stats.clusters_cpu for stats in got.per_query) < 8 * 6
                assert_same((got.scores, got.ids), (want.scores, want.ids))
        finally:
            serve.delete(APP)


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 2, 3])
def test_writes_interleaved_with_searches_through_the_tier_equal_faiss(cluster, tmp_path, shards):
    """A writer (the process holding the datastore) and a caller beside it that follows it, as an
    inference replica does, searching through the tier: random upserts and deletes between
    searches, a compaction and a retrain (the shards load each new generation when a search names
    it); every search equals faiss's IndexIVF after the same writes, at the same nprobe."""
    rng = np.random.default_rng(shards)
    ds = passage_datastore(tmp_path / "ds", n=900, nlist=12, seed=shards)
    writer = LiveDatastore(ds, writable=True)
    follower = LiveDatastore(Datastore.load(ds.path))
    reference = Reference(ds, {e.doc_id: e.passage_ids for e in writer.documents(limit=10**6)})
    tier = deploy_tier(ds.path, TierShape(shards=shards, replicas=2 if shards == 2 else 1, cpus_per_replica=0.5))
    engines: dict[int, RetrievalEngine] = {}
    versions: dict[str, int] = {}
    try:
        for step in range(90):
            if step in (30, 60):
                if step == 30:
                    writer.compact()
                else:
                    writer.retrain(nlist=9)
                    reference = reference.retrained(9)
                continue
            if step % 3:
                writes = []
                for _ in range(int(rng.integers(1, 4))):
                    doc_id = f"b{int(rng.integers(0, 300))}" if rng.random() < 0.5 else f"n{int(rng.integers(0, 40))}"
                    if rng.random() < 0.7:
                        versions[doc_id] = versions.get(doc_id, 0) + 1
                        writes.append(upsert(doc_id, unit_vectors(rng, int(rng.integers(1, 4)), ds.dim), versions[doc_id]))
                    else:
                        writes.append(DocumentDelete(doc_id))
                reference.apply(writes, writer.write(writes))
                continue
            snapshot = follower.snapshot()  # what a request beginning now reads: every acknowledged write
            assert snapshot.lsn == writer.snapshot().lsn
            generation = snapshot.datastore
            if generation.generation.number not in engines:
                engines[generation.generation.number] = RetrievalEngine(
                    generation, cache_bytes=generation.vectors.nbytes // 3, cpu_half=tier.at(generation)
                )
            engine = engines[generation.generation.number]
            queries = unit_vectors(rng, int(rng.integers(1, 6)), ds.dim)
            k, nprobe = int(rng.integers(1, 12)), int(rng.integers(1, generation.nlist + 1))
            prefetch = engine.prefetch(queries, int(rng.integers(0, generation.vectors.nbytes // 3)))
            result = search_snapshot(engine, snapshot, queries, k, nprobe, prefetch=prefetch)
            ref_scores, ref_ids = reference.search(queries, k, nprobe)
            for i in range(len(queries)):
                assert same_results(result.ids[i], result.scores[i], ref_ids[i], ref_scores[i]), (step, i)
        assert sorted(engines) == [0, 1, 2]
        newest = CPUIndex(follower.snapshot().datastore)  # a caller naming no generation (a benchmark): the newest
        for q, lists, list_scores in searches(newest, 3, seed=shards):
            assert_same(tier.search_lists(q, 5, lists, list_scores), newest.search_lists(q, 5, lists, list_scores))
    finally:
        serve.delete(APP)
        for engine in engines.values():
            engine.close()
        follower.close()
        writer.close()


@pytest.mark.slow
def test_a_replica_killed_under_load_loses_no_search_and_is_restarted(cluster, tmp_path):
    ds = random_datastore(tmp_path / "ds", n=3000, dim=16, nlist=24)
    whole = CPUIndex(ds)
    tier = deploy_tier(ds.path, TierShape(shards=2, replicas=2, cpus_per_replica=0.5))
    try:
        replicas = serve.status().applications[APP].deployments["shard-0"].replica_states
        assert replicas.get("RUNNING") == 2, replicas
        results: list[tuple] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def load() -> None:
            try:
                for q, lists, list_scores in searches(whole, 400, seed=9):
                    if stop.is_set():
                        break
                    results.append((tier.search_lists(q, 5, lists, list_scores), whole.search_lists(q, 5, lists, list_scores)))
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

        worker = threading.Thread(target=load)
        worker.start()
        while len(results) < 20 and worker.is_alive():
            threading.Event().wait(0.05)
        actors = ray.util.list_named_actors(all_namespaces=True)
        victim = next(a for a in actors if "shard-0" in a["name"] and "REPLICA" in a["name"])
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
        killed_at = len(results)
        while len(results) < killed_at + 40 and worker.is_alive():
            threading.Event().wait(0.05)
        stop.set()
        worker.join(timeout=120)
        assert not errors, errors
        assert len(results) >= killed_at + 40
        for got, want in results:
            assert_same(got, want)
        for _ in range(120):  # Serve starts a replacement
            replicas = serve.status().applications[APP].deployments["shard-0"].replica_states
            if replicas.get("RUNNING") == 2:
                break
            threading.Event().wait(0.5)
        assert replicas.get("RUNNING") == 2, replicas
    finally:
        serve.delete(APP)


@pytest.mark.slow
def test_bench_tier_times_the_tier_against_faiss_and_prints_a_table_and_one_json_line(cluster, tmp_path, capsys):
    """`telerag bench tier` (on the cluster already running: it joins it and leaves it running)."""
    random_datastore(tmp_path / "ds", n=2000, dim=16, nlist=16)
    argv = ["bench", "tier", "--datastore", str(tmp_path / "ds"), "--shards", "1", "2", "--batch", "1", "4"]
    threads = faiss.omp_get_max_threads()
    assert main([*argv, "--searches", "4", "--cpus-per-replica", "0.5", "--faiss-threads", "1", "--json"]) == 0
    assert faiss.omp_get_max_threads() == threads  # this process's faiss given back as it was
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert report["nlist"] == 16 and report["n_vectors"] == 2000 and report["faiss_threads"] == 1
    assert [(row["shards"], row["batch"]) for row in report["rows"]] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    for row in report["rows"]:
        assert row["same_documents"] == 1.0 and row["searches"] == 4
        assert row["remote_overhead"] == pytest.approx(row["tier_ms_p50"] / row["local_ms_p50"])
    assert lines[1].split() == [
        "shards",
        "batch",
        "searches",
        "faiss",
        "p50",
        "ms",
        "tier",
        "p50",
        "ms",
        "tier",
        "p99",
        "ms",
        "remote_overhead",
        "same_documents",
    ]
    assert len(lines) == 2 + 4 + 1
    assert ray.is_initialized() and serve.status().applications.get(APP) is None  # the cluster left, the tier gone


def test_bench_tier_without_ray_says_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(SystemExit, match=r"needs Ray Serve: pip install 'telerag\[ray\]'"):
        main(["bench", "tier", "--datastore", str(tmp_path)])


def test_bench_tier_refuses_a_missing_datastore_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"no datastore at .*build it first"):
        main(["bench", "tier", "--datastore", str(tmp_path / "none")])


@pytest.mark.slow
def test_bench_sizing_models_both_tiers_from_their_measured_latencies(cluster, tmp_path, capsys):
    """`telerag bench sizing` with the tiny LLM over a small datastore of the tiny embedder, on
    the cluster already running: Chameleon's throughputs and the best split of the budget."""
    from telerag.pipelines.embedder import Embedder
    from telerag.retrieval.builder import build_datastore
    from telerag.retrieval.corpus import Article, split_passages
    from tests.tiny_models import tiny_embedder_dir

    embedder = Embedder(tiny_embedder_dir(32, 0))
    articles = [
        Article(id=f"a{i}", title=f"Article {i}", text=f"Article {i} tells about topic {i % 5}. " * 12) for i in range(40)
    ]
    build_datastore(
        split_passages(articles), embedder.encode, embedder=embedder.name, out_dir=tmp_path / "ds", nlist=8, progress=False
    )
    argv = ["bench", "sizing", "--tiny", "--embedder", str(tiny_embedder_dir(32, 0)), "--datastore", str(tmp_path / "ds")]
    argv += ["--device", "cpu", "--batch", "1", "2", "--requests", "2", "--searches", "4", "--max-tokens", "2", "--budget", "9"]
    assert main([*argv, "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert (report["shards"], report["budget"], report["llm"]) == (2, 9, "tiny-random")
    assert [row["batch"] for row in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert row["searches_per_request"] == 1.0 and row["inference_ms"] > 0 and row["retrieval_ms"] > 0
        assert row["inference_replicas"] + 2 * row["shard_replicas"] <= 9
        rates = (row["inference_replicas"] * row["inference_rps"], row["shard_replicas"] * row["retrieval_rps"])
        assert row["throughput_rps"] == pytest.approx(min(rates))
    assert lines[1].split()[:4] == ["batch", "s", "L_I", "ms"] and len(lines) == 2 + 2 + 1
    assert ray.is_initialized() and serve.status().applications.get(APP) is None  # the cluster left, the tier gone
