"""The FastAPI application: routes, authentication, limits, streaming, metrics."""

# No `from __future__ import annotations`: the routes' body types are this app's request models
# (built from its limits), which FastAPI must see as objects, not as names to look up.

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from telerag.pipelines.types import (
    Pipeline,
    RagResult,
    ResultEvent,
    RunEvent,
    RunOptions,
    StageEvent,
    TokenEvent,
    UsageEvent,
)
from telerag.server import errors
from telerag.server.errors import BodyTooLarge, InvalidField, NotReady, RequestTimeout, Unauthorized
from telerag.server.metrics import Metrics
from telerag.server.protocol import (
    AssistantMessage,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatDelta,
    ErrorDetail,
    ErrorResponse,
    Health,
    Model,
    ModelList,
    PipelineInfo,
    PipelineList,
    QueryResponse,
    Ready,
    StageUpdate,
    TokenText,
    Usage,
    new_id,
    request_models,
)
from telerag.server.runtime import Runtime
from telerag.server.scheduler import Admission, BatchingRetriever
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

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.metrics = Metrics(runtime.cache_stats)
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
            on_change=lambda waiting, running: (self.metrics.queue_depth.set(waiting), self.metrics.in_flight.set(running)),
        )

    def check(self, *, pipeline: str, top_k: int | None, nprobe: int | None, max_tokens: int) -> tuple[Pipeline, RunOptions]:
        """What the request models cannot check: that the server is ready, and nprobe against the
        datastore's nlist when the app was built without it."""
        if not self.runtime.ready:
            raise NotReady("the server is still loading")
        nlist = int(self.runtime.datastore_info.get("nlist", 0))
        if nprobe is not None and nlist and nprobe > nlist:
            raise InvalidField("nprobe", f"nprobe must be at most nlist ({nlist})")
        return self.pipelines[pipeline], RunOptions(
            top_k=top_k or self.settings.retrieval.top_k, nprobe=nprobe, max_tokens=max_tokens,
        )

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

    async def result(self, request: Request, pipeline: Pipeline, query: str, options: RunOptions) -> RagResult:
        """Run to the end; cancelled (LLM aborted, clusters released) if the client goes away."""

        async def run() -> RagResult:
            async with self.admission.slot():
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


def create_app(runtime: Runtime) -> FastAPI:
    settings = runtime.settings
    service = Service(runtime)
    models = request_models(settings.limits, list(service.pipelines), runtime.datastore_info.get("nlist"))
    default_max_tokens = models.query.model_fields["max_tokens"].default
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await service.admission.drain()  # accepted requests finish before the process exits
        await runtime.close()

    # the documentation routes are ours (below), so that they can sit behind the API key
    app = FastAPI(title="telerag", version="0.1.0", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None,
                  description="RAG inference server with lookahead retrieval (TeleRAG). Every error, whatever its "
                              "status, has the body `{\"error\": {\"type\", \"message\", \"field\"?}}` (ErrorResponse).")
    app.state.service = service
    openapi_of_routes = app.openapi

    def openapi_schema() -> dict:
        """FastAPI's schema, plus the models that only streamed events refer to."""
        schema = openapi_of_routes()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, definition in STREAMED_COMPONENTS.items():
            components.setdefault(name, definition)
        return schema

    app.openapi = openapi_schema
    errors.install(app)
    app.add_middleware(BodyLimit, limit=settings.limits.max_body_bytes)
    if settings.server.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.server.cors_origins, allow_methods=["*"], allow_headers=["*"])

    api_key = settings.server.api_key
    bearer = HTTPBearer(auto_error=False, description="the server's API key (`server.api_key`)")

    async def authorized(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        assert api_key is not None  # only routes of an app with a key depend on this
        if credentials is None or not hmac.compare_digest(credentials.credentials.encode(), api_key.get_secret_value().encode()):
            raise Unauthorized("missing or wrong API key (Authorization: Bearer …)")

    # the API, and with server.protect_docs the documentation and metrics, need the key (if set)
    protected = [Depends(authorized)] if api_key else []
    auth_errors = (401,) if api_key else ()
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

    @app.get("/ready", response_model=Ready)
    async def ready() -> Response:
        body = Ready(ready=runtime.ready, engine=getattr(runtime.engine, "name", None), datastore=runtime.datastore_info)
        return JSONResponse(body.model_dump(), status_code=200 if runtime.ready else 503)

    @app.get("/metrics", dependencies=guarded, response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
                        **errors.responses(*guarded_errors)})
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/pipelines", response_model=PipelineList, dependencies=protected, responses=errors.responses(*auth_errors))
    async def pipelines() -> PipelineList:
        return PipelineList(pipelines=[
            PipelineInfo(name=name, description=p.description, stages=[{"name": s.name, "role": s.role} for s in p.stages])
            for name, p in service.pipelines.items()
        ])

    @app.get("/v1/models", response_model=ModelList, dependencies=protected, responses=errors.responses(*auth_errors),
             summary="The models a chat completion may name: the pipelines (OpenAI's model list)")
    async def list_models() -> ModelList:
        return ModelList(data=[Model(id=name, created=started) for name in service.pipelines])

    @app.post("/v1/rag/query", dependencies=protected, responses={**_json_or_events(QueryResponse, QUERY_STREAM, QUERY_EVENTS), **generation_errors})
    async def rag_query(body: models.query, request: Request) -> Response:
        pipeline, options = service.check(pipeline=body.pipeline, top_k=body.top_k, nprobe=body.nprobe, max_tokens=body.max_tokens)
        options.temperature, options.prefetch = body.temperature, body.prefetch
        request_id = new_id("rag")
        if not body.stream:
            result = await service.result(request, pipeline, body.query, options)
            response = QueryResponse.from_result(result, request_id=request_id, with_documents=body.return_documents)
            return Response(response.model_dump_json(), media_type="application/json")
        await service.admission.acquire()  # refuse (429) before the stream starts, not inside it

        async def stream() -> AsyncIterator[bytes]:
            try:
                async for event in service.events(pipeline, body.query, options):
                    if isinstance(event, StageEvent):
                        yield sse("stage", StageUpdate(stage=event.stage, status=event.status, ms=event.ms).model_dump())
                    elif isinstance(event, TokenEvent):
                        yield sse("token", TokenText(text=event.text).model_dump())
                    elif isinstance(event, ResultEvent):
                        response = QueryResponse.from_result(event.result, request_id=request_id, with_documents=body.return_documents)
                        yield sse("result", response.model_dump())
            except Exception as exc:  # noqa: BLE001 - after the stream began, errors travel as an event
                yield sse("error", errors.error_detail(exc).model_dump(exclude_none=True))
            finally:
                service.admission.release()

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions", dependencies=protected,
              responses={**_json_or_events(ChatCompletion, CHAT_STREAM, CHAT_EVENTS), **generation_errors})
    async def chat_completions(body: models.chat, request: Request) -> Response:
        question = body.question
        max_tokens = body.max_tokens if body.max_tokens is not None else default_max_tokens
        pipeline, options = service.check(pipeline=body.model, top_k=None, nprobe=None, max_tokens=max_tokens)
        options.temperature = body.temperature
        request_id = new_id("chatcmpl")
        if not body.stream:
            result = await service.result(request, pipeline, question, options)
            completion = ChatCompletion(id=request_id, model=body.model, usage=_usage(result),
                                        choices=[ChatCompletionChoice(message=AssistantMessage(content=result.answer))])
            return Response(completion.model_dump_json(), media_type="application/json")
        await service.admission.acquire()

        def chunk(delta: ChatDelta, finish_reason: str | None = None) -> bytes:
            choice = ChatChunkChoice(delta=delta, finish_reason=finish_reason)
            return sse_data(ChatCompletionChunk(id=request_id, model=body.model, choices=[choice]).model_dump())

        async def stream() -> AsyncIterator[bytes]:
            try:
                yield chunk(ChatDelta(role="assistant", content=""))
                async for event in service.events(pipeline, question, options):
                    if isinstance(event, TokenEvent):
                        yield chunk(ChatDelta(content=event.text))
                yield chunk(ChatDelta(), finish_reason="stop")
            except Exception as exc:  # noqa: BLE001 - after the stream began, errors travel in the stream
                yield sse_data({"error": errors.error_detail(exc).model_dump(exclude_none=True)})
            finally:
                service.admission.release()
            yield sse_data("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


def _usage(result: RagResult) -> Usage:
    prompt = sum(s.tokens_in for s in result.steps if s.kind == "llm")
    return Usage(prompt_tokens=prompt, completion_tokens=result.tokens_generated, total_tokens=prompt + result.tokens_generated)
