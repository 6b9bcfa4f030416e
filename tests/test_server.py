"""The HTTP API through an in-process ASGI client, on a runtime of fakes."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from telerag.server.app import create_app
from telerag.server.process.lifecycle import Lifecycle
from telerag.utils.progress import StepProgress
from tests.fake_app import DATASTORE_INFO, METRIC_SERIES, Harness, sdk, settings
from tests.fakes import Reply


async def test_query_json():
    h = Harness()
    async with h.client() as client:
        response = await client.post(
            "/v1/rag/query", json={"query": "What is the capital of France?", "pipeline": "hyde", "top_k": 2}
        )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["answer"] == "Paris is the capital of France" and body["pipeline"] == "hyde"
    assert len(body["documents"]) == 2 and {"id", "doc_id", "title", "text", "score"} <= body["documents"][0].keys()
    assert [s["stage"] for s in body["steps"]] == ["prefetch", "hypothetical_passage", "search", "generate"]
    assert {"total_ms", "pre_retrieval_ms", "prefetch_ms", "search_device_ms", "search_cpu_ms"} <= body["timings"].keys()
    assert body["prefetch"]["overlap_rate"] == 0.75 and body["prefetch"]["clusters_device"] == 3
    assert body["id"].startswith("rag-")
    assert not h.retriever.outstanding


async def test_query_without_documents_and_prefetch_off():
    h = Harness()
    async with h.client() as client:
        response = await client.post("/v1/rag/query", json={"query": "q?", "return_documents": False, "prefetch": False})
    assert response.status_code == 200 and response.json()["documents"] == []


async def test_query_sse():
    h = Harness()
    body = {"query": "Capital of France?", "stream": True}
    async with h.client() as client, client.stream("POST", "/v1/rag/query", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join([chunk async for chunk in response.aiter_text()])
    events = [
        (block.split("\n")[0][len("event: ") :], json.loads(block.split("\n")[1][len("data: ") :]))
        for block in raw.strip().split("\n\n")
    ]
    names = [name for name, _ in events]
    assert names[0] == "stage" and names[-1] == "result" and "token" in names
    tokens = "".join(data["text"] for name, data in events if name == "token")
    assert tokens.strip() == events[-1][1]["answer"] == "Paris is the capital of France"


async def test_sse_error_event_after_the_stream_began():
    h = Harness()
    h.engine.fail = True
    body = {"query": "q?", "stream": True, "pipeline": "hyde"}
    async with h.client() as client, client.stream("POST", "/v1/rag/query", json=body) as response:
        raw = "".join([chunk async for chunk in response.aiter_text()])
    assert response.status_code == 200
    last = raw.strip().split("\n\n")[-1]
    assert last.startswith("event: error") and "engine_error" in last
    assert not h.retriever.outstanding


async def test_openai_client():
    h = Harness()
    async with h.client() as http:
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http)
        completion = await client.chat.completions.create(
            model="naive", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "Capital of France?"}]
        )
        assert completion.choices[0].message.content == "Paris is the capital of France"
        assert completion.usage.completion_tokens > 0
        stream = await client.chat.completions.create(
            model="hyde", messages=[{"role": "user", "content": "Capital?"}], stream=True
        )
        pieces = [chunk.choices[0].delta.content or "" async for chunk in stream]
        assert "".join(pieces).strip() == "Paris is the capital of France"
        with pytest.raises(openai.UnprocessableEntityError):
            await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


async def test_openai_clients_limit_by_max_completion_tokens_and_learn_when_the_limit_cut_the_answer():
    """The SDK's current name for the limit is honoured as `max_tokens` is, and an answer the
    limit cut says `length`, in the JSON and in the stream's last chunk."""
    h = Harness()
    question = [{"role": "user", "content": "Capital of France?"}]
    async with h.client() as http:
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http)
        cut = await client.chat.completions.create(model="naive", messages=question, max_completion_tokens=3)
        assert cut.choices[0].message.content.split() == ["Paris", "is", "the"] and cut.choices[0].finish_reason == "length"
        whole = await client.chat.completions.create(model="naive", messages=question, max_completion_tokens=50)
        assert whole.choices[0].finish_reason == "stop"
        stream = await client.chat.completions.create(model="naive", messages=question, max_tokens=2, stream=True)
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks).split() == ["Paris", "is"]
        assert chunks[-1].choices[0].finish_reason == "length"
        both = await client.chat.completions.create(model="naive", messages=question, max_tokens=5, max_completion_tokens=3)
        assert len(both.choices[0].message.content.split()) == 3  # both limits honoured: the tighter


async def test_an_admitted_request_is_answered_by_its_deadline_with_what_it_had_and_says_so():
    """A request admitted on an estimate that proves wrong (the model runs on) is still answered
    within `scheduler.admission_deadline_s`: its generation stops, the answer is what it wrote by
    then, and each API says so in its own words; the metric counts it apart from the answers."""
    h = Harness(scheduler={"admission_deadline_s": 1.5})
    h.engine.script = lambda prompt: Reply(" ".join(["Paris"] * 1000))
    h.engine.token_delay = 0.005  # 5 s for the whole reply
    question = [{"role": "user", "content": "Capital of France?"}]
    async with h.client() as http:
        native = (await http.post("/v1/rag/query", json={"query": "Capital of France?", "max_tokens": 1000})).json()
        chat = await sdk(http).chat.completions.create(model="naive", messages=question, max_tokens=1000)
        stream = await sdk(http).chat.completions.create(model="naive", messages=question, max_tokens=1000, stream=True)
        chunks = [chunk async for chunk in stream]
        metrics = (await http.get("/metrics")).text
    assert native["finish_reason"] == "deadline" and 0 < len(native["answer"].split()) < 1000
    assert native["steps"][-1]["stats"]["finish_reason"] == "deadline"
    assert chat.choices[0].finish_reason == "length" and 0 < len(chat.choices[0].message.content.split()) < 1000
    assert chunks[-1].choices[0].finish_reason == "length"
    assert 'telerag_request_seconds_count{outcome="deadline",pipeline="naive"} 3.0' in metrics
    assert 'outcome="ok"' not in metrics


async def test_concurrent_requests_are_batched():
    h = Harness(scheduler={"admission_deadline_s": None})  # a cold server with a deadline admits one at a time
    async with h.client() as client:
        responses = await asyncio.gather(
            *[client.post("/v1/rag/query", json={"query": f"question {i}?", "top_k": 2}) for i in range(6)]
        )
        assert all(r.status_code == 200 for r in responses)
        metrics = (await client.get("/metrics")).text
    assert max(h.retriever.search_batches) > 1  # several requests' searches ran as one call
    sums = [line for line in metrics.splitlines() if line.startswith('telerag_batch_size_count{kind="search"}')]
    count = float(sums[0].split()[-1])
    assert count < 6  # fewer batched calls than requests


async def test_overload_answers_429_with_retry_after():
    h = Harness(delay=0.5, scheduler={"max_concurrency": 1, "max_queue": 0})
    async with h.client() as client:
        first = asyncio.create_task(client.post("/v1/rag/query", json={"query": "slow?"}))
        await asyncio.sleep(0.1)
        second = await client.post("/v1/rag/query", json={"query": "refused?"})
        assert second.status_code == 429
        assert second.headers["retry-after"] == "1"
        assert second.json()["error"]["type"] == "queue_full"
        assert (await first).status_code == 200


async def test_disconnect_aborts_generation_and_releases_clusters():
    h = Harness(delay=30.0)
    async with h.client() as client:
        request = asyncio.create_task(client.post("/v1/rag/query", json={"query": "never answered", "pipeline": "hyde"}))
        for _ in range(100):
            await asyncio.sleep(0.02)
            if h.engine.log:
                break
        assert h.engine.log[-1][0] == "llm_start"
        request.cancel()  # the client goes away mid-generation
        with pytest.raises(asyncio.CancelledError):
            await request
        for _ in range(100):
            if h.engine.log[-1][0] == "llm_end" and not h.retriever.outstanding:
                break
            await asyncio.sleep(0.02)
    assert h.engine.log[-1][0] == "llm_end"  # generation stopped
    assert h.retriever.prefetches and not h.retriever.outstanding  # its clusters were released


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"query": ""}, "query"),
        ({"query": "   "}, "query"),
        ({"query": "x" * 5000}, "query"),
        ({"query": "q", "pipeline": "nope"}, "pipeline"),
        ({"query": "q", "top_k": 0}, "top_k"),
        ({"query": "q", "top_k": 51}, "top_k"),
        ({"query": "q", "nprobe": 0}, "nprobe"),
        ({"query": "q", "max_tokens": 5000}, "max_tokens"),
        ({"query": "q", "temperature": -1}, "temperature"),
        ({"query": 3}, "query"),
        ({}, "query"),
    ],
)
async def test_bad_input_is_422_naming_the_field(body, field):
    h = Harness()
    async with h.client() as client:
        response = await client.post("/v1/rag/query", json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field and error["message"]


async def test_body_too_large():
    h = Harness()
    async with h.client() as client:
        response = await client.post(
            "/v1/rag/query", content=b"{" + b" " * 300_000 + b"}", headers={"content-type": "application/json"}
        )
    assert response.status_code == 413


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic secret", "secret"])
async def test_api_key_required(header):
    h = Harness(server={"api_key": "secret"})
    async with h.client() as client:
        headers = {"authorization": header} if header else {}
        response = await client.post("/v1/rag/query", json={"query": "q"}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "unauthorized"
        ok = await client.post("/v1/rag/query", json={"query": "q"}, headers={"authorization": "Bearer secret"})
        assert ok.status_code == 200
        assert (await client.get("/health")).status_code == 200


async def test_health_ready_pipelines():
    h = Harness()
    async with h.client() as client:
        assert (await client.get("/health")).json() == {"status": "ok"}
        ready = (await client.get("/ready")).json()
        assert ready["ready"] and ready["status"] == "ready" and ready["loading"] is None
        assert ready["datastore"] == {**vars(DATASTORE_INFO)} and ready["engine"] == h.engine.name
        pipelines = (await client.get("/v1/pipelines")).json()["pipelines"]
        assert {p["name"] for p in pipelines} == {"naive", "hyde", "subquestion", "iterative", "iter_retgen", "flare", "self_rag"}
        assert all(any(s["role"] == "prefetch" for s in p["stages"]) for p in pipelines)
        assert (await client.get("/docs")).status_code == 200


async def test_loading_answers_health_and_refuses_v1_with_retry_after():
    lifecycle = Lifecycle()
    app = create_app(settings(), lifecycle)
    lifecycle.loading("checking datastore")
    lifecycle.report(StepProgress("verify checksums", done=25, total=100, unit="B"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        ready = await client.get("/ready")
        assert ready.status_code == 503
        body = ready.json()
        assert body.pop("loading_s") >= body.pop("step_s") >= 0
        assert body == {
            "ready": False,
            "status": "loading",
            "loading": "checking datastore",
            "engine": None,
            "datastore": None,
            "cache": None,
            "live": None,
            "recall": None,
            "progress": {"task": "verify checksums", "done": 25, "total": 100, "unit": "B", "fraction": 0.25},
        }
        for method, path, kind in (
            ("POST", "/v1/rag/query", "not_ready"),
            ("POST", "/v1/chat/completions", "server_error"),  # OpenAI's class of error, on its routes
            ("GET", "/v1/pipelines", "not_ready"),
        ):
            refused = await client.request(method, path, json={"query": "q"})
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
            message = "the server is still loading (checking datastore)"
            assert refused.json()["error"] == {"type": kind, "code": "not_ready", "message": message}


async def test_draining_refuses_new_work_and_says_so():
    h = Harness()
    h.app.state.lifecycle.drain()
    async with h.client() as client:
        ready = await client.get("/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "draining" and not ready.json()["ready"]
        refused = await client.post("/v1/rag/query", json={"query": "q"})
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["type"] == "not_ready" and "shutting down" in refused.json()["error"]["message"]
        assert (await client.get("/health")).status_code == 200


async def test_metrics_expose_everything():
    h = Harness()
    async with h.client() as client:
        await client.post("/v1/rag/query", json={"query": "q?", "pipeline": "hyde"})
        text = (await client.get("/metrics")).text
    lines = text.splitlines()
    for metric, labels in METRIC_SERIES:
        assert any(line.startswith(metric) and all(label in line for label in labels) for line in lines), (metric, labels)


@pytest.mark.parametrize(("error", "status"), [("EngineOverloaded", 429), ("GenerationAborted", 503), ("EngineError", 502)])
async def test_engine_errors_map_to_status(error, status):
    import telerag.engines.errors as engine_errors

    h = Harness()

    async def failing(prompts, params):
        raise getattr(engine_errors, error)("engine says no")
        yield  # an async generator

    h.engine.stream = failing
    async with h.client() as client:
        response = await client.post("/v1/rag/query", json={"query": "q?"})
    assert response.status_code == status
    assert response.json()["error"]["message"] == "engine says no"
    assert ("retry-after" in response.headers) == (status in (429, 503))
    assert not h.retriever.outstanding
