"""Cross-request batching of retrieval (admission is `server/admission/deadline.py`).

`BatchingRetriever` is what the pipelines see as their retriever: prefetch and search calls
that arrive while the previous batch runs (or within an optional window, or until a batch fills) become one call of the
underlying `BatchRetriever` (`utils.batching.Batcher`), so their embedding, prefetch planning and search run as one
batch; each caller gets its own result and waits only on its own copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from telerag.pipelines.types import (
    BatchRetriever,
    PrefetchRequest,
    PrefetchTicket,
    SearchOptions,
    SearchOutcome,
    SearchQuery,
    SearchRequest,
    TextEmbeddings,
)
from telerag.utils.batching import Batcher

if TYPE_CHECKING:
    from telerag.retrieval.snapshot import Snapshot


class BatchingRetriever:
    """The pipelines' Retriever, batching concurrent callers into one BatchRetriever call."""

    def __init__(
        self, inner: BatchRetriever, *, window_ms: float, max_batch: int, on_batch: Callable[[str, int], None] | None = None
    ) -> None:
        self.inner = inner
        report = on_batch or (lambda kind, size: None)
        window = window_ms / 1e3
        self._prefetch: Batcher[PrefetchRequest, PrefetchTicket] = Batcher(
            self.inner.prefetch_batch,
            lambda item: len(item.queries),
            window,
            max_batch,
            lambda n: report("prefetch", n),
            abandon=self.inner.release,  # a cancelled caller's clusters are unpinned at once
        )
        self._search: Batcher[SearchRequest, SearchOutcome] = Batcher(
            self.inner.search_batch, lambda item: len(item.queries), window, max_batch, lambda n: report("search", n)
        )

    async def prefetch(self, queries: Sequence[str], *, enabled: bool = True, overlap_ms: float | None = None) -> PrefetchTicket:
        return await self._prefetch.submit(PrefetchRequest(list(queries), enabled, overlap_ms))

    async def search(
        self,
        queries: Sequence[SearchQuery],
        options: SearchOptions,
        ticket: PrefetchTicket | None = None,
    ) -> SearchOutcome:
        return await self._search.submit(SearchRequest(list(queries), options, ticket))

    def release(self, ticket: PrefetchTicket) -> None:
        self.inner.release(ticket)

    def snapshot(self) -> Snapshot | None:
        return self.inner.snapshot()

    async def embed(self, texts: Sequence[str]) -> TextEmbeddings:
        """Not batched: a pipelined retrieval's comparison of two queries, a client's texts."""
        return await self.inner.embed(texts)
