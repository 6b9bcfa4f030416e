"""One run's state, owned by the run from its start to its result: the request's question and
options, its trace (stage events, steps), the documents and tokens so far, the engine calls it
makes (`generate`, which a pipelined step watches while its call runs) and how it retrieves
(`retrieval`, chosen once when it begins)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from telerag.engines.types import Generation, SamplingParams, deadline_passed
from telerag.pipelines.errors import UndeclaredStage
from telerag.pipelines.types import (
    EventSink,
    PrefetchTicket,
    RetrievedPassage,
    RunOptions,
    SearchOptions,
    Stage,
    StageEvent,
    Step,
    UsageEvent,
)

if TYPE_CHECKING:
    from telerag.pipelines.rag.retrieval_step import RetrievalStrategy
    from telerag.retrieval.snapshot import Snapshot

T = TypeVar("T")
Traced = tuple[T, float, float]  # a traced stage's result, when it started (ms after the request) and how long it took (ms)
Generate = Callable[[Stage, list[str], SamplingParams], Awaitable[list[Generation]]]  # a run's LLM calls of one stage


@dataclass
class RunContext:
    query: str
    options: RunOptions
    pipeline: str  # its name, in errors
    stages: tuple[Stage, ...]  # those the pipeline declares: the only ones it may trace
    generate: Generate  # the engine's calls; a pipelined step's watched ones while its call runs
    retrieval: RetrievalStrategy  # how its lookaheads retrieve, chosen when it began
    clock: Callable[[], float]  # seconds, for every time the run traces
    started: float  # the clock's time when the run began
    emit: EventSink  # where its stage, token and usage events go as they happen
    steps: list[Step] = field(default_factory=list)
    documents: list[RetrievedPassage] = field(default_factory=list)
    tokens_generated: int = 0
    carried: PrefetchTicket | None = None  # the standalone question's prefetch, for the first lookahead to use
    draft: str = ""  # the latest quiet answer with any text: the answer, should the deadline come before the last
    snapshot: Snapshot | None = None  # the datastore every retrieval of the run reads, taken when it began

    def search_options(self, nprobe: int | None) -> SearchOptions:
        """A search of this run: the request's top_k, prefetch and ranking, over the run's snapshot."""
        options = self.options
        return SearchOptions(options.top_k, nprobe, options.prefetch, self.snapshot, options.ranking)

    @property
    def fixed_nprobe(self) -> int | None:
        """The nprobe of a search that overlaps no generation: the request's number, or the
        default (None) for "auto", which has nothing to fit inside."""
        return self.options.nprobe if isinstance(self.options.nprobe, int) else None

    @property
    def past_deadline(self) -> bool:
        """Whether the run's deadline (`RunOptions.deadline`) has come: its LLM calls generate nothing more."""
        return deadline_passed(self.options.deadline)

    def generated(self, tokens: int) -> None:
        """Account for `tokens` newly generated tokens (in the result, and at once as a UsageEvent)."""
        if tokens:
            self.tokens_generated += tokens
            self.emit(UsageEvent(tokens))

    def called(self, stage: Stage, prompt: str, generation: Generation) -> None:
        """An LLM call ended: shown to the retrieval strategy unless the deadline cut it (one
        cut short shows neither its length nor the engine's cache)."""
        if generation.finish_reason != "deadline":
            self.retrieval.observe_call(stage, prompt, generation)

    # -- the trace ------------------------------------------------------------------------------

    def begin(self, stage: Stage) -> float:
        """A declared stage begins: its start event is sent; the clock's time it began."""
        if stage not in self.stages:
            raise UndeclaredStage(
                f"pipeline {self.pipeline} traced stage {stage.name!r} ({stage.role.value}), which it does not declare"
            )
        self.emit(StageEvent(stage, "start"))
        return self.clock()

    def end(self, stage: Stage, started: float) -> tuple[float, float]:
        """A stage that began at `started` ends: its end event is sent; when it began (ms after
        the request did) and how long it took (ms)."""
        ms = (self.clock() - started) * 1e3
        self.emit(StageEvent(stage, "end", ms))
        return (started - self.started) * 1e3, ms

    def stage(self, stage: Stage, work: Callable[[], Awaitable[T]]) -> asyncio.Future[Traced[T]]:
        """Start `work()` as a traced stage: its start event and time are taken now, so stages
        started side by side are traced in the order they were started. The task gives the
        result, when the stage started (ms after the request did) and how long it took (ms)."""
        started = self.begin(stage)
        pending = work()

        async def traced() -> tuple[T, float, float]:
            result = await pending
            return (result, *self.end(stage, started))

        return asyncio.ensure_future(traced())
