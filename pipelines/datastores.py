"""Opening the datastore the pipelines search, and the retriever over it: the built-in Wikipedia
one ingested on the embedded default's first run (`ingestion`: it embeds), then opened as
retrieval opens any (`retrieval.opening`: checked against the embedder that will search it, and
live, every write since it was built replayed, writable by the one process that holds it)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

from telerag.documents.ingestion import corpus_documents, finish_ingestion, ingestion_pending, write_seed
from telerag.pipelines.retriever import DirectRetriever
from telerag.pipelines.text_encoder import TextEncoder
from telerag.retrieval.cache import CacheBuffer
from telerag.retrieval.corpus import WIKIPEDIA_SOURCE, read_wikipedia
from telerag.retrieval.datastore import MANIFEST, Datastore
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.ivf import ListSearch
from telerag.retrieval.opening import open_datastore, open_live

log = logging.getLogger(__name__)


def seed_wikipedia_datastore(path: Path, embedder: TextEncoder) -> Path:
    """The seed of the built-in Wikipedia datastore at `path` (first run of the embedded default;
    the rest of it follows, `ingestion`): only into a new or empty directory, never over a user's files."""
    log.info("ingesting the Wikipedia datastore at %s (first run; kept afterwards): a sample first", path)
    return write_seed(path, corpus_documents(read_wikipedia()), embedder.encode, embedder=embedder.name, source=WIKIPEDIA_SOURCE)


def load_datastore(
    path: Path,
    embedder: TextEncoder,
    *,
    build_if_missing: bool = False,
    ingest_now: bool = True,
    verify_checksums: bool = True,
    early_stop: bool = False,
    on_step: Callable[[str], None] = lambda step: None,
) -> Datastore:
    """The one way a datastore is opened for searching with `embedder`: the built-in Wikipedia
    one is begun at `path` first if there is none there and `build_if_missing` (its seed); with
    `ingest_now`, an ingestion that has not ended is taken to its end here (a server passes False:
    it writes the rest in the background, `ingestion.Ingestion`); then the datastore is opened
    (`retrieval.opening.open_datastore`: refused if `embedder` did not build it, its files checked;
    with `early_stop`, refused without list statistics, or given them where `build_if_missing`
    makes the built-in Wikipedia one the server's own). `on_step` hears each step begin."""
    path = Path(path).expanduser()
    if build_if_missing and not (path / MANIFEST).is_file():
        on_step("embedding a first sample of the datastore (first run)")
        seed_wikipedia_datastore(path, embedder)
    if ingest_now and (path / MANIFEST).is_file() and ingestion_pending(path):
        on_step("ingesting the rest of the datastore")
        finish_ingestion(path, embedder.encode)
    return open_datastore(
        path,
        embedder=embedder.name,
        dim=embedder.dim,
        verify_checksums=verify_checksums,
        early_stop=early_stop,
        own_wikipedia=build_if_missing,
        on_step=on_step,
    )


def open_retriever(
    datastore: Path | Datastore,
    embedder: TextEncoder,
    *,
    device: str = "auto",
    cache_bytes: int = 0,
    cache_buffer: CacheBuffer | None = None,
    prefetch_budget_bytes: int | None = None,
    prefetch_reach: float | None = None,
    nprobe: int | None = None,
    demand_copy: bool | None = None,
    cpu_threads: int | None = None,
    cpu_half: Callable[[Datastore], ListSearch] | None = None,
    early_stop: bool = False,
    on_disk: bool = False,
    host_cache_bytes: int = 0,
    build_if_missing: bool = False,
    verify_checksums: bool = True,
    writable: bool = False,
    recall_budget: float = 0.0,
    target_recall: float = 0.99,
) -> DirectRetriever:
    """Start the retrieval engine over `datastore`, checked to match `embedder`: a loaded one, or
    the directory to load (`load_datastore`); `cpu_half(generation)` the `RetrievalEngine`'s of each
    generation of it (None: faiss here; the retrieval tier's view of that generation), `cache_buffer`
    (another engine's cluster cache buffer to share, in place of one of `cache_bytes`) as its; `on_disk`: its
    vectors read from its files, `cache_bytes` of them cached in host memory (with `host_cache_bytes`, on the
    device, through a host tier of that size: `RetrievalEngine`); `prefetch_reach`: how far down
    q_in's ranking a prefetch reads (`RetrievalEngine`). With `writable`,
    documents can be written to it through the retriever (`retrieval.opening.open_live`). `recall_budget`
    and `target_recall`: `DirectRetriever`'s."""
    if not isinstance(datastore, Datastore):
        datastore = load_datastore(
            datastore, embedder, build_if_missing=build_if_missing, verify_checksums=verify_checksums, early_stop=early_stop
        )
    else:
        datastore.manifest.check_embedder(datastore.where, embedder=embedder.name, dim=embedder.dim)

    def new_engine(datastore: Datastore, previous: RetrievalEngine | None) -> RetrievalEngine:
        host_tier = None if previous is None else previous.host_cache
        return RetrievalEngine(
            datastore,
            device=device,
            cache_bytes=cache_bytes if previous is None and cache_buffer is None else 0,
            cache_buffer=cache_buffer if previous is None else previous.cache.shared,
            host_cache_bytes=host_cache_bytes if previous is None else 0,
            host_cache_buffer=None if host_tier is None else host_tier.shared,
            nprobe=nprobe,
            demand_copy=demand_copy,
            cpu_threads=cpu_threads,
            cpu_half=None if cpu_half is None else cpu_half(datastore),
            early_stop=early_stop,
            on_disk=on_disk,
            prefetch_reach=prefetch_reach,
            progress=True,
        )

    engine = new_engine(datastore, None)
    _log_opened(engine, on_disk=on_disk, early_stop=early_stop, prefetch_budget_bytes=prefetch_budget_bytes)
    try:
        live = open_live(datastore, writable=writable)
    except BaseException:
        engine.close()
        raise
    return DirectRetriever(
        engine,
        embedder,
        live=live,
        new_engine=new_engine,
        prefetch_budget_bytes=prefetch_budget_bytes,
        recall_budget=recall_budget,
        target_recall=target_recall,
    )


def _log_opened(engine: RetrievalEngine, *, on_disk: bool, early_stop: bool, prefetch_budget_bytes: int | None) -> None:
    """What the retrieval engine opened: the datastore, where its vectors and cache are, the prefetch budget."""
    datastore = engine.datastore
    log.info(
        "datastore %s: %d passages, %d lists, dim %d, embedder %s; vectors %s; device %s, cluster cache %.1f MB, "
        "demand copies %s, early stop %s",
        datastore.where,
        datastore.n_vectors,
        datastore.nlist,
        datastore.dim,
        datastore.manifest.embedder,
        "read from disk" if on_disk else "memory-mapped",
        engine.device,
        engine.cache.capacity_bytes / 2**20,
        "on" if engine.demand is not None and engine.demand.copy_missed else "off",
        "on" if early_stop else "off",
    )
    if not engine.cache.capacity_rows:
        log.info("prefetch off: no cluster cache")
    elif prefetch_budget_bytes is not None:
        log.info("prefetch budget %.1f MB per request (fixed)", min(prefetch_budget_bytes, engine.cache.capacity_bytes) / 2**20)
    else:
        log.info("prefetch budget B·t_LLM per pipeline, B = %.1f GB/s measured now", (engine.copy_bytes_per_ms or 0) / 1e6)
    if engine.cache.capacity_rows and math.isfinite(engine.prefetch_reach):
        reach = math.ceil(engine.prefetch_reach * engine.nprobe)
        log.info("prefetch reach %.4g x nprobe: q_in's nearest %d lists at most", engine.prefetch_reach, reach)
