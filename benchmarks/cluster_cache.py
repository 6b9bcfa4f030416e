"""`telerag bench cluster-cache`: the cluster cache's own bookkeeping, apart from any search.

A synthetic IVF layout (`nlist` lists of random sizes about `mean_rows`), a cache of
`cache_fraction` of it, kept full by searches that each prefetch `prefetch` clusters and then copy
`demand` more on demand, as `bench retrieval`'s searches do at batch 1. It times each acquisition
on the host (placing, evicting, issuing the copies: on CUDA asynchronous, so the host's part; on
the CPU the copies run as they are issued, so keep `dim` small there to time the bookkeeping) and
counts copies per copied cluster, evictions and hits. The demand acquisition is on a search's
critical path."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from tqdm import tqdm

from telerag.retrieval.cache import CacheBuffer, ClusterCache, TensorRows


@dataclass(frozen=True)
class ClusterCacheConfig:
    nlist: int = 4096
    mean_rows: int = 976  # 4M vectors in 4096 lists: bench retrieval's datastore
    dim: int = 2
    cache_fraction: float = 0.2
    prefetch: int = 192  # clusters a search's prefetch asks for (three quarters of nprobe 256)
    demand: int = 31  # clusters it then copies on demand (12% of nprobe 256, as measured on an H100)
    searches: int = 300
    warmup: int = 20  # searches not timed: until the cache is full
    device: str = "cpu"
    seed: int = 0


@dataclass(frozen=True)
class ClusterCacheReport:
    config: ClusterCacheConfig
    prefetch_ms_p50: float
    prefetch_ms_p99: float
    demand_ms_p50: float
    demand_ms_p99: float
    copies_per_cluster: float  # copies issued per cluster copied (fewer than one: adjacent clusters share one)
    hit_rate: float  # of the clusters asked for, the share already resident
    evictions_per_search: float

    def to_dict(self) -> dict:
        return asdict(self)


def run_cluster_cache(config: ClusterCacheConfig, progress: bool = True) -> ClusterCacheReport:
    rng = np.random.default_rng(config.seed)
    sizes = rng.integers(config.mean_rows // 3, config.mean_rows * 5 // 3 + 1, config.nlist)
    offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    device = torch.device(config.device)
    host = torch.zeros((int(offsets[-1]), config.dim), dtype=torch.float32, pin_memory=device.type == "cuda")
    row_bytes = config.dim * 4
    source = TensorRows(host)
    shared = CacheBuffer.for_vectors(source, int(offsets[-1] * config.cache_fraction) * row_bytes, device)
    cache = ClusterCache(source, offsets, shared)
    prefetch_ms: list[float] = []
    demand_ms: list[float] = []
    asked = resident = copied = copies = 0
    evictions_before = 0
    for i in tqdm(range(config.warmup + config.searches), desc="searches", disable=not progress):
        probed = rng.choice(config.nlist, config.prefetch + config.demand, replace=False)
        started = time.perf_counter()
        prefetched = cache.acquire(probed[: config.prefetch], fetch=True)
        between = time.perf_counter()
        missed = [c for c in probed[config.prefetch :].tolist() if c not in prefetched.resident]
        demanded = cache.acquire(missed, fetch=True)
        ended = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # every copy landed: the next search starts from a quiet stream
        if i == config.warmup:
            evictions_before = cache.stats().evictions
        if i >= config.warmup:
            prefetch_ms.append((between - started) * 1e3)
            demand_ms.append((ended - between) * 1e3)
            for lease in (prefetched, demanded):
                asked += lease.clusters_already_resident + lease.clusters_copied + lease.clusters_skipped
                resident += lease.clusters_already_resident
                copied += lease.clusters_copied
                copies += lease.copies
        prefetched.release()
        demanded.release()
    return ClusterCacheReport(
        config=config,
        prefetch_ms_p50=float(np.median(prefetch_ms)),
        prefetch_ms_p99=float(np.percentile(prefetch_ms, 99)),
        demand_ms_p50=float(np.median(demand_ms)),
        demand_ms_p99=float(np.percentile(demand_ms, 99)),
        copies_per_cluster=copies / copied if copied else 0.0,
        hit_rate=resident / asked if asked else 0.0,
        evictions_per_search=(cache.stats().evictions - evictions_before) / config.searches,
    )


def format_table(report: ClusterCacheReport) -> str:
    c = report.config
    return "\n".join(
        [
            f"{c.nlist} lists of ~{c.mean_rows} rows x {c.dim}, a cache of {c.cache_fraction:.0%} on {c.device}; "
            f"{c.searches} searches of {c.prefetch} prefetched + {c.demand} demanded clusters",
            f"{'acquisition':<12} {'p50 ms':>8} {'p99 ms':>8}",
            f"{'prefetch':<12} {report.prefetch_ms_p50:>8.2f} {report.prefetch_ms_p99:>8.2f}",
            f"{'demand':<12} {report.demand_ms_p50:>8.2f} {report.demand_ms_p99:>8.2f}",
            f"copies per copied cluster {report.copies_per_cluster:.2f}, hit rate {report.hit_rate:.3f}, "
            f"evictions per search {report.evictions_per_search:.1f}",
        ]
    )
