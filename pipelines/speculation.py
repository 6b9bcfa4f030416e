"""Speculative prefill (AquaPipe): while a search runs, the prompt of the LLM
call its documents go to is prefilled from the search's provisional top-k, into the engine's
prefix cache (SGLang's radix cache), so that the call, built as always from the final top-k,
finds its prompt's KV computed: all of it when the top-k held, up to the first document that
changed otherwise (the call then prefills the rest itself: the re-prefill). The answer never
changes; only the time to the call's first token may.

Stable, here: the search reports its top-k so far after a 64th, a 32nd, ... and a half of its
lists (`retrieval.provisional`); a top-k is stable when a report names the same documents in
the same order, every query, as the report before (AquaPipe's Stability = k, Unstability = 0
between two reports: it withstood doubling the lists scanned). The first stable top-k is
prefilled, once per search. When the search ends with another top-k, a speculative prefill still
waiting for the engine is cancelled (AquaPipe's re-prefill: what was computed of it is kept, as
the prefix cache keeps any prompt's KV).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from telerag.engines.types import Generation, Prefiller
from telerag.pipelines.stats import SpeculativePrefill
from telerag.pipelines.types import ProvisionalDocuments, RetrievedPassage, SearchObserver

log = logging.getLogger(__name__)


class StableTopK:
    """Successive reports of one search's top-k (ids, one row per query); the first that repeats
    the report before, complete (k documents every query), is stable."""

    def __init__(self) -> None:
        self.previous: np.ndarray | None = None
        self.found = False

    def offer(self, ids: np.ndarray) -> bool:
        """Whether `ids`, the next report's, is the first stable top-k."""
        stable = not self.found and self.previous is not None and np.array_equal(self.previous, ids) and bool((ids >= 0).all())
        self.previous, self.found = ids.copy(), self.found or stable
        return stable


@dataclass(frozen=True)
class HeardOnLoop:
    """A search's observer heard on its caller's event loop (the search runs in a worker thread)."""

    observer: SearchObserver
    loop: asyncio.AbstractEventLoop

    def provisional(self, found: ProvisionalDocuments) -> None:
        self.loop.call_soon_threadsafe(self.observer.provisional, found)


class Speculation:
    """One search's speculative prefill: started from its stable top-k (as the search's observer:
    `provisional`), judged when the search ends (`settle`), and matched with the LLM call
    whose prompt it was for (`observe_call`); `report` says what became of it."""

    def __init__(self, engine: Prefiller, prompt_of: Callable[[list[list[RetrievedPassage]]], str]) -> None:
        """`prompt_of`: the formatted prompt of the call a search's documents go to."""
        self.engine, self.prompt_of = engine, prompt_of
        self.task: asyncio.Future[list[Generation]] | None = None
        self.prompt = ""  # the speculated one
        self.lists_share = 0.0  # of the search's lists, scanned when its top-k was found stable
        self.final_prompt: str | None = None  # the call's, once the search ended
        self.prefilled_tokens: int | None = None  # computed by the speculative prefill
        self.cached_before: int | None = None  # of the speculated prompt, what the engine held already
        self.call_cached: int | None = None  # of the call's prompt, what the engine held

    def provisional(self, found: ProvisionalDocuments) -> None:
        """Prefill the call's prompt as the provisional documents would make it (on the event
        loop: the search tells it through `HeardOnLoop`)."""
        if self.task is not None:
            return
        self.prompt, self.lists_share = self.prompt_of(found.documents), found.lists_share
        self.task = asyncio.ensure_future(self.engine.prefill([self.prompt]))
        self.task.add_done_callback(self._prefilled)

    def settle(self, documents: list[list[RetrievedPassage]]) -> None:
        """The search ended with `documents`: a different prompt is a re-prefill, and a
        speculative prefill still waiting is cancelled. Nothing without a speculation."""
        if self.task is None:
            return
        self.final_prompt = self.prompt_of(documents)
        if self.final_prompt != self.prompt and not self.task.done():
            self.task.cancel()

    def observe_call(self, prompt: str, generation: Generation) -> None:
        """An LLM call of the run: the one this speculation was for, if its prompt is the final one."""
        if self.final_prompt == prompt and self.call_cached is None:
            self.call_cached = generation.cached_tokens

    async def finished(self) -> None:
        """Wait for the speculative prefill (cancelled or failed: nothing to wait for)."""
        if self.task is not None:
            await asyncio.gather(self.task, return_exceptions=True)

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    @property
    def report(self) -> SpeculativePrefill | None:
        """What became of it (None: nothing was speculated), with the tokens the call reused
        once both sides are known: what it found cached beyond what was cached before the
        speculation, at most what the speculation computed."""
        if self.task is None or self.final_prompt is None:
            return None
        reused = None
        if self.prefilled_tokens is not None and self.cached_before is not None and self.call_cached is not None:
            reused = min(max(0, self.call_cached - self.cached_before), self.prefilled_tokens)
        return SpeculativePrefill(self.lists_share, self.final_prompt != self.prompt, self.prefilled_tokens, reused)

    def _prefilled(self, task: asyncio.Future[list[Generation]]) -> None:
        if task.cancelled():
            return
        if (error := task.exception()) is not None:  # the call prefills its prompt itself: only speed is lost
            log.warning("a speculative prefill failed: %s", error)
            return
        generation = task.result()[0]
        self.cached_before = generation.cached_tokens
        self.prefilled_tokens = generation.prompt_tokens - generation.cached_tokens
