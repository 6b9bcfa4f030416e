"""The contracts between retrieval and the pipelines, and what a pipeline run yields (the LLM's
contract, `Engine` and what it takes and gives, is the engines' own: `engines.types`).

Everything here is plain data or a Protocol, so the server, the CLI and the tests can drive a
pipeline without knowing which engine or retriever sits behind it. It is long because it is the
one place these contracts are written: every layer above imports them together.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np

from telerag.pipelines.stats import (
    GenerationStats,
    PipeliningSummary,
    PrefetchStepStats,
    PrefetchSummary,
    SearchStats,
    SpeculationSummary,
    StepStats,
    Timings,
)
from telerag.retrieval.prefetch import PrefetchHandle
from telerag.retrieval.ranking import DENSE, Ranking

if TYPE_CHECKING:
    from telerag.retrieval.snapshot import Snapshot

# ---------------------------------------------------------------------------------------------
# Retrieval, as the pipelines see it
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetrievedPassage:
    """A retrieved passage. `id` is the passage's id in its datastore; `doc_id` its document's
    (an article's corpus id, a vector store's file id); `source` the vector store it came from
    ("": the server's datastore)."""

    id: int
    doc_id: str
    title: str
    text: str
    score: float
    source: str = ""


@dataclass(frozen=True)
class MeanQuery:
    """A search query that is the mean of several texts' embeddings (HyDE: the question and its
    hypothetical passages). Inner product is linear, so a document's score is the mean of its
    scores against each text: no single text can pull the search away from the others."""

    texts: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.texts:
            raise ValueError("a MeanQuery needs at least one text")

    def __str__(self) -> str:
        return " + ".join(self.texts)


SearchQuery = str | MeanQuery  # a text, or the mean of several texts' embeddings


def query_texts(query: SearchQuery) -> tuple[str, ...]:
    """The texts a query's embedding is made of."""
    return query.texts if isinstance(query, MeanQuery) else (query,)


def query_vectors(queries: Sequence[SearchQuery], text_vectors: np.ndarray) -> np.ndarray:
    """One float32 row per query from the rows of its texts (`text_vectors`: every query's
    `query_texts`, in order): a MeanQuery's is the mean of its texts'."""
    counts = [len(query_texts(query)) for query in queries]
    if all(count == 1 for count in counts):
        return np.ascontiguousarray(text_vectors, dtype=np.float32)
    starts = np.cumsum([0, *counts])
    means = [text_vectors[start:end].mean(axis=0) for start, end in itertools.pairwise(starts)]
    return np.ascontiguousarray(np.stack(means), dtype=np.float32)


@dataclass(frozen=True)
class ProvisionalDocuments:
    """A search's documents before it ended: its top-k found stable but not proven
    (`pipelines.speculation`), after `lists_share` of its probed lists were scanned."""

    documents: list[list[RetrievedPassage]]
    lists_share: float


class SearchObserver(Protocol):
    """Who hears how a search goes before it returns (speculative prefill's `Speculation`). A
    search without one is watched by nobody and scans as it always does."""

    def provisional(self, found: ProvisionalDocuments) -> None:
        """The search's first top-k found stable, at most once, before the search returns, from the
        search's thread (an observer that acts on an event loop goes there itself:
        `speculation.HeardOnLoop`); the outcome is the same either way."""
        ...


@dataclass(frozen=True)
class SearchOptions:
    top_k: int = 3
    nprobe: int | None = None  # None: the datastore's configured default
    prefetch: bool = True  # False: every cluster is searched on the CPU (the baseline)
    snapshot: Snapshot | None = None  # the datastore as the search reads it (`Retriever.snapshot`); None: as of now
    ranking: Ranking = DENSE  # by meaning, by words or both (`retrieval.ranking`)
    observer: SearchObserver | None = None  # hears the search's provisional top-k


@dataclass
class PrefetchTicket:
    """What a prefetch started; hand it to `Retriever.search` and release it when done."""

    queries: list[str]
    stats: PrefetchStepStats = field(default_factory=PrefetchStepStats)
    handle: PrefetchHandle | None = None  # the retrieval engine's own (None: nothing was planned)


@dataclass
class SearchOutcome:
    """Documents per query and the search stats."""

    documents: list[list[RetrievedPassage]]
    stats: SearchStats = field(default_factory=SearchStats)


@runtime_checkable
class Retriever(Protocol):
    """Embeds text and searches the datastore; the server wraps one to batch across requests."""

    async def prefetch(self, queries: Sequence[str], *, enabled: bool = True, overlap_ms: float | None = None) -> PrefetchTicket:
        """Embed `queries` (q_in), plan and start copying their clusters; returns at once, copies run on.
        `overlap_ms`: how long the caller expects the work the copies hide behind (its
        pre-retrieval LLM call) to take; the budget is what can be copied in that time."""
        ...

    async def search(
        self,
        queries: Sequence[SearchQuery],
        options: SearchOptions,
        ticket: PrefetchTicket | None = None,
    ) -> SearchOutcome:
        """Embed `queries` (q_out) and run the cooperative search, waiting only on `ticket`'s
        copies; `options.observer` hears its provisional top-k."""
        ...

    def release(self, ticket: PrefetchTicket) -> None:
        """Unpin the ticket's clusters (idempotent)."""
        ...

    def snapshot(self) -> Snapshot | None:
        """The datastore as of now, every acknowledged write in it: a request takes one when it
        starts and every retrieval of the request reads it (None: a retriever over no live
        datastore, whose searches read what they read)."""
        ...

    async def embed(self, texts: Sequence[str]) -> TextEmbeddings:
        """`texts` embedded as the datastore's passages and queries are (a pipelined retrieval
        compares its stale query with the final one; clients search or cache beside the server)."""
        ...


@dataclass(frozen=True)
class PrefetchRequest:
    """One caller's prefetch inside a batch (see `Retriever.prefetch`)."""

    queries: list[str]
    enabled: bool = True
    overlap_ms: float | None = None


@dataclass(frozen=True)
class SearchRequest:
    """One caller's search inside a batch: its queries, options and (optional) prefetch ticket."""

    queries: list[SearchQuery]
    options: SearchOptions
    ticket: PrefetchTicket | None = None


@runtime_checkable
class BatchRetriever(Retriever, Protocol):
    """A Retriever that also takes many callers' work at once, so one embedding call, one
    prefetch plan (ranks interleaved across callers) and one cooperative search serve them all.
    The server's scheduler gathers concurrent requests and calls these."""

    async def prefetch_batch(self, requests: Sequence[PrefetchRequest]) -> list[PrefetchTicket]:
        """One ticket per request, each pinning only its own clusters."""
        ...

    async def search_batch(self, requests: Sequence[SearchRequest]) -> list[SearchOutcome]:
        """One outcome per request, in order; each waits only on its own ticket's copies."""
        ...


@dataclass(frozen=True)
class TextEmbeddings:
    """One unit-length float32 row per text, and the tokens the embedder read of them all."""

    vectors: np.ndarray
    tokens: int


@dataclass(frozen=True)
class DatastoreInfo:
    """What an operator needs to know of the served datastore and its retrieval engine (no host
    paths: this is shown to clients)."""

    passages: int
    documents: int
    passage_words: int | None  # words per passage when built (None: not recorded)
    nlist: int
    dim: int
    embedder: str
    codec: str
    nprobe: int  # the default
    device: str  # where the cluster cache and the device search run
    cache_bytes: int
    prefetch_budget_bytes: int | None  # None: B · each request's expected pre-retrieval time
    copy_gbps: float | None  # B, measured at start-up (None without a cache): read from disk, its read rate
    vectors: Literal["memory-mapped", "read from disk"] = "memory-mapped"  # disk: the cache is in host memory
    prefetch_reach: float | None = None  # x nprobe: how far down q_in's ranking a prefetch reads (None: its budget's)


# ---------------------------------------------------------------------------------------------
# A pipeline run
# ---------------------------------------------------------------------------------------------

StageKind = Literal["llm", "retrieval", "prefetch"]


class StageRole(StrEnum):
    """What a stage does in a run: where q_in, q_out and the answer are. The run's timings sum
    its steps by role, and a stage's kind (what sort of work it is) follows from its role."""

    PREFETCH = "prefetch"  # embed q_in, plan and copy its clusters
    PRE_RETRIEVAL = "pre_retrieval"  # the LLM call a prefetch runs beside; its output makes q_out
    SEARCH = "search"  # embed q_out, search the datastore
    LLM = "llm"  # another LLM call, whose output is not the answer: a draft for a judge, a judgement, a critique
    GENERATE = "generate"  # an LLM call that writes answer text

    @property
    def kind(self) -> StageKind:
        if self is StageRole.PREFETCH:
            return "prefetch"
        return "retrieval" if self is StageRole.SEARCH else "llm"


@dataclass(frozen=True)
class Stage:
    """A stage a pipeline declares (its `stages`) and traces under that name."""

    name: str
    role: StageRole


@dataclass
class Step:
    """One traced step of a run."""

    stage: Stage
    query: str | None = None
    tokens_in: int = 0
    tokens_out: int = 0
    ms: float = 0.0
    stats: StepStats | None = None  # an LLM call's, a prefetch's or a search's
    start_ms: float = 0.0  # when it began, ms after the request did: a prefetch overlaps the pre-retrieval call
    tokens_cached: int = 0  # an LLM call's: of tokens_in, those the engine's prefix cache held (0 when not reported)

    @property
    def kind(self) -> StageKind:
        return self.stage.role.kind

    @property
    def cut(self) -> bool:
        """An LLM call that ended at its token limit, not of itself."""
        return isinstance(self.stats, GenerationStats) and self.stats.finish_reason == "length"

    @property
    def stopped_at_deadline(self) -> bool:
        """An LLM call that the run's deadline stopped (or that began after it and generated nothing)."""
        return isinstance(self.stats, GenerationStats) and self.stats.finish_reason == "deadline"


def overlap_rates(steps: Sequence[Step]) -> list[float]:
    """|C_in ∩ C_out| / |C_out| of each search that had a prefetch."""
    return [s.stats.overlap_rate for s in steps if isinstance(s.stats, SearchStats) and s.stats.overlap_rate is not None]


@dataclass(frozen=True)
class Turn:
    """An earlier turn of a conversation: what the user asked or the assistant answered."""

    role: Literal["user", "assistant"]
    text: str


@dataclass(frozen=True)
class RunOptions:
    """Per-request knobs a pipeline honours; validated where they are made, never changed after."""

    top_k: int = 3
    nprobe: int | Literal["auto"] | None = None  # auto: a pipelined search's fits in the generation it overlaps
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0  # with temperature, every LLM call of the request samples so
    stop: tuple[str, ...] = ()  # the answer ends before any of these (the pipeline's own calls keep theirs)
    instructions: str = ""  # the client's own (a chat's system messages), in every prompt that writes the answer
    history: tuple[Turn, ...] = ()  # the conversation before the question: with any, it is first rewritten to stand alone
    prefetch: bool = True
    ranking: Ranking = DENSE  # how its searches rank passages: by meaning, by words or both
    pipelining: bool = False  # iterative pipelines search from a stale query while the step generates (PipeRAG)
    speculative_prefill: bool = False  # the call after a search prefilled from its provisional top-k (AquaPipe)
    deadline: float | None = None  # a time.monotonic() instant: every LLM call stops there (the server's admission deadline)


@dataclass
class RagResult:
    answer: str
    pipeline: str
    documents: list[RetrievedPassage]
    steps: list[Step]
    timings: Timings
    prefetch: PrefetchSummary
    tokens_generated: int = 0
    pipelining: PipeliningSummary = field(default_factory=PipeliningSummary)
    speculation: SpeculationSummary = field(default_factory=SpeculationSummary)

    @property
    def prompt_tokens(self) -> int:
        """Every LLM call's prompt tokens."""
        return sum(s.tokens_in for s in self.steps if s.kind == "llm")

    @property
    def cached_tokens(self) -> int:
        """Of `prompt_tokens`, those the engine reused from its prefix cache instead of prefilling."""
        return sum(s.tokens_cached for s in self.steps if s.kind == "llm")

    @property
    def finish_reason(self) -> Literal["stop", "length", "deadline"]:
        """Why the answer ended: of itself; at the token limit (the last call that wrote it ended
        there); or at the run's deadline (some call stopped there, and what it would have led to
        was cut short: the answer is what the run had by then)."""
        if any(step.stopped_at_deadline for step in self.steps):
            return "deadline"
        answers = [step for step in self.steps if step.kind == "llm" and step.stage.role is StageRole.GENERATE]
        return "length" if answers and answers[-1].cut else "stop"


@dataclass(frozen=True)
class StageEvent:
    stage: Stage
    status: Literal["start", "end"]
    ms: float | None = None


@dataclass(frozen=True)
class TokenEvent:
    text: str


@dataclass(frozen=True)
class UsageEvent:
    """`tokens` more were generated (by any LLM call of the run), reported as they are, so that a
    run cut short still accounts for what it cost."""

    tokens: int


@dataclass(frozen=True)
class ResultEvent:
    result: RagResult


RunEvent = StageEvent | TokenEvent | UsageEvent | ResultEvent
EventSink = Callable[[RunEvent], None]  # where a run's events go as they happen
RunBody = Callable[[EventSink], Coroutine[Any, Any, RagResult]]  # a run, once its events have somewhere to go


@runtime_checkable
class Pipeline(Protocol):
    """A RAG pipeline."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    @property
    def stages(self) -> tuple[Stage, ...]:
        """Every stage a run may trace; it traces no other."""
        ...

    @property
    def llm_calls(self) -> int:
        """The most LLM calls one run makes (the scheduler's cost estimate)."""
        ...

    async def run(self, query: str, options: RunOptions, emit: EventSink) -> RagResult:
        """Run to the end in the caller's task: each stage, token and usage event handed to
        `emit` as it happens (on the event loop), the result returned."""
        ...

    def over(self, retriever: Retriever) -> Pipeline:
        """The same pipeline retrieving from `retriever` instead (a request's `file_search` tool's
        vector stores)."""
        ...


def ignore_events(event: RunEvent) -> None:
    """An `EventSink` for a caller that wants the result alone."""


async def event_stream(run: RunBody) -> AsyncGenerator[RunEvent, None]:
    """A run's events ending with one ResultEvent, for a reader that cannot take them as they
    happen (a Ray streaming call, a test): the run in a task of its own, its events through a
    queue. The server's own runs need none of this (`AdmittedRun` is their one queue)."""
    queue: asyncio.Queue[RunEvent | None] = asyncio.Queue()
    task = asyncio.create_task(run(queue.put_nowait))
    task.add_done_callback(lambda _: queue.put_nowait(None))  # queued behind every event of the run
    try:
        while (event := await queue.get()) is not None:
            yield event
        yield ResultEvent(task.result())  # raises the run's error
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
