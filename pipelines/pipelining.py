"""Pipelined retrieval (PipeRAG): an iterative pipeline's next search starts from the text its
step has generated so far, while the step's generation goes on, instead of after it.

The launch point: once the step has generated `launch_share` of the tokens its stage's calls
have lately generated (a moving average; the call's token limit before the first), the stale
query is made from the text so far and searched (a step whose query needs more, as FLARE's
needs an unsure token, launches at the first token after that point that gives one). Half by
default: the second half of the generation is the time the search hides behind, the first half
is what the stale query knows of the step, and `nprobe: "auto"` (`search_budget`) fills the
second half with as many lists as fit. When the step ends, its final query is embedded beside
the stale one: at a cosine of at least `min_cosine` the stale documents are used, otherwise the
final query is searched again (exact, as without pipelining). With `check`, a kept stale search
is compared with the final query's own search beside the next step, so that every response can
say how often pipelining changed its documents.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from telerag.engines.types import TokenChunk
from telerag.pipelines.types import RetrievedPassage, SearchQuery, query_texts

TOKEN_SMOOTHING = 0.2  # weight of a stage's newest call in its expected completion tokens


@dataclass(frozen=True)
class PipeliningConfig:
    """How the pipelines pipeline their retrievals (`experiments.pipelining_*` in the settings)."""

    launch_share: float = 0.5  # of the step's expected tokens generated before the stale query is searched
    min_cosine: float = 0.9  # stale and final query at least this alike: the stale documents are used
    check: bool = True  # search a kept stale search's final query beside the next step, to report differences

    def __post_init__(self) -> None:
        if not 0.0 <= self.launch_share <= 1.0:
            raise ValueError("launch_share must be within [0, 1]")
        if not -1.0 <= self.min_cosine <= 1.0:
            raise ValueError("min_cosine must be within [-1, 1]")


@dataclass(frozen=True)
class PartialGeneration:
    """What a streamed LLM call has generated so far (its first prompt's)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    expected_tokens: float  # what calls of its stage lately generated, at most its limit (`ExpectedTokens`)
    per_token_ms: float | None  # the decode time per token so far (None before the second token)

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


StaleQuery = Callable[[PartialGeneration], Sequence[SearchQuery] | None]  # a step's query from its text so far


class ExpectedTokens:
    """Each stage's expected completion tokens: a moving average of its calls'."""

    def __init__(self) -> None:
        self.by_stage: dict[str, float] = {}

    def observe(self, stage: str, tokens: int) -> None:
        previous = self.by_stage.get(stage)
        self.by_stage[stage] = tokens if previous is None else (1 - TOKEN_SMOOTHING) * previous + TOKEN_SMOOTHING * tokens

    def of(self, stage: str, max_tokens: int) -> float:
        """What a call of `stage` limited to `max_tokens` is expected to generate (before the
        first: its limit)."""
        return min(float(max_tokens), self.by_stage.get(stage, float(max_tokens)))


class CallWatch:
    """An LLM call's `on_chunk` (`Engine.generate`): each chunk of its first prompt shown to
    `watch` as the generation so far."""

    def __init__(self, expected_tokens: float, watch: Callable[[PartialGeneration], None], clock: Callable[[], float]) -> None:
        self.expected_tokens, self.watch, self.clock = expected_tokens, watch, clock
        self.text, self.ids, self.logprobs = "", list[int](), list[float]()
        self.first: tuple[float, int] | None = None  # when the first token came, and how many there were then

    def __call__(self, chunk: TokenChunk) -> None:
        if chunk.index:
            return
        self.text, now = self.text + chunk.text, self.clock()
        self.ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if self.first is None and self.ids:
            self.first = (now, len(self.ids))
        first = self.first
        per_token_ms = None if first is None or len(self.ids) <= first[1] else (now - first[0]) * 1e3 / (len(self.ids) - first[1])
        self.watch(PartialGeneration(self.text, tuple(self.ids), tuple(self.logprobs), self.expected_tokens, per_token_ms))


@dataclass(frozen=True)
class Launch:
    """A stale query found at the launch point, and what the launch knew."""

    queries: list[SearchQuery]
    tokens: int  # generated when it launched
    at: float  # the clock's time
    left_ms: float | None  # the generation predicted left (None: no decode rate measured yet)


def launch_point(partial: PartialGeneration, stale: StaleQuery, share: float, now: float) -> Launch | None:
    """The launch, if `partial` is at or past the point (`share` of its expected tokens, at
    least one) and gives a query; else None."""
    if partial.tokens < max(1, math.ceil(share * partial.expected_tokens)):
        return None
    queries = [q for q in stale(partial) or () if any(text.strip() for text in query_texts(q))]
    if not queries:
        return None
    left = max(0.0, partial.expected_tokens - partial.tokens)
    return Launch(queries, partial.tokens, now, None if partial.per_token_ms is None else left * partial.per_token_ms)


def cosines(stale: np.ndarray, final: np.ndarray) -> float:
    """The least cosine between each stale query's vector and its final query's (rows paired;
    a different number of queries: -1, nothing alike)."""
    if stale.shape != final.shape or not len(stale):
        return -1.0
    norms = np.linalg.norm(stale, axis=1) * np.linalg.norm(final, axis=1)
    return float(np.min(np.sum(stale * final, axis=1) / np.maximum(norms, 1e-12)))


def same_documents(a: Sequence[Sequence[RetrievedPassage]], b: Sequence[Sequence[RetrievedPassage]]) -> bool:
    """Whether two searches' documents are the same passages in the same order, query by query."""
    return [[(d.source, d.id) for d in group] for group in a] == [[(d.source, d.id) for d in group] for group in b]
