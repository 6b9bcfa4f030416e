"""What a server runs on: the engine, the retriever, and what it reports; built from settings."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from telerag.pipelines.errors import EngineUnavailable
from telerag.pipelines.rag.base import RagPipeline
from telerag.pipelines.registry import build_pipelines
from telerag.pipelines.types import BatchRetriever, Engine, Retriever
from telerag.server.settings import RetrievalSettings, Settings, pre_retrieval_profile

if TYPE_CHECKING:
    from telerag.pipelines.retriever import DirectRetriever

log = logging.getLogger(__name__)
T = TypeVar("T")


def run_event_loop(main: Coroutine[Any, Any, T], settings: Settings) -> T:
    """Run the server's event loop: uvloop when installed (uvicorn's own choice), asyncio
    otherwise; with the GIL switch interval the settings ask for."""
    sys.setswitchinterval(settings.server.switch_interval_ms / 1e3)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


@dataclass
class Runtime:
    settings: Settings
    engine: Engine
    retriever: BatchRetriever
    datastore_info: dict[str, Any] = field(default_factory=dict)
    cache_stats: Callable[[], dict[str, Any]] = dict
    ready: bool = True
    closers: list[Callable[[], Any]] = field(default_factory=list)

    def pipelines(self, retriever: Retriever, names: Sequence[str] | None = None) -> dict[str, RagPipeline]:
        """The pipelines over this engine and `retriever`, each starting from its expected
        pre-retrieval time in `config/prefetch_profiles.yaml`."""
        return build_pipelines(self.engine, retriever, names=names, pre_retrieval_ms=pre_retrieval_profile())

    async def close(self) -> None:
        await self.engine.close()
        for close in self.closers:
            close()


def _device(name: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name



def build_engine(settings: Settings) -> Engine:
    """The configured engine: SGLang in this process on a GPU box, else transformers."""
    engine = settings.engine
    if engine.kind == "sglang":
        from telerag.pipelines.engines.sglang import SGLangEngine

        if engine.model_path is None:
            raise EngineUnavailable("engine.kind=sglang needs engine.model_path (a local model directory)")
        return SGLangEngine(
            str(engine.model_path.expanduser()),
            mem_fraction_static=engine.mem_fraction_static,
            context_length=engine.context_length,
            tp_size=engine.tp_size,
        )
    from telerag.pipelines.engines.cpu import CPUEngine

    device = _device(engine.device)
    if engine.model_path is None:
        return CPUEngine.embedded_default(device=device)
    return CPUEngine.from_pretrained(engine.model_path, device=device)


def cluster_cache_bytes(retrieval: RetrievalSettings, device: str) -> int:
    """The configured cache size; by default none on CPU (faiss alone is fastest there) and on
    CUDA the memory still free (call it after the LLM has taken its share) less the headroom."""
    if retrieval.cache_mb is not None:
        return int(retrieval.cache_mb * 2**20)
    if device != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info()
    return max(0, free - int(retrieval.cache_headroom_mb * 2**20))


def open_retrieval(settings: Settings) -> DirectRetriever:
    """The configured embedder and datastore (building the Wikipedia one on first run) behind a
    retriever; on CUDA call it after the engine has taken its share of the GPU."""
    from telerag.pipelines.embedder import Embedder
    from telerag.pipelines.retriever import open_retriever

    retrieval = settings.retrieval
    device = _device(retrieval.device)
    embedder_device = _device(retrieval.embedder_device)
    embedder = Embedder(retrieval.embedder, device=embedder_device) if retrieval.embedder else Embedder.embedded_default(device=embedder_device)
    log.info("embedder %s (%d-d) on %s", embedder.name, embedder.dim, embedder_device)
    return open_retriever(
        retrieval.datastore,
        embedder,
        device=device,
        cache_bytes=cluster_cache_bytes(retrieval, device),
        prefetch_budget_bytes=None if retrieval.prefetch_budget_mb is None else int(retrieval.prefetch_budget_mb * 2**20),
        nprobe=retrieval.nprobe,
        demand_copy=retrieval.demand_copy,
        cpu_threads=retrieval.cpu_threads,
        build_if_missing=retrieval.build_if_missing,
        verify_checksums=retrieval.verify_checksums,
    )


@asynccontextmanager
async def open_runtime(settings: Settings) -> AsyncIterator[Runtime]:
    """Load the engine, then the embedder and the datastore (building the Wikipedia one on first
    run): the engine first, so that the cluster cache gets what the LLM leaves of the GPU."""
    engine = build_engine(settings)
    log.info("engine %s (%s)", getattr(engine, "name", "?"), settings.engine.kind)
    try:
        retriever = open_retrieval(settings)
    except BaseException:
        await engine.close()
        raise
    try:
        runtime = Runtime(
            settings=settings,
            engine=engine,
            retriever=retriever,
            datastore_info=retriever.datastore_info(),
            cache_stats=retriever.cache_stats,
            closers=[retriever.close],
        )
        yield runtime
    finally:
        retriever.close()
