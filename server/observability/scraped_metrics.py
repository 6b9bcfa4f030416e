"""What the metrics read at scrape time rather than count as it happens: the cluster cache's
counters, the prefix cache's size, the live datastore's state and the search's estimated recall,
each from a callable the app hands its `Metrics` (nothing for a runtime without one)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from telerag.documents.ingestion import IngestionProgress
from telerag.retrieval.live import LiveStats
from telerag.retrieval.recall import RecallEstimate
from telerag.retrieval.stats import CacheStats


class CacheCollector(Collector):
    """Reads the cluster cache's counters at scrape time."""

    def __init__(self, stats: Callable[[], CacheStats]) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats()
        for metric, name, doc in (
            ("telerag_cache_hits", "hits", "searched clusters found resident"),
            ("telerag_cache_misses", "misses", "searched clusters not resident"),
            ("telerag_cache_evictions", "evictions", "clusters evicted"),
            ("telerag_cache_bytes_copied", "bytes_copied", "bytes copied into the cache (from disk: read into it)"),
            ("telerag_cache_bytes_copied_ahead", "bytes_copied_ahead", "of those, a prefetch's, before the search reading them"),
            ("telerag_cache_bytes_evicted_unread", "bytes_evicted_unread", "copied ahead, evicted before a search read them"),
            ("telerag_disk_bytes_read_for_scans", "bytes_read_for_scans", "on disk: bytes searches read and scanned uncached"),
            ("telerag_host_cache_bytes_read", "host_bytes_read", "from disk onto a device: bytes read into the host tier"),
            ("telerag_host_cache_hits", "host_hits", "lists a search's CPU half found in the host tier, not read"),
        ):
            family = CounterMetricFamily(metric, doc)
            family.add_metric([], float(getattr(s, name)))
            yield family
        for metric, name, doc in (
            ("telerag_cache_occupancy_bytes", "occupancy_bytes", "bytes of the cache holding clusters"),
            ("telerag_cache_capacity_bytes", "capacity_bytes", "cache size"),
            ("telerag_cache_resident_clusters", "resident_clusters", "clusters resident"),
            ("telerag_cache_pinned_clusters", "pinned_clusters", "clusters pinned now"),
            ("telerag_host_cache_occupancy_bytes", "host_occupancy_bytes", "bytes of the host tier holding clusters"),
            ("telerag_host_cache_capacity_bytes", "host_capacity_bytes", "host tier size (0: none)"),
        ):
            family = GaugeMetricFamily(metric, doc)
            family.add_metric([], float(getattr(s, name)))
            yield family


class RecallCollector(Collector):
    """Reads the dense search's estimated recall at scrape time (`retrieval.recall`)."""

    def __init__(self, estimate: Callable[[], RecallEstimate | None]) -> None:
        self.estimate = estimate

    def collect(self):
        found = self.estimate()
        if found is None:
            return
        if found.recall is not None:
            recall = GaugeMetricFamily(
                "telerag_search_recall",
                "the dense search's recall against an exhaustive search, over the latest sampled queries",
                labels=["datastore"],
            )
            recall.add_metric([found.datastore], found.recall)
            yield recall
        samples = CounterMetricFamily("telerag_search_recall_samples", "queries whose recall was measured", labels=["datastore"])
        samples.add_metric([found.datastore], float(found.samples))
        yield samples


class PrefixCacheCollector(Collector):
    """Reads the engine's prefix cache size at scrape time; nothing for an engine that has none."""

    def __init__(self, held_bytes: Callable[[], int | None]) -> None:
        self.held_bytes = held_bytes

    def collect(self):
        held = self.held_bytes()
        if held is not None:
            family = GaugeMetricFamily("telerag_prefix_cache_bytes", "bytes of prompts' KV the engine's prefix cache holds")
            family.add_metric([], float(held))
            yield family


@dataclass(frozen=True)
class LiveReport:
    """What the metrics read of a live datastore at scrape time."""

    stats: LiveStats
    rebuilds_ended: Mapping[tuple[str, str], int]  # compactions and retrains that ended, by (kind, state)
    ingestion: IngestionProgress | None  # the corpus being written into it (None: none since the server started)


class LiveCollector(Collector):
    """Reads the live datastore's state, its rebuilds' count and its ingestion's progress at scrape
    time; nothing for a runtime without one."""

    def __init__(self, live: Callable[[], LiveReport | None]) -> None:
        self.live = live

    def collect(self):
        report = self.live()
        if report is None:
            return
        s = report.stats
        ended = CounterMetricFamily(
            "telerag_datastore_rebuilds", "compactions and retrains that ended, by kind and state", labels=["kind", "state"]
        )
        for kind in ("compact", "retrain"):
            for state in ("done", "failed"):
                ended.add_metric([kind, state], float(report.rebuilds_ended.get((kind, state), 0)))
        yield ended
        yield SummaryMetricFamily(
            "telerag_datastore_publish_seconds",
            "write batches' time from durable (log synced) to searchable (snapshot published), part of each "
            "acknowledgment: a write is searchable before it is acknowledged (freshness after it: 0)",
            count_value=s.published,
            sum_value=s.publish_seconds,
        )
        ingestion = report.ingestion
        for name, value, doc in (
            ("documents", s.documents, "documents in the datastore"),
            ("passages", s.passages, "passages (rows) in the datastore"),
            ("datastore_lsn", s.lsn, "the last acknowledged write's position in the datastore's log"),
            (
                "datastore_generation",
                s.generation,
                "the generation of the datastore's files: one more each compaction or retrain",
            ),
            ("datastore_wal_bytes", s.wal_bytes, "bytes of the write-ahead log since the datastore's files were written"),
            ("datastore_delta_rows", s.delta_rows, "rows added since the datastore's files were written"),
            ("datastore_tombstones", s.tombstones, "deleted rows still in the datastore's files or delta (filtered in the scan)"),
            ("datastore_list_imbalance", s.imbalance, "the largest IVF list over the mean list (appends keep the centroids)"),
            (
                "ingestion_documents_remaining",
                0 if ingestion is None else ingestion.total_documents - ingestion.documents,
                "documents of a corpus being ingested into the datastore not written yet (0: none)",
            ),
        ):
            family = GaugeMetricFamily(f"telerag_{name}", doc)
            family.add_metric([], float(value))
            yield family
