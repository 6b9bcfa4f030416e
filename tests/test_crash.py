"""A real `telerag serve` taking a stream of writes, killed with SIGKILL at random points, again and
again: after each restart every acknowledged write is there, a write cut short is wholly there or
wholly not, and the datastore opens (its log replayed) by itself. Tiny models and a small datastore,
so that a restart takes seconds. Slow: 7 server starts."""

from __future__ import annotations

import random
import signal
import sys
import threading
from dataclasses import dataclass, field

import httpx
import pytest

from telerag.documents.writer import DocumentText
from tests.serving import ServerProcess, build_small_datastore, save_tiny_lm, start_server
from tests.tiny_models import tiny_embedder_dir

pytestmark = [pytest.mark.slow, pytest.mark.minutes(1.5)]  # 7 starts of about 10 s each in CI

KILLS = 6
DOCUMENTS = [f"crash/{i}" for i in range(8)]


def text_of(doc_id: str, version: int) -> str:
    return f"{doc_id} version {version} is written here. " * 12


@dataclass
class Expected:
    """What each document must be after a restart: its last acknowledged version (0: deleted or
    never written), and the versions a write that was not answered may have left instead."""

    acknowledged: dict[str, int] = field(default_factory=dict)
    maybe: dict[str, set[int]] = field(default_factory=dict)

    def allowed(self, doc_id: str) -> set[int]:
        return {self.acknowledged.get(doc_id, 0)} | self.maybe.get(doc_id, set())


def write_until_killed(server: ServerProcess, expected: Expected, rng: random.Random, version: list[int]) -> None:
    """Writes, one request at a time (now and then a batch), until the server stops answering."""
    with httpx.Client(base_url=server.base, timeout=60) as client:
        while True:
            batch = rng.sample(DOCUMENTS, rng.choice([1, 1, 1, 3]))
            changes: dict[str, int] = {}
            for doc_id in batch:
                version[0] += 1
                changes[doc_id] = 0 if rng.random() < 0.3 else version[0]
            for doc_id, v in changes.items():
                expected.maybe.setdefault(doc_id, set()).add(v)
            try:
                responses = [client.delete(f"/v1/documents/{doc_id}") for doc_id, v in changes.items() if v == 0]
                upserts = [{"id": doc_id, "text": text_of(doc_id, v)} for doc_id, v in changes.items() if v]
                if upserts:
                    responses.append(client.post("/v1/documents", json={"documents": upserts}))
            except httpx.HTTPError:
                return  # killed: what was sent last is in `maybe`
            for response in responses:
                assert response.status_code in (200, 201, 404), response.text
            for doc_id, v in changes.items():
                expected.acknowledged[doc_id] = v
                expected.maybe[doc_id] = set()


def check(server: ServerProcess, expected: Expected) -> None:
    with httpx.Client(base_url=server.base, timeout=60) as client:
        for doc_id in DOCUMENTS:
            response = client.get(f"/v1/documents/{doc_id}")
            allowed = expected.allowed(doc_id)
            if response.status_code == 404:
                assert 0 in allowed, (doc_id, allowed)
                found = 0
            else:
                document = response.json()
                found = int(document["passages"][0]["text"].split(" version ")[1].split()[0])
                assert found in allowed, (doc_id, found, allowed)
                whole = DocumentText(doc_id, text_of(doc_id, found))
                assert document["content_hash"] == whole.content_hash, "a document half written"
                assert all(f"version {found} " in p["text"] for p in document["passages"])
            expected.acknowledged[doc_id] = found  # what the next round starts from
            expected.maybe[doc_id] = set()


def test_acknowledged_writes_survive_sigkill(tmp_path):
    embedder = tiny_embedder_dir(32, 0)
    lm = save_tiny_lm(tmp_path / "tiny-lm")
    datastore = build_small_datastore(tmp_path / "datastore", embedder, articles=20)
    args = ["--model", str(lm), "--embedder", str(embedder), "--datastore", str(datastore)]
    # no compaction by itself: one begun by the writes of the last round would leave the last start
    # no log to replay, and the replay is what this test is about (compaction's crashes: test_live_datastore.py)
    env = {"TELERAG_SERVER__WARM_UP": "false", "TELERAG_DOCUMENTS__COMPACT_SHARE": "null"}
    rng = random.Random(7)
    expected, version = Expected(), [0]
    for kill in range(KILLS):
        server = start_server(args, tmp_path / f"server-{kill}.log", env=env, command=(sys.executable, "-m", "telerag.cli"))
        try:
            server.wait_ready(timeout=180)
            check(server, expected)
            writer = threading.Thread(target=write_until_killed, args=(server, expected, rng, version))
            writer.start()
            threading.Event().wait(rng.uniform(0.2, 2.0))
            server.signal(signal.SIGKILL)
            writer.join(60)
            assert not writer.is_alive()
        finally:
            server.stop()
    server = start_server(args, tmp_path / "server-last.log", env=env)
    try:
        server.wait_ready(timeout=180)
        check(server, expected)
        assert "replayed" in server.output()
    finally:
        server.stop()
    assert version[0] > KILLS, "writes were made between the kills"
