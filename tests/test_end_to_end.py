"""One real `telerag serve` process on loopback, with the real embedded models (Gemma 3 270M,
all-MiniLM-L6-v2) over a slice of the built-in Wikipedia: every path a client uses, through a
real socket. The server runs with an API key, a small cluster cache (so prefetches pin
clusters even without a GPU), a batching window and small admission limits. Slow: the first
run converts the GGUF (about two minutes), later runs reuse the converted model."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.fake_app import EXPECTED_METRICS
from tests.serving import build_wikipedia_slice, start_server

pytestmark = [pytest.mark.slow, pytest.mark.minutes(3)]  # the first run's GGUF conversion 2 min in CI

KEY = "e2e-secret"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_CONCURRENCY, MAX_QUEUE = 3, 1
TOPICS = ["Albert Einstein", "Mount Everest", "Photosynthesis", "William Shakespeare", "Amazon River", "Jupiter"]


@pytest.fixture(scope="module")
def wiki_slice(tmp_path_factory) -> Path:
    return build_wikipedia_slice(tmp_path_factory.mktemp("wiki") / "ds", TOPICS, others=150)


@pytest.fixture(scope="module")
def served(wiki_slice, tmp_path_factory) -> tuple[str, subprocess.Popen]:
    env = {
        "TELERAG_SERVER__API_KEY": KEY,
        "TELERAG_SCHEDULER__REQUEST_TIMEOUT_S": "120",
        "TELERAG_SCHEDULER__BATCH_WINDOW_MS": "100",
        "TELERAG_SCHEDULER__MAX_CONCURRENCY": str(MAX_CONCURRENCY),
        "TELERAG_SCHEDULER__MAX_QUEUE": str(MAX_QUEUE),
        "TELERAG_RETRIEVAL__CACHE_MB": "0.5",
        "TELERAG_RETRIEVAL__PREFETCH_BUDGET_MB": "0.2",
        # these tests count on the queue, not on this machine's speed (tests/test_admission.py tests the deadline)
        "TELERAG_SCHEDULER__ADMISSION_DEADLINE_S": "600",
    }
    server = start_server(["--datastore", str(wiki_slice)], tmp_path_factory.mktemp("server") / "server.log", env=env)
    try:
        server.wait_ready(timeout=600)
        yield server.base, server.process
    finally:
        server.stop()


@pytest.fixture()
def server(served) -> str:
    return served[0]


def query(server: str, timeout: float = 180, **body) -> httpx.Response:
    return httpx.post(f"{server}/v1/rag/query", json=body, headers=AUTH, timeout=timeout)


def sample(metrics: str, name: str, *labels: str) -> float:
    """The value of one Prometheus sample (0 when the series does not exist yet)."""
    for line in metrics.splitlines():
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(label in series for label in labels):
            return float(value)
    return 0.0


def metrics(server: str) -> str:
    return httpx.get(f"{server}/metrics", timeout=10).text


def test_real_server_answers_from_the_right_article(server):
    response = query(server, query="Who developed the theory of relativity?", max_tokens=32)
    assert response.status_code == 200, response.text
    body = response.json()
    assert "Albert Einstein" in [d["title"] for d in body["documents"]]
    assert body["answer"].strip()
    assert body["timings"]["total_ms"] > 0 and body["steps"][0]["stage"] == "prefetch"
    assert body["prefetch"]["clusters_prefetched"] > 0 and body["prefetch"]["clusters_device"] > 0


def test_real_server_streams(server):
    with httpx.stream(
        "POST",
        f"{server}/v1/rag/query",
        headers=AUTH,
        timeout=180,
        json={"query": "How tall is Mount Everest?", "stream": True, "max_tokens": 24},
    ) as response:
        blocks = "".join(response.iter_text()).strip().split("\n\n")
    events = [block.split("\n")[0].removeprefix("event: ") for block in blocks]
    assert events[-1] == "result" and "stage" in events
    result = json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))
    assert "Mount Everest" in [d["title"] for d in result["documents"]]


def test_real_server_with_the_openai_client(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, timeout=180)
    completion = client.chat.completions.create(
        model="naive", max_tokens=16, messages=[{"role": "user", "content": "What is the largest planet, Jupiter?"}]
    )
    assert completion.choices[0].message.content.strip() and completion.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model="hyde", max_tokens=16, stream=True, messages=[{"role": "user", "content": "Where does the Amazon River flow?"}]
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream).strip()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong").chat.completions.create(
            model="naive", messages=[{"role": "user", "content": "x"}]
        )
    datastore = httpx.get(f"{server}/ready", timeout=10).json()["datastore"]
    texts = ["Who developed the theory of relativity?", "Einstein's theory of relativity", "bread flour and yeast"]
    embedded = client.embeddings.create(model=datastore["embedder"], input=texts)  # the datastore's own embedder
    vectors = np.array([d.embedding for d in embedded.data])
    assert vectors.shape == (3, datastore["dim"]) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-4)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.2


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {KEY}"])
def test_real_server_refuses_a_missing_or_wrong_api_key(server, header):
    headers = {"authorization": header} if header else {}
    response = httpx.post(f"{server}/v1/rag/query", json={"query": "q?"}, headers=headers, timeout=30)
    assert response.status_code == 401 and response.json()["error"]["type"] == "unauthorized"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"query": " "}, "query"),
        ({"query": "q", "top_k": 1000}, "top_k"),
        ({"query": "q", "max_tokens": 100_000}, "max_tokens"),
        ({"query": "q", "pipeline": "../../etc/passwd"}, "pipeline"),
        ({"query": ["not", "text"]}, "query"),
    ],
)
def test_real_server_answers_bad_input_with_422_naming_the_field(server, body, field):
    response = httpx.post(f"{server}/v1/rag/query", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field


def test_real_server_batches_concurrent_requests(server):
    before = metrics(server)
    questions = ["Who was William Shakespeare?", "What is photosynthesis?", "How big is Jupiter?"]
    with ThreadPoolExecutor(len(questions)) as pool:
        responses = list(pool.map(lambda q: query(server, query=q, max_tokens=8), questions))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    after = metrics(server)
    calls = sample(after, "telerag_batch_size_count", 'kind="prefetch"') - sample(
        before, "telerag_batch_size_count", 'kind="prefetch"'
    )
    queries = sample(after, "telerag_batch_size_sum", 'kind="prefetch"') - sample(
        before, "telerag_batch_size_sum", 'kind="prefetch"'
    )
    assert queries == len(questions) and calls < len(questions)  # their prefetches shared a call


def test_real_server_refuses_overload_with_429(server):
    sent = MAX_CONCURRENCY + MAX_QUEUE + 2
    # all sent at once, so none can be answered (and free its place) before the last arrives: each
    # client is made first (its SSL context takes a while on a loaded box), then a barrier lets them go
    start = threading.Barrier(sent)

    def send(i: int) -> httpx.Response:
        with httpx.Client(headers=AUTH, timeout=180) as client:
            start.wait()
            return client.post(
                f"{server}/v1/rag/query", json={"query": f"Tell me about the Amazon River ({i})", "max_tokens": 48}
            )

    with ThreadPoolExecutor(sent) as pool:
        responses = list(pool.map(send, range(sent)))
    refused = [r for r in responses if r.status_code == 429]
    assert len(refused) >= sent - MAX_CONCURRENCY - MAX_QUEUE
    causes = {"queue_full", "deadline", "calibrating"}  # the queue's bound, or admission's model: each says which
    assert all(r.headers["retry-after"] and r.json()["error"]["type"] in causes for r in refused)
    assert all(r.status_code == 200 for r in responses if r not in refused)


def test_real_server_disconnect_aborts_the_request_and_releases_its_clusters(server):
    before = sample(metrics(server), "telerag_request_seconds_count", 'outcome="cancelled"')
    with pytest.raises(httpx.ReadTimeout):  # three rounds of retrieval and generation: still running at 1 s
        query(server, timeout=1.0, query="What did Albert Einstein discover?", pipeline="iter_retgen", max_tokens=200)
    deadline = time.time() + 60
    while time.time() < deadline:
        text = metrics(server)
        if sample(text, "telerag_requests_in_flight") == 0:
            break
        time.sleep(0.25)
    assert sample(text, "telerag_request_seconds_count", 'outcome="cancelled"') == before + 1
    assert sample(text, "telerag_requests_in_flight") == 0 and sample(text, "telerag_cache_pinned_clusters") == 0


def test_real_server_metrics(server):
    text = metrics(server)
    for name in EXPECTED_METRICS:
        assert any(line.startswith(name) for line in text.splitlines()), name
    assert sample(text, "telerag_cache_bytes_copied_total") > 0 and sample(text, "telerag_cache_hits_total") > 0


def test_shutdown_lets_accepted_requests_finish(served):
    base, process = served
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(query, base, query="What is photosynthesis?", max_tokens=48)
        time.sleep(1.0)  # the request is admitted and running
        process.send_signal(signal.SIGTERM)
        response = pending.result()
    assert response.status_code == 200 and response.json()["answer"]
    assert process.wait(timeout=60) == 0
