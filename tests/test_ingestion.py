"""A corpus ingested into a new datastore (`documents.ingestion`): a seed of whole documents drawn at
random, then the rest written a block at a time, then retrained; every document there once, with
its content hash; an ingestion stopped part-way goes on from its last block (a document deleted
meanwhile stays deleted); what `telerag ask` and the benchmarks open is ingested whole first; a
server answers from the seed and writes the rest while it serves, through a SIGKILL."""

from __future__ import annotations

import json
import signal
import time

import httpx
import numpy as np
import pytest

from telerag.documents.ingestion import (
    Ingestion,
    IngestionRecord,
    corpus_documents,
    ingest,
    ingestion_pending,
    write_seed,
)
from telerag.documents.writer import DocumentText, DocumentWriter
from telerag.pipelines.datastores import load_datastore
from telerag.pipelines.embedder import Embedder
from telerag.retrieval.builder import default_nlist
from telerag.retrieval.corpus import Article, PassageShape, read_jsonl
from telerag.retrieval.datastore_writer import check_target
from telerag.retrieval.documents import DocumentUpsert
from telerag.retrieval.errors import DatastoreError
from telerag.retrieval.generations import INGESTION
from telerag.retrieval.live import LiveDatastore, opened
from tests.retrieval_helpers import HashEmbedder
from tests.serving import save_tiny_lm, start_server
from tests.tiny_models import tiny_embedder_dir

WORDS = ["river", "star", "piano", "bread", "flood", "orbit", "violin", "yeast", "delta", "comet", "concert", "dough"]


def corpus(n: int, seed: int = 0) -> list[DocumentText]:
    """`n` documents of one to three passages each (100 words a passage), in id order."""
    rng = np.random.default_rng(seed)
    documents = []
    for i in range(n):
        words = rng.choice(WORDS, size=int(rng.integers(40, 300))).tolist()
        documents.append(DocumentText(f"doc-{i:03d}", " ".join([f"doc{i}", *words]), f"Document {i}"))
    return documents


def seed(path, documents, embedder, *, source="test", **options):
    return write_seed(path, documents, embedder.encode, embedder=embedder.name, source=source, progress=False, **options)


def write_corpus(path, documents) -> None:
    path.write_text("\n".join(json.dumps({"id": d.doc_id, "title": d.title, "text": d.text}) for d in documents))


def passages_of(documents: list[DocumentText]) -> dict[str, list[str]]:
    shape = PassageShape()
    return {d.doc_id: [p.text for p in shape.split([Article(d.doc_id, d.shown_title, d.text)])] for d in documents}


def check_holds(path, documents: list[DocumentText], embedder: HashEmbedder) -> None:
    """The datastore at `path` holds `documents` and nothing else: each once, whole, with its
    content hash, its passages' vectors the embedder's."""
    expected = passages_of(documents)
    with opened(path, verify_checksums=True) as live:
        assert live.stats().documents == len(documents)
        assert live.stats().passages == sum(len(texts) for texts in expected.values())
        snapshot = live.snapshot()
        for document in documents:
            entry = live.document(document.doc_id)
            assert entry is not None and entry.content_hash == document.content_hash
            passages = snapshot.passages_of(list(entry.passage_ids))
            assert [p.text for p in passages] == expected[document.doc_id]
        datastore = live.datastore
        assert not len(snapshot.delta) and not len(snapshot.deleted), "retrained: everything in the generation's files"
        rows = np.arange(datastore.n_vectors)
        texts = [p.text for p in datastore.passages(datastore.ids_of(rows))]
        stored = datastore.codec.decode_exact(datastore.vectors[rows], datastore.codec_params)
        np.testing.assert_allclose(stored, embedder.encode(texts), rtol=0, atol=1e-6)


def test_a_corpus_is_ingested_whole_and_retrained(tmp_path):
    documents, embedder = corpus(60), HashEmbedder()
    path = seed(tmp_path / "ds", documents, embedder, sample_passages=25)
    record = IngestionRecord.read(path)
    assert record == IngestionRecord("test", 60, 0, None, False)
    check_target(path, overwrite=True)  # its record is one of its own files: a datastore, which --overwrite may replace
    with opened(path) as live:
        seeded = live.stats()
        assert 25 <= seeded.passages < 40 and seeded.documents < 60
        for doc_id in [d.doc_id for d in documents if live.document(d.doc_id)]:
            entry = live.document(doc_id)
            assert entry is not None and entry.content_hash == next(d for d in documents if d.doc_id == doc_id).content_hash

    assert ingest(path, documents, embedder.encode, record, block_passages=16, progress=False)
    assert IngestionRecord.read(path) == IngestionRecord("test", 60, 60, None, True)
    check_holds(path, documents, embedder)
    with opened(path) as live:
        assert live.generation == 1
        assert live.manifest.nlist == default_nlist(live.stats().passages)


def test_a_corpus_smaller_than_the_sample_is_one_datastore_with_no_ingestion(tmp_path):
    documents, embedder = corpus(12), HashEmbedder()
    path = seed(tmp_path / "ds", documents, embedder, nlist=3)
    assert not (path / INGESTION).exists() and not ingestion_pending(path)
    with opened(path) as live:
        assert live.generation == 0 and live.manifest.nlist == 3
    check_holds(path, documents, embedder)


def test_an_ingestion_stopped_part_way_goes_on_from_its_last_block(tmp_path):
    documents, embedder = corpus(50, seed=1), HashEmbedder()
    path = seed(tmp_path / "ds", documents, embedder, sample_passages=10)
    calls = []

    def failing(texts):
        calls.append(len(texts))
        if len(calls) == 3:
            raise OSError("the disk is gone")
        return embedder.encode(texts)

    with opened(path, writable=True) as live:
        ingestion = Ingestion(
            DocumentWriter(live, failing), documents, IngestionRecord.read(path), retrain=live.retrain, block_passages=10
        )
        with pytest.raises(OSError, match="disk is gone"):
            ingestion.run()
        assert ingestion.progress.state == "failed" and ingestion.progress.error == "the disk is gone"
        written = IngestionRecord.read(path).written
        assert 0 < written < 50 and ingestion.progress.documents == live.stats().documents  # the seed's among them
        gone = documents[written - 1].doc_id  # written before the stop: deleted meanwhile, it must stay deleted
        assert live.document(gone) is not None
        DocumentWriter(live, embedder.encode).write_now([gone])

    assert ingest(path, documents, embedder.encode, IngestionRecord.read(path), block_passages=10, progress=False)
    check_holds(path, [d for d in documents if d.doc_id != gone], embedder)


def test_a_document_a_client_wrote_during_the_ingestion_stays_the_clients(tmp_path):
    """The ingestion writes a document only where none of its id is held, decided as it writes:
    a client's version of a corpus document written before the ingestion reached it is kept."""
    documents, embedder = corpus(40, seed=3), HashEmbedder()
    path = seed(tmp_path / "ds", documents, embedder, sample_passages=10)
    with opened(path, writable=True) as live:
        absent = [d for d in documents if live.document(d.doc_id) is None]
        mine = DocumentText(absent[-1].doc_id, "my own version of it, comet orbit", "Mine")
        (written,) = DocumentWriter(live, embedder.encode).write_now([mine])
        assert written.outcome == "created"
        # held when the writer looked, deleted by a client before it wrote: it stays deleted
        ghost = DocumentUpsert(absent[0].doc_id, "Ghost", (), None, absent[0].content_hash, if_absent=True)
        (unchanged,) = live.write([ghost])
        assert unchanged.outcome == "unchanged" and live.document(absent[0].doc_id) is None
    assert ingest(path, documents, embedder.encode, IngestionRecord.read(path), block_passages=10, progress=False)
    check_holds(path, [mine if d.doc_id == mine.doc_id else d for d in documents], embedder)


def test_what_opens_a_datastore_to_search_it_ingests_the_rest_first(tmp_path):
    embedder = HashEmbedder()
    source = tmp_path / "c.jsonl"
    documents = corpus(40, seed=2)
    write_corpus(source, documents)
    assert corpus_documents(read_jsonl(source)) == documents
    path = seed(tmp_path / "ds", documents, embedder, source=str(source), sample_passages=20)
    with opened(path, writable=True):  # a server holds it: it writes the rest itself; this opens what is written
        datastore = load_datastore(path, embedder)
        assert datastore.n_vectors < sum(len(t) for t in passages_of(documents).values())
        datastore.close()
    assert ingestion_pending(path)
    load_datastore(path, embedder).close()
    assert not ingestion_pending(path)
    check_holds(path, documents, embedder)


def test_a_corpus_changed_or_gone_since_its_ingestion_began_leaves_what_was_written_serving(tmp_path, caplog):
    embedder, source = HashEmbedder(), tmp_path / "c.jsonl"
    documents = corpus(30, seed=4)
    write_corpus(source, documents)
    path = seed(tmp_path / "ds", documents, embedder, source=str(source), sample_passages=10)
    write_corpus(source, [*documents, DocumentText("doc-new", "a newer article", "New")])
    with caplog.at_level("WARNING"):
        load_datastore(path, embedder).close()
    assert "holds 31 documents, not 30 as it did; what was written serves" in caplog.text
    source.unlink()
    with caplog.at_level("WARNING"):
        load_datastore(path, embedder).close()
    assert "the corpus is gone" in caplog.text
    assert ingestion_pending(path)


def test_an_ingestion_record_of_another_corpus_is_refused(tmp_path):
    documents, embedder = corpus(30), HashEmbedder()
    path = seed(tmp_path / "ds", documents, embedder, sample_passages=10)
    with opened(path, writable=True) as live, pytest.raises(DatastoreError, match="counts 30 documents"):
        Ingestion(DocumentWriter(live, embedder.encode), documents[:20], IngestionRecord.read(path), retrain=live.retrain)


@pytest.mark.slow
def test_a_server_answers_from_the_seed_and_writes_the_rest_while_it_serves(tmp_path):
    """`telerag serve` on a seed: ready with its ingestion reported, killed part-way, started again:
    every document of the corpus there once, retrained, and a late one answered from."""
    embedder_dir = tiny_embedder_dir(32, 0)
    embedder = Embedder(embedder_dir)
    source = tmp_path / "corpus.jsonl"
    documents = corpus(400, seed=3)
    write_corpus(source, documents)
    path = seed(tmp_path / "ds", documents, embedder, source=str(source), sample_passages=40)
    lm = save_tiny_lm(tmp_path / "lm")
    args = ["--model", str(lm), "--embedder", str(embedder_dir), "--datastore", str(path)]
    env = {"TELERAG_SERVER__WARM_UP": "false"}
    server = start_server(args, tmp_path / "first.log", env=env)
    try:
        server.wait_ready(timeout=180)
        live = httpx.get(f"{server.base}/ready", timeout=10).json()["live"]
        assert live["ingestion"]["source"] == str(source) and live["ingestion"]["total_documents"] == 400
        assert live["ingestion"]["state"] in ("ingesting", "retraining", "done")
        server.signal(signal.SIGKILL)
    finally:
        server.stop()
    server = start_server(args, tmp_path / "second.log", env=env)
    try:
        server.wait_ready(timeout=180)
        deadline = time.monotonic() + 120
        while (state := httpx.get(f"{server.base}/v1/datastore", timeout=10).json())["live"]["ingestion"]["state"] != "done":
            assert state["live"]["ingestion"]["state"] != "failed", state
            assert time.monotonic() < deadline, state
            time.sleep(0.2)
        assert state["live"]["documents"] == 400 and state["live"]["generation"] >= 1
        last = documents[-1]  # its first passage as the query: its own vector, in the list the query probes first
        query = {"query": passages_of([last])[last.doc_id][0], "pipeline": "naive", "top_k": 1, "max_tokens": 1}
        found = httpx.post(f"{server.base}/v1/rag/query", json=query, timeout=60)
        assert found.status_code == 200 and found.json()["documents"][0]["doc_id"] == last.doc_id
    finally:
        server.stop()
    live_store = LiveDatastore.open(path)
    try:
        assert live_store.stats().documents == 400
        assert IngestionRecord.read(path).done
    finally:
        live_store.close()
        live_store.datastore.close()


async def test_every_answer_says_how_much_of_the_corpus_it_searched_while_the_rest_is_written(tmp_path):
    """A first start answers from a sample while it writes the rest: each API's answer says so
    (documents held of those expected), as JSON, as the stream's first event, through the openai
    SDK; and says nothing once the corpus is all written. `telerag ask` reads the same from the
    datastore's record."""
    from telerag.documents.ingestion import unfinished_ingestion
    from telerag.documents.rebuilds import Rebuilds
    from telerag.pipelines.datastores import open_retriever
    from telerag.server.app import create_app, start_serving
    from telerag.server.process.runtime import Runtime
    from tests.fake_app import sdk, settings
    from tests.fakes import Reply, ScriptedEngine

    embedder, documents = HashEmbedder(), corpus(60, seed=5)
    path = seed(tmp_path / "ds", documents, embedder, sample_passages=20)
    retriever = open_retriever(path, embedder, device="cpu", writable=True)
    held = retriever.live.stats().documents  # the seed's, drawn from all of the corpus
    assert 0 < held < 60 and IngestionRecord.read(path).written == 0 and unfinished_ingestion(retriever.live).documents == held
    rebuilds = Rebuilds(retriever.live)
    writer = DocumentWriter(retriever.live, retriever.embed_passages)
    ingestion = Ingestion(
        writer, documents, IngestionRecord.read(path), retrain=lambda nlist: retriever.live.retrain(nlist=nlist)
    )
    runtime = Runtime(
        settings=settings(),
        engine=ScriptedEngine(lambda prompt: Reply("an answer")),
        retriever=retriever,
        datastore_info=retriever.datastore_info(),
        documents=writer,
        rebuilds=rebuilds,
        ingestion=ingestion,
    )
    app = create_app(runtime.settings)
    start_serving(app, runtime)
    partly = {"source": "test", "state": "ingesting", "documents": held, "total_documents": 60, "error": None}
    question = [{"role": "user", "content": "river star"}]
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30) as client:
            answer = await client.post("/v1/rag/query", json={"query": "river star", "max_tokens": 4})
            assert answer.status_code == 200 and answer.json()["ingestion"] == partly, answer.text
            streamed = await client.post("/v1/rag/query", json={"query": "river star", "stream": True})
            first = streamed.text.split("\n\n")[0].splitlines()
            assert first[0] == "event: ingestion" and json.loads(first[1].removeprefix("data: ")) == partly
            assert f'"ingestion":{json.dumps(partly, separators=(",", ":"))}' in streamed.text.replace(" ", "")  # the result
            chat = await sdk(client).chat.completions.create(model="naive", messages=question)
            assert chat.model_extra["ingestion"] == partly
            chunks = [c async for c in await sdk(client).chat.completions.create(model="naive", messages=question, stream=True)]
            assert chunks[0].model_extra["ingestion"] == partly and "ingestion" not in chunks[-1].model_extra
            response = await sdk(client).responses.create(model="naive", input="river star")
            assert response.model_extra["ingestion"] == partly

            ingestion.run()  # the rest written, and retrained
            assert unfinished_ingestion(retriever.live) is None
            done = await client.post("/v1/rag/query", json={"query": "river star", "max_tokens": 4})
            assert done.status_code == 200 and done.json()["ingestion"] is None
            assert "event: ingestion" not in (await client.post("/v1/rag/query", json={"query": "q", "stream": True})).text
            assert (await sdk(client).chat.completions.create(model="naive", messages=question)).model_extra["ingestion"] is None
    finally:
        writer.close()
        rebuilds.join()
        retriever.close()
