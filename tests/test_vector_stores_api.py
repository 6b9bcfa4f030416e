"""The Vector Stores API: stores made, filled, searched, changed and deleted through the
official `openai` SDK (its polling helpers unchanged), each seen only by the API key that made it;
a search equal to faiss's IndexIVF over the same passages at the same nprobe; a store durable
across a restart, a file in progress processed again; `rewrite_query` the engine's rewrite searched,
admitted as any engine call; fields not served refused by name."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import threading
import time
from collections.abc import Iterator

import faiss
import httpx
import numpy as np
import openai
import pytest
import torch

from telerag.file_search.attribute_filters import Comparison
from telerag.file_search.file_store import FileStore
from telerag.file_search.vector_store_index import StoreResources
from telerag.file_search.vector_store_records import Attach, FileStatus, StoreFile, StoreRecord
from telerag.file_search.vector_stores import VectorStores
from telerag.pipelines.embedding_priority import EmbeddingPriority
from telerag.retrieval.builder import default_nlist
from telerag.retrieval.cache import CacheBuffer
from telerag.retrieval.corpus import PassageShape
from telerag.retrieval.engine import default_nprobe
from telerag.retrieval.ivf import same_results
from telerag.retrieval.live import opened
from telerag.server.app import create_app, start_serving
from telerag.server.process.runtime import Runtime
from tests.fake_app import DATASTORE_INFO, settings
from tests.fakes import RecordingRetriever, Reply, ScriptedEngine
from tests.retrieval_helpers import HashEmbedder
from tests.test_files import make_pdf

HARBOUR = "The harbour keeps blue pumpkins in its towers beside the old lighthouse"
MARKDOWN = f"# Harbour notes\n\n{HARBOUR}.\n".encode()
ORCHARD = "violin concert orchestra plays songs for the apple orchard"
PDF = make_pdf([[ORCHARD]], title="Orchard concerts")
WORDS = 12  # the passage rule of these tests' server: 12 words a passage


def encoder(words: int = WORDS) -> StoreResources:
    """The bag-of-words embedder as a server's: its tokens are words."""
    embedder = HashEmbedder()
    return StoreResources(embedder, PassageShape(words), embedder.encode, EmbeddingPriority())


class Gate:
    """Passages' embedding that, once armed, waits for `open` (what a large file's embedding is)."""

    def __init__(self) -> None:
        self.embedder, self.armed = HashEmbedder(), False
        self.entered, self.open = threading.Event(), threading.Event()

    def __call__(self, texts):
        if self.armed:
            self.entered.set()
            assert self.open.wait(30)
        return self.embedder.encode(texts)


@contextlib.contextmanager
def stores_app(
    tmp_path, store_resources: StoreResources | None = None, scripted: ScriptedEngine | None = None, **sections
) -> Iterator[httpx.AsyncClient]:
    """The app on fakes (a scripted engine, `scripted` if given, and a recording retriever) with
    vector stores served by the bag-of-words embedder; its stores let go of when the client is
    done (as a server's end)."""
    stores = {"dir": str(tmp_path / "stores"), **sections.pop("vector_stores", {})}
    configured = settings(files={"dir": str(tmp_path / "files")}, vector_stores=stores, **sections)
    runtime = Runtime(
        settings=configured,
        engine=scripted or ScriptedEngine(lambda prompt: Reply("an answer")),
        retriever=RecordingRetriever(),
        datastore_info=DATASTORE_INFO,
        store_resources=store_resources or encoder(),
    )
    app = create_app(configured)
    start_serving(app, runtime)
    try:
        yield httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30)
    finally:
        app.state.vector_stores.close()


def keyed(http: httpx.AsyncClient, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key=key, http_client=http, max_retries=0)


async def test_a_store_is_made_filled_searched_and_emptied_through_the_sdk(tmp_path):
    with stores_app(tmp_path) as http:
        client = keyed(http)
        store = await client.vector_stores.create(name="harbour", metadata={"team": "docs"})
        assert (store.object, store.status, store.usage_bytes, store.file_counts.total) == ("vector_store", "completed", 0, 0)
        assert [hit async for hit in await client.vector_stores.search(store.id, query=HARBOUR)] == []  # empty: no results

        notes = await client.vector_stores.files.upload_and_poll(
            vector_store_id=store.id, file=("notes.md", MARKDOWN), attributes={"kind": "notes", "year": 2026}
        )
        assert (notes.status, notes.last_error, notes.attributes) == ("completed", None, {"kind": "notes", "year": 2026})
        assert notes.usage_bytes > 0 and notes.chunking_strategy.type == "other"  # auto: the server's own rule
        report = await client.files.create(file=("orchard.pdf", PDF, "application/pdf"), purpose="assistants")
        attached = await client.vector_stores.files.create_and_poll(report.id, vector_store_id=store.id)
        assert attached.status == "completed"

        found = [hit async for hit in await client.vector_stores.search(store.id, query=HARBOUR, max_num_results=1)]
        assert [(h.file_id, h.filename, h.attributes) for h in found] == [(notes.id, "notes.md", {"kind": "notes", "year": 2026})]
        assert found[0].content[0].type == "text" and HARBOUR in found[0].content[0].text
        found = [hit async for hit in await client.vector_stores.search(store.id, query=[ORCHARD, "violin"], max_num_results=1)]
        assert [(h.file_id, h.filename) for h in found] == [(report.id, "orchard.pdf")]
        assert ORCHARD in "".join(
            part.text for part in (await client.vector_stores.files.content(report.id, vector_store_id=store.id)).data
        )
        far = await client.vector_stores.search(store.id, query=HARBOUR, ranking_options={"score_threshold": 0.99})
        assert [h.file_id for h in far.data] == []  # none that alike

        got = await client.vector_stores.retrieve(store.id)
        assert (got.status, got.file_counts.completed, got.usage_bytes) == (
            "completed",
            2,
            notes.usage_bytes + attached.usage_bytes,
        )
        assert [f.id async for f in client.vector_stores.files.list(store.id)] == [report.id, notes.id]  # the newest first
        assert [f.id async for f in client.vector_stores.files.list(store.id, order="asc", limit=1)] == [notes.id, report.id]
        assert [f.id async for f in client.vector_stores.files.list(store.id, filter="failed")] == []
        updated = await client.vector_stores.files.update(notes.id, vector_store_id=store.id, attributes={"kind": "old"})
        assert updated.attributes == {"kind": "old"}
        assert (await client.vector_stores.files.retrieve(notes.id, vector_store_id=store.id)).attributes == {"kind": "old"}

        deleted = await client.vector_stores.files.delete(notes.id, vector_store_id=store.id)
        assert (deleted.id, deleted.deleted, deleted.object) == (notes.id, True, "vector_store.file.deleted")
        found = [hit async for hit in await client.vector_stores.search(store.id, query=HARBOUR)]
        assert notes.id not in [h.file_id for h in found] and found  # the PDF's passage is still there
        with pytest.raises(openai.NotFoundError):
            await client.vector_stores.files.retrieve(notes.id, vector_store_id=store.id)
        assert (await client.files.retrieve(notes.id)).id == notes.id  # still in /v1/files

        renamed = await client.vector_stores.update(store.id, name="harbour 2", metadata={"team": "ops"})
        assert (renamed.name, renamed.metadata) == ("harbour 2", {"team": "ops"})
        assert [s.id async for s in client.vector_stores.list()] == [store.id]
        gone = await client.vector_stores.delete(store.id)
        assert (gone.id, gone.deleted, gone.object) == (store.id, True, "vector_store.deleted")
        with pytest.raises(openai.NotFoundError) as missing:
            await client.vector_stores.retrieve(store.id)
        assert missing.value.code == "vector_store_not_found" and missing.value.type == "invalid_request_error"
        assert [s async for s in client.vector_stores.list()] == []


async def test_a_search_with_filters_on_attributes_finds_the_matching_files_alone(tmp_path):
    with stores_app(tmp_path) as http:
        client = keyed(http)
        store = await client.vector_stores.create(name="filtered")
        notes = await client.vector_stores.files.upload_and_poll(
            vector_store_id=store.id, file=("notes.md", MARKDOWN), attributes={"kind": "notes", "year": 2024, "draft": True}
        )
        concerts = await client.vector_stores.files.upload_and_poll(
            vector_store_id=store.id, file=("orchard.pdf", PDF), attributes={"kind": "concerts", "year": 2025}
        )

        async def found(filters) -> set[str]:
            page = await client.vector_stores.search(store.id, query=HARBOUR, max_num_results=10, filters=filters)
            return {hit.file_id async for hit in page}

        both = {notes.id, concerts.id}
        assert await found({"type": "eq", "key": "kind", "value": "notes"}) == {notes.id}
        assert await found({"type": "gte", "key": "year", "value": 2025}) == {concerts.id}  # not the nearer notes
        assert await found({"type": "nin", "key": "kind", "value": ["notes", "manuals"]}) == {concerts.id}
        assert await found({"type": "ne", "key": "draft", "value": True}) == set()  # a file without it: neither eq nor ne
        assert await found({"type": "gt", "key": "kind", "value": 3}) == set()  # a text is not ordered against a number
        either = {
            "type": "or",
            "filters": [{"type": "eq", "key": "draft", "value": True}, {"type": "lt", "key": "year", "value": 2026}],
        }
        assert await found(either) == both
        assert await found({"type": "and", "filters": [either, {"type": "eq", "key": "kind", "value": "concerts"}]}) == {
            concerts.id
        }

        await client.vector_stores.files.update(concerts.id, vector_store_id=store.id, attributes={"kind": "notes"})
        assert await found({"type": "eq", "key": "kind", "value": "notes"}) == both  # the next search follows the change
        with pytest.raises(openai.UnprocessableEntityError) as refused:
            await found({"type": "in", "key": "kind", "value": "notes"})
        assert refused.value.param == "filters.value"


async def test_a_batch_and_a_store_made_with_files_are_processed_in_the_background(tmp_path):
    text = " ".join(f"word{i}" for i in range(400)).encode()
    with stores_app(tmp_path) as http:
        client = keyed(http)
        long = await client.files.create(file=("long.txt", text), purpose="assistants")
        static = {"type": "static", "static": {"max_chunk_size_tokens": 100, "chunk_overlap_tokens": 50}}
        store = await client.vector_stores.create(name="long", file_ids=[long.id], chunking_strategy=static)
        polled = await client.vector_stores.files.poll(long.id, vector_store_id=store.id, poll_interval_ms=20)
        assert polled.status == "completed" and polled.chunking_strategy.static.max_chunk_size_tokens == 100
        passages = (await client.vector_stores.files.content(long.id, vector_store_id=store.id)).data
        assert [len(p.text.split()) for p in passages] == [100] * 7  # 100 tokens (words) a step of 50

        batch = await client.vector_stores.file_batches.upload_and_poll(
            store.id, files=[("a.md", MARKDOWN), ("b.pdf", PDF, "application/pdf")], poll_interval_ms=20
        )
        assert (batch.object, batch.status, batch.file_counts.completed, batch.file_counts.total) == (
            "vector_store.files_batch",
            "completed",
            2,
            2,
        )
        listed = [f async for f in client.vector_stores.file_batches.list_files(batch.id, vector_store_id=store.id)]
        assert sorted(f.status for f in listed) == ["completed", "completed"]
        assert (await client.vector_stores.file_batches.retrieve(batch.id, vector_store_id=store.id)).status == "completed"
        assert (await client.vector_stores.retrieve(store.id)).file_counts.total == 3


async def test_a_file_without_text_fails_saying_why(tmp_path):
    scanned = make_pdf([b"0 0 1 rg 72 72 400 600 re f"])  # a picture of a page: no text layer
    with stores_app(tmp_path) as http:
        client = keyed(http)
        store = await client.vector_stores.create(name="scans")
        failed = await client.vector_stores.files.upload_and_poll(
            vector_store_id=store.id, file=("scan.pdf", scanned, "application/pdf"), poll_interval_ms=20
        )
        assert (
            failed.status == "failed"
            and failed.last_error.code == "invalid_file"
            and "no text layer" in failed.last_error.message
        )
        assert (await client.vector_stores.retrieve(store.id)).file_counts.failed == 1
        assert [f.id async for f in client.vector_stores.files.list(store.id, filter="failed")] == [failed.id]


async def test_a_file_detached_or_cancelled_while_it_is_written_leaves_no_passage(tmp_path):
    gate = Gate()
    texts = {name: f"{name} " * 5 + HARBOUR for name in ("alpha", "beta", "gamma", "delta")}
    with stores_app(tmp_path, StoreResources(gate.embedder, PassageShape(WORDS), gate, EmbeddingPriority())) as http:
        client = keyed(http)
        store = await client.vector_stores.create(name="racing")
        uploaded = {
            name: await client.files.create(file=(f"{name}.txt", text.encode()), purpose="assistants")
            for name, text in texts.items()
        }
        gate.armed = True
        batch = await client.vector_stores.file_batches.create(
            store.id, file_ids=[uploaded[n].id for n in ("alpha", "beta", "gamma")]
        )
        assert await asyncio.to_thread(gate.entered.wait, 30)  # alpha is being embedded
        cancelled = await client.vector_stores.file_batches.cancel(batch.id, vector_store_id=store.id)
        assert (cancelled.status, cancelled.file_counts.cancelled, cancelled.file_counts.in_progress) == ("cancelled", 3, 0)
        gate.armed = False
        gate.open.set()
        delta = await client.vector_stores.files.create_and_poll(
            uploaded["delta"].id, vector_store_id=store.id, poll_interval_ms=20
        )
        assert delta.status == "completed"  # processed after alpha's write was taken back
        found = [hit.file_id async for hit in await client.vector_stores.search(store.id, query=HARBOUR, max_num_results=50)]
        assert set(found) == {uploaded["delta"].id}

        gate.armed, gate.entered, gate.open = True, threading.Event(), threading.Event()
        await client.vector_stores.files.create(vector_store_id=store.id, file_id=uploaded["alpha"].id)
        assert await asyncio.to_thread(gate.entered.wait, 30)  # alpha attached again, being embedded
        detaching = asyncio.create_task(client.vector_stores.files.delete(uploaded["alpha"].id, vector_store_id=store.id))
        await asyncio.sleep(0.2)
        assert not detaching.done()  # it waits for the write under way, to take it back
        gate.open.set()
        assert (await detaching).deleted
        found = [hit.file_id async for hit in await client.vector_stores.search(store.id, query=HARBOUR, max_num_results=50)]
        assert set(found) == {uploaded["delta"].id}


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda c, s: c.vector_stores.create(name="x", expires_after={"anchor": "last_active_at", "days": 1}), "expires_after"),
        (lambda c, s: c.vector_stores.update(s, expires_after={"anchor": "last_active_at", "days": 1}), "expires_after"),
        (lambda c, s: c.vector_stores.search(s, query="q", extra_body={"mystery": 1}), "mystery"),
    ],
)
async def test_what_is_not_served_is_refused_naming_the_field(tmp_path, call, field):
    with stores_app(tmp_path) as http:
        client = keyed(http)
        store = await client.vector_stores.create(name="s")
        with pytest.raises(openai.BadRequestError) as refused:
            await call(client, store.id)
    assert refused.value.param == field and refused.value.code == "unsupported_field"


TOPIC_PROMPT = "Name the topic of the conversation."  # the follow-up rewrite's call, which rewrite_query makes too


def naming(topic: str) -> ScriptedEngine:
    """An engine that replies `topic` to a topic's prompt (and answers any other)."""
    return ScriptedEngine(lambda prompt: Reply(topic if prompt.startswith(TOPIC_PROMPT) else "an answer"))


def listed(page) -> list[tuple[str, float, str]]:
    return [(hit.file_id, hit.score, hit.content[0].text) for hit in page.data]


async def found(client: openai.AsyncOpenAI, store_id: str, query: str) -> list[tuple[str, float, str]]:
    """The top 3 of `query` searched as given."""
    return listed(await client.vector_stores.search(store_id, query=query, max_num_results=3))


async def test_rewrite_query_searches_the_engines_rewrite_and_says_so(tmp_path):
    """The query asked about the topic the engine names (the first line of its reply), the page's
    search_query, and searched exactly as that text is without rewrite_query; a list is one query,
    its texts in turn; a store that is not the key's is 404 before any call."""
    engine = naming("the apple orchard concert\nand a line more")
    with stores_app(tmp_path, scripted=engine) as http:
        client = keyed(http)
        store = await client.vector_stores.create(name="rewritten")
        notes = await client.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("notes.md", MARKDOWN))
        concerts = await client.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("orchard.pdf", PDF))

        page = await client.vector_stores.search(store.id, query="blue pumpkins", max_num_results=3, rewrite_query=True)
        assert page.search_query == ["blue pumpkins (the apple orchard concert)"]
        assert [p for p in engine.prompts if p.startswith(TOPIC_PROMPT)] == engine.prompts  # one call, the topic's
        assert len(engine.prompts) == 1 and engine.prompts[0].endswith("\n\nUser: blue pumpkins\nTopic:")
        rewritten = listed(page)
        assert rewritten == await found(client, store.id, page.search_query[0])
        assert rewritten[0][0] == concerts.id and (await found(client, store.id, "blue pumpkins"))[0][0] == notes.id

        page = await client.vector_stores.search(store.id, query=["blue", "pumpkins"], max_num_results=3, rewrite_query=True)
        assert page.search_query == ["blue pumpkins (the apple orchard concert)"]
        assert engine.prompts[-1].endswith("\n\nUser: blue pumpkins\nTopic:") and len(engine.prompts) == 2
        assert listed(page) == rewritten

        with pytest.raises(openai.NotFoundError):
            await client.vector_stores.search("vs_none", query="blue pumpkins", rewrite_query=True)
        assert len(engine.prompts) == 2


@pytest.mark.parametrize("reply", ["", "\nthe apple orchard", " ... "])
async def test_a_rewrite_that_names_no_topic_searches_the_query_as_given(tmp_path, reply):
    """Nothing on the reply's first line, or nothing but punctuation: the query is searched as it is."""
    engine = naming(reply)
    with stores_app(tmp_path, scripted=engine) as http:
        client = keyed(http)
        store = await client.vector_stores.create(name="as given")
        await client.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("notes.md", MARKDOWN))
        await client.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("orchard.pdf", PDF))
        page = await client.vector_stores.search(store.id, query="blue pumpkins", max_num_results=3, rewrite_query=True)
        assert page.search_query == ["blue pumpkins"] and len(engine.prompts) == 1
        assert listed(page) == await found(client, store.id, "blue pumpkins")


class HeldEngine(ScriptedEngine):
    """A scripted engine whose calls wait for `release`; `begun` is set once one has begun."""

    def __init__(self, script) -> None:
        super().__init__(script)
        self.begun, self.release = asyncio.Event(), asyncio.Event()

    async def stream(self, prompts, params):
        self.begun.set()
        await self.release.wait()
        async for item in super().stream(prompts, params):
            yield item


async def test_a_rewrite_is_admitted_as_every_engine_call(tmp_path):
    """With one request running and none waiting (`fixed` admission), a second rewrite is refused
    with a 429 while the first holds the engine; a search without one makes no call, and is served."""
    engine = HeldEngine(lambda prompt: Reply("the harbour"))
    busy = {"admission": "fixed", "max_concurrency": 1, "max_queue": 0}
    with stores_app(tmp_path, scripted=engine, scheduler=busy) as http:
        client = keyed(http)
        store = await client.vector_stores.create(name="busy")
        notes = await client.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("notes.md", MARKDOWN))
        held = asyncio.ensure_future(client.vector_stores.search(store.id, query=HARBOUR, rewrite_query=True))
        await asyncio.wait_for(engine.begun.wait(), 30)
        with pytest.raises(openai.RateLimitError) as refused:  # not held behind the first (30 s: a guard, not a bound)
            await asyncio.wait_for(client.vector_stores.search(store.id, query=HARBOUR, rewrite_query=True), 30)
        assert refused.value.code == "queue_full"
        assert [hit.file_id for hit in (await client.vector_stores.search(store.id, query=HARBOUR)).data] == [notes.id]
        engine.release.set()
        assert (await held).search_query == [f"{HARBOUR} (the harbour)"] and len(engine.prompts) == 1


async def test_one_key_never_sees_searches_or_changes_anothers_store(tmp_path):
    with stores_app(tmp_path, server={"api_keys": ["key-of-ann", "key-of-bob"]}) as http:
        ann, bob = keyed(http, "key-of-ann"), keyed(http, "key-of-bob")
        store = await ann.vector_stores.create(name="ann's")
        mine = await ann.vector_stores.files.upload_and_poll(
            vector_store_id=store.id, file=("notes.md", MARKDOWN), poll_interval_ms=20
        )
        assert [s async for s in bob.vector_stores.list()] == []
        for call in (
            lambda: bob.vector_stores.retrieve(store.id),
            lambda: bob.vector_stores.update(store.id, name="bob's now"),
            lambda: bob.vector_stores.search(store.id, query=HARBOUR),
            lambda: bob.vector_stores.files.list(store.id),
            lambda: bob.vector_stores.files.retrieve(mine.id, vector_store_id=store.id),
            lambda: bob.vector_stores.files.content(mine.id, vector_store_id=store.id),
            lambda: bob.vector_stores.files.delete(mine.id, vector_store_id=store.id),
            lambda: bob.vector_stores.files.create(vector_store_id=store.id, file_id=mine.id),
            lambda: bob.vector_stores.delete(store.id),
        ):
            with pytest.raises(openai.NotFoundError):
                await call()
        own = await bob.vector_stores.create(name="bob's")
        with pytest.raises(openai.NotFoundError) as not_his:  # ann's file, into bob's own store
            await bob.vector_stores.files.create(vector_store_id=own.id, file_id=mine.id)
        assert not_his.value.code == "file_not_found"
        assert (await ann.vector_stores.retrieve(store.id)).name == "ann's"
        assert [h.file_id async for h in await ann.vector_stores.search(store.id, query=HARBOUR)] == [mine.id]


async def test_each_keys_stores_and_bytes_are_limited_with_413(tmp_path):
    with stores_app(tmp_path, vector_stores={"max_stores_per_key": 1, "max_bytes_per_key": 1024}) as http:
        client = keyed(http)
        store = await client.vector_stores.create(name="one")
        with pytest.raises(openai.APIStatusError) as many:
            await client.vector_stores.create(name="two")
        assert many.value.status_code == 413 and many.value.code == "vector_stores_too_large"
        big = await client.files.create(file=("big.txt", b"word " * 300), purpose="assistants")
        with pytest.raises(openai.APIStatusError) as large:
            await client.vector_stores.files.create(vector_store_id=store.id, file_id=big.id)
        assert large.value.status_code == 413 and "vector_stores.max_bytes_per_key" in large.value.message
        assert (await client.vector_stores.retrieve(store.id)).file_counts.total == 0


async def test_a_store_survives_a_restart(tmp_path):
    with stores_app(tmp_path) as http:
        client = keyed(http)
        store = await client.vector_stores.create(name="kept", metadata={"a": "b"})
        notes = await client.vector_stores.files.upload_and_poll(
            vector_store_id=store.id, file=("notes.md", MARKDOWN), attributes={"kind": "notes"}, poll_interval_ms=20
        )
        before = [(h.file_id, h.score) async for h in await client.vector_stores.search(store.id, query=HARBOUR)]
    with stores_app(tmp_path) as http:  # a new app over the same folders
        client = keyed(http)
        again = await client.vector_stores.retrieve(store.id)
        assert (again.name, again.metadata, again.file_counts.completed, again.usage_bytes) == (
            "kept",
            {"a": "b"},
            1,
            notes.usage_bytes,
        )
        assert (await client.vector_stores.files.retrieve(notes.id, vector_store_id=store.id)).attributes == {"kind": "notes"}
        assert [(h.file_id, h.score) async for h in await client.vector_stores.search(store.id, query=HARBOUR)] == before


def test_a_file_in_progress_when_the_server_stopped_is_processed_at_the_next_start(tmp_path):
    files = FileStore(tmp_path / "files", max_bytes=1 << 20, max_bytes_per_owner=1 << 20)
    uploaded = files.add(MARKDOWN, "notes.md", "assistants", None)
    attached = StoreFile(uploaded.id, "notes.md", 1, FileStatus.IN_PROGRESS, {}, None, uploaded.bytes)
    (tmp_path / "stores").mkdir()
    StoreRecord("vs_cut", "cut short", None, 1, 1, files={uploaded.id: attached}).write(tmp_path / "stores" / "vs_cut.json")
    (tmp_path / "stores" / "vs_cut").mkdir()  # a first build cut short: removed, and built again
    stores = VectorStores(tmp_path / "stores", files, max_stores=10, max_bytes=1 << 20)
    stores.serve(encoder())
    try:
        for _ in range(500):
            if stores.file("vs_cut", None, uploaded.id).status is not FileStatus.IN_PROGRESS:
                break
            time.sleep(0.01)
        assert stores.file("vs_cut", None, uploaded.id).status is FileStatus.COMPLETED
        assert [hit.file_id for hit in stores.search("vs_cut", None, [HARBOUR], 3)] == [uploaded.id]
    finally:
        stores.close()


@contextlib.contextmanager
def served_stores(tmp_path, cache_rows: int = 0) -> Iterator[tuple[FileStore, VectorStores, StoreResources]]:
    """A file store and vector stores under `tmp_path`, served by the bag-of-words embedder with
    passages of 6 words, their lists in a cluster cache buffer of `cache_rows` rows (in host
    memory: the same code as on a GPU) that any prefetch may fill; the stores let go of at the end."""
    files = FileStore(tmp_path / "files", max_bytes=1 << 24, max_bytes_per_owner=1 << 26)
    stores = VectorStores(tmp_path / "stores", files, max_stores=10, max_bytes=1 << 26)
    store_resources = encoder(words=6)
    if cache_rows:
        cache = CacheBuffer(cache_rows, store_resources.embedder.dim, torch.float32, torch.device("cpu"))
        store_resources = dataclasses.replace(store_resources, cache=cache, budget_bytes=lambda overlap_ms: cache.capacity_bytes)
    stores.serve(store_resources)
    try:
        yield files, stores, store_resources
    finally:
        stores.close()


def faiss_reference(store_dir, embedder: HashEmbedder) -> tuple[faiss.IndexIVFFlat, dict[int, tuple[str, str]]]:
    """faiss's IndexIVFFlat with the store's centroids, the store's living passages embedded again
    and added with their ids; and each id's (file, text)."""
    with opened(store_dir) as live:
        snapshot = live.snapshot()
        ids = [i for entry in live.documents(limit=10_000) for i in entry.passage_ids]
        passages = snapshot.passages_of(ids)
        centroids = np.ascontiguousarray(snapshot.datastore.centroids)
    nlist, dim = centroids.shape
    quantizer = faiss.IndexFlatIP(dim)
    quantizer.add(centroids)
    index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    index.is_trained = True
    index.add_with_ids(embedder.encode([p.text for p in passages]), np.asarray(ids, dtype=np.int64))
    index.nprobe = default_nprobe(nlist)
    return index, {i: (p.doc_id, p.text) for i, p in zip(ids, passages, strict=True)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_search_equals_faiss_over_the_same_passages_at_the_same_nprobe(tmp_path, seed):
    """Random stores: a first file large enough for 17+ lists (so nprobe < nlist), more files
    written into it, one detached; every search, with a filter on the files' attributes or
    without, equal to faiss's over its living passages (with an ID selector of the matching files'
    passages)."""
    rng = random.Random(seed)
    vocabulary = [f"w{i}" for i in range(300)]
    with served_stores(tmp_path) as (files, stores, store_resources):
        store = stores.create(None, name="random", metadata={})
        sizes = [rng.randint(700, 900), *(rng.randint(20, 120) for _ in range(3))]
        ids = []
        for n, size in enumerate(sizes):
            text = " ".join(rng.choice(vocabulary) for _ in range(6 * size))
            uploaded = files.add(text.encode(), f"f{n}.txt", "assistants", None)
            stores.attach(store.id, None, Attach(uploaded.id, {"n": n}))
            ids.append(uploaded.id)
        for _ in range(1000):
            if not stores.get(store.id, None).in_progress:
                break
            time.sleep(0.01)
        assert stores.get(store.id, None).counts.completed == len(sizes)
        stores.detach(store.id, None, ids[rng.randrange(1, len(ids))])
        reference, passages = faiss_reference(tmp_path / "stores" / store.id, store_resources.embedder)
        by_passage = {passage: i for i, passage in passages.items()}
        assert reference.nprobe < reference.nlist
        for _ in range(10):
            query = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(1, 8)))
            # a filter on the files' attributes: the passages of the files it matches, faiss's ID selector
            kept = rng.sample(range(len(ids)), rng.randint(1, len(ids) - 1))
            where = Comparison("in", "n", tuple(float(n) for n in kept)) if rng.random() < 0.5 else None
            selected = {i for i, (file_id, _) in passages.items() if where is None or ids.index(file_id) in kept}
            params = faiss.SearchParametersIVF(nprobe=reference.nprobe, sel=faiss.IDSelectorBatch(np.asarray(sorted(selected))))
            hits = stores.search(store.id, None, [query], 10, where=where)
            scores, found = reference.search(store_resources.embedder.encode([query]), 10, params=params)
            got = np.asarray([by_passage.get((h.file_id, h.text), -2) for h in hits], dtype=np.int64)
            got_scores = np.asarray([h.score for h in hits], dtype=np.float32)
            assert same_results(got, got_scores, found[0][: len(hits)], scores[0][: len(hits)]), (query, where)
            assert len(hits) == int((found[0] >= 0).sum())  # never short


def test_a_stores_lists_follow_its_size(tmp_path):
    """One list while it is small; retrained to `default_nlist(n)` lists once it holds 4x the
    passages its lists were trained on; its searches equal faiss's throughout."""
    rng = random.Random(7)
    vocabulary = [f"w{i}" for i in range(300)]
    with served_stores(tmp_path) as (files, stores, store_resources):
        store = stores.create(None, name="growing", metadata={})
        shapes = []
        for n, size in enumerate([10, 20, 10, 800]):  # 10 passages; 30 (< 40); 40 (4x 10: retrained); 840 (> 160: retrained)
            text = " ".join(rng.choice(vocabulary) for _ in range(6 * size))
            stores.attach(store.id, None, Attach(files.add(text.encode(), f"f{n}.txt", "assistants", None).id, {}))
            while stores.get(store.id, None).in_progress:
                time.sleep(0.01)
            reference, passages = faiss_reference(tmp_path / "stores" / store.id, store_resources.embedder)
            shapes.append((stores.get(store.id, None).trained_on, reference.nlist))
            by_passage = {passage: i for i, passage in passages.items()}
            query = " ".join(rng.choice(vocabulary) for _ in range(4))
            hits = stores.search(store.id, None, [query], 5)
            scores, found = reference.search(store_resources.embedder.encode([query]), 5)
            got = np.asarray([by_passage[(h.file_id, h.text)] for h in hits], dtype=np.int64)
            assert same_results(got, np.asarray([h.score for h in hits], dtype=np.float32), found[0], scores[0])
        assert shapes == [(10, 1), (10, 1), (40, 1), (840, default_nlist(840))] and default_nlist(840) == 21


def test_a_filter_never_takes_a_boolean_for_a_number():
    assert not Comparison("eq", "x", 1.0).holds({"x": True}) and not Comparison("in", "x", (1.0,)).holds({"x": True})
    assert Comparison("in", "x", (1.0, "a")).holds({"x": 1.0}) and Comparison("nin", "x", (1.0,)).holds({"x": True})
    assert Comparison("eq", "x", True).holds({"x": True}) and not Comparison("gt", "x", False).holds({"x": True})
