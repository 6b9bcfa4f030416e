"""One cooperative search's steps after the probe (TeleRAG chapter 4): where each probed list is
scanned, the two halves run at the same time, and their merge.

Each query's probed lists go to one of three places: the device, from the clusters resident in
the cache; the device, from clusters copied on demand while it scans the resident ones (see
`retrieval.demand`); or faiss on the CPU (the misses, and resident clusters whose copies are
still queued and would land after faiss could scan them: "late"). The halves scan disjoint
lists, so their merged top-k is exactly IVF at that nprobe.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from telerag.retrieval.cache import ClusterCache, Lease
from telerag.retrieval.codecs import Codec
from telerag.retrieval.demand import DemandCopyPolicy
from telerag.retrieval.ivf import ListSearch
from telerag.retrieval.prefetch import PrefetchHandle
from telerag.retrieval.provisional import DeviceHalfDone
from telerag.retrieval.search import Part, faiss_part, merge_to_host, scan_resident

CPUResult = tuple[np.ndarray, np.ndarray, float]  # faiss's (scores, ids) and how long it took (ms)


@dataclass
class QueryStats:
    """One query's overlap with its prefetch, and where its probed lists were scanned."""

    overlap_rate: float | None  # |C_in ∩ C_out| / |C_out| (TeleRAG Eq. 3.1); None without a prefetch
    clusters_device: int  # of C_out, scanned on the device (those copied on demand included)
    clusters_cpu: int
    clusters_copied_on_demand: int = 0
    clusters_late: int = 0  # of those on the CPU: resident, but faiss would finish before their copies land


@dataclass(frozen=True)
class SearchResources:
    """What a search runs on, as the engine holds them when it starts (a search runs against
    the cache and demand policy it began with, even if the engine's are replaced meanwhile)."""

    cpu_half: ListSearch  # faiss in process, or the retrieval tier (as the search watches it: `SearchHalves`)
    cpu_pool: ThreadPoolExecutor  # faiss's worker threads
    cache: ClusterCache
    policy: DemandCopyPolicy | None  # None: no cache
    device: torch.device
    stream: torch.cuda.Stream | None  # the search stream on CUDA; None on the CPU
    codec: Codec
    codec_params: torch.Tensor | None  # on the device
    row_ids: torch.Tensor | None = None  # on the device: each row's passage id (None: a row's id is its row)


class CooperativeSearch:
    """The state of one search between its steps: masks over `lists` (each query's C_out) saying
    where each list is scanned, the leases pinning what the device reads, and each half's results
    and times. `RetrievalEngine.search` runs the steps in order, and `release` in every case."""

    def __init__(
        self,
        resources: SearchResources,
        queries: np.ndarray,
        q: torch.Tensor,
        k: int,
        lists: np.ndarray,
        list_scores: np.ndarray,
        device_done: DeviceHalfDone,
    ) -> None:
        """`queries` on the host and `q` the same on the device; `lists` and `list_scores` from
        the probe; `device_done` hears the device half's results when it ends (`SearchHalves`)."""
        self.resources = resources
        self.cache, self.policy = resources.cache, resources.policy
        self.queries, self.q, self.k = queries, q, k
        self.lists, self.list_scores = lists, list_scores
        self.device_done = device_done
        self.lease: Lease | None = None  # pins the resident clusters the search reads
        self.demand: Lease | None = None  # pins the clusters copied on demand
        self.resident_mask = np.zeros(lists.shape, dtype=bool)  # scanned on the device, resident at the start
        self.late_mask = np.zeros(lists.shape, dtype=bool)  # resident, but scanned by faiss
        self.chosen_mask = np.zeros(lists.shape, dtype=bool)  # missed, chosen to be copied on demand
        self.demand_mask = np.zeros(lists.shape, dtype=bool)  # of those chosen, the ones the cache placed
        self.parts: list[Part] = []
        self.device_ms = self.cpu_ms = self.wait_ms = 0.0

    # -- the steps, in order -------------------------------------------------------------------

    def pin_resident(self) -> None:
        """Pin the resident clusters of every query's C_out; those whose copies are still queued
        and would land after faiss could scan them are left to faiss."""
        lists = self.lists
        self.lease = self.cache.acquire(np.unique(lists[lists >= 0]), fetch=False)
        held = _held(lists, self.lease)
        self.late_mask = self._late_copies(held, self.lease)
        self.resident_mask = held & ~self.late_mask

    def choose_demand_copies(self) -> None:
        """Which missed lists to copy to the device on demand (only once `pin_resident` ran)."""
        if self.lease is not None:
            self.chosen_mask = self._demand_choice(self.resident_mask | self.late_mask)

    @property
    def missed_bytes(self) -> int:
        """Bytes of the probed lists not resident, once per query probing them."""
        lists = self.lists
        return int(self.cache.sizes[lists[(lists >= 0) & ~self.resident_mask]].sum()) * self.cache.row_bytes

    def scan(self) -> None:
        """Both halves: faiss over the lists no device pass takes, the device over the rest."""
        cpu_lists = np.where(self.resident_mask | self.chosen_mask, -1, self.lists)
        if not (self.resident_mask.any() or self.chosen_mask.any()):
            self.device_done([], 0)
            cpu_scores, cpu_ids, self.cpu_ms = self._cpu_search(cpu_lists)
            self.parts.append(faiss_part((cpu_scores, cpu_ids), self.resources.device))
            return
        # faiss, the longer half, starts first and runs in a worker thread; the demand
        # copies are issued after, and what they could not place goes to faiss too
        cpu_futures = []
        if (cpu_lists >= 0).any():
            cpu_futures.append(self._submit_cpu_search(cpu_lists))
        if self.chosen_mask.any():
            cpu_futures.extend(self._copy_on_demand())
        # what is resident first; the demand copies land meanwhile and are scanned next
        in_order = ((self.resident_mask, self.lease), (self.demand_mask, self.demand))
        passes = [(m, h) for m, h in in_order if h is not None and m.any()]
        if passes:
            device_parts, self.device_ms, self.wait_ms = self._device_search(self.q, self.k, self.lists, passes)
            self.parts.extend(device_parts)
        self.device_done(self.parts, int(sum(mask.sum() for mask, _ in passes)))
        for future in cpu_futures:
            cpu_scores, cpu_ids, ms = future.result()
            self.parts.append(faiss_part((cpu_scores, cpu_ids), self.resources.device))
            self.cpu_ms += ms

    def merge(self) -> tuple[np.ndarray, np.ndarray]:
        """The halves' top-k merged on the device, read to the host."""
        return merge_to_host(self.parts, self.k)

    def release(self) -> None:
        """End the search's pins (harmless before they were taken, or twice)."""
        for held in (self.lease, self.demand):
            if held is not None:
                held.release()

    def observe_demand_copies(self) -> None:
        """Feed the demand copies' measured rate to the policy, once they have landed."""
        if self.demand is not None:
            copy_ms = self.demand.copy_elapsed_ms()
            if self.policy is not None and copy_ms:
                self.policy.observe_copy(self.demand.bytes_copied, copy_ms)

    def query_stats(self, handles: Sequence[PrefetchHandle | None]) -> list[QueryStats]:
        """Each query's overlap with its prefetch and where its lists were scanned."""
        on_device = self.resident_mask | self.demand_mask
        lists = self.lists
        per_query = []
        for i in range(len(lists)):
            c_out = set(lists[i][lists[i] >= 0].tolist())
            handle = handles[i]
            overlap = None
            if handle is not None and c_out:
                c_in = frozenset().union(*handle.plan.per_query) if handle.plan.per_query else frozenset()
                overlap = len(c_in & c_out) / len(c_out)
            device_clusters = int(on_device[i].sum())
            per_query.append(
                QueryStats(
                    overlap,
                    device_clusters,
                    len(c_out) - device_clusters,
                    int(self.demand_mask[i].sum()),
                    int(self.late_mask[i].sum()),
                )
            )
        return per_query

    # -- where lists go ------------------------------------------------------------------------

    def _late_copies(self, held_mask: np.ndarray, lease: Lease) -> np.ndarray:
        """Which entries of `lists` the lease holds but whose copies are still queued and would
        land after faiss could scan them (see `DemandCopyPolicy.late_to_cpu`): those go to faiss."""
        lists = self.lists
        late = np.zeros(lists.shape, dtype=bool)
        if self.policy is None:
            return late
        pending = self.cache.pending(lease)
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
        to_cpu = self.policy.late_to_cpu(waiting, int(self.cache.sizes[missed].sum()) * row_bytes)
        if to_cpu:
            late = np.isin(lists, np.asarray(to_cpu, dtype=np.int64)) & held_mask
        return late

    def _demand_choice(self, resident_mask: np.ndarray) -> np.ndarray:
        """Which entries of `lists` to copy to the device on demand: the missed clusters the
        policy picks (none without a policy)."""
        lists = self.lists
        chosen_mask = np.zeros(lists.shape, dtype=bool)
        if self.policy is None or not self.policy.copy_missed:
            return chosen_mask
        missed, counts = np.unique(lists[(lists >= 0) & ~resident_mask], return_counts=True)
        missed_sizes = self.cache.sizes[missed]
        keep = missed_sizes > 0
        missed, counts = missed[keep], counts[keep]
        if not len(missed):
            return chosen_mask
        sizes = dict(zip(missed.tolist(), (missed_sizes[keep] * self.cache.row_bytes).tolist(), strict=True))
        chosen = self.policy.choose(dict(zip(missed.tolist(), counts.tolist(), strict=True)), sizes)
        if chosen:
            chosen_mask = np.isin(lists, np.asarray(chosen, dtype=np.int64)) & ~resident_mask
        return chosen_mask

    def _copy_on_demand(self) -> list[Future[CPUResult]]:
        """Issue the chosen copies; what the cache could not place goes to faiss (its futures)."""
        self.demand = self.cache.acquire(np.unique(self.lists[self.chosen_mask]), fetch=True)
        self.demand_mask = _held(self.lists, self.demand) & self.chosen_mask
        not_placed = np.where(self.chosen_mask & ~self.demand_mask, self.lists, -1)
        return [self._submit_cpu_search(not_placed)] if (not_placed >= 0).any() else []

    # -- the halves ----------------------------------------------------------------------------

    def _submit_cpu_search(self, lists: np.ndarray) -> Future[CPUResult]:
        return self.resources.cpu_pool.submit(self._cpu_search, lists)

    def _cpu_search(self, lists: np.ndarray) -> CPUResult:
        """faiss over `lists` (-1: skipped), its time fed to the policy's CPU scan rate."""
        started = time.perf_counter()
        scores, ids = self.resources.cpu_half.search_lists(self.queries, self.k, lists, self.list_scores)
        ms = (time.perf_counter() - started) * 1e3
        if self.policy is not None:
            self.policy.observe_cpu(int(self.cache.sizes[lists[lists >= 0]].sum()) * self.cache.row_bytes, ms)
        return scores, ids, ms

    def _device_search(
        self, q: torch.Tensor, k: int, lists: np.ndarray, passes: Sequence[tuple[np.ndarray, Lease]]
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float, float]:
        """Scan each pass's clusters (`mask` over `lists`, held by its lease) in order. On CUDA all
        passes are queued before one wait: a pass waits on the stream for its own copies only,
        while the host already prepares the next. Returns the results, the scan time and how
        long the stream waited for copies (both ms)."""
        stream = self.resources.stream
        if stream is None:
            return self._host_search(q, k, lists, passes)
        begin = end = None
        waits: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        results = []
        for mask, lease in passes:
            probes = [lists[i][mask[i]].tolist() for i in range(len(q))]
            in_flight = [arrival for arrival in lease.arrivals if not arrival.landed()]
            if in_flight:  # timed on the stream: from where it stops to where its copies landed
                stop, landed = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                stop.record(stream)
                for arrival in in_flight:
                    arrival.wait(stream)
                landed.record(stream)
                waits.append((stop, landed))
            if begin is None:  # timed from the first pass's start, after its copies landed
                begin = torch.cuda.Event(enable_timing=True)
                begin.record(stream)
            results.append(self._scan_held(q, k, lease, probes))
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        end.synchronize()
        assert begin is not None  # at least one pass
        return results, begin.elapsed_time(end), sum(stop.elapsed_time(landed) for stop, landed in waits)

    def _host_search(
        self, q: torch.Tensor, k: int, lists: np.ndarray, passes: Sequence[tuple[np.ndarray, Lease]]
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float, float]:
        """`_device_search` where the "device" is host memory: each pass's clusters scanned as
        their copies land, those landed first, so that the scan of what is in memory runs while
        the reads still in flight (from disk) finish. Returns the results, the scan time and how
        long the calling thread waited for copies (both ms)."""
        started = time.perf_counter()
        waited_ms = 0.0
        results = []
        for mask, lease in passes:
            probes = [lists[i][mask[i]].tolist() for i in range(len(q))]
            wanted = {c for row in probes for c in row}
            pending = {c: arrival for c, arrival in lease.arrival_of.items() if c in wanted and not arrival.landed()}
            while True:
                ready = [[c for c in row if c not in pending] for row in probes]
                if any(ready):
                    results.append(self._scan_held(q, k, lease, ready))
                if not pending:
                    break
                probes = [[c for c in row if c in pending] for row in probes]
                waiting = time.perf_counter()
                next(iter(pending.values())).wait()  # the first issued; whatever else landed meanwhile comes with it
                waited_ms += (time.perf_counter() - waiting) * 1e3
                pending = {c: arrival for c, arrival in pending.items() if not arrival.landed()}
        return results, (time.perf_counter() - started) * 1e3 - waited_ms, waited_ms

    def _scan_held(
        self, q: torch.Tensor, k: int, lease: Lease, probes: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k of each query over its `probes`, clusters `lease` holds in the cache, as passage ids."""
        scores, rows = scan_resident(
            self.cache.buffer, q, lease.resident, probes, k, codec=self.resources.codec, codec_params=self.resources.codec_params
        )
        row_ids = self.resources.row_ids
        return scores, rows if row_ids is None else torch.where(rows >= 0, row_ids[rows.clamp(min=0)], rows)


def _held(lists: np.ndarray, lease: Lease) -> np.ndarray:
    """Which entries of `lists` are clusters the lease holds on the device."""
    if not lease.resident:
        return np.zeros(lists.shape, dtype=bool)
    return np.isin(lists, np.fromiter(lease.resident, dtype=np.int64))
