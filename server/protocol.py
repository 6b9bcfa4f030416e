"""Pydantic models of every request and response of the HTTP API.

The request models carry the server's limits (`Settings.limits`, the served pipelines, the
datastore's nlist), so they are built per app (`query_request_model`; the OpenAI routes' are in
`openai_protocol`): what the OpenAPI schema
says a field accepts is exactly what the server accepts. Requests are strict (`"top_k": "3"`
and `"stream": 0` are refused, not coerced).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    create_model,
)
from pydantic_core import PydanticCustomError

from telerag.pipelines.types import DatastoreInfo, Document, RagResult, StageKind, StageRole
from telerag.server.result_stats import (
    PipeliningSummaryOut,
    PrefetchSummaryOut,
    SpeculationSummaryOut,
    StepStatsOut,
    TimingsOut,
    step_stats,
)
from telerag.server.settings import LimitSettings

# A query needs one character that is not white space. Spelled out rather than `\S`, whose
# meaning differs between regex engines (U+0085 and U+FEFF): so pydantic, JSON Schema (ECMA-262)
# and a client's validator agree on which queries are blank.
NON_BLANK = r"[^\t\n\x0b\f\r \u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff]"


def _integral(value: Any) -> Any:
    """JSON Schema counts 2.0 as an integer, so the server does too (but never "2" or true)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(low: int, high: int | None) -> Any:
    """An integer in [low, high] (no upper bound with None); 2.0 counts, "2" and true do not."""
    return Annotated[int, Field(ge=low, le=high), BeforeValidator(_integral)]


class ErrorDetail(BaseModel):
    """What went wrong, with OpenAI's keys too (`param`, `code`), so that OpenAI clients read it."""

    type: str = Field(
        description="a stable slug, e.g. invalid_request, body_too_large, queue_full, not_found; on the OpenAI routes "
        "(/v1/chat/completions, /v1/models) OpenAI's class of error instead: invalid_request_error, "
        "authentication_error, rate_limit_error or server_error"
    )
    message: str = Field(description="what went wrong, for a human")
    field: str | None = Field(None, description="the request field at fault (dotted path), when there is one")
    param: str | None = Field(None, description="the same as `field`, by OpenAI's name")
    code: str | None = Field(None, description="the slug, on every route (where `type` is OpenAI's class, the reason)")


class ErrorResponse(BaseModel):
    """The body of every error the server answers, whatever its status."""

    error: ErrorDetail


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
        "server's retrieval.pipelining",
    )
    speculative_prefill: bool | None = Field(
        None,
        description="true: while a search runs, the prompt of the LLM call after it is prefilled from the search's "
        "provisional top-k (the answer is the same; reported in `speculation`); false: not; null: the server's "
        "retrieval.speculative_prefill",
    )


AUTO: Any = Literal["auto"]  # nprobe chosen per search (a value for pydantic, built at run time)

UNSUPPORTED = "unsupported"  # a pydantic error type: the request asks for what this server does not do (400, not 422)


def refuse(message: str) -> PydanticCustomError:
    return PydanticCustomError(UNSUPPORTED, message)


def pipeline_name(pipelines: Sequence[str]) -> Any:
    """A field that names one of the served pipelines."""
    return Literal[tuple(pipelines)]


def question_text(limits: LimitSettings) -> Any:
    """A question: not blank, at most `limits.max_query_chars` characters."""
    return Annotated[str, StringConstraints(min_length=1, max_length=limits.max_query_chars, pattern=NON_BLANK)]


def default_max_tokens(limits: LimitSettings) -> int:
    """An answer's token limit when a request names none (a chat completion's as a query's)."""
    return min(256, limits.max_tokens)


def query_request_model(limits: LimitSettings, pipelines: Sequence[str], nlist: int | None = None) -> type[QueryRequest]:
    """`QueryRequest` for one app: `limits`, the pipeline names and the datastore's `nlist` (None:
    not known yet, so nprobe's upper bound is checked per request instead) become the fields'
    constraints, and so appear in the OpenAPI schema."""
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
            integer(1, nlist) | AUTO | None,
            Field(
                None,
                description="IVF lists to search (at most the datastore's nlist); \"auto\": a pipelined search's is the "
                "largest predicted to finish within the generation it overlaps (the others' the default); null: the "
                "server's retrieval.nprobe",
            ),
        ),
        max_tokens=(integer(1, limits.max_tokens), Field(max_tokens, description="tokens of the answer, at most")),
    )


# -- responses ----------------------------------------------------------------------------------


class DocumentOut(BaseModel):
    id: int
    doc_id: str
    title: str
    text: str
    score: float


def documents_out(documents: Sequence[Document]) -> list[DocumentOut]:
    return [DocumentOut(**vars(d)) for d in documents]


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
    documents: list[DocumentOut]
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

    @classmethod
    def from_result(cls, result: RagResult, *, request_id: str, with_documents: bool) -> QueryResponse:
        return cls(
            id=request_id,
            answer=result.answer,
            finish_reason=result.finish_reason,
            pipeline=result.pipeline,
            documents=documents_out(result.documents) if with_documents else [],
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


class StageInfo(BaseModel):
    name: str
    role: StageRole = Field(
        description="prefetch: embed q_in and copy its clusters; pre_retrieval: the LLM call the "
        "prefetch runs beside, whose output makes q_out; search: embed q_out and search; llm: another "
        "LLM call whose output is not the answer (a draft for a judge, a judgement, a critique); "
        "generate: an LLM call that writes answer text"
    )


class PipelineInfo(BaseModel):
    name: str
    description: str
    stages: list[StageInfo]


class PipelineList(BaseModel):
    pipelines: list[PipelineInfo]


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class LoadProgress(BaseModel):
    """How far the current load step's work is (a checksum pass, a build's embedding, ...)."""

    task: str = Field(description='e.g. "verify checksums", "embed passages", "pin host vectors"')
    done: float
    total: float | None = Field(description="null when unknown")
    unit: str = Field(description='"B" for bytes, else the task\'s own unit')
    fraction: float | None = Field(description="done / total, 0..1")


class TierState(BaseModel):
    """On a Ray cluster: one deployment of the inference or the retrieval tier and its replicas."""

    tier: Literal["ingress", "inference", "retrieval"]
    deployment: str
    running: int = Field(description="replicas running now")
    status: str = Field(description="Ray Serve's: HEALTHY, UPDATING, UPSCALING, DOWNSCALING, UNHEALTHY, ...")


class IngestionInfo(BaseModel):
    """A corpus being written into the datastore while it serves (the embedded default's first run)."""

    source: str = Field(description="the corpus")
    state: Literal["ingesting", "retraining", "done", "failed"] = Field(
        description="retraining: every document is written and the centroids are trained again on them all"
    )
    documents: int = Field(description="the corpus's documents written so far")
    total_documents: int
    error: str | None = Field(None, description="failed: why (the next start goes on from the last block written)")


class LiveInfo(BaseModel):
    """The datastore's writes: how far its log is, what it holds now, how even its lists are."""

    writable: bool = Field(description="false: this server serves it read-only (documents.writable, or another holds it)")
    generation: int = Field(description="the generation of its files: one more at each compaction or retrain")
    lsn: int = Field(description="the last acknowledged write's position in the log")
    documents: int
    passages: int
    delta_rows: int = Field(description="rows added since the datastore's files were written")
    tombstones: int = Field(description="deleted rows still in its files or delta (filtered in the scan)")
    wal_bytes: int
    list_imbalance: float = Field(description="the largest IVF list over the mean list (1: even)")
    ingestion: IngestionInfo | None = Field(
        None, description="the corpus being written into it while it serves (null: none since this server started)"
    )


class Ready(BaseModel):
    """`GET /ready`: 200 once the engine and datastore are up; 503 while loading or draining. On a
    Ray cluster (`telerag serve --ray`) also 503 while a deployment of either tier has no replica
    running."""

    ready: bool
    status: Literal["loading", "ready", "draining"]
    loading: str | None = Field(None, description='while loading: the step, e.g. "checking datastore", "loading model"')
    progress: LoadProgress | None = Field(None, description="while loading, for a step with a progress bar: how far it is")
    loading_s: float | None = Field(None, description="while loading: seconds since the load began")
    step_s: float | None = Field(
        None, description="while loading: seconds since the current step began (every step, with a progress bar or without)"
    )
    engine: str | None = None
    datastore: DatastoreInfo | None = None
    live: LiveInfo | None = Field(None, description="the datastore's writes (null: a deployment that writes none)")
    tiers: list[TierState] | None = Field(None, description="on a Ray cluster: each deployment of both tiers")


def new_request_id() -> str:
    return uuid.uuid4().hex[:24]
