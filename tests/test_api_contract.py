"""The HTTP contract a client relies on: one error body for every status, `Retry-After` where
a retry helps, `/v1/models`, documentation and metrics behind the key on request, and the
token count of requests that never finished."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import httpx
import openai
import pytest
from pydantic import ValidationError

from telerag.config.settings import Settings
from telerag.engines.types import Generation, SamplingParams, TokenChunk
from telerag.pipelines.rag.base import GENERATE, PREFETCH, SEARCH
from telerag.pipelines.stats import (
    GenerationStats,
    PipelinedSearch,
    PipeliningSummary,
    PrefetchStepStats,
    PrefetchSummary,
    SearchStats,
    SpeculationSummary,
    SpeculativePrefill,
    Timings,
)
from telerag.pipelines.types import RagResult, Step
from telerag.retrieval.stats import PrefetchStats
from telerag.server.app import create_app, start_serving
from telerag.server.protocols.rag import QueryResponse
from telerag.server.routes import openai as openai_routes
from tests.fake_app import Harness
from tests.fakes import Reply, ScriptedEngine
from tests.serving import serving

KEY = "contract-key"
AUTH = {"authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "content-type": "application/json"}
Send = Callable[[httpx.AsyncClient, Harness], Awaitable[httpx.Response]]


async def _overloaded(client: httpx.AsyncClient, h: Harness) -> httpx.Response:
    first = asyncio.create_task(client.post("/v1/rag/query", json={"query": "slow?"}, headers=AUTH))
    while not h.engine.log:  # the first request holds the only slot
        await asyncio.sleep(0.01)
    try:
        return await client.post("/v1/rag/query", json={"query": "refused?"}, headers=AUTH)
    finally:
        first.cancel()


async def _chunked(size: int) -> AsyncIterator[bytes]:
    for _ in range(size // 8192 + 1):
        yield b" " * 8192


def _break_pipeline(h: Harness) -> None:
    async def broken(query, options, emit):
        raise RuntimeError("secret detail at /srv/data")

    h.app.state.service.pipelines["naive"].run = broken


# (name, harness options, what to break, the request, status, error type, route that documents it)
CASES: list[tuple[str, dict, Callable[[Harness], None] | None, Send, int, str, tuple[str, str] | None]] = [
    (
        "invalid JSON",
        {},
        None,
        lambda c, h: c.post("/v1/rag/query", content=b'{"query":', headers=JSON),
        400,
        "invalid_json",
        ("post", "/v1/rag/query"),
    ),
    (
        "invalid UTF-8",
        {},
        None,
        lambda c, h: c.post("/v1/rag/query", content=b'{"query": "\xff"}', headers=JSON),
        400,
        "invalid_json",
        ("post", "/v1/rag/query"),
    ),
    (
        "deeply nested JSON",
        {},
        None,
        lambda c, h: c.post("/v1/rag/query", content=b"[" * 60_000 + b"]" * 60_000, headers=JSON),
        400,
        "invalid_json",
        ("post", "/v1/rag/query"),
    ),
    (
        "no API key",
        {},
        None,
        lambda c, h: c.post("/v1/rag/query", json={"query": "q"}),
        401,
        "unauthorized",
        ("post", "/v1/rag/query"),
    ),
    ("unknown route", {}, None, lambda c, h: c.get("/v1/nothing-here", headers=AUTH), 404, "not_found", None),
    ("wrong method", {}, None, lambda c, h: c.get("/v1/rag/query", headers=AUTH), 405, "method_not_allowed", None),
    (
        "declared body over the limit",
        {},
        None,
        lambda c, h: c.post("/v1/rag/query", content=b" " * 300_000, headers=JSON),
        413,
        "body_too_large",
        ("post", "/v1/rag/query"),
    ),
    (
        "chunked body over the limit",
        {},
        None,
        lambda c, h: c.post("/v1/rag/query", content=_chunked(300_000), headers=JSON),
        413,
        "body_too_large",
        ("post", "/v1/rag/query"),
    ),
    (
        "invalid field",
        {},
        None,
        lambda c, h: c.post("/v1/rag/query", json={"query": "q", "top_k": 0}, headers=AUTH),
        422,
        "invalid_request",
        ("post", "/v1/rag/query"),
    ),
    (
        "overloaded",
        {"delay": 1.0, "scheduler": {"max_concurrency": 1, "max_queue": 0}},
        None,
        _overloaded,
        429,
        "queue_full",
        ("post", "/v1/rag/query"),
    ),
    (
        "a bug",
        {},
        _break_pipeline,
        lambda c, h: c.post("/v1/rag/query", json={"query": "q"}, headers=AUTH),
        500,
        "internal_error",
        None,
    ),
    (
        "engine failure",
        {},
        lambda h: setattr(h.engine, "fail", True),
        lambda c, h: c.post(
            "/v1/chat/completions", json={"model": "naive", "messages": [{"role": "user", "content": "q"}]}, headers=AUTH
        ),
        502,
        "engine_error",
        ("post", "/v1/chat/completions"),
    ),
    (
        "not ready",
        {},
        lambda h: h.app.state.lifecycle.drain(),
        lambda c, h: c.post("/v1/rag/query", json={"query": "q"}, headers=AUTH),
        503,
        "not_ready",
        ("post", "/v1/rag/query"),
    ),
    (
        "timeout",
        {"delay": 5.0, "scheduler": {"request_timeout_s": 0.2}},
        None,
        lambda c, h: c.post("/v1/rag/query", json={"query": "q"}, headers=AUTH),
        504,
        "timeout",
        ("post", "/v1/rag/query"),
    ),
]


@pytest.mark.parametrize(("name", "options", "breaks", "send", "status", "kind", "route"), CASES, ids=[c[0] for c in CASES])
async def test_every_error_has_the_one_body(name, options, breaks, send, status, kind, route):
    options = {**options, "server": {"api_key": KEY}}
    h = Harness(**options)
    if breaks:
        breaks(h)
    transport = httpx.ASGITransport(app=h.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
        response = await send(client, h)
        schema = (await client.get("/openapi.json")).json()
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    error = body["error"]
    assert list(body) == ["error"] and {"type", "message", "code"} <= error.keys() <= {
        "type",
        "message",
        "code",
        "field",
        "param",
    }
    assert error["code"] == kind and error["message"] and error.get("param") == error.get("field")
    if response.request.url.path in openai_routes.PATHS:  # OpenAI's class of error, where OpenAI clients read it
        assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    else:
        assert error["type"] == kind
    assert ("retry-after" in response.headers) == (status in (429, 503))
    assert re.fullmatch(r"[0-9a-f]{24}", response.headers["x-request-id"])  # every response, refusals and bugs included
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"
    if status == 405:
        assert response.headers["allow"] == "POST"
    if status == 500:
        assert "secret" not in response.text and "Traceback" not in response.text  # nothing of the exception leaks
        assert response.headers["x-request-id"] in body["error"]["message"]  # but the id to find it in the log
    if route:  # and the schema says so
        documented = schema["paths"][route[1]][route[0]]["responses"][str(status)]
        assert documented["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}


async def test_a_fault_is_logged_with_the_request_id_the_client_gave(caplog):
    """A client's X-Request-ID comes back on the response, names the answer, and is in the log
    line of a fault, whether the answer was one body or a stream that had begun."""
    h = Harness()
    transport = httpx.ASGITransport(app=h.app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
        answered = await http.post("/v1/rag/query", json={"query": "q?"}, headers={"x-request-id": "client-7.a"})
        invalid = await http.post("/v1/rag/query", json={"query": "q?"}, headers={"x-request-id": "spaces are not kept"})
        _break_pipeline(h)
        with caplog.at_level("ERROR", logger="telerag.server.errors"):
            failed = await http.post("/v1/rag/query", json={"query": "q?"}, headers={"x-request-id": "client-8"})
            streamed = await http.post(
                "/v1/rag/query", json={"query": "q?", "stream": True}, headers={"x-request-id": "client-9"}
            )
    assert answered.headers["x-request-id"] == "client-7.a" and answered.json()["id"] == "rag-client-7.a"
    assert re.fullmatch(r"[0-9a-f]{24}", invalid.headers["x-request-id"])
    assert failed.status_code == 500 and failed.json()["error"]["message"] == "internal server error (request client-8)"
    error_event = [line for line in streamed.text.splitlines() if line.startswith("data:")][-1]
    assert json.loads(error_event.removeprefix("data:")) == {
        "type": "internal_error",
        "code": "internal_error",
        "message": "internal server error (request client-9)",
    }
    logged = [r.getMessage() for r in caplog.records]
    assert any("client-8" in m and "secret detail" in m for m in logged) and any("client-9" in m for m in logged)


async def test_chunked_body_over_the_limit_is_413_over_a_socket():
    """Through uvicorn: a body sent in chunks with no Content-Length, over `limits.max_body_bytes`."""
    h = Harness(limits={"max_body_bytes": 4096})
    with serving(h.app) as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            response = await client.post("/v1/rag/query", content=_chunked(20_000), headers={"content-type": "application/json"})
            small = await client.post("/v1/rag/query", json={"query": "q?"})
    assert response.status_code == 413
    message = "the request body is over 4096 bytes"
    assert response.json() == {"error": {"type": "body_too_large", "code": "body_too_large", "message": message}}
    assert small.status_code == 200


async def test_models_lists_what_a_chat_completion_may_name():
    h = Harness(server={"api_key": KEY})
    async with h.client() as http:
        assert (await http.get("/v1/models")).status_code == 401
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key=KEY, http_client=http)
        models = [m.id async for m in client.models.list()]
        assert models == list(h.app.state.service.pipelines)
        for model in models:  # each one a chat completion accepts
            completion = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Capital?"}])
            assert completion.choices[0].message.content
        schema = (await http.get("/openapi.json", headers=AUTH)).json()
    assert schema["paths"]["/v1/models"]["get"]["security"] == [{"HTTPBearer": []}]
    assert set(schema["paths"]["/v1/models"]["get"]["responses"]) == {"200", "401", "503"}  # 503: loading


@pytest.mark.parametrize("protect", [False, True])
async def test_protect_docs_puts_docs_and_metrics_behind_the_key(protect):
    h = Harness(server={"api_key": KEY, "protect_docs": protect})
    async with h.client() as client:
        for path in ("/docs", "/redoc", "/openapi.json", "/metrics"):
            anonymous = await client.get(path)
            assert anonymous.status_code == (401 if protect else 200), path
            if protect:
                assert anonymous.json()["error"]["type"] == "unauthorized"
            assert (await client.get(path, headers=AUTH)).status_code == 200, path
        assert (await client.get("/health")).status_code == 200  # probes never need the key
        schema = (await client.get("/openapi.json", headers=AUTH)).json()
    assert ("401" in schema["paths"]["/metrics"]["get"]["responses"]) == protect


def test_protect_docs_needs_an_api_key():
    with pytest.raises(ValidationError, match="protect_docs needs an API key"):
        Settings(server={"protect_docs": True})


class StallingEngine(ScriptedEngine):
    """Streams the first `emit` tokens of its answer, with their ids, then never finishes."""

    def __init__(self, emit: int) -> None:
        super().__init__(lambda prompt: Reply("one two three four five"))
        self.emit = emit
        self.stalled = asyncio.Event()

    async def stream(self, prompts: Sequence[str], params: SamplingParams) -> AsyncIterator[TokenChunk | Generation]:
        for token_id, word in enumerate(["one", "two", "three", "four", "five"][: self.emit]):
            yield TokenChunk(0, word + " ", token_ids=(token_id,))
        self.stalled.set()
        await asyncio.Event().wait()


def tokens_counted(metrics: str, pipeline: str) -> float:
    found = re.search(rf'^telerag_tokens_generated_total{{pipeline="{pipeline}"}} (\S+)$', metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def test_tokens_of_a_cancelled_request_are_counted():
    h = Harness()
    h.runtime.engine = StallingEngine(emit=3)
    h.app = create_app(h.runtime.settings)
    start_serving(h.app, h.runtime)
    async with h.client() as client:
        request = asyncio.create_task(client.post("/v1/rag/query", json={"query": "q?", "pipeline": "naive"}))
        await asyncio.wait_for(h.runtime.engine.stalled.wait(), 10)
        request.cancel()  # the client goes away mid-answer
        for _ in range(200):
            metrics = (await client.get("/metrics")).text
            if 'outcome="cancelled"' in metrics:
                break
            await asyncio.sleep(0.02)
    assert 'telerag_request_seconds_count{outcome="cancelled",pipeline="naive"} 1.0' in metrics
    assert tokens_counted(metrics, "naive") == 3


async def test_tokens_of_a_finished_request_are_counted_once():
    h = Harness()
    async with h.client() as client:
        body = (await client.post("/v1/rag/query", json={"query": "q?", "pipeline": "hyde"})).json()
        metrics = (await client.get("/metrics")).text
    assert body["tokens_generated"] > 0 and len([s for s in body["steps"] if s["kind"] == "llm"]) == 2
    assert tokens_counted(metrics, "hyde") == body["tokens_generated"]


async def test_a_tiny_temperature_samples_like_greedy():
    """Any temperature the schema allows (here the smallest normal float32, found by the fuzzer)
    generates: dividing unshifted logits by it overflowed to inf and the sampler failed (502)."""
    from tests.tiny_models import tiny_engine

    engine = tiny_engine()
    try:
        prompt = [engine.format_prompt("Question: what is a river?\nAnswer:")]
        greedy = await engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0))
        tiny = await engine.generate(prompt, SamplingParams(max_tokens=6, temperature=1.175494351e-38))
    finally:
        await engine.close()
    assert tiny[0].token_ids == greedy[0].token_ids


def test_a_result_is_sent_with_the_documented_field_names():
    """The typed stats become the JSON clients parse: every name, in order; an LLM step's
    `ttft_ms` and a prefetch that did not run leave out what they do not have."""
    pipelined = PipelinedSearch(13, 14.0, None, 0.5, True, False)
    speculative = SpeculativePrefill(0.25, True, 15, None)
    search = SearchStats(1.0, 2.0, 3.0, 4.0, 5.0, 0.5, 6, 7, 8, 9, 10.0, 11, 12, pipelined, speculative, rerank_ms=16.0)
    steps = [
        Step(PREFETCH, "q", stats=PrefetchStepStats(True, 0.25, 2, PrefetchStats(1, 2, 3, 4, 5, 6, 7, 8, 9.0))),
        Step(PREFETCH, "q", stats=PrefetchStepStats()),
        Step(SEARCH, "q", stats=search),
        Step(GENERATE, "q", 3, 4, 5.0, GenerationStats("length", 1.5), 6.0),
        Step(GENERATE, "q", stats=GenerationStats("stop")),
    ]
    summary = PrefetchSummary(1, 2, None, 3, 4, 5, 6)
    speculation = SpeculationSummary(1, 1, 15, 0)
    result = RagResult(
        "a", "naive", [], steps, Timings(*map(float, range(9))), summary, 7, PipeliningSummary(1, 1, 1, 1), speculation
    )
    body = json.loads(QueryResponse.from_result(result, request_id="rag-1", with_documents=True).model_dump_json())
    assert list(body) == [
        *("id", "answer", "finish_reason", "pipeline", "documents", "steps", "timings", "prefetch", "tokens_generated"),
        *("pipelining", "speculation", "ingestion"),
    ]
    assert body["ingestion"] is None  # the datastore holds its whole corpus
    assert body["finish_reason"] == "stop"  # the last answer-writing call's, not the first's "length"
    assert list(body["steps"][0]) == [
        *("stage", "role", "kind", "query", "tokens_in", "tokens_out", "ms", "stats", "start_ms", "tokens_cached")
    ]
    assert [(step["stage"], step["role"], step["kind"]) for step in body["steps"]] == [
        ("prefetch", "prefetch", "prefetch"),
        ("prefetch", "prefetch", "prefetch"),
        ("search", "search", "retrieval"),
        ("generate", "generate", "llm"),
        ("generate", "generate", "llm"),
    ]
    assert [list(step["stats"].items()) for step in body["steps"]] == [
        [
            ("enabled", True),
            ("embed_ms", 0.25),
            ("batch", 2),
            ("clusters_requested", 1),
            ("bytes_requested", 2),
            ("clusters_resident", 3),
            ("clusters_copied", 4),
            ("clusters_skipped", 5),
            ("bytes_copied", 6),
            ("copies", 7),
            ("bytes_queued_ahead", 8),
            ("plan_ms", 9.0),
        ],
        [("enabled", False)],
        [
            ("embed_ms", 1.0),
            ("probe_ms", 2.0),
            ("device_ms", 3.0),
            ("cpu_ms", 4.0),
            ("total_ms", 5.0),
            ("overlap_rate", 0.5),
            ("clusters_device", 6),
            ("clusters_cpu", 7),
            ("clusters_copied_on_demand", 8),
            ("clusters_late", 9),
            ("copy_wait_ms", 10.0),
            ("rerank_ms", 16.0),
            ("nprobe", 11),
            ("batch", 12),
            (
                "pipelined",
                {
                    "launched_after_tokens": 13,
                    "generation_left_ms": 14.0,
                    "budget_ms": None,
                    "cosine": 0.5,
                    "searched_again": True,
                    "same_documents": False,
                },
            ),
            ("speculative", {"lists_share": 0.25, "reprefilled": True, "prefilled_tokens": 15, "reused_tokens": None}),
        ],
        [("ttft_ms", 1.5), ("finish_reason", "length")],
        [("finish_reason", "stop")],
    ]
    assert list(body["timings"].items()) == [
        ("total_ms", 0.0),
        ("embed_ms", 1.0),
        ("prefetch_ms", 2.0),
        ("pre_retrieval_ms", 3.0),
        ("search_ms", 4.0),
        ("search_device_ms", 5.0),
        ("search_cpu_ms", 6.0),
        ("llm_ms", 7.0),
        ("generate_ms", 8.0),
    ]
    assert list(body["prefetch"].items()) == [
        ("clusters_prefetched", 1),
        ("bytes_prefetched", 2),
        ("overlap_rate", None),
        ("clusters_device", 3),
        ("clusters_cpu", 4),
        ("clusters_copied_on_demand", 5),
        ("clusters_late", 6),
    ]
    assert body["pipelining"] == {"retrievals": 1, "searched_again": 1, "checked": 1, "differed": 1}
    assert body["speculation"] == {"prefills": 1, "reprefilled": 1, "prefilled_tokens": 15, "reused_tokens": 0}
