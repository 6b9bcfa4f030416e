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
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from telerag.pipelines.embedding_priority import EmbeddingPriority
from telerag.pipelines.speculation import StableTopK
from telerag.pipelines.stats import PrefetchStepStats, mean_overlap, search_step_stats
from telerag.pipelines.text_encoder import TextEncoder, embedded
from telerag.pipelines.types import (
    DatastoreInfo,
    PrefetchRequest,
    PrefetchTicket,
    ProvisionalDocuments,
    RetrievedPassage,
    SearchOptions,
    SearchOutcome,
    SearchQuery,
    SearchRequest,
    TextEmbeddings,
    query_texts,
    query_vectors,
)
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.engine import RetrievalEngine, SearchResult
from telerag.retrieval.errors import InvalidCall
from telerag.retrieval.live import LiveDatastore
from telerag.retrieval.prefetch import PrefetchHandle
from telerag.retrieval.provisional import UNWATCHED, Provisional, ProvisionalWatch, SearchWatch
from telerag.retrieval.ranking import Ranking, RankTrace
from telerag.retrieval.recall import RecallEstimate, RecallSampler
from telerag.retrieval.snapshot import Snapshot, search_snapshot
from telerag.retrieval.stats import CacheStats

log = logging.getLogger(__name__)

WRITE_EMBED_CHUNK = 1  # passages a write embeds at a time: a query that comes meanwhile waits for one layer of one
# passage's embedding at most. 1 ingested as fast as 16 (bench ingest, 12.7 passages/s each)


class DirectRetriever:
    """Embedder + retrieval engine + the live datastore, behind the pipelines' Retriever protocol."""

    def __init__(
        self,
        engine: RetrievalEngine,
        embedder: TextEncoder,
        *,
        live: LiveDatastore | None = None,
        new_engine: Callable[[Datastore, RetrievalEngine], RetrievalEngine] | None = None,
        prefetch_budget_bytes: int | None = None,
        recall_budget: float = 0.0,
        target_recall: float = 0.99,
    ) -> None:
        """`live`: the engine's datastore with its writes (default: opened read-only here).
        `new_engine(datastore, previous)`: an engine like `engine` over a new generation of it (a
        compaction's or a retrain's), sharing `previous`'s cache buffers (None: a new generation is
        refused). `prefetch_budget_bytes`: the same budget for every prefetch; None: b_p = B · t
        (TeleRAG §4.2) for each prefetch's own `overlap_ms` t, B being the cache's measured copy
        rate. `recall_budget`: the share of the search time spent repeating sampled searches
        exhaustively to estimate their recall (`retrieval.recall`; 0: none), logged below `target_recall`."""
        self.retrieval_engine = engine
        self.embedder = embedder
        self.live = live if live is not None else LiveDatastore(engine.datastore)
        self.prefetch_budget_bytes = prefetch_budget_bytes
        self.priority = EmbeddingPriority()
        self._new_engine = new_engine
        self._engines = {engine.datastore.generation.number: engine}  # the current one, and the one before it
        self._engines_lock = threading.Lock()
        self.recall = RecallSampler(
            Path(self.live.where).name or self.live.where,
            budget=recall_budget,
            target=target_recall,
            idle=self.priority.write_turn,
            current=lambda snapshot: snapshot.generation == self.live.generation,
        )

    @property
    def datastore(self) -> Datastore:
        return self.retrieval_engine.datastore

    def retrieval_engine_for(self, datastore: Datastore) -> RetrievalEngine:
        """The engine over `datastore`, a generation of the live datastore: the current one, the
        one before it (a request that began before a switch still reads it), or a new one once the
        live datastore has switched. Two engines at most: an older one is closed. A new engine's
        cluster cache shares the current one's buffer: the older generation's lists cool as
        requests leave it and are evicted first, and leave it when its engine is closed."""
        number = datastore.generation.number
        with self._engines_lock:
            engine = self._engines.get(number)
            if engine is None:
                if self._new_engine is None:
                    raise InvalidCall(f"{datastore.where}: a new generation ({number}), and no way to open an engine on it")
                engine = self._new_engine(datastore, self.retrieval_engine)
                self._engines[number] = engine
                if number > self.retrieval_engine.datastore.generation.number:
                    self.retrieval_engine = engine
                for older in [n for n in self._engines if n < number - 1]:
                    self._engines.pop(older).close()
            return engine

    def budget_bytes(self, overlap_ms: float | None) -> int:
        """What one prefetch may copy, never more than the cache: the fixed budget if there is
        one, else what copies in `overlap_ms` (without an estimate, the whole cache)."""
        capacity = self.retrieval_engine.cache.capacity_bytes
        if self.prefetch_budget_bytes is not None:
            return min(self.prefetch_budget_bytes, capacity)
        if overlap_ms is None:
            return capacity
        return min(int((self.retrieval_engine.copy_bytes_per_ms or 0.0) * max(overlap_ms, 0.0)), capacity)

    # -- the Retriever protocol -------------------------------------------------------------------

    async def prefetch(self, queries: Sequence[str], *, enabled: bool = True, overlap_ms: float | None = None) -> PrefetchTicket:
        return (await self.prefetch_batch([PrefetchRequest(list(queries), enabled, overlap_ms)]))[0]

    async def search(
        self,
        queries: Sequence[SearchQuery],
        options: SearchOptions,
        ticket: PrefetchTicket | None = None,
    ) -> SearchOutcome:
        return (await self.search_batch([SearchRequest(list(queries), options, ticket)]))[0]

    def release(self, ticket: PrefetchTicket) -> None:
        if ticket.handle is not None:
            ticket.handle.release()

    def snapshot(self) -> Snapshot:
        return self.live.snapshot()

    # -- the BatchRetriever protocol --------------------------------------------------------------

    async def prefetch_batch(self, requests: Sequence[PrefetchRequest]) -> list[PrefetchTicket]:
        return await asyncio.to_thread(self._prefetch_batch, list(requests))

    async def search_batch(self, requests: Sequence[SearchRequest]) -> list[SearchOutcome]:
        return await asyncio.to_thread(self._search_batch, list(requests))

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
        with self.priority.query(), self.retrieval_engine.on_stream():
            vectors = embedded(self.embedder, texts)
        return vectors, (time.perf_counter() - started) * 1e3

    def embed_passages(self, texts: Sequence[str]) -> np.ndarray:
        """Passages a write adds, embedded below queries' priority (`EmbeddingPriority`), a chunk
        at a time, each pausing before every layer of the model while a query is served; float32
        (len(texts), dim). In a worker thread: it waits."""
        chunks = []
        for start in range(0, len(texts), WRITE_EMBED_CHUNK):
            chunk = list(texts[start : start + WRITE_EMBED_CHUNK])
            with self.retrieval_engine.on_stream():
                chunks.append(embedded(self.embedder, chunk, pause=self.priority.write_turn))
        return np.concatenate(chunks).reshape(len(texts), -1) if chunks else np.zeros((0, self.embedder.dim), np.float32)

    def _prefetch_batch(self, requests: list[PrefetchRequest]) -> list[PrefetchTicket]:
        budgets = [self.budget_bytes(r.overlap_ms) if r.enabled else 0 for r in requests]
        active = [i for i, r in enumerate(requests) if budgets[i] > 0 and r.queries]
        tickets = [PrefetchTicket(queries=list(r.queries)) for r in requests]
        if not active:
            # nothing could be copied (no budget or no cache): do not even embed q_in
            return tickets
        vectors, embed_ms = self._embed([text for i in active for text in requests[i].queries])
        splits = np.cumsum([len(requests[i].queries) for i in active])[:-1]
        engine = self.retrieval_engine_for(self.live.datastore)
        handles = engine.prefetch_batch(np.split(vectors, splits), [budgets[i] for i in active])
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
        """The searches, a write's embedding paused meanwhile: on a CPU the scan shares the cores
        with it as the queries' embedding does."""
        with self.priority.query():
            return self._search_now(requests)

    def _search_now(self, requests: list[SearchRequest]) -> list[SearchOutcome]:
        queries = [query for request in requests for query in request.queries]
        if not queries:
            return [SearchOutcome(documents=[]) for _ in requests]
        if any(request.options.ranking.uses_vectors for request in requests):
            vectors, embed_ms = self._embed_queries(queries)
        else:  # by words alone: nothing to embed
            vectors, embed_ms = np.zeros((len(queries), self.embedder.dim), np.float32), 0.0
        return self.search_embedded(requests, vectors, embed_ms)

    def search_embedded(self, requests: list[SearchRequest], vectors: np.ndarray, embed_ms: float) -> list[SearchOutcome]:
        """The searches of `requests` given their queries' vectors (one row per query, in order;
        zeros for a ranking by words alone), one engine search per setting and snapshot. The caller
        holds the queries' priority (a vector store's searches, `file_search.store_searcher`, embed
        their whole batch once, for every store)."""
        queries = [query for request in requests for query in request.queries]
        starts = np.concatenate(([0], np.cumsum([len(r.queries) for r in requests])))
        outcomes: list[SearchOutcome | None] = [None] * len(requests)
        latest = self.live.snapshot()  # for the callers that name none: every write acknowledged before this batch
        by_setting: dict[tuple[int, int | None, bool, Snapshot, Ranking], list[int]] = {}
        for index, request in enumerate(requests):
            o = request.options
            by_setting.setdefault((o.top_k, o.nprobe, o.prefetch, o.snapshot or latest, o.ranking), []).append(index)
        for (top_k, asked_nprobe, use_cache, snapshot, ranking), members in by_setting.items():
            rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in members])
            handles = [
                ticket.handle if (ticket := requests[i].ticket) is not None else None
                for i in members
                for _ in requests[i].queries
            ]
            watch = self._watch([requests[i] for i in members], snapshot)
            engine = self.retrieval_engine_for(snapshot.datastore)
            # the default of the snapshot's generation (a retrain's nlist may differ); more lists than it has are all of
            # them, as faiss's own IndexIVF.search takes them
            nprobe = min(asked_nprobe or engine.nprobe, engine.nlist)
            handles = [_of_engine(handle, engine) for handle in handles]
            dense = _GroupSearch(engine, snapshot, vectors[rows], nprobe, handles, use_cache, watch, self.recall)
            started = time.perf_counter()
            texts = [" ".join(query_texts(queries[row])) for row in rows]
            trace = RankTrace()
            scores, ids = ranking.rank(snapshot, texts, top_k, dense, trace)
            ranked_ms = (time.perf_counter() - started) * 1e3
            stats = search_step_stats(dense.found, ranked_ms, embed_ms, nprobe, len(rows), trace.rerank_ms)
            offset = 0
            for i in members:
                count = len(requests[i].queries)
                outcomes[i] = SearchOutcome(
                    documents=[self._documents(snapshot, ids[j], scores[j]) for j in range(offset, offset + count)],
                    stats=dataclasses.replace(stats, overlap_rate=mean_overlap(dense.found, offset, count)),
                )
                offset += count
        return [outcome for outcome in outcomes if outcome is not None]

    def _watch(self, requests: list[SearchRequest], snapshot: Snapshot) -> SearchWatch:
        """What one engine search of `requests` shows before it ends: nothing when none of them has
        an observer; else its provisional top-k, split into the requests' rows, each request with
        an observer hearing its first stable top-k (`speculation.StableTopK`) as documents."""
        watching = [(i, o) for i, r in enumerate(requests) if (o := r.options.observer) is not None]
        if not watching:
            return UNWATCHED
        starts = np.concatenate(([0], np.cumsum([len(r.queries) for r in requests])))
        rules = {i: StableTopK() for i, _ in watching}

        def report(found: Provisional) -> None:
            for i, observer in watching:
                rows = slice(starts[i], starts[i + 1])
                if rules[i].offer(found.ids[rows]):
                    pairs = zip(found.ids[rows], found.scores[rows], strict=True)
                    documents = [self._documents(snapshot, ids, scores) for ids, scores in pairs]
                    observer.provisional(ProvisionalDocuments(documents, found.lists_share))

        return ProvisionalWatch(report)

    def _documents(self, snapshot: Snapshot, ids: np.ndarray, scores: np.ndarray) -> list[RetrievedPassage]:
        keep = [(int(i), float(s)) for i, s in zip(ids, scores, strict=True) if i >= 0]
        passages = snapshot.passages_of([i for i, _ in keep])
        return [
            RetrievedPassage(id=i, doc_id=p.doc_id, title=p.title, text=p.text, score=s)
            for (i, s), p in zip(keep, passages, strict=True)
        ]

    # -- introspection for the server -------------------------------------------------------------

    def cache_stats(self) -> CacheStats:
        return self.retrieval_engine.cache_stats()

    def search_recall(self) -> RecallEstimate:
        return self.recall.estimate()

    def resident_clusters(self) -> list[int]:
        """The clusters the cache holds now (landed or in flight)."""
        return np.flatnonzero(self.retrieval_engine.cache.resident_mask()).tolist()

    def datastore_info(self) -> DatastoreInfo:
        """The datastore's current generation and its engine (opened here, if the live datastore
        has switched to a new generation since the last search)."""
        snapshot = self.live.snapshot()
        engine = self.retrieval_engine_for(snapshot.datastore)
        manifest = engine.datastore.manifest
        return DatastoreInfo(
            passages=snapshot.passages,
            documents=snapshot.documents,
            passage_words=manifest.passage_words,
            nlist=manifest.nlist,
            dim=manifest.dim,
            embedder=manifest.embedder,
            codec=manifest.codec,
            nprobe=engine.nprobe,
            device=str(engine.device),
            cache_bytes=engine.cache.capacity_bytes,
            prefetch_budget_bytes=self.prefetch_budget_bytes,
            copy_gbps=engine.copy_bytes_per_ms / 1e6 if engine.copy_bytes_per_ms else None,
            vectors="read from disk" if engine.on_disk else "memory-mapped",
            prefetch_reach=engine.prefetch_reach if math.isfinite(engine.prefetch_reach) else None,
        )

    def close(self) -> None:
        self.recall.close()
        for engine in self._engines.values():
            engine.close()
        self.live.close()
        self.datastore.close()


@dataclass
class _GroupSearch:
    """The dense search of one group of a batch's searches, as its ranking calls it (`DenseSearch`);
    what it found is kept for the step's stats."""

    engine: RetrievalEngine
    snapshot: Snapshot
    vectors: np.ndarray
    nprobe: int
    handles: list[PrefetchHandle | None]
    use_cache: bool
    watch: SearchWatch  # of the final search; the ranking's deeper ones are unwatched
    recall: RecallSampler
    found: SearchResult | None = None

    def __call__(self, depth: int, final: bool) -> tuple[np.ndarray, np.ndarray]:
        started = time.perf_counter()
        self.found = search_snapshot(
            self.engine,
            self.snapshot,
            self.vectors,
            depth,
            self.nprobe,
            prefetch=self.handles,
            use_cache=self.use_cache,
            watch=self.watch if final else UNWATCHED,
        )
        found = self.found
        self.recall.offer(self.engine, self.snapshot, self.vectors, depth, found.ids, found.scores, time.perf_counter() - started)
        return found.scores, found.ids


def _of_engine(handle: PrefetchHandle | None, engine: RetrievalEngine) -> PrefetchHandle | None:
    """A prefetch the search on `engine` can use: one made by it (a request that began before a
    switch to a new generation prefetched on the engine before); another's is ended here."""
    if handle is None or handle.lease is None or handle.lease.cache is engine.cache:
        return handle
    handle.release()
    return None
