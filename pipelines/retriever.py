"""The retriever the pipelines use: embed text, prefetch q_in's clusters, search q_out.

`DirectRetriever` implements `BatchRetriever`: many callers' prefetches become one embedding
call and one ranking call, many callers' searches one embedding call and one cooperative
search per distinct (top_k, nprobe, prefetch) setting. The server's scheduler gathers the
callers; the CLI and the tests call it directly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from telerag.pipelines.speculation import StableTopK
from telerag.pipelines.stats import PrefetchStepStats, SearchStats
from telerag.pipelines.types import (
    DatastoreInfo,
    Document,
    OnProvisional,
    PrefetchRequest,
    PrefetchTicket,
    ProvisionalDocuments,
    SearchOptions,
    SearchOutcome,
    SearchQuery,
    SearchRequest,
    TextEmbeddings,
    query_texts,
    query_vectors,
)
from telerag.retrieval.builder import build_datastore
from telerag.retrieval.corpus import WIKIPEDIA_SOURCE, PassageShape, read_wikipedia
from telerag.retrieval.datastore import LIST_STATS, MANIFEST, Datastore, Manifest
from telerag.retrieval.datastore_writer import add_list_stats
from telerag.retrieval.early_stop import require_list_stats
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.ivf import ListSearch
from telerag.retrieval.provisional import Provisional, ProvisionalReport
from telerag.retrieval.stats import CacheStats

log = logging.getLogger(__name__)


class TextEncoder(Protocol):
    """What the retriever needs of an embedder (`pipelines.embedder.Embedder` is one)."""

    name: str
    dim: int

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...

    def count_tokens(self, texts: Sequence[str]) -> int: ...


class DirectRetriever:
    """Embedder + retrieval engine + passages, behind the pipelines' Retriever protocol."""

    def __init__(self, engine: RetrievalEngine, embedder: TextEncoder, *, prefetch_budget_bytes: int | None = None) -> None:
        """`prefetch_budget_bytes`: the same budget for every prefetch; None: b_p = B · t (TeleRAG
        §4.2) for each prefetch's own `overlap_ms` t, B being the cache's measured copy rate."""
        self.engine = engine
        self.embedder = embedder
        self.datastore = engine.datastore
        self.prefetch_budget_bytes = prefetch_budget_bytes

    def budget_bytes(self, overlap_ms: float | None) -> int:
        """What one prefetch may copy, never more than the cache: the fixed budget if there is
        one, else what copies in `overlap_ms` (without an estimate, the whole cache)."""
        capacity = self.engine.cache.capacity_bytes
        if self.prefetch_budget_bytes is not None:
            return min(self.prefetch_budget_bytes, capacity)
        if overlap_ms is None:
            return capacity
        return min(int((self.engine.copy_bytes_per_ms or 0.0) * max(overlap_ms, 0.0)), capacity)

    # -- the Retriever protocol -------------------------------------------------------------------

    async def prefetch(self, queries: Sequence[str], *, enabled: bool = True, overlap_ms: float | None = None) -> PrefetchTicket:
        return (await self.prefetch_batch([PrefetchRequest(list(queries), enabled, overlap_ms)]))[0]

    async def search(
        self,
        queries: Sequence[SearchQuery],
        options: SearchOptions,
        ticket: PrefetchTicket | None = None,
        *,
        provisional: OnProvisional | None = None,
    ) -> SearchOutcome:
        return (await self.search_batch([SearchRequest(list(queries), options, ticket, provisional)]))[0]

    def release(self, ticket: PrefetchTicket) -> None:
        if ticket.handle is not None:
            ticket.handle.release()

    # -- the BatchRetriever protocol --------------------------------------------------------------

    async def prefetch_batch(self, requests: Sequence[PrefetchRequest]) -> list[PrefetchTicket]:
        return await asyncio.to_thread(self._prefetch_batch, list(requests))

    async def search_batch(self, requests: Sequence[SearchRequest]) -> list[SearchOutcome]:
        loop = asyncio.get_running_loop()
        return await asyncio.to_thread(self._search_batch, [_on_loop(request, loop) for request in requests])

    async def embed(self, texts: Sequence[str]) -> TextEmbeddings:
        def work() -> TextEmbeddings:
            vectors, _ = self._embed(list(texts))
            return TextEmbeddings(vectors, self.embedder.count_tokens(texts))

        return await asyncio.to_thread(work)

    # -- work, in a worker thread -----------------------------------------------------------------

    def _embed(self, texts: list[str]) -> tuple[np.ndarray, float]:
        """Embedded on retrieval's stream (CUDA): a query's embedding is the first step of its
        search or prefetch, and must not queue behind generation kernels either."""
        started = time.perf_counter()
        with self.engine.on_stream():
            vectors = np.asarray(self.embedder.encode(texts), dtype=np.float32).reshape(len(texts), -1)
        return vectors, (time.perf_counter() - started) * 1e3

    def _prefetch_batch(self, requests: list[PrefetchRequest]) -> list[PrefetchTicket]:
        budgets = [self.budget_bytes(r.overlap_ms) if r.enabled else 0 for r in requests]
        active = [i for i, r in enumerate(requests) if budgets[i] > 0 and r.queries]
        tickets = [PrefetchTicket(queries=list(r.queries)) for r in requests]
        if not active:
            # nothing could be copied (no budget or no cache): do not even embed q_in
            return tickets
        vectors, embed_ms = self._embed([text for i in active for text in requests[i].queries])
        splits = np.cumsum([len(requests[i].queries) for i in active])[:-1]
        handles = self.engine.prefetch_batch(np.split(vectors, splits), [budgets[i] for i in active])
        for i, handle in zip(active, handles, strict=True):
            tickets[i].handle = handle
            tickets[i].stats = PrefetchStepStats(enabled=True, embed_ms=embed_ms, batch=len(active), plan=handle.stats)
        return tickets

    def _embed_queries(self, queries: list[SearchQuery]) -> tuple[np.ndarray, float]:
        """One vector per query, all texts embedded in one call; a MeanQuery's is the mean of
        its texts' vectors."""
        vectors, embed_ms = self._embed([text for query in queries for text in query_texts(query)])
        return query_vectors(queries, vectors), embed_ms

    def _search_batch(self, requests: list[SearchRequest]) -> list[SearchOutcome]:
        queries = [query for request in requests for query in request.queries]
        if not queries:
            return [SearchOutcome(documents=[]) for _ in requests]
        vectors, embed_ms = self._embed_queries(queries)
        starts = np.concatenate(([0], np.cumsum([len(r.queries) for r in requests])))
        outcomes: list[SearchOutcome | None] = [None] * len(requests)
        by_setting: dict[tuple[int, int, bool], list[int]] = {}
        for index, request in enumerate(requests):
            nprobe = request.options.nprobe or self.engine.nprobe
            by_setting.setdefault((request.options.top_k, nprobe, request.options.prefetch), []).append(index)
        for (top_k, nprobe, use_cache), members in by_setting.items():
            rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in members])
            handles = [
                ticket.handle if (ticket := requests[i].ticket) is not None else None
                for i in members
                for _ in requests[i].queries
            ]
            provisional = self._provisional([requests[i] for i in members])
            result = self.engine.search(
                vectors[rows], top_k, nprobe, prefetch=handles, use_cache=use_cache, provisional=provisional
            )
            offset = 0
            for i in members:
                count = len(requests[i].queries)
                per_query = result.per_query[offset : offset + count]
                overlaps = [s.overlap_rate for s in per_query if s.overlap_rate is not None]
                outcomes[i] = SearchOutcome(
                    documents=[self._documents(result.ids[j], result.scores[j]) for j in range(offset, offset + count)],
                    stats=SearchStats(
                        embed_ms=embed_ms,
                        probe_ms=result.probe_ms,
                        device_ms=result.device_ms,
                        cpu_ms=result.cpu_ms,
                        total_ms=result.total_ms,
                        overlap_rate=float(np.mean(overlaps)) if overlaps else None,
                        clusters_device=sum(s.clusters_device for s in per_query),
                        clusters_cpu=sum(s.clusters_cpu for s in per_query),
                        clusters_copied_on_demand=sum(s.clusters_copied_on_demand for s in per_query),
                        clusters_late=sum(s.clusters_late for s in per_query),
                        copy_wait_ms=result.copy_wait_ms,
                        nprobe=nprobe,
                        batch=len(rows),
                    ),
                )
                offset += count
        return [outcome for outcome in outcomes if outcome is not None]

    def _provisional(self, requests: list[SearchRequest]) -> ProvisionalReport | None:
        """The report of one engine search's provisional top-k, split into its requests' rows: each
        request that asked hears its first stable top-k (`speculation.StableTopK`) as documents."""
        wanting = [(i, r.provisional) for i, r in enumerate(requests) if r.provisional is not None]
        if not wanting:
            return None
        starts = np.concatenate(([0], np.cumsum([len(r.queries) for r in requests])))
        rules = {i: StableTopK() for i, _ in wanting}

        def report(found: Provisional) -> None:
            for i, hear in wanting:
                rows = slice(starts[i], starts[i + 1])
                if rules[i].offer(found.ids[rows]):
                    pairs = zip(found.ids[rows], found.scores[rows], strict=True)
                    hear(ProvisionalDocuments([self._documents(ids, scores) for ids, scores in pairs], found.lists_share))

        return report

    def _documents(self, ids: np.ndarray, scores: np.ndarray) -> list[Document]:
        keep = [(int(i), float(s)) for i, s in zip(ids, scores, strict=True) if i >= 0]
        passages = self.datastore.passages([i for i, _ in keep])
        return [
            Document(id=i, doc_id=p.doc_id, title=p.title, text=p.text, score=s) for (i, s), p in zip(keep, passages, strict=True)
        ]

    # -- introspection for the server -------------------------------------------------------------

    def cache_stats(self) -> CacheStats:
        return self.engine.cache.stats()

    def resident_clusters(self) -> list[int]:
        """The clusters the cache holds now (landed or in flight)."""
        return np.flatnonzero(self.engine.cache.resident_mask()).tolist()

    def datastore_info(self) -> DatastoreInfo:
        manifest = self.datastore.manifest
        return DatastoreInfo(
            passages=manifest.n_vectors,
            documents=manifest.n_documents,
            passage_words=manifest.passage_words,
            nlist=manifest.nlist,
            dim=manifest.dim,
            embedder=manifest.embedder,
            codec=manifest.codec,
            nprobe=self.engine.nprobe,
            device=str(self.engine.device),
            cache_bytes=self.engine.cache.capacity_bytes,
            prefetch_budget_bytes=self.prefetch_budget_bytes,
            copy_gbps=self.engine.copy_bytes_per_ms / 1e6 if self.engine.copy_bytes_per_ms else None,
        )

    def close(self) -> None:
        self.engine.close()
        self.datastore.close()


def _on_loop(request: SearchRequest, loop: asyncio.AbstractEventLoop) -> SearchRequest:
    """`request` with its provisional callback run on `loop` (the search runs in a worker thread)."""
    hear = request.provisional
    if hear is None:
        return request

    def on_loop(found: ProvisionalDocuments) -> None:
        loop.call_soon_threadsafe(hear, found)

    return dataclasses.replace(request, provisional=on_loop)


def build_wikipedia_datastore(path: Path, embedder: TextEncoder) -> Path:
    """The built-in Wikipedia datastore at `path` (first run of the embedded default): only into
    a new or empty directory, never over a user's files."""
    log.info("building the Wikipedia datastore at %s (first run; cached afterwards)", path)
    shape = PassageShape()
    return build_datastore(
        shape.split(read_wikipedia()),
        embedder.encode,
        embedder=embedder.name,
        out_dir=path,
        source=WIKIPEDIA_SOURCE,
        shape=shape,
    )


def load_datastore(
    path: Path,
    embedder: TextEncoder,
    *,
    build_if_missing: bool = False,
    verify_checksums: bool = True,
    early_stop: bool = False,
    on_step: Callable[[str], None] = lambda step: None,
) -> Datastore:
    """The one way a datastore is opened for searching with `embedder`: the built-in Wikipedia
    one is built at `path` first if there is none there and `build_if_missing`; then it is
    loaded, refused (`DatastoreMismatchError`) if it was built with another embedder or holds
    vectors of another dimension, and its files checked. `on_step` hears each step begin.

    With `early_stop`, a datastore without the list statistics early stop needs (written
    before they were stored) is refused in one line naming `telerag datastore upgrade`; except
    the built-in Wikipedia one where `build_if_missing` makes it the server's own (a cache the
    embedded default built on an older telerag): that one is upgraded here, saying so, as the
    server would have built it here (`add_list_stats`: one new file, nothing else changed)."""
    path = Path(path).expanduser()
    if build_if_missing and not (path / MANIFEST).is_file():
        on_step("building datastore (first run)")
        build_wikipedia_datastore(path, embedder)
    if early_stop and build_if_missing:
        manifest = Manifest.read(path)
        if LIST_STATS not in manifest.files and manifest.source == WIKIPEDIA_SOURCE:
            on_step("adding list statistics to the datastore (upgrade)")
            log.info(
                "upgrading the Wikipedia datastore at %s, built by an older telerag: adding the list statistics that "
                "retrieval.early_stop needs (list_stats.npy; as `telerag datastore upgrade %s` does)",
                path,
                path,
            )
            add_list_stats(path, verify_checksums=verify_checksums, progress=True)
    on_step("checking datastore")
    datastore = Datastore.load(path, embedder=embedder.name, dim=embedder.dim, verify_checksums=verify_checksums, progress=True)
    if early_stop:
        require_list_stats(datastore)
    return datastore


def open_retriever(
    datastore: Path | Datastore,
    embedder: TextEncoder,
    *,
    device: str = "auto",
    cache_bytes: int = 0,
    prefetch_budget_bytes: int | None = None,
    nprobe: int | None = None,
    demand_copy: bool | None = None,
    cpu_threads: int | None = None,
    cpu_half: ListSearch | None = None,
    early_stop: bool = False,
    build_if_missing: bool = False,
    verify_checksums: bool = True,
) -> DirectRetriever:
    """Start the retrieval engine over `datastore`, checked to match `embedder`: a loaded one, or
    the directory to load (`load_datastore`); `cpu_half` as `RetrievalEngine`'s."""
    if not isinstance(datastore, Datastore):
        datastore = load_datastore(
            datastore, embedder, build_if_missing=build_if_missing, verify_checksums=verify_checksums, early_stop=early_stop
        )
    else:
        datastore.manifest.check_embedder(datastore.where, embedder=embedder.name, dim=embedder.dim)
    engine = RetrievalEngine(
        datastore,
        device=device,
        cache_bytes=cache_bytes,
        nprobe=nprobe,
        demand_copy=demand_copy,
        cpu_threads=cpu_threads,
        cpu_half=cpu_half,
        early_stop=early_stop,
        progress=True,
    )
    log.info(
        "datastore %s: %d passages, %d lists, dim %d, embedder %s; device %s, cluster cache %.1f MB, demand copies %s, "
        "early stop %s",
        datastore.where,
        datastore.n_vectors,
        datastore.nlist,
        datastore.dim,
        datastore.manifest.embedder,
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
    return DirectRetriever(engine, embedder, prefetch_budget_bytes=prefetch_budget_bytes)
