"""A run's timings and prefetch summary, summed from its traced steps."""

from __future__ import annotations

from collections.abc import Sequence

from telerag.pipelines.stats import (
    PipeliningSummary,
    PrefetchStepStats,
    PrefetchSummary,
    SearchStats,
    SpeculationSummary,
    Timings,
)
from telerag.pipelines.types import StageRole, Step, overlap_rates


def summarize(
    steps: Sequence[Step], *, total_ms: float
) -> tuple[Timings, PrefetchSummary, PipeliningSummary, SpeculationSummary]:
    """Each timing sums its role's steps (embedding and the search's device and CPU parts are
    parts of the prefetches and searches); the prefetch summary sums the prefetches' plans and
    the searches' placement, with the mean overlap rate of the searches that had a prefetch;
    the pipelining summary counts the searches launched from a stale query, the speculation
    summary the speculative prefills."""
    searches = [s.stats for s in steps if isinstance(s.stats, SearchStats)]
    prefetches = [s.stats for s in steps if isinstance(s.stats, PrefetchStepStats)]
    overlaps = overlap_rates(steps)

    def ms(role: StageRole) -> float:
        return float(sum(s.ms for s in steps if s.stage.role is role))

    timings = Timings(
        total_ms=total_ms,
        embed_ms=float(sum(s.embed_ms for s in searches) + sum(p.embed_ms for p in prefetches)),
        prefetch_ms=ms(StageRole.PREFETCH),
        pre_retrieval_ms=ms(StageRole.PRE_RETRIEVAL),
        search_ms=ms(StageRole.SEARCH),
        search_device_ms=float(sum(s.device_ms for s in searches)),
        search_cpu_ms=float(sum(s.cpu_ms for s in searches)),
        llm_ms=ms(StageRole.LLM),
        generate_ms=ms(StageRole.GENERATE),
    )
    prefetch = PrefetchSummary(
        clusters_prefetched=sum(s.plan.clusters_requested for s in prefetches),
        bytes_prefetched=sum(s.plan.bytes_copied for s in prefetches),
        overlap_rate=sum(overlaps) / len(overlaps) if overlaps else None,
        clusters_device=sum(s.clusters_device for s in searches),
        clusters_cpu=sum(s.clusters_cpu for s in searches),
        clusters_copied_on_demand=sum(s.clusters_copied_on_demand for s in searches),
        clusters_late=sum(s.clusters_late for s in searches),
    )
    pipelined = [s.pipelined for s in searches if s.pipelined is not None]
    checked = [p for p in pipelined if p.same_documents is not None]
    pipelining = PipeliningSummary(
        retrievals=len(pipelined),
        searched_again=sum(p.searched_again for p in pipelined),
        checked=len(checked),
        differed=sum(not p.same_documents for p in checked),
    )
    speculated = [s.speculative for s in searches if s.speculative is not None]
    speculation = SpeculationSummary(
        prefills=len(speculated),
        reprefilled=sum(p.reprefilled for p in speculated),
        prefilled_tokens=sum(p.prefilled_tokens or 0 for p in speculated),
        reused_tokens=sum(p.reused_tokens or 0 for p in speculated),
    )
    return timings, prefetch, pipelining, speculation
