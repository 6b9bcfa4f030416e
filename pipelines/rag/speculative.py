"""Speculative prefill as a retrieval strategy (`pipelines.speculation`): a step whose documents
go to a known prompt searches with a provisional top-k, and prefills that prompt from the first
stable one while the search goes on. Its search is traced once the run is done, when what became
of the prefill is known."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from telerag.engines.types import Generation, Prefiller
from telerag.pipelines.pipelining import StaleQuery
from telerag.pipelines.rag.retrieval_step import (
    NextPrompt,
    PrefetchTask,
    RetrievalStep,
    SearchCall,
    SearchTrace,
    SequentialStep,
    traced_search,
)
from telerag.pipelines.speculation import HeardOnLoop, Speculation
from telerag.pipelines.stats import SearchStats
from telerag.pipelines.types import PrefetchTicket, RetrievedPassage, SearchQuery, Stage

if TYPE_CHECKING:
    from telerag.pipelines.rag.run_context import RunContext

T = TypeVar("T")


class SpeculativeStep:
    """A search whose provisional top-k prefills the prompt its documents go to."""

    def __init__(self, ctx: RunContext, search: SearchCall, speculation: Speculation) -> None:
        self.ctx, self.search, self.speculation = ctx, search, speculation
        self.searched: tuple[SearchStats, SearchTrace] | None = None

    def around_call(self, call: Callable[[], Awaitable[T]], prefetch: PrefetchTask) -> Callable[[], Awaitable[T]]:
        return call

    async def documents(self, queries: list[SearchQuery], ticket: PrefetchTicket) -> list[list[RetrievedPassage]]:
        observer = HeardOnLoop(self.speculation, asyncio.get_running_loop())
        options = dataclasses.replace(self.ctx.search_options(self.ctx.fixed_nprobe), observer=observer)
        outcome, trace = await traced_search(self.ctx, self.search, queries, ticket, options)
        self.speculation.settle(outcome.documents)
        self.searched = outcome.stats, trace
        return outcome.documents

    async def abandon(self) -> None:
        pass

    def trace(self) -> None:
        """The search's step, with what became of its speculation (once that is known)."""
        if self.searched is not None:
            stats, trace = self.searched
            self.ctx.steps.append(trace.step(dataclasses.replace(stats, speculative=self.speculation.report)))


class Speculative:
    """Steps with a known next prompt speculate (`SpeculativeStep`); the others search as the
    default does. Every LLM call of the run is shown to the speculations, to find the call each
    was for."""

    def __init__(self, search: SearchCall, engine: Prefiller) -> None:
        self.search, self.engine = search, engine
        self.steps: list[SpeculativeStep] = []

    def step(self, ctx: RunContext, stale: StaleQuery | None, next_prompt: NextPrompt | None) -> RetrievalStep:
        if next_prompt is None:
            return SequentialStep(ctx, self.search)

        def formatted(documents: list[list[RetrievedPassage]]) -> str:
            prompt = next_prompt(documents)
            return self.engine.format_prompt(prompt.user, system=prompt.system)

        step = SpeculativeStep(ctx, self.search, Speculation(self.engine, formatted))
        self.steps.append(step)
        return step

    def observe_call(self, stage: Stage, prompt: str, generation: Generation) -> None:
        for step in self.steps:
            step.speculation.observe_call(prompt, generation)

    async def finished(self) -> None:
        await asyncio.gather(*(step.speculation.finished() for step in self.steps))
        for step in self.steps:
            step.trace()

    def cancel(self) -> None:
        for step in self.steps:
            step.speculation.cancel()
