"""A lookahead's pipelined retrieval (`pipelines.pipelining`): the search of the step's stale
query, launched while the step's pre-retrieval call generates, and its use once the call ends."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from telerag.pipelines.pipelining import Launch, PartialGeneration, StaleQuery, cosines, launch_point, same_documents
from telerag.pipelines.stats import PipelinedSearch, SearchStats
from telerag.pipelines.types import (
    Document,
    PrefetchTicket,
    SearchOutcome,
    SearchQuery,
    Step,
    query_texts,
    query_vectors,
)

if TYPE_CHECKING:
    from telerag.pipelines.rag.base import RagPipeline, RunContext

T = TypeVar("T")

log = logging.getLogger(__name__)


class PipelinedStep:
    """One lookahead's pipelined retrieval: watches its pre-retrieval call's generation and, at
    the launch point (`pipelining.launch_point`), starts searching the stale query, once the
    step's prefetch has landed; `use` decides, when the call has ended, whose documents the step
    gets."""

    def __init__(
        self,
        pipeline: RagPipeline,
        ctx: RunContext,
        stale: StaleQuery,
        prefetch: asyncio.Future[tuple[PrefetchTicket, float, float]],
    ) -> None:
        self.pipeline, self.ctx, self.stale, self.prefetch = pipeline, ctx, stale, prefetch
        self.launch: Launch | None = None
        self.search: asyncio.Future[tuple[SearchOutcome, Step, float | None]] | None = None
        self.ended = 0.0  # when the call ended (the pipeline's clock)

    def watching(self, call: Callable[[], Awaitable[T]]) -> Callable[[], Awaitable[T]]:
        """`call` with the generations of its LLM calls shown to `watch` (`RunContext.watch`)."""

        async def watched() -> T:
            self.ctx.watch = self.watch
            try:
                return await call()
            finally:
                self.ctx.watch = None
                self.ended = self.pipeline.clock()

        return watched

    def watch(self, partial: PartialGeneration) -> None:
        if self.search is None:
            self.launch = launch_point(partial, self.stale, self.pipeline.pipelining.launch_share, self.pipeline.clock())
            if self.launch is not None:
                self.search = asyncio.ensure_future(self._search(self.launch))

    async def _search(self, launch: Launch) -> tuple[SearchOutcome, Step, float | None]:
        ticket = (await asyncio.shield(self.prefetch))[0]
        budget_ms, nprobe = self.budgeted_nprobe(launch.left_ms)
        outcome, step = await self.pipeline.search_traced(self.ctx, launch.queries, ticket, nprobe)
        return outcome, step, budget_ms

    def budgeted_nprobe(self, left_ms: float | None) -> tuple[float | None, int | None]:
        """The stale search's budget and nprobe: with nprobe "auto", the largest nprobe
        predicted to finish within the generation left (`left_ms`), and that budget; else the
        request's nprobe and no budget."""
        fixed = self.pipeline.fixed_nprobe(self.ctx)
        if self.ctx.options.nprobe != "auto" or left_ms is None:
            return None, fixed
        nprobe = self.pipeline.search_budget.choose(left_ms)
        return (None, fixed) if nprobe is None else (left_ms, nprobe)

    async def use(self, queries: list[SearchQuery], ticket: PrefetchTicket) -> list[list[Document]]:
        """The step's documents, given its final query: the stale search's when the two are
        alike enough (cosine of their embeddings at least `pipelining.min_cosine`; then, with
        `pipelining.check`, the final query is searched beside the rest of the run to see whether
        they differ), else the final query's own, searched now. The stale search's step says
        which (`PipelinedSearch`)."""
        assert self.search is not None and self.launch is not None
        stale, step, budget_ms = await self.search
        launch, config = self.launch, self.pipeline.pipelining
        texts = [text for query in (*launch.queries, *queries) for text in query_texts(query)]
        vectors = (await self.pipeline.retriever.embed(texts)).vectors
        split = sum(len(query_texts(query)) for query in launch.queries)
        cosine = cosines(query_vectors(launch.queries, vectors[:split]), query_vectors(queries, vectors[split:]))
        again = cosine < config.min_cosine
        documents, same = stale.documents, None
        if again:
            fresh, _ = await self.pipeline.search_traced(self.ctx, queries, ticket, self.pipeline.fixed_nprobe(self.ctx))
            documents = fresh.documents
            same = same_documents(stale.documents, documents)
        report = PipelinedSearch(launch.tokens, (self.ended - launch.at) * 1e3, budget_ms, cosine, again, same)
        step.stats = dataclasses.replace(search_stats(step), pipelined=report)
        if not again and config.check:
            self.ctx.checks.append(asyncio.ensure_future(self._check(queries, stale, step)))
        return documents

    async def _check(self, queries: list[SearchQuery], stale: SearchOutcome, step: Step) -> None:
        """Search the final query of a step that used its stale documents (untraced: nothing
        waits for it but the result) and record whether they differ; a failed check is logged
        and leaves it unknown."""
        options = self.ctx.search_options(self.pipeline.fixed_nprobe(self.ctx))
        try:
            fresh = await self.pipeline.search_timed(queries, options, None)
        except Exception:  # the answer stands; only the report lacks this check
            log.warning("a pipelined search's check failed", exc_info=True)
            return
        stats = search_stats(step)
        assert stats.pipelined is not None
        same = same_documents(stale.documents, fresh.documents)
        step.stats = dataclasses.replace(stats, pipelined=dataclasses.replace(stats.pipelined, same_documents=same))

    async def abandon(self) -> None:
        """End a stale search nothing will use (the step failed or needed no search); after
        `use`, or without a launch, nothing."""
        if self.search is not None:
            self.search.cancel()
            await asyncio.gather(self.search, return_exceptions=True)


def search_stats(step: Step) -> SearchStats:
    assert isinstance(step.stats, SearchStats), step.stats
    return step.stats
