"""The prefix cache benchmark: real pipelines over a question stream in which some questions come
again (another user asking what was just asked, so the same documents are retrieved), run with
the transformers engine's KV reuse off, with its prefix cache (exact), and with per-document KV
beside it (TurboRAG's option, which changes answers), the same requests in the same order, one
at a time, the modes taking turns: time to the first answer token, latency, prompt tokens and how many were reused, and
whether each answer is the one the engine gave without reuse.
`configured_prefix_cache_study` runs it with the configured LLM and datastore
(`telerag bench prefix-cache`)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqdm import tqdm

from telerag.config.settings import Settings
from telerag.engines.errors import EngineUnavailable
from telerag.pipelines.questions import Question, question_options
from telerag.pipelines.types import Pipeline, RagResult, RunEvent, RunOptions, TokenEvent

if TYPE_CHECKING:  # torch comes with them: imported when the study runs (the CLI reads CACHE_MODES)
    from telerag.engines.transformers.engine import TransformersEngine

REPEAT_GAP = 2  # a repeated question comes back after this many others
CACHE_MODES = ("off", "prefix", "per_document")  # per_document: the prefix cache, and documents' KV reused anywhere


@dataclass
class PrefixCacheRow:
    pipeline: str
    cache: str  # one of CACHE_MODES
    requests: int
    ttft_ms_p50: float  # to the first answer token
    latency_ms_p50: float
    prompt_tokens: int  # every LLM call's, summed over the requests
    cached_tokens: int  # of them, whose KV was reused
    identical_outputs: float  # share of answers equal to the `off` run's
    cache_bytes: int  # what the caches held at the end


@dataclass(frozen=True)
class PrefixCacheConfig:
    pipelines: tuple[str, ...]
    questions: tuple[Question, ...]
    repeat: float = 0.5  # share of questions asked again, REPEAT_GAP questions later
    seed: int = 0
    max_tokens: int = 64
    cache_mb: float = 256.0  # each cache's, when on
    modes: tuple[str, ...] = CACHE_MODES  # `off` first: the answers the others are compared with


def question_stream(questions: Sequence[Question], repeat: float, seed: int = 0) -> list[Question]:
    """Each question in turn; with probability `repeat`, it is asked again after the next
    REPEAT_GAP questions (the same article, so the same documents)."""
    rng = random.Random(seed)
    stream: list[Question] = []
    pending: list[tuple[int, Question]] = []  # (due after this many more questions, question)
    for question in questions:
        stream.append(question)
        pending = [(due - 1, q) for due, q in pending]
        stream.extend(q for due, q in pending if due <= 0)
        pending = [(due, q) for due, q in pending if due > 0]
        if rng.random() < repeat:
            pending.append((REPEAT_GAP, question))
    stream.extend(q for _, q in pending)
    return stream


async def timed_run(pipeline: Pipeline, question: Question, options: RunOptions) -> tuple[RagResult, float, float]:
    """The result, ms to the first answer token (to the result when none streamed) and ms in all."""
    started = time.perf_counter()
    first: list[float] = []  # when the first answer token came

    def timed(event: RunEvent) -> None:
        if isinstance(event, TokenEvent) and not first:
            first.append(time.perf_counter())

    result = await pipeline.run(question.text, question_options(question, options), timed)
    ended = time.perf_counter()
    return result, ((first[0] if first else ended) - started) * 1e3, (ended - started) * 1e3


async def prefix_cache_study(
    engine: TransformersEngine,
    pipelines: Sequence[Pipeline],
    stream: Sequence[Question],
    options: RunOptions,
    cache_mb: float,
    modes: Sequence[str] = CACHE_MODES,
    *,
    progress: bool = False,
) -> list[PrefixCacheRow]:
    """Each pipeline over `stream` in each of `modes`, the modes taking turns request by request
    (so that a load drifting on the machine weighs on each alike), each mode with caches of its
    own, empty at the pipeline's start."""
    if not modes or modes[0] != "off" or not set(modes) <= set(CACHE_MODES):
        raise ValueError(f"modes must begin with off and be among {CACHE_MODES}, not {list(modes)}")
    rows: list[PrefixCacheRow] = []
    configured = (engine.prefix_cache, engine.document_kv)  # given back at the end
    bar = tqdm(total=len(modes) * len(pipelines) * len(stream), desc="requests", unit="req", disable=not progress)
    for pipeline in pipelines:
        caches = {}
        for cache in modes:
            engine.use_prefix_cache(cache_mb if cache != "off" else 0.0)
            engine.use_document_kv(cache_mb if cache == "per_document" else 0.0)
            caches[cache] = (engine.prefix_cache, engine.document_kv)
        runs: dict[str, list[tuple[RagResult, float, float]]] = {cache: [] for cache in modes}
        for question in stream:
            for cache in modes:
                engine.prefix_cache, engine.document_kv = caches[cache]  # between requests: none runs
                runs[cache].append(await timed_run(pipeline, question, options))
                bar.update()
        answers = [result.answer for result, _, _ in runs["off"]]
        for cache in modes:
            done = runs[cache]
            rows.append(
                PrefixCacheRow(
                    pipeline=pipeline.name,
                    cache=cache,
                    requests=len(done),
                    ttft_ms_p50=statistics.median(ttft for _, ttft, _ in done),
                    latency_ms_p50=statistics.median(ms for _, _, ms in done),
                    prompt_tokens=sum(result.prompt_tokens for result, _, _ in done),
                    cached_tokens=sum(result.cached_tokens for result, _, _ in done),
                    identical_outputs=sum(r.answer == a for (r, _, _), a in zip(done, answers, strict=True)) / len(done),
                    cache_bytes=sum(c.bytes for c in caches[cache] if c is not None),
                )
            )
    engine.prefix_cache, engine.document_kv = configured
    bar.close()
    return rows


async def configured_prefix_cache_study(settings: Settings, config: PrefixCacheConfig) -> list[PrefixCacheRow]:
    """`prefix_cache_study` with the configured transformers engine and datastore."""
    from telerag.engines.transformers.engine import TransformersEngine
    from telerag.server.process.runtime import open_runtime

    async with open_runtime(settings) as runtime:
        engine = runtime.engine
        if not isinstance(engine, TransformersEngine):
            raise EngineUnavailable(
                "bench prefix-cache measures the transformers engine's prefix cache (engine.kind: transformers)"
            )
        options = RunOptions(top_k=settings.retrieval.top_k, max_tokens=config.max_tokens)
        stream = question_stream(config.questions, config.repeat, config.seed)
        pipelines = list(runtime.pipelines(runtime.retriever, config.pipelines).values())
        return await prefix_cache_study(engine, pipelines, stream, options, config.cache_mb, config.modes, progress=True)


def format_table(rows: Sequence[PrefixCacheRow]) -> str:
    header = f"{'pipeline':<13}{'cache':<14}{'requests':>9}{'ttft p50':>10}{'latency p50':>13}{'prompt':>9}{'cached':>9}"
    header += f"{'identical':>10}{'cache MB':>10}"
    lines = [header]
    for r in rows:
        lines.append(
            f"{r.pipeline:<13}{r.cache:<14}{r.requests:>9}{r.ttft_ms_p50:>8.0f}ms{r.latency_ms_p50:>11.0f}ms{r.prompt_tokens:>9}"
            f"{r.cached_tokens:>9}{r.identical_outputs:>10.3f}{r.cache_bytes / 2**20:>10.1f}"
        )
    return "\n".join(lines)
