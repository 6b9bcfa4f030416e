"""OpenAI's `file_search` tool through the official SDK: a response's pipeline answers from the
vector stores it names, says so in its `file_search_call` item and cites the files; a file
deleted is cited no more; a search over several stores is the exact merge of each store's."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import faiss
import numpy as np
import openai
import pytest
from langchain_openai import ChatOpenAI

from telerag.file_search.attribute_filters import Comparison
from telerag.file_search.store_retriever import StoresRetriever
from telerag.file_search.store_searcher import Batching, StoresSearch, StoresSearcher
from telerag.file_search.vector_store_records import Attach
from telerag.pipelines.text_encoder import embedded
from telerag.pipelines.types import SearchOptions
from telerag.retrieval.ivf import same_results
from telerag.retrieval.ranking import DENSE
from tests.test_vector_stores_api import MARKDOWN, PDF, faiss_reference, keyed, served_stores, stores_app

QUESTION = "Where are the blue pumpkins kept?"


def tool(store_ids, **fields) -> dict:
    return {"type": "file_search", "vector_store_ids": list(store_ids), **fields}


def cited(response) -> list[str]:
    message = response.output[-1]
    return [a.file_id for a in message.content[0].annotations]


async def test_an_answer_with_the_file_search_tool_cites_its_files_and_forgets_a_deleted_one(tmp_path):
    with stores_app(tmp_path) as http:
        client = keyed(http)
        store = await client.vector_stores.create(name="notes")
        notes = await client.vector_stores.files.upload_and_poll(
            vector_store_id=store.id, file=("notes.md", MARKDOWN), attributes={"kind": "notes"}
        )
        orchard = await client.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("orchard.pdf", PDF))

        response = await client.responses.create(
            model="naive", input=QUESTION, tools=[tool([store.id], max_num_results=1)], include=["file_search_call.results"]
        )
        call, message = response.output
        assert (call.type, call.status, call.queries) == ("file_search_call", "completed", [QUESTION])
        assert [(r.file_id, r.filename, r.attributes) for r in call.results] == [(notes.id, "notes.md", {"kind": "notes"})]
        assert "blue pumpkins" in call.results[0].text
        assert [(a.type, a.file_id, a.filename, a.index) for a in message.content[0].annotations] == [
            ("file_citation", notes.id, "notes.md", len(response.output_text))
        ]
        assert response.output_text == "an answer" and response.tools[0].vector_store_ids == [store.id]
        assert response.documents == [  # the extension says where each passage came from
            {**response.documents[0], "doc_id": notes.id, "title": "notes.md", "source": store.id}
        ]

        without = await client.responses.create(model="naive", input=QUESTION, tools=[tool([store.id], max_num_results=1)])
        assert without.output[0].results is None and cited(without) == [notes.id]  # results only when included

        await client.vector_stores.files.delete(notes.id, vector_store_id=store.id)
        again = await client.responses.create(model="naive", input=QUESTION, tools=[tool([store.id], max_num_results=1)])
        assert cited(again) == [orchard.id]  # the only file left


async def test_a_streamed_response_with_the_file_search_tool_has_the_calls_events(tmp_path):
    with stores_app(tmp_path) as http:
        client = keyed(http)
        store = await client.vector_stores.create(name="notes")
        notes = await client.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("notes.md", MARKDOWN))
        async with client.responses.stream(
            model="naive", input=QUESTION, tools=[tool([store.id])], include=["file_search_call.results"]
        ) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.file_search_call.in_progress",
        "response.file_search_call.searching",
    ]
    assert kinds.index("response.file_search_call.completed") < kinds.index("response.output_text.done")
    assert kinds.count("response.output_text.annotation.added") == 1 and kinds[-1] == "response.completed"
    call, message = final.output
    assert call.status == "completed" and [r.file_id for r in call.results] == [notes.id]
    assert final.output_text == "an answer" and [a.file_id for a in message.content[0].annotations] == [notes.id]


async def test_a_chat_completion_takes_the_file_search_tool_as_an_extension(tmp_path):
    with stores_app(tmp_path) as http:
        client = keyed(http)
        store = await client.vector_stores.create(name="notes")
        notes = await client.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("notes.md", MARKDOWN))
        completion = await client.chat.completions.create(
            model="naive", messages=[{"role": "user", "content": QUESTION}], extra_body={"tools": [tool([store.id])]}
        )
    documents = completion.model_extra["documents"]
    assert [(d["doc_id"], d["title"], d["source"]) for d in documents] == [(notes.id, "notes.md", store.id)]


@pytest.mark.parametrize(
    ("fields", "param", "error"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools", openai.BadRequestError),
        ({"tools": [tool(["vs_a"]), tool(["vs_b"])]}, "tools", openai.BadRequestError),
        ({"tools": [tool(["vs_a"])], "include": ["message.output_text.logprobs"]}, "include", openai.BadRequestError),
        ({"tools": [tool(["vs_unknown"])]}, None, openai.NotFoundError),
    ],
)
async def test_a_tool_not_served_or_a_store_not_the_keys_is_refused(tmp_path, fields, param, error):
    with stores_app(tmp_path) as http:
        client = keyed(http)
        with pytest.raises(error) as refused:
            await client.responses.create(model="naive", input=QUESTION, **fields)
    assert refused.value.param == param


async def test_another_keys_store_is_not_found_for_the_tool(tmp_path):
    with stores_app(tmp_path, server={"api_keys": ["key-of-ann", "key-of-bob"]}) as http:
        ann, bob = keyed(http, "key-of-ann"), keyed(http, "key-of-bob")
        store = await ann.vector_stores.create(name="ann's")
        await ann.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("notes.md", MARKDOWN))
        with pytest.raises(openai.NotFoundError):
            await bob.responses.create(model="naive", input=QUESTION, tools=[tool([store.id])])
        assert cited(await ann.responses.create(model="naive", input=QUESTION, tools=[tool([store.id])]))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_search_over_several_stores_is_the_merge_of_each_stores_faiss_search(tmp_path, seed):
    """Three random stores (one large enough that nprobe < nlist) sharing a cluster cache buffer
    too small for them all, a filter half the time, a lookahead from another query half the time:
    each query's top k over all of them equals the merge, by score and then store and id, of
    faiss's top k of each store at its nprobe."""
    rng = random.Random(seed)
    vocabulary = [f"w{i}" for i in range(200)]
    with served_stores(tmp_path, cache_rows=300) as (files, stores, store_resources):
        ids = []
        for n, sizes in enumerate([[800, 40], [30, 20], [60]]):
            store = stores.create(None, name=f"s{n}", metadata={})
            ids.append(store.id)
            for m, size in enumerate(sizes):
                text = " ".join(rng.choice(vocabulary) for _ in range(6 * size))
                stores.attach(store.id, None, Attach(files.add(text.encode(), f"f{n}{m}.txt", "assistants", None).id, {"m": m}))
        while any(stores.get(i, None).in_progress for i in ids):
            time.sleep(0.01)
        references = [faiss_reference(tmp_path / "stores" / i, store_resources.embedder) for i in ids]
        assert references[0][0].nprobe < references[0][0].nlist
        for _ in range(8):
            k = rng.randint(1, 12)
            only_first = rng.random() < 0.5
            query = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(1, 6)))
            where = Comparison("eq", "m", 0.0) if only_first else None
            retriever = StoresRetriever(stores.views(ids, None, where), stores.searcher)
            vector = embedded(store_resources.embedder, [query])
            if rng.random() < 0.5:
                q_in = " ".join(rng.choice(vocabulary) for _ in range(3))  # what a lookahead guessed, right or not
                ticket = asyncio.run(retriever.prefetch([q_in]))
                assert ticket.stats.enabled and ticket.stats.plan.clusters_requested > 0
                got = asyncio.run(retriever.search([query], SearchOptions(top_k=k), ticket)).documents[0]
            else:
                got = asyncio.run(retriever.search([query], SearchOptions(top_k=k))).documents[0]
            expected = []
            for at, (reference, passages) in enumerate(references):
                selected = [
                    i
                    for i, (file_id, _) in passages.items()
                    if where is None or stores.file(ids[at], None, file_id).attributes["m"] == 0
                ]
                params = faiss.SearchParametersIVF(
                    nprobe=reference.nprobe, sel=faiss.IDSelectorBatch(np.asarray(sorted(selected)))
                )
                scores, found = reference.search(vector, k, params=params)
                expected += [(float(s), ids[at], int(i)) for s, i in zip(scores[0], found[0], strict=True) if i >= 0]
            expected = sorted(expected, key=lambda e: (-e[0], e[1], e[2]))[:k]
            code = {store_id: n << 32 for n, store_id in enumerate(ids)}  # (store, passage) as one int64 for same_results
            assert same_results(
                np.asarray([code[d.source] + d.id for d in got], dtype=np.int64),
                np.asarray([d.score for d in got], dtype=np.float32),
                np.asarray([code[s] + i for _, s, i in expected], dtype=np.int64),
                np.asarray([e[0] for e in expected], dtype=np.float32),
            ), (query, k, where)
            assert len(got) == len(expected)  # never short
        cache = store_resources.cache
        assert cache is not None and cache.stats().copies > 0 and cache.stats().pinned_clusters == 0
        assert len(cache.caches) == 3  # each store's lists, in the one buffer
        cache.check_invariants()


class CountingEncoder:
    """An encoder that records the size of each call."""

    def __init__(self, inner, calls: list[int]) -> None:
        self.inner, self.calls, self.name, self.dim = inner, calls, inner.name, inner.dim

    def encode(self, texts, *, pause=None):
        self.calls.append(len(texts))
        return self.inner.encode(texts, pause=pause)

    def count_tokens(self, texts) -> int:
        return self.inner.count_tokens(texts)


def test_searches_of_several_requests_are_one_batch_and_each_gets_what_it_gets_alone(tmp_path):
    """Three requests' file_search searches arriving together are one batch of the stores'
    searcher: their queries embedded in one call, each store searched once for all that name it,
    and each request's top k the one it gets searched alone."""
    rng = random.Random(3)
    vocabulary = [f"w{i}" for i in range(100)]
    with served_stores(tmp_path) as (files, stores, store_resources):
        ids = []
        for n in range(2):
            store = stores.create(None, name=f"s{n}", metadata={})
            ids.append(store.id)
            text = " ".join(rng.choice(vocabulary) for _ in range(600))
            stores.attach(store.id, None, Attach(files.add(text.encode(), f"f{n}.txt", "assistants", None).id, {}))
        while any(stores.get(i, None).in_progress for i in ids):
            time.sleep(0.01)
        calls: list[int] = []
        sizes: list[int] = []
        counting = dataclasses.replace(store_resources, embedder=CountingEncoder(store_resources.embedder, calls))
        searcher = StoresSearcher(counting, Batching(window_ms=500, on_batch=sizes.append))
        asks = [(ids[:1], "w1 w2"), (ids, "w3"), (ids[1:], "w4 w5 w6")]

        async def together():
            retrievers = [StoresRetriever(stores.views(store_ids, None), searcher) for store_ids, _ in asks]
            searches = (r.search([query], SearchOptions(top_k=5)) for r, (_, query) in zip(retrievers, asks, strict=True))
            return await asyncio.gather(*searches)

        outcomes = asyncio.run(together())
        assert sizes == [3] and calls == [3]
        for (store_ids, query), outcome in zip(asks, outcomes, strict=True):
            (alone,) = searcher.search_now([StoresSearch(stores.views(store_ids, None), [query], 5, DENSE)])
            assert outcome.documents[0] and {d.source for d in outcome.documents[0]} <= set(store_ids)
            assert [(d.source, d.id, d.score) for d in outcome.documents[0]] == [
                (d.source, d.id, d.score) for d in alone.documents[0]
            ]


async def test_the_tools_searches_run_beside_other_requests(tmp_path):
    """Two tool requests at once, each over its own store, each cites its own file."""
    with stores_app(tmp_path) as http:
        client = keyed(http)
        first, second = await client.vector_stores.create(name="a"), await client.vector_stores.create(name="b")
        notes = await client.vector_stores.files.upload_and_poll(vector_store_id=first.id, file=("notes.md", MARKDOWN))
        orchard = await client.vector_stores.files.upload_and_poll(vector_store_id=second.id, file=("orchard.pdf", PDF))
        await client.responses.create(model="naive", input=QUESTION)  # admission measures one alone first
        answers = await asyncio.gather(
            *(client.responses.create(model="naive", input=QUESTION, tools=[tool([s.id])]) for s in (first, second))
        )
    assert [cited(a) for a in answers] == [[notes.id], [orchard.id]]


async def test_langchain_with_the_file_search_tool_answers_from_the_store_and_cites_it(tmp_path):
    """LangChain's ChatOpenAI on the Responses API, with OpenAI's built-in tool bound as its
    documentation shows: the answer's content blocks carry the file's citation."""
    with stores_app(tmp_path) as http:
        client = keyed(http)
        store = await client.vector_stores.create(name="notes")
        notes = await client.vector_stores.files.upload_and_poll(vector_store_id=store.id, file=("notes.md", MARKDOWN))
        chat = ChatOpenAI(
            model="naive",
            base_url="http://test/v1",
            api_key="unused",
            http_async_client=http,
            max_retries=0,
            use_responses_api=True,
        )
        reply = await chat.bind_tools([tool([store.id])]).ainvoke(QUESTION)
    text = [block for block in reply.content if block["type"] == "text"]
    assert [block["text"] for block in text] == ["an answer"]
    assert [(a["type"], a["file_id"], a["filename"]) for a in text[0]["annotations"]] == [("file_citation", notes.id, "notes.md")]
    (call,) = [block for block in reply.content if block["type"] == "file_search_call"]
    assert (call["status"], call["queries"]) == ("completed", [QUESTION])
