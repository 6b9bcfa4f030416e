"""The FastAPI application: routes, authentication, limits, streaming, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from telerag.pipelines.types import Pipeline, RagResult, ResultEvent, RunEvent, RunOptions, StageEvent, TokenEvent
from telerag.server import errors
from telerag.server.admission import DEFAULT_PASSAGE_WORDS, TOKENS_PER_WORD, Admission, Refusal, RequestCost, Ticket
from telerag.server.errors import InvalidField, NotReady, RequestTimeout, Unauthorized
from telerag.server.lifecycle import RETRY_AFTER_S, Lifecycle, Phase
from telerag.server.metrics import Metrics
from telerag.server.protocol import (
    ChatCompletionRequest,
    Health,
    LoadProgress,
    PipelineInfo,
    PipelineList,
    QueryRequest,
    QueryResponse,
    Ready,
    chat_chunk,
    chat_completion,
    new_id,
)
from telerag.server.runtime import Runtime
from telerag.server.scheduler import BatchingRetriever
from telerag.server.settings import Settings
from telerag.server.streaming import sse, sse_data


class BodyLimit:
    """Refuse request bodies over `limit` bytes (413), whether or not they declare a length."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except _TooLarge:
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = {"error": {"type": "body_too_large", "message": f"request body over {self.limit} bytes"}}
        await JSONResponse(body, status_code=413)(scope, receive, send)


class _TooLarge(Exception):
    pass


class Service:
    """What the routes share: the runtime, the pipelines over the batching retriever, admission, metrics."""

    def __init__(self, runtime: Runtime, metrics: Metrics) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.metrics = metrics
        scheduler = self.settings.scheduler
        self.retriever = BatchingRetriever(
            runtime.retriever,
            window_ms=scheduler.batch_window_ms,
            max_batch=scheduler.max_batch,
            on_batch=lambda kind, size: self.metrics.batch_size.labels(kind).observe(size),
        )
        self.pipelines: dict[str, Pipeline] = runtime.pipelines(self.retriever)
        self.admission = Admission(
            scheduler.max_concurrency,
            scheduler.max_queue,
            deadline_s=scheduler.admission_deadline_s,
            max_in_flight_per_key=scheduler.max_in_flight_per_key,
            on_change=lambda waiting, running: (self.metrics.queue_depth.set(waiting), self.metrics.in_flight.set(running)),
            on_refuse=lambda reason: self.metrics.refusals.labels(reason.value).inc(),
        )
        self.metrics.expected_wait.set_function(self.admission.expected_wait_s)
        words = self.runtime.datastore_info.passage_words or DEFAULT_PASSAGE_WORDS
        self.passage_tokens = math.ceil(TOKENS_PER_WORD * words)

    def check(self, *, query: str, pipeline: str, top_k: int | None, nprobe: int | None, max_tokens: int,
              pipeline_field: str = "pipeline") -> tuple[Pipeline, RunOptions]:
        """Validate a request against the server's limits; the error names the field."""
        limits = self.settings.limits
        if not query.strip():
            raise InvalidField("query", "query must not be empty")
        if len(query) > limits.max_query_chars:
            raise InvalidField("query", f"query is {len(query)} characters; the limit is {limits.max_query_chars}")
        if pipeline not in self.pipelines:
            raise InvalidField(pipeline_field, f"unknown pipeline {pipeline!r}; one of: {', '.join(self.pipelines)}")
        if top_k is not None and top_k > limits.max_top_k:
            raise InvalidField("top_k", f"top_k must be at most {limits.max_top_k}")
        nlist = self.runtime.datastore_info.nlist
        if nprobe is not None and nprobe > nlist:
            raise InvalidField("nprobe", f"nprobe must be at most nlist ({nlist})")
        if max_tokens > limits.max_tokens:
            raise InvalidField("max_tokens", f"max_tokens must be at most {limits.max_tokens}")
        return self.pipelines[pipeline], RunOptions(
            top_k=top_k or self.settings.retrieval.top_k, nprobe=nprobe, max_tokens=max_tokens,
        )

    def cost(self, pipeline: Pipeline, query: str, options: RunOptions, *, query_field: str = "query",
             top_k_field: str | None = "top_k") -> RequestCost:
        """The request's cost for admission; 422 past `limits.max_prompt_tokens`, naming the field
        that put it there (`top_k` when the query alone fits)."""
        query_tokens = self.runtime.engine.count_tokens(query)
        prompt_tokens = query_tokens + options.top_k * self.passage_tokens
        limit = self.settings.limits.max_prompt_tokens
        if prompt_tokens > limit:
            self.metrics.refusals.labels(Refusal.PROMPT_TOKENS.value).inc()
            field = top_k_field if top_k_field and query_tokens <= limit else query_field
            raise InvalidField(field, f"the prompt would be about {prompt_tokens} tokens (the query's {query_tokens} and "
                                      f"{options.top_k} passages of about {self.passage_tokens}); the limit is {limit}")
        return RequestCost(prompt_tokens=prompt_tokens, max_tokens=options.max_tokens, llm_calls=pipeline.llm_calls)

    async def events(self, pipeline: Pipeline, query: str, options: RunOptions) -> AsyncIterator[RunEvent]:
        """Run a pipeline (a slot must be held) with the request timeout, recording metrics."""
        started = time.perf_counter()
        outcome = "error"
        first_token = True
        try:
            async with asyncio.timeout(self.settings.scheduler.request_timeout_s):
                async for event in pipeline.run(query, options):
                    if isinstance(event, TokenEvent) and first_token:
                        first_token = False
                        self.metrics.ttft.labels(pipeline.name).observe(time.perf_counter() - started)
                    if isinstance(event, ResultEvent):
                        self.metrics.observe_result(event.result)
                        outcome = "ok"
                    yield event
        except TimeoutError:
            outcome = "timeout"
            raise RequestTimeout(f"the request took longer than {self.settings.scheduler.request_timeout_s} s") from None
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self.metrics.request_latency.labels(pipeline.name, outcome).observe(time.perf_counter() - started)

    async def result(self, request: Request, pipeline: Pipeline, query: str, options: RunOptions,
                     ticket: Ticket) -> RagResult:
        """Run an admitted request to the end; cancelled (LLM aborted, clusters released) if the client goes away."""

        async def run() -> RagResult:
            async with self.admission.running(ticket):
                async for event in self.events(pipeline, query, options):
                    if isinstance(event, ResultEvent):
                        return event.result
            raise RuntimeError("the pipeline ended without a result")

        task = asyncio.ensure_future(run())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.25)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            self.admission.finish(ticket, completed=False)  # a no-op unless the task never began


class ServingGate:
    """`/v1/*` answers 503 (with Retry-After, in the one error body) unless the server is ready:
    while it loads, and while it drains before stopping. The rest (`/health`, `/ready`,
    `/metrics`, the docs) always answers."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle) -> None:
        self.app, self.lifecycle = app, lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and self.lifecycle.phase != Phase.READY:
            refusal = NotReady(self.lifecycle.unavailable_reason, retry_after=RETRY_AFTER_S)
            await errors.response_for(refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(settings: Settings, lifecycle: Lifecycle | None = None) -> FastAPI:
    """The HTTP API, before anything is loaded: `/health` answers at once, `/ready` and `/v1/*`
    answer 503 until `start_serving` hands it a loaded runtime."""
    lifecycle = lifecycle or Lifecycle()
    app = FastAPI(title="telerag", version="0.1.0",
                  description="RAG inference server with lookahead retrieval (TeleRAG).")
    app.state.lifecycle = lifecycle
    app.state.service = None
    app.state.metrics = Metrics(lambda: app.state.service.runtime.cache_stats() if app.state.service else {})
    errors.install(app)
    app.add_middleware(ServingGate, lifecycle=lifecycle)
    app.add_middleware(BodyLimit, limit=settings.limits.max_body_bytes)
    if settings.server.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.server.cors_origins, allow_methods=["*"], allow_headers=["*"])

    def serving() -> Service:
        """The service behind `/v1/*` (ServingGate lets requests through only once there is one)."""
        return app.state.service

    keys = [key.get_secret_value().encode() for key in settings.server.keys()]

    async def authorized(request: Request) -> str | None:
        """The client: which API key it presented (`key-N`, N its place in the settings); None
        when the API is open."""
        if not keys:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        matches = [hmac.compare_digest(token.encode(), key) for key in keys]  # every key compared: constant time
        if scheme.lower() != "bearer" or not any(matches):
            raise Unauthorized("missing or wrong API key (Authorization: Bearer …)")
        return f"key-{matches.index(True)}"

    @app.get("/health", response_model=Health)
    async def health() -> Health:
        return Health()

    @app.get("/ready", response_model=Ready, responses={503: {"model": Ready, "description": "loading or draining"}})
    async def ready() -> Response:
        service: Service | None = app.state.service
        progress = lifecycle.progress
        body = Ready(
            ready=lifecycle.phase == Phase.READY,
            status=lifecycle.phase.value,
            loading=lifecycle.step if lifecycle.phase == Phase.LOADING else None,
            progress=None if progress is None else LoadProgress(
                task=progress.step, done=progress.done, total=progress.total, unit=progress.unit, fraction=progress.fraction,
            ),
            engine=None if service is None else getattr(service.runtime.engine, "name", None),
            datastore=None if service is None else service.runtime.datastore_info,
        )
        return Response(body.model_dump_json(), media_type="application/json", status_code=200 if body.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/pipelines", response_model=PipelineList, dependencies=[Depends(authorized)])
    async def pipelines(service: Service = Depends(serving)) -> PipelineList:
        return PipelineList(pipelines=[
            PipelineInfo(name=name, description=p.description, stages=[{"name": s.name, "role": s.role} for s in p.stages])
            for name, p in service.pipelines.items()
        ])

    @app.post("/v1/rag/query", response_model=QueryResponse)
    async def rag_query(body: QueryRequest, request: Request, client: str | None = Depends(authorized),
                        service: Service = Depends(serving)) -> Response:
        pipeline, options = service.check(query=body.query, pipeline=body.pipeline, top_k=body.top_k,
                                          nprobe=body.nprobe, max_tokens=body.max_tokens)
        options.temperature, options.prefetch = body.temperature, body.prefetch
        ticket = service.admission.admit(service.cost(pipeline, body.query, options), client)  # or 429, at once
        request_id = new_id("rag")
        if not body.stream:
            result = await service.result(request, pipeline, body.query, options, ticket)
            response = QueryResponse.from_result(result, request_id=request_id, with_documents=body.return_documents)
            return Response(response.model_dump_json(), media_type="application/json")
        await service.admission.start(ticket)  # wait for a slot before the stream starts

        async def stream() -> AsyncIterator[bytes]:
            completed = False
            try:
                async for event in service.events(pipeline, body.query, options):
                    if isinstance(event, StageEvent):
                        yield sse("stage", {"stage": event.stage, "status": event.status, "ms": event.ms})
                    elif isinstance(event, TokenEvent):
                        yield sse("token", {"text": event.text})
                    else:
                        response = QueryResponse.from_result(event.result, request_id=request_id, with_documents=body.return_documents)
                        completed = True
                        yield sse("result", response.model_dump())
            except Exception as exc:  # noqa: BLE001 - after the stream began, errors travel as an event
                yield sse("error", errors.error_body(exc)["error"])
            finally:
                service.admission.finish(ticket, completed=completed)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, client: str | None = Depends(authorized),
                               service: Service = Depends(serving)) -> Response:
        users = [m.content for m in body.messages if m.role == "user"]
        if not users:
            raise InvalidField("messages", "at least one user message is required")
        max_tokens = body.max_tokens or 256
        pipeline, options = service.check(query=users[-1], pipeline=body.model, top_k=None, nprobe=None,
                                          max_tokens=max_tokens, pipeline_field="model")
        options.temperature = body.temperature
        ticket = service.admission.admit(service.cost(pipeline, users[-1], options, query_field="messages", top_k_field=None), client)
        request_id = new_id("chatcmpl")
        if not body.stream:
            result = await service.result(request, pipeline, users[-1], options, ticket)
            usage = _usage(result)
            return JSONResponse(chat_completion(request_id, body.model, result.answer, usage))
        await service.admission.start(ticket)

        async def stream() -> AsyncIterator[bytes]:
            completed = False
            try:
                yield sse_data(chat_chunk(request_id, body.model, {"role": "assistant", "content": ""}))
                async for event in service.events(pipeline, users[-1], options):
                    if isinstance(event, TokenEvent):
                        yield sse_data(chat_chunk(request_id, body.model, {"content": event.text}))
                completed = True
                yield sse_data(chat_chunk(request_id, body.model, {}, finish_reason="stop"))
            except Exception as exc:  # noqa: BLE001 - after the stream began, errors travel in the stream
                yield sse_data({"error": errors.error_body(exc)["error"]})
            finally:
                service.admission.finish(ticket, completed=completed)
            yield sse_data("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


def start_serving(app: FastAPI, runtime: Runtime) -> Service:
    """Serve `/v1/*` from `runtime`, now loaded: `/ready` turns 200."""
    service = Service(runtime, app.state.metrics)
    app.state.service = service
    app.state.lifecycle.ready()
    return service


def _usage(result: RagResult) -> dict[str, Any]:
    prompt = sum(s.tokens_in for s in result.steps if s.kind == "llm")
    return {"prompt_tokens": prompt, "completion_tokens": result.tokens_generated, "total_tokens": prompt + result.tokens_generated}
