"""The retrieval tier's cost over faiss in process (`telerag bench tier`): the same queries' same
lists searched by the CPU half here (`CPUIndex`, faiss with every core) and through the tier on
a Ray cluster (`server.ray_serve.tier`: S shards of one replica each), in turn, search by search, per
number of shards and batch size. `remote_overhead` is the tier's median time over faiss's,
`same_documents` the share of queries whose top-k equals faiss's.

On one box the tier's replicas share the cores with the caller, and every call crosses process
boundaries: this measures what the tier costs, not what it scales to."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from telerag.benchmarks.retrieval import near_stored
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.ivf import CPUIndex, faiss, same_results
from telerag.server.ray_serve.tier import APP, RetrievalTier, TierShape, deploy_tier
from telerag.utils.progress import ProgressBar


@dataclass(frozen=True)
class TierBenchConfig:
    datastore: Path
    shards: tuple[int, ...] = (1, 2)
    batches: tuple[int, ...] = (1, 8)
    searches: int = 50  # measured per (shards, batch), after `warmup`
    warmup: int = 5
    k: int = 3
    nprobe: int | None = None  # default: the server's for this datastore
    cpus_per_replica: float = 1.0
    faiss_threads: int | None = None  # faiss here; default: every core, as the one-process server
    noise: float = 0.5  # queries: stored vectors plus this much Gaussian noise, normalised
    seed: int = 0


@dataclass(frozen=True)
class TierRow:
    shards: int
    batch: int
    searches: int
    local_ms_p50: float
    tier_ms_p50: float
    tier_ms_p99: float
    remote_overhead: float  # tier_ms_p50 / local_ms_p50
    same_documents: float  # share of queries whose top-k equals faiss's


@dataclass
class TierReport:
    datastore: str
    n_vectors: int
    nlist: int
    nprobe: int
    k: int
    faiss_threads: int
    cpus_per_replica: float
    retries: int = 0  # shard calls the tier asked again over the run (a replica failed)
    rows: list[TierRow] = field(default_factory=list)


def run_tier_bench(config: TierBenchConfig, *, progress: bool = True) -> TierReport:
    """Start (or join, with RAY_ADDRESS) a Ray cluster and Serve, deploy the tier once per
    number of shards, and time it against faiss here."""
    datastore = Datastore.load(config.datastore, verify_checksums=False)
    local = CPUIndex(datastore)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(config.faiss_threads or threads)
    try:
        return _run(config, datastore, local, progress)
    finally:
        faiss.omp_set_num_threads(threads)


def _run(config: TierBenchConfig, datastore: Datastore, local: CPUIndex, progress: bool) -> TierReport:
    import ray
    from ray import serve

    from telerag.retrieval.engine import default_nprobe

    nprobe = config.nprobe or default_nprobe(datastore.nlist)
    report = TierReport(
        datastore=str(config.datastore),
        n_vectors=datastore.n_vectors,
        nlist=datastore.nlist,
        nprobe=nprobe,
        k=config.k,
        faiss_threads=faiss.omp_get_max_threads(),
        cpus_per_replica=config.cpus_per_replica,
    )
    started_ray = not ray.is_initialized()
    if started_ray:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(proxy_location="Disabled")
    try:
        for shards in config.shards:
            shape = TierShape(shards=shards, cpus_per_replica=config.cpus_per_replica)
            tier = deploy_tier(config.datastore, shape, verify_checksums=False)
            try:
                for batch in config.batches:
                    report.rows.append(measure_tier(local, tier, shards, batch, nprobe, config, progress))
                report.retries += tier.retries
            finally:
                serve.delete(APP)
    finally:
        if started_ray:
            ray.shutdown()  # Serve with it (serve.shutdown first prints a failed task of its controller)
    return report


def measure_tier(
    local: CPUIndex, tier: RetrievalTier, shards: int, batch: int, nprobe: int, config: TierBenchConfig, progress: bool
) -> TierRow:
    """`config.searches` searches of `batch` queries near stored vectors, by faiss here and by
    the tier in turn, over the same lists."""
    rng = np.random.default_rng(config.seed + 1000 * shards + batch)
    local_ms: list[float] = []
    tier_ms: list[float] = []
    same: list[bool] = []
    total = config.warmup + config.searches
    for i in ProgressBar(range(total), desc=f"{shards} shards, batch {batch}", unit="search", disable=not progress):
        rows = np.sort(rng.choice(local.datastore.n_vectors, size=batch, replace=False))
        q = near_stored(local.datastore, rows, config.noise, rng)
        list_scores, lists = local.probe(q, nprobe)
        started = time.perf_counter()
        want = local.search_lists(q, config.k, lists, list_scores)
        between = time.perf_counter()
        got = tier.search_lists(q, config.k, lists, list_scores)
        ended = time.perf_counter()
        if i < config.warmup:
            continue
        local_ms.append((between - started) * 1e3)
        tier_ms.append((ended - between) * 1e3)
        same.extend(same_results(got[1][j], got[0][j], want[1][j], want[0][j]) for j in range(batch))
    local_p50, tier_p50 = statistics.median(local_ms), statistics.median(tier_ms)
    return TierRow(
        shards=shards,
        batch=batch,
        searches=config.searches,
        local_ms_p50=local_p50,
        tier_ms_p50=tier_p50,
        tier_ms_p99=float(np.percentile(tier_ms, 99)),
        remote_overhead=tier_p50 / local_p50,
        same_documents=float(np.mean(same)),
    )


def format_table(report: TierReport) -> str:
    lines = [
        f"{report.datastore}: {report.n_vectors} vectors, nlist {report.nlist}, nprobe {report.nprobe}, k {report.k}; "
        f"faiss here with {report.faiss_threads} threads, each shard replica {report.cpus_per_replica} CPU; "
        f"{report.retries} shard calls asked again",
        f"{'shards':>6}{'batch':>6}{'searches':>9}{'faiss p50 ms':>13}{'tier p50 ms':>12}{'tier p99 ms':>12}"
        f"{'remote_overhead':>16}{'same_documents':>15}",
    ]
    for row in report.rows:
        lines.append(
            f"{row.shards:>6}{row.batch:>6}{row.searches:>9}{row.local_ms_p50:>13.2f}{row.tier_ms_p50:>12.2f}"
            f"{row.tier_ms_p99:>12.2f}{row.remote_overhead:>16.2f}{row.same_documents:>15.3f}"
        )
    return "\n".join(lines)
