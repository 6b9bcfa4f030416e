"""The searches of vector stores, batched across requests as the server's datastore's are
(`utils.batching.Batcher`): the queries of every search that arrives while a batch runs are
embedded in one call on the retrieval stream, then each store is searched once for all the
batch's queries that name it (its own retriever's batched search: `DirectRetriever.search_embedded`,
one engine call per snapshot), and each search's top k is merged over its stores.

Each search is exact: every store named is searched for its own top k (as faiss's IndexIVF over
its passages, those of the files a filter matches, at its nprobe), and the stores' results are
merged by score, then store id and passage id, so the merged top k is the top k of all their
passages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from telerag.file_search.vector_store_index import StoreIndex, StoreResources, StoreView
from telerag.pipelines.stats import SearchStats
from telerag.pipelines.text_encoder import embedded
from telerag.pipelines.types import (
    PrefetchTicket,
    RetrievedPassage,
    SearchOptions,
    SearchOutcome,
    SearchQuery,
    SearchRequest,
    query_texts,
    query_vectors,
)
from telerag.retrieval.ranking import Ranking
from telerag.utils.batching import Batcher

if TYPE_CHECKING:
    from telerag.retrieval.prefetch import PrefetchHandle


@dataclass(frozen=True)
class StoresSearch:
    """One search over `views`: each query's top `k` by `ranking`, those scoring under
    `score_threshold` left out; `prefetched`, the request's lookahead, by store id."""

    views: Sequence[StoreView]
    queries: Sequence[SearchQuery]
    k: int
    ranking: Ranking
    score_threshold: float | None = None
    prefetched: Mapping[str, PrefetchHandle] = field(default_factory=dict)


@dataclass(frozen=True)
class Batching:
    """How the searches are batched: the server's `scheduler.batch_window_ms` and `max_batch`;
    `on_batch` hears each batch's queries (the server's `telerag_batch_size` metric)."""

    window_ms: float = 0.0
    max_batch: int = 32
    on_batch: Callable[[int], None] = lambda size: None


class StoresSearcher:
    """Every request's searches of vector stores, through one batcher."""

    def __init__(self, resources: StoreResources, batching: Batching) -> None:
        self.resources = resources
        self._batcher: Batcher[StoresSearch, SearchOutcome] = Batcher(
            self._run, lambda search: len(search.queries), batching.window_ms / 1e3, batching.max_batch, batching.on_batch
        )

    async def search(self, search: StoresSearch) -> SearchOutcome:
        return await self._batcher.submit(search)

    async def _run(self, searches: list[StoresSearch]) -> list[SearchOutcome]:
        return await asyncio.to_thread(self.search_now, searches)

    def search_now(self, searches: Sequence[StoresSearch]) -> list[SearchOutcome]:
        """The searches as one batch, in this thread (it embeds and scans: a worker thread)."""
        started = time.perf_counter()
        queries = [query for search in searches for query in search.queries]
        with self.resources.priority.query():
            vectors = self._embedded(queries) if any(s.ranking.uses_vectors for s in searches) else None
            embed_ms = (time.perf_counter() - started) * 1e3
            if vectors is None:  # by words alone: nothing to embed
                vectors = np.zeros((len(queries), self.resources.embedder.dim), np.float32)
            found = self._found(searches, vectors, embed_ms)
        cpu_ms = (time.perf_counter() - started) * 1e3 - embed_ms
        stats = SearchStats(embed_ms=embed_ms, cpu_ms=cpu_ms, total_ms=embed_ms + cpu_ms, batch=len(queries))
        return [
            SearchOutcome([_merged(found[i, j], search) for j in range(len(search.queries))], stats)
            for i, search in enumerate(searches)
        ]

    def _embedded(self, queries: list[SearchQuery]) -> np.ndarray:
        """One row per query (a list of texts: their mean), every text embedded in one call on the
        retrieval stream."""
        with self.resources.on_stream():
            vectors = embedded(self.resources.embedder, [text for query in queries for text in query_texts(query)])
        return query_vectors(queries, vectors)

    def _found(
        self, searches: Sequence[StoresSearch], vectors: np.ndarray, embed_ms: float
    ) -> dict[tuple[int, int], list[RetrievedPassage]]:
        """(search, query) -> its passages from every store it names, each store searched once
        for all the batch's queries that name it."""
        starts = np.cumsum([0, *(len(search.queries) for search in searches)])
        by_store: dict[int, tuple[StoreIndex, list[tuple[int, StoreView, SearchRequest]]]] = {}
        for i, search in enumerate(searches):
            for view in search.views:
                if view.snapshot is None:
                    continue
                handle = search.prefetched.get(view.store_id)
                ticket = None if handle is None else PrefetchTicket(list(map(str, search.queries)), handle=handle)
                options = SearchOptions(top_k=search.k, snapshot=view.snapshot, ranking=search.ranking)
                entry = by_store.setdefault(id(view.index), (view.index, []))
                entry[1].append((i, view, SearchRequest(list(search.queries), options, ticket)))
        found: dict[tuple[int, int], list[RetrievedPassage]] = {
            (i, j): [] for i, search in enumerate(searches) for j in range(len(search.queries))
        }
        for index, members in by_store.values():
            rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i, _, _ in members])
            outcomes = index.search_embedded([request for _, _, request in members], vectors[rows], embed_ms)
            for (i, view, _), outcome in zip(members, outcomes, strict=True):
                for j, documents in enumerate(outcome.documents):
                    found[i, j] += [
                        dataclasses.replace(d, title=view.files[d.doc_id].filename, source=view.store_id)
                        for d in documents
                        if d.doc_id in view.files
                    ]
        return found


def _merged(found: list[RetrievedPassage], search: StoresSearch) -> list[RetrievedPassage]:
    """The top k over the stores, by score, then store id and passage id."""
    found.sort(key=lambda d: (-d.score, d.source, d.id))
    return [d for d in found[: search.k] if search.score_threshold is None or d.score >= search.score_threshold]
