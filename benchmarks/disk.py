"""`telerag bench disk`: a datastore searched from disk (`retrieval.disk`), side by side in one run
with faiss over the same lists on disk (`OnDiskInvertedLists`, its own file, read through the page
cache) and with every probed list already in memory (the bound), on a synthetic clustered datastore
(`benchmarks.retrieval.synthetic_datastore`) and q_in/q_out pairs (`query_pairs`).

Per batch size, over the same queries: faiss on disk, cold (before each search its index opened
anew, so that none of its file is mapped, and the page cache dropped, as root) and warm (each
search run once untimed first); ours with
a host cache of `host_cache_mb` (with `device`: a device cache of `cache_mb` over a host tier of
`host_cache_mb`), cold (every tier emptied before each search) without
lookahead (every list read when searched) and with it (q_in's lists read during a pre-retrieval
call of `llm_ms`, planned within B·t_LLM, then q_out searched); ours cold reporting its top-k so
far (a chunk of the lists at a time, as speculative prefill asks: `retrieval.provisional`); ours
cold with exact early stop (`experiments.early_stop`: the lists the bound rules out are never
read), alone and reporting its top-k so far; ours with the whole datastore in its cache (the
bound). Each row: search p50 ms, MB read per search, and, with lookahead, the share of the
search's lists already read when it began (the disk time masked). Answers are checked against
faiss in memory at the same nprobe."""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import faiss as typed_faiss
import numpy as np
from tqdm.auto import tqdm

from telerag.benchmarks.report import key_value_table
from telerag.benchmarks.retrieval import BenchConfig, query_pairs, synthetic_datastore
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.ivf import CPUIndex, same_results
from telerag.retrieval.provisional import UNWATCHED, Provisional, ProvisionalWatch

faiss: Any = typed_faiss  # its on-disk lists' merge and ownership live below its stubs (as in `retrieval.ivf`)
ONDISK = "faiss-ondisk"  # faiss's own files, beside the datastore's


@dataclass
class DiskBenchConfig:
    vectors: int = 1_000_000
    dim: int = 384
    nlist: int | None = None  # default: 4*sqrt(vectors)
    nprobe: int | None = None  # default: 4*sqrt(nlist), the server's
    topk: int = 10
    batches: tuple[int, ...] = (1, 8)
    queries: int = 32
    host_cache_mb: float = 256.0
    device: str = "cpu"  # cuda: ours through a host tier of host_cache_mb into a device cache of cache_mb
    cache_mb: float | None = None  # the device cache (default on CUDA: host_cache_mb; on the CPU, given: the CPU as the device)
    llm_ms: float = 1000.0  # the pre-retrieval call the lookahead reads during (HyDE's on two cores: about a second)
    overlap_noise: float = 0.3
    seed: int = 0
    datastore_dir: Path = Path(".bench")


@dataclass
class Row:
    """One way of searching at one batch size."""

    name: str
    batch: int
    search_ms_p50: float
    search_ms_mean: float
    mb_read_per_search: float  # ours: by the search and its prefetch
    masked: float | None  # of the search's lists' bytes, the share read and landed before it began (lookahead)
    identical: float  # share of queries whose answer is faiss's in memory


def run(config: DiskBenchConfig, progress: bool = True) -> dict[str, Any]:
    nlist = config.nlist or max(1, round(4 * np.sqrt(config.vectors)))
    synthetic = BenchConfig(
        vectors=config.vectors, dim=config.dim, nlist=nlist, seed=config.seed, datastore_dir=config.datastore_dir
    )
    path = synthetic_datastore(synthetic, progress=progress)
    datastore = Datastore.load(path, verify_checksums=False)
    q_in, q_out = query_pairs(
        datastore, BenchConfig(queries=config.queries, overlap_noise=config.overlap_noise, seed=config.seed)
    )
    memory = RetrievalEngine(datastore, nprobe=config.nprobe)
    nprobe = memory.nprobe
    _ondisk_index(datastore, path / ONDISK, progress)  # made once, kept beside the datastore
    ondisk = functools.partial(_ondisk_index, datastore, path / ONDISK, False)
    rows: list[Row] = []
    dropped = drop_page_cache()
    ours = functools.partial(_our_engine, datastore, config, nprobe)
    read_gbps: list[float] = []  # as each batch size's engine measured it at start
    for batch in config.batches:
        slices = [slice(s, s + batch) for s in range(0, config.queries, batch)]
        references = [memory.index.search(q_out[s], config.topk, nprobe) for s in slices]
        for name, cold in (("faiss on disk, cold", True), ("faiss on disk, warm", False)):
            drop_page_cache()
            rows.append(_faiss_rows(name, batch, ondisk, q_out, slices, references, config, nprobe, cold, progress))
        engine = ours()
        read_gbps.append((engine.copy_bytes_per_ms or 0.0) / 1e6)  # B of the lookahead's budget B·t_LLM
        for name, lookahead, cold, watched in (
            ("ours, cold, reads on demand", False, True, False),
            ("ours, cold, lookahead", True, True, False),
            ("ours, warm, lookahead", True, False, False),
            ("ours, cold, top-k so far", False, True, True),
        ):
            _empty(engine)
            searches = Searches(q_in if lookahead else None, q_out, slices, references, watched)
            rows.append(_our_rows(name, batch, engine, searches, config, cold, progress))
        engine.close()
        if datastore.list_stats is not None:  # exact early stop: the lists it rules out are not read
            stopping = ours(early_stop=True)
            for name, watched in (("ours, cold, early stop", False), ("ours, cold, early stop, top-k so far", True)):
                searches = Searches(None, q_out, slices, references, watched)
                rows.append(_our_rows(name, batch, stopping, searches, config, True, progress))
            stopping.close()
        bound = _bound_row(datastore, batch, Searches(None, q_out, slices, references), memory, ours, config, progress)
        rows.extend([bound] if bound is not None else [])
    memory.close()
    return {
        "datastore": datastore.where,
        "n_vectors": datastore.n_vectors,
        "dim": datastore.dim,
        "nlist": datastore.nlist,
        "nprobe": nprobe,
        "topk": config.topk,
        "queries": config.queries,
        "datastore_bytes": _datastore_bytes(datastore),
        "host_cache_bytes": int(config.host_cache_mb * 2**20),
        "device": config.device,
        "read_gbps": read_gbps,
        "llm_ms": config.llm_ms,
        "page_cache_dropped": dropped,
        "faiss_threads": faiss.omp_get_max_threads(),
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rows": [asdict(row) for row in rows],
    }


def _faiss_rows(
    name: str,
    batch: int,
    open_index: Callable[[], Any],
    q_out: np.ndarray,
    slices: list[slice],
    references: list,
    config: DiskBenchConfig,
    nprobe: int,
    cold: bool,
    progress: bool,
) -> Row:
    """faiss over its on-disk lists, read through the page cache, which it maps: `cold`, the index
    opened anew and the page cache dropped before each search (a page still mapped is not dropped);
    warm, each search run once untimed first, so that its lists are in the page cache."""
    times, same = [], []
    params: Any = faiss.SearchParametersIVF()
    params.nprobe = nprobe
    index = open_index()
    for i, s in enumerate(tqdm(slices, desc=name, disable=not progress)):
        if cold:
            del index  # its lists unmapped
            index = open_index()
            drop_page_cache()
        else:
            index.search(q_out[s], config.topk, params=params)  # its lists in the page cache
        started = time.perf_counter()
        scores, ids = index.search(q_out[s], config.topk, params=params)
        times.append((time.perf_counter() - started) * 1e3)
        same += _same(ids, scores, references[i])
    return Row(name, batch, float(np.median(times)), float(np.mean(times)), float("nan"), None, float(np.mean(same)))


@dataclass(frozen=True)
class Searches:
    """One batch size's searches: each q_out batch (`slices`), its q_in (None: no lookahead) and
    faiss's answer; `watched`: each search reports its top-k so far (to nobody: what it costs)."""

    q_in: np.ndarray | None
    q_out: np.ndarray
    slices: list[slice]
    references: list[tuple[np.ndarray, np.ndarray]]
    watched: bool = False


def _our_engine(
    datastore: Datastore, config: DiskBenchConfig, nprobe: int, *, cache_bytes: int | None = None, early_stop: bool = False
) -> RetrievalEngine:
    """Ours from disk: on the CPU a host cache of `host_cache_mb` (or `cache_bytes`); on a device (or
    with `cache_mb`) a cache there of `cache_mb` (or `cache_bytes`) over a host tier of `host_cache_mb`."""
    host_bytes = int(config.host_cache_mb * 2**20)
    device_bytes = int((config.cache_mb if config.cache_mb is not None else config.host_cache_mb) * 2**20)
    tiered = config.device != "cpu" or config.cache_mb is not None
    return RetrievalEngine(
        datastore,
        device=config.device,
        cache_bytes=cache_bytes or device_bytes,
        host_cache_bytes=host_bytes if tiered else 0,
        nprobe=nprobe,
        on_disk=True,
        early_stop=early_stop,
    )


def _empty(engine: RetrievalEngine) -> None:
    """Every tier of `engine`'s cache emptied (the copies still landing landed first): a cold start."""
    engine.cache.evict_all()
    if engine.host_cache is not None:
        engine.host_cache.evict_all()


def _our_rows(
    name: str, batch: int, engine: RetrievalEngine, searches: Searches, config: DiskBenchConfig, cold: bool, progress: bool
) -> Row:
    """Ours from disk: `cold`, its caches emptied before each search (and its prefetch); with
    `q_in`, each search's prefetch issued a pre-retrieval call (`llm_ms`) before it."""
    rows = engine.files
    assert rows is not None
    q_in, q_out = searches.q_in, searches.q_out
    times, same, read, masked = [], [], [], []
    for i, s in enumerate(tqdm(searches.slices, desc=name, disable=not progress)):
        if cold:
            _empty(engine)
        before = rows.bytes_read
        handle = None
        if q_in is not None:
            budget = int((engine.copy_bytes_per_ms or 0.0) * config.llm_ms)  # B · t_LLM
            handle = engine.prefetch(q_in[s], budget)
            time.sleep(config.llm_ms / 1e3)  # the pre-retrieval call the reads run beside
            probed = engine.index.probe(q_out[s], engine.nprobe)[1]
            masked.append(_masked(engine, probed))
        started = time.perf_counter()
        watch = ProvisionalWatch(_unread) if searches.watched else UNWATCHED
        result = engine.search(q_out[s], config.topk, engine.nprobe, prefetch=handle, watch=watch)
        times.append((time.perf_counter() - started) * 1e3)
        read.append((rows.bytes_read - before) / 2**20)
        same += _same(result.ids, result.scores, searches.references[i])
    masked_share = float(np.mean(masked)) if masked else None
    return Row(
        name, batch, float(np.median(times)), float(np.mean(times)), float(np.mean(read)), masked_share, float(np.mean(same))
    )


def _bound_row(
    datastore: Datastore,
    batch: int,
    searches: Searches,
    memory: RetrievalEngine,
    ours: Callable[..., RetrievalEngine],
    config: DiskBenchConfig,
    progress: bool,
) -> Row | None:
    """Ours with every list each search probes read into the cache (on a device, the device's)
    before it (the bound): a cache as large as the most any one search probes, not the whole
    datastore, which need not fit in memory; None (not measured) where that is more than half
    the memory available."""
    probed = [np.unique(memory.index.probe(searches.q_out[s], memory.nprobe)[1]) for s in searches.slices]
    sizes = np.diff(datastore.offsets) * datastore.dim * datastore.vectors.itemsize
    cache_bytes = max(int(sizes[p].sum()) for p in probed)
    if cache_bytes > _available_bytes() // 2:
        return None  # the bound would not fit beside everything else: not measured
    engine = ours(cache_bytes=cache_bytes)
    times, same = [], []
    try:
        for i, s in enumerate(tqdm(searches.slices, desc="ours, every list in memory", disable=not progress)):
            held = engine.cache.acquire(probed[i], fetch=True)
            for arrival in held.arrivals:
                arrival.wait()
            started = time.perf_counter()
            result = engine.search(searches.q_out[s], config.topk, engine.nprobe)
            times.append((time.perf_counter() - started) * 1e3)
            held.release()
            same += _same(result.ids, result.scores, searches.references[i])
    finally:
        engine.close()
    return Row(
        "ours, every list in memory", batch, float(np.median(times)), float(np.mean(times)), 0.0, None, float(np.mean(same))
    )


def _unread(report: Provisional) -> None:
    """A top-k so far nobody acts on."""


def _masked(engine: RetrievalEngine, probed: np.ndarray) -> float:
    """Of the bytes of the lists a search probes (each once), the share already read into the
    cache, landed, when it begins: what it need not wait for."""
    sizes = engine.cache.sizes
    wanted = np.unique(probed[probed >= 0])
    total = int(sizes[wanted].sum())
    return float(sizes[wanted[engine.cache.landed_mask()[wanted]]].sum()) / total if total else 1.0


def _same(ids: np.ndarray, scores: np.ndarray, reference: tuple[np.ndarray, np.ndarray]) -> list[bool]:
    ref_scores, ref_ids = reference
    return [same_results(ids[j], scores[j], ref_ids[j], ref_scores[j]) for j in range(len(ids))]


def _available_bytes() -> int:
    """The memory Linux says is available now (MemAvailable); elsewhere, as good as unbounded."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def _datastore_bytes(datastore: Datastore) -> int:
    return datastore.n_vectors * datastore.dim * datastore.vectors.itemsize


def _ondisk_index(datastore: Datastore, where: Path, progress: bool) -> Any:
    """faiss's IVF over the datastore's lists with `OnDiskInvertedLists` in a file of its own (made
    once, kept beside the datastore): what faiss offers for lists larger than memory."""
    index_file, lists_file = where / "index.faissindex", where / "lists.ivfdata"
    if not index_file.is_file():
        where.mkdir(parents=True, exist_ok=True)
        index, quantizer = datastore.codec.empty_faiss_index(datastore.centroids, datastore.codec_params)
        invlists = faiss.OnDiskInvertedLists(datastore.nlist, index.code_size, str(lists_file))
        source = CPUIndex(datastore)  # faiss's lists over the memory map, merged into its on-disk ones (faiss.contrib.ondisk)
        merged = faiss.InvertedListsPtrVector()
        merged.push_back(source.lists)
        index.ntotal = invlists.merge_from_multiple(merged.data(), merged.size(), False)
        index.replace_invlists(invlists, True)
        invlists.this.disown()
        faiss.write_index(index, str(index_file))  # the quantizer with it: alive till here (faiss does not own it)
        del quantizer
    with _stdout_silenced():  # faiss prints where it finds the lists file, on every open
        return faiss.read_index(str(index_file), faiss.IO_FLAG_ONDISK_SAME_DIR)


@contextlib.contextmanager
def _stdout_silenced() -> Iterator[None]:
    """File descriptor 1 sent to /dev/null (what C++ prints, not only Python's `print`)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def drop_page_cache() -> bool:
    """Empty the page cache (root only, Linux): a cold run reads from the disk. False where it cannot."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as control:
            control.write("1\n")
        return True
    except OSError:
        return False


def format_table(result: dict[str, Any]) -> str:
    head = key_value_table({key: value for key, value in result.items() if key != "rows"}, float_format=".1f")
    width = max(len("way of searching"), *(len(row["name"]) for row in result["rows"]))
    lines = [
        head,
        "",
        f"{'way of searching':<{width}} {'batch':>5} {'p50 ms':>9} {'mean ms':>9} {'MB read':>9} {'masked':>7} {'same':>5}",
    ]
    for row in result["rows"]:
        masked = "" if row["masked"] is None else f"{row['masked']:.2f}"
        mb = "" if row["mb_read_per_search"] != row["mb_read_per_search"] else f"{row['mb_read_per_search']:.1f}"
        lines.append(
            f"{row['name']:<{width}} {row['batch']:>5} {row['search_ms_p50']:>9.1f} {row['search_ms_mean']:>9.1f} {mb:>9}"
            f" {masked:>7} {row['identical']:>5.2f}"
        )
    return "\n".join(lines)
