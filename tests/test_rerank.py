"""A re-ranker over a search's candidates (`retrieval.reranker`): a small random-weight
cross-encoder built here (a real BERT architecture, its scores meaningless) reorders exactly as
scoring the pairs with sentence-transformers directly does; through the server, the answer's
documents are in its order with its time in the search step, and OpenAI's ranker `none` leaves it out."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from telerag.retrieval.ranking import HybridRanking, KeywordRanking
from telerag.retrieval.rerank import CrossEncoderReranker, RerankedRanking
from telerag.retrieval.snapshot import search_snapshot
from tests.retrieval_helpers import TOPICS, tiny_cross_encoder
from tests.test_documents_api import documents_app
from tests.test_vector_stores_api import MARKDOWN, PDF, keyed, stores_app


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> Path:
    words = {w for text in TOPICS.values() for w in text.split()} | {"item", "notes", "harbour", "pumpkins", "blue"}
    return tiny_cross_encoder(tmp_path_factory.mktemp("cross-encoder"), words)


def test_the_reranked_order_is_the_cross_encoders(cross_encoder, tmp_path):
    from sentence_transformers import CrossEncoder

    with documents_app(tmp_path) as client:
        retriever = client._transport.app.state.service.runtime.retriever
        snapshot, engine = retriever.live.snapshot(), retriever.retrieval_engine
        texts = ["river water fish", "piano concert violin"]
        vectors = retriever.embedder.encode(texts).astype(np.float32)

        def dense(depth: int, final: bool):
            found = search_snapshot(engine, snapshot, vectors, depth, engine.nlist)
            return found.scores, found.ids

        reranked = RerankedRanking(HybridRanking(), CrossEncoderReranker(cross_encoder), candidates=12)
        scores, ids = reranked.rank(snapshot, texts, 5, dense)
        candidates = HybridRanking(candidates=12).rank(snapshot, texts, 12, dense)[1]
        model = CrossEncoder(str(cross_encoder), device="cpu")
        for row, text in enumerate(texts):
            pool = [int(i) for i in candidates[row] if i >= 0]
            passages = snapshot.passages_of(pool)
            expected = model.predict([(text, f"{p.title}\n{p.text}") for p in passages])
            order = sorted(range(len(pool)), key=lambda j: (-expected[j], pool[j]))[:5]
            assert ids[row].tolist() == [pool[j] for j in order]
            np.testing.assert_allclose(scores[row], [expected[j] for j in order], rtol=1e-5)
        assert np.all((scores >= 0) & (scores <= 1))  # one label: the sigmoid's
        assert set(KeywordRanking().rank(snapshot, texts, 5, dense)[1][0]) != set()  # the keyword half has words to find


async def test_the_server_reranks_with_the_configured_model_and_says_how_long(cross_encoder, tmp_path):
    with documents_app(tmp_path, retrieval={"reranker": str(cross_encoder)}) as client:
        service = client._transport.app.state.service
        assert service.runtime.reranker is None  # the fake app loads nothing (load_reranker: tested below)
        service.runtime.reranker = CrossEncoderReranker(cross_encoder)
        body = {"query": "river water fish boat", "pipeline": "naive", "top_k": 3, "nprobe": 4}
        answer = (await client.post("/v1/rag/query", json=body)).json()
        (search,) = [step for step in answer["steps"] if step["kind"] == "retrieval"]
        assert search["stats"]["rerank_ms"] > 0
        snapshot = service.runtime.retriever.live.snapshot()
        passages = snapshot.passages_of([d["id"] for d in answer["documents"]])
        expected = service.runtime.reranker.scores([(body["query"], f"{p.title}\n{p.text}") for p in passages])
        assert [d["score"] for d in answer["documents"]] == pytest.approx(expected.tolist(), rel=1e-5)
        assert expected.tolist() == sorted(expected.tolist(), reverse=True)


async def test_a_vector_store_search_reranks_unless_the_ranker_is_none(cross_encoder, tmp_path):
    with stores_app(tmp_path, retrieval={"reranker": str(cross_encoder)}) as http:
        http._transport.app.state.service.runtime.reranker = CrossEncoderReranker(cross_encoder)
        client = keyed(http)
        store = await client.vector_stores.create(name="notes")
        await client.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("notes.md", MARKDOWN))
        await client.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("orchard.pdf", PDF))
        stores = http._transport.app.state.vector_stores
        plain = stores.search(store.id, None, ["blue pumpkins"], 10)
        none = await client.vector_stores.search(store.id, query="blue pumpkins", ranking_options={"ranker": "none"})
        assert [(h.file_id, round(h.score, 5)) for h in none.data] == [(h.file_id, round(h.score, 5)) for h in plain]
        for ranker in ("auto", "default-2024-11-15"):
            auto = await client.vector_stores.search(store.id, query="blue pumpkins", ranking_options={"ranker": ranker})
            scores = CrossEncoderReranker(cross_encoder).scores(
                [("blue pumpkins", f"{h.filename}\n{h.content[0].text}") for h in auto.data]
            )
            assert [h.score for h in auto.data] == pytest.approx(scores.tolist(), rel=1e-4)


def test_the_runtime_loads_the_configured_reranker_and_none_without(cross_encoder):
    from telerag.config.settings import RetrievalSettings
    from telerag.server.process.runtime import load_reranker

    assert load_reranker(RetrievalSettings()) is None
    loaded = load_reranker(RetrievalSettings(reranker=cross_encoder, embedder_device="cpu"))
    assert isinstance(loaded, CrossEncoderReranker) and loaded.scores([("river", "river water")]).shape == (1,)
