"""`telerag bench e2e`: whole RAG requests (real pipelines, the server's batching scheduler, the
real retriever and LLM) in the modes of `benchmarks.e2e_modes` (cpu, lookahead, resident,
primed) over the same requests, side by side in one run.

At each batch size B, B clients each send their next request as soon as the previous one is
answered (a closed loop, B requests in flight) until N requests are answered, after `warmup`
unmeasured requests (which also refine each pipeline's estimate of its pre-retrieval time, the
time its prefetch hides behind). Every run of `lookahead` starts from an empty cluster cache. Every request's documents are
compared with the `cpu` mode's for the same question: prefetching changes speed, never answers.

Without CUDA the "device" is CPU memory, and with no cluster cache configured (the CPU
default) `lookahead` runs exactly as `cpu`: the machinery and the answers are still checked.

`run_configured_e2e` runs it on what the settings configure, or on a tiny or random-weight LLM
and the datastore scaled up (`telerag bench e2e`).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from telerag.benchmarks.e2e_modes import DEFAULT_MODES, MODES, Mode, Primer, configured
from telerag.benchmarks.scaled import DatastoreScale, open_scaled_retriever
from telerag.benchmarks.search_recorder import SearchRecorder
from telerag.config.settings import Settings, pre_retrieval_profile
from telerag.engines.errors import EngineUnavailable, ModelNotFound
from telerag.engines.types import Engine
from telerag.pipelines.rag.base import RagPipeline
from telerag.pipelines.registry import build_pipelines
from telerag.pipelines.retriever import DirectRetriever
from telerag.pipelines.types import (
    DatastoreInfo,
    RagResult,
    RunEvent,
    RunOptions,
    SearchQuery,
    TokenEvent,
)
from telerag.retrieval.errors import DeviceMemoryError
from telerag.server.process.event_loop import run_event_loop
from telerag.server.process.runtime import build_engine
from telerag.server.scheduling.retrieval_batching import BatchingRetriever
from telerag.utils.device import resolve_device


@dataclass(frozen=True)
class E2EConfig:
    pipelines: tuple[str, ...]
    questions: tuple[str, ...]  # request i asks questions[i % len(questions)]
    batches: tuple[int, ...] = (1, 4, 8)
    requests: int = 16  # per (pipeline, batch, mode)
    max_tokens: int = 32
    top_k: int = 3
    nprobe: int | None = None  # None: the retriever's default
    warmup: int = 2  # unmeasured requests before each measured run
    batch_window_ms: float = 0.0  # the scheduler's settings
    max_batch: int = 32
    modes: tuple[Mode, ...] = DEFAULT_MODES  # in MODES' order; cpu always (the others are compared with it)

    def __post_init__(self) -> None:
        if Mode.CPU not in self.modes:
            raise ValueError("the cpu mode is the baseline every other mode is compared with: it cannot be left out")
        if Mode.PRIMED in self.modes and set(self.batches) != {1}:
            raise ValueError("the primed mode reads each request's lists before it, one request at a time: run it at batch 1")
        object.__setattr__(self, "modes", tuple(m for m in MODES if m in self.modes))


class LLMChoice(StrEnum):
    """Which LLM `run_configured_e2e` loads."""

    CONFIGURED = "configured"  # the settings' engine, as `serve` builds it
    TINY = "tiny"  # a tiny random LLM (seconds; its text is noise): for CI
    RANDOM_WEIGHTS = "random-weights"  # engine.model_path's architecture with random weights, nothing loaded


@dataclass(frozen=True)
class RequestRecord:
    """What one answered request measured and returned."""

    latency_ms: float  # from sending the request to its result, as the client sees it
    ttft_ms: float  # from sending it to the answer's first token
    result: RagResult
    searches: tuple[tuple[SearchQuery, ...], ...]  # each search's queries, in order

    @property
    def documents(self) -> tuple[int, ...]:
        return tuple(d.id for d in self.result.documents)

    @property
    def queries(self) -> tuple[str | None, ...]:
        """Every search's q_out, in order (what the LLM wrote, for pipelines that search its text)."""
        return tuple(s.query for s in self.result.steps if s.kind == "retrieval")


@dataclass(frozen=True)
class E2ERow:
    """One (pipeline, batch, mode): latency, throughput, where the time went, and the answers
    against the `cpu` mode's. Gains are against the `cpu` row of the same pipeline and batch."""

    pipeline: str
    batch: int
    mode: str
    requests: int
    llm: str
    t_llm_ms: float  # mean pre-retrieval (and other non-final) LLM time per request: what a prefetch hides behind
    latency_ms_p50: float
    latency_ms_p99: float
    latency_ms_mean: float
    ttft_ms_p50: float  # to the answer's first token
    ttft_ms_mean: float
    throughput_rps: float
    retrieval_ms_p50: float  # the search stage per request (q_out's embedding, queueing, search)
    searches_mean: float  # searches per request (its retrieval steps)
    retrieval_ms_mean: float
    retrieval_cpu_ms_mean: float  # of which faiss on the CPU
    retrieval_device_ms_mean: float  # and the device scan
    generate_ms_mean: float  # the calls that wrote the answer (role generate)
    overlap_rate: float | None  # mean |C_in ∩ C_out| / |C_out|; None where nothing was prefetched
    bytes_prefetched_mean: float
    same_documents: float  # share of requests whose documents equal the cpu mode's
    same_queries: float  # share of requests whose q_out texts equal the cpu mode's (the LLM wrote the same)
    retrieval_share: float  # retrieval_ms_mean / latency_ms_mean in this mode
    gain_bound: float  # 1 / (1 - the cpu mode's retrieval share): the latency gain if retrieval took no time
    latency_gain: float  # cpu mode's mean latency / this mode's
    ttft_gain: float  # cpu mode's mean time to first token / this mode's
    throughput_gain: float  # this mode's throughput / cpu mode's


@dataclass(frozen=True)
class E2EReport:
    """The rows of one run and what it ran on."""

    llm: str  # the engine's name
    datastore: DatastoreInfo  # after the run (the lookahead mode's cache)
    config: E2EConfig
    rows: list[E2ERow]


async def timed(pipeline: RagPipeline, question: str, options: RunOptions) -> tuple[RagResult, float, float]:
    """The request's result, its latency and its time to the answer's first token (ms; the
    latency where no token came)."""
    first_token: list[float] = []

    def on_event(event: RunEvent) -> None:
        if isinstance(event, TokenEvent) and not first_token:
            first_token.append(time.perf_counter())

    started = time.perf_counter()
    result = await pipeline.run(question, options, on_event)
    ended = time.perf_counter()
    return result, (ended - started) * 1e3, ((first_token or [ended])[0] - started) * 1e3


def unprepared(i: int) -> contextlib.AbstractAsyncContextManager[None]:
    """A request sent as it comes."""
    return contextlib.nullcontext()


async def serve_closed_loop(
    pipeline: RagPipeline,
    questions: Sequence[str],
    concurrency: int,
    options: RunOptions,
    recorder: SearchRecorder,
    prepared: Callable[[int], contextlib.AbstractAsyncContextManager[None]] = unprepared,
) -> tuple[list[RequestRecord], float]:
    """Answer every question with `concurrency` clients in flight (the pipeline's searches going
    through `recorder`), each request i timed inside `prepared(i)`; the records in question
    order and the wall time in seconds."""
    records: list[RequestRecord | None] = [None] * len(questions)
    pending = iter(range(len(questions)))  # shared: each client takes the next question

    async def client() -> None:
        for i in pending:
            async with prepared(i):
                with recorder.question():
                    result, latency_ms, ttft_ms = await timed(pipeline, questions[i], options)
                    searches = tuple(tuple(search.queries) for search in recorder.searches)
            records[i] = RequestRecord(latency_ms, ttft_ms, result, searches)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(max(1, min(concurrency, len(questions))))))
    wall = time.perf_counter() - started
    return [r for r in records if r is not None], wall


async def run_e2e(
    engine: Engine, retriever: DirectRetriever, config: E2EConfig, *, log: Callable[[str], None] = print
) -> list[E2ERow]:
    """Every pipeline at every batch size in every mode; one row each. The three modes of a
    (pipeline, batch) run back to back, so that a machine whose load drifts (a shared box)
    treats them alike; each run starts with its own warm-up. `log` reports progress."""
    questions = [config.questions[i % len(config.questions)] for i in range(config.requests)]
    warmup = [config.questions[-1 - i % len(config.questions)] for i in range(config.warmup)]
    recorder = SearchRecorder(BatchingRetriever(retriever, window_ms=config.batch_window_ms, max_batch=config.max_batch))
    # one set of pipelines per mode, each starting from the profiled t_LLM as a server's do and
    # refining it from its own calls in that mode
    pipelines = {
        mode: build_pipelines(engine, recorder, names=config.pipelines, pre_retrieval_ms=pre_retrieval_profile())
        for mode in config.modes
    }
    rows: list[E2ERow] = []
    for name in config.pipelines:
        for batch in config.batches:
            measured: dict[Mode, tuple[list[RequestRecord], float]] = {}
            for mode in config.modes:
                with configured(retriever, mode) as mode_options:
                    options = RunOptions(
                        top_k=config.top_k, nprobe=config.nprobe, max_tokens=config.max_tokens, prefetch=mode_options.prefetch
                    )
                    pipeline = pipelines[mode][name]
                    if warmup:
                        await serve_closed_loop(pipeline, warmup, batch, options, recorder)
                    prepared = (
                        Primer(retriever, config.nprobe, [r.searches for r in measured[Mode.CPU][0]]).prepared
                        if mode is Mode.PRIMED
                        else unprepared
                    )
                    measured[mode] = await serve_closed_loop(pipeline, questions, batch, options, recorder, prepared)
                records, wall = measured[mode]
                log(f"{name} batch {batch} {mode.value}: {len(records) / wall:.2f} requests/s")
            rows.extend(summarise(name, batch, mode, *measured[mode], measured[Mode.CPU], engine.name) for mode in config.modes)
    return rows


def summarise(
    pipeline: str,
    batch: int,
    mode: Mode,
    records: list[RequestRecord],
    wall_s: float,
    baseline: tuple[list[RequestRecord], float],
    llm: str,
) -> E2ERow:
    """One row from a mode's records and the cpu mode's records of the same requests."""
    base_records, base_wall = baseline
    latency = [r.latency_ms for r in records]
    retrieval = [r.result.timings.search_ms for r in records]
    overlaps = [r.result.prefetch.overlap_rate for r in records if r.result.prefetch.overlap_rate is not None]
    base_latency = statistics.fmean(r.latency_ms for r in base_records)
    ttft = [r.ttft_ms for r in records]
    base_share = statistics.fmean(r.result.timings.search_ms for r in base_records) / base_latency
    pairs = list(zip(records, base_records, strict=True))
    return E2ERow(
        pipeline=pipeline,
        batch=batch,
        mode=mode.value,
        requests=len(records),
        llm=llm,
        t_llm_ms=statistics.fmean(r.result.timings.pre_retrieval_ms for r in records),
        latency_ms_p50=float(np.percentile(latency, 50)),
        latency_ms_p99=float(np.percentile(latency, 99)),
        latency_ms_mean=statistics.fmean(latency),
        ttft_ms_p50=float(np.percentile(ttft, 50)),
        ttft_ms_mean=statistics.fmean(ttft),
        throughput_rps=len(records) / wall_s,
        retrieval_ms_p50=float(np.percentile(retrieval, 50)),
        searches_mean=statistics.fmean(len(r.queries) for r in records),
        retrieval_ms_mean=statistics.fmean(retrieval),
        retrieval_cpu_ms_mean=statistics.fmean(r.result.timings.search_cpu_ms for r in records),
        retrieval_device_ms_mean=statistics.fmean(r.result.timings.search_device_ms for r in records),
        generate_ms_mean=statistics.fmean(r.result.timings.generate_ms for r in records),
        overlap_rate=statistics.fmean(overlaps) if overlaps else None,
        bytes_prefetched_mean=statistics.fmean(r.result.prefetch.bytes_prefetched for r in records),
        same_documents=statistics.fmean(r.documents == b.documents for r, b in pairs),
        same_queries=statistics.fmean(r.queries == b.queries for r, b in pairs),
        retrieval_share=statistics.fmean(retrieval) / statistics.fmean(latency),
        gain_bound=1.0 / max(1e-9, 1.0 - base_share),
        latency_gain=base_latency / statistics.fmean(latency),
        ttft_gain=statistics.fmean(r.ttft_ms for r in base_records) / statistics.fmean(ttft),
        throughput_gain=(len(records) / wall_s) / (len(base_records) / base_wall),
    )


def run_configured_e2e(
    settings: Settings,
    config: E2EConfig,
    *,
    llm: LLMChoice = LLMChoice.CONFIGURED,
    scale: DatastoreScale | None = None,
    log: Callable[[str], None] = print,
) -> E2EReport:
    """`run_e2e` in the server's event loop on the LLM `llm` names and the configured retriever,
    over the configured datastore or, with `scale`, that datastore scaled up. The engine loads
    first, so that the default cluster cache gets what the LLM leaves of the GPU (as `serve`)."""
    engine = build_llm(settings, llm)
    retriever = open_scaled_retriever(settings.retrieval, scale, early_stop=settings.experiments.early_stop)
    if Mode.RESIDENT in config.modes:  # before minutes of measuring, not after them
        try:
            retriever.retrieval_engine.check_cache_fits(
                retriever.datastore.n_vectors * retriever.retrieval_engine.cache.row_bytes,
                headroom_bytes=int(settings.retrieval.cache_headroom_mb * 2**20),
            )
        except DeviceMemoryError as exc:
            retriever.close()
            raise DeviceMemoryError(
                f"the resident mode holds the whole datastore: {exc}; run it on a larger GPU, or leave "
                "it out with --modes cpu lookahead"
            ) from None

    async def main() -> list[E2ERow]:
        try:
            return await run_e2e(engine, retriever, config, log=log)
        finally:
            await engine.close()

    try:
        rows = run_event_loop(main(), settings)
        info = retriever.datastore_info()
    finally:
        retriever.close()
    return E2EReport(llm=engine.name, datastore=info, config=config, rows=rows)


def build_llm(settings: Settings, llm: LLMChoice) -> Engine:
    """The engine `llm` names, on the configured engine device."""
    if llm is LLMChoice.CONFIGURED:
        return build_engine(settings)
    from telerag.benchmarks.random_llm import random_weight_engine, tiny_random_lm
    from telerag.engines.transformers.engine import TransformersEngine

    device = str(resolve_device(settings.engine.device, error=EngineUnavailable))
    if llm is LLMChoice.TINY:
        return TransformersEngine(*tiny_random_lm(0), name="tiny-random", device=device)
    if settings.engine.model_path is None:
        raise ModelNotFound("random weights need engine.model_path: a directory with a config.json and a tokenizer")
    return random_weight_engine(settings.engine.model_path, device=device)


def format_table(report: E2EReport) -> str:
    """A header naming the LLM, the datastore and the run's shape; one line per row; the gains' legend."""
    info, config = report.datastore, report.config
    header = (
        f"{'pipeline':<12}{'batch':>6} {'mode':<10}{'req':>5}{'p50 ms':>10}{'p99 ms':>10}{'ttft p50':>10}{'req/s':>8}"
        f"{'retr p50':>10}{'t_LLM ms':>10}{'overlap':>9}{'same docs':>10}{'same q_out':>11}{'retr share':>11}"
        f"{'lat gain':>9}{'ttft gain':>10}{'tput gain':>10}{'bound':>7}"
    )
    lines = [
        f"LLM {report.llm}; datastore {info.passages} vectors, nlist {info.nlist}, nprobe {info.nprobe}, "
        f"device {info.device}, lookahead cache {info.cache_bytes / 2**20:.3g} MB; "
        f"{config.requests} requests per row, top-{config.top_k}, {config.max_tokens} tokens",
        header,
    ]
    for r in report.rows:
        overlap = f"{r.overlap_rate:.2f}" if r.overlap_rate is not None else "-"
        lines.append(
            f"{r.pipeline:<12}{r.batch:>6} {r.mode:<10}{r.requests:>5}{r.latency_ms_p50:>10.1f}{r.latency_ms_p99:>10.1f}"
            f"{r.ttft_ms_p50:>10.1f}"
            f"{r.throughput_rps:>8.2f}{r.retrieval_ms_p50:>10.2f}{r.t_llm_ms:>10.1f}{overlap:>9}{r.same_documents:>10.2f}{r.same_queries:>11.2f}"
            f"{r.retrieval_share:>11.2f}{r.latency_gain:>8.2f}x{r.ttft_gain:>9.2f}x{r.throughput_gain:>9.2f}x{r.gain_bound:>6.2f}x"
        )
    lines.append(
        "gains: against the cpu row of the same pipeline and batch; bound: 1 / (1 - the cpu row's retrieval share), "
        "the latency gain if retrieval took no time"
    )
    return "\n".join(lines)
