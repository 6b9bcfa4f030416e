"""`telerag serve --ray` on a local Ray cluster: the ingress (the same HTTP API) in front of two
inference replicas that search through a retrieval tier of two shards, with the tiny test model
and embedder over a datastore of topics. `telerag bench cluster` routes a stream with topic
locality through new replicas per router (the cluster router hits the caches more than Ray's
default) and serves the one-process server's documents; SSE streams, `/ready` and `/metrics`
cover both tiers and every replica, a routing key keeps a replica, a full ingress answers 429,
and a replica killed under load loses no accepted request silently. One module, so that one
worker runs one Ray cluster at a time; the bench runs first and leaves the cluster router's
replicas to the other tests (which deploy their own when run alone)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from telerag.config.settings import Settings
from telerag.retrieval.builder import build_datastore
from telerag.retrieval.corpus import Article, split_passages
from telerag.server.app import create_app, start_serving
from telerag.utils.processes import free_port
from tests.document_stream import DocumentStream
from tests.serving import save_tiny_lm
from tests.tiny_models import tiny_embedder_dir

ray = pytest.importorskip("ray", reason="the cluster needs the `ray` extra")
serve = pytest.importorskip("ray.serve")

pytestmark = [pytest.mark.slow, pytest.mark.minutes(4)]  # about 4 min in CI, the bench half of it

TOPICS = 24
WORDS = [
    "river",
    "mountain",
    "city",
    "music",
    "science",
    "history",
    "art",
    "king",
    "war",
    "ship",
    "school",
    "church",
    "island",
    "forest",
    "bridge",
    "garden",
    "castle",
    "train",
    "market",
    "temple",
    "desert",
    "village",
    "harbour",
    "tower",
    "library",
    "museum",
    "theatre",
    "factory",
    "planet",
    "ocean",
    "battle",
    "empire",
    "poet",
    "painter",
    "engine",
    "festival",
    "saint",
    "queen",
    "village",
    "valley",
    "glacier",
    "canal",
]


def topic_words(topic: int) -> list[str]:
    return [WORDS[(topic * 7 + j * 3) % len(WORDS)] for j in range(6)]


def build_topic_datastore(out_dir: Path, embedder_dir: Path) -> Path:
    """Articles of `TOPICS` topics, each topic's words its own: questions of one topic land in
    the same few of the datastore's 24 lists. Each passage has a word of its own, so that no two
    passages are alike (tied scores could be served in either order)."""
    from telerag.pipelines.embedder import Embedder

    articles = [
        Article(
            id=f"t{t}-{a}",
            title=f"Topic {t} article {a}",
            text=" ".join(word for k in range(2) for word in [f"{t}x{a}x{k}", *(topic_words(t) * 5)[:29]]),
        )
        for t in range(TOPICS)
        for a in range(6)
    ]
    embedder = Embedder(embedder_dir)
    passages = split_passages(articles, passage_words=30)
    return build_datastore(passages, embedder.encode, embedder=embedder.name, out_dir=out_dir, nlist=24, progress=False)


def question(topic: int, n: int) -> str:
    words = topic_words(topic)
    return f"what about {words[n % 6]} and {words[(n + 2) % 6]}?"


def tiny_cluster_settings(root: Path, *, retrieval: dict, scheduler: dict, cluster: dict) -> Settings:
    """The tiny test model and embedder over the topic datastore, under `root`, on the CPU, with no
    warm-up, no admission measurements kept, no admission deadline and a 60-s request timeout; `retrieval`, `scheduler` and
    `cluster` the rest of those sections."""
    embedder = tiny_embedder_dir(32, 0)
    return Settings(
        engine={"model_path": save_tiny_lm(root / "lm"), "device": "cpu", "prefix_cache_mb": 0},
        retrieval={
            "datastore": build_topic_datastore(root / "ds", embedder),
            "embedder": embedder,
            "device": "cpu",
            "embedder_device": "cpu",
            "build_if_missing": False,
            **retrieval,
        },
        scheduler={"admission_deadline_s": None, "request_timeout_s": 60, **scheduler},
        server={"warm_up": False, "calibration_dir": None},
        cluster=cluster,
    )


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> Settings:
    return tiny_cluster_settings(
        tmp_path_factory.mktemp("cluster"),
        retrieval={
            "cache_mb": 0.012,  # a third of the lists per replica
            "prefetch_budget_mb": 0.003,  # one to three lists: a question's other lists hit only where they are resident
            "nprobe": 4,
        },
        scheduler={"max_concurrency": 2, "max_queue": 2},
        cluster={"replicas": 2, "shards": 2, "replica_cpus": 0.5, "shard_cpus": 0.5, "routing_stats_period_s": 0.2},
    )


@pytest.fixture(scope="module")
def cluster(settings) -> Iterator[str]:
    """The local Ray cluster with Serve's proxy on a free port and the retrieval tier; its URL."""
    from telerag.server.ray_serve.applications import tier_shape
    from telerag.server.ray_serve.tier import deploy_tier

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        deploy_tier(settings.retrieval.datastore, tier_shape(settings))
        yield f"http://127.0.0.1:{port}"
    finally:
        ray.shutdown()  # Serve and its applications with it


@pytest.fixture(scope="module")
def url(cluster, settings) -> str:
    """The inference application with the cluster router, and the tier: those the bench left, or new
    ones (a bench with writes deletes its own, over its copy of the datastore)."""
    from telerag.server.ray_serve.applications import APP, deploy_inference, tier_shape
    from telerag.server.ray_serve.tier import APP as TIER_APP
    from telerag.server.ray_serve.tier import deploy_tier

    applications = serve.status().applications
    if TIER_APP not in applications:
        deploy_tier(settings.retrieval.datastore, tier_shape(settings))
    if APP not in applications:
        deploy_inference(settings)
    wait_ready(cluster)
    return cluster


def wait_ready(base: str) -> None:
    deadline = time.monotonic() + 120
    while (ready := httpx.get(f"{base}/ready", timeout=10)).status_code != 200:
        assert time.monotonic() < deadline, ready.text
        time.sleep(0.2)


async def one_process_documents(settings: Settings, questions: list[str]) -> list[list[int]]:
    """What the one-process server serves for `questions` (its app in process, the same settings)."""
    from telerag.server.process.runtime import open_runtime

    local = settings.model_copy(update={"cluster": settings.cluster.model_copy(update={"shards": 0})})
    async with open_runtime(local) as runtime:
        app = create_app(local)
        start_serving(app, runtime)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60) as client:
            served = []
            for text in questions:
                response = await client.post("/v1/rag/query", json={"query": text, "pipeline": "hyde", "max_tokens": 8})
                assert response.status_code == 200, response.text
                served.append([d["id"] for d in response.json()["documents"]])
            return served


def test_bench_cluster_routes_by_clusters_and_serves_the_one_process_servers_documents(cluster, settings, tmp_path, capsys):
    """The same stream (24 runs of 3 questions about one of 16 topics, a fifth repeats, seeded)
    one request at a time through new replicas (cold caches of a third of the lists) per router,
    Ray's default first: a question's lists beyond the one or two its prefetch copies hit only
    where the router sent it to the replica holding them. Every request's documents equal the
    one-process server's. (With one list prefetched the two routers tied, 0.604 each: the caches
    then hold little beyond what each question copies for itself.)"""
    from telerag.cli.main import main

    questions = tmp_path / "questions.txt"
    questions.write_text("".join(f"{question(t, n)} [Topic {t}]\n" for t in range(16) for n in range(3)), encoding="utf-8")
    config = tmp_path / "settings.yaml"
    config.write_text(yaml.safe_dump(settings.model_dump(mode="json")), encoding="utf-8")
    port = cluster.rsplit(":", 1)[1]
    argv = ["bench", "cluster", "--config", str(config), "--questions", str(questions), "--port", port, "--json"]
    argv += ["--routers", "default", "cluster", "--batch", "1", "--runs", "24", "--seed", "3", "--tier-searches", "5"]
    assert main([*argv, "--cache-mb", "0.012", "--prefetch-budget-mb", "0.003"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert [(row["router"], row["batch"]) for row in report["rows"]] == [("default", 1), ("cluster", 1)]
    for row in report["rows"]:
        assert (row["replicas"], row["shards"], row["requests"]) == (2, 2, 72) and report["requests"] == 72
        assert row["same_documents"] == 1.0 and row["bytes_copied"] > 0 and row["remote_overhead"] > 0
        assert row["refused"] == 0  # one request at a time: nothing waits behind a full ingress
        assert row["latency_ms_p99"] >= row["latency_ms_p50"] > 0 and row["throughput_rps"] > 0
    rates = {row["router"]: row["cache_hit_rate"] for row in report["rows"]}
    print(f"cache hit rate: cluster router {rates['cluster']:.3f}, default router {rates['default']:.3f}")
    assert rates["cluster"] > rates["default"], rates
    assert report["writes"] == []  # (the write rows: tests/test_multinode.py, on three nodes)
    assert lines[1].split()[:5] == ["router", "replicas", "shards", "nodes", "batch"] and len(lines) == 2 + 2 + 1
    assert report["nodes"] == 1 and {row["nodes"] for row in report["rows"]} == {1}  # a local Ray: one node


def test_served_documents_equal_the_one_process_servers_and_the_answer_streams(url, settings):
    questions = [question(t, n) for t in (0, 5, 11, 17) for n in range(2)]
    served = []
    for text in questions:
        response = httpx.post(f"{url}/v1/rag/query", json={"query": text, "pipeline": "hyde", "max_tokens": 8}, timeout=60)
        assert response.status_code == 200, response.text
        served.append([d["id"] for d in response.json()["documents"]])
    assert served == asyncio.run(one_process_documents(settings, questions))
    streamed = {"query": questions[0], "pipeline": "hyde", "stream": True, "max_tokens": 8}
    with httpx.stream("POST", f"{url}/v1/rag/query", json=streamed, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        blocks = "".join(response.iter_text()).strip().split("\n\n")
    events = [block.split("\n")[0].removeprefix("event: ") for block in blocks]
    assert events[0] == "stage" and "token" in events and events[-1] == "result", events
    result = json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))
    assert [d["id"] for d in result["documents"]] == served[0]


def test_the_openai_routes_and_the_pipelines_are_served(url):
    pipelines = httpx.get(f"{url}/v1/pipelines", timeout=10).json()["pipelines"]
    assert {p["name"] for p in pipelines} >= {"naive", "hyde"}
    chat = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "naive", "max_tokens": 4, "messages": [{"role": "user", "content": question(3, 0)}]},
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["object"] == "chat.completion" and chat.json()["documents"]


def test_ready_reports_both_tiers_and_metrics_every_replica(url):
    ready = httpx.get(f"{url}/ready", timeout=10).json()
    tiers = {(t["tier"], t["deployment"]): t["running"] for t in ready["tiers"]}
    assert tiers == {
        ("ingress", "ingress"): 1,
        ("inference", "inference"): 2,
        ("retrieval", "shard-0"): 1,
        ("retrieval", "shard-1"): 1,
    }
    assert ready["ready"] and ready["engine"] and ready["datastore"]["nlist"] == 24
    deadline = time.monotonic() + 30  # each replica reports every routing_stats_period_s, later on a busy machine
    while True:
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        replicas = {line.split('replica="')[1].split('"')[0] for line in metrics.splitlines() if 'replica="' in line}
        if len(replicas) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(replicas) == 2
    assert 'telerag_routing_decisions_total{rule="clusters"}' in metrics
    for replica in replicas:
        assert f'telerag_cache_capacity_bytes{{replica="{replica}"}}' in metrics
    assert metrics.count("# TYPE telerag_request_seconds histogram") == 1  # the ingress's and the replicas' in one family


def kill_replica(deployment: str) -> dict:
    """One replica of the `telerag` application's `deployment` killed (Serve starts another): its
    actor's name and namespace."""
    victim = next(a for a in ray.util.list_named_actors(all_namespaces=True) if f"#{deployment}#" in a["name"])
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    return victim


def served_by(url: str, since: dict[str, float] | None = None, requests: int = 0) -> dict[str, float]:
    """Requests each replica has finished (its telerag_request_seconds_count, all pipelines), once
    the replicas' reports (every routing_stats_period_s, later on a busy machine) count at least
    `requests` more than `since`."""
    deadline = time.monotonic() + 30
    while True:
        time.sleep(0.6)  # a report or two
        counts: dict[str, float] = {}
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("telerag_request_seconds_count") and 'replica="' in line:
                replica = line.split('replica="')[1].split('"')[0]
                counts[replica] = counts.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
        grown = sum(count - (since or {}).get(replica, 0.0) for replica, count in counts.items())
        if grown >= requests or time.monotonic() > deadline:
            return counts


def test_a_routing_key_keeps_its_replica(url):
    before = served_by(url)
    for n in range(6):
        response = httpx.post(
            f"{url}/v1/rag/query",
            json={"query": question(n, n), "max_tokens": 4},
            headers={"X-Routing-Key": "tenant-7"},
            timeout=60,
        )
        assert response.status_code == 200, response.text
    after = served_by(url, before, 6)
    grown = sorted(after[r] - before.get(r, 0.0) for r in after)
    assert grown[-1] == 6 and sum(grown) == 6, (before, after)


def test_a_full_ingress_answers_429_with_retry_after(url):
    """2 replicas x (2 running + 2 waiting) admitted; the rest of a burst of 20 refused at once."""

    def ask(i: int) -> httpx.Response:
        return httpx.post(f"{url}/v1/rag/query", json={"query": question(i, i), "max_tokens": 48}, timeout=60)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(20) as pool:
        responses = list(pool.map(ask, range(20)))
    refused = [r for r in responses if r.status_code == 429]
    assert refused and all(r.status_code in (200, 429) for r in responses)
    assert len(responses) - len(refused) >= 8
    for response in refused:
        assert int(response.headers["Retry-After"]) >= 1 and response.json()["error"]["code"] == "queue_full"


def test_a_replica_killed_under_load_loses_no_accepted_request(url):
    """Every request answered whole (200 with its result), or refused or failed in the one error
    body (429, 503); Serve starts a replacement."""
    outcomes: list[tuple[int, dict]] = []
    stop = threading.Event()

    def load(worker: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            response = httpx.post(
                f"{url}/v1/rag/query", json={"query": question(worker * 5 + n, n), "max_tokens": 16}, timeout=60
            )
            outcomes.append((response.status_code, response.json()))

    workers = [threading.Thread(target=load, args=(w,)) for w in range(3)]
    for worker in workers:
        worker.start()
    while len(outcomes) < 6:
        time.sleep(0.05)
    victim = kill_replica("inference")
    killed_at = len(outcomes)
    while len(outcomes) < killed_at + 12:
        time.sleep(0.05)
    stop.set()
    for worker in workers:
        worker.join(60)
    for status, body in outcomes:
        if status == 200:
            assert body["answer"] is not None and body["documents"], body
        else:
            assert status in (429, 503) and set(body["error"]) >= {"type", "message", "code"}, (status, body)
    assert sum(status == 200 for status, _ in outcomes[killed_at:]) >= 6
    from telerag.server.ray_serve.applications import APP

    def replaced() -> bool:  # two running, the killed one not among them
        alive = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#inference#" in a["name"]}
        running = serve.status().applications[APP].deployments["inference"].replica_states.get("RUNNING")
        return running == 2 and len(alive) == 2 and victim["name"] not in alive

    for _ in range(120):
        if replaced():
            break
        time.sleep(0.5)
    assert replaced()


def test_a_document_written_through_the_ingress_is_found_through_every_replica_and_deleted(url):
    """The ingress writes the datastore (its one writer); each replica's next request finds the
    document (the replicas follow the writer's log), and a delete is seen by each as well.
    Last in the module: the document changes what later searches would find."""
    text = "zebra quasar lantern orchard violin harbour pumpkin glacier"
    created = httpx.post(f"{url}/v1/documents", json={"id": "zebra-notes", "text": text, "title": "Zebra notes"}, timeout=60)
    assert created.status_code in (200, 201), created.text
    assert httpx.get(f"{url}/v1/documents/zebra-notes", timeout=10).status_code == 200

    def found_by_each_replica() -> list[bool]:
        before, found = served_by(url), []
        for n in range(8):  # keys spread over both replicas
            response = httpx.post(
                f"{url}/v1/rag/query",
                json={"query": text, "pipeline": "naive", "max_tokens": 4},
                headers={"X-Routing-Key": f"writer-{n}"},
                timeout=60,
            )
            assert response.status_code == 200, response.text
            found.append("zebra-notes" in [d["doc_id"] for d in response.json()["documents"]])
        after = served_by(url, before, 8)
        assert sum(after[r] - before.get(r, 0.0) > 0 for r in after) == 2, (before, after)  # both replicas answered
        return found

    assert all(found_by_each_replica())
    assert httpx.delete(f"{url}/v1/documents/zebra-notes", timeout=60).status_code == 200
    assert not any(found_by_each_replica())


def test_the_writer_killed_under_a_stream_of_writes_loses_nothing_acknowledged(url):
    """The ingress (the datastore's one writer) killed while a client writes document after
    document: Serve starts it again, it opens the log again (a record it was appending, never
    acknowledged, cut off), and every write acknowledged before the kill or after is there, and
    found by a replica's search."""
    stream = DocumentStream(url, repeats=12, timeout_s=30).start()
    assert stream.wait_for(5, 120)
    kill_replica("ingress")
    killed_at = len(stream.acknowledged)
    # writes acknowledged again: a new ingress serves
    assert stream.wait_for(killed_at + 5, 120), f"no write acknowledged after the kill ({killed_at} before it)"
    assert stream.stop()
    wait_ready(url)
    assert stream.missing() == []
    assert stream.last_found(["after"]) == [True]
    for doc_id in stream.acknowledged:  # the module's datastore as it was
        httpx.delete(f"{url}/v1/documents/{doc_id}", timeout=30)
