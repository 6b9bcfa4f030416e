"""Pipelined retrieval as a retrieval strategy (`pipelines.pipelining`, PipeRAG): a step with a
stale query searches it while the step's pre-retrieval call generates, launched at the launch
point, and decides once the call ends whose documents the step gets. A step that never reaches
the launch point (or has no call, or no stale query) retrieves as the strategy it stands on."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from telerag.engines.types import Engine, Generation, SamplingParams
from telerag.pipelines.pipelining import (
    CallWatch,
    ExpectedTokens,
    Launch,
    PartialGeneration,
    PipeliningConfig,
    StaleQuery,
    cosines,
    launch_point,
    same_documents,
)
from telerag.pipelines.rag.retrieval_step import (
    NextPrompt,
    PrefetchTask,
    RetrievalStep,
    RetrievalStrategy,
    SearchCall,
    SearchTrace,
    traced_search,
)
from telerag.pipelines.search_budget import SearchBudget
from telerag.pipelines.stats import PipelinedSearch
from telerag.pipelines.types import (
    PrefetchTicket,
    RetrievedPassage,
    SearchOptions,
    SearchOutcome,
    SearchQuery,
    Stage,
    TextEmbeddings,
    query_texts,
    query_vectors,
)

if TYPE_CHECKING:
    from telerag.pipelines.rag.run_context import RunContext

T = TypeVar("T")

log = logging.getLogger(__name__)

StaleSearch = tuple[SearchOutcome, SearchTrace, float | None]  # the stale query's outcome, its trace, its budget (ms)


@dataclass(frozen=True)
class PipelinedTools:
    """What a request's pipelined steps share: the engine they watch, the embedder that compares
    stale and final queries, the settings, the search-time model and the expected tokens."""

    engine: Engine
    embed: Callable[[Sequence[str]], Awaitable[TextEmbeddings]]
    config: PipeliningConfig
    budget: SearchBudget
    expected: ExpectedTokens


def budget_observed(search: SearchCall, budget: SearchBudget, clock: Callable[[], float] = time.perf_counter) -> SearchCall:
    """`search` with each search's time, nprobe and the searches in flight beside it taught to
    `budget` (nprobe "auto" reads it)."""

    async def observed(queries: Sequence[SearchQuery], options: SearchOptions, ticket: PrefetchTicket | None) -> SearchOutcome:
        with budget.searching() as depth:
            started = clock()
            outcome = await search(queries, options, ticket)
            budget.observe(outcome.stats.nprobe, depth, (clock() - started) * 1e3)
        return outcome

    return observed


class PipelinedStep:
    """One lookahead's pipelined retrieval: watches its pre-retrieval call's generation and, at
    the launch point (`pipelining.launch_point`), starts searching the stale query, once the
    step's prefetch has landed; `documents` decides, when the call has ended, whose documents
    the step gets. Its search is traced when its report is final (after its check, if any)."""

    def __init__(
        self, ctx: RunContext, search: SearchCall, tools: PipelinedTools, stale: StaleQuery, fallback: RetrievalStep
    ) -> None:
        self.ctx, self.search, self.tools, self.stale, self.fallback = ctx, search, tools, stale, fallback
        self.prefetch: PrefetchTask | None = None
        self.launch: Launch | None = None
        self.stale_search: asyncio.Future[StaleSearch] | None = None
        self.used = False  # the stale search was given to `documents`
        self.check: asyncio.Future[None] | None = None
        self.ended = 0.0  # when the call ended (the run's clock)

    def around_call(self, call: Callable[[], Awaitable[T]], prefetch: PrefetchTask) -> Callable[[], Awaitable[T]]:
        """`call` with the generations of its LLM calls watched (`RunContext.generate`)."""
        self.prefetch = prefetch

        async def watched() -> T:
            plain, self.ctx.generate = self.ctx.generate, self._generate
            try:
                return await call()
            finally:
                self.ctx.generate = plain
                self.ended = self.ctx.clock()

        return watched

    def _generate(self, stage: Stage, prompts: list[str], params: SamplingParams) -> Awaitable[list[Generation]]:
        """The engine's generations, streamed so that each partial is shown to `_watch`."""
        expected = self.tools.expected.of(stage.name, params.max_tokens)
        return self.tools.engine.generate(prompts, params, CallWatch(expected, self._watch, self.ctx.clock))

    def _watch(self, partial: PartialGeneration) -> None:
        if self.stale_search is None:
            self.launch = launch_point(partial, self.stale, self.tools.config.launch_share, self.ctx.clock())
            if self.launch is not None:
                self.stale_search = asyncio.ensure_future(self._search(self.launch))

    async def _search(self, launch: Launch) -> StaleSearch:
        assert self.prefetch is not None
        ticket = (await asyncio.shield(self.prefetch))[0]
        budget_ms, nprobe = self.budgeted_nprobe(launch.left_ms)
        outcome, trace = await traced_search(self.ctx, self.search, launch.queries, ticket, self.ctx.search_options(nprobe))
        return outcome, trace, budget_ms

    def budgeted_nprobe(self, left_ms: float | None) -> tuple[float | None, int | None]:
        """The stale search's budget and nprobe: with nprobe "auto", the largest nprobe
        predicted to finish within the generation left (`left_ms`), and that budget; else the
        request's nprobe and no budget."""
        fixed = self.ctx.fixed_nprobe
        if self.ctx.options.nprobe != "auto" or left_ms is None:
            return None, fixed
        nprobe = self.tools.budget.choose(left_ms)
        return (None, fixed) if nprobe is None else (left_ms, nprobe)

    async def documents(self, queries: list[SearchQuery], ticket: PrefetchTicket) -> list[list[RetrievedPassage]]:
        """The step's documents, given its final query: the stale search's when the two are
        alike enough (cosine of their embeddings at least `pipelining.min_cosine`; then, with
        `pipelining.check`, the final query is searched beside the rest of the run to see whether
        they differ), else the final query's own, searched now. The stale search's step says
        which (`PipelinedSearch`). Without a launch, the step it stands on retrieves."""
        if self.stale_search is None:
            return await self.fallback.documents(queries, ticket)
        assert self.launch is not None
        self.used = True
        stale, trace, budget_ms = await self.stale_search
        launch, config = self.launch, self.tools.config
        texts = [text for query in (*launch.queries, *queries) for text in query_texts(query)]
        vectors = (await self.tools.embed(texts)).vectors
        split = sum(len(query_texts(query)) for query in launch.queries)
        cosine = cosines(query_vectors(launch.queries, vectors[:split]), query_vectors(queries, vectors[split:]))
        again = cosine < config.min_cosine
        documents, same = stale.documents, None
        if again:
            options = self.ctx.search_options(self.ctx.fixed_nprobe)
            fresh, fresh_trace = await traced_search(self.ctx, self.search, queries, ticket, options)
            self.ctx.steps.append(fresh_trace.step(fresh.stats))
            documents = fresh.documents
            same = same_documents(stale.documents, documents)
        report = PipelinedSearch(launch.tokens, (self.ended - launch.at) * 1e3, budget_ms, cosine, again, same)
        if not again and config.check:
            self.check = asyncio.ensure_future(self._check(queries, stale, trace, report))
        else:
            self.ctx.steps.append(trace.step(dataclasses.replace(stale.stats, pipelined=report)))
        return documents

    async def _check(self, queries: list[SearchQuery], stale: SearchOutcome, trace: SearchTrace, report: PipelinedSearch) -> None:
        """Search the final query of a step that used its stale documents (untraced: nothing
        waits for it but the result) and record whether they differ; a failed check is logged
        and leaves it unknown."""
        same = None
        try:
            fresh = await self.search(queries, self.ctx.search_options(self.ctx.fixed_nprobe), None)
            same = same_documents(stale.documents, fresh.documents)
        except Exception:  # the answer stands; only the report lacks this check
            log.warning("a pipelined search's check failed", exc_info=True)
        checked = dataclasses.replace(report, same_documents=same)
        self.ctx.steps.append(trace.step(dataclasses.replace(stale.stats, pipelined=checked)))

    async def abandon(self) -> None:
        """End a stale search nothing used (the step failed or needed no search); one that
        finished anyway is traced as the search it was."""
        if self.stale_search is not None and not self.used:
            self.used = True
            self.stale_search.cancel()
            done = (await asyncio.gather(self.stale_search, return_exceptions=True))[0]
            if isinstance(done, tuple):
                outcome, trace, _ = done
                self.ctx.steps.append(trace.step(outcome.stats))
        await self.fallback.abandon()


class Pipelined:
    """Steps with a stale query are pipelined (`PipelinedStep`) over the steps of `fallback`,
    which retrieves for them when they do not launch; every LLM call teaches the expected
    tokens the launch point is a share of."""

    def __init__(self, search: SearchCall, tools: PipelinedTools, fallback: RetrievalStrategy) -> None:
        self.search, self.tools, self.fallback = search, tools, fallback
        self.steps: list[PipelinedStep] = []

    def step(self, ctx: RunContext, stale: StaleQuery | None, next_prompt: NextPrompt | None) -> RetrievalStep:
        fallback = self.fallback.step(ctx, None, next_prompt)
        if stale is None:
            return fallback
        step = PipelinedStep(ctx, self.search, self.tools, stale, fallback)
        self.steps.append(step)
        return step

    def observe_call(self, stage: Stage, prompt: str, generation: Generation) -> None:
        self.tools.expected.observe(stage.name, generation.completion_tokens)
        self.fallback.observe_call(stage, prompt, generation)

    async def finished(self) -> None:
        await asyncio.gather(*(step.check for step in self.steps if step.check is not None))
        await self.fallback.finished()

    def cancel(self) -> None:
        for step in self.steps:
            if step.check is not None:
                step.check.cancel()
        self.fallback.cancel()
