"""The batching retriever: who shares a call, who waits, and that nothing leaks when callers leave."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from telerag.pipelines.types import PrefetchRequest, PrefetchTicket, SearchOptions, SearchOutcome, SearchRequest
from telerag.server.scheduling.retrieval_batching import BatchingRetriever
from tests.fakes import RecordingRetriever


class GatedRetriever(RecordingRetriever):
    """Each batched call blocks until the test opens the gate; records the callers per call."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.calls: list[list[str]] = []  # the first query of each caller, per call
        self.entered = asyncio.Event()

    async def search_batch(self, requests: Sequence[SearchRequest]) -> list[SearchOutcome]:
        self.calls.append([r.queries[0] for r in requests])
        self.entered.set()
        await self.gate.wait()
        return await super().search_batch(requests)

    async def prefetch_batch(self, requests: Sequence[PrefetchRequest]) -> list[PrefetchTicket]:
        self.calls.append([r.queries[0] for r in requests])
        self.entered.set()
        await self.gate.wait()
        return await super().prefetch_batch(requests)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def search(batching: BatchingRetriever, query: str, n: int = 1) -> asyncio.Task:
    return asyncio.create_task(batching.search([query] * n, SearchOptions(top_k=2)))


async def test_a_lone_call_runs_at_once_and_arrivals_during_it_form_the_next_batch():
    inner = GatedRetriever()
    batching = BatchingRetriever(inner, window_ms=0, max_batch=32)
    first = search(batching, "a")
    await inner.entered.wait()  # dispatched with no window, alone
    assert inner.calls == [["a"]]
    rest = [search(batching, q) for q in "bcde"]
    await settle()
    assert inner.calls == [["a"]]  # one call at a time: the others wait for it
    inner.gate.set()
    outcomes = await asyncio.gather(first, *rest)
    assert inner.calls == [["a"], ["b", "c", "d", "e"]]
    assert [o.documents[0][0].text for o in outcomes] == [f"about {q}" for q in "abcde"]  # each caller its own answer


async def test_batches_never_exceed_max_batch_queries():
    inner = GatedRetriever()
    batching = BatchingRetriever(inner, window_ms=0, max_batch=4)
    first = search(batching, "a")
    await inner.entered.wait()
    rest = [search(batching, "b", 3), search(batching, "c", 2), search(batching, "d", 1), search(batching, "e", 5)]
    await settle()
    inner.gate.set()
    await asyncio.gather(first, *rest)
    # b (3) fits, c (2) would make 5; c + d = 3; e alone exceeds the limit but still runs
    assert inner.calls == [["a"], ["b"], ["c", "d"], ["e"]]


async def test_a_window_gathers_callers_that_arrive_while_idle():
    inner = GatedRetriever()
    inner.gate.set()
    batching = BatchingRetriever(inner, window_ms=10_000, max_batch=3)
    # the window is long, but a full batch goes at once
    outcomes = await asyncio.wait_for(asyncio.gather(*[search(batching, q) for q in "abc"]), timeout=5)
    assert inner.calls == [["a", "b", "c"]] and len(outcomes) == 3


async def test_a_failed_call_fails_each_of_its_callers_and_the_next_batch_still_runs():
    inner = GatedRetriever()
    batching = BatchingRetriever(inner, window_ms=0, max_batch=8)
    first = search(batching, "boom")
    await inner.entered.wait()
    waiting = [search(batching, q) for q in "xy"]
    await settle()

    original = inner.search

    async def failing(queries, options, ticket=None):
        if queries[0] == "boom":
            raise RuntimeError("device lost")
        return await original(queries, options, ticket)

    inner.search = failing
    inner.gate.set()
    with pytest.raises(RuntimeError, match="device lost"):
        await first
    assert all(o.documents for o in await asyncio.gather(*waiting))


async def test_a_caller_that_leaves_before_its_turn_costs_nothing_and_one_that_leaves_during_it_leaks_nothing():
    inner = GatedRetriever()
    batching = BatchingRetriever(inner, window_ms=0, max_batch=8)
    first = asyncio.create_task(batching.prefetch(["a"]))
    await inner.entered.wait()
    gone = asyncio.create_task(batching.prefetch(["gone"]))
    staying = asyncio.create_task(batching.prefetch(["staying"]))
    await settle()
    gone.cancel()  # leaves while waiting for the next batch: never dispatched
    await settle()
    first.cancel()  # leaves while its batch runs: its clusters are released at once
    inner.gate.set()
    ticket: PrefetchTicket = await staying
    assert inner.calls == [["a"], ["staying"]]
    assert [t.queries for t in inner.released] == [["a"]]
    assert inner.outstanding == {id(ticket)}
    for task in (first, gone):
        with pytest.raises(asyncio.CancelledError):
            await task
