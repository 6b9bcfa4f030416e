"""What the routes share once the runtime is loaded: the pipelines over the batching retriever,
admission, metrics, and what turns a request into an admitted run."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from fastapi import Request

from telerag.config.settings import DEADLINE_STOP_LEAD_S, Settings, packaged_config
from telerag.file_search.errors import VectorStoresUnavailable
from telerag.pipelines.questions import read_questions
from telerag.pipelines.rag.query_rewrite import REWRITE_OPTIONS
from telerag.pipelines.types import (
    DatastoreInfo,
    EventSink,
    Pipeline,
    RagResult,
    RunEvent,
    RunOptions,
    TextEmbeddings,
    TokenEvent,
    Turn,
    UsageEvent,
)
from telerag.retrieval.live import LiveStats
from telerag.retrieval.ranking import Ranking, SearchMode
from telerag.retrieval.recall import RecallEstimate
from telerag.retrieval.rerank import Reranker
from telerag.retrieval.stats import CacheStats
from telerag.server.admission.admitted_run import AdmittedRun
from telerag.server.admission.calibration import Calibration, load_calibration
from telerag.server.admission.policy import admission_policy
from telerag.server.admission.workload import DEFAULT_PASSAGE_WORDS, TOKENS_PER_WORD, ServedWork, Workload
from telerag.server.errors import DocumentsUnavailable, InvalidField, Refusal, RequestTimeout, UnsupportedField
from telerag.server.observability.metrics import Metrics
from telerag.server.observability.scraped_metrics import LiveReport

if TYPE_CHECKING:
    from telerag.documents.ingestion import Ingestion, IngestionProgress
    from telerag.documents.writer import DocumentWriter
from telerag.documents.rebuilds import Rebuilds


class ServedRuntime(Protocol):
    """What a service runs on: an engine and a retriever in this process (`runtime.Runtime`), or
    inference replicas on a Ray cluster (`replicas.ReplicaRuntime`)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def datastore_info(self) -> DatastoreInfo: ...

    @property
    def reranker(self) -> Reranker | None:
        """What reorders a search's candidates (`retrieval.reranker`; None: none)."""
        ...

    @property
    def engine_name(self) -> str | None: ...

    def count_tokens(self, text: str) -> int: ...

    def serving_pipelines(self, on_batch: Callable[[str, int], None]) -> Mapping[str, Pipeline]: ...

    def query_rewrite(self) -> Pipeline | None:
        """What rewrites a vector store search's query on the engine (`rewrite_query`; None: no
        vector stores are served)."""
        ...

    async def embed(self, texts: Sequence[str]) -> TextEmbeddings: ...

    def cache_stats(self) -> CacheStats: ...

    def search_recall(self) -> RecallEstimate | None:
        """The dense search's recall estimated on the traffic (None: not estimated here)."""
        ...

    def prefix_cache_bytes(self) -> int | None: ...

    @property
    def documents(self) -> DocumentWriter | None:
        """What writes documents into the datastore (None: this runtime writes none)."""
        ...

    @property
    def rebuilds(self) -> Rebuilds | None:
        """What compacts and retrains the datastore (None: this runtime writes none)."""
        ...

    @property
    def ingestion(self) -> Ingestion | None:
        """The rest of the datastore's corpus, written while it serves (None: none left, or none written here)."""
        ...

    async def close(self) -> None: ...


log = logging.getLogger(__name__)

CALIBRATION_PIPELINE = "naive"
CALIBRATION_MAX_TOKENS = 64  # a client's usual limit; the answers it cuts count as running to a larger request's
# limit (`workload`). At 256 (the default) a few of the burst's answers ran long, 4x the prior the burst was estimated
# at, and that error made every default request look 53 s long alone
CALIBRATION_BURST = 16  # requests at once after the first alone (at most max_concurrency): one of every other pipeline,
# naive's filling it up, so that the rates and the error are measured up to 16 running and every pipeline's work, in
# one burst: shorter than naive's burst first and the others after it, and no worse (docs/benchmarks.md, "A burst
# right after start"; tests/test_admission_load.py)


class Service:
    """The runtime, the pipelines over the batching retriever, admission, metrics."""

    def __init__(self, runtime: ServedRuntime, metrics: Metrics) -> None:
        self.runtime = runtime
        self.settings = runtime.settings
        self.metrics = metrics
        scheduler = self.settings.scheduler
        self.pipelines: Mapping[str, Pipeline] = runtime.serving_pipelines(
            lambda kind, size: self.metrics.batch_size.labels(kind).observe(size)
        )
        self.query_rewrite = runtime.query_rewrite()
        self.workload = Workload()
        self.admission = admission_policy(
            scheduler,
            on_change=self._queue_changed,
            on_refuse=lambda reason: self.metrics.admission.refusals.labels(reason.value).inc(),
            on_start=self.metrics.admission.queue_wait.observe,
        )
        self.metrics.admission.expected_wait.set_function(self.admission.expected_wait_s)
        self.metrics.admission.service_rate.set_function(lambda: self.admission.service_rate() or 0.0)
        self.metrics.admission.estimate_factor.set_function(self.admission.estimate_factor)
        words = self.runtime.datastore_info.passage_words or DEFAULT_PASSAGE_WORDS
        self.passage_tokens = math.ceil(TOKENS_PER_WORD * words)

    def calibration(self) -> Calibration:
        """What admission has measured so far (to keep across a restart: `admission.calibration`)."""
        return Calibration(self.workload, self.admission.measured)

    def restore_calibration(self, path: Path) -> bool:
        """Start from the measurements kept at `path`, if there are any this server can read."""
        restored = load_calibration(path, self.workload, self.admission.measured) is not None
        if restored:
            log.info("admission starts from the measurements kept in %s", path)
        return restored

    async def warm_up(self, *, measured: bool = False) -> None:
        """Requests through the whole path and through admission before the server is ready: one
        alone, then (unless admission's measurements were kept from an earlier run: `measured`,
        `restore_calibration`) a burst of `CALIBRATION_BURST` at once (at most `max_concurrency`):
        one request of every other pipeline and naive ones for the rest, questions of the packaged
        set. What the chat template, the tokenizer, the embedder, the search and the engine set up
        on first use holds the GIL for a while; done here, it does not stall the event loop under
        the first clients (measured in a soak: stalls of 0.2-1.4 s in the first seconds of load
        without it). And admission measures its service rate alone and at each number running as
        the burst drains, and every pipeline's work: a burst right after start-up is judged at a
        burst's rate and cost, not refused for want of them, and no pipeline is costed by the
        prior (`workload`), whose guess for the multi-call ones is several times their measured
        work: under load such a guess never fits beside the others, so the pipeline was refused
        and so never measured."""
        naive = self.pipelines[CALIBRATION_PIPELINE]
        others = [p for name, p in self.pipelines.items() if name != CALIBRATION_PIPELINE]
        size = min(CALIBRATION_BURST, self.admission.max_concurrency)
        burst = [*others, *[naive] * (size - len(others))]
        questions = [q.text for q in read_questions(packaged_config("questions_wiki_en.txt"), limit=1 + len(burst))]
        options = RunOptions(max_tokens=CALIBRATION_MAX_TOKENS, top_k=self.settings.retrieval.top_k)
        await self._calibrate(naive, questions[0], options)
        if measured:
            return
        measuring = list(zip(burst, questions[1:], strict=True))
        for start in range(0, len(measuring), size):  # at once, as many as the slots (the queue may hold no more)
            await asyncio.gather(*(self._calibrate(p, question, options) for p, question in measuring[start : start + size]))

    async def _calibrate(self, pipeline: Pipeline, question: str, options: RunOptions) -> None:
        """One warm-up request, admitted and run as a client's is (no client to watch, no metrics)."""
        prompt = self.prompt_tokens(question, options)
        cost = self.workload.estimate(pipeline.name, pipeline.llm_calls, prompt, options.max_tokens)
        ticket = self.admission.admit(cost, calibrating=True)
        learn = functools.partial(self.workload.observe, pipeline.name, prompt)
        await AdmittedRun(None, self.admission, ticket, functools.partial(pipeline.run, question, options), learn).result()

    def documents(self) -> DocumentWriter:
        """The writer of the datastore's documents; 501 on a runtime that writes none."""
        writer = self.runtime.documents
        if writer is None:
            raise DocumentsUnavailable("this deployment writes no documents (a Ray cluster's inference replicas)")
        return writer

    def rebuilds(self) -> Rebuilds:
        """The compactions and retrains of the datastore; 501 on a runtime that writes none."""
        rebuilds = self.runtime.rebuilds
        if rebuilds is None:
            raise DocumentsUnavailable("this deployment writes no documents (a Ray cluster's inference replicas)")
        return rebuilds

    def ingestion_progress(self) -> IngestionProgress | None:
        """How far the ingestion of the datastore's corpus is (None: none since this server started)."""
        ingestion = self.runtime.ingestion
        return None if ingestion is None else ingestion.progress

    def ingesting(self) -> IngestionProgress | None:
        """How far the datastore's corpus is written while it is not all (an answer searched a part
        of it: the answer says so); None once it is, or where nothing is being written."""
        progress = self.ingestion_progress()
        return progress if progress is not None and progress.documents < progress.total_documents else None

    def live_report(self) -> LiveReport | None:
        """What the metrics read of the live datastore (None: no live datastore here)."""
        writer, rebuilds = self.runtime.documents, self.runtime.rebuilds
        if writer is None:
            return None
        ended = {} if rebuilds is None else {(kind.value, state.value): n for (kind, state), n in rebuilds.ended().items()}
        return LiveReport(writer.stats(), ended, self.ingestion_progress())

    def live_stats(self) -> LiveStats | None:
        """The datastore's documents, passages, log and lists now (None: no live datastore here)."""
        writer = self.runtime.documents
        return None if writer is None else writer.stats()

    def _queue_changed(self, waiting: int, running: int) -> None:
        self.metrics.admission.queue_depth.set(waiting)
        self.metrics.admission.in_flight.set(running)

    def ranking(self, mode: SearchMode | None = None, weights: tuple[float, float] | None = None, rerank: bool = True) -> Ranking:
        """How a search ranks: `mode` (None: `retrieval.search_mode`) or hybrid with `weights`, re-ranked
        by the configured re-ranker if there is one and `rerank` (OpenAI's ranker `none`: not)."""
        reranker = self.runtime.reranker if rerank else None
        return self.settings.retrieval.ranking(mode, weights, reranker)

    def options(
        self,
        *,
        top_k: int | None,
        nprobe: int | Literal["auto"] | None,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        stop: tuple[str, ...] = (),
        instructions: str = "",
        history: tuple[Turn, ...] = (),
        prefetch: bool = True,
        pipelining: bool | None = None,
        speculative_prefill: bool | None = None,
        search_mode: SearchMode | None = None,
    ) -> RunOptions:
        """A request's options. What the request leaves out (None) is the settings': top_k, nprobe
        "auto" when `retrieval.nprobe` is (a configured number is the retriever's own default),
        pipelining, speculative prefill, the search mode."""
        retrieval, experiments = self.settings.retrieval, self.settings.experiments
        if nprobe is None and retrieval.nprobe == "auto":
            nprobe = "auto"
        return RunOptions(
            top_k=top_k or retrieval.top_k,
            nprobe=nprobe,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            instructions=instructions,
            history=history,
            prefetch=prefetch,
            ranking=self.ranking(search_mode),
            pipelining=experiments.pipelining if pipelining is None else pipelining,
            speculative_prefill=experiments.speculative_prefill if speculative_prefill is None else speculative_prefill,
        )

    async def embed(self, model: str, texts: list[str], dimensions: int | None) -> TextEmbeddings:
        """`texts` embedded by the datastore's embedder, which `model` must name (422 otherwise);
        `dimensions` can only be its size (400 otherwise: vectors are not shortened here)."""
        datastore = self.runtime.datastore_info
        if model != datastore.embedder:
            raise InvalidField("model", f"model: the datastore's embedder is {datastore.embedder!r} (GET /ready)")
        if dimensions is not None and dimensions != datastore.dim:
            raise UnsupportedField("dimensions", f"dimensions: only {datastore.dim}, the embedder's size")
        return await self.runtime.embed(texts)

    def prompt_tokens(
        self, query: str, options: RunOptions, *, query_field: str = "query", top_k_field: str | None = "top_k"
    ) -> int:
        """About how long the request's answer prompt is (its query and `top_k` passages); 422
        past `limits.max_prompt_tokens`, naming the field that put it there (`top_k` when the
        query alone fits)."""
        query_tokens = sum(  # the answer's prompt: its question and instructions; a follow-up's rewrite: the turns too
            self.runtime.count_tokens(text) for text in (query, options.instructions, *(t.text for t in options.history)) if text
        )
        prompt_tokens = query_tokens + options.top_k * self.passage_tokens
        limit = self.settings.limits.max_prompt_tokens
        if prompt_tokens > limit:
            self.metrics.admission.refusals.labels(Refusal.PROMPT_TOKENS.value).inc()
            field = top_k_field if top_k_field and query_tokens <= limit else query_field
            raise InvalidField(
                field,
                f"the prompt would be about {prompt_tokens} tokens (the query's {query_tokens} and "
                f"{options.top_k} passages of about {self.passage_tokens}); the limit is {limit}",
            )
        return prompt_tokens

    def admit(
        self,
        request: Request,
        pipeline: Pipeline,
        query: str,
        options: RunOptions,
        client: str | None,
        *,
        query_field: str = "query",
        top_k_field: str | None = "top_k",
    ) -> AdmittedRun:
        """Admit the request at its expected cost (`workload`), or refuse it at once (422 over the
        prompt limit, naming the question's and top_k's fields; 429 when busy); its run starts
        waiting for a slot, and its LLM calls stop at the deadline."""
        prompt = self.prompt_tokens(query, options, query_field=query_field, top_k_field=top_k_field)
        calls = pipeline.llm_calls + (1 if options.history else 0)  # a follow-up's rewrite
        cost = self.workload.estimate(pipeline.name, calls, prompt, options.max_tokens, options.temperature)
        ticket = self.admission.admit(cost, client)
        deadline = self.admission.deadline_s
        if deadline is not None:  # the promise kept even where the estimate was wrong: its LLM calls stop in time
            options = replace(options, deadline=ticket.admitted_at + deadline - DEADLINE_STOP_LEAD_S)
        learn = functools.partial(self._learn, pipeline.name, prompt, options.temperature)
        return AdmittedRun(request, self.admission, ticket, functools.partial(self.run, pipeline, query, options), learn)

    async def rewrite_query(self, request: Request, query: str, client: str | None) -> str:
        """`query` as a vector store search should ask it (`rewrite_query`: `QueryRewrite`), by a
        run of its own admitted as every request is (429 when busy, 422 past the prompt limit),
        stopped at the admission deadline, timed out and cancelled with its client
        (`ClientDisconnected`) as any run."""
        if self.query_rewrite is None:
            raise VectorStoresUnavailable("this deployment serves no vector stores (a Ray cluster's inference replicas)")
        run = self.admit(request, self.query_rewrite, query, REWRITE_OPTIONS, client, top_k_field=None)
        return (await run.result()).answer

    def _learn(self, pipeline: str, prompt_tokens: int, temperature: float, served: ServedWork) -> None:
        """What a completed request was served: its pipeline's next costs come from it."""
        self.workload.observe(pipeline, prompt_tokens, served, temperature)

    async def run(self, pipeline: Pipeline, query: str, options: RunOptions, emit: EventSink) -> RagResult:
        """Run a pipeline (a slot must be held) with the request timeout, recording metrics; the
        tokens it generates count as they are generated, so a cancelled request's count too."""
        started = time.perf_counter()
        outcome = "error"
        tokens = self.metrics.tokens.labels(pipeline.name)
        ttft = self.metrics.ttft.labels(pipeline.name)
        answered = False  # its first token has come

        def observed(event: RunEvent) -> None:
            nonlocal answered
            if isinstance(event, UsageEvent):
                tokens.inc(event.tokens)
                return
            if isinstance(event, TokenEvent) and not answered:
                answered = True
                ttft.observe(time.perf_counter() - started)
            emit(event)

        try:
            async with asyncio.timeout(self.settings.scheduler.request_timeout_s):
                result = await pipeline.run(query, options, observed)
        except TimeoutError:
            outcome = "timeout"
            raise RequestTimeout(f"the request took longer than {self.settings.scheduler.request_timeout_s} s") from None
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        else:
            self.metrics.observe_result(result)
            outcome = "deadline" if result.finish_reason == "deadline" else "ok"
            return result
        finally:
            self.metrics.request_latency.labels(pipeline.name, outcome).observe(time.perf_counter() - started)


def serving(request: Request) -> Service:
    """The service behind `/v1/*` (ServingGate lets requests through only once there is one)."""
    return request.app.state.service
