"""Deterministic stand-ins for an engine and a retriever that record what was asked of them."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import zlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace

from telerag.engines.errors import EngineError
from telerag.engines.types import Generation, OnChunk, SamplingParams, TokenChunk, deadline_passed
from telerag.pipelines.stats import PrefetchStepStats, SearchStats
from telerag.pipelines.types import (
    PrefetchRequest,
    PrefetchTicket,
    ProvisionalDocuments,
    RetrievedPassage,
    SearchOptions,
    SearchOutcome,
    SearchQuery,
    SearchRequest,
    TextEmbeddings,
)
from telerag.retrieval.stats import PrefetchStats
from tests.retrieval_helpers import HashEmbedder


@dataclass
class Reply:
    text: str
    logprobs: tuple[float, ...] = ()  # one per word of `text` (the fake's tokens are words)
    token_delay: float | None = None  # seconds before each token, if not the engine's (cut short by a call's deadline)


Script = Callable[[str], Reply]


class ScriptedEngine:
    """Answers each prompt with `script(prompt)`; tokens are words; logs every call in `log`."""

    name = "scripted"

    def __init__(
        self,
        script: Script,
        log: list[tuple[str, str]] | None = None,
        *,
        fail: bool = False,
        delay: float = 0.0,
        token_delay: float = 0.0,
    ) -> None:
        """`delay`: seconds before a call's first token; `token_delay`: before each token (the
        event loop runs other work meanwhile, as while a real engine decodes)."""
        self.script = script
        self.log = log if log is not None else []
        self.fail = fail
        self.delay = delay
        self.token_delay = token_delay
        self.prompts: list[str] = []
        self.params: list[SamplingParams] = []  # each call's, in order
        self.vocab: list[str] = []
        self.prefilled: list[str] = []  # every prompt `prefill` was given, in order: its "prefix cache"

    def format_prompt(self, user_text: str, *, system: str = "") -> str:
        return f"{system}\n\n{user_text}" if system else user_text  # as for a base model

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def decode(self, token_ids: Sequence[int]) -> str:
        return " ".join(self.vocab[i] for i in token_ids)

    def cached(self, prompt: str) -> int:
        """The prompt's tokens (words) a prefilled prompt began with: what a prefix cache holds."""
        words = prompt.split()
        return max((_common(words, seen.split()) for seen in self.prefilled), default=0)

    async def prefill(self, prompts: Sequence[str]) -> list[Generation]:
        out = []
        for index, prompt in enumerate(prompts):
            self.log.append(("prefill", prompt.splitlines()[0]))
            if self.delay:
                await asyncio.sleep(self.delay)
            tokens, cached = self.count_tokens(prompt), self.cached(prompt)
            out.append(Generation("", tokens, 0, "length", 0.0, 1.0, index=index, cached_tokens=cached))
            self.prefilled.append(prompt)
        return out

    def _generation(self, index: int, prompt: str, params: SamplingParams) -> tuple[Generation, float]:
        """The call's Generation and the seconds before each of its tokens."""
        reply = self.script(prompt)
        words = reply.text.split()
        cut = len(words) > params.max_tokens
        text = " ".join(words[: params.max_tokens]) if cut else reply.text
        for stop in params.stop:
            if stop and stop in text:
                text = text[: text.index(stop)]
        ids = []
        for word in text.split():
            self.vocab.append(word)
            ids.append(len(self.vocab) - 1)
        logprobs = tuple(reply.logprobs[: len(ids)]) or tuple(0.0 for _ in ids)
        generation = Generation(
            text,
            self.count_tokens(prompt),
            len(ids),
            "length" if cut and len(ids) == params.max_tokens else "stop",
            1.0,
            2.0,
            tuple(ids),
            logprobs if params.logprobs else (),
            index,
            min(self.cached(prompt), max(0, self.count_tokens(prompt) - 1)),
        )
        return generation, self.token_delay if reply.token_delay is None else reply.token_delay

    async def generate(self, prompts: Sequence[str], params: SamplingParams, on_chunk: OnChunk | None = None) -> list[Generation]:
        """The stream's Generations; a call whose `on_chunk` asks no more ends there, each
        unfinished prompt with what it streamed ("stop")."""
        out: dict[int, Generation] = {}
        streamed: dict[int, list[TokenChunk]] = {i: [] for i in range(len(prompts))}
        async with contextlib.aclosing(self.stream(prompts, params)) as items:
            async for item in items:
                if isinstance(item, Generation):
                    out[item.index] = item
                    continue
                streamed[item.index].append(item)
                if on_chunk is not None and on_chunk(item):
                    break
        return [out.get(i) or self._stopped(i, prompts[i], streamed[i]) for i in range(len(prompts))]

    def _stopped(self, index: int, prompt: str, chunks: list[TokenChunk]) -> Generation:
        ids = tuple(t for c in chunks for t in c.token_ids)
        logprobs = tuple(lp for c in chunks for lp in c.logprobs)
        text = "".join(c.text for c in chunks).strip()
        return Generation(text, self.count_tokens(prompt), len(ids), "stop", 1.0, 2.0, ids, logprobs, index)

    async def stream(self, prompts: Sequence[str], params: SamplingParams) -> AsyncIterator[TokenChunk | Generation]:
        self.params.append(params)
        for index, prompt in enumerate(prompts):
            self.prompts.append(prompt)
            self.log.append(("llm_start", prompt.splitlines()[0]))
            try:
                if self.delay:
                    await asyncio.sleep(self.delay)
                if self.fail:
                    raise EngineError("scripted failure")
                generation, token_delay = self._generation(index, prompt, params)
                words = generation.text.split()
                for i, word in enumerate(words):
                    if token_delay:
                        left = math.inf if params.deadline is None else params.deadline - time.monotonic()
                        await asyncio.sleep(max(0.0, min(token_delay, left)))
                    if deadline_passed(params.deadline):  # as an engine stops there
                        text, ids, logprobs = " ".join(words[:i]), generation.token_ids[:i], generation.logprobs[:i]
                        generation = replace(
                            generation, text=text, completion_tokens=i, token_ids=ids, logprobs=logprobs, finish_reason="deadline"
                        )
                        break
                    logprobs = generation.logprobs[i : i + 1]
                    yield TokenChunk(index, word + " ", generation.token_ids[i : i + 1], logprobs)
                yield generation
            finally:
                self.log.append(("llm_end", prompt.splitlines()[0]))

    async def close(self) -> None:
        return None


def _common(a: Sequence[str], b: Sequence[str]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class RecordingRetriever:
    """Returns `docs_per_query` made-up documents per query; logs prefetch, search and release."""

    default_nprobe = 8  # reported for a search that names none (as `fake_app.DATASTORE_INFO`)

    def __init__(self, log: list[tuple[str, str]] | None = None, docs_per_query: int = 3) -> None:
        self.log = log if log is not None else []
        self.docs_per_query = docs_per_query
        self.searches: list[list[str]] = []
        self.prefetches: list[list[str]] = []
        self.overlaps_ms: list[float | None] = []  # each prefetch's overlap_ms
        self.released: list[PrefetchTicket] = []
        self.outstanding: set[int] = set()

    async def prefetch(self, queries: Sequence[str], *, enabled: bool = True, overlap_ms: float | None = None) -> PrefetchTicket:
        self.prefetches.append(list(queries))
        self.overlaps_ms.append(overlap_ms)
        self.log.append(("prefetch", " | ".join(queries)))
        ticket = PrefetchTicket(
            list(queries), PrefetchStepStats(enabled, plan=PrefetchStats(clusters_requested=4, bytes_copied=1024))
        )
        self.outstanding.add(id(ticket))
        return ticket

    async def search(
        self,
        queries: Sequence[SearchQuery],
        options: SearchOptions,
        ticket: PrefetchTicket | None = None,
    ) -> SearchOutcome:
        self.searches.append(list(queries))
        self.log.append(("search", " | ".join(map(str, queries))))
        documents = [
            [
                RetrievedPassage(
                    id=zlib.crc32(f"{q}|{j}".encode()) % 10_000,
                    doc_id=f"doc-{str(q)[:10]}-{j}",
                    title=f"T{j}",
                    text=f"about {q}",
                    score=1.0 - j / 10,
                )
                for j in range(min(self.docs_per_query, options.top_k))
            ]
            for q in queries
        ]
        if options.observer is not None:
            options.observer.provisional(ProvisionalDocuments(self.provisional_documents(documents), 0.25))
            await asyncio.sleep(0)  # the rest of the search: what was started from the provisional documents begins
        stats = SearchStats(overlap_rate=0.75, clusters_device=3, clusters_cpu=1, device_ms=1.0, cpu_ms=2.0, embed_ms=0.5)
        return SearchOutcome(documents, replace(stats, nprobe=options.nprobe or self.default_nprobe))

    def provisional_documents(self, documents: list[list[RetrievedPassage]]) -> list[list[RetrievedPassage]]:
        """What a search asked for its provisional top-k reports as stable: its final documents."""
        return documents

    async def prefetch_batch(self, requests: Sequence[PrefetchRequest]) -> list[PrefetchTicket]:
        return [await self.prefetch(r.queries, enabled=r.enabled, overlap_ms=r.overlap_ms) for r in requests]

    async def search_batch(self, requests: Sequence[SearchRequest]) -> list[SearchOutcome]:
        return [await self.search(r.queries, r.options, r.ticket) for r in requests]

    async def embed(self, texts: Sequence[str]) -> TextEmbeddings:
        embedder = HashEmbedder()
        return TextEmbeddings(embedder.encode(texts), embedder.count_tokens(texts))

    def snapshot(self) -> None:
        return None  # no datastore: nothing to keep one version of

    def release(self, ticket: PrefetchTicket) -> None:
        self.log.append(("release", " | ".join(ticket.queries)))
        self.released.append(ticket)
        self.outstanding.discard(id(ticket))
