"""Search modes as users reach them: `search_mode` on /v1/rag/query (and `retrieval.search_mode`
when a request does not say), OpenAI's `ranking_options` on a vector store's search and on the
`file_search` tool, through the official SDK. Each answer is the ranking it asked for, computed
again here on the same snapshot: a mode or a weight is honored, never dropped."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from telerag.retrieval.keywords import keyword_search
from telerag.retrieval.ranking import HybridRanking, KeywordRanking
from telerag.retrieval.snapshot import search_snapshot
from tests.test_documents_api import documents_app
from tests.test_vector_stores_api import MARKDOWN, PDF, keyed, stores_app

NAME = "Brelm2q4821"
LIGHTHOUSE = f"The Drummet Lighthouse on the island of {NAME} flashes green every nine seconds"


async def answered(client, **fields) -> list[int]:
    response = await client.post("/v1/rag/query", json={"pipeline": "naive", "top_k": 3, "nprobe": 1, **fields})
    assert response.status_code == 200, response.text
    return [document["id"] for document in response.json()["documents"]]


async def test_a_query_searches_in_the_mode_it_names_or_the_servers(tmp_path):
    with documents_app(tmp_path, retrieval={"search_mode": "keyword"}) as client:
        written = await client.post("/v1/documents", json={"id": "drummet", "text": LIGHTHOUSE, "title": "Drummet"})
        assert written.status_code == 201, written.text
        retriever = client._transport.app.state.service.runtime.retriever
        snapshot = retriever.live.snapshot()
        query = f"Which lighthouse is on {NAME}?"

        found = keyword_search(snapshot, [query], 3)[1][0]
        by_words = found[found >= 0].tolist()
        assert snapshot.passages_of(by_words[:1])[0].doc_id == "drummet"
        assert await answered(client, query=query) == by_words  # the server's mode: keyword
        assert await answered(client, query=query, search_mode="keyword") == by_words

        vector = retriever.embedder.encode([query]).astype(np.float32)
        engine = retriever.retrieval_engine_for(snapshot.datastore)
        dense = search_snapshot(engine, snapshot, vector, 3, 1)
        assert await answered(client, query=query, search_mode="dense") == dense.ids[0][dense.ids[0] >= 0].tolist()

        def dense_at(depth: int, final: bool):
            found = search_snapshot(engine, snapshot, vector, depth, 1)
            return found.scores, found.ids

        hybrid = HybridRanking().rank(snapshot, [query], 3, dense_at)[1][0]
        assert await answered(client, query=query, search_mode="hybrid") == hybrid[hybrid >= 0].tolist()

        refused = await client.post("/v1/rag/query", json={"query": query, "search_mode": "sparse"})
        assert refused.status_code == 422 and refused.json()["error"]["param"] == "search_mode"


@pytest.mark.parametrize("ranker", ["none", "auto", "default-2024-11-15"])
async def test_a_vector_store_search_takes_openais_ranking_options(tmp_path, ranker):
    """Every ranker OpenAI names is served (none is configured: the scores are the search's own);
    `hybrid_search` weights make the search hybrid, its scores in [0, 1]: all the weight on the
    words, the order is BM25's; `score_threshold` cuts on that scale."""
    with stores_app(tmp_path) as http:
        client = keyed(http)
        store = await client.vector_stores.create(name="notes")
        notes = await client.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("notes.md", MARKDOWN))
        orchard = await client.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("orchard.pdf", PDF))
        stores = http._transport.app.state.vector_stores
        query = "blue pumpkins orchard"

        plain = await client.vector_stores.search(store.id, query=query, ranking_options={"ranker": ranker})
        assert [h.file_id for h in plain.data] == [h.file_id for h in stores.search(store.id, None, [query], 10)]

        by_words = await client.vector_stores.search(
            store.id,
            query=query,
            ranking_options={"ranker": ranker, "hybrid_search": {"embedding_weight": 0, "text_weight": 1}},
        )
        expected = stores.search(store.id, None, [query], 10, ranking=KeywordRanking())
        assert [h.file_id for h in by_words.data] == [h.file_id for h in expected] and len(expected) == 2
        assert {notes.id, orchard.id} == {h.file_id for h in by_words.data}
        assert by_words.data[0].score == pytest.approx(1.0) and all(0 <= h.score <= 1 for h in by_words.data)

        fused = stores.search(store.id, None, [query], 10, ranking=HybridRanking(0.5, 2.0))
        both = await client.vector_stores.search(
            store.id, query=query, ranking_options={"hybrid_search": {"embedding_weight": 0.5, "text_weight": 2.0}}
        )
        assert [(h.file_id, round(h.score, 5)) for h in both.data] == [(h.file_id, round(h.score, 5)) for h in fused]
        cut = fused[-1].score + 1e-4
        over = await client.vector_stores.search(
            store.id,
            query=query,
            ranking_options={"score_threshold": cut, "hybrid_search": {"embedding_weight": 0.5, "text_weight": 2.0}},
        )
        assert [h.file_id for h in over.data] == [h.file_id for h in fused if h.score >= cut] != []

        with pytest.raises(openai.UnprocessableEntityError):
            await client.vector_stores.search(
                store.id, query=query, ranking_options={"hybrid_search": {"embedding_weight": 0, "text_weight": 0}}
            )


async def test_the_file_search_tool_takes_hybrid_weights(tmp_path):
    """The tool's `hybrid_search` weights rank the passages its answer is written from."""
    with stores_app(tmp_path) as http:
        client = keyed(http)
        store = await client.vector_stores.create(name="notes")
        await client.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("notes.md", MARKDOWN))
        await client.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("orchard.pdf", PDF))
        stores = http._transport.app.state.vector_stores
        question = "violin pumpkins"
        for weights in ((0.0, 1.0), (1.0, 3.0)):
            options = {"hybrid_search": {"embedding_weight": weights[0], "text_weight": weights[1]}}
            tool = {"type": "file_search", "vector_store_ids": [store.id], "max_num_results": 2, "ranking_options": options}
            response = await client.responses.create(
                model="naive", input=question, tools=[tool], include=["file_search_call.results"]
            )
            expected = stores.search(store.id, None, [question], 2, ranking=HybridRanking(*weights))
            assert [(r.file_id, round(r.score, 5)) for r in response.output[0].results] == [
                (h.file_id, round(h.score, 5)) for h in expected
            ]
