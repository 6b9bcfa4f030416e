"""Documents written through the pipelines' writer: searchable by the next search, gone after a
delete, unchanged ones not embedded again, each run on one snapshot, writes below queries."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from telerag.documents.errors import InvalidDocument, WritesBusy
from telerag.documents.writer import DocumentText, DocumentWriter
from telerag.pipelines import embedding_priority
from telerag.pipelines.datastores import open_retriever
from telerag.pipelines.embedding_priority import EmbeddingPriority
from telerag.pipelines.retriever import DirectRetriever
from telerag.pipelines.types import SearchOptions
from telerag.retrieval.documents import WriteOutcome
from tests.retrieval_helpers import HashEmbedder, topic_datastore

VOLCANO = "volcano lava eruption magma crater ash"


class CountingEmbedder(HashEmbedder):
    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    def encode(self, texts, *, pause=None):
        self.texts.extend(texts)
        return super().encode(texts, pause=pause)


@pytest.fixture()
def retriever(tmp_path):
    _, path = topic_datastore(tmp_path, per_topic=20, nlist=4)
    retriever = open_retriever(path, CountingEmbedder(), device="cpu", writable=True)
    yield retriever
    retriever.close()


@pytest.fixture()
def writer(retriever):
    writer = DocumentWriter(retriever.live, retriever.embed_passages)
    yield writer
    writer.close()


async def search(retriever: DirectRetriever, text: str, **options) -> list[str]:
    outcome = await retriever.search([text], SearchOptions(top_k=3, nprobe=4, **options))
    return [document.doc_id for document in outcome.documents[0]]


async def test_a_document_is_found_by_the_next_search_and_gone_after_its_delete(writer, retriever):
    assert "volcanoes" not in await search(retriever, VOLCANO)
    (created,) = await writer.upsert([DocumentText("volcanoes", f"{VOLCANO} " * 30, title="Volcanoes")])
    assert created.outcome is WriteOutcome.CREATED and created.document.version == 1
    assert (await search(retriever, VOLCANO))[0] == "volcanoes"
    outcome = await retriever.search([VOLCANO], SearchOptions(top_k=1, nprobe=4))
    assert outcome.documents[0][0].title == "Volcanoes" and "lava" in outcome.documents[0][0].text

    (replaced,) = await writer.upsert([DocumentText("volcanoes", "piano sonata " * 40)])
    assert replaced.outcome is WriteOutcome.REPLACED and replaced.document.version == 2
    assert "volcanoes" not in await search(retriever, VOLCANO)
    assert "volcanoes" in await search(retriever, "piano sonata")

    (deleted,) = await writer.delete(["volcanoes"])
    assert deleted.outcome is WriteOutcome.DELETED and writer.document("volcanoes") is None
    assert "volcanoes" not in await search(retriever, "piano sonata")
    (missing,) = await writer.delete(["volcanoes"])
    assert missing.outcome is WriteOutcome.NOT_FOUND


async def test_an_unchanged_document_is_not_embedded_again(writer, retriever):
    embedder = retriever.embedder
    document = DocumentText("doc", f"{VOLCANO} " * 30, metadata={"source": "a"})
    await writer.upsert([document])
    embedded = len(embedder.texts)
    (again,) = await writer.upsert([document])
    assert again.outcome is WriteOutcome.UNCHANGED and len(embedder.texts) == embedded
    (changed,) = await writer.upsert([DocumentText("doc", f"{VOLCANO} " * 30, metadata={"source": "b"})])
    assert changed.outcome is WriteOutcome.REPLACED and len(embedder.texts) > embedded


async def test_a_document_is_cut_by_the_datastores_rule(writer):
    words = " ".join(f"w{i}" for i in range(220))
    (result,) = await writer.upsert([DocumentText("long", words)])
    assert len(result.document.passage_ids) == 2  # 100 words a passage; a short tail joins the last
    passages = writer.live.snapshot().passages_of(list(result.document.passage_ids))
    assert [len(p.text.split()) for p in passages] == [100, 120]


async def test_a_search_reads_the_snapshot_it_names(writer, retriever):
    before = retriever.snapshot()
    await writer.upsert([DocumentText("volcanoes", f"{VOLCANO} " * 30)])
    assert "volcanoes" not in await search(retriever, VOLCANO, snapshot=before)
    assert "volcanoes" in await search(retriever, VOLCANO, snapshot=retriever.snapshot())


async def test_concurrent_writers_are_grouped_and_each_hears_its_own(writer):
    documents = [DocumentText(f"d{i}", f"{VOLCANO} item{i} " * 20) for i in range(12)]
    results = await asyncio.gather(*(writer.upsert([d]) for d in documents))
    assert [r[0].doc_id for r in results] == [d.doc_id for d in documents]
    assert all(r[0].outcome is WriteOutcome.CREATED for r in results)
    assert writer.stats().lsn == 12 and writer.stats().documents == 80 + 12


async def test_a_full_queue_refuses_at_once(tmp_path):
    _, path = topic_datastore(tmp_path, per_topic=5, nlist=2)
    retriever = open_retriever(path, HashEmbedder(), device="cpu", writable=True)
    writer = DocumentWriter(retriever.live, retriever.embed_passages, max_queued=1)
    held = threading.Event()
    release = threading.Event()
    write = retriever.live.write

    def slow_write(writes):
        held.set()
        release.wait(30)
        return write(writes)

    retriever.live.write = slow_write
    first = asyncio.ensure_future(writer.upsert([DocumentText("a", "lava " * 20)]))
    await asyncio.to_thread(held.wait, 30)  # the writer holds the first job
    second = asyncio.ensure_future(writer.upsert([DocumentText("b", "lava " * 20)]))  # queued
    await asyncio.sleep(0)
    with pytest.raises(WritesBusy, match="queued already"):
        await writer.upsert([DocumentText("c", "lava " * 20)])
    release.set()
    assert (await first)[0].outcome is WriteOutcome.CREATED and (await second)[0].outcome is WriteOutcome.CREATED
    writer.close()
    retriever.close()


def test_documents_without_id_or_text_are_refused():
    with pytest.raises(InvalidDocument) as empty_text:
        DocumentText("a", "   ")
    assert empty_text.value.field == "text"
    with pytest.raises(InvalidDocument) as empty_id:
        DocumentText(" ", "text")
    assert empty_id.value.field == "id"


def test_a_write_waits_while_a_query_embeds(monkeypatch):
    monkeypatch.setattr(embedding_priority, "WRITE_MAX_WAIT_S", 60.0)
    priority = EmbeddingPriority()
    order: list[str] = []
    with priority.query():
        writing = threading.Thread(target=lambda: (priority.write_turn(), order.append("write")))
        writing.start()
        time.sleep(0.2)
        order.append("query done")
    writing.join(30)
    assert order == ["query done", "write"]


async def test_a_compaction_moves_the_retriever_to_the_new_generation_with_the_same_answers(tmp_path):
    _, path = topic_datastore(tmp_path, per_topic=20, nlist=4)
    retriever = open_retriever(
        path, HashEmbedder(), device="cpu", cache_bytes=1 << 20, prefetch_budget_bytes=1 << 20, writable=True
    )
    writer = DocumentWriter(retriever.live, retriever.embed_passages)
    await writer.upsert([DocumentText("volcanoes", f"{VOLCANO} " * 30)])
    await writer.delete(["rivers-0"])
    before, capacity, shared = (
        retriever.snapshot(),
        retriever.cache_stats().capacity_bytes,
        retriever.retrieval_engine.cache.shared,
    )
    ticket = await retriever.prefetch(["volcano lava"])  # planned on generation 0's engine
    expected = await search(retriever, VOLCANO)
    rebuilt = await asyncio.to_thread(retriever.live.compact)
    assert rebuilt.generation == 1
    outcome = await retriever.search([VOLCANO], SearchOptions(top_k=3, nprobe=4), ticket)
    # the same passages, but for ties at the third place (the rivers' passages score alike against lava)
    assert [d.doc_id for d in outcome.documents[0]][:2] == expected[:2] == ["volcanoes", "volcanoes"]
    assert retriever.retrieval_engine.datastore.generation.number == 1
    assert (await search(retriever, VOLCANO, snapshot=before))[:2] == expected[:2]  # a request that began before the switch
    # the new generation's lists share the one cluster cache buffer with the old one's; nothing stays pinned
    assert retriever.retrieval_engine.cache.shared is shared and len(shared.caches) == 2
    assert capacity > 0 and retriever.cache_stats().capacity_bytes == capacity and retriever.cache_stats().pinned_clusters == 0
    assert "rivers-0" not in await search(retriever, "river water fish boat delta flood bank item0")
    writer.close()
    retriever.close()
