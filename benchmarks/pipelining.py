"""`telerag bench pipelining`: the same requests of the iterative pipelines in several modes, over a
datastore scaled so that retrieval is a real share of a request's time (`benchmarks.scaled`):

  sequential  every search after its step (what the pipelines do without `pipelining`)
  pipelined   each search launched from the step's text so far while it generates (PipeRAG)
  early_stop  sequential, faiss's lists scanned with exact early stop (`experiments.early_stop`)
  budgeted    pipelined, with nprobe "auto" (the largest predicted to fit the generation left)
  speculative sequential, each search's next call prefilled from its provisional top-k (AquaPipe)
  early_stop_speculative  both: the provisional top-k over the lists early stop has not ruled out

One client, one request at a time, the modes taking turns request by request, each request's
turn begun by the next mode (a load drifting on the machine weighs on each alike, and no mode is
always first), after `warmup` unmeasured requests per mode (which also teach each mode's
pipelines their expected step lengths and the search-time model). Each mode has its own
pipelines over one retriever, batching scheduler and LLM. The modes ask the same questions, so
each request starts from an empty prefix cache (the transformers engine's): no mode reuses the
prompts another just sent. A pipelined search's final query is
not checked beside the run (`pipelining.check` off): `same_documents` compares each request's
documents with the sequential mode's instead. After each request, untimed, the searches its
documents came from are replayed with every list probed (`search_recorder.SearchRecorder`): its
`recall_at_k` against exhaustive search. With `cold`, the cluster cache is emptied before each
request: over a datastore on disk every list a request probes is read anew, as the first request
after the lists left the cache finds them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from telerag.benchmarks.e2e import LLMChoice, build_llm, timed
from telerag.benchmarks.scaled import DatastoreScale, open_scaled_retriever
from telerag.benchmarks.search_recorder import SearchRecorder
from telerag.config.settings import Settings, pre_retrieval_profile
from telerag.engines.types import Engine
from telerag.pipelines.rag.base import RagPipeline
from telerag.pipelines.registry import build_pipelines
from telerag.pipelines.retriever import DirectRetriever
from telerag.pipelines.search_budget import SearchBudget
from telerag.pipelines.stats import SearchStats
from telerag.pipelines.types import DatastoreInfo, RagResult, RunOptions
from telerag.retrieval.early_stop import EarlyStopSearch, ListBounds
from telerag.server.process.event_loop import run_event_loop
from telerag.server.process.runtime import pipelining_config
from telerag.server.scheduling.retrieval_batching import BatchingRetriever


class Mode(StrEnum):
    SEQUENTIAL = "sequential"
    PIPELINED = "pipelined"
    EARLY_STOP = "early_stop"
    BUDGETED = "budgeted"
    SPECULATIVE = "speculative"
    EARLY_STOP_SPECULATIVE = "early_stop_speculative"


# sequential first: the baseline
MODES = (Mode.SEQUENTIAL, Mode.PIPELINED, Mode.EARLY_STOP, Mode.BUDGETED, Mode.SPECULATIVE, Mode.EARLY_STOP_SPECULATIVE)


@dataclass(frozen=True)
class PipeliningBenchConfig:
    pipelines: tuple[str, ...]
    questions: tuple[str, ...]  # request i asks questions[i % len(questions)]
    requests: int = 8  # measured, per pipeline and mode
    warmup: int = 2  # unmeasured, per pipeline and mode
    max_tokens: int = 32
    top_k: int = 3
    modes: tuple[Mode, ...] = MODES
    cold: bool = False  # the cluster cache emptied before each request: every list read anew (from disk, a cold search)

    def __post_init__(self) -> None:
        if Mode.SEQUENTIAL not in self.modes:
            raise ValueError("the sequential mode is the baseline every other mode is compared with: it cannot be left out")
        object.__setattr__(self, "modes", tuple(m for m in MODES if m in self.modes))


@dataclass(frozen=True)
class Measured:
    """One answered request of one mode."""

    latency_ms: float
    ttft_ms: float  # to the answer's first token
    result: RagResult
    recall: float  # of its documents, the share exhaustive search of the same queries also returns
    lists_probed: int  # by its searches' CPU half with early stop (0 in the other modes)
    lists_scanned: int

    @property
    def documents(self) -> tuple[int, ...]:
        return tuple(d.id for d in self.result.documents)

    def searches(self) -> list[tuple[float, SearchStats]]:
        return [(s.ms, s.stats) for s in self.result.steps if isinstance(s.stats, SearchStats)]


@dataclass(frozen=True)
class PipeliningRow:
    """One (pipeline, mode), against the sequential mode of the same pipeline and requests."""

    pipeline: str
    mode: str
    requests: int
    latency_ms_p50: float
    latency_ms_p99: float
    ttft_ms_p50: float  # to the answer's first token
    retrieval_ms_p50: float  # the search stages per request (hidden behind generation or not)
    gain: float  # the sequential mode's mean latency over this mode's
    ttft_gain: float  # the sequential mode's mean time to first token over this mode's
    bound: float  # 1 / (1 - retrieval's share of the sequential mode's mean latency): the gain if retrieval took no time
    same_documents: float  # share of requests whose documents equal the sequential mode's
    same_answers: float  # share of requests whose answer equals the sequential mode's
    lists_scanned_fraction: float  # lists scanned over lists probed (1 but with early stop)
    recall_at_k: float  # mean over requests of the share of their top-k that exhaustive search also finds
    nprobe_p50: float  # over the mode's pipelined searches (budgeted: what "auto" chose), or all its searches without any
    pipelined: float  # share of the mode's searches launched from a stale query
    searched_again: float  # share of those whose final query was searched again (it had moved too far)
    search_over_generation_p50: float | None  # a pipelined search's time over the generation left at its launch
    speculated: float  # share of the mode's searches whose next call's prompt was prefilled from their provisional top-k
    reprefilled: float  # of those, the share whose final top-k made another prompt (prefilled again from the change)


@dataclass(frozen=True)
class PipeliningReport:
    llm: str
    datastore: DatastoreInfo
    config: PipeliningBenchConfig
    rows: list[PipeliningRow]


class ModeSetup:
    """What each mode changes: its requests' options, its pipelines, and faiss's half (exact
    early stop for `early_stop`, swapped in for its requests only)."""

    def __init__(self, engine: Engine, retriever: DirectRetriever, settings: Settings, config: PipeliningBenchConfig) -> None:
        self.retriever, self.recorder = (
            retriever,
            SearchRecorder(
                BatchingRetriever(retriever, window_ms=settings.scheduler.batch_window_ms, max_batch=settings.scheduler.max_batch)
            ),
        )
        search = retriever.retrieval_engine  # its CPU half as it scans: faiss in memory, or the lists read from disk
        self.early_stop = EarlyStopSearch(search.cpu_half, ListBounds.of(retriever.datastore))
        unchecked = dataclasses.replace(pipelining_config(settings.experiments), check=False)
        floor, nlist = settings.retrieval.nprobe_floor, retriever.datastore.nlist
        self.pipelines: dict[Mode, dict[str, RagPipeline]] = {
            mode: build_pipelines(
                engine,
                self.recorder,
                names=config.pipelines,
                pre_retrieval_ms=pre_retrieval_profile(),
                pipelining=unchecked,
                search_budget=SearchBudget(floor=floor, ceiling=lambda: nlist),
            )
            for mode in config.modes
        }
        self.config, self.engine = config, engine
        self.prefix_cache_mb = settings.engine.prefix_cache_mb if hasattr(engine, "use_prefix_cache") else 0.0

    def options(self, mode: Mode) -> RunOptions:
        return RunOptions(
            top_k=self.config.top_k,
            max_tokens=self.config.max_tokens,
            nprobe="auto" if mode is Mode.BUDGETED else None,
            pipelining=mode in (Mode.PIPELINED, Mode.BUDGETED),
            speculative_prefill=mode in (Mode.SPECULATIVE, Mode.EARLY_STOP_SPECULATIVE),
        )

    @contextlib.contextmanager
    def cpu_half(self, mode: Mode) -> Iterator[None]:
        engine = self.retriever.retrieval_engine
        faiss_half = engine.cpu_half
        engine.cpu_half = self.early_stop if mode in (Mode.EARLY_STOP, Mode.EARLY_STOP_SPECULATIVE) else faiss_half
        try:
            yield
        finally:
            engine.cpu_half = faiss_half

    async def measure(self, mode: Mode, name: str, question: str) -> Measured:
        """One request of `mode`, timed; then, untimed, its documents against exhaustive search."""
        if self.prefix_cache_mb:  # a new, empty one
            self.engine.use_prefix_cache(self.prefix_cache_mb)  # type: ignore[attr-defined]
        if self.config.cold:
            search = self.retriever.retrieval_engine
            search.resize_cache(search.cache.capacity_bytes)  # empty
        counts = self.early_stop.counts
        probed, scanned = counts.probed, counts.scanned
        with self.cpu_half(mode), self.recorder.question():
            result, latency_ms, ttft_ms = await timed(self.pipelines[mode][name], question, self.options(mode))
            probed, scanned = counts.probed - probed, counts.scanned - scanned
            exact = await self.recorder.exact_documents(result.documents, self.retriever.datastore.nlist, self.config.top_k)
        found = {d.id for d in exact}
        recall = sum(d.id in found for d in result.documents) / max(1, len(result.documents))
        return Measured(latency_ms, ttft_ms, result, recall, probed, scanned)


async def run_pipelining_bench(
    engine: Engine, retriever: DirectRetriever, settings: Settings, config: PipeliningBenchConfig, *, log: Callable[[str], None]
) -> list[PipeliningRow]:
    """Every pipeline's requests in every mode, the modes taking turns request by request."""
    setup = ModeSetup(engine, retriever, settings, config)
    questions = [config.questions[i % len(config.questions)] for i in range(config.requests)]
    warmup = [config.questions[-1 - i % len(config.questions)] for i in range(config.warmup)]
    rows: list[PipeliningRow] = []
    for name in config.pipelines:
        for question in warmup:
            for mode in config.modes:
                await setup.measure(mode, name, question)
        measured: dict[Mode, list[Measured]] = {mode: [] for mode in config.modes}
        for i, question in enumerate(questions):
            turn = i % len(config.modes)
            for mode in (*config.modes[turn:], *config.modes[:turn]):
                measured[mode].append(await setup.measure(mode, name, question))
            log(f"{name}: request {i + 1} of {len(questions)}")
        rows.extend(summarise(name, mode, measured[mode], measured[Mode.SEQUENTIAL]) for mode in config.modes)
    return rows


def _p50(values: Sequence[float]) -> float:
    return float(np.percentile(values, 50)) if values else 0.0


def summarise(pipeline: str, mode: Mode, records: list[Measured], sequential: list[Measured]) -> PipeliningRow:
    latency = [r.latency_ms for r in records]
    base_latency = statistics.fmean(r.latency_ms for r in sequential)
    base_ttft = statistics.fmean(r.ttft_ms for r in sequential)
    base_share = statistics.fmean(r.result.timings.search_ms for r in sequential) / base_latency
    searches = [search for r in records for search in r.searches()]
    pipelined = [(ms, stats.pipelined) for ms, stats in searches if stats.pipelined is not None]
    speculated = [stats.speculative for _, stats in searches if stats.speculative is not None]
    probed = sum(r.lists_probed for r in records)
    return PipeliningRow(
        pipeline=pipeline,
        mode=mode.value,
        requests=len(records),
        latency_ms_p50=_p50(latency),
        latency_ms_p99=float(np.percentile(latency, 99)),
        ttft_ms_p50=_p50([r.ttft_ms for r in records]),
        retrieval_ms_p50=_p50([r.result.timings.search_ms for r in records]),
        gain=base_latency / statistics.fmean(latency),
        ttft_gain=base_ttft / statistics.fmean(r.ttft_ms for r in records),
        bound=1.0 / max(1e-9, 1.0 - base_share),
        same_documents=statistics.fmean(r.documents == b.documents for r, b in zip(records, sequential, strict=True)),
        same_answers=statistics.fmean(r.result.answer == b.result.answer for r, b in zip(records, sequential, strict=True)),
        lists_scanned_fraction=sum(r.lists_scanned for r in records) / probed if probed else 1.0,
        recall_at_k=statistics.fmean(r.recall for r in records),
        nprobe_p50=_p50([stats.nprobe for _, stats in searches if stats.pipelined is not None or not pipelined]),
        pipelined=len(pipelined) / len(searches) if searches else 0.0,
        searched_again=sum(p.searched_again for _, p in pipelined) / len(pipelined) if pipelined else 0.0,
        search_over_generation_p50=(_p50([ms / max(p.generation_left_ms, 1e-9) for ms, p in pipelined]) if pipelined else None),
        speculated=len(speculated) / len(searches) if searches else 0.0,
        reprefilled=sum(s.reprefilled for s in speculated) / len(speculated) if speculated else 0.0,
    )


def run_configured_pipelining_bench(
    settings: Settings,
    config: PipeliningBenchConfig,
    *,
    llm: LLMChoice = LLMChoice.CONFIGURED,
    scale: DatastoreScale | None = None,
    log: Callable[[str], None] = print,
) -> PipeliningReport:
    """`run_pipelining_bench` in the server's event loop on the LLM `llm` names and the
    configured retriever, over the configured datastore or, with `scale`, that datastore scaled
    up (early stop needs its list statistics: the embedded default's are added as serve adds them)."""
    engine = build_llm(settings, llm)
    retriever = open_scaled_retriever(settings.retrieval, scale, early_stop=True)  # the datastore's list statistics, loaded
    stopping = retriever.retrieval_engine.cpu_half
    assert isinstance(stopping, EarlyStopSearch)
    retriever.retrieval_engine.cpu_half = stopping.inner  # faiss's own (or the disk's reads), but where a mode says otherwise

    async def main() -> list[PipeliningRow]:
        try:
            return await run_pipelining_bench(engine, retriever, settings, config, log=log)
        finally:
            await engine.close()

    try:
        rows = run_event_loop(main(), settings)
        info = retriever.datastore_info()
    finally:
        retriever.close()
    return PipeliningReport(llm=engine.name, datastore=info, config=config, rows=rows)


def format_table(report: PipeliningReport) -> str:
    info, config = report.datastore, report.config
    lines = [
        f"LLM {report.llm}; datastore {info.passages} vectors, nlist {info.nlist}, nprobe {info.nprobe}, device {info.device}; "
        f"{config.requests} requests per row (one at a time, the modes taking turns), top-{config.top_k}, "
        f"{config.max_tokens} tokens",
        f"{'pipeline':<12} {'mode':<23}{'req':>4}{'p50 ms':>9}{'p99 ms':>9}{'ttft p50':>9}{'retr p50':>9}{'gain':>7}"
        f"{'ttft gain':>10}{'bound':>7}"
        f"{'same docs':>10}{'same ans':>9}{'lists':>7}{'recall':>7}{'nprobe':>7}{'pipel.':>7}{'again':>7}{'search/gen':>11}"
        f"{'spec.':>7}{'re-pref.':>9}",
    ]
    for r in report.rows:
        ratio = "-" if r.search_over_generation_p50 is None else f"{r.search_over_generation_p50:.2f}"
        lines.append(
            f"{r.pipeline:<12} {r.mode:<23}{r.requests:>4}{r.latency_ms_p50:>9.0f}{r.latency_ms_p99:>9.0f}{r.ttft_ms_p50:>9.0f}"
            f"{r.retrieval_ms_p50:>9.1f}{r.gain:>6.2f}x{r.ttft_gain:>9.2f}x{r.bound:>6.2f}x{r.same_documents:>10.2f}"
            f"{r.same_answers:>9.2f}"
            f"{r.lists_scanned_fraction:>7.3f}{r.recall_at_k:>7.3f}{r.nprobe_p50:>7.0f}{r.pipelined:>7.2f}"
            f"{r.searched_again:>7.2f}{ratio:>11}{r.speculated:>7.2f}{r.reprefilled:>9.2f}"
        )
    lines.append(
        "gain: the sequential row's mean latency over this row's; ttft gain: the same of the time to the answer's first "
        "token; bound: 1 / (1 - retrieval's share of the sequential "
        "row's latency); lists: scanned over probed; recall: against exhaustive search; pipel.: searches launched from a "
        "stale query; again: of those, searched again; search/gen: a pipelined search's time over the generation left "
        "at its launch (p50); spec.: searches whose next call was prefilled from their provisional top-k; re-pref.: of "
        "those, the share whose final top-k made another prompt"
    )
    return "\n".join(lines)
