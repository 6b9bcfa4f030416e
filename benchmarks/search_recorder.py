"""A pipeline's searches recorded and replayed exactly (`bench quality`, `bench pipelining`): every
search a question makes is kept, and once it is answered the searches its final documents came
from run again with every list probed, so that its documents can be compared with exact search's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from telerag.pipelines.rag.base import merge_documents
from telerag.pipelines.types import (
    PrefetchTicket,
    RetrievedPassage,
    Retriever,
    SearchOptions,
    SearchOutcome,
    SearchQuery,
    TextEmbeddings,
)

if TYPE_CHECKING:
    from telerag.retrieval.snapshot import Snapshot


@dataclass(frozen=True)
class RecordedSearch:
    queries: list[SearchQuery]
    options: SearchOptions
    outcome: SearchOutcome


class SearchRecorder:
    """Passes every call to `inner` and keeps each search the current question made, so that
    the ones its answer drew on can be replayed with exact search afterwards."""

    def __init__(self, inner: Retriever) -> None:
        self.inner = inner
        self._question: ContextVar[list[RecordedSearch]] = ContextVar("recorded_searches")
        self._outside: list[RecordedSearch] = []  # searches made outside any `question()`

    @property
    def searches(self) -> list[RecordedSearch]:
        """The current question's searches so far."""
        return self._question.get(self._outside)

    @contextlib.contextmanager
    def question(self) -> Iterator[None]:
        """Searches made inside (and in the tasks started inside) belong to one question, so
        questions run at the same time keep theirs apart."""
        token = self._question.set([])
        try:
            yield
        finally:
            self._question.reset(token)

    async def prefetch(self, queries: Sequence[str], *, enabled: bool = True, overlap_ms: float | None = None) -> PrefetchTicket:
        return await self.inner.prefetch(queries, enabled=enabled, overlap_ms=overlap_ms)

    async def search(
        self,
        queries: Sequence[SearchQuery],
        options: SearchOptions,
        ticket: PrefetchTicket | None = None,
    ) -> SearchOutcome:
        outcome = await self.inner.search(queries, options, ticket)
        self.searches.append(RecordedSearch(list(queries), options, outcome))
        return outcome

    def release(self, ticket: PrefetchTicket) -> None:
        self.inner.release(ticket)

    def snapshot(self) -> Snapshot | None:
        return self.inner.snapshot()

    async def embed(self, texts: Sequence[str]) -> TextEmbeddings:
        return await self.inner.embed(texts)

    async def exact_documents(self, documents: Sequence[RetrievedPassage], nlist: int, k: int) -> list[RetrievedPassage]:
        """`documents` (a run's final ones) as exact search would have given them: the searches
        they came from run again with every list probed, merged best score first. Forgets the
        recorded searches."""
        searches = list(self.searches)
        self.searches.clear()
        sources: dict[int, RecordedSearch] = {}
        for document in documents:
            source = _source(searches, document)
            if source is not None:
                sources[id(source)] = source
        groups: list[list[RetrievedPassage]] = []
        for search in sources.values():
            exact = replace(search.options, top_k=k, nprobe=nlist, prefetch=False)
            groups.extend((await self.inner.search(search.queries, exact)).documents)
        return merge_documents(groups, k)


def _source(searches: Sequence[RecordedSearch], document: RetrievedPassage) -> RecordedSearch | None:
    """The search that returned `document`: the one holding this very object (pipelines pass
    documents on unchanged), else the latest that returned its passage."""
    for match in (lambda d: d is document, lambda d: d.id == document.id):
        for search in reversed(searches):
            if any(match(d) for group in search.outcome.documents for d in group):
                return search
    return None
