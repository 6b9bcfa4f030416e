"""Prometheus metrics of one app (own registry, so several apps in one process stay apart)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from telerag.pipelines.stats import SearchStats
from telerag.pipelines.types import RagResult
from telerag.retrieval.documents import WriteOutcome, WriteResult
from telerag.retrieval.recall import RecallEstimate
from telerag.retrieval.stats import CacheStats
from telerag.server.errors import Refusal
from telerag.server.observability.scraped_metrics import (
    CacheCollector,
    LiveCollector,
    LiveReport,
    PrefixCacheCollector,
    RecallCollector,
)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
NPROBE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
RATE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class DocumentMetrics:
    """Writes of documents: by outcome, and how long each request took to be acknowledged; and the
    live datastore's state (`live`), read at scrape time."""

    def __init__(self, registry: CollectorRegistry, live: Callable[[], LiveReport | None]) -> None:
        self.writes = Counter(
            "telerag_document_writes", "documents written, by outcome (created, replaced, unchanged, deleted, not_found)",
            ["outcome"], registry=registry,
        )  # fmt: skip
        for outcome in WriteOutcome:
            self.writes.labels(outcome.value)
        self.acknowledged = Histogram(
            "telerag_document_write_seconds",
            "a write request's time to its acknowledgment (durable and searchable): queue, embedding, log sync",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        registry.register(LiveCollector(live))

    def observe(self, results: list[WriteResult], seconds: float) -> None:
        for result in results:
            self.writes.labels(result.outcome.value).inc()
        self.acknowledged.observe(seconds)


class ConnectionMetrics:
    """The connection guards' reports (`server/process/connections.py`'s `ConnectionObserver`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.open = Gauge("telerag_connections_open", "HTTP connections open", registry=registry)
        self.actions = Counter(
            "telerag_connections_guarded",
            "connections the guards acted on: closed for late headers "
            "(header_timeout) or opened past server.max_connections (over_bound)",
            ["action"],
            registry=registry,
        )
        for action in ("header_timeout", "over_bound"):
            self.actions.labels(action)

    def connections_open(self, count: int) -> None:
        self.open.set(count)

    def guarded(self, action: str) -> None:
        self.actions.labels(action).inc()


class PipeliningMetrics:
    """Pipelined retrievals (`pipelining`) and what nprobe "auto" chose."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.pipelined = Counter(
            "telerag_pipelined_retrievals",
            "searches launched from a stale query while their step generated, by what became of them: kept (its "
            "documents used) or searched_again (the final query had moved too far)",
            ["pipeline", "outcome"],
            registry=registry,
        )
        self.pipelined_checked = Counter(
            "telerag_pipelined_checked",
            "pipelined searches whose final query's documents are known, by whether the stale ones differed",
            ["pipeline", "differed"],
            registry=registry,
        )
        self.auto_nprobe = Histogram(
            "telerag_auto_nprobe",
            'the nprobe nprobe "auto" chose for a pipelined search (the largest predicted to fit the generation left)',
            ["pipeline"],
            buckets=NPROBE_BUCKETS,
            registry=registry,
        )

    def observe(self, pipeline: str, stats: SearchStats) -> None:
        pipelined = stats.pipelined
        if pipelined is None:
            return
        self.pipelined.labels(pipeline, "searched_again" if pipelined.searched_again else "kept").inc()
        if pipelined.same_documents is not None:
            self.pipelined_checked.labels(pipeline, str(not pipelined.same_documents).lower()).inc()
        if pipelined.budget_ms is not None:
            self.auto_nprobe.labels(pipeline).observe(stats.nprobe)


class SpeculationMetrics:
    """Speculative prefills (`speculative_prefill`): how often, re-prefilled how often, the tokens."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.prefills = Counter(
            "telerag_speculative_prefills",
            "next calls' prompts prefilled from a search's provisional top-k, by outcome: confirmed (the final top-k "
            "made the same prompt) or reprefilled (another prompt: the call prefilled it again from the first change)",
            ["pipeline", "outcome"],
            registry=registry,
        )
        self.tokens = Counter(
            "telerag_speculative_prefill_tokens",
            "tokens speculative prefills computed (prefilled) and, of them, those the calls after the searches found "
            "cached (reused)",
            ["pipeline", "kind"],
            registry=registry,
        )

    def observe(self, pipeline: str, stats: SearchStats) -> None:
        speculative = stats.speculative
        if speculative is None:
            return
        self.prefills.labels(pipeline, "reprefilled" if speculative.reprefilled else "confirmed").inc()
        self.tokens.labels(pipeline, "prefilled").inc(speculative.prefilled_tokens or 0)
        self.tokens.labels(pipeline, "reused").inc(speculative.reused_tokens or 0)


class AdmissionMetrics:
    """The queue and admission's model: what waits, what runs, what was refused and why, and the
    model's measured rate and error."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue_wait = Histogram(
            "telerag_queue_wait_seconds",
            "how long admitted requests waited for a slot",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_depth = Gauge("telerag_queue_depth", "requests waiting for a slot", registry=registry)
        self.in_flight = Gauge("telerag_requests_in_flight", "requests running", registry=registry)
        self.refusals = Counter(
            "telerag_admission_refusals", "requests refused by admission, by reason", ["reason"], registry=registry
        )
        for reason in Refusal:
            self.refusals.labels(reason.value)
        self.expected_wait = Gauge(
            "telerag_admission_expected_wait_seconds",
            "time the admitted work takes at the measured service rate (scaled by the estimate factor)",
            registry=registry,
        )
        self.service_rate = Gauge(
            "telerag_admission_service_rate",
            "work units the server completes per second with as many requests running as now, as admission measures it "
            "(0 until a request completed)",
            registry=registry,
        )
        self.estimate_factor = Gauge(
            "telerag_admission_estimate_factor",
            "what admission multiplies its estimates by at the load admitted now: the largest of recent requests' "
            "time to finish over their estimate (at that load once measured there)",
            registry=registry,
        )


class _Merged:
    """A registry's families with other processes' samples of the same families (or new ones),
    each sample labelled with its process: one family per name, as the text format requires."""

    def __init__(self, registry: CollectorRegistry, others: Mapping[str, bytes], label: str = "replica") -> None:
        self.registry, self.others, self.label = registry, others, label

    def collect(self) -> Iterator[Metric]:
        families = {family.name: family for family in self.registry.collect()}
        for source, text in self.others.items():
            for family in text_string_to_metric_families(text.decode()):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                merged.samples.extend(sample._replace(labels={**sample.labels, self.label: source}) for sample in family.samples)
        yield from families.values()


class Metrics:
    def __init__(
        self,
        cache_stats: Callable[[], CacheStats],
        prefix_cache_bytes: Callable[[], int | None] = lambda: None,
        live: Callable[[], LiveReport | None] = lambda: None,
        search_recall: Callable[[], RecallEstimate | None] = lambda: None,
    ) -> None:
        self.registry = r = CollectorRegistry()
        self.request_latency = Histogram(
            "telerag_request_seconds",
            "request latency, from its slot to its end (the wait for the slot: telerag_queue_wait_seconds)",
            ["pipeline", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stage_latency = Histogram(
            "telerag_stage_seconds", "stage latency", ["pipeline", "stage"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.overlap = Histogram(
            "telerag_cluster_overlap_rate", "|C_in ∩ C_out| / |C_out| per request", ["pipeline"], buckets=RATE_BUCKETS, registry=r
        )
        self.prefetched_bytes = Counter("telerag_prefetched_bytes", "bytes copied by prefetches", ["pipeline"], registry=r)
        self.clusters_searched = Counter(
            "telerag_clusters_searched", "clusters searched, by where", ["pipeline", "where"], registry=r
        )
        self.demand_copies = Counter(
            "telerag_clusters_copied_on_demand",
            "searched clusters copied to the device on demand (of those searched on the device)",
            ["pipeline"],
            registry=r,
        )
        self.late_clusters = Counter(
            "telerag_clusters_late",
            "resident clusters scanned by faiss because their copies would land after faiss finished",
            ["pipeline"],
            registry=r,
        )
        self.copy_wait = Histogram(
            "telerag_search_copy_wait_seconds",
            "how long a search's device scan waited for copies in flight (searches that waited)",
            ["pipeline"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.pipelining = PipeliningMetrics(r)
        self.speculation = SpeculationMetrics(r)
        self.admission = AdmissionMetrics(r)
        self.batch_size = Histogram(
            "telerag_batch_size",
            "queries per batched retrieval call",
            ["kind"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.tokens = Counter(
            "telerag_tokens_generated", "tokens generated, cancelled requests' included", ["pipeline"], registry=r
        )
        self.ttft = Histogram(
            "telerag_time_to_first_token_seconds",
            "time to the first answer token",
            ["pipeline"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "telerag_prompt_tokens", "prompt tokens of every LLM call of finished requests", ["pipeline"], registry=r
        )
        self.prefix_cache_hits = Counter(
            "telerag_prefix_cache_hit_tokens",
            "of telerag_prompt_tokens, those the engine's prefix cache held (reused, not prefilled)",
            ["pipeline"],
            registry=r,
        )
        self.connections = ConnectionMetrics(r)
        self.documents = DocumentMetrics(r, live)
        for collector in (CacheCollector(cache_stats), PrefixCacheCollector(prefix_cache_bytes), RecallCollector(search_recall)):
            r.register(collector)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open fds (Linux)
        # on a Ray cluster's ingress: each inference replica's Prometheus text, by replica id
        self.replica_series: Callable[[], Mapping[str, bytes]] = dict

    def exposition(self) -> bytes:
        """The Prometheus text of this app's series and, on a Ray cluster's ingress, of every
        inference replica's, each labelled `replica`."""
        replicas = self.replica_series()
        return generate_latest(_Merged(self.registry, replicas) if replicas else self.registry)

    def observe_result(self, result: RagResult) -> None:
        p = result.pipeline
        for step in result.steps:
            self.stage_latency.labels(p, step.stage.name).observe(step.ms / 1e3)
            if isinstance(step.stats, SearchStats):
                if step.stats.copy_wait_ms:
                    self.copy_wait.labels(p).observe(step.stats.copy_wait_ms / 1e3)
                self.pipelining.observe(p, step.stats)
                self.speculation.observe(p, step.stats)
        self.prompt_tokens.labels(p).inc(result.prompt_tokens)
        self.prefix_cache_hits.labels(p).inc(result.cached_tokens)
        summary = result.prefetch
        if summary.overlap_rate is not None:
            self.overlap.labels(p).observe(summary.overlap_rate)
        self.prefetched_bytes.labels(p).inc(summary.bytes_prefetched)
        self.clusters_searched.labels(p, "device").inc(summary.clusters_device)
        self.clusters_searched.labels(p, "cpu").inc(summary.clusters_cpu)
        self.demand_copies.labels(p).inc(summary.clusters_copied_on_demand)
        self.late_clusters.labels(p).inc(summary.clusters_late)
