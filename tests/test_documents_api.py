"""`/v1/documents` through an in-process client, on a real live datastore (a four-topic corpus under
the bag-of-words embedder) and a scripted engine: written documents are answered from by the next
query, deleted ones no longer; outcomes, statuses, limits and errors as the schema says."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from telerag.documents import rebuilds as rebuilds_module
from telerag.documents.rebuilds import Rebuilds
from telerag.documents.writer import DocumentWriter
from telerag.pipelines.datastores import open_retriever
from telerag.server.app import create_app, start_serving
from telerag.server.process.runtime import Runtime
from tests.fake_app import settings
from tests.fakes import Reply, ScriptedEngine
from tests.retrieval_helpers import HashEmbedder, topic_datastore

VOLCANO = "volcano lava eruption magma crater ash"
KEY = "secret-key"


@contextlib.contextmanager
def documents_app(tmp_path, *, writable: bool = True, **sections) -> Iterator[httpx.AsyncClient]:
    _, path = topic_datastore(tmp_path, per_topic=10, nlist=4)
    retriever = open_retriever(path, HashEmbedder(), device="cpu", writable=writable)
    configured = settings(**sections)
    rebuilds = Rebuilds(retriever.live, compact_share=configured.documents.compact_share)
    writer = DocumentWriter(retriever.live, retriever.embed_passages, on_written=rebuilds.after_writes)
    runtime = Runtime(
        settings=configured,
        engine=ScriptedEngine(lambda prompt: Reply("an answer")),
        retriever=retriever,
        datastore_info=retriever.datastore_info(),
        closers=[writer.close, retriever.close],
        documents=writer,
        rebuilds=rebuilds,
    )
    rebuilds.on_done = lambda _: setattr(runtime, "datastore_info", retriever.datastore_info())
    app = create_app(runtime.settings)
    start_serving(app, runtime)
    headers = {"Authorization": f"Bearer {KEY}"} if "server" in sections else {}
    try:
        yield httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30, headers=headers)
    finally:
        writer.close()
        rebuilds.join()
        retriever.close()


async def found(client: httpx.AsyncClient, query: str, nprobe: int = 4) -> list[str]:
    response = await client.post("/v1/rag/query", json={"query": query, "pipeline": "naive", "top_k": 3, "nprobe": nprobe})
    assert response.status_code == 200, response.text
    return [document["doc_id"] for document in response.json()["documents"]]


async def test_a_document_written_is_answered_from_and_gone_once_deleted(tmp_path):
    with documents_app(tmp_path) as client:
        assert "volcanoes" not in await found(client, VOLCANO)
        created = await client.post("/v1/documents", json={"id": "volcanoes", "text": f"{VOLCANO} " * 30, "title": "Volcanoes"})
        assert created.status_code == 201, created.text
        body = created.json()
        assert body["outcome"] == "created" and body["version"] == 1 and body["passages"] == 2 and body["lsn"] == 1
        assert (await found(client, VOLCANO))[0] == "volcanoes"

        again = await client.post("/v1/documents", json={"id": "volcanoes", "text": f"{VOLCANO} " * 30, "title": "Volcanoes"})
        assert again.status_code == 200 and again.json()["outcome"] == "unchanged" and again.json()["lsn"] == 1

        replaced = await client.put("/v1/documents/volcanoes", json={"text": "piano sonata " * 20})
        assert replaced.status_code == 200 and replaced.json()["outcome"] == "replaced" and replaced.json()["version"] == 2
        assert "volcanoes" not in await found(client, VOLCANO)

        document = (await client.get("/v1/documents/volcanoes")).json()
        assert document["title"] == "volcanoes" and document["version"] == 2 and document["state"] == "indexed"
        assert [p["text"] for p in document["passages"]] == [("piano sonata " * 20).strip()]
        assert document["content_hash"].startswith("sha256:") and document["passage_count"] == 1

        deleted = await client.delete("/v1/documents/volcanoes")
        assert deleted.status_code == 200 and deleted.json() == {
            "object": "document.deleted",
            "id": "volcanoes",
            "deleted": True,
            "lsn": 3,
        }
        assert "volcanoes" not in await found(client, "piano sonata")
        for response in (await client.delete("/v1/documents/volcanoes"), await client.get("/v1/documents/volcanoes")):
            assert response.status_code == 404 and response.json()["error"]["type"] == "document_not_found"


async def test_a_batch_ids_with_slashes_and_paging(tmp_path):
    with documents_app(tmp_path) as client:
        batch = {
            "documents": [{"id": f"notes/{i}.md", "text": f"{VOLCANO} note {i} " * 10, "metadata": {"n": i}} for i in range(5)]
        }
        written = await client.post("/v1/documents", json=batch)
        assert written.status_code == 201, written.text
        assert [d["outcome"] for d in written.json()["data"]] == ["created"] * 5 and written.json()["lsn"] == 5
        assert (await client.get("/v1/documents/notes/3.md")).json()["metadata"] == {"n": 3}

        seen, after = [], None
        while True:
            page = (await client.get("/v1/documents", params={"limit": 13, **({"after": after} if after else {})})).json()
            seen += [d["id"] for d in page["data"]]
            after = page["last_id"]
            if not page["has_more"]:
                break
        assert seen == sorted(seen) and len(seen) == 40 + 5 and "notes/4.md" in seen
        ready = (await client.get("/ready")).json()
        assert ready["live"]["documents"] == 45 and ready["live"]["lsn"] == 5 and ready["datastore"]["documents"] == 45
        metrics = (await client.get("/metrics")).text
        assert 'telerag_document_writes_total{outcome="created"} 5.0' in metrics and "telerag_documents 45.0" in metrics
        assert "telerag_datastore_publish_seconds_count 1.0" in metrics  # the batch, made searchable at once


async def test_uploaded_files_are_converted_and_answered_from(tmp_path):
    with documents_app(tmp_path) as client:
        markdown = f"# Volcanoes of the world\n\n{VOLCANO} " * 3
        uploaded = await client.post(
            "/v1/uploads",
            files={"file": ("guide.md", markdown.encode(), "text/markdown")},
            data={"metadata": json.dumps({"kind": "guide"})},
        )
        assert uploaded.status_code == 201, uploaded.text
        assert uploaded.json()["id"] == "guide.md"
        document = (await client.get("/v1/documents/guide.md")).json()
        assert document["title"] == "Volcanoes of the world" and document["metadata"] == {"kind": "guide"}
        assert "guide.md" in await found(client, VOLCANO)

        refused = await client.post("/v1/uploads", files={"file": ("photo.png", b"\x89PNG", "image/png")})
        assert refused.status_code == 400 and refused.json()["error"]["type"] == "unsupported_file"
        assert "image/png" in refused.json()["error"]["message"] or ".png" in refused.json()["error"]["message"]
        bad = await client.post("/v1/uploads", files={"file": ("a.txt", b"text")}, data={"metadata": "{"})
        assert bad.status_code == 422 and bad.json()["error"]["field"] == "metadata"


async def test_a_file_posted_to_documents_is_taken_as_an_upload_is(tmp_path):
    """NVIDIA's RAG blueprint takes files on its documents route: so does this one, as multipart,
    with /v1/uploads's fields; a README with no extension and no type is text by its content."""
    with documents_app(tmp_path) as client:
        readme = f"Volcanoes\n\n{VOLCANO} " * 3
        posted = await client.post("/v1/documents", files={"file": ("README", readme.encode())}, data={"id": "docs/README"})
        assert posted.status_code == 201, posted.text
        assert posted.json()["id"] == "docs/README" and posted.json()["outcome"] == "created"
        assert "docs/README" in await found(client, VOLCANO)
        named = await client.post("/v1/documents", files={"file": ("notes.md", b"# Notes\n\npiano sonata")})
        assert named.status_code == 201 and named.json()["id"] == "notes.md"
        image = await client.post("/v1/documents", files={"file": ("photo", b"\x89PNG\r\n\x1a\n\x00\x00", "image/png")})
        assert image.status_code == 400 and image.json()["error"]["type"] == "unsupported_file"
        assert (await client.post("/v1/documents", json={"id": "j", "text": "still JSON"})).status_code == 201
        schema = (await client.get("/openapi.json")).json()
    body = schema["paths"]["/v1/documents"]["post"]["requestBody"]["content"]
    assert body.keys() == {"application/json", "multipart/form-data"}
    assert body["multipart/form-data"] == schema["paths"]["/v1/uploads"]["post"]["requestBody"]["content"]["multipart/form-data"]


async def test_a_put_may_name_its_own_id_in_the_body_but_no_other(tmp_path):
    with documents_app(tmp_path) as client:
        same = await client.put("/v1/documents/guides/a", json={"id": "guides/a", "text": "piano sonata"})
        assert same.status_code == 201 and same.json()["id"] == "guides/a", same.text
        other = await client.put("/v1/documents/guides/a", json={"id": "guides/b", "text": "piano sonata"})
        assert other.status_code == 400 and other.json()["error"]["type"] == "id_mismatch"
        assert other.json()["error"]["field"] == "id" and "differs" in other.json()["error"]["message"]
        assert (await client.get("/v1/documents/guides/b")).status_code == 404


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"id": "a", "text": ""}, 422, "text"),
        ({"id": "", "text": "words"}, 422, "id"),
        ({"id": "   ", "text": "words"}, 422, "id"),
        ({"id": "a", "text": "   "}, 422, "text"),
        ({"id": "a", "text": "words", "colour": "red"}, 400, "colour"),
        ({"id": "a", "text": "words", "metadata": {f"k{i}": i for i in range(17)}}, 422, "metadata"),
        ({"id": "a", "text": "words", "metadata": {"k": {"nested": 1}}}, 422, "metadata.k"),
        ({"documents": []}, 422, "documents"),
        ({"documents": [{"id": f"d{i}", "text": "w"} for i in range(4)]}, 422, "documents"),
    ],
)
async def test_bad_documents_are_refused_naming_the_field(tmp_path, body, status, field):
    with documents_app(tmp_path, documents={"max_documents": 3}) as client:
        response = await client.post("/v1/documents", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["field"] == field


async def test_more_passages_than_a_request_may_write_is_413(tmp_path):
    with documents_app(tmp_path, documents={"max_passages": 3}) as client:
        response = await client.post("/v1/documents", json={"id": "long", "text": "word " * 450})
        assert response.status_code == 413 and response.json()["error"]["type"] == "documents_too_large"
        assert (await client.get("/v1/documents/long")).status_code == 404


async def test_a_read_only_datastore_refuses_writes_with_409(tmp_path):
    with documents_app(tmp_path, writable=False) as client:
        response = await client.post("/v1/documents", json={"id": "a", "text": "words"})
        assert response.status_code == 409 and response.json()["error"]["type"] == "datastore_read_only"
        assert (await client.get("/v1/documents", params={"limit": 1})).status_code == 200
        assert (await client.get("/ready")).json()["live"]["writable"] is False


async def test_documents_need_the_api_key(tmp_path):
    with documents_app(tmp_path, server={"api_key": KEY}) as client:
        assert (await client.post("/v1/documents", json={"id": "a", "text": "words"})).status_code == 201
        client.headers.pop("Authorization")
        for response in (
            await client.post("/v1/documents", json={"id": "b", "text": "words"}),
            await client.get("/v1/documents/a"),
            await client.get("/v1/documents"),
            await client.delete("/v1/documents/a"),
        ):
            assert response.status_code == 401


async def test_the_schema_says_the_limits_and_answers(tmp_path):
    with documents_app(tmp_path, documents={"max_documents": 7}) as client:
        schema = (await client.get("/openapi.json")).json()
    post = schema["paths"]["/v1/documents"]["post"]
    assert {"200", "201", "409", "413", "422", "429"} <= post["responses"].keys()
    batch = schema["components"]["schemas"]["DocumentBatch"]["properties"]["documents"]
    assert batch["maxItems"] == 7 and batch["minItems"] == 1
    assert "/v1/uploads" in schema["paths"] and "/v1/documents/{doc_id}" in schema["paths"]
    assert {"get", "put", "delete"} <= schema["paths"]["/v1/documents/{doc_id}"].keys()


async def rebuilt(client: httpx.AsyncClient) -> dict:
    """`GET /v1/datastore` once its rebuild has ended."""
    for _ in range(600):
        state = (await client.get("/v1/datastore")).json()
        if state["rebuild"] is not None and state["rebuild"]["state"] != "running":
            return state
        await asyncio.sleep(0.05)
    raise AssertionError("the rebuild never ended")


async def test_a_compaction_and_a_retrain_through_the_api(tmp_path):
    with documents_app(tmp_path, documents={"compact_share": None}) as client:
        await client.post("/v1/documents", json={"id": "volcanoes", "text": f"{VOLCANO} " * 30})
        await client.delete("/v1/documents/rivers-3")
        before = await found(client, VOLCANO)
        started = await client.post("/v1/datastore/compact")
        assert started.status_code == 202 and started.json()["kind"] == "compact" and not started.json()["automatic"]
        state = await rebuilt(client)
        assert state["rebuild"]["state"] == "done" and state["rebuild"]["generation"] == 1
        assert not state["rebuild"]["changes_results"] and state["rebuild"]["passages"] == 40 - 1 + 2
        assert state["live"]["generation"] == 1 and state["live"]["delta_rows"] == 0 and state["live"]["tombstones"] == 0
        assert await found(client, VOLCANO) == before
        assert (await client.get("/v1/documents/volcanoes")).json()["content_hash"].startswith("sha256:")

        too_many = await client.post("/v1/datastore/retrain", json={"nlist": 42})  # a list per passage at most
        assert too_many.status_code == 422 and too_many.json()["error"]["field"] == "nlist", too_many.text
        retrained = await client.post("/v1/datastore/retrain", json={"nlist": 2.0})  # an integer, as JSON Schema counts
        assert retrained.status_code == 202 and retrained.json()["changes_results"]
        state = await rebuilt(client)
        assert state["rebuild"]["generation"] == 2 and (await client.get("/ready")).json()["datastore"]["nlist"] == 2
        assert (await found(client, VOLCANO, nprobe=2))[0] == "volcanoes"
        past = await client.post("/v1/rag/query", json={"query": VOLCANO, "nprobe": 4, "top_k": 3})  # nlist is 2 now
        assert past.status_code == 200, past.text
        searched = [step["stats"]["nprobe"] for step in past.json()["steps"] if step["kind"] == "retrieval"]
        assert searched == [2] and [d["doc_id"] for d in past.json()["documents"]] == await found(client, VOLCANO, nprobe=2)


async def test_a_compaction_begins_by_itself_once_enough_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(rebuilds_module, "MIN_COMPACT_ROWS", 1)
    with documents_app(tmp_path, documents={"compact_share": 0.1}) as client:
        for i in range(3):
            await client.post("/v1/documents", json={"id": f"n{i}", "text": f"{VOLCANO} {i} " * 20})
        state = await rebuilt(client)
        assert state["rebuild"]["automatic"] and state["rebuild"]["state"] == "done"
        assert state["live"]["generation"] >= 1 and state["live"]["documents"] == 43


async def test_a_second_rebuild_while_one_runs_is_refused(tmp_path, monkeypatch):
    gate = threading.Event()
    with documents_app(tmp_path, documents={"compact_share": None}) as client:
        from telerag.retrieval import live as live_module

        build = live_module.write_generation
        monkeypatch.setattr(live_module, "write_generation", lambda *a, **k: (gate.wait(30), build(*a, **k))[1])
        assert (await client.post("/v1/datastore/compact")).status_code == 202
        second = await client.post("/v1/datastore/retrain")
        assert second.status_code == 409 and second.json()["error"]["type"] == "rebuild_running"
        gate.set()
        assert (await rebuilt(client))["rebuild"]["state"] == "done"
