"""The retrieval engine: lookahead prefetch into the device cluster cache, and exact
GPU/CPU cooperative IVF search (TeleRAG chapter 4).

On CUDA its device work (query copies, centroid products, scans, merges) runs on a stream of its
own, created with high priority, never on the default stream: kernels other threads of the
process queue there (the transformers engine's decode steps) would otherwise run first. The
cache's copies have a stream of their own too; a search's stream waits on exactly the copies it
reads (events), and a search reads its answer to the host only after its own stream's work.
"""

from __future__ import annotations

import contextlib
import functools
import logging
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

from telerag.retrieval.cache import ClusterCache, Lease
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.demand import DemandCopyPolicy
from telerag.retrieval.device import resolve_device
from telerag.retrieval.errors import SearchError
from telerag.retrieval.ivf import CPUIndex
from telerag.retrieval.prefetch import PrefetchHandle, PrefetchPlan, PrefetchStats, plan_prefetch
from telerag.retrieval.progress import ProgressBar
from telerag.retrieval.search import merge_topk, scan_resident

log = logging.getLogger(__name__)

PROBE_TIE_MARGIN = 1e-5  # relative centroid-score gap below which the device defers to faiss
STREAM_PRIORITY = -1  # CUDA: lower is sooner; the search stream's blocks go before the default stream's

P = ParamSpec("P")
R = TypeVar("R")


def default_nprobe(nlist: int) -> int:
    """4·sqrt(nlist), the paper's setting (256 for 4096 lists)."""
    return max(1, min(nlist, int(round(4 * math.sqrt(nlist)))))


def _on_stream(method: Callable[Concatenate[RetrievalEngine, P], R]) -> Callable[Concatenate[RetrievalEngine, P], R]:
    """`method` run with its engine's stream current (see `RetrievalEngine.on_stream`)."""

    @functools.wraps(method)
    def run(engine: RetrievalEngine, *args: P.args, **kwargs: P.kwargs) -> R:
        with engine.on_stream():
            return method(engine, *args, **kwargs)

    return run


@dataclass
class QueryStats:
    overlap_rate: float | None  # |C_in ∩ C_out| / |C_out| (TeleRAG Eq. 3.1); None without a prefetch
    clusters_device: int  # of C_out, scanned on the device (those copied on demand included)
    clusters_cpu: int
    clusters_copied_on_demand: int = 0
    clusters_late: int = 0  # of those on the CPU: resident, but faiss would finish before their copies land


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

    def __init__(
        self,
        datastore: Datastore,
        *,
        device: str | torch.device = "cpu",
        cache_bytes: int = 0,
        nprobe: int | None = None,
        cpu_workers: int = 2,
        cpu_threads: int | None = None,
        demand_copy: bool | None = None,
        progress: bool = False,
    ) -> None:
        """`cpu_threads`: faiss threads of the CPU half of a cooperative search (None: every
        core on a CPU box; one fewer on CUDA, leaving a core to the thread that drives the
        device while faiss's workers spin). `demand_copy`: copy part of each search's missed
        clusters to the device instead of leaving them all to faiss (None: on with CUDA)."""
        self.datastore = datastore
        self.device = resolve_device(device)
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
        with self.on_stream():  # the device tensors searches read belong to the search stream
            self.cache = ClusterCache(self.host_vectors, datastore.offsets, cache_bytes, self.device)
            self.centroids = torch.from_numpy(np.ascontiguousarray(datastore.centroids)).to(self.device)
            self.codec_params = None if datastore.codec_params is None else torch.from_numpy(datastore.codec_params).to(self.device)
        if cpu_threads is None and self.device.type == "cuda":
            cpu_threads = max(1, faiss.omp_get_max_threads() - 1)
        self._cpu_pool = ThreadPoolExecutor(
            max_workers=cpu_workers,
            thread_name_prefix="faiss-search",
            # OpenMP's thread count is per calling thread: this bounds only the CPU half
            initializer=faiss.omp_set_num_threads if cpu_threads else None,
            initargs=(cpu_threads,) if cpu_threads else (),
        )
        # B of TeleRAG §4.2: the copy rate prefetch budgets are computed from
        self.copy_bytes_per_ms = self.cache.measure_copy_rate()
        self.demand = self._demand_policy(demand_copy)

    def on_stream(self) -> contextlib.AbstractContextManager[Any]:
        """This engine's stream as the calling thread's current one (CUDA; nothing on the CPU):
        kernels launched inside queue on it, and tensors made inside belong to it."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _host_tensor(self, progress: bool) -> torch.Tensor:
        """The vectors as a tensor: the memory map itself on CPU; a pinned copy on CUDA, so that
        every cluster copy is a true asynchronous DMA."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the memory map is read-only; we never write it
            mapped = torch.from_numpy(self.datastore.vectors)
        if self.device.type != "cuda":
            return mapped
        pinned = torch.empty(mapped.shape, dtype=mapped.dtype, pin_memory=True)
        step = max(1, (256 << 20) // max(1, mapped.shape[1] * mapped.element_size()))
        for start in ProgressBar(range(0, len(mapped), step), desc="pin host vectors", unit="chunk", disable=not progress):
            pinned[start : start + step].copy_(mapped[start : start + step])
        return pinned

    def _demand_policy(self, demand_copy: bool | None) -> DemandCopyPolicy | None:
        """With a cache, the policy that measures the rates and decides copy or scan (missed
        clusters: only with `demand_copy`, by default on CUDA) and wait or scan (queued copies)."""
        if not self.cache.capacity_rows:
            return None
        copy_missed = self.device.type == "cuda" if demand_copy is None else demand_copy
        return DemandCopyPolicy(self.copy_bytes_per_ms, copy_missed=copy_missed)

    def resize_cache(self, cache_bytes: int, *, demand_copy: bool | None = None) -> None:
        """Replace the cluster cache with an empty one of `cache_bytes` (nothing may be pinned);
        `demand_copy` as in the constructor."""
        if self.cache.stats().pinned_clusters:
            raise SearchError("cannot resize the cluster cache while clusters are pinned")
        with self.on_stream():
            self.cache = ClusterCache(self.host_vectors, self.datastore.offsets, 0, self.device)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.cache = ClusterCache(self.host_vectors, self.datastore.offsets, cache_bytes, self.device)
        self.copy_bytes_per_ms = self.cache.measure_copy_rate() or self.copy_bytes_per_ms
        self.demand = self._demand_policy(demand_copy)

    def close(self) -> None:
        self._cpu_pool.shutdown(wait=True)

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
        plan = plan_prefetch(ranked, cluster_bytes, budget, resident=resident, depth=self.nprobe)
        plan_ms = (time.perf_counter() - started) * 1e3
        offset = 0
        for g in active:
            per_query = plan.per_query[offset : offset + sizes[g]]
            offset += sizes[g]
            mine = frozenset().union(*per_query)
            clusters = [c for c in plan.clusters if c in mine]
            lease = self.cache.acquire(clusters, fetch=True) if clusters else None
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
        evict them. (Releasing a handle again is harmless.)"""
        started = time.perf_counter()
        nprobe = nprobe or self.nprobe
        queries = self.index.check(q_out, k, nprobe)
        n = len(queries)
        handles = self._handles_per_query(prefetch, n)
        if not (use_cache and self.cache.capacity_rows) and not any(h is not None and h.plan.clusters for h in handles):
            # Nothing can be on the device and no overlap to report: this is faiss, as is.
            cpu_started = time.perf_counter()
            scores, ids = _to_host(merge_topk([_to_torch(self.index.search(queries, k, nprobe), "cpu")], k))
            cpu_ms = (time.perf_counter() - cpu_started) * 1e3
            return SearchResult(
                scores=scores,
                ids=ids,
                per_query=[QueryStats(None, 0, nprobe) for _ in range(n)],
                probe_ms=0.0,
                device_ms=0.0,
                cpu_ms=cpu_ms,
                total_ms=(time.perf_counter() - started) * 1e3,
            )
        q = torch.from_numpy(queries).to(self.device, non_blocking=True)  # once, for probe and scan
        list_scores, lists = self.probe(queries, q, nprobe)
        probe_ms = (time.perf_counter() - started) * 1e3

        lease: Lease | None = None
        demand: Lease | None = None
        resident_mask = np.zeros(lists.shape, dtype=bool)
        late_mask = np.zeros(lists.shape, dtype=bool)
        demand_mask = np.zeros(lists.shape, dtype=bool)
        chosen_mask = np.zeros(lists.shape, dtype=bool)
        wait_ms = 0.0
        try:
            if use_cache and self.cache.capacity_rows:
                lease = self.cache.acquire(np.unique(lists[lists >= 0]), fetch=False)
                resident_mask = _held(lists, lease)
                late_mask = self._late_copies(lists, resident_mask, lease)
                resident_mask &= ~late_mask
            _end_prefetches(handles)  # from here the search's own lease pins what it reads
            if lease is not None:
                chosen_mask = self._demand_choice(lists, resident_mask | late_mask)
            cpu_lists = np.where(resident_mask | chosen_mask, -1, lists)
            missed_bytes = int(self.cache.sizes[lists[(lists >= 0) & ~resident_mask]].sum()) * self.cache.row_bytes
            parts: list[tuple[torch.Tensor, torch.Tensor]] = []
            device_ms = cpu_ms = 0.0
            if not (resident_mask.any() or chosen_mask.any()):
                cpu_scores, cpu_ids, cpu_ms = self._cpu_search(queries, k, cpu_lists, list_scores)
                parts.append(_to_torch((cpu_scores, cpu_ids), self.device))
            else:
                # faiss, the longer half, starts first and runs in a worker thread; the demand
                # copies are issued after, and what they could not place goes to faiss too
                cpu_futures = []
                if (cpu_lists >= 0).any():
                    cpu_futures.append(self._cpu_pool.submit(self._cpu_search, queries, k, cpu_lists, list_scores))
                if chosen_mask.any():
                    demand = self.cache.acquire(np.unique(lists[chosen_mask]), fetch=True)
                    demand_mask = _held(lists, demand) & chosen_mask
                    not_placed = np.where(chosen_mask & ~demand_mask, lists, -1)
                    if (not_placed >= 0).any():
                        cpu_futures.append(self._cpu_pool.submit(self._cpu_search, queries, k, not_placed, list_scores))
                # what is resident first; the demand copies land meanwhile and are scanned next
                passes = [(m, h) for m, h in ((resident_mask, lease), (demand_mask, demand)) if h is not None and m.any()]
                if passes:
                    device_parts, device_ms, wait_ms = self._device_search(q, k, lists, passes)
                    parts.extend(device_parts)
                for future in cpu_futures:
                    cpu_scores, cpu_ids, ms = future.result()
                    parts.append(_to_torch((cpu_scores, cpu_ids), self.device))
                    cpu_ms += ms
            on_device = resident_mask | demand_mask
            scores, ids = _to_host(merge_topk(parts, k))
        finally:
            for held in (lease, demand):
                if held is not None:
                    held.release()
        if demand is not None:
            copy_ms = demand.copy_elapsed_ms()
            if self.demand is not None and copy_ms:
                self.demand.observe_copy(demand.bytes_copied, copy_ms)

        per_query = []
        for i in range(n):
            c_out = set(lists[i][lists[i] >= 0].tolist())
            handle = handles[i]
            overlap = None
            if handle is not None and c_out:
                c_in = frozenset().union(*handle.plan.per_query) if handle.plan.per_query else frozenset()
                overlap = len(c_in & c_out) / len(c_out)
            device_clusters = int(on_device[i].sum())
            per_query.append(QueryStats(
                overlap, device_clusters, len(c_out) - device_clusters, int(demand_mask[i].sum()), int(late_mask[i].sum())
            ))
        return SearchResult(
            scores=scores,
            ids=ids,
            per_query=per_query,
            probe_ms=probe_ms,
            device_ms=device_ms,
            cpu_ms=cpu_ms,
            total_ms=(time.perf_counter() - started) * 1e3,
            copy_wait_ms=wait_ms,
            missed_bytes=missed_bytes,
        )

    def _late_copies(self, lists: np.ndarray, held_mask: np.ndarray, lease: Lease) -> np.ndarray:
        """Which entries of `lists` the lease holds but whose copies are still queued and would
        land after faiss could scan them (see `DemandCopyPolicy.late_to_cpu`): those go to faiss."""
        late = np.zeros(lists.shape, dtype=bool)
        pending = self.cache.pending(lease) if self.demand is not None else {}
        if not pending:
            return late
        row_bytes = self.cache.row_bytes
        held, readers = np.unique(lists[held_mask], return_counts=True)
        waiting = [
            (cluster, pending[cluster], int(self.cache.sizes[cluster]) * row_bytes * count)
            for cluster, count in zip(held.tolist(), readers.tolist(), strict=True)
            if cluster in pending
        ]
        missed = lists[(lists >= 0) & ~held_mask]
        to_cpu = self.demand.late_to_cpu(waiting, int(self.cache.sizes[missed].sum()) * row_bytes)
        if to_cpu:
            late = np.isin(lists, np.asarray(to_cpu, dtype=np.int64)) & held_mask
        return late

    def _demand_choice(self, lists: np.ndarray, resident_mask: np.ndarray) -> np.ndarray:
        """Which entries of `lists` to copy to the device on demand: the missed clusters the
        policy picks (none without a policy)."""
        chosen_mask = np.zeros(lists.shape, dtype=bool)
        if self.demand is None or not self.demand.copy_missed:
            return chosen_mask
        missed, counts = np.unique(lists[(lists >= 0) & ~resident_mask], return_counts=True)
        missed_sizes = self.cache.sizes[missed]
        keep = missed_sizes > 0
        missed, counts = missed[keep], counts[keep]
        if not len(missed):
            return chosen_mask
        sizes = dict(zip(missed.tolist(), (missed_sizes[keep] * self.cache.row_bytes).tolist(), strict=True))
        chosen = self.demand.choose(dict(zip(missed.tolist(), counts.tolist(), strict=True)), sizes)
        if chosen:
            chosen_mask = np.isin(lists, np.asarray(chosen, dtype=np.int64)) & ~resident_mask
        return chosen_mask

    def probe(self, queries: np.ndarray, q: torch.Tensor, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        """C_out of each query (`queries` on the host, `q` the same on the device): the same
        `nprobe` lists faiss's quantizer picks.

        On CUDA the centroid scores come from one exact fp32 product on the device; a query whose
        nprobe-th and next score are too close to call (so that summation order could flip them)
        is probed by faiss instead, so the set of lists is always faiss's own.
        """
        if self.device.type != "cuda" or nprobe >= self.nlist:
            return self.index.probe(queries, nprobe)
        scores, lists = torch.topk(q @ self.centroids.T, nprobe + 1, dim=1)
        scores, lists = scores.cpu().numpy(), lists.cpu().numpy()
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
            raise SearchError(f"{len(handles)} prefetch handles for {n} queries")
        return handles

    def _cpu_search(
        self, queries: np.ndarray, k: int, lists: np.ndarray, list_scores: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, float]:
        started = time.perf_counter()
        scores, ids = self.index.search_lists(queries, k, lists, list_scores)
        ms = (time.perf_counter() - started) * 1e3
        if self.demand is not None:
            self.demand.observe_cpu(int(self.cache.sizes[lists[lists >= 0]].sum()) * self.cache.row_bytes, ms)
        return scores, ids, ms

    def _device_search(
        self, q: torch.Tensor, k: int, lists: np.ndarray, passes: Sequence[tuple[np.ndarray, Lease]]
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float, float]:
        """Scan each pass's clusters (`mask` over `lists`, held by its lease) in order. On CUDA all
        passes are queued before one wait: a pass waits on the stream for its own copies only,
        while the host already prepares the next. Returns the results, the scan time and how
        long the stream waited for copies (both ms)."""
        stream = self.stream
        begin = end = None
        waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        started = time.perf_counter()
        results = []
        for mask, lease in passes:
            probes = [lists[i][mask[i]].tolist() for i in range(len(q))]
            if stream is not None:
                in_flight = [event for event in lease.events if not event.query()]
                if in_flight:  # timed on the stream: from where it stops to where its copies landed
                    stop, landed = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    stop.record(stream)
                    for event in in_flight:
                        stream.wait_event(event)
                    landed.record(stream)
                    waits.append((stop, landed))
                if begin is None:  # timed from the first pass's start, after its copies landed
                    begin = torch.cuda.Event(enable_timing=True)
                    begin.record(stream)
            results.append(
                scan_resident(
                    self.cache.buffer, q, lease.resident, probes, k,
                    codec=self.datastore.codec, codec_params=self.codec_params,
                )
            )
        if stream is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            end.synchronize()
        ms = begin.elapsed_time(end) if begin is not None and end is not None else (time.perf_counter() - started) * 1e3
        return results, ms, sum(stop.elapsed_time(landed) for stop, landed in waits)


def _end_prefetches(handles: Sequence[PrefetchHandle | None]) -> None:
    """Release each distinct prefetch of a search (the search now pins what it reads)."""
    for handle in {id(h): h for h in handles if h is not None}.values():
        handle.release()


def _to_torch(part: tuple[np.ndarray, np.ndarray], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """A (scores, ids) result from faiss on `device` (a view on the CPU, a small copy elsewhere)."""
    return tuple(torch.from_numpy(a).to(device, non_blocking=True) for a in part)  # type: ignore[return-value]


def _to_host(part: tuple[torch.Tensor, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    return part[0].cpu().numpy(), part[1].cpu().numpy()


def _held(lists: np.ndarray, lease: Lease) -> np.ndarray:
    """Which entries of `lists` are clusters the lease holds on the device."""
    if not lease.resident:
        return np.zeros(lists.shape, dtype=bool)
    return np.isin(lists, np.fromiter(lease.resident, dtype=np.int64))
