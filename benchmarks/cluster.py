"""`telerag bench cluster`: the same question stream through the one-process server
and through the tiers on Ray Serve (`server.ray_serve.applications`: N inference replicas, S retrieval shards),
once per request router and batch, each run on new replicas (cold cluster caches of the same
size for both routers).

The stream has topic locality and repeats, as users' questions do: runs of questions about one
article (its own questions from the questions file, then questions about its title), the
articles in a seeded order, and a share of requests that re-ask an earlier question. A router
that sends a question to the replica already holding its clusters finds them resident; one that
ignores them copies them again. Per run: latency and throughput as the client sees them over
HTTP, the replicas' cache hit rate (hits over searched clusters, their `/metrics` summed) and
bytes copied into their caches, `same_documents` (the share of requests whose documents equal
the one-process server's for the same question) and `remote_overhead` (a tier search's time
over faiss's here, same lists: `benchmarks.tier.measure_tier`).

With a write rate (`--write-rate`), each batch's stream runs once more, on the last router's
replicas, beside a client writing documents through the ingress (the datastore's one writer) at
that rate: each write's acknowledgment is timed, and right after it a query through the ingress
for the written text checks that a replica's search finds it (freshness: from the acknowledgment
to the start of the first query that found it, 0 when the first did; a query admission refused
was not asked, and is asked again after its Retry-After). The bench then runs on a
copy of the datastore (the user's is never written).

On one small machine every replica shares the same cores: the figures show the overhead, the
routing and the correctness, not scaling. The module is long because the stream, its clients
(questions and writes) and the report's rows are one run, timed side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from telerag.config.settings import Settings
from telerag.pipelines.questions import Question

ROUTERS = ("cluster", "default")
FRESHNESS_POLL_S = 5.0  # how long a write not found at once is asked for again, before it counts as never
TITLE_QUESTIONS = ("Tell me about {}.", "What is {} known for?", "Why is {} notable?")  # a run longer than an article's own


@dataclass(frozen=True)
class StreamShape:
    runs: int = 12  # articles, in a seeded order (an article may come back)
    run_length: int = 3  # questions about one article in a row
    repeat_rate: float = 0.2  # share of requests that re-ask an earlier question of the stream
    seed: int = 0


def topic_stream(questions: Sequence[Question], shape: StreamShape) -> list[str]:
    """The questions, grouped by article and in runs of `run_length`, with repeats."""
    by_article: dict[str, list[str]] = {}
    for question in questions:
        by_article.setdefault(question.title or question.text, []).append(question.text)
    rng = random.Random(shape.seed)
    articles = sorted(by_article)
    stream: list[str] = []
    for _ in range(shape.runs):
        title = rng.choice(articles)
        own = by_article[title]
        run = (own + [template.format(title) for template in TITLE_QUESTIONS])[: max(shape.run_length, len(own))]
        rng.shuffle(run)
        for text in run[: shape.run_length]:
            stream.append(rng.choice(stream) if stream and rng.random() < shape.repeat_rate else text)
    return stream


@dataclass(frozen=True)
class ClusterBenchConfig:
    stream: StreamShape = StreamShape()
    routers: tuple[str, ...] = ROUTERS
    batches: tuple[int, ...] = (1, 4)  # clients in flight
    pipeline: str = "naive"
    max_tokens: int = 8
    tier_searches: int = 30  # per batch, for remote_overhead
    write_rate: float = 0.0  # documents a second written beside each batch's stream once more; 0: no write rows


@dataclass(frozen=True)
class ClusterRow:
    router: str
    replicas: int
    shards: int
    nodes: int  # the Ray nodes this run's replicas (every deployment of both applications) ran on
    batch: int
    requests: int
    latency_ms_p50: float
    latency_ms_p99: float
    throughput_rps: float
    cache_hit_rate: float | None  # None: no cluster cache (cache_mb 0)
    bytes_copied: int  # into the replicas' caches over the run
    same_documents: float  # share of requests whose documents equal the one-process server's
    remote_overhead: float | None  # a tier search over faiss here, same lists; None without shards
    refused: int  # 429s answered before requests were admitted (retried after Retry-After)


@dataclass(frozen=True)
class ClusterWriteRow:
    """A batch's stream beside a stream of writes through the ingress (on the last router's replicas)."""

    router: str
    batch: int
    requests: int
    latency_ms_p50: float  # the stream's, with the writes
    latency_ms_p99: float
    latency_ms_p50_alone: float  # the same router and batch's row, without
    writes: int
    ack_ms_p50: float  # a write's answer, its embedding and the log's sync inside
    ack_ms_p99: float
    fresh_ms_p50: float | None  # from the acknowledgment to the first query that found it (0: the first did)
    fresh_ms_p99: float | None
    never_found: int  # writes no query found within FRESHNESS_POLL_S


@dataclass
class ClusterReport:
    datastore: str
    pipeline: str
    questions: int  # distinct questions in the stream
    requests: int
    cache_mb: float  # each replica's cluster cache (the one-process server's too)
    prefetch_budget_mb: float | None
    one_process_latency_ms_p50: float  # the same questions one at a time through the one-process server
    nodes: int = 1  # the Ray cluster's, alive at the start
    rows: list[ClusterRow] = field(default_factory=list)
    writes: list[ClusterWriteRow] = field(default_factory=list)


@dataclass(frozen=True)
class Answer:
    latency_ms: float  # from the first try to the answer, waits after refusals included
    documents: tuple[int, ...]
    refused: int  # 429s before it was admitted (each waited its Retry-After, as a client does)


async def ask(client: httpx.AsyncClient, text: str, config: ClusterBenchConfig) -> Answer:
    started, refused = time.perf_counter(), 0
    body = {"query": text, "pipeline": config.pipeline, "max_tokens": config.max_tokens}
    while (response := await client.post("/v1/rag/query", json=body)).status_code == 429:
        refused += 1
        await asyncio.sleep(float(response.headers.get("Retry-After", 1)))
    response.raise_for_status()
    return Answer((time.perf_counter() - started) * 1e3, tuple(d["id"] for d in response.json()["documents"]), refused)


async def closed_loop(
    client: httpx.AsyncClient, stream: Sequence[str], batch: int, config: ClusterBenchConfig
) -> tuple[list[Answer], float]:
    """`batch` clients, each sending the stream's next question when its last is answered:
    each request's answer in stream order, and the wall time in seconds."""
    answers: list[Answer | None] = [None] * len(stream)
    pending = iter(range(len(stream)))

    async def worker() -> None:
        for i in pending:
            answers[i] = await ask(client, stream[i], config)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(batch)))
    return [a for a in answers if a is not None], time.perf_counter() - started


@dataclass(frozen=True)
class Written:
    ack_ms: float
    fresh_ms: float | None  # None: no query found it within FRESHNESS_POLL_S


async def write_stream(client: httpx.AsyncClient, rate: float, done: asyncio.Event, config: ClusterBenchConfig) -> list[Written]:
    """Documents written one at a time at `rate` a second until `done`, each one's freshness asked
    right after its acknowledgment."""
    written: list[Written] = []
    while not done.is_set():
        n = len(written)
        text = f"benchmark write {n} " + " ".join(f"w{n}x{k}" for k in range(24))
        started = time.perf_counter()
        response = await client.post("/v1/documents", json={"id": f"bench-write-{n}", "text": text, "title": f"write {n}"})
        response.raise_for_status()
        acknowledged = time.perf_counter()
        fresh_ms, first = None, True
        while time.perf_counter() - acknowledged < FRESHNESS_POLL_S:
            asked = time.perf_counter()
            body = {"query": text, "pipeline": config.pipeline, "max_tokens": 1}
            found = await client.post("/v1/rag/query", json=body)
            if found.status_code == 429:  # refused by admission, not asked: its search is still the first
                await asyncio.sleep(float(found.headers.get("Retry-After", 1)))
                continue
            if found.status_code == 200 and f"bench-write-{n}" in [d["doc_id"] for d in found.json()["documents"]]:
                fresh_ms = 0.0 if first else (asked - acknowledged) * 1e3
                break
            first = False
        written.append(Written((acknowledged - started) * 1e3, fresh_ms))
        await asyncio.sleep(max(0.0, 1.0 / rate - (time.perf_counter() - started)))
    return written


async def _stream_with_writes(
    base: str, stream: Sequence[str], batch: int, config: ClusterBenchConfig
) -> tuple[list[Answer], list[Written]]:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        done = asyncio.Event()
        writing = asyncio.create_task(write_stream(client, config.write_rate, done, config))
        try:
            answers, _ = await closed_loop(client, stream, batch, config)
        finally:
            done.set()
        return answers, await writing


async def one_process(
    settings: Settings, stream: Sequence[str], config: ClusterBenchConfig
) -> tuple[dict[str, tuple[int, ...]], float]:
    """The one-process server (its app in process, the same settings without shards): each
    distinct question's documents, and the median latency one at a time."""
    from telerag.server.app import create_app, start_serving
    from telerag.server.process.runtime import open_runtime

    local = settings.model_copy(update={"cluster": settings.cluster.model_copy(update={"shards": 0})})
    async with open_runtime(local) as runtime:
        app = create_app(local)
        start_serving(app, runtime)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://one-process", timeout=600) as client:
            answers = {text: await ask(client, text, config) for text in dict.fromkeys(stream)}
    return {text: a.documents for text, a in answers.items()}, statistics.median(a.latency_ms for a in answers.values())


def replica_sum(metrics: str, name: str) -> float:
    """A series summed over the replicas (their labelled samples)."""
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{") and 'replica="' in line
    )


def wait_ready(base: str, timeout_s: float = 900) -> None:
    """Until `base/ready` answers 200 (a proxy not listening yet is not ready yet); TimeoutError past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/ready", timeout=30).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base}/ready not 200 after {timeout_s:.0f} s")
        time.sleep(0.5)


def run_cluster_bench(
    settings: Settings, questions: Sequence[Question], config: ClusterBenchConfig, *, log: Callable[[str], None] = print
) -> ClusterReport:
    """The one-process reference first, then (on the Ray cluster at RAY_ADDRESS, the one this
    process is connected to, or a local one it starts and stops) the tier once and the inference
    application once per router and batch. It deploys its own `telerag` and `telerag-retrieval`
    applications: not for a cluster that serves users."""
    import ray
    from ray import serve

    from telerag.server.ray_serve.applications import deploy_inference, start_ray

    stream = topic_stream(questions, config.stream)
    copied = None
    if config.write_rate:  # the writes go to a copy: the user's datastore is never written
        settings, copied = _on_a_copy(settings)
    retrieval = settings.retrieval
    report = ClusterReport(
        datastore=str(retrieval.datastore),
        pipeline=config.pipeline,
        questions=len(set(stream)),
        requests=len(stream),
        cache_mb=retrieval.cache_mb or 0.0,
        prefetch_budget_mb=retrieval.prefetch_budget_mb,
        one_process_latency_ms_p50=0.0,
    )
    log(f"one-process server: {report.questions} questions")
    reference, report.one_process_latency_ms_p50 = asyncio.run(one_process(settings, stream, config))
    started_ray = not ray.is_initialized()
    if started_ray:
        start_ray(settings, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": settings.server.port})
    report.nodes = sum(node["Alive"] for node in ray.nodes())
    base = f"http://127.0.0.1:{settings.server.port}"
    cluster = settings.cluster
    try:
        overheads = _tier_overheads(settings, config) if cluster.shards else {}
        for batch in config.batches:
            for router in config.routers:
                log(f"router {router}, batch {batch}: new replicas")
                deploy_inference(settings.model_copy(update={"cluster": cluster.model_copy(update={"router": router})}))
                wait_ready(base)
                answers, wall = asyncio.run(_stream(base, stream, batch, config))
                time.sleep(3 * cluster.routing_stats_period_s)  # the replicas' reports after the last request
                metrics = httpx.get(f"{base}/metrics", timeout=30).text
                hits, misses = (replica_sum(metrics, f"telerag_cache_{kind}_total") for kind in ("hits", "misses"))
                latencies = [answer.latency_ms for answer in answers]
                report.rows.append(
                    ClusterRow(
                        router=router,
                        replicas=cluster.replicas,
                        shards=cluster.shards,
                        nodes=len({place.ip for place in replica_places()}),
                        batch=batch,
                        requests=len(answers),
                        latency_ms_p50=float(np.percentile(latencies, 50)),
                        latency_ms_p99=float(np.percentile(latencies, 99)),
                        throughput_rps=len(answers) / wall,
                        cache_hit_rate=hits / (hits + misses) if hits + misses else None,
                        bytes_copied=int(replica_sum(metrics, "telerag_cache_bytes_copied_total")),
                        same_documents=statistics.fmean(
                            answer.documents == reference[text] for text, answer in zip(stream, answers, strict=True)
                        ),
                        refused=sum(answer.refused for answer in answers),
                        remote_overhead=overheads.get(batch),
                    )
                )
            if config.write_rate:
                report.writes.append(_with_writes(settings, base, stream, batch, config, report.rows[-1], log))
    finally:
        if started_ray:
            ray.shutdown()  # Serve and the applications with it
        elif copied is not None:
            _delete_applications()  # they serve the copy, removed next
        if copied is not None:
            shutil.rmtree(copied, ignore_errors=True)
    return report


def _on_a_copy(settings: Settings) -> tuple[Settings, Path]:
    """The settings over a copy of their datastore, and the temporary directory holding it."""
    from telerag.benchmarks.ingest import copy_datastore

    copied = Path(tempfile.mkdtemp(prefix="telerag-bench-cluster-"))
    copy = copy_datastore(settings.retrieval.datastore.expanduser(), copied)
    return settings.model_copy(update={"retrieval": settings.retrieval.model_copy(update={"datastore": copy})}), copied


@dataclass(frozen=True)
class ReplicaPlace:
    app: str
    deployment: str
    ip: str  # its node's address


def ask_replicas(apps: Sequence[str], question: Callable[[object], Any], timeout_s: float = 30) -> list[tuple[str, str, Any]]:
    """Each Serve replica of `apps` asked `question` in its own process (`__ray_call__`): its
    application, deployment and answer. One that does not answer within `timeout_s` (gone, or on a
    node just lost) is left out."""
    import ray

    answers: list[tuple[str, str, Any]] = []
    for actor in ray.util.list_named_actors(all_namespaces=True):
        name = actor["name"]  # SERVE_REPLICA::<app>#<deployment>#<id>
        if not name.startswith("SERVE_REPLICA::") or name.count("#") != 2:
            continue
        app, deployment, _ = name.removeprefix("SERVE_REPLICA::").split("#")
        if app not in apps:
            continue
        try:
            replica = ray.get_actor(name, namespace=actor["namespace"])
            answers.append((app, deployment, ray.get(replica.__ray_call__.remote(question), timeout=timeout_s)))
        except Exception:  # noqa: BLE001 - gone, or on a node just lost
            continue
    return answers


def replica_places(apps: Sequence[str] | None = None) -> list[ReplicaPlace]:
    """Where each Serve replica of `apps` (default: the bench's two applications) runs, as the
    replica itself answers (Serve's status counts replicas but does not place them)."""
    from telerag.server.ray_serve.applications import APP
    from telerag.server.ray_serve.tier import APP as TIER_APP

    def address(_replica: object) -> str:
        import ray  # in the replica's process

        return str(ray.util.get_node_ip_address())

    return [ReplicaPlace(app, deployment, ip) for app, deployment, ip in ask_replicas(apps or (APP, TIER_APP), address)]


def _delete_applications() -> None:
    from ray import serve

    from telerag.server.ray_serve.applications import APP
    from telerag.server.ray_serve.tier import APP as TIER_APP

    for app in (APP, TIER_APP):
        serve.delete(app)


def _with_writes(
    settings: Settings,
    base: str,
    stream: Sequence[str],
    batch: int,
    config: ClusterBenchConfig,
    alone: ClusterRow,
    log: Callable[[str], None],
) -> ClusterWriteRow:
    """The stream once more on new replicas of `alone`'s router, beside the writes."""
    from telerag.server.ray_serve.applications import deploy_inference

    log(f"router {alone.router}, batch {batch}, writes at {config.write_rate:g}/s: new replicas")
    cluster = settings.cluster.model_copy(update={"router": alone.router})
    deploy_inference(settings.model_copy(update={"cluster": cluster}))
    wait_ready(base)
    answers, written = asyncio.run(_stream_with_writes(base, stream, batch, config))
    latencies = [answer.latency_ms for answer in answers]
    acks = [w.ack_ms for w in written]
    fresh = [w.fresh_ms for w in written if w.fresh_ms is not None]
    return ClusterWriteRow(
        router=alone.router,
        batch=batch,
        requests=len(answers),
        latency_ms_p50=float(np.percentile(latencies, 50)),
        latency_ms_p99=float(np.percentile(latencies, 99)),
        latency_ms_p50_alone=alone.latency_ms_p50,
        writes=len(written),
        ack_ms_p50=float(np.percentile(acks, 50)) if acks else 0.0,
        ack_ms_p99=float(np.percentile(acks, 99)) if acks else 0.0,
        fresh_ms_p50=float(np.percentile(fresh, 50)) if fresh else None,
        fresh_ms_p99=float(np.percentile(fresh, 99)) if fresh else None,
        never_found=sum(w.fresh_ms is None for w in written),
    )


async def _stream(base: str, stream: Sequence[str], batch: int, config: ClusterBenchConfig) -> tuple[list[Answer], float]:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        return await closed_loop(client, stream, batch, config)


def _tier_overheads(settings: Settings, config: ClusterBenchConfig) -> dict[int, float]:
    """Deploy the tier (or use the one running, if it has the settings' shards) and measure each
    batch's `remote_overhead` on it."""
    from ray import serve

    from telerag.benchmarks.tier import TierBenchConfig, measure_tier
    from telerag.retrieval.datastore import Datastore
    from telerag.retrieval.engine import default_nprobe
    from telerag.retrieval.ivf import CPUIndex
    from telerag.server.ray_serve.applications import tier_shape
    from telerag.server.ray_serve.tier import APP, RetrievalTier, deploy_tier

    path = settings.retrieval.datastore.expanduser()
    running = RetrievalTier.connect() if APP in serve.status().applications and not config.write_rate else None
    if running is not None and len(running.handles) == settings.cluster.shards:  # (with writes: a copy, a tier of its own)
        tier = running
    else:
        tier = deploy_tier(path, tier_shape(settings), verify_checksums=settings.retrieval.verify_checksums)
    local = CPUIndex(Datastore.load(path, verify_checksums=False))
    nprobe = settings.retrieval.fixed_nprobe or default_nprobe(local.datastore.nlist)
    measuring = TierBenchConfig(datastore=path, searches=config.tier_searches, k=settings.retrieval.top_k)
    return {
        batch: measure_tier(local, tier, settings.cluster.shards, batch, nprobe, measuring, False).remote_overhead
        for batch in config.batches
    }


def format_table(report: ClusterReport) -> str:
    lines = [
        f"{report.datastore}, pipeline {report.pipeline}: {report.requests} requests ({report.questions} distinct questions); "
        f"each replica's cluster cache {report.cache_mb:g} MB, prefetch budget "
        f"{'B x t_LLM' if report.prefetch_budget_mb is None else f'{report.prefetch_budget_mb:g} MB'}; "
        f"one-process server p50 {report.one_process_latency_ms_p50:.0f} ms one at a time; Ray nodes {report.nodes}",
        f"{'router':<8}{'replicas':>9}{'shards':>7}{'nodes':>6}{'batch':>6}{'requests':>9}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>7}"
        f"{'hit rate':>9}{'MB copied':>10}{'same docs':>10}{'remote_overhead':>16}{'429s':>6}",
    ]
    for row in report.rows:
        hit = "-" if row.cache_hit_rate is None else f"{row.cache_hit_rate:.3f}"
        overhead = "-" if row.remote_overhead is None else f"{row.remote_overhead:.2f}"
        lines.append(
            f"{row.router:<8}{row.replicas:>9}{row.shards:>7}{row.nodes:>6}{row.batch:>6}{row.requests:>9}{row.latency_ms_p50:>9.0f}"
            f"{row.latency_ms_p99:>9.0f}{row.throughput_rps:>7.2f}{hit:>9}{row.bytes_copied / 2**20:>10.3g}"
            f"{row.same_documents:>10.3f}{overhead:>16}{row.refused:>6}"
        )
    if report.writes:
        lines.append(
            f"{'router':<8}{'batch':>6}{'requests':>9}{'p50 ms':>9}{'p99 ms':>9}{'alone p50':>10}{'writes':>7}"
            f"{'ack p50':>9}{'ack p99':>9}{'fresh p50':>10}{'fresh p99':>10}{'never':>6}"
        )
    for write in report.writes:
        fresh = ["-" if v is None else f"{v:.0f}" for v in (write.fresh_ms_p50, write.fresh_ms_p99)]
        lines.append(
            f"{write.router:<8}{write.batch:>6}{write.requests:>9}{write.latency_ms_p50:>9.0f}{write.latency_ms_p99:>9.0f}"
            f"{write.latency_ms_p50_alone:>10.0f}{write.writes:>7}{write.ack_ms_p50:>9.0f}{write.ack_ms_p99:>9.0f}"
            f"{fresh[0]:>10}{fresh[1]:>10}{write.never_found:>6}"
        )
    return "\n".join(lines)
