"""What the server's metrics count from a request's result."""

from __future__ import annotations

import pytest

from telerag.pipelines.rag.base import SEARCH
from telerag.pipelines.stats import PrefetchSummary, SearchStats, Timings
from telerag.pipelines.types import RagResult, Step
from telerag.retrieval.stats import CacheStats
from telerag.server.observability.metrics import Metrics


def test_metrics_count_late_clusters_and_copy_waits():
    metrics = Metrics(CacheStats)
    search = Step(SEARCH, "q", ms=3.0, stats=SearchStats(copy_wait_ms=2.0, clusters_late=4))
    quick = Step(SEARCH, "q", ms=1.0, stats=SearchStats(copy_wait_ms=0.0))
    metrics.observe_result(
        RagResult(
            answer="a",
            pipeline="hyde",
            documents=[],
            steps=[search, quick],
            timings=Timings(),
            prefetch=PrefetchSummary(clusters_late=4),
            tokens_generated=1,
        )
    )
    value = metrics.registry.get_sample_value
    assert value("telerag_clusters_late_total", {"pipeline": "hyde"}) == 4
    assert value("telerag_search_copy_wait_seconds_count", {"pipeline": "hyde"}) == 1  # only the search that waited
    assert value("telerag_search_copy_wait_seconds_sum", {"pipeline": "hyde"}) == pytest.approx(0.002)
