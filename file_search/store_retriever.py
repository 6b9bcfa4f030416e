"""A `Retriever` over vector stores: what a request's `file_search` tool runs its pipeline on
instead of the server's datastore (`Pipeline.over`).

Its searches go through the stores' one batcher (`file_search.store_searcher`: batched across
requests, embedded once per batch, exact). The stores are read as they were when the request
began (each one's snapshot is taken then), so every search of one request sees the same files.
The lookahead is the server's: a prefetch copies each store's lists nearest q_in into the one
cluster cache (the server's budget for the overlap, split evenly among the stores), and each
store's search reads them, as the server's datastore's search does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from telerag.file_search.attribute_filters import Attributes
from telerag.file_search.store_searcher import StoresSearch, StoresSearcher
from telerag.file_search.vector_store_index import StoreView
from telerag.pipelines.stats import PrefetchStepStats
from telerag.pipelines.text_encoder import embedded
from telerag.pipelines.types import (
    PrefetchTicket,
    RetrievedPassage,
    SearchOptions,
    SearchOutcome,
    SearchQuery,
    TextEmbeddings,
)
from telerag.retrieval.ranking import Ranking
from telerag.retrieval.snapshot import Snapshot
from telerag.retrieval.stats import PrefetchStats

if TYPE_CHECKING:
    from telerag.retrieval.prefetch import PrefetchHandle


class StoresRetriever:
    """The `Retriever` of one request over `views` (`VectorStores.views`); a passage scoring under
    `score_threshold` is left out of what a search returns; `ranking`, the tool's, ranks every
    search (None: each search's own options say)."""

    def __init__(
        self,
        views: Sequence[StoreView],
        searcher: StoresSearcher,
        score_threshold: float | None = None,
        ranking: Ranking | None = None,
    ) -> None:
        self.views, self.searcher, self.score_threshold, self.ranking = tuple(views), searcher, score_threshold, ranking
        self.resources = searcher.resources
        self.searched: list[str] = []  # every query the request's searches asked, in order
        self._prefetched: dict[int, dict[str, PrefetchHandle]] = {}  # id of a ticket -> each store's part of it

    async def prefetch(self, queries: Sequence[str], *, enabled: bool = True, overlap_ms: float | None = None) -> PrefetchTicket:
        """Copy each store's lists nearest `queries` (q_in) into the cluster cache, within the
        server's budget for `overlap_ms` split evenly among the stores."""
        ticket = PrefetchTicket(list(queries))
        stores = [view for view in self.views if view.snapshot is not None]
        budget = self.resources.budget_bytes(overlap_ms) // max(len(stores), 1) if enabled else 0
        if budget <= 0 or not queries or not stores:
            return ticket
        handles, embed_ms = await asyncio.to_thread(self._prefetch, list(queries), stores, budget)
        self._prefetched[id(ticket)] = handles
        plans = [handle.stats for handle in handles.values()]
        ticket.stats = PrefetchStepStats(enabled=True, embed_ms=embed_ms, batch=1, plan=PrefetchStats.combined(plans))
        return ticket

    async def search(
        self,
        queries: Sequence[SearchQuery],
        options: SearchOptions,
        ticket: PrefetchTicket | None = None,
    ) -> SearchOutcome:
        """Each query's top `options.top_k` over the stores, batched with other requests' searches
        (an observer hears nothing: no provisional top-k is reported)."""
        self.searched += [str(query) for query in queries]
        prefetched = self._prefetched.pop(id(ticket), {}) if ticket is not None else {}
        try:
            ranking = self.ranking or options.ranking
            return await self.searcher.search(
                StoresSearch(self.views, list(queries), options.top_k, ranking, self.score_threshold, prefetched)
            )
        finally:
            _release(prefetched)

    def release(self, ticket: PrefetchTicket) -> None:
        _release(self._prefetched.pop(id(ticket), {}))

    def snapshot(self) -> Snapshot | None:
        return None  # each store's own is in its view, taken when the request began

    async def embed(self, texts: Sequence[str]) -> TextEmbeddings:
        def work() -> TextEmbeddings:
            with self.resources.priority.query(), self.resources.on_stream():
                vectors = embedded(self.resources.embedder, texts)
            return TextEmbeddings(vectors, self.resources.embedder.count_tokens(texts))

        return await asyncio.to_thread(work)

    def attributes(self, document: RetrievedPassage) -> Attributes:
        """The attributes of a found passage's file, as they were when the request began."""
        view = next(v for v in self.views if v.store_id == document.source)
        return view.files[document.doc_id].attributes

    # -- in a worker thread -----------------------------------------------------------------------

    def _prefetch(self, queries: list[str], stores: list[StoreView], budget: int) -> tuple[dict[str, PrefetchHandle], float]:
        started = time.perf_counter()
        with self.resources.priority.query(), self.resources.on_stream():
            vectors = embedded(self.resources.embedder, queries)
        embed_ms = (time.perf_counter() - started) * 1e3
        handles = {view.store_id: handle for view in stores if (handle := view.prefetch(vectors, budget)) is not None}
        return handles, embed_ms


def _release(handles: Mapping[str, PrefetchHandle]) -> None:
    for handle in handles.values():
        handle.release()
