"""What a pipeline run measures: each traced step's stats and the run's totals.

Typed, so that a mistyped field is an AttributeError rather than a silent 0 in a metric. The
server turns them into the JSON it documents (`server.protocol`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from telerag.engines.types import FinishReason
from telerag.retrieval.stats import PrefetchStats

if TYPE_CHECKING:
    from telerag.retrieval.engine import SearchResult


@dataclass(frozen=True)
class GenerationStats:
    """An LLM step's."""

    finish_reason: FinishReason
    ttft_ms: float | None = None  # None: the reply was cut where it ended, before the engine's own report


@dataclass(frozen=True)
class PrefetchStepStats:
    """A prefetch step's: its q_in embedding, how many callers' prefetches ran as one, and what
    the engine planned and copied. One that did not run (turned off, no budget or no cache) is
    not `enabled` and did nothing."""

    enabled: bool = False
    embed_ms: float = 0.0
    batch: int = 0  # callers whose prefetches were planned together
    plan: PrefetchStats = field(default_factory=PrefetchStats)


@dataclass(frozen=True)
class SearchStats:
    """A search step's (summed over its queries, except `overlap_rate`)."""

    embed_ms: float = 0.0
    probe_ms: float = 0.0
    device_ms: float = 0.0
    cpu_ms: float = 0.0
    total_ms: float = 0.0
    overlap_rate: float | None = None  # mean over queries of |C_in ∩ C_out| / |C_out|; None without a prefetch
    clusters_device: int = 0
    clusters_cpu: int = 0
    clusters_copied_on_demand: int = 0
    clusters_late: int = 0  # resident, but scanned by faiss: their copies would have landed after it finished
    copy_wait_ms: float = 0.0  # how long the device scan waited for copies in flight
    nprobe: int = 0
    batch: int = 0  # queries searched together, other callers' included
    pipelined: PipelinedSearch | None = None  # a search launched from a stale query while its step generated
    speculative: SpeculativePrefill | None = None  # the next call's prompt prefilled from a provisional top-k
    rerank_ms: float = 0.0  # the re-ranker's call (`retrieval.reranker`), its batch's


@dataclass(frozen=True)
class SpeculativePrefill:
    """The prompt of the LLM call after a search, prefilled from the search's provisional top-k
    while the search went on (AquaPipe), and what became of it."""

    lists_share: float  # of the search's probed lists, those scanned when its top-k was found stable
    reprefilled: bool  # the final top-k differed: the call prefilled its prompt again from the first change on
    prefilled_tokens: int | None = None  # computed by the speculative prefill (None: not known, or cancelled before it ran)
    reused_tokens: int | None = None  # of those, the ones the call found cached (None: no call matched, or not yet)


@dataclass(frozen=True)
class PipelinedSearch:
    """A search launched from the text its step had generated so far (PipeRAG), and what became
    of it once the step ended: its documents were used, or the final query had moved too far
    from the stale one and was searched again."""

    launched_after_tokens: int  # of the step's generation
    generation_left_ms: float  # from the launch to the step's end: the time the search could hide behind
    budget_ms: float | None  # nprobe "auto": the generation time predicted left at the launch (None: nprobe not chosen)
    cosine: float  # between the stale and the final query's embeddings
    searched_again: bool  # cosine under the threshold: the final query was searched and its documents used
    same_documents: bool | None  # the stale query's documents equal the final query's (None: not checked)


StepStats = GenerationStats | PrefetchStepStats | SearchStats


@dataclass(frozen=True)
class Timings:
    """Where a run's time went (ms), each field its stages' role (`StageRole`); stages that ran
    several times are summed. The prefetch runs beside the pre-retrieval call, so the fields
    overlap; the steps' spans (`Step.start_ms`, `Step.ms`) show how."""

    total_ms: float = 0.0
    embed_ms: float = 0.0  # prefetches' and searches' embedding calls
    prefetch_ms: float = 0.0
    pre_retrieval_ms: float = 0.0  # the LLM calls that prefetches ran beside
    search_ms: float = 0.0
    search_device_ms: float = 0.0
    search_cpu_ms: float = 0.0
    llm_ms: float = 0.0  # the other LLM calls whose output is not the answer: drafts for a judge, judgements, critiques
    generate_ms: float = 0.0  # the LLM calls that wrote the answer


@dataclass(frozen=True)
class PrefetchSummary:
    """A run's prefetches and where its searches scanned, summed over its steps."""

    clusters_prefetched: int = 0
    bytes_prefetched: int = 0
    overlap_rate: float | None = None  # mean over searches with a prefetch
    clusters_device: int = 0
    clusters_cpu: int = 0
    clusters_copied_on_demand: int = 0
    clusters_late: int = 0


@dataclass(frozen=True)
class PipeliningSummary:
    """A run's pipelined retrievals (`PipelinedSearch`), counted over its searches."""

    retrievals: int = 0  # searches launched from a stale query while their step generated
    searched_again: int = 0  # of them, those whose final query moved too far: searched again
    checked: int = 0  # of them, those whose final query's documents are known (searched again, or checked beside)
    differed: int = 0  # of those checked, those whose stale documents differed from the final query's


@dataclass(frozen=True)
class SpeculationSummary:
    """A run's speculative prefills (`SpeculativePrefill`), counted over its searches."""

    prefills: int = 0  # searches whose next call's prompt was prefilled from a provisional top-k
    reprefilled: int = 0  # of them, those whose final top-k differed
    prefilled_tokens: int = 0  # computed by the speculative prefills
    reused_tokens: int = 0  # of those, the ones the calls after the searches found cached


def search_step_stats(
    result: SearchResult | None, ranked_ms: float, embed_ms: float, nprobe: int, batch: int, rerank_ms: float = 0.0
) -> SearchStats:
    """A search step's stats: the dense search's (none by words alone), its total the whole ranking's."""
    if result is None:
        return SearchStats(embed_ms=embed_ms, total_ms=ranked_ms, rerank_ms=rerank_ms, batch=batch)
    per_query = result.per_query
    return SearchStats(
        embed_ms=embed_ms,
        probe_ms=result.probe_ms,
        device_ms=result.device_ms,
        cpu_ms=result.cpu_ms,
        total_ms=max(result.total_ms, ranked_ms),
        clusters_device=sum(s.clusters_device for s in per_query),
        clusters_cpu=sum(s.clusters_cpu for s in per_query),
        clusters_copied_on_demand=sum(s.clusters_copied_on_demand for s in per_query),
        clusters_late=sum(s.clusters_late for s in per_query),
        copy_wait_ms=result.copy_wait_ms,
        rerank_ms=rerank_ms,
        nprobe=nprobe,
        batch=batch,
    )


def mean_overlap(result: SearchResult | None, offset: int, count: int) -> float | None:
    """The mean overlap rate of one request's queries (rows `offset`...) in the dense search."""
    if result is None:
        return None
    overlaps = [s.overlap_rate for s in result.per_query[offset : offset + count] if s.overlap_rate is not None]
    return float(np.mean(overlaps)) if overlaps else None
