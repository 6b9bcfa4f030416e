"""The pipelines' retriever: text in, documents out, batched across callers, same answers as faiss."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from telerag.pipelines.datastores import open_retriever
from telerag.pipelines.retriever import DirectRetriever
from telerag.pipelines.stats import PrefetchStepStats
from telerag.pipelines.types import MeanQuery, PrefetchRequest, SearchOptions, SearchRequest
from telerag.retrieval.errors import DatastoreMismatchError
from telerag.retrieval.ivf import same_results
from tests.retrieval_helpers import CopyEveryMiss, HashEmbedder, topic_datastore


@pytest.fixture()
def retriever(tmp_path) -> DirectRetriever:
    embedder, path = topic_datastore(tmp_path, per_topic=20, nlist=2)
    r = open_retriever(path, embedder, device="cpu", cache_bytes=1 << 20, prefetch_budget_bytes=1 << 20)
    yield r
    r.close()


async def test_demand_copies_take_misses_to_the_device(tmp_path):
    """No prefetch budget, demand copies on: the missed clusters are copied and scanned on the
    device, and the documents are faiss's."""
    embedder, path = topic_datastore(tmp_path, per_topic=20, nlist=2)
    r = open_retriever(path, embedder, device="cpu", cache_bytes=1 << 20, prefetch_budget_bytes=0, demand_copy=True)
    r.retrieval_engine.demand = CopyEveryMiss()
    outcome = await r.search(["river water fish boat"], SearchOptions(top_k=3, nprobe=2))
    reference = await r.search(["river water fish boat"], SearchOptions(top_k=3, nprobe=2, prefetch=False))
    assert outcome.stats.clusters_device == 2 and reference.stats.clusters_cpu == 2
    assert outcome.stats.clusters_copied_on_demand == 2 and reference.stats.clusters_copied_on_demand == 0
    (ids, scores), (ref_ids, ref_scores) = (
        (np.array([d.id for d in o.documents[0]]), np.array([d.score for d in o.documents[0]], dtype=np.float32))
        for o in (outcome, reference)
    )
    assert same_results(ids, scores, ref_ids, ref_scores)  # near-equal scores may swap places
    assert r.cache_stats().pinned_clusters == 0
    r.close()


async def test_prefetch_search_release(retriever):
    ticket = await retriever.prefetch(["river fish"])
    assert ticket.stats.enabled and ticket.stats.plan.clusters_requested >= 1
    outcome = await retriever.search(["river water fish boat"], SearchOptions(top_k=3, nprobe=2), ticket)
    retriever.release(ticket)
    retriever.release(ticket)  # idempotent
    docs = outcome.documents[0]
    assert len(docs) == 3 and all(d.doc_id.startswith("rivers-") for d in docs)
    assert docs[0].score >= docs[1].score >= docs[2].score
    assert outcome.stats.overlap_rate == 1.0
    assert outcome.stats.clusters_device + outcome.stats.clusters_cpu == 2
    assert retriever.cache_stats().pinned_clusters == 0


async def test_an_nprobe_past_the_datastores_lists_searches_them_all_as_faiss_does(retriever):
    """The lists a search may probe are the datastore's, which a retrain changes under a request:
    more than it has are all of them (faiss's own `IndexIVF.search` clamps so), said in the stats."""
    nlist = retriever.datastore_info().nlist
    past = await retriever.search(["river water fish boat"], SearchOptions(top_k=5, nprobe=nlist + 7))
    every = await retriever.search(["river water fish boat"], SearchOptions(top_k=5, nprobe=nlist))
    assert past.stats.nprobe == every.stats.nprobe == nlist
    assert [d.id for d in past.documents[0]] == [d.id for d in every.documents[0]]


async def test_batched_requests_get_their_own_answers(retriever):
    requests = [
        SearchRequest(["piano concert"], SearchOptions(top_k=2, nprobe=1)),
        SearchRequest(["bread oven", "comet galaxy"], SearchOptions(top_k=4, nprobe=2)),
        SearchRequest(["river flood"], SearchOptions(top_k=1, nprobe=2, prefetch=False)),
    ]
    outcomes = await retriever.search_batch(requests)
    assert [len(o.documents) for o in outcomes] == [1, 2, 1]
    assert [len(d) for d in outcomes[1].documents] == [4, 4]
    assert outcomes[1].documents[0][0].doc_id.startswith("baking-")
    assert outcomes[1].documents[1][0].doc_id.startswith("space-")
    assert outcomes[2].stats.clusters_device == 0
    # each equals its own search run alone, and faiss
    for request, outcome in zip(requests, outcomes, strict=True):
        alone = await retriever.search(request.queries, request.options)
        assert [[d.id for d in docs] for docs in alone.documents] == [[d.id for d in docs] for docs in outcome.documents]
    vectors = retriever.embedder.encode(["bread oven"])
    ref_scores, ref_ids = retriever.retrieval_engine.index.search(vectors, 4, 2)
    docs = outcomes[1].documents[0]
    ids, scores = np.array([d.id for d in docs]), np.array([d.score for d in docs], dtype=np.float32)
    assert same_results(ids, scores, ref_ids[0], ref_scores[0])


async def test_prefetch_disabled_issues_no_copies(retriever):
    tickets = await retriever.prefetch_batch([PrefetchRequest(["river"], enabled=False), PrefetchRequest(["star"])])
    assert tickets[0].handle is None and tickets[0].stats == PrefetchStepStats()
    assert tickets[1].handle is not None
    for t in tickets:
        retriever.release(t)


def test_refuses_a_datastore_of_another_embedder(retriever, tmp_path):
    class Other(HashEmbedder):
        name = "another"

    with pytest.raises(DatastoreMismatchError):
        open_retriever(tmp_path / "ds", Other(), device="cpu")


def test_datastore_info(retriever):
    info = retriever.datastore_info()
    assert info.passages == 80 and info.nlist == 2 and info.embedder == "hash-32"
    assert str(retriever.datastore.path) not in repr(info)  # shown to clients: no host paths


def test_budget_is_copy_rate_times_overlap_capped_by_the_cache(retriever):
    capacity = retriever.retrieval_engine.cache.capacity_bytes
    rate = retriever.retrieval_engine.copy_bytes_per_ms
    assert rate and rate > 0, "the copy rate is measured when the cache is made"
    retriever.prefetch_budget_bytes = None
    assert retriever.budget_bytes(0.0) == 0
    assert retriever.budget_bytes(1e-3) == min(int(rate * 1e-3), capacity)
    assert retriever.budget_bytes(1e9) == capacity
    assert retriever.budget_bytes(None) == capacity  # no estimate: the whole cache
    retriever.prefetch_budget_bytes = 1000
    assert retriever.budget_bytes(1e9) == retriever.budget_bytes(None) == 1000  # a fixed budget wins


async def test_no_overlap_means_no_prefetch(retriever):
    retriever.prefetch_budget_bytes = None
    ticket = await retriever.prefetch(["river fish"], overlap_ms=0.0)
    assert ticket.handle is None and ticket.stats == PrefetchStepStats()


async def test_a_mean_query_scores_each_document_by_its_mean_score_over_the_texts(retriever):
    """HyDE's query: the mean of the texts' embeddings. Inner product is linear, so with every
    list probed each document's score is the mean of its scores against each text alone."""
    every = SearchOptions(top_k=80, nprobe=2)
    texts = ("river water fish boat", "piano concert song")
    mean, river, piano = (await retriever.search([MeanQuery(texts), *texts], every)).documents
    alone = {d.id: d.score for d in river}, {d.id: d.score for d in piano}
    assert len(mean) == 80
    for doc in mean:
        assert doc.score == pytest.approx((alone[0][doc.id] + alone[1][doc.id]) / 2, abs=1e-5)
    single = (await retriever.search([MeanQuery(texts[:1])], every)).documents[0]
    assert [d.id for d in single] == [d.id for d in river]


async def test_the_batching_scheduler_carries_mean_queries(retriever):
    """A mean query and a plain one batched into one call get what each gets alone (exactly tied
    documents in either order: the hashed corpus has them)."""
    from telerag.server.scheduling.retrieval_batching import BatchingRetriever

    batching = BatchingRetriever(retriever, window_ms=50, max_batch=8)
    options = SearchOptions(top_k=5, nprobe=2)
    queries = [[MeanQuery(("river flood", "comet galaxy"))], ["bread oven"]]
    together = await asyncio.gather(*(batching.search(q, options) for q in queries))
    for query, outcome in zip(queries, together, strict=True):
        assert outcome.stats.batch == 2  # one search for both callers
        alone = await retriever.search(query, options)
        (ids, scores), (ref_ids, ref_scores) = (
            (np.array([d.id for d in o.documents[0]]), np.array([d.score for d in o.documents[0]], dtype=np.float32))
            for o in (outcome, alone)
        )
        assert same_results(ids, scores, ref_ids, ref_scores)


async def test_queries_are_embedded_on_retrievals_stream(retriever):
    """On CUDA `on_stream` makes retrieval's own stream current; q_in and q_out are embedded
    inside it, so their kernels do not queue behind generation on the default stream."""
    inside, entered = [], []
    on_stream = retriever.retrieval_engine.on_stream

    @contextlib.contextmanager
    def recording():
        entered.append(True)
        with on_stream():
            yield
        entered.pop()

    encode = retriever.embedder.encode
    retriever.retrieval_engine.on_stream = recording
    retriever.embedder.encode = lambda texts, pause=None: (inside.append(bool(entered)), encode(texts))[1]
    await retriever.prefetch(["river fish"])
    await retriever.search(["river water"], SearchOptions(top_k=3, nprobe=2))
    assert inside == [True, True]
