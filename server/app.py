"""The FastAPI application: routes, authentication, limits, streaming, metrics."""

# No `from __future__ import annotations`: the routes' body types are this app's request models
# (built from its limits), which FastAPI must see as objects, not as names to look up.

import asyncio
import contextlib
import hmac
import math
import time
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from telerag.pipelines.registry import PIPELINES
from telerag.pipelines.types import (
    Pipeline,
    RagResult,
    ResultEvent,
    RunEvent,
    RunOptions,
    StageEvent,
    TokenEvent,
    UsageEvent,
    run_result,
)
from telerag.retrieval.cache import CacheStats
from telerag.server import errors
from telerag.server.admission import DEFAULT_PASSAGE_WORDS, TOKENS_PER_WORD, Admission, Refusal, RequestCost, Ticket
from telerag.server.errors import BodyTooLarge, InvalidField, NotReady, RequestTimeout, Unauthorized
from telerag.server.lifecycle import RETRY_AFTER_S, Lifecycle, Phase
from telerag.server.metrics import Metrics
from telerag.server.protocol import (
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ErrorDetail,
    ErrorResponse,
    Health,
    LoadProgress,
    Model,
    ModelList,
    PipelineInfo,
    PipelineList,
    QueryResponse,
    Ready,
    StageInfo,
    StageUpdate,
    TokenText,
    new_id,
    request_models,
)
from telerag.server.runtime import Runtime
from telerag.server.scheduler import BatchingRetriever
from telerag.server.settings import Settings
from telerag.server.streaming import component_schemas, event_schema, json_data, sse, sse_data


class BodyLimit:
    """Refuse request bodies over `limit` bytes (413), whether they declare their length or arrive
    chunked. The body is read here, before the app sees the request: an error raised while
    FastAPI reads it would reach the client as FastAPI's 400 ("error parsing the body")."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body ended
                replay = [message]
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
                break

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()  # then the disconnect, when it comes

        await self.app(scope, replayed, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        await errors.response_for(BodyTooLarge(f"the request body is over {self.limit} bytes"))(scope, receive, send)


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

    def check(self, *, pipeline: str, top_k: int | None, nprobe: int | None, max_tokens: int) -> tuple[Pipeline, RunOptions]:
        """What the request models cannot check: nprobe against the datastore's nlist (the app's
        models are built before the datastore is loaded)."""
        nlist = self.runtime.datastore_info.nlist
        if nprobe is not None and nprobe > nlist:
            raise InvalidField("nprobe", f"nprobe must be at most nlist ({nlist})")
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
        """Run a pipeline (a slot must be held) with the request timeout, recording metrics; the
        tokens it generates count as they are generated, so a cancelled request's count too."""
        started = time.perf_counter()
        outcome = "error"
        first_token = True
        tokens = self.metrics.tokens.labels(pipeline.name)
        try:
            async with asyncio.timeout(self.settings.scheduler.request_timeout_s):
                async for event in pipeline.run(query, options):
                    if isinstance(event, UsageEvent):
                        tokens.inc(event.tokens)
                        continue
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
                return await run_result(self.events(pipeline, query, options))

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


QUERY_EVENTS = """JSON, or with `"stream": true` server-sent events: `stage` (StageUpdate) as each
stage starts and ends, `token` (TokenText) for each piece of the answer, and last either `result`
(the QueryResponse) or, if the run fails after the stream began, `error` (ErrorDetail)."""
CHAT_EVENTS = """JSON, or with `"stream": true` server-sent events as OpenAI sends them: unnamed
events whose data is a ChatCompletionChunk (the first delta sets the role, the next ones add
content, the last has `finish_reason`), then `[DONE]`; a failure after the stream began comes
as `{"error": ErrorDetail}` before `[DONE]`."""
QUERY_STREAM = event_schema({"stage": json_data(StageUpdate), "token": json_data(TokenText),
                             "result": json_data(QueryResponse), "error": json_data(ErrorDetail)})
CHAT_STREAM = event_schema({"message": {"anyOf": [{"const": "[DONE]"}, json_data(ChatCompletionChunk, ErrorResponse)]}})
# the models only the streams refer to, for the schema's components
STREAMED_COMPONENTS = component_schemas([StageUpdate, TokenText, QueryResponse, ErrorDetail, ChatCompletionChunk, ErrorResponse])


def _json_or_events(model: type, events: dict, description: str) -> dict:
    return {200: {"model": model, "description": description, "content": {"text/event-stream": {"schema": events}}}}


def create_app(settings: Settings, lifecycle: Lifecycle | None = None) -> FastAPI:
    """The HTTP API, before anything is loaded: `/health` answers at once, `/ready` and `/v1/*`
    answer 503 until `start_serving` hands it a loaded runtime."""
    lifecycle = lifecycle or Lifecycle()
    # the request models carry the configured limits and the pipelines; nprobe's bound (the
    # datastore's nlist) is checked per request and added to the schema once the datastore is
    # loaded, since it loads after the app exists
    models = request_models(settings.limits, list(PIPELINES), None)
    default_max_tokens = models.query.model_fields["max_tokens"].default
    started = int(time.time())
    # the documentation routes are ours (below), so that they can sit behind the API key
    app = FastAPI(title="telerag", version="0.1.0", openapi_url=None, docs_url=None, redoc_url=None,
                  description="RAG inference server with lookahead retrieval (TeleRAG). Every error, whatever its "
                              "status, has the body `{\"error\": {\"type\", \"message\", \"field\"?}}` (ErrorResponse).")
    app.state.lifecycle = lifecycle
    app.state.service = None
    app.state.metrics = Metrics(lambda: app.state.service.runtime.cache_stats() if app.state.service else CacheStats())
    openapi_of_routes = app.openapi

    def openapi_schema() -> dict:
        """FastAPI's schema, plus the models that only streamed events refer to and, once the
        datastore is loaded, nprobe's upper bound (its nlist)."""
        schema = openapi_of_routes()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, definition in STREAMED_COMPONENTS.items():
            components.setdefault(name, definition)
        if app.state.service is not None:
            nprobe = components["QueryRequest"]["properties"]["nprobe"]["anyOf"][0]
            nprobe["maximum"] = app.state.service.runtime.datastore_info.nlist
        return schema

    app.openapi = openapi_schema
    errors.install(app)
    app.add_middleware(ServingGate, lifecycle=lifecycle)
    app.add_middleware(BodyLimit, limit=settings.limits.max_body_bytes)
    if settings.server.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.server.cors_origins, allow_methods=["*"], allow_headers=["*"])

    def serving() -> Service:
        """The service behind `/v1/*` (ServingGate lets requests through only once there is one)."""
        return app.state.service

    keys = [key.get_secret_value().encode() for key in settings.server.keys()]
    bearer = HTTPBearer(auto_error=False, description="one of the server's API keys (`server.api_key`, `server.api_keys`)")

    async def authorized(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str:
        """The client: which API key it presented (`key-N`, N its place in the settings)."""
        token = credentials.credentials.encode() if credentials is not None else b""
        matches = [hmac.compare_digest(token, key) for key in keys]  # every key compared: constant time
        if credentials is None or not any(matches):
            raise Unauthorized("missing or wrong API key (Authorization: Bearer …)")
        return f"key-{matches.index(True)}"

    async def anyone() -> None:
        """The client of an open API: nobody in particular."""

    # the API, and with server.protect_docs the documentation and metrics, need a key (if set)
    client_of = authorized if keys else anyone
    protected = [Depends(authorized)] if keys else []
    auth_errors = (401,) if keys else ()
    guarded = protected if settings.server.protect_docs else []
    guarded_errors = auth_errors if settings.server.protect_docs else ()
    generation_errors = errors.responses(400, *auth_errors, 413, 422, 429, 502, 503, 504)

    @app.get("/openapi.json", include_in_schema=False, dependencies=guarded)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=guarded)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="telerag API")

    @app.get("/redoc", include_in_schema=False, dependencies=guarded)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title="telerag API")

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

    @app.get("/metrics", dependencies=guarded, response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
                        **errors.responses(*guarded_errors)})
    async def metrics() -> Response:
        return Response(generate_latest(app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/pipelines", response_model=PipelineList, dependencies=protected, responses=errors.responses(*auth_errors, 503))
    async def pipelines(service: Service = Depends(serving)) -> PipelineList:
        return PipelineList(pipelines=[
            PipelineInfo(name=name, description=p.description, stages=[StageInfo(name=s.name, role=s.role) for s in p.stages])
            for name, p in service.pipelines.items()
        ])

    @app.get("/v1/models", response_model=ModelList, dependencies=protected, responses=errors.responses(*auth_errors, 503),
             summary="The models a chat completion may name: the pipelines (OpenAI's model list)")
    async def list_models(service: Service = Depends(serving)) -> ModelList:
        return ModelList(data=[Model(id=name, created=started) for name in service.pipelines])

    @app.post("/v1/rag/query", responses={**_json_or_events(QueryResponse, QUERY_STREAM, QUERY_EVENTS), **generation_errors})
    async def rag_query(body: models.query, request: Request, client: str | None = Depends(client_of),
                        service: Service = Depends(serving)) -> Response:
        pipeline, options = service.check(pipeline=body.pipeline, top_k=body.top_k, nprobe=body.nprobe, max_tokens=body.max_tokens)
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
                        yield sse("stage", StageUpdate(stage=event.stage, status=event.status, ms=event.ms).model_dump())
                    elif isinstance(event, TokenEvent):
                        yield sse("token", TokenText(text=event.text).model_dump())
                    elif isinstance(event, ResultEvent):
                        response = QueryResponse.from_result(event.result, request_id=request_id, with_documents=body.return_documents)
                        completed = True
                        yield sse("result", response.model_dump())
            except Exception as exc:  # noqa: BLE001 - after the stream began, errors travel as an event
                yield sse("error", errors.error_detail(exc).model_dump(exclude_none=True))
            finally:
                service.admission.finish(ticket, completed=completed)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions", responses={**_json_or_events(ChatCompletion, CHAT_STREAM, CHAT_EVENTS), **generation_errors})
    async def chat_completions(body: models.chat, request: Request, client: str | None = Depends(client_of),
                               service: Service = Depends(serving)) -> Response:
        question = body.question
        max_tokens = body.max_tokens if body.max_tokens is not None else default_max_tokens
        pipeline, options = service.check(pipeline=body.model, top_k=None, nprobe=None, max_tokens=max_tokens)
        options.temperature = body.temperature
        ticket = service.admission.admit(service.cost(pipeline, question, options, query_field="messages", top_k_field=None), client)
        request_id = new_id("chatcmpl")
        if not body.stream:
            result = await service.result(request, pipeline, question, options, ticket)
            completion = ChatCompletion.from_result(result, request_id=request_id, model=body.model)
            return Response(completion.model_dump_json(), media_type="application/json")
        await service.admission.start(ticket)

        def chunk(delta: ChatDelta, finish_reason: str | None = None) -> bytes:
            choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
            return sse_data(ChatCompletionChunk(id=request_id, model=body.model, choices=[choice]).model_dump())

        async def stream() -> AsyncIterator[bytes]:
            completed = False
            try:
                yield chunk(ChatDelta(role="assistant", content=""))
                async for event in service.events(pipeline, question, options):
                    if isinstance(event, TokenEvent):
                        yield chunk(ChatDelta(content=event.text))
                completed = True
                yield chunk(ChatDelta(), finish_reason="stop")
            except Exception as exc:  # noqa: BLE001 - after the stream began, errors travel in the stream
                yield sse_data(ErrorResponse(error=errors.error_detail(exc)).model_dump(exclude_none=True))
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
