"""Pydantic models of the RAG API (`POST /v1/rag/query`, its stream's events).

The request model carries the server's limits (`Settings.limits`, the served pipelines, the
datastore's nlist), so it is built per app (`query_request_model`; the OpenAI routes' are in
`protocols.openai`): what the OpenAPI schema says a field accepts is exactly what the server
accepts. Requests are strict (`"top_k": "3"` and `"stream": 0` are refused, not coerced).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    create_model,
)

from telerag.config.settings import LimitSettings
from telerag.documents.ingestion import IngestionProgress
from telerag.pipelines.types import RagResult, StageKind, StageRole
from telerag.retrieval.ranking import SearchMode
from telerag.server.protocols.common import (
    RetrievedPassageOut,
    default_max_tokens,
    integer,
    passages_out,
    pipeline_name,
    question_text,
)
from telerag.server.protocols.ops import ANSWERED_WHILE_INGESTING, IngestionInfo
from telerag.server.protocols.result_stats import (
    PipeliningSummaryOut,
    PrefetchSummaryOut,
    SpeculationSummaryOut,
    StepStatsOut,
    TimingsOut,
    step_stats,
)

# -- requests, built per app from its limits ---------------------------------------------------


class QueryRequest(BaseModel):
    """`POST /v1/rag/query`. The bounded fields get their bounds per app (`query_request_model`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    query: str
    pipeline: str = "naive"
    top_k: int | None = None
    nprobe: int | Literal["auto"] | None = None
    max_tokens: int = 256
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    stream: bool = Field(False, description="true: answer as server-sent events (text/event-stream)")
    return_documents: bool = Field(True, description="false: the answer without its documents")
    prefetch: bool = Field(True, description="false: every cluster searched on the CPU (the baseline)")
    pipelining: bool | None = Field(
        None,
        description="iter_retgen, flare and iterative: true: each search starts from the text generated so far while "
        "the step goes on (PipeRAG; the documents may differ, reported in `pipelining`); false: after it; null: the "
        "server's experiments.pipelining",
    )
    search_mode: SearchMode | None = Field(
        None,
        strict=False,  # its value, as JSON sends it
        description="how its searches rank passages: dense (by meaning: the embeddings, IVF at nprobe), keyword (by "
        "words: BM25) or hybrid (both, fused by reciprocal rank); null: the server's retrieval.search_mode",
    )
    speculative_prefill: bool | None = Field(
        None,
        description="true: while a search runs, the prompt of the LLM call after it is prefilled from the search's "
        "provisional top-k (the answer is the same; reported in `speculation`); false: not; null: the server's "
        "experiments.speculative_prefill",
    )


AUTO: Any = Literal["auto"]  # nprobe chosen per search (a value for pydantic, built at run time)


def query_request_model(limits: LimitSettings, pipelines: Sequence[str]) -> type[QueryRequest]:
    """`QueryRequest` for one app: `limits` and the pipeline names become the fields' constraints,
    and so appear in the OpenAPI schema."""
    # The fields' types are made here, at run time, from the limits: values to pydantic, not types to mypy.
    max_tokens = default_max_tokens(limits)
    return create_model(
        "QueryRequest",
        __base__=QueryRequest,
        __module__=__name__,
        query=(
            question_text(limits),
            Field(description=f"the user's question (at most {limits.max_query_chars} characters, not blank)"),
        ),
        pipeline=(
            pipeline_name(pipelines),
            Field("naive" if "naive" in pipelines else pipelines[0], description="one of GET /v1/pipelines"),
        ),
        top_k=(integer(1, limits.max_top_k) | None, Field(None, description="documents to retrieve (default: the server's)")),
        nprobe=(
            integer(1, None) | AUTO | None,
            Field(
                None,
                description="IVF lists to search; more than the datastore has (GET /ready: datastore.nlist, which a "
                "retrain changes) searches them all, as faiss does, and each search step's `stats.nprobe` says how many "
                'it searched; "auto": a pipelined search\'s is the '
                "largest predicted to finish within the generation it overlaps (the others' the default); null: the "
                "server's retrieval.nprobe",
            ),
        ),
        max_tokens=(integer(1, limits.max_tokens), Field(max_tokens, description="tokens of the answer, at most")),
    )


class StepOut(BaseModel):
    stage: str = Field(description="the stage's name, one of the pipeline's (GET /v1/pipelines)")
    role: StageRole = Field(description="what the stage does (see StageInfo)")
    kind: StageKind = Field(description="what sort of work it is, by its role: an LLM call, a retrieval or a prefetch")
    query: str | None
    tokens_in: int
    tokens_out: int
    ms: float
    stats: StepStatsOut | None = Field(description="by kind: an LLM call's, a prefetch's or a search's")
    start_ms: float = Field(description="when the step began, ms after the request did")
    tokens_cached: int = Field(description="an LLM call's: of tokens_in, those the engine's prefix cache held (not prefilled)")


class QueryResponse(BaseModel):
    id: str
    answer: str
    finish_reason: Literal["stop", "length", "deadline"] = Field(
        description="why the answer ended: of itself; at `max_tokens`; or at the server's deadline "
        "(`scheduler.admission_deadline_s` after admission), where every LLM call stops: the answer is what the run had "
        "by then, its latest draft for a pipeline that writes one"
    )
    pipeline: str
    documents: list[RetrievedPassageOut]
    steps: list[StepOut]
    timings: TimingsOut
    prefetch: PrefetchSummaryOut
    tokens_generated: int
    pipelining: PipeliningSummaryOut = Field(
        description="the pipelined retrievals (request field `pipelining`): how many, and how often their documents "
        "differed from what the final query found"
    )
    speculation: SpeculationSummaryOut = Field(
        description="the speculative prefills (request field `speculative_prefill`): how many, how many were prefilled "
        "again, the tokens they computed and those the calls after them reused"
    )
    ingestion: IngestionInfo | None = Field(None, description=ANSWERED_WHILE_INGESTING)

    @classmethod
    def from_result(
        cls, result: RagResult, *, request_id: str, with_documents: bool, ingestion: IngestionProgress | None = None
    ) -> QueryResponse:
        return cls(
            id=request_id,
            answer=result.answer,
            finish_reason=result.finish_reason,
            pipeline=result.pipeline,
            documents=passages_out(result.documents) if with_documents else [],
            steps=[
                StepOut(
                    stage=s.stage.name,
                    role=s.stage.role,
                    kind=s.kind,
                    query=s.query,
                    tokens_in=s.tokens_in,
                    tokens_out=s.tokens_out,
                    ms=s.ms,
                    stats=step_stats(s.stats),
                    start_ms=s.start_ms,
                    tokens_cached=s.tokens_cached,
                )
                for s in result.steps
            ],
            timings=TimingsOut.model_validate(result.timings),
            prefetch=PrefetchSummaryOut.model_validate(result.prefetch),
            tokens_generated=result.tokens_generated,
            pipelining=PipeliningSummaryOut.model_validate(result.pipelining),
            speculation=SpeculationSummaryOut.model_validate(result.speculation),
            ingestion=None if ingestion is None else IngestionInfo.of(ingestion),
        )


class StageUpdate(BaseModel):
    """The data of a streamed `stage` event."""

    stage: str
    role: StageRole
    status: Literal["start", "end"]
    ms: float | None = None


class TokenText(BaseModel):
    """The data of a streamed `token` event: the next piece of the answer."""

    text: str
