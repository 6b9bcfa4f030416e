"""`telerag bench retrieval`: faiss CPU vs. our prefetch + cooperative search (without and with
demand copies) vs. everything resident, and faiss vs. its scan with exact early stop
(`experiments.early_stop`), side by side in one run, on a synthetic clustered datastore with
controllable overlap, or on the configured datastore (the embedded default's), as it is or
scaled up in memory as `bench e2e` scales it (`benchmarks.scaled`). The module is long because
its phases share one engine, one set of queries and faiss's answers to them, the reference every
phase is checked against; the early-stop phase, which needs only those, is `benchmarks.early_stop`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile
from tqdm.auto import tqdm

from telerag.benchmarks.early_stop import EarlyStopTimes, early_stop_phase
from telerag.benchmarks.report import key_value_table
from telerag.benchmarks.scaled import DatastoreScale, scaled_datastore
from telerag.config.settings import load_settings
from telerag.retrieval.builder import order_centroids
from telerag.retrieval.cache import CopyWindow
from telerag.retrieval.codecs import Codec
from telerag.retrieval.datastore import Datastore, Manifest
from telerag.retrieval.datastore_writer import add_list_stats, write_datastore
from telerag.retrieval.engine import RetrievalEngine, SearchResult
from telerag.retrieval.errors import DatastoreError, DeviceUnavailable
from telerag.retrieval.ivf import same_results
from telerag.server.process.runtime import load_configured_datastore, load_embedder
from telerag.utils.device import resolve_device


@dataclass
class BenchConfig:
    vectors: int = 500_000
    dim: int = 384
    nlist: int | None = None  # synthetic: 1024; scaled: 4*sqrt(vectors)
    nprobe: int | None = None  # 4*sqrt(nlist), the server's default
    topk: int = 10
    batch: int = 1
    queries: int = 64
    budget_mb: float = 0.0
    cache_mb: float | None = None  # default: the budget
    demand_mb: float = 0.0  # extra cache for the demand-copy run (none needed: a search frees its prefetch's misses)
    overlap_noise: float = 0.3
    distinct_queries: int | None = None  # a stream of `queries` drawn from this many (Zipf, s=1): repeats, as real traffic has
    codec: str = "fp32"
    device: str = "auto"
    cpu_threads: int | None = None  # faiss threads of our CPU half; default: the engine's
    seed: int = 0
    configured: bool = False  # the configured datastore (the embedded default's) instead of a synthetic one
    scale_vectors: int | None = None  # the configured datastore scaled up to this many vectors in memory
    replica_noise: float = 0.5  # of the scaled datastore's replicas (`benchmarks.scaled.DatastoreScale`)
    datastore_dir: Path = Path(".bench")
    profile_dir: Path | None = None  # also write a profiler trace of a few searches of each phase here


PROFILED_BATCHES = 3  # searches of each phase in a profiler trace
SYNTHETIC_NLIST = 1024


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True)


SYNTHETIC_BLOCK = 1 << 12  # rows made at once; a block's noise has its own seed, so any slice is the same every time
# (a slice makes whole blocks: few rows each, so that its ends cost little)


class SyntheticRows:
    """A synthetic datastore's vectors in list order, made a block at a time as they are written,
    so that a datastore larger than memory is never held: row p of list c is
    normalise(centre_c + 1.2 · normalise(g)), g standard normal from its block's own generator."""

    def __init__(self, centres: np.ndarray, offsets: np.ndarray, codec: Codec, seed: int, device: torch.device) -> None:
        self.centres = torch.from_numpy(centres).to(device)
        self.offsets, self.codec, self.seed, self.device = offsets, codec, seed, device
        self.shape = (int(offsets[-1]), centres.shape[1])
        self.dtype = np.dtype(codec.numpy_dtype)
        blocks = -(-self.shape[0] // SYNTHETIC_BLOCK)
        spread = np.unique(np.linspace(0, blocks - 1, min(blocks, 8)).round().astype(int))  # the sq8 ranges' sample
        self.params = codec.train(np.concatenate([self._floats(int(b)) for b in spread])) if codec.has_params else None

    def _floats(self, block: int) -> np.ndarray:
        start, stop = block * SYNTHETIC_BLOCK, min(self.shape[0], (block + 1) * SYNTHETIC_BLOCK)
        owner = torch.from_numpy(np.searchsorted(self.offsets, np.arange(start, stop), side="right") - 1).to(self.device)
        seed = int(np.random.SeedSequence([self.seed, block]).generate_state(1)[0])
        generator = torch.Generator(self.device).manual_seed(seed)
        noise = torch.randn(stop - start, self.shape[1], generator=generator, device=self.device)
        return _normalise(self.centres[owner] + 1.2 * _normalise(noise)).cpu().numpy()

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, _ = rows.indices(self.shape[0])
        first, last = start // SYNTHETIC_BLOCK, -(-stop // SYNTHETIC_BLOCK)
        floats = np.concatenate([self._floats(b) for b in range(first, last)]) if stop > start else np.empty((0, self.shape[1]))
        at = start - first * SYNTHETIC_BLOCK
        return self.codec.to_codes(floats[at : at + stop - start], self.params)


def synthetic_datastore(config: BenchConfig, progress: bool = True) -> Path:
    """Build (or reuse) a datastore of clustered unit vectors: cluster sizes vary log-normally,
    as real IVF lists do; each vector is its centre plus noise and lives in its centre's list;
    near lists are adjacent in the file, as a built datastore's are (`order_centroids`). Written
    a block at a time (`SyntheticRows`): its size is bounded by the disk, not by memory. One kept
    from before list statistics were stored gets them (`add_list_stats`)."""
    nlist = config.nlist or SYNTHETIC_NLIST
    name = f"synthetic-v2-n{config.vectors}-d{config.dim}-l{nlist}-{config.codec}-s{config.seed}"
    path = Path(config.datastore_dir) / name
    if (path / "manifest.json").is_file():
        add_list_stats(path, verify_checksums=False, progress=progress)
        return path
    device = resolve_device(config.device, error=DeviceUnavailable)
    gen = torch.Generator(device=device).manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    centres = _normalise(torch.randn(nlist, config.dim, generator=gen, device=device)).cpu().numpy()
    centres = np.ascontiguousarray(centres[order_centroids(centres)])
    weights = rng.lognormal(0.0, 0.6, nlist)
    offsets = np.concatenate(([0], np.cumsum(rng.multinomial(config.vectors, weights / weights.sum())))).astype(np.int64)
    rows = SyntheticRows(centres, offsets, Codec(config.codec), config.seed, device)
    manifest = Manifest("synthetic", config.dim, nlist, config.vectors, codec=config.codec, source="synthetic")
    return write_datastore(
        path,
        manifest=manifest,
        centroids=centres,
        offsets=offsets,
        vectors=rows,
        passages=None,
        codec_params=rows.params,
        progress=progress,
    )


def near_stored(datastore: Datastore, rows: np.ndarray, noise: float, rng: np.random.Generator) -> np.ndarray:
    """Queries that land where passages are: the stored vectors of `rows` (decoded) plus
    Gaussian noise of norm about `noise`, normalised."""
    params = None if datastore.codec_params is None else torch.from_numpy(datastore.codec_params)
    stored = datastore.codec.decode(torch.from_numpy(np.asarray(datastore.vectors[rows])), params).numpy()
    q = stored + noise * rng.standard_normal(stored.shape).astype(np.float32) / np.sqrt(datastore.dim)
    return np.ascontiguousarray(q / np.linalg.norm(q, axis=1, keepdims=True), dtype=np.float32)


def query_pairs(datastore: Datastore, config: BenchConfig) -> tuple[np.ndarray, np.ndarray]:
    """q_in near the data, and q_out = normalise(q_in + noise): more noise, less overlap. With
    `distinct_queries`, the stream repeats pairs drawn by a Zipf law (the popular ones often)."""
    rng = np.random.default_rng(config.seed + 1)
    distinct = config.distinct_queries or config.queries
    rows = rng.integers(0, datastore.n_vectors, distinct)
    q_in = near_stored(datastore, np.sort(rows), 0.5, rng)
    q_out = q_in + config.overlap_noise * rng.standard_normal(q_in.shape).astype(np.float32) / np.sqrt(datastore.dim)
    q_out /= np.linalg.norm(q_out, axis=1, keepdims=True)
    if config.distinct_queries:
        popularity = 1.0 / np.arange(1, distinct + 1)
        stream = rng.choice(distinct, size=config.queries, p=popularity / popularity.sum())
        q_in, q_out = q_in[stream], q_out[stream]
    return q_in.astype(np.float32), q_out.astype(np.float32)


def peak_copy_gbps(device: torch.device, nbytes: int = 1 << 30) -> float | None:
    """Pinned host -> device copy rate of one large copy (the ceiling for prefetch)."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dest = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for _ in range(5):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        dest.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(nbytes / (begin.elapsed_time(end) / 1e3) / 1e9)
    return float(np.median(rates[1:]))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Phase:
    """Per-batch measurements of one way of searching (the first batch, a warm-up, is left out)."""

    total_ms: list[float] = field(default_factory=list)
    device_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)
    probe_ms: list[float] = field(default_factory=list)
    identical: list[bool] = field(default_factory=list)
    overlap: list[float] = field(default_factory=list)
    device_fraction: list[float] = field(default_factory=list)  # of each query's nprobe clusters
    demand_fraction: list[float] = field(default_factory=list)  # of each query's nprobe clusters, copied on demand
    copy_ms: list[float] = field(default_factory=list)  # the prefetch copies, timed on the copy stream
    copied: list[int] = field(default_factory=list)
    missed_bytes: list[int] = field(default_factory=list)  # per batch: probed bytes not resident


def _p50(values: Sequence[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def _search_once(
    engine: RetrievalEngine, q_in: np.ndarray | None, q_out: np.ndarray, config: BenchConfig, budget: int
) -> tuple[SearchResult, float, tuple[float, int] | None]:
    """Prefetch q_in (unless None), let the copies land (they overlap the pre-retrieval LLM
    call in a real request), then time the search of q_out. Returns the result, its wall time
    in ms, and the prefetch's (copy ms, bytes copied) when it copied on a CUDA stream."""
    handle = engine.prefetch(q_in, budget) if q_in is not None else None
    copied = None
    lease = None if handle is None else handle.lease
    if lease is not None and isinstance(lease.arrival, CopyWindow):
        lease.arrival.wait()
        copied = (lease.arrival.elapsed_ms() or 0.0, lease.bytes_copied)
    _sync(engine.device)
    t0 = time.perf_counter()
    result = engine.search(q_out, config.topk, engine.nprobe, prefetch=handle)
    elapsed = (time.perf_counter() - t0) * 1e3
    if handle is not None:
        handle.release()
    return result, elapsed, copied


def _search_phase(
    engine: RetrievalEngine,
    q_in: np.ndarray | None,
    q_out: np.ndarray,
    batches: list[slice],
    references: list[tuple[np.ndarray, np.ndarray]],
    config: BenchConfig,
    budget: int,
    label: str,
    progress: bool,
) -> _Phase:
    """Search every batch as `_search_once` does, checking each answer against faiss's."""
    phase = _Phase()
    for i, batch in enumerate(tqdm(batches, desc=label, disable=not progress)):
        result, elapsed, copied = _search_once(engine, None if q_in is None else q_in[batch], q_out[batch], config, budget)
        if copied is not None:
            phase.copy_ms.append(copied[0])
            phase.copied.append(copied[1])
        ref_scores, ref_ids = references[i]
        phase.identical.extend(
            same_results(result.ids[j], result.scores[j], ref_ids[j], ref_scores[j]) for j in range(len(ref_ids))
        )
        phase.overlap.extend(s.overlap_rate for s in result.per_query if s.overlap_rate is not None)
        phase.device_fraction.extend(s.clusters_device / engine.nprobe for s in result.per_query)
        phase.demand_fraction.extend(s.clusters_copied_on_demand / engine.nprobe for s in result.per_query)
        if i:
            phase.total_ms.append(elapsed)
            phase.device_ms.append(result.device_ms)
            phase.cpu_ms.append(result.cpu_ms)
            phase.probe_ms.append(result.probe_ms)
            phase.missed_bytes.append(result.missed_bytes)
    if config.profile_dir is not None:
        _profile_phase(engine, q_in, q_out, batches, config, budget, label, config.profile_dir)
    return phase


def _profile_phase(
    engine: RetrievalEngine,
    q_in: np.ndarray | None,
    q_out: np.ndarray,
    batches: list[slice],
    config: BenchConfig,
    budget: int,
    label: str,
    out: Path,
) -> None:
    """Prefetch and search a few batches again under torch's profiler (Python calls, host ops
    and, on CUDA, kernels and copies; not timed) and write into `out` the trace,
    `<label>.json.gz` (Chrome's format; Perfetto opens it), and `<label>.txt`, the ops that took
    longest."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    name = label.replace(" + ", "-").replace(" ", "-")
    out.mkdir(parents=True, exist_ok=True)
    with profile(activities=activities, with_stack=True) as prof:
        for batch in batches[1 : 1 + PROFILED_BATCHES]:
            _search_once(engine, None if q_in is None else q_in[batch], q_out[batch], config, budget)
    prof.export_chrome_trace(str(out / f"{name}.json.gz"))
    # host time (Python calls and ops) first, then, on CUDA, device time (kernels and copies)
    orders = ["self_cpu_time_total"] + (["self_device_time_total"] if engine.device.type == "cuda" else [])
    tables = [prof.key_averages().table(sort_by=order, row_limit=30) for order in orders]
    (out / f"{name}.txt").write_text("\n\n".join(tables) + "\n", encoding="utf-8")


def run(config: BenchConfig, progress: bool = True) -> dict:
    """Time faiss, ours (prefetch at the budget), ours with demand copies, everything resident,
    and faiss's scan with exact early stop over the same queries."""
    datastore = open_datastore(config, progress)
    device = resolve_device(config.device, error=DeviceUnavailable)
    mb = 1 << 20
    budget = int(config.budget_mb * mb)
    cache_bytes = int((config.cache_mb if config.cache_mb is not None else config.budget_mb) * mb)
    engine = RetrievalEngine(
        datastore,
        device=device,
        cache_bytes=cache_bytes,
        nprobe=config.nprobe,
        cpu_threads=config.cpu_threads,
        demand_copy=False,
        progress=progress,
    )
    row_bytes = engine.cache.row_bytes
    demand_bytes = int(config.demand_mb * mb)
    q_in, q_out = query_pairs(datastore, config)
    batches = [slice(s, s + config.batch) for s in range(0, config.queries, config.batch)]

    faiss_ms, faiss_tuned_ms, references = _faiss_phase(engine, q_out, batches, config, progress)
    early_stop = early_stop_phase(engine, q_out, batches, references, config.topk, progress)
    ours = _search_phase(engine, q_in, q_out, batches, references, config, budget, "ours", progress)
    engine.resize_cache(cache_bytes + demand_bytes, demand_copy=True)
    demand = _search_phase(engine, q_in, q_out, batches, references, config, budget, "ours + demand copies", progress)
    # What the missed bytes allow at best: copied and scanned by faiss at once, at the rates measured
    rates = engine.demand
    together = (rates.copy_bytes_per_ms or 0.0) + (rates.cpu_bytes_per_ms or 0.0) if rates is not None else 0.0
    missed_ms = _p50([m / together for m in demand.missed_bytes]) if together else float("nan")
    # The best possible: every cluster resident, same search code.
    engine.resize_cache(datastore.n_vectors * row_bytes, demand_copy=False)
    everything = engine.cache.acquire(range(datastore.nlist), fetch=True)
    _sync(device)
    resident = _search_phase(engine, None, q_out, batches, references, config, budget, "all resident", progress)
    everything.release()

    copy_gbps = sum(ours.copied) / (sum(ours.copy_ms) / 1e3) / 1e9 if ours.copy_ms and sum(ours.copy_ms) > 0 else None
    peak = peak_copy_gbps(device)
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "datastore": datastore.where,
        "n_vectors": datastore.n_vectors,
        "dim": datastore.dim,
        "nlist": datastore.nlist,
        "nprobe": engine.nprobe,
        "topk": config.topk,
        "batch": config.batch,
        "queries": config.queries,
        "codec": config.codec,
        "budget_bytes": budget,
        "cache_bytes": cache_bytes,
        "demand_cache_bytes": cache_bytes + demand_bytes,
        "datastore_bytes": datastore.n_vectors * row_bytes,
        **_comparison(faiss_ms, faiss_tuned_ms, ours, demand, resident, missed_ms, early_stop),
        "copy_gbps": copy_gbps,
        "copy_gbps_peak": peak,
        "copy_fraction_of_peak": copy_gbps / peak if copy_gbps and peak else None,
    }


def _faiss_phase(
    engine: RetrievalEngine, q_out: np.ndarray, batches: list[slice], config: BenchConfig, progress: bool
) -> tuple[list[float], list[float], list[tuple[np.ndarray, np.ndarray]]]:
    """faiss alone on every batch, default-threaded and tuned: the two timings (the first batch,
    a warm-up, left out) and the tuned search's answers, the reference every other phase must match."""
    faiss_ms, faiss_tuned_ms, references = [], [], []
    for i, batch in enumerate(tqdm(batches, desc="faiss", disable=not progress)):
        t0 = time.perf_counter()
        engine.index.search(q_out[batch], config.topk, engine.nprobe, tuned=False)
        faiss_time = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        references.append(engine.index.search(q_out[batch], config.topk, engine.nprobe))
        if i:  # the first batch warms up
            faiss_ms.append(faiss_time)
            faiss_tuned_ms.append((time.perf_counter() - t0) * 1e3)
    return faiss_ms, faiss_tuned_ms, references


def open_datastore(config: BenchConfig, progress: bool) -> Datastore:
    """The datastore `config` names: a synthetic one (built once, kept in `datastore_dir`), or
    the configured one (its list statistics added if the embedded default's cache predates them,
    as the serve path adds them), scaled up in memory with `scale_vectors`."""
    if not (config.configured or config.scale_vectors):
        path = synthetic_datastore(config, progress)
        datastore = Datastore.load(path, verify_checksums=False)
        if datastore.manifest.embedder != "synthetic":
            raise DatastoreError(f"{path} is not a synthetic benchmark datastore")
        return datastore
    retrieval = load_settings().retrieval
    datastore = load_configured_datastore(retrieval, load_embedder(retrieval), early_stop=True)
    if config.scale_vectors:
        scale = DatastoreScale(vectors=config.scale_vectors, nlist=config.nlist, noise=config.replica_noise, seed=config.seed)
        datastore = scaled_datastore(datastore, scale, device=config.device, progress=progress)
    return datastore


def _comparison(
    faiss_ms: list[float],
    faiss_tuned_ms: list[float],
    ours: _Phase,
    demand: _Phase,
    resident: _Phase,
    missed_ms: float,
    early_stop: EarlyStopTimes,
) -> dict:
    """The phases' timings side by side, the speedups between them and how many answers matched."""
    faiss_p50, ours_p50, demand_p50, resident_p50 = (
        _p50(faiss_ms),
        _p50(ours.total_ms),
        _p50(demand.total_ms),
        _p50(resident.total_ms),
    )
    return {
        "overlap_rate": float(np.mean(ours.overlap)) if ours.overlap else None,
        "device_cluster_fraction": float(np.mean(ours.device_fraction)),
        "faiss_ms_p50": faiss_p50,
        "ours_ms_p50": ours_p50,
        "resident_ms_p50": resident_p50,
        "faiss_ms_p99": float(np.percentile(faiss_ms, 99)) if faiss_ms else None,
        "ours_ms_p99": float(np.percentile(ours.total_ms, 99)) if ours.total_ms else None,
        "speedup_vs_faiss": faiss_p50 / ours_p50,
        "speedup_vs_faiss_tuned": _p50(faiss_tuned_ms) / ours_p50,
        "ours_vs_resident": ours_p50 / resident_p50,
        "ours_demand_ms_p50": demand_p50,
        "ours_demand_ms_p99": float(np.percentile(demand.total_ms, 99)) if demand.total_ms else None,
        "speedup_vs_faiss_demand": faiss_p50 / demand_p50,
        "demand_vs_resident": demand_p50 / resident_p50,
        # the bound: the longer of the all-resident search and the missed bytes over both rates together
        "demand_bound_ms": max(resident_p50, missed_ms),
        "demand_vs_bound": demand_p50 / max(resident_p50, missed_ms),
        "missed_mb_p50": _p50(demand.missed_bytes) / (1 << 20),
        "demand_device_cluster_fraction": float(np.mean(demand.device_fraction)),
        "demand_copied_fraction": float(np.mean(demand.demand_fraction)),
        "identical_fraction": float(np.mean(ours.identical + demand.identical + resident.identical + early_stop.identical)),
        # faiss at the same nprobe vs its scan with exact early stop, by turns on each batch
        "early_stop_faiss_ms_p50": _p50(early_stop.faiss_ms),
        "early_stop_ms_p50": _p50(early_stop.early_stop_ms),
        "early_stop_speedup": _p50(early_stop.faiss_ms) / _p50(early_stop.early_stop_ms),
        "lists_scanned_fraction": early_stop.lists_scanned_fraction,
        "early_stop_identical_fraction": float(np.mean(early_stop.identical)),
        "faiss_tuned_ms_p50": _p50(faiss_tuned_ms),
        "ours_device_ms_p50": _p50(ours.device_ms),
        "ours_cpu_ms_p50": _p50(ours.cpu_ms),
        "ours_probe_ms_p50": _p50(ours.probe_ms),
        "demand_device_ms_p50": _p50(demand.device_ms),
        "demand_cpu_ms_p50": _p50(demand.cpu_ms),
        "resident_device_ms_p50": _p50(resident.device_ms),
    }


def format_table(result: dict) -> str:
    return key_value_table(result, float_format=".4g")


def config_dict(config: BenchConfig) -> dict:
    """The config as JSON-ready values (paths as strings)."""
    return {key: str(value) if isinstance(value, Path) else value for key, value in asdict(config).items()}
