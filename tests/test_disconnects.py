"""A client that goes away over a real socket (uvicorn, both HTTP implementations) cancels its
run at once, however it asked for the answer: the LLM call is aborted, the clusters released,
the slot or the place in the queue freed."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator

import pytest

from telerag.server.app import create_app, start_serving
from telerag.server.process.runtime import Runtime
from telerag.server.service import Service
from tests.fake_app import DATASTORE_INFO, settings
from tests.fakes import RecordingRetriever, Reply, ScriptedEngine
from tests.serving import serving

WAIT_S = 10.0  # far longer than a cancellation takes, far shorter than the engine's delay


def post(address: tuple[str, int], path: str, body: dict) -> socket.socket:
    """A request sent, its answer not read."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(address, timeout=WAIT_S)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def eventually(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class Server:
    def __init__(self, service: Service, engine: ScriptedEngine, retriever: RecordingRetriever, address: tuple[str, int]) -> None:
        self.service, self.engine, self.retriever, self.address = service, engine, retriever, address

    def generating(self) -> int:
        """LLM calls begun and not ended."""
        return sum(1 if kind == "llm_start" else -1 for kind, _ in self.engine.log)


@pytest.fixture(params=["httptools", "h11"])
def server(request) -> Iterator[Server]:
    config = settings(scheduler={"max_concurrency": 1, "max_queue": 4, "admission_deadline_s": None})
    engine = ScriptedEngine(lambda prompt: Reply("never said"), delay=60.0)
    retriever = RecordingRetriever()
    app = create_app(config)
    service = start_serving(app, Runtime(settings=config, engine=engine, retriever=retriever, datastore_info=DATASTORE_INFO))
    with serving(app, http=request.param, lifespan="off") as base:
        yield Server(service, engine, retriever, ("127.0.0.1", int(base.rsplit(":", 1)[1])))


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/rag/query", {"query": "q?", "pipeline": "hyde"}),
        ("/v1/rag/query", {"query": "q?", "pipeline": "hyde", "stream": True}),
        ("/v1/chat/completions", {"model": "hyde", "messages": [{"role": "user", "content": "q?"}]}),
        ("/v1/chat/completions", {"model": "hyde", "messages": [{"role": "user", "content": "q?"}], "stream": True}),
    ],
    ids=["rag", "rag-stream", "chat", "chat-stream"],
)
def test_a_client_that_leaves_mid_generation_cancels_its_run(server, path, body):
    sock = post(server.address, path, body)
    assert eventually(lambda: server.generating() == 1)
    sock.close()
    assert eventually(lambda: server.generating() == 0), "the LLM call went on"
    assert eventually(lambda: server.service.admission.n_running == 0), "the slot was kept"
    assert server.retriever.prefetches and not server.retriever.outstanding


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_while_queued_gives_up_its_place(server, stream):
    first = post(server.address, "/v1/rag/query", {"query": "first?"})
    assert eventually(lambda: server.generating() == 1)
    queued = post(server.address, "/v1/rag/query", {"query": "queued?", "stream": stream})
    assert eventually(lambda: server.service.admission.n_waiting == 1)
    queued.close()
    assert eventually(lambda: server.service.admission.n_waiting == 0), "the place in the queue was kept"
    assert server.service.admission.n_running == 1  # the first goes on
    first.close()
    assert eventually(lambda: server.service.admission.n_running == 0)
