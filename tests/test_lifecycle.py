"""A real `telerag serve` process through its life, on loopback with the tiny random LM and a small
datastore: it listens before it loads and says what is loading, refuses a damaged datastore
before the model loads, drains at SIGTERM and exits 0, and stops at once at a second signal or
the end of its grace period. The load and the requests are held where a test needs them by
`tests/gated_serve.py`. Slow: each test starts a server process."""

from __future__ import annotations

import json
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serving import ServerProcess, build_small_datastore, save_tiny_lm, start_server
from tests.tiny_models import tiny_embedder_dir

pytestmark = pytest.mark.slow

QUERY = {"query": "What is topic 3 about?", "max_tokens": 4}


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(model directory, embedder directory, datastore): made once, copied where a test damages it."""
    root = tmp_path_factory.mktemp("assets")
    embedder = tiny_embedder_dir(32, 0)
    return save_tiny_lm(root / "tiny-lm"), embedder, build_small_datastore(root / "datastore", embedder)


def serve(
    assets,
    tmp_path: Path,
    *gates: str,
    datastore: Path | None = None,
    model: Path | None = None,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    lm, embedder, store = assets
    args = ["--model", str(model or lm), "--embedder", str(embedder), "--datastore", str(datastore or store)]
    command = (sys.executable, "-m", "tests.gated_serve", *gates) if gates else (sys.executable, "-m", "telerag.cli")
    return start_server(args, tmp_path / "server.log", env=env, command=command)


def poll(server: ServerProcess, path: str, until, timeout: float = 120) -> httpx.Response:
    """GET `path` until `until(response)` holds (connection errors retried)."""
    deadline = time.monotonic() + timeout
    while True:
        assert server.process.poll() is None, f"exited with {server.process.returncode}:\n{server.output()[-3000:]}"
        try:
            response = httpx.get(server.base + path, timeout=5)
            if until(response):
                return response
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{path} never matched:\n{server.output()[-3000:]}"
        time.sleep(0.1)


def in_flight(server: ServerProcess) -> bool:
    metrics = httpx.get(f"{server.base}/metrics", timeout=5).text
    return any(line == "telerag_requests_in_flight 1.0" for line in metrics.splitlines())


def send_query(server: ServerProcess, results: list) -> threading.Thread:
    def run() -> None:
        try:
            results.append(httpx.post(f"{server.base}/v1/rag/query", json=QUERY, timeout=120))
        except httpx.HTTPError as exc:
            results.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_listens_at_once_and_reports_the_load_until_ready(assets, tmp_path):
    gate = tmp_path / "checksums"
    datastore = shutil.copytree(assets[2], tmp_path / "datastore")  # a copy: every file read against its checksum
    server = serve(assets, tmp_path, "--checksum-gate", str(gate), datastore=datastore)
    try:
        assert poll(server, "/health", lambda r: r.status_code == 200).json() == {"status": "ok"}
        # the bar reports at 0 when it is made, then after each block; the gate holds it before vectors.npy
        loading = poll(server, "/ready", lambda r: (r.json().get("progress") or {}).get("fraction", 0) > 0)
        assert loading.status_code == 503
        body = loading.json()
        assert body["ready"] is False and body["status"] == "loading" and body["loading"] == "checking datastore"
        assert body["progress"]["task"] == "verify checksums" and body["progress"]["unit"] == "B"
        assert 0 < body["progress"]["fraction"] < 1  # every file but vectors.npy is counted
        for method, path in (("POST", "/v1/rag/query"), ("GET", "/v1/pipelines")):
            refused = httpx.request(method, server.base + path, json=QUERY, timeout=5)
            assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
            assert refused.json()["error"]["type"] == "not_ready"
            assert refused.json()["error"]["message"] == "the server is still loading (checking datastore)"

        gate.touch()
        server.wait_ready()
        ready = httpx.get(f"{server.base}/ready", timeout=5)
        assert ready.json()["status"] == "ready" and ready.json()["engine"] and ready.json()["progress"] is None
        assert ready.json()["loading_s"] is None and ready.json()["step_s"] is None
        assert ready.json()["datastore"]["passages"] > 0 and ready.json()["datastore"]["embedder"] == assets[1].name
        assert str(datastore) not in ready.text and str(Path.home()) not in ready.text  # no host paths
        answered = httpx.post(f"{server.base}/v1/rag/query", json=QUERY, timeout=60)
        assert answered.status_code == 200 and answered.json()["documents"]
        server.signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0
    finally:
        server.stop()
    output = server.output()
    steps = ["loading libraries", "loading embedder", "checking datastore", "loading model", "opening datastore", "warming up"]
    assert [line.split("start-up: ")[1] for line in output.splitlines() if "start-up: " in line] == steps


def test_listens_before_torch_loads(assets, tmp_path):
    """torch takes seconds to import (more with CUDA): the listener must not wait for it."""
    gate = tmp_path / "imports"
    server = serve(assets, tmp_path, "--import-gate", str(gate))
    try:
        assert poll(server, "/health", lambda r: r.status_code == 200).json() == {"status": "ok"}
        loading = httpx.get(f"{server.base}/ready", timeout=5)
        assert loading.status_code == 503 and loading.json()["loading"] == "loading libraries"
        # a step without a progress bar still shows that it is moving: its time so far
        later = poll(server, "/ready", lambda r: r.json()["step_s"] > loading.json()["step_s"])
        assert later.json()["progress"] is None and later.json()["loading"] == "loading libraries"
        assert later.json()["loading_s"] >= later.json()["step_s"] > 0
        refused = httpx.post(f"{server.base}/v1/rag/query", json=QUERY, timeout=5)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
        gate.touch()
        server.wait_ready()
        assert httpx.post(f"{server.base}/v1/rag/query", json=QUERY, timeout=60).status_code == 200
    finally:
        server.stop()


def truncate_vectors(datastore: Path) -> None:
    vectors = datastore / "vectors.npy"
    vectors.write_bytes(vectors.read_bytes()[:-100])


def flip_a_vector_byte(datastore: Path) -> None:
    vectors = datastore / "vectors.npy"
    data = bytearray(vectors.read_bytes())
    data[-1] ^= 0xFF
    vectors.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "reason"), [(truncate_vectors, "truncated?"), (flip_a_vector_byte, "fails its sha256 checksum")]
)
def test_a_damaged_datastore_is_refused_before_the_model_loads(assets, tmp_path, damage, reason):
    datastore = shutil.copytree(assets[2], tmp_path / "datastore")
    damage(datastore)
    # a model that is not there: had the server loaded the model first, it would fail on that instead
    server = serve(assets, tmp_path, datastore=datastore, model=tmp_path / "no-such-model")
    try:
        status = server.process.wait(timeout=120)
    finally:
        server.stop()
    output = server.output()
    assert status == 1, output
    assert "Traceback" not in output and "loading model" not in output
    (failure,) = [line for line in output.splitlines() if "start-up failed" in line]
    assert f"{datastore / 'vectors.npy'}" in failure and reason in failure
    assert (
        f"telerag datastore build --corpus FILE (or --wikipedia) --embedder DIR (the model {assets[1].name}) "
        f"--out {datastore} --overwrite" in failure
    )


def sigterm_with_one_in_flight(server: ServerProcess, results: list) -> threading.Thread:
    """Once the server is ready, send a query, wait until it runs, then send SIGTERM and wait
    until the server says it is draining; the thread that waits for the query's answer."""
    server.wait_ready()
    request = send_query(server, results)
    poll(server, "/metrics", lambda r: in_flight(server))
    server.signal(signal.SIGTERM)
    poll(server, "/ready", lambda r: r.json()["status"] == "draining")
    return request


def test_sigterm_drains_the_request_in_flight_then_exits_0(assets, tmp_path):
    gate = tmp_path / "searches"
    server = serve(assets, tmp_path, "--search-gate", str(gate))
    results: list = []
    try:
        request = sigterm_with_one_in_flight(server, results)
        draining = httpx.get(f"{server.base}/ready", timeout=5)
        assert draining.status_code == 503 and not draining.json()["ready"]
        refused = httpx.post(f"{server.base}/v1/rag/query", json=QUERY, timeout=5)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert refused.json()["error"]["message"] == "the server is shutting down"
        assert httpx.get(f"{server.base}/health", timeout=5).status_code == 200

        gate.touch()  # the request in flight may now finish
        request.join(timeout=60)
        (answered,) = results
        assert isinstance(answered, httpx.Response) and answered.status_code == 200, answered
        assert answered.json()["documents"]
        assert server.process.wait(timeout=60) == 0
    finally:
        gate.touch()
        server.stop()
    assert "every accepted request finished" in server.output()


@pytest.mark.parametrize("stop", ["second signal", "grace period"])
def test_a_second_signal_or_the_end_of_the_grace_stops_at_once_with_1(assets, tmp_path, stop):
    gate = tmp_path / "searches"  # never opened: the request in flight never finishes
    grace = "600" if stop == "second signal" else "1"
    server = serve(assets, tmp_path, "--search-gate", str(gate), env={"TELERAG_SERVER__SHUTDOWN_GRACE_S": grace})
    results: list = []
    try:
        request = sigterm_with_one_in_flight(server, results)
        if stop == "second signal":
            server.signal(signal.SIGINT)
        assert server.process.wait(timeout=30) == 1
        request.join(timeout=30)
    finally:
        server.stop()
    assert "with 1 accepted request(s) unfinished" in server.output()
    assert not isinstance(results[0], httpx.Response)  # its connection closed without an answer


def test_a_restart_starts_from_the_measurements_the_last_run_kept(assets, tmp_path):
    """The first start measures itself and keeps what it measured when it stops (SIGTERM); the
    next finds it, so its warm-up is one request, and it answers as before."""
    kept = tmp_path / "calibration"
    env = {"TELERAG_SERVER__CALIBRATION_DIR": str(kept)}
    (tmp_path / "first").mkdir()
    first = serve(assets, tmp_path / "first", env=env)
    try:
        first.wait_ready()
        assert httpx.post(first.base + "/v1/rag/query", json=QUERY, timeout=60).status_code == 200
        first.signal(signal.SIGTERM)
        assert first.process.wait(timeout=60) == 0
    finally:
        first.stop()
    (file,) = kept.glob("admission-*.json")
    assert "admission starts from" not in first.output()
    (tmp_path / "second").mkdir()
    second = serve(assets, tmp_path / "second", env=env)
    try:
        second.wait_ready()
        assert httpx.post(second.base + "/v1/rag/query", json=QUERY, timeout=60).status_code == 200
    finally:
        second.stop()
    assert f"admission starts from the measurements kept in {file}" in second.output()
    kept_rates = json.loads(file.read_text())["measured"]["rate"]
    assert {point["running"] for point in kept_rates} >= {1, 8}  # the first start's burst measured them
