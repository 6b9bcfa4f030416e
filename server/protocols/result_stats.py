"""Pydantic models of a RAG result's step stats, timings and prefetch summary: the JSON that
`POST /v1/rag/query` documents for the typed stats of `pipelines.stats`."""

from __future__ import annotations

from dataclasses import asdict

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from telerag.engines.types import FinishReason
from telerag.pipelines.stats import GenerationStats, PrefetchStepStats, SearchStats, StepStats


class _OmitsAbsent(BaseModel):
    """A model whose unset (None) fields are left out of the JSON rather than sent as null."""

    @model_serializer(mode="wrap")
    def _without_none(self, handler: SerializerFunctionWrapHandler):
        return {name: value for name, value in handler(self).items() if value is not None}


class GenerationStatsOut(_OmitsAbsent):
    """An LLM step's stats."""

    model_config = ConfigDict(from_attributes=True)

    ttft_ms: float | None = Field(None, description="time to its first token; absent when the reply was cut where it ended")
    finish_reason: FinishReason


class PrefetchStatsOut(_OmitsAbsent):
    """A prefetch step's stats: only `enabled` when it did not run (turned off, no budget or no cache)."""

    enabled: bool
    embed_ms: float | None = Field(None, description="embedding q_in")
    batch: int | None = Field(None, description="callers whose prefetches were planned together")
    clusters_requested: int | None = Field(None, description="clusters planned for this request, resident ones included")
    bytes_requested: int | None = Field(None, description="bytes of those not resident when planned")
    clusters_resident: int | None = Field(None, description="planned clusters already resident (pinned, not copied)")
    clusters_copied: int | None = None
    clusters_skipped: int | None = Field(None, description="planned clusters that did not fit beside pinned ones")
    bytes_copied: int | None = None
    copies: int | None = Field(None, description="copy calls issued (adjacent clusters coalesce)")
    bytes_queued_ahead: int | None = Field(None, description="bytes on the copy stream ahead of this prefetch")
    plan_ms: float | None = Field(None, description="ranking and planning")

    @classmethod
    def of(cls, stats: PrefetchStepStats) -> PrefetchStatsOut:
        if not stats.enabled:
            return cls(enabled=False)
        return cls(enabled=True, embed_ms=stats.embed_ms, batch=stats.batch, **asdict(stats.plan))


class PipelinedSearchOut(BaseModel):
    """A search launched from the text its step had generated so far (`pipelining`)."""

    model_config = ConfigDict(from_attributes=True)

    launched_after_tokens: int = Field(description="tokens of the step's generation when the search was launched")
    generation_left_ms: float = Field(description="from the launch to the step's end: the time the search could hide behind")
    budget_ms: float | None = Field(
        description='nprobe "auto": the generation predicted left at the launch, which the chosen nprobe fits in; null otherwise'
    )
    cosine: float = Field(description="between the stale and the final query's embeddings")
    searched_again: bool = Field(
        description="the final query had moved too far (cosine under experiments.pipelining_min_cosine): it was searched "
        "again and its documents used"
    )
    same_documents: bool | None = Field(
        description="whether the stale query's documents equal the final query's; null: not checked "
        "(experiments.pipelining_check off)"
    )


class SpeculativePrefillOut(BaseModel):
    """The next LLM call's prompt, prefilled from the search's provisional top-k (`speculative_prefill`)."""

    model_config = ConfigDict(from_attributes=True)

    lists_share: float = Field(description="of the probed lists, those scanned when the top-k was found stable")
    reprefilled: bool = Field(
        description="the final top-k made another prompt: the call prefilled it again from the first document that changed"
    )
    prefilled_tokens: int | None = Field(
        description="tokens the speculative prefill computed; null: not known (cancelled before it ran, or it failed)"
    )
    reused_tokens: int | None = Field(
        description="of those, the tokens the call after the search found cached; null: no call was matched to it"
    )


class SearchStatsOut(BaseModel):
    """A search step's stats, summed over its queries (except `overlap_rate`)."""

    model_config = ConfigDict(from_attributes=True)

    embed_ms: float = Field(description="embedding q_out")
    probe_ms: float = Field(description="ranking the centroids")
    device_ms: float
    cpu_ms: float
    total_ms: float
    overlap_rate: float | None = Field(description="mean over queries of |C_in ∩ C_out| / |C_out|; null without a prefetch")
    clusters_device: int = Field(description="scanned on the device, those copied on demand included")
    clusters_cpu: int = Field(description="scanned by faiss on the CPU")
    clusters_copied_on_demand: int
    clusters_late: int = Field(description="resident, but scanned by faiss: their copies would have landed after it finished")
    copy_wait_ms: float = Field(description="how long the device scan waited for copies in flight")
    rerank_ms: float = Field(0.0, description="the re-ranker's call, its batch's (retrieval.reranker; 0 without one)")
    nprobe: int = Field(description='the lists searched (with nprobe "auto", the one chosen)')
    batch: int = Field(description="queries searched together, other requests' included")
    pipelined: PipelinedSearchOut | None = Field(
        None, description="a search launched while its step was still generating (`pipelining`); null otherwise"
    )
    speculative: SpeculativePrefillOut | None = Field(
        None,
        description="the next call's prompt prefilled from this search's provisional top-k (`speculative_prefill`); "
        "null otherwise",
    )


StepStatsOut = GenerationStatsOut | PrefetchStatsOut | SearchStatsOut


def step_stats(stats: StepStats | None) -> StepStatsOut | None:
    """The JSON model of a step's stats, chosen by their type."""
    if isinstance(stats, PrefetchStepStats):
        return PrefetchStatsOut.of(stats)
    if isinstance(stats, SearchStats):
        return SearchStatsOut.model_validate(stats)
    if isinstance(stats, GenerationStats):
        return GenerationStatsOut.model_validate(stats)
    return None


class TimingsOut(BaseModel):
    """Where the request's time went (ms), each field its stages' role; stages that ran several
    times are summed. The prefetch runs beside the pre-retrieval call, so the fields overlap; the
    steps' spans (`start_ms`, `ms`) show how."""

    model_config = ConfigDict(from_attributes=True)

    total_ms: float
    embed_ms: float = Field(description="the prefetches' and searches' embedding calls")
    prefetch_ms: float
    pre_retrieval_ms: float = Field(description="the LLM calls the prefetches ran beside (role pre_retrieval)")
    search_ms: float
    search_device_ms: float
    search_cpu_ms: float
    llm_ms: float = Field(
        description="the other LLM calls whose output is not the answer (role llm): drafts for a judge, judgements, critiques"
    )
    generate_ms: float = Field(description="the LLM calls that wrote the answer (role generate)")


class PrefetchSummaryOut(BaseModel):
    """The request's prefetches and where its searches scanned, summed over its steps."""

    model_config = ConfigDict(from_attributes=True)

    clusters_prefetched: int
    bytes_prefetched: int
    overlap_rate: float | None = Field(description="mean over searches with a prefetch; null without one")
    clusters_device: int
    clusters_cpu: int
    clusters_copied_on_demand: int
    clusters_late: int


class PipeliningSummaryOut(BaseModel):
    """The request's pipelined retrievals (`pipelining`), counted over its searches."""

    model_config = ConfigDict(from_attributes=True)

    retrievals: int = Field(description="searches launched from the text generated so far while their step went on")
    searched_again: int = Field(description="of them, those whose final query had moved too far: searched again")
    checked: int = Field(description="of them, those whose final query's own documents are known (searched again, or checked)")
    differed: int = Field(description="of those checked, those whose documents differed from the final query's")


class SpeculationSummaryOut(BaseModel):
    """The request's speculative prefills (`speculative_prefill`), counted over its searches."""

    model_config = ConfigDict(from_attributes=True)

    prefills: int = Field(description="searches whose next call's prompt was prefilled from their provisional top-k")
    reprefilled: int = Field(description="of them, those whose final top-k made another prompt (prefilled again from the change)")
    prefilled_tokens: int = Field(description="tokens the speculative prefills computed")
    reused_tokens: int = Field(description="of those, the tokens the calls after the searches found cached")
