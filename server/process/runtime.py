"""What a server runs on: the engine, the retriever, and what it reports; built from settings."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from telerag.config.settings import ExperimentSettings, RetrievalSettings, Settings, pre_retrieval_profile
from telerag.documents.ingestion import Ingestion, resumed_ingestion
from telerag.documents.rebuilds import RebuildKind, Rebuilds
from telerag.documents.writer import DocumentWriter
from telerag.engines.errors import EngineUnavailable
from telerag.engines.types import Engine
from telerag.file_search.vector_store_index import StoreResources
from telerag.pipelines import prompts
from telerag.pipelines.datastores import load_datastore, open_retriever
from telerag.pipelines.embedder import Embedder
from telerag.pipelines.errors import EmbedderError
from telerag.pipelines.pipelining import PipeliningConfig
from telerag.pipelines.rag.base import RagPipeline
from telerag.pipelines.rag.query_rewrite import QueryRewrite
from telerag.pipelines.registry import build_pipelines
from telerag.pipelines.retriever import DirectRetriever
from telerag.pipelines.search_budget import SearchBudget
from telerag.pipelines.text_encoder import TextEncoder
from telerag.pipelines.types import BatchRetriever, DatastoreInfo, Retriever, TextEmbeddings
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.errors import DeviceUnavailable
from telerag.retrieval.ivf import ListSearch
from telerag.retrieval.live import LiveDatastore
from telerag.retrieval.recall import RecallEstimate
from telerag.retrieval.rerank import CrossEncoderReranker, Reranker
from telerag.retrieval.stats import CacheStats
from telerag.server.scheduling.retrieval_batching import BatchingRetriever
from telerag.utils.device import resolve_device
from telerag.utils.progress import StepProgress, observe_progress

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Runtime:
    settings: Settings
    engine: Engine
    retriever: BatchRetriever
    datastore_info: DatastoreInfo
    cache_stats: Callable[[], CacheStats] = CacheStats  # without a cache: all zero
    search_recall: Callable[[], RecallEstimate | None] = lambda: None  # None: not estimated here
    reranker: Reranker | None = None  # what reorders a search's candidates (None: none configured)
    resident_clusters: Callable[[], list[int]] = list  # what the cluster cache holds now (none without one)
    closers: list[Callable[[], Any]] = field(default_factory=list)
    documents: DocumentWriter | None = None  # what writes documents into the datastore (None: no live datastore)
    rebuilds: Rebuilds | None = None  # what compacts and retrains it
    ingestion: Ingestion | None = None  # the rest of its corpus, written while it serves (None: nothing left to write)
    store_resources: StoreResources | None = None  # what the vector stores use of the server (None: they are not served)

    def pipelines(self, retriever: Retriever, names: Sequence[str] | None = None) -> dict[str, RagPipeline]:
        """The pipelines over this engine and `retriever`, each starting from its expected
        pre-retrieval time in `config/prefetch_profiles.yaml`, pipelining as the settings say,
        with one search budget for nprobe "auto" (up to the datastore's nlist, as the latest
        retrain left it)."""
        return build_pipelines(
            self.engine,
            retriever,
            names=names,
            pre_retrieval_ms=pre_retrieval_profile(),
            pipelining=pipelining_config(self.settings.experiments),
            search_budget=SearchBudget(floor=self.settings.retrieval.nprobe_floor, ceiling=lambda: self.datastore_info.nlist),
        )

    def serving_pipelines(self, on_batch: Callable[[str, int], None]) -> dict[str, RagPipeline]:
        """The pipelines a server runs: over the retriever behind the scheduler's cross-request
        batching (`on_batch(kind, size)` hears each batch)."""
        scheduler = self.settings.scheduler
        batching = BatchingRetriever(
            self.retriever, window_ms=scheduler.batch_window_ms, max_batch=scheduler.max_batch, on_batch=on_batch
        )
        return self.pipelines(batching)

    def query_rewrite(self) -> RagPipeline:
        """The rewrite of a vector store search's query (`rewrite_query`) on this engine; it
        retrieves nothing, so any retriever serves."""
        return QueryRewrite(self.engine, self.retriever)

    @property
    def engine_name(self) -> str | None:
        return getattr(self.engine, "name", None)

    def count_tokens(self, text: str) -> int:
        return self.engine.count_tokens(text)

    async def embed(self, texts: Sequence[str]) -> TextEmbeddings:
        return await self.retriever.embed(texts)

    def prefix_cache_bytes(self) -> int | None:
        """What the transformers engine's prefix cache holds; None for an engine without one it
        measures (SGLang's lives in its own memory pool)."""
        cache = getattr(self.engine, "prefix_cache", None)
        return cache.bytes if cache is not None else None

    async def close(self) -> None:
        await self.engine.close()
        for close in self.closers:
            close()


class LoadObserver(Protocol):
    """What watches a load: each step as it begins, and the progress of its long tasks."""

    def loading(self, step: str) -> None: ...

    def report(self, progress: StepProgress) -> None: ...


class LogSteps:
    """A LoadObserver for commands that only log (the progress bars show on the terminal)."""

    def loading(self, step: str) -> None:
        log.info("start-up: %s", step)

    def report(self, progress: StepProgress) -> None:
        pass


def pipelining_config(experiments: ExperimentSettings) -> PipeliningConfig:
    """How the pipelines pipeline their retrievals, from `experiments.pipelining_*`."""
    return PipeliningConfig(
        launch_share=experiments.pipelining_launch_share,
        min_cosine=experiments.pipelining_min_cosine,
        check=experiments.pipelining_check,
    )


def build_engine(settings: Settings) -> Engine:
    """The configured engine: SGLang in this process on a GPU box, else transformers."""
    engine = settings.engine
    if engine.kind == "sglang":
        from telerag.engines.sglang import SGLangEngine

        if engine.model_path is None:
            raise EngineUnavailable("engine.kind=sglang needs engine.model_path (a local model directory)")
        return SGLangEngine(
            str(engine.model_path.expanduser()),
            mem_fraction_static=engine.mem_fraction_static,
            context_length=engine.context_length,
            tp_size=engine.tp_size,
            log_level=settings.server.log_level,
        )
    from telerag.engines.transformers.engine import TransformersEngine

    device = str(resolve_device(engine.device, error=EngineUnavailable))
    options: dict[str, Any] = {
        "dtype": engine.dtype,
        "prefix_cache_mb": engine.prefix_cache_mb,
        "document_kv_mb": engine.document_kv_mb,
        "split_documents": prompts.document_chunks,
    }
    if engine.model_path is None:
        return TransformersEngine.embedded_default(device=device, **options)
    return TransformersEngine.from_pretrained(engine.model_path, device=device, **options)


def load_embedder(retrieval: RetrievalSettings) -> Embedder:
    device = str(resolve_device(retrieval.embedder_device, error=EmbedderError))
    embedder = Embedder(retrieval.embedder, device=device) if retrieval.embedder else Embedder.embedded_default(device=device)
    log.info("embedder %s (%d-d) on %s", embedder.name, embedder.dim, device)
    return embedder


def load_reranker(retrieval: RetrievalSettings) -> Reranker | None:
    """The configured cross-encoder (`retrieval.reranker`), on the embedder's device; None without one."""
    if retrieval.reranker is None:
        return None
    device = str(resolve_device(retrieval.embedder_device, error=EmbedderError))
    reranker = CrossEncoderReranker(retrieval.reranker, device=device)
    log.info("re-ranker %s on %s", retrieval.reranker, device)
    return reranker


def cluster_cache_bytes(retrieval: RetrievalSettings, device: str) -> int:
    """The configured cache size; by default none on CPU (faiss alone is fastest there), on CUDA what the LLM
    left free less the headroom. From disk on the CPU: `retrieval.host_cache_mb` (on CUDA: `host_tier_bytes`)."""
    if retrieval.host_cache_mb is not None and torch.device(device).type == "cpu":
        return int(retrieval.host_cache_mb * 2**20)
    if retrieval.cache_mb is not None:
        return int(retrieval.cache_mb * 2**20)
    target = torch.device(device)
    if target.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(target)  # that device's (cuda:N), not the current one's
    return max(0, free - int(retrieval.cache_headroom_mb * 2**20))


def host_tier_bytes(retrieval: RetrievalSettings, device: str) -> int:
    """From disk onto a device, the host tier: `retrieval.host_cache_mb` (0 on the CPU, whose cache it is)."""
    return 0 if retrieval.host_cache_mb is None or torch.device(device).type == "cpu" else int(retrieval.host_cache_mb * 2**20)


def open_retrieval(settings: Settings) -> DirectRetriever:
    """The configured embedder and datastore behind a retriever, with no LLM (a benchmark of
    retrieval alone)."""
    embedder, early_stop = load_embedder(settings.retrieval), settings.experiments.early_stop
    datastore = load_configured_datastore(settings.retrieval, embedder, early_stop=early_stop)
    return open_configured_retriever(datastore, embedder, settings.retrieval, early_stop=early_stop)


def load_configured_datastore(
    retrieval: RetrievalSettings,
    embedder: Embedder,
    on_step: Callable[[str], None] = lambda step: None,
    *,
    ingest_now: bool = True,
    early_stop: bool = False,
) -> Datastore:
    """The configured datastore, as serve, ask and every benchmark open it
    (`pipelines.datastores.load_datastore`: ingested on the embedded default's first run, all of
    it unless not `ingest_now`; refused in one line if `embedder` did not build it); with
    `early_stop` (`experiments.early_stop`), with its list statistics."""
    return load_datastore(
        retrieval.datastore,
        embedder,
        build_if_missing=retrieval.build_if_missing,
        ingest_now=ingest_now,
        verify_checksums=retrieval.verify_checksums,
        early_stop=early_stop,
        on_step=on_step,
    )


def open_configured_retriever(
    datastore: Datastore,
    embedder: TextEncoder,
    retrieval: RetrievalSettings,
    *,
    cpu_half: Callable[[Datastore], ListSearch] | None = None,
    writable: bool = False,
    early_stop: bool = False,
) -> DirectRetriever:
    """The retrieval engine over a loaded datastore, as the settings configure it (device,
    cluster cache, prefetch budget, nprobe, demand copies, faiss threads; `early_stop`:
    `experiments.early_stop`); `cpu_half`:
    who scans what the device does not in a generation (default: faiss here; the retrieval tier's
    view of it on a Ray cluster);
    `writable`: documents may be written to it through this process (`retrieval.opening.open_live`)."""
    device = str(resolve_device(retrieval.device, error=DeviceUnavailable))
    return open_retriever(
        datastore,
        embedder,
        cpu_half=cpu_half,
        device=device,
        cache_bytes=cluster_cache_bytes(retrieval, device),
        prefetch_budget_bytes=None if retrieval.prefetch_budget_mb is None else int(retrieval.prefetch_budget_mb * 2**20),
        prefetch_reach=retrieval.prefetch_reach,
        nprobe=retrieval.fixed_nprobe,  # auto: chosen per search
        demand_copy=retrieval.demand_copy,
        cpu_threads=retrieval.cpu_threads,
        early_stop=early_stop,
        on_disk=retrieval.host_cache_mb is not None,
        host_cache_bytes=host_tier_bytes(retrieval, device),
        writable=writable,
        recall_budget=0.0
        if retrieval.host_cache_mb is not None
        else retrieval.recall_budget,  # on disk: an exhaustive read is the datastore
        target_recall=retrieval.target_recall,
    )


async def load_runtime(
    settings: Settings,
    observer: LoadObserver | None = None,
    *,
    cpu_half: Callable[[Datastore], ListSearch] | None = None,
    encoder: Callable[[Embedder], TextEncoder] = lambda embedder: embedder,
    writable: bool = False,
) -> Runtime:
    """Load what the server runs on, in the order that fails fast and sizes the cache right:
    the embedder (small), then the datastore, built on the embedded default's first run and
    checked (made by this embedder, at its dimension; manifest, file sizes, checksums), so a
    mismatch or damage is refused in seconds rather than after the LLM has loaded; then the
    engine; then the retrieval engine, whose cluster cache gets what GPU memory the LLM left.

    Each step runs in a worker thread and tells `observer`, so an event loop serving `/health`
    and `/ready` meanwhile keeps answering and can say what is loading and how far it is.

    An inference replica on a Ray cluster (`replicas.InferenceReplica`) gives the retrieval
    tier's view of a generation as `cpu_half`, and an `encoder` over the embedder that knows the vectors the ingress
    computed already. With `writable`, the runtime writes documents into its datastore (only one
    process can: the one that serves it alone), and an ingestion of it that has not ended (the
    embedded default's first run) is left to `Runtime.ingestion`, to go on with while it serves;
    without, it is taken to its end before the datastore is opened."""
    observer = observer or LogSteps()
    retrieval, early_stop = settings.retrieval, settings.experiments.early_stop
    with observe_progress(observer.report):
        observer.loading("loading embedder")
        embedder = await _in_thread(load_embedder, retrieval)
        reranker = await _in_thread(load_reranker, retrieval)
        load = functools.partial(load_configured_datastore, ingest_now=not writable, early_stop=early_stop)
        datastore = await _in_thread(load, retrieval, embedder, observer.loading)
        try:
            observer.loading("loading model")
            engine = await _in_thread(build_engine, settings)
        except BaseException:
            datastore.close()
            raise
        log.info("engine %s (%s)", getattr(engine, "name", "?"), settings.engine.kind)
        try:
            observer.loading("opening datastore")
            retriever = await _in_thread(
                functools.partial(open_configured_retriever, cpu_half=cpu_half, writable=writable, early_stop=early_stop),
                datastore,
                encoder(embedder),
                retrieval,
            )
        except BaseException:
            await engine.close()
            datastore.close()
            raise
    documents, rebuilds = datastore_writes(retriever.live, retriever.embed_passages, settings)
    ingestion = resumed_ingestion(documents, retrain=lambda nlist: rebuilds.run(RebuildKind.RETRAIN, nlist=nlist))
    runtime = Runtime(
        settings=settings,
        engine=engine,
        retriever=retriever,
        datastore_info=retriever.datastore_info(),
        cache_stats=retriever.cache_stats,
        search_recall=retriever.search_recall,
        reranker=reranker,
        resident_clusters=retriever.resident_clusters,
        closers=[*([ingestion.stop] if ingestion else []), documents.close, rebuilds.join, retriever.close],
        documents=documents,
        rebuilds=rebuilds,
        ingestion=ingestion,
        store_resources=StoreResources.of(retriever),
    )
    rebuilds.on_done = lambda _: setattr(runtime, "datastore_info", retriever.datastore_info())  # a retrain's nlist
    return runtime


def datastore_writes(
    live: LiveDatastore, embed_passages: Callable[[Sequence[str]], np.ndarray], settings: Settings
) -> tuple[DocumentWriter, Rebuilds]:
    """What writes documents into `live` (their passages embedded by `embed_passages`) and the
    compactions and retrains its writes begin, as the settings configure them."""
    rebuilds = Rebuilds(live, compact_share=settings.documents.compact_share)
    writer = DocumentWriter(
        live, embed_passages, max_queued=settings.documents.max_queued_writes, on_written=rebuilds.after_writes
    )
    return writer, rebuilds


@asynccontextmanager
async def open_runtime(
    settings: Settings, observer: LoadObserver | None = None, *, writable: bool = False
) -> AsyncIterator[Runtime]:
    """`load_runtime`, closed (engine, retrieval engine, datastore) on exit."""
    runtime = await load_runtime(settings, observer, writable=writable)
    try:
        yield runtime
    finally:
        await runtime.close()


async def _in_thread(call: Callable[[], T] | Callable[..., T], *args: Any) -> T:
    """`call(*args)` in a daemon thread with a copy of this context (so the progress observer
    sees its bars): the event loop keeps serving meanwhile, and a load abandoned when the
    process is told to stop does not keep it alive."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = context.run(call, *args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="telerag-load", daemon=True).start()
    return await future
