"""Cross-request batching of retrieval (admission is `server/admission/deadline.py`).

`BatchingRetriever` is what the pipelines see as their retriever: prefetch and search calls
that arrive while the previous batch runs (or within an optional window, or until a batch fills) become one call of the
underlying `BatchRetriever`, so their embedding, prefetch planning and search run as one
batch; each caller gets its own result and waits only on its own copies.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from telerag.pipelines.types import (
    BatchRetriever,
    OnProvisional,
    PrefetchRequest,
    PrefetchTicket,
    SearchOptions,
    SearchOutcome,
    SearchQuery,
    SearchRequest,
    TextEmbeddings,
)

if TYPE_CHECKING:
    from telerag.retrieval.snapshot import Snapshot

Item = TypeVar("Item")
Out = TypeVar("Out")


@dataclass
class _Pending(Generic[Item, Out]):
    item: Item
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class _Batcher(Generic[Item, Out]):
    """Runs `run` over batches of items, one call at a time (work-conserving).

    An item that finds the batcher idle waits at most `window_s` for company (not at all with a
    window of 0, so a lone request pays no batching latency); items that arrive while a call
    runs form the next call as soon as it ends, up to `max_batch` queries per call. Under load
    batches grow by themselves; when idle nothing waits.
    """

    def __init__(
        self,
        run: Callable[[list[Item]], Any],
        size: Callable[[Item], int],
        window_s: float,
        max_batch: int,
        on_batch: Callable[[int], None],
        abandon: Callable[[Out], None] = lambda result: None,
    ) -> None:
        self._run, self._size, self.window_s, self.max_batch = run, size, window_s, max_batch
        self._on_batch, self._abandon = on_batch, abandon
        self._pending: list[_Pending[Item, Out]] = []
        self._full = asyncio.Event()
        self._worker: asyncio.Task | None = None

    async def submit(self, item: Item) -> Out:
        pending: _Pending[Item, Out] = _Pending(item)
        self._pending.append(pending)
        if sum(self._size(p.item) for p in self._pending) >= self.max_batch:
            self._full.set()
        if self._worker is None:
            self._worker = asyncio.create_task(self._work())
        return await pending.future

    async def _work(self) -> None:
        try:
            if self.window_s > 0 and not self._full.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), self.window_s)
            while batch := self._take():
                await self._dispatch(batch)
        finally:
            self._worker = None

    def _take(self) -> list[_Pending[Item, Out]]:
        """The next batch: waiting items in arrival order up to `max_batch` queries (at least one);
        callers that went away before their turn are dropped, so they cost nothing."""
        self._pending = [p for p in self._pending if not p.future.done()]
        batch: list[_Pending[Item, Out]] = []
        total = 0
        while self._pending and (not batch or total + self._size(self._pending[0].item) <= self.max_batch):
            total += self._size(self._pending[0].item)
            batch.append(self._pending.pop(0))
        if sum(self._size(p.item) for p in self._pending) < self.max_batch:
            self._full.clear()
        return batch

    async def _dispatch(self, batch: list[_Pending[Item, Out]]) -> None:
        try:
            self._on_batch(sum(self._size(p.item) for p in batch))
            results = await self._run([p.item for p in batch])
        except Exception as exc:  # noqa: BLE001 - every caller of the batch sees the failure
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(exc)
            return
        for p, result in zip(batch, results, strict=True):
            if not p.future.done():
                p.future.set_result(result)
            else:  # the caller went away while its batch ran: nothing of its result may leak
                self._abandon(result)


class BatchingRetriever:
    """The pipelines' Retriever, batching concurrent callers into one BatchRetriever call."""

    def __init__(
        self, inner: BatchRetriever, *, window_ms: float, max_batch: int, on_batch: Callable[[str, int], None] | None = None
    ) -> None:
        self.inner = inner
        report = on_batch or (lambda kind, size: None)
        window = window_ms / 1e3
        self._prefetch: _Batcher[PrefetchRequest, PrefetchTicket] = _Batcher(
            self.inner.prefetch_batch,
            lambda item: len(item.queries),
            window,
            max_batch,
            lambda n: report("prefetch", n),
            abandon=self.inner.release,  # a cancelled caller's clusters are unpinned at once
        )
        self._search: _Batcher[SearchRequest, SearchOutcome] = _Batcher(
            self.inner.search_batch, lambda item: len(item.queries), window, max_batch, lambda n: report("search", n)
        )

    async def prefetch(self, queries: Sequence[str], *, enabled: bool = True, overlap_ms: float | None = None) -> PrefetchTicket:
        return await self._prefetch.submit(PrefetchRequest(list(queries), enabled, overlap_ms))

    async def search(
        self,
        queries: Sequence[SearchQuery],
        options: SearchOptions,
        ticket: PrefetchTicket | None = None,
        *,
        provisional: OnProvisional | None = None,
    ) -> SearchOutcome:
        return await self._search.submit(SearchRequest(list(queries), options, ticket, provisional))

    def release(self, ticket: PrefetchTicket) -> None:
        self.inner.release(ticket)

    def snapshot(self) -> Snapshot | None:
        return self.inner.snapshot()

    async def embed(self, texts: Sequence[str]) -> TextEmbeddings:
        """Not batched: a pipelined retrieval's comparison of two queries, a client's texts."""
        return await self.inner.embed(texts)
