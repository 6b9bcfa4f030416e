"""Pydantic models of every request and response of the HTTP API."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from telerag.pipelines.types import DatastoreInfo, RagResult


class QueryRequest(BaseModel):
    query: str = Field(..., min_length=1, description="the user's question")
    pipeline: str = Field("naive", description="one of GET /v1/pipelines")
    top_k: int | None = Field(None, ge=1, description="documents to retrieve (default: the server's)")
    nprobe: int | None = Field(None, ge=1, description="IVF lists to search (at most nlist)")
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    stream: bool = False
    return_documents: bool = True
    prefetch: bool = Field(True, description="false: every cluster searched on the CPU (the baseline)")

    model_config = {"extra": "forbid"}


class DocumentOut(BaseModel):
    id: int
    doc_id: str
    title: str
    text: str
    score: float


class StepOut(BaseModel):
    stage: str
    kind: str
    query: str | None
    tokens_in: int
    tokens_out: int
    ms: float
    stats: dict[str, Any]
    start_ms: float = Field(description="when the step began, ms after the request did")


class QueryResponse(BaseModel):
    id: str
    answer: str
    pipeline: str
    documents: list[DocumentOut]
    steps: list[StepOut]
    timings: dict[str, float]
    prefetch: dict[str, Any]
    tokens_generated: int

    @classmethod
    def from_result(cls, result: RagResult, *, request_id: str, with_documents: bool) -> QueryResponse:
        return cls(
            id=request_id,
            answer=result.answer,
            pipeline=result.pipeline,
            documents=[DocumentOut(**vars(d)) for d in result.documents] if with_documents else [],
            steps=[StepOut(**vars(s)) for s in result.steps],
            timings=result.timings,
            prefetch=result.prefetch,
            tokens_generated=result.tokens_generated,
        )


class PipelineInfo(BaseModel):
    name: str
    description: str
    stages: list[dict[str, str]]


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


class Ready(BaseModel):
    """`GET /ready`: 200 once the engine and datastore are up; 503 while loading or draining."""

    ready: bool
    status: Literal["loading", "ready", "draining"]
    loading: str | None = Field(None, description='while loading: the step, e.g. "checking datastore", "loading model"')
    progress: LoadProgress | None = None
    engine: str | None = None
    datastore: DatastoreInfo | None = None


# -- OpenAI-compatible chat completions ------------------------------------------------------


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatCompletionRequest(BaseModel):
    model: str = Field(..., description="the pipeline")
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    stream: bool = False


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def chat_completion(request_id: str, model: str, answer: str, usage: dict[str, int]) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}],
        "usage": usage,
    }


def chat_chunk(request_id: str, model: str, delta: dict[str, str], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }
