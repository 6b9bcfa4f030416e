"""The retrieval engine: lookahead prefetch into the device cluster cache, and exact GPU/CPU
cooperative IVF search (TeleRAG chapter 4; the steps after the probe: `retrieval.cooperative`).

On CUDA its device work (query copies, centroid products, scans, merges) runs on a stream of its
own, created with high priority, never on the default stream: kernels other threads of the
process queue there (the transformers engine's decode steps) would otherwise run first. The
cache's copies have a stream of their own too; a search's stream waits on exactly the copies it
reads (events), and a search reads its answer to the host only after its own stream's work.

The module is long because the engine is the one owner of what a search reads on the device (the
index, the host copy, the cache, the streams): prefetch, search and their resources belong together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import faiss
import numpy as np
import torch

from telerag.retrieval.cache import CacheBuffer, ClusterCache, RowSource, TensorRows
from telerag.retrieval.cooperative import CooperativeSearch, QueryStats, SearchResources
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.demand import DemandCopyPolicy
from telerag.retrieval.disk import DiskListSearch
from telerag.retrieval.early_stop import EarlyStopSearch, ListBounds
from telerag.retrieval.errors import DeviceMemoryError, DeviceUnavailable, InvalidCall
from telerag.retrieval.file_reads import FileRows
from telerag.retrieval.host_tier import HostTierRows, host_cache_on
from telerag.retrieval.ivf import CPUIndex, ListSearch
from telerag.retrieval.prefetch import PrefetchHandle, PrefetchPlan, plan_prefetch
from telerag.retrieval.provisional import UNWATCHED, SearchWatch
from telerag.retrieval.search import faiss_part, merge_to_host
from telerag.retrieval.stats import CacheStats, PrefetchStats
from telerag.utils.device import resolve_device
from telerag.utils.progress import ProgressBar

PROBE_TIE_MARGIN = 1e-5  # relative centroid-score gap below which the device defers to faiss
STREAM_PRIORITY = -1  # CUDA: lower is sooner; the search stream's blocks go before the default stream's
# How far down q_in's ranking a prefetch from disk reads, in multiples of nprobe: HyDE at TeleRAG's shape
# lands 0.90 of its search's lists ahead from 1.25 nprobe, 0.93 from 1.5 and 0.96 from 1.85 (its budget's
# reach), and on a CPU box the reads share the cores and memory with the LLM, whose call 2.2-3.8 GB read
# beside it slowed by 0.1-0.8 s (docs/benchmarks.md)
DISK_PREFETCH_REACH = 1.5

P = ParamSpec("P")
R = TypeVar("R")


def default_nprobe(nlist: int) -> int:
    """4·sqrt(nlist), the paper's setting (256 for 4096 lists)."""
    return max(1, min(nlist, round(4 * math.sqrt(nlist))))


def _on_stream(method: Callable[Concatenate[RetrievalEngine, P], R]) -> Callable[Concatenate[RetrievalEngine, P], R]:
    """`method` run with its engine's stream current (see `RetrievalEngine.on_stream`)."""

    @functools.wraps(method)
    def run(engine: RetrievalEngine, *args: P.args, **kwargs: P.kwargs) -> R:
        with engine.on_stream():
            return method(engine, *args, **kwargs)

    return run


@dataclass
class SearchResult:
    scores: np.ndarray  # float32 (n, k)
    ids: np.ndarray  # int64 (n, k); -1 where fewer than k candidates exist
    per_query: list[QueryStats]
    probe_ms: float
    device_ms: float
    cpu_ms: float
    total_ms: float
    copy_wait_ms: float = 0.0  # how long the device scan waited for copies still in flight
    missed_bytes: int = 0  # with a cache: bytes of the probed lists not resident, once per query probing them


class RetrievalEngine:
    """Owns the faiss index (CPU half), the host copy of the vectors, and the device cluster cache."""

    files: FileRows | None = None  # from disk: the datastore's file, read
    host_cache: ClusterCache | None = None  # from disk: the host tier under the cache, if any

    def __init__(
        self,
        datastore: Datastore,
        *,
        device: str | torch.device = "cpu",
        cache_bytes: int = 0,
        cache_buffer: CacheBuffer | None = None,
        nprobe: int | None = None,
        cpu_workers: int = 2,
        cpu_threads: int | None = None,
        demand_copy: bool | None = None,
        cpu_half: ListSearch | None = None,
        early_stop: bool = False,
        on_disk: bool = False,
        host_cache_bytes: int = 0,
        host_cache_buffer: CacheBuffer | None = None,
        prefetch_reach: float | None = None,
        progress: bool = False,
    ) -> None:
        """`cpu_threads`: faiss threads of the CPU half of a cooperative search (None: every
        core on a CPU box; one fewer on CUDA, leaving a core to the thread that drives the
        device while faiss's workers spin). `demand_copy`: copy part of each search's missed
        clusters to the device instead of leaving them all to faiss (None: on with CUDA).
        `cpu_half`: who scans the lists the device does not (default: faiss here, over the host
        copy; the retrieval tier, `server.ray_serve.tier`, where the datastore's shards are remote).
        `early_stop`: faiss's half scans its lists with exact early stop (`experiments.early_stop`;
        refused for a datastore without list statistics; from disk, a list it rules out is not
        read); a tier's shards are told when deployed.
        `cache_buffer`: the device buffer of another engine's cluster cache, to share (its lists and
        this one's weighed on one clock; `cache_bytes` must then be 0); None: one of `cache_bytes`.
        `on_disk`: the vectors are read from the datastore's file, never through its memory map
        (`retrieval.disk`: a datastore larger than memory): the cluster cache, in host memory
        (`cache_bytes`), is filled by reads, and the lists it does not hold are read and scanned per
        search; a missed list is read into the cache or scanned where it is read, as the measured
        rates balance the two. `host_cache_bytes` (or `host_cache_buffer`, another engine's): from disk, a
        host tier under the cache (`retrieval.host_tier`; always on CUDA), where the CPU half scans what it holds.
        `prefetch_reach`: a prefetch reads no list that
        q_in ranks past this many times nprobe (None: `DISK_PREFETCH_REACH` from disk, else as far
        as its budget goes: a copy to the device takes nothing from the call it overlaps)."""
        self.datastore = datastore
        self.device = resolve_device(device, error=DeviceUnavailable)
        self.nlist = datastore.nlist
        self.nprobe = nprobe or default_nprobe(self.nlist)
        self.stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            # Exact fp32 scores: TF32 would change the answers.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            self.stream = torch.cuda.Stream(self.device, priority=STREAM_PRIORITY)
        self.host_vectors = self._host_tensor(progress)
        self.index = CPUIndex(datastore, vectors=self.host_vectors.numpy())  # faiss reads the same memory
        self.rows: RowSource = TensorRows(self.host_vectors)
        self.on_disk = on_disk
        self.prefetch_reach = prefetch_reach if prefetch_reach is not None else DISK_PREFETCH_REACH if on_disk else math.inf
        self.cpu_half: ListSearch = self.index if cpu_half is None else cpu_half
        if on_disk:
            self.rows = self._disk_tiers(cpu_half, host_cache_bytes, host_cache_buffer)
        if early_stop and cpu_half is None:  # from disk, the lists it rules out are never read
            self.cpu_half = EarlyStopSearch(self.cpu_half, ListBounds.of(datastore))
        with self.on_stream():  # the device tensors searches read belong to the search stream
            self.cache = self._cache_on(cache_buffer, cache_bytes)
            self.centroids = torch.from_numpy(np.ascontiguousarray(datastore.centroids)).to(self.device)
            self.codec_params = (
                None if datastore.codec_params is None else torch.from_numpy(datastore.codec_params).to(self.device)
            )
            self.row_ids = None if datastore.ids is None else torch.from_numpy(np.array(datastore.ids)).to(self.device)
        if cpu_threads is None and self.device.type == "cuda":
            cpu_threads = max(1, faiss.omp_get_max_threads() - 1)
        self._cpu_pool = ThreadPoolExecutor(
            max_workers=cpu_workers,
            thread_name_prefix="faiss-search",
            # OpenMP's thread count is per calling thread: this bounds only the CPU half
            initializer=functools.partial(faiss.omp_set_num_threads, cpu_threads) if cpu_threads else None,
        )
        # B of TeleRAG §4.2: the copy rate prefetch budgets are computed from (from disk: its read rate;
        # through a host tier, the slower of its reads and the copies from it to the device)
        rates = [cache.measure_copy_rate() for cache in (self.host_cache, self.cache) if cache is not None]
        self.copy_bytes_per_ms = min((rate for rate in rates if rate), default=None)
        self.demand = self._demand_policy(True if on_disk else demand_copy)

    def _disk_tiers(self, cpu_half: ListSearch | None, host_cache_bytes: int, host_cache_buffer: CacheBuffer | None) -> RowSource:
        """The rows of a datastore read from disk as the cache's source: the file's, or a host
        tier's over them; the CPU half becomes the datastore's own reads (beside the host tier's lists)."""
        if cpu_half is not None:
            raise InvalidCall("a datastore read from disk is searched by its own reads, not by a given CPU half")
        self.files = FileRows(self.datastore)  # faiss's lists still view the memory map, which nothing scans now
        rows: RowSource = self.files
        if self.device.type != "cpu" or host_cache_bytes or host_cache_buffer is not None:  # 0 bytes: every copy staged
            self.host_cache = host_cache_on(self.files, self.datastore.offsets, host_cache_buffer, host_cache_bytes, self.device)
            rows = HostTierRows(self.host_cache, self.files)
        self.cpu_half = DiskListSearch(self.datastore, self.files, host_cache=self.host_cache)
        return rows

    def _cache_on(self, shared: CacheBuffer | None, cache_bytes: int) -> ClusterCache:
        """This datastore's cluster cache: on `shared`, or on a buffer of `cache_bytes` of its own."""
        source = self.rows
        if shared is None:
            shared = CacheBuffer.for_vectors(source, cache_bytes, self.device)
            return ClusterCache(source, self.datastore.offsets, shared)
        if cache_bytes:
            raise InvalidCall("a shared cluster cache buffer has its own size: cache_bytes must be 0")
        if shared.device != self.device or not shared.holds(source):
            raise InvalidCall(
                f"a cluster cache buffer of ({shared.dim},) {shared.dtype} rows on {shared.device} cannot hold "
                f"{self.datastore.where}'s ({self.datastore.dim},) {self.host_vectors.dtype} rows on {self.device}"
            )
        return ClusterCache(source, self.datastore.offsets, shared)

    def on_stream(self) -> contextlib.AbstractContextManager[Any]:
        """This engine's stream as the calling thread's current one (CUDA; nothing on the CPU):
        kernels launched inside queue on it, and tensors made inside belong to it."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _host_tensor(self, progress: bool) -> torch.Tensor:
        """The vectors as a tensor: the datastore's own memory on CPU, or on CUDA where it is
        pinned already (a datastore made in memory); else a pinned copy, so that every cluster
        copy is a true asynchronous DMA."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the memory map is read-only; we never write it
            mapped = torch.from_numpy(self.datastore.vectors)
        if self.device.type != "cuda" or mapped.is_pinned():
            return mapped
        pinned = torch.empty(mapped.shape, dtype=mapped.dtype, pin_memory=True)
        step = max(1, (256 << 20) // max(1, mapped.shape[1] * mapped.element_size()))
        for start in ProgressBar(range(0, len(mapped), step), desc="pin host vectors", unit="chunk", disable=not progress):
            pinned[start : start + step].copy_(mapped[start : start + step])
        return pinned

    def _demand_policy(self, demand_copy: bool | None) -> DemandCopyPolicy | None:
        """With a cache, the policy that measures the rates and decides copy or scan (missed
        clusters: only with `demand_copy`, by default on CUDA) and wait or scan (queued copies; from disk a
        search waits: its reads go first, and faiss would read the same lists again)."""
        if not self.cache.capacity_rows:
            return None
        copy_missed = self.device.type == "cuda" if demand_copy is None else demand_copy
        return DemandCopyPolicy(self.copy_bytes_per_ms, copy_missed=copy_missed, hand_late=not self.on_disk)

    def check_cache_fits(self, cache_bytes: int, *, headroom_bytes: int = 0) -> None:
        """Refuse (`DeviceMemoryError`) a cluster cache of `cache_bytes` in place of this one that
        the device could not hold beside what else is on it now, with `headroom_bytes` left free
        (CUDA only: a CPU "device" is host memory, which the operating system manages)."""
        if self.device.type != "cuda":
            return
        free, _ = torch.cuda.mem_get_info(self.device)
        idle = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)  # torch's, reusable
        own = self.cache.capacity_bytes if self.cache.shared.caches == [self.cache] else 0  # a shared buffer stays
        available = free + idle + own - headroom_bytes
        if cache_bytes > available:
            raise DeviceMemoryError(
                f"a cluster cache of {cache_bytes / 2**30:.1f} GiB does not fit on {self.device}: "
                f"{max(0, available) / 2**30:.1f} GiB can be had beside what it holds now"
                + (f", leaving {headroom_bytes / 2**30:.1f} GiB free" if headroom_bytes else "")
            )

    def resize_cache(self, cache_bytes: int, *, demand_copy: bool | None = None) -> None:
        """Replace the cluster cache with an empty one of `cache_bytes`, on a buffer of its own
        (nothing may be pinned, and the device must hold it: `check_cache_fits`); `demand_copy`
        as in the constructor."""
        if self.cache.pinned_clusters():
            raise InvalidCall("cannot resize the cluster cache while clusters are pinned")
        self.check_cache_fits(cache_bytes)
        with self.on_stream():
            self.cache.close()
            self.cache = self._cache_on(None, 0)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.cache = self._cache_on(None, cache_bytes)
        self.copy_bytes_per_ms = self.cache.measure_copy_rate() or self.copy_bytes_per_ms
        self.demand = self._demand_policy(demand_copy)

    def cache_stats(self) -> CacheStats:
        """The cluster cache's counters, with what searches read from disk beside it and the host tier's (on disk)."""
        stats = self.cache.stats()
        if self.files is not None:
            stats = dataclasses.replace(stats, bytes_read_for_scans=self.files.bytes_read_for_scans)
        if self.host_cache is not None:
            host = self.host_cache.stats()
            stats = dataclasses.replace(
                stats,
                host_capacity_bytes=host.capacity_bytes,
                host_occupancy_bytes=host.occupancy_bytes,
                host_bytes_read=host.bytes_copied,
                host_hits=host.hits,
            )
        return stats

    def close(self) -> None:
        """Its lists leave the cluster caches (each once unpinned) and its CPU workers (and readers) end."""
        self.cache.close()
        self._cpu_pool.shutdown(wait=True)
        if self.files is not None:
            self.files.close()  # the reads queued land first, then the copies to the device after them
        if isinstance(self.rows, HostTierRows):
            self.rows.close()

    # -- prefetch -------------------------------------------------------------------------------

    @_on_stream
    def rank_clusters(self, queries: np.ndarray) -> np.ndarray:
        """Every query's clusters, nearest centroid first: scored on the GPU when there is one,
        else by faiss (whose thread pool is the only one a CPU search then wakes)."""
        if self.device.type != "cuda":
            return self.index.probe(np.ascontiguousarray(queries, dtype=np.float32), self.nlist)[1]
        q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32)).to(self.device)
        return torch.argsort(q @ self.centroids.T, dim=1, descending=True).cpu().numpy()

    def prefetch(self, q_in: np.ndarray, budget_bytes: int) -> PrefetchHandle:
        """Plan q_in's clusters within `budget_bytes` and start copying the missing ones; returns
        as soon as the copies are issued."""
        return self.prefetch_batch([q_in], [budget_bytes])[0]

    def prefetch_batch(self, groups: Sequence[np.ndarray], budgets: Sequence[int]) -> list[PrefetchHandle]:
        """One ranking call and one plan for every group's q_in, then one lease per group.

        The copy stream is one queue shared by every request, so the batch copies what can land
        within the largest of its budgets after the bytes already queued ahead of it. The plan
        interleaves the ranks of all the batch's queries (a cluster several of them want comes
        first; clusters already resident cost nothing and are pinned), and each group pins the
        planned clusters its own queries ranked, so no group is left out."""
        started = time.perf_counter()
        sizes = [len(g) for g in groups]
        active = [g for g, (size, budget) in enumerate(zip(sizes, budgets, strict=True)) if size and budget > 0]
        handles = [self._empty_handle(size) for size in sizes]
        if not active or not self.cache.capacity_rows:
            return handles
        queries = self.index.check(np.concatenate([np.asarray(groups[g], dtype=np.float32) for g in active]), 1, 1)
        ranked = self.rank_clusters(queries)
        resident = self.cache.resident_mask()
        queued = self.cache.queued_bytes()
        budget = max(0, min(max(int(budgets[g]) for g in active) - queued, self.cache.capacity_bytes))
        cluster_bytes = self.cache.cluster_bytes()
        plan = plan_prefetch(
            ranked, cluster_bytes, budget, resident=resident, depth=self.nprobe, reach=self.prefetch_reach * self.nprobe
        )
        plan_ms = (time.perf_counter() - started) * 1e3
        offset = 0
        for g in active:
            per_query = plan.per_query[offset : offset + sizes[g]]
            offset += sizes[g]
            mine = frozenset().union(*per_query)
            clusters = [c for c in plan.clusters if c in mine]
            lease = self.cache.acquire(clusters, fetch=True, ahead=True) if clusters else None
            to_copy = int(cluster_bytes[[c for c in clusters if not resident[c]]].sum())
            handles[g] = PrefetchHandle(
                plan=PrefetchPlan(clusters, per_query, to_copy),
                lease=lease,
                stats=PrefetchStats(
                    clusters_requested=len(clusters),
                    bytes_requested=to_copy,
                    clusters_resident=lease.clusters_already_resident if lease else 0,
                    clusters_copied=lease.clusters_copied if lease else 0,
                    clusters_skipped=lease.clusters_skipped if lease else 0,
                    bytes_copied=lease.bytes_copied if lease else 0,
                    copies=lease.copies if lease else 0,
                    bytes_queued_ahead=queued,
                    plan_ms=plan_ms,
                ),
            )
        return handles

    def _empty_handle(self, n: int) -> PrefetchHandle:
        return PrefetchHandle(plan=PrefetchPlan([], [frozenset()] * n, 0), lease=None)

    # -- search -----------------------------------------------------------------------------------

    @_on_stream
    def search(
        self,
        q_out: np.ndarray,
        k: int,
        nprobe: int | None = None,
        *,
        prefetch: PrefetchHandle | Sequence[PrefetchHandle | None] | None = None,
        use_cache: bool = True,
        watch: SearchWatch = UNWATCHED,
    ) -> SearchResult:
        """Exact IVF search at `nprobe`: resident clusters of each query's C_out on the device,
        then those copied on demand (see `retrieval.demand`), the rest by faiss on the CPU at the
        same time, merged on the device. The search uses whatever is resident and waits only on
        the copies of the clusters it reads, and only where that is sooner than faiss scanning
        them: a cluster whose copy is still queued goes to faiss when the measured rates say
        faiss would finish first.

        `prefetch` (one handle for all queries, or one per query) gives the overlap statistics,
        and the search ends it: once the search has pinned the clusters it reads, the prefetch's
        others are no longer held, so this search's demand copies, and other requests, may
        evict them. (Releasing a handle again is harmless.)

        `watch` is what the search shows before it ends: with a `ProvisionalWatch`, faiss's half
        scans its lists chunk by chunk in centroid order and the top-k so far is reported after
        each chunk but the last (`retrieval.provisional`); the answer is the same."""
        started = time.perf_counter()
        nprobe = nprobe or self.nprobe
        queries = self.index.check(q_out, k, nprobe)
        handles = self._handles_per_query(prefetch, len(queries))
        cached = bool(use_cache and self.cache.capacity_rows)
        if not cached and not any(h is not None and h.plan.clusters for h in handles):
            return self._faiss_search(queries, k, nprobe, started, watch)  # nothing on the device, no overlap
        q = torch.from_numpy(queries).to(self.device, non_blocking=True)  # once, for probe and scan
        list_scores, lists = self.probe(queries, q, nprobe)
        probe_ms = (time.perf_counter() - started) * 1e3
        halves = watch.halves(self.cpu_half, k, int((lists >= 0).sum()), merge_to_host)
        search = CooperativeSearch(self._search_resources(halves.cpu_half), queries, q, k, lists, list_scores, halves.device_done)
        try:
            if cached:
                search.pin_resident()
            _end_prefetches(handles)  # from here the search's own lease pins what it reads
            search.choose_demand_copies()
            search.scan()
            scores, ids = search.merge()
        finally:
            search.release()
        search.observe_demand_copies()
        return SearchResult(
            scores=scores,
            ids=ids,
            per_query=search.query_stats(handles),
            probe_ms=probe_ms,
            device_ms=search.device_ms,
            cpu_ms=search.cpu_ms,
            total_ms=(time.perf_counter() - started) * 1e3,
            copy_wait_ms=search.wait_ms,
            missed_bytes=search.missed_bytes,
        )

    def _faiss_search(self, queries: np.ndarray, k: int, nprobe: int, started: float, watch: SearchWatch) -> SearchResult:
        """faiss's search, as is, or probed here and scanned by the CPU half that stands in for
        it or watches it (`started`: when the search began)."""
        cpu_started = time.perf_counter()
        found = watch.faiss_search(self.index, self.cpu_half, queries, k, nprobe, merge_to_host)
        scores, ids = merge_to_host([faiss_part(found, "cpu")], k)
        cpu_ms = (time.perf_counter() - cpu_started) * 1e3
        return SearchResult(
            scores=scores,
            ids=ids,
            per_query=[QueryStats(None, 0, nprobe) for _ in range(len(queries))],
            probe_ms=0.0,
            device_ms=0.0,
            cpu_ms=cpu_ms,
            total_ms=(time.perf_counter() - started) * 1e3,
        )

    def _search_resources(self, cpu_half: ListSearch) -> SearchResources:
        """What a search starting now runs on (the cache and policy may be replaced later), its
        CPU half as the search watches it."""
        return SearchResources(
            cpu_half=cpu_half,
            cpu_pool=self._cpu_pool,
            cache=self.cache,
            policy=self.demand,
            device=self.device,
            stream=self.stream,
            codec=self.datastore.codec,
            codec_params=self.codec_params,
            row_ids=self.row_ids,
        )

    def probe(self, queries: np.ndarray, q: torch.Tensor, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        """C_out of each query (`queries` on the host, `q` the same on the device): the same
        `nprobe` lists faiss's quantizer picks.

        On CUDA the centroid scores come from one exact fp32 product on the device; a query whose
        nprobe-th and next score are too close to call (so that summation order could flip them)
        is probed by faiss instead, so the set of lists is always faiss's own.
        """
        if self.device.type != "cuda" or nprobe >= self.nlist:
            return self.index.probe(queries, nprobe)
        top = torch.topk(q @ self.centroids.T, nprobe + 1, dim=1)
        scores, lists = top.values.cpu().numpy(), top.indices.cpu().numpy()
        gap = scores[:, nprobe - 1] - scores[:, nprobe]
        unclear = gap <= PROBE_TIE_MARGIN * np.maximum(1.0, np.abs(scores[:, nprobe - 1]))
        scores, lists = np.ascontiguousarray(scores[:, :nprobe]), np.ascontiguousarray(lists[:, :nprobe])
        if unclear.any():
            scores[unclear], lists[unclear] = self.index.probe(queries[unclear], nprobe)
        return scores, lists

    @staticmethod
    def _handles_per_query(
        prefetch: PrefetchHandle | Sequence[PrefetchHandle | None] | None, n: int
    ) -> list[PrefetchHandle | None]:
        if prefetch is None or isinstance(prefetch, PrefetchHandle):
            return [prefetch] * n
        handles = list(prefetch)
        if len(handles) != n:
            raise InvalidCall(f"{len(handles)} prefetch handles for {n} queries")
        return handles


def _end_prefetches(handles: Sequence[PrefetchHandle | None]) -> None:
    """Release each distinct prefetch of a search (the search now pins what it reads)."""
    for handle in {id(h): h for h in handles if h is not None}.values():
        handle.release()
