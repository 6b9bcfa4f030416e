"""One real `telerag serve` process on loopback, with the real embedded models (Gemma 3 270M,
all-MiniLM-L6-v2) over a slice of the built-in Wikipedia. Slow: the first run converts the
GGUF (about two minutes), later runs reuse the converted model."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pipelines.embedder import Embedder
from retrieval.builder import build_datastore
from retrieval.corpus import read_wikipedia, split_passages

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["Albert Einstein", "Mount Everest", "Photosynthesis", "William Shakespeare", "Amazon River", "Jupiter"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def wiki_slice(tmp_path_factory) -> Path:
    articles = list(read_wikipedia())
    chosen = [a for a in articles if a.title in TOPICS] + articles[:150]
    out = tmp_path_factory.mktemp("wiki") / "ds"
    embedder = Embedder.embedded_default()
    build_datastore(split_passages(chosen), embedder.encode, embedder=embedder.name, out_dir=out, progress=False)
    return out


@pytest.fixture(scope="module")
def served(wiki_slice) -> tuple[str, subprocess.Popen]:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TELERAG_SCHEDULER__REQUEST_TIMEOUT_S": "120"}
    process = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--datastore", str(wiki_slice), "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if process.poll() is not None:
            pytest.fail(f"telerag serve exited early:\n{process.stdout.read()[-4000:]}")
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        process.kill()
        pytest.fail("telerag serve did not become ready")
    yield base, process
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture()
def server(served) -> str:
    return served[0]


def test_real_server_answers_from_the_right_article(server):
    response = httpx.post(f"{server}/v1/rag/query", json={"query": "Who developed the theory of relativity?", "max_tokens": 32}, timeout=180)
    assert response.status_code == 200, response.text
    body = response.json()
    assert "Albert Einstein" in [d["title"] for d in body["documents"]]
    assert body["answer"].strip()
    assert body["timings"]["total_ms"] > 0 and body["steps"][0]["stage"] == "prefetch"


def test_real_server_streams(server):
    with httpx.stream("POST", f"{server}/v1/rag/query", json={"query": "How tall is Mount Everest?", "stream": True, "max_tokens": 24}, timeout=180) as response:
        blocks = "".join(response.iter_text()).strip().split("\n\n")
    events = [block.split("\n")[0].removeprefix("event: ") for block in blocks]
    assert events[-1] == "result" and "stage" in events
    result = json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))
    assert "Mount Everest" in [d["title"] for d in result["documents"]]


def test_real_server_metrics(server):
    text = httpx.get(f"{server}/metrics", timeout=10).text
    assert "telerag_request_seconds_count" in text and "telerag_cache_capacity_bytes" in text


def test_shutdown_lets_accepted_requests_finish(served):
    base, process = served
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            httpx.post, f"{base}/v1/rag/query", json={"query": "What is photosynthesis?", "max_tokens": 48}, timeout=180
        )
        time.sleep(1.0)  # the request is admitted and running
        process.send_signal(signal.SIGTERM)
        response = pending.result()
    assert response.status_code == 200 and response.json()["answer"]
    # uvicorn re-raises the signal once it has shut down gracefully
    assert process.wait(timeout=60) in (0, -signal.SIGTERM)
