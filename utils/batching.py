"""Batching across requests on one event loop: items that arrive while a call runs become the
next call, so under load batches grow by themselves and a lone item waits for nothing. The
server's retrieval (`server.scheduling.retrieval_batching`) and the vector stores' searches
(`file_search.store_searcher`) batch their callers with it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")
Out = TypeVar("Out")


@dataclass
class _Pending(Generic[Item, Out]):
    item: Item
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Batcher(Generic[Item, Out]):
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
