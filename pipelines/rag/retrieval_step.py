"""How a lookahead retrieves once its pre-retrieval call has started: a strategy chosen once per
request (`RagPipeline.retrieval_strategy`), which gives each lookahead a step of its own.

The default is `Sequential`: the step's final query is searched after the call, traced as the
SEARCH stage. The experiments are other implementations of the same two interfaces, off unless a
request asks for them: pipelined retrieval (`rag.pipelined`: the search starts from the call's
text so far) and speculative prefill (`rag.speculative`: the next call's prompt is prefilled from
the search's provisional top-k, which an observer in its options hears). The lookahead itself has no branch for either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from telerag.engines.types import Generation
from telerag.pipelines.pipelining import StaleQuery
from telerag.pipelines.prompts import Prompt
from telerag.pipelines.stats import SearchStats
from telerag.pipelines.types import (
    PrefetchTicket,
    RetrievedPassage,
    SearchOptions,
    SearchOutcome,
    SearchQuery,
    Stage,
    StageRole,
    Step,
)

if TYPE_CHECKING:
    from telerag.pipelines.rag.run_context import RunContext

T = TypeVar("T")
SEARCH = Stage("search", StageRole.SEARCH)
NextPrompt = Callable[[list[list[RetrievedPassage]]], Prompt]  # the prompt of the LLM call a search's documents go to
SearchCall = Callable[[Sequence[SearchQuery], SearchOptions, PrefetchTicket | None], Awaitable[SearchOutcome]]
PrefetchTask = asyncio.Future[tuple[PrefetchTicket, float, float]]  # a traced prefetch (`RunContext.stage`)


class RetrievalStep(Protocol):
    """One lookahead's retrieval."""

    def around_call(self, call: Callable[[], Awaitable[T]], prefetch: PrefetchTask) -> Callable[[], Awaitable[T]]:
        """The step's pre-retrieval call as the step runs it, beside q_in's `prefetch`."""
        ...

    async def documents(self, queries: list[SearchQuery], ticket: PrefetchTicket) -> list[list[RetrievedPassage]]:
        """The documents of the step's final queries, with q_in's prefetch `ticket`."""
        ...

    async def abandon(self) -> None:
        """The step ends (its documents given, or it failed or needed no search): what it
        started and nothing will use is stopped. Harmless twice."""
        ...


class RetrievalStrategy(Protocol):
    """A request's way of retrieving, chosen once when its run begins."""

    def step(self, ctx: RunContext, stale: StaleQuery | None, next_prompt: NextPrompt | None) -> RetrievalStep:
        """A lookahead's step: `stale` makes its query from its call's text so far (for a
        pipelined step), `next_prompt` is the prompt its documents go to."""
        ...

    def observe_call(self, stage: Stage, prompt: str, generation: Generation) -> None:
        """An LLM call of the run ended of itself (`RunContext.called`)."""
        ...

    async def finished(self) -> None:
        """What the run's steps left running beside the answer, done (their steps traced)."""
        ...

    def cancel(self) -> None:
        """The run ended early: stop what its steps left running."""
        ...


@dataclass(frozen=True)
class SearchTrace:
    """A traced search's place in the run: traced as a step once its stats are final."""

    queries: str
    start_ms: float
    ms: float

    def step(self, stats: SearchStats) -> Step:
        return Step(SEARCH, self.queries, ms=self.ms, stats=stats, start_ms=self.start_ms)


async def traced_search(
    ctx: RunContext, search: SearchCall, queries: Sequence[SearchQuery], ticket: PrefetchTicket | None, options: SearchOptions
) -> tuple[SearchOutcome, SearchTrace]:
    """A search of the run, as its SEARCH stage (the caller adds its step: `SearchTrace.step`)."""
    outcome, start_ms, ms = await ctx.stage(SEARCH, lambda: search(queries, options, ticket))
    return outcome, SearchTrace(" | ".join(map(str, queries))[:200], start_ms, ms)


class SequentialStep:
    """The final query searched once the call has ended, at the request's nprobe."""

    def __init__(self, ctx: RunContext, search: SearchCall) -> None:
        self.ctx, self.search = ctx, search

    def around_call(self, call: Callable[[], Awaitable[T]], prefetch: PrefetchTask) -> Callable[[], Awaitable[T]]:
        return call

    async def documents(self, queries: list[SearchQuery], ticket: PrefetchTicket) -> list[list[RetrievedPassage]]:
        options = self.ctx.search_options(self.ctx.fixed_nprobe)
        outcome, trace = await traced_search(self.ctx, self.search, queries, ticket, options)
        self.ctx.steps.append(trace.step(outcome.stats))
        return outcome.documents

    async def abandon(self) -> None:
        pass


class Sequential:
    """The default: every step a `SequentialStep`; nothing left running, nothing observed."""

    def __init__(self, search: SearchCall) -> None:
        """`search`: the retriever's (`Retriever.search`), or it observed (`pipelined.budget_observed`)."""
        self.search = search

    def step(self, ctx: RunContext, stale: StaleQuery | None, next_prompt: NextPrompt | None) -> RetrievalStep:
        return SequentialStep(ctx, self.search)

    def observe_call(self, stage: Stage, prompt: str, generation: Generation) -> None:
        pass

    async def finished(self) -> None:
        pass

    def cancel(self) -> None:
        pass
