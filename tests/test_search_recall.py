"""The dense search's recall, estimated on the traffic: sampled searches repeated exhaustively in
idle time. It falls when the lists are skewed and nprobe is cut, is 1 where every list is probed,
is logged once below its target, and is shown on /metrics and /ready."""

from __future__ import annotations

import asyncio
import logging
import random

import httpx
import numpy as np
import pytest

from telerag.pipelines.datastores import open_retriever
from telerag.pipelines.types import SearchOptions
from telerag.retrieval.documents import DocumentUpsert
from telerag.retrieval.recall import query_recall
from telerag.server.app import create_app, start_serving
from telerag.server.process.runtime import Runtime
from tests.fake_app import settings
from tests.fakes import Reply, ScriptedEngine
from tests.retrieval_helpers import HashEmbedder, topic_datastore

WORDS = ["river", "water", "fish", "boat", "star", "planet", "orbit", "piano", "music", "song", "bread", "flour", "oven"]


def questions(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.sample(WORDS, 3)) for _ in range(n)]


def skewed_retriever(tmp_path, budget: float = 1e6):
    """16 lists over four topics, then 150 documents that all fall near one place (what a bulk
    upload of templated pages does to a datastore's lists)."""
    embedder, path = topic_datastore(tmp_path, per_topic=40, nlist=16)
    retriever = open_retriever(path, HashEmbedder(), device="cpu", writable=True, recall_budget=budget, target_recall=0.99)
    texts = [f"river water star piano bread item{i}" for i in range(150)]
    vectors = embedder.encode(texts)
    retriever.live.write(
        [DocumentUpsert(f"bulk-{i}", "bulk", (t,), vectors[i : i + 1], content_hash=str(i)) for i, t in enumerate(texts)]
    )
    assert retriever.live.snapshot().imbalance() > 3
    return retriever


def searched(retriever, nprobe: int, n: int = 40) -> float:
    for question in questions(n):
        asyncio.run(retriever.search([question], SearchOptions(top_k=10, nprobe=nprobe, prefetch=False)))
        retriever.recall.drain()  # each measured before the next: none turned away by a full queue on a slow machine
    return retriever.search_recall().recall


def test_query_recall_counts_ties_at_the_boundary_as_found():
    exact_ids, exact_scores = np.array([4, 7, 9]), np.array([0.9, 0.5, 0.5], dtype=np.float32)
    assert query_recall(np.array([4, 8, 7]), np.array([0.9, 0.5, 0.5]), exact_ids, exact_scores) == 1.0  # 8 ties with 9
    assert query_recall(np.array([4, 8, -1]), np.array([0.9, 0.2, -1.0]), exact_ids, exact_scores) == pytest.approx(1 / 3)
    assert query_recall(np.array([-1]), np.array([0.0]), np.array([-1]), np.array([0.0])) is None


def test_recall_falls_when_lists_are_skewed_and_nprobe_is_cut_and_is_logged_once(tmp_path, caplog):
    retriever = skewed_retriever(tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="telerag.retrieval.recall"):
            cut = searched(retriever, nprobe=1)
            searched(retriever, nprobe=1)
        estimate = retriever.search_recall()
        assert cut < 0.9 and estimate.samples >= 40 and estimate.target == 0.99
        assert sum("below retrieval.target_recall" in r.message for r in caplog.records) == 1  # once, not per sample
    finally:
        retriever.close()
    (tmp_path / "again").mkdir()
    every = skewed_retriever(tmp_path / "again")
    try:
        assert searched(every, nprobe=16) == 1.0  # every list probed: exact
    finally:
        every.close()


@pytest.mark.parametrize(("budget", "samples"), [(0.0, 0), (1e-9, 10)])
def test_the_budget_gates_the_sampling(tmp_path, budget, samples):
    """No budget: nothing sampled. A budget too small for a second exhaustive search: the first
    search (its 10 queries) is sampled, and none after it, since its cost is counted (reserved as
    its own search's time until measured) before the next is offered."""
    retriever = skewed_retriever(tmp_path, budget=budget)
    try:
        for _ in range(6):
            asyncio.run(retriever.search(questions(10), SearchOptions(top_k=10, nprobe=1, prefetch=False)))
        retriever.recall.drain()
        assert retriever.search_recall().samples == samples
    finally:
        retriever.close()


async def test_recall_on_metrics_and_ready(tmp_path):
    retriever = skewed_retriever(tmp_path)
    configured = settings()
    runtime = Runtime(
        settings=configured,
        engine=ScriptedEngine(lambda prompt: Reply("an answer")),
        retriever=retriever,
        datastore_info=retriever.datastore_info(),
        search_recall=retriever.search_recall,
        closers=[retriever.close],
    )
    app = create_app(configured)
    start_serving(app, runtime)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            ready = (await client.get("/ready")).json()
            assert ready["recall"]["recall"] is None and ready["recall"]["samples"] == 0
            for question in questions(12):
                response = await client.post("/v1/rag/query", json={"query": question, "top_k": 5, "nprobe": 1})
                assert response.status_code == 200, response.text
                await asyncio.to_thread(retriever.recall.drain)
            ready = (await client.get("/ready")).json()["recall"]
            assert ready["samples"] >= 12 and 0 < ready["recall"] < 1 and ready["datastore"] == "ds"
            metrics = (await client.get("/metrics")).text
            assert f'telerag_search_recall{{datastore="ds"}} {ready["recall"]}' in metrics
            assert f'telerag_search_recall_samples_total{{datastore="ds"}} {float(ready["samples"])}' in metrics
    finally:
        retriever.close()
