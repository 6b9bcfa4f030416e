"""Pydantic models of the operations routes: /health, /ready (with what is loading, the datastore's
writes and the Ray tiers) and /v1/pipelines."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    Field,
)

from telerag.documents.ingestion import IngestionProgress
from telerag.pipelines.types import DatastoreInfo, StageRole
from telerag.retrieval.recall import RecallEstimate
from telerag.retrieval.stats import CacheStats


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

    @classmethod
    def of(cls, progress: IngestionProgress) -> IngestionInfo:
        return cls(
            source=progress.source,
            state=progress.state.value,
            documents=progress.documents,
            total_documents=progress.total_documents,
            error=progress.error,
        )


ANSWERED_WHILE_INGESTING = (
    "the datastore's corpus is still being written into it (a first start answers from a sample while it writes the "
    "rest): its documents written so far (`documents`) of `total_documents`, when this answer was made; null when "
    "it holds them all"
)


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
    cache: CacheStats | None = Field(
        None,
        description="the cluster cache now and its counters since start: what prefetches copied (read ahead, from disk for a "
        "datastore on disk), what was evicted before a search read it, and what searches read from disk beside it",
    )
    live: LiveInfo | None = Field(None, description="the datastore's writes (null: a deployment that writes none)")
    recall: RecallEstimate | None = Field(
        None,
        description="the dense search's recall against an exhaustive search, estimated on sampled searches of the "
        "traffic repeated in idle time (retrieval.recall_budget): `recall` over the latest `window` sampled queries "
        "(null before the first), `samples` since start, `target` (retrieval.target_recall); null where not estimated",
    )
    tiers: list[TierState] | None = Field(None, description="on a Ray cluster: each deployment of both tiers")
