"""A `Retriever` over vector stores: what a request's `file_search` tool runs its pipeline on
instead of the server's datastore (`Pipeline.over`).

Each search is exact: every store named is searched for its own top k (exactly as faiss's
IndexIVF over its passages, those of the files the tool's filter matches, at its nprobe), and the
stores' results are merged by score, then store id and passage id, so the merged top k is the
top k of all their passages. The stores are read as they were when the request began (each
one's snapshot is taken then), so every search of one request sees the same files. Nothing is
prefetched: stores are searched on the CPU, with no cluster cache.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np

from telerag.pipelines.attribute_filters import Attributes
from telerag.pipelines.stats import SearchStats
from telerag.pipelines.types import (
    Document,
    OnProvisional,
    PrefetchTicket,
    SearchOptions,
    SearchOutcome,
    SearchQuery,
    TextEmbeddings,
    query_texts,
)
from telerag.pipelines.vector_store_index import StoreEncoder, StoreView
from telerag.retrieval.snapshot import Snapshot


class StoresRetriever:
    """The `Retriever` of one request over `views` (`VectorStores.views`); a passage scoring under
    `score_threshold` is left out of what a search returns."""

    def __init__(self, views: Sequence[StoreView], encoder: StoreEncoder, score_threshold: float | None = None) -> None:
        self.views, self.encoder, self.score_threshold = tuple(views), encoder, score_threshold
        self.searched: list[str] = []  # every query the request's searches asked, in order

    async def prefetch(self, queries: Sequence[str], *, enabled: bool = True, overlap_ms: float | None = None) -> PrefetchTicket:
        return PrefetchTicket(list(queries))  # nothing to copy: no cluster cache holds a store's lists

    async def search(
        self,
        queries: Sequence[SearchQuery],
        options: SearchOptions,
        ticket: PrefetchTicket | None = None,
        *,
        provisional: OnProvisional | None = None,
    ) -> SearchOutcome:
        """Each query's top `options.top_k` over the stores (no provisional top-k: a store's search
        is one faiss call, with nothing to report before it ends)."""
        self.searched += [str(query) for query in queries]
        return await asyncio.to_thread(self._search, list(queries), options.top_k)

    def release(self, ticket: PrefetchTicket) -> None:
        pass

    def snapshot(self) -> Snapshot | None:
        return None  # each store's own is in its view, taken when the request began

    async def embed(self, texts: Sequence[str]) -> TextEmbeddings:
        def work() -> TextEmbeddings:
            with self.encoder.priority.query():
                vectors = np.asarray(self.encoder.embedder.encode(list(texts)), dtype=np.float32)
            return TextEmbeddings(vectors, self.encoder.embedder.count_tokens(texts))

        return await asyncio.to_thread(work)

    def attributes(self, document: Document) -> Attributes:
        """The attributes of a found passage's file, as they were when the request began."""
        view = next(v for v in self.views if v.store_id == document.source)
        return view.files[document.doc_id].attributes

    # -- in a worker thread -----------------------------------------------------------------------

    def _search(self, queries: list[SearchQuery], k: int) -> SearchOutcome:
        started = time.perf_counter()
        with self.encoder.priority.query():
            vectors = [self.encoder.query(query_texts(query)) for query in queries]
        embedded = time.perf_counter()
        documents = [self.merged(vector, k) for vector in vectors]
        embed_ms, cpu_ms = (embedded - started) * 1e3, (time.perf_counter() - embedded) * 1e3
        return SearchOutcome(
            documents, SearchStats(embed_ms=embed_ms, cpu_ms=cpu_ms, total_ms=embed_ms + cpu_ms, batch=len(queries))
        )

    def merged(self, query: np.ndarray, k: int) -> list[Document]:
        """The top k for `query` (1, dim) over every store: each store's exact top k, merged by
        score, then store id and passage id."""
        found = [
            Document(hit.id, hit.file_id, view.files[hit.file_id].filename, hit.text, hit.score, source=view.store_id)
            for view in self.views
            for hit in view.search(query, k)
            if hit.file_id in view.files
        ]
        found.sort(key=lambda d: (-d.score, d.source, d.id))
        return [d for d in found[:k] if self.score_threshold is None or d.score >= self.score_threshold]
