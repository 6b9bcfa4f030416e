"""A real datastore scaled up, in memory, to the size retrieval costs at in production: every
vector of the base plus noisy replicas of it, each replica mapped back to its source's passage.

Real pipeline text (queries written by a real LLM, embedded by the real embedder) then meets
clusters of realistic count and size (TeleRAG's 21M × 768 fp32 in 4096 lists, nprobe 256),
while every document retrieved is still a real passage. The scaled set is made on the retrieval
device and held in memory, pinned on CUDA so that the engine copies clusters straight from it:
the paper's 61 GB fits a GPU box's 128 GiB of memory but not its 64 GiB disk.

The replicas are made a block of rows at a time, each block from a generator seeded by the seed
and the block's number, so a block is the same every time it is made. Two passes: the first
assigns every replica to its nearest centroid (spherical k-means on the device over a sample of
whole blocks), the second makes each block again and puts its rows into their clusters' places,
so the whole set is never held twice. `open_scaled_retriever` opens the configured retriever over
the configured datastore so scaled (`telerag bench e2e`). Where the scaled set is larger than
memory, `write_scaled_datastore` writes it to disk as a datastore of its own (`telerag datastore
scale`), a window of rows at a time, each replica's passage a copy of its source's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from telerag.config.settings import RetrievalSettings
from telerag.pipelines.retriever import DirectRetriever
from telerag.retrieval.builder import check_nlist, default_nlist, lay_out_clusters
from telerag.retrieval.codecs import Codec
from telerag.retrieval.corpus import Passage
from telerag.retrieval.datastore import DOCUMENTS, Datastore
from telerag.retrieval.datastore_writer import check_target, write_datastore
from telerag.retrieval.documents import DocumentEntry, read_documents
from telerag.retrieval.early_stop import ListStats
from telerag.retrieval.errors import DatastoreError, DeviceUnavailable
from telerag.retrieval.windowed_rows import WindowedRows
from telerag.server.process.runtime import load_configured_datastore, load_embedder, open_configured_retriever
from telerag.utils.device import resolve_device
from telerag.utils.progress import ProgressBar

log = logging.getLogger(__name__)

REPLICA_BLOCK = 1 << 16  # rows made per step; a block's noise comes from its own seed
TRAIN_POINTS_PER_LIST = 256  # the k-means sample, as faiss's IVF training caps it
KMEANS_ITERATIONS = 20
SCORE_ROWS = 1 << 14  # rows scored against every centroid at once (nlist 4096: 256 MB of scores)


@dataclass(frozen=True)
class DatastoreScale:
    """How `open_scaled_retriever` scales the configured datastore: to `vectors` vectors, its
    own and noisy replicas of them, in `nlist` lists."""

    vectors: int
    nlist: int | None = None  # None: 4*sqrt(vectors)
    noise: float = 0.5  # replica = normalise(v + noise*g/sqrt(dim)): cosine about 0.9 to its source
    seed: int = 0


class Replicas:
    """The scaled vectors in row order, made a block at a time on `device`: row i copies base row
    i % n_base, unchanged for the first n_base rows (the base itself) and as
    normalise(v + noise · g / sqrt(dim)), g standard normal, after them."""

    def __init__(self, base: np.ndarray, n_vectors: int, noise: float, seed: int, device: torch.device) -> None:
        self.base = torch.from_numpy(np.array(base, dtype=np.float32)).to(device)  # a copy: the map is read-only
        self.n_base, self.dim = self.base.shape
        self.n_vectors, self.noise, self.seed, self.device = n_vectors, noise, seed, device
        self.n_blocks = -(-n_vectors // REPLICA_BLOCK)

    def rows(self, block: int) -> slice:
        return slice(block * REPLICA_BLOCK, min(self.n_vectors, (block + 1) * REPLICA_BLOCK))

    def block(self, block: int) -> torch.Tensor:
        """float32 (rows, dim) on the device: the rows of `block`, in memory of their own."""
        return self._make(block, *self._buffers())

    def in_turn(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """Every block in order, as (its rows, its vectors), each made in the memory of the one
        before: a block is the caller's only until it asks for the next. A pass over them all
        touches no fresh memory (which costs more to fault in here than a block costs to make)."""
        buffers = self._buffers()
        for block in range(self.n_blocks):
            yield self.rows(block), self._make(block, *buffers)

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's rows and its noise's."""
        shape = (min(REPLICA_BLOCK, self.n_vectors), self.dim)
        return torch.empty(shape, device=self.device), torch.empty(shape, device=self.device)

    def _make(self, block: int, out: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """The rows of `block` made in `out` (`noise`: scratch of as many rows)."""
        rows = self.rows(block)
        out = out[: rows.stop - rows.start]
        torch.index_select(self.base, 0, torch.arange(rows.start, rows.stop, device=self.device) % self.n_base, out=out)
        first = max(0, self.n_base - rows.start)  # rows before it are the base's own
        if first < len(out):
            seed = int(np.random.SeedSequence([self.seed, block]).generate_state(1)[0])
            generator = torch.Generator(self.device).manual_seed(seed)
            replicas = noise[: len(out) - first]
            torch.randn(replicas.shape, generator=generator, device=self.device, out=replicas)
            replicas.mul_(self.noise / self.dim**0.5).add_(out[first:])
            torch.div(replicas, replicas.norm(dim=1, keepdim=True), out=out[first:])
        return out


def nearest_centroid(vectors: torch.Tensor, centroids: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
    """Each vector's nearest centroid by inner product (int64, on the vectors' device); `scores`:
    (`SCORE_ROWS`, centroids) float32 to score in, kept by a caller that asks again."""
    if scores is None:
        scores = score_buffer(centroids)
    return torch.cat([torch.mm(part, centroids.T, out=scores[: len(part)]).argmax(dim=1) for part in vectors.split(SCORE_ROWS)])


def score_buffer(centroids: torch.Tensor) -> torch.Tensor:
    return torch.empty((SCORE_ROWS, len(centroids)), dtype=torch.float32, device=centroids.device)


def spherical_kmeans(points: torch.Tensor, k: int, *, seed: int, progress: bool = False) -> torch.Tensor:
    """k unit centroids for an inner-product IVF: k random points, then Lloyd's steps, each
    centroid the normalised sum of its points; a centroid left with none restarts at a random
    point. On the device: seconds on a GPU for a sample of a million, where faiss's CPU
    training takes minutes."""
    generator = torch.Generator(points.device).manual_seed(seed)
    centroids = points[torch.randperm(len(points), generator=generator, device=points.device)[:k]].clone()
    scores = score_buffer(centroids)
    for _ in ProgressBar(range(KMEANS_ITERATIONS), desc="train IVF lists", unit="step", disable=not progress):
        assigned = nearest_centroid(points, centroids, scores)
        sums = torch.zeros_like(centroids).index_add_(0, assigned, points)
        empty = torch.bincount(assigned, minlength=k) == 0
        if empty.any():
            restart = torch.randint(len(points), (int(empty.sum()),), generator=generator, device=points.device)
            sums[empty] = points[restart]
        centroids = sums / sums.norm(dim=1, keepdim=True)
    return centroids


class ReplicaPassages:
    """Passage `row` of the scaled datastore is the base's passage `sources[row]`."""

    def __init__(self, base: Datastore, sources: np.ndarray) -> None:
        self.base, self.sources = base, sources

    def get(self, rows: Sequence[int]) -> list[Passage]:
        return self.base.passages([int(self.sources[row]) for row in rows])

    def close(self) -> None:
        self.base.close()


@dataclass(frozen=True)
class ScaledLayout:
    """Where every scaled row goes: the lists' centroids and offsets, and each row's place in
    list order (`positions`; `perm` is its inverse: the scaled row at each place)."""

    centroids: np.ndarray
    offsets: np.ndarray
    perm: np.ndarray
    positions: torch.Tensor


def _checked_scale(base: Datastore, scale: DatastoreScale) -> int:
    """The lists of `base` scaled as `scale` says (refused in one line where it cannot be)."""
    nlist = scale.nlist or default_nlist(scale.vectors)
    if base.codec is not Codec.FP32:
        raise DatastoreError(f"{base.where}: scaling needs an fp32 base datastore, not {base.codec.value}")
    if not base.has_passages:
        raise DatastoreError(f"{base.where}: scaling needs a datastore with passages")
    if scale.vectors < base.n_vectors:
        raise DatastoreError(f"cannot scale {base.n_vectors} vectors down to {scale.vectors}")
    check_nlist(nlist, scale.vectors)
    return nlist


def _lay_out(replicas: Replicas, nlist: int, seed: int, progress: bool) -> ScaledLayout:
    """Train `nlist` lists on a sample of whole blocks, spread evenly over the rows, then assign
    every replica to its nearest centroid (the first pass over the blocks)."""
    n = replicas.n_vectors
    wanted = min(n, nlist * TRAIN_POINTS_PER_LIST)
    blocks = np.unique(np.linspace(0, replicas.n_blocks - 1, -(-wanted // REPLICA_BLOCK)).round().astype(int))
    sample = torch.cat([replicas.block(int(b)) for b in blocks])
    centroids = spherical_kmeans(sample, nlist, seed=seed, progress=progress)
    del sample
    lists = np.empty(n, dtype=np.int64)
    scores = score_buffer(centroids)
    every = ProgressBar(replicas.in_turn(), total=replicas.n_blocks, desc="assign lists", unit="block", disable=not progress)
    for rows, block in every:
        lists[rows] = nearest_centroid(block, centroids, scores).cpu().numpy()
    layout = lay_out_clusters(centroids.cpu().numpy(), lists)
    del lists
    positions = torch.empty(n, dtype=torch.int64)
    positions[torch.from_numpy(layout.perm)] = torch.arange(n)
    return ScaledLayout(layout.centroids, layout.offsets, layout.perm, positions)


def scaled_datastore(
    base: Datastore, scale: DatastoreScale, *, device: str | torch.device = "cpu", progress: bool = True
) -> Datastore:
    """The base scaled to `scale.vectors` in memory, made on `device` (pinned host memory on
    CUDA), with an IVF of `scale.nlist` lists trained on the scaled vectors. It owns `base`
    from here on (its passages are the base's): closing it closes the base."""
    device = resolve_device(device, error=DeviceUnavailable)
    nlist = _checked_scale(base, scale)
    n = scale.vectors
    started = time.perf_counter()
    log.info(
        "scaling %s from %d to %d vectors in %d lists on %s (noise %g): %.1f GiB in memory",
        base.where,
        base.n_vectors,
        n,
        nlist,
        device,
        scale.noise,
        n * base.dim * 4 / 2**30,
    )
    replicas = Replicas(base.vectors, n, scale.noise, scale.seed, device)
    layout = _lay_out(replicas, nlist, scale.seed, progress)
    vectors = torch.empty((n, base.dim), dtype=torch.float32, pin_memory=device.type == "cuda")
    every = ProgressBar(replicas.in_turn(), total=replicas.n_blocks, desc="lay out vectors", unit="block", disable=not progress)
    for rows, block in every:
        vectors.index_copy_(0, layout.positions[rows], block.cpu())
    with ProgressBar[None](total=n, desc="list statistics", unit="row", disable=not progress) as bar:
        list_stats = ListStats.of(layout.centroids, layout.offsets, vectors.numpy(), Codec.FP32, None, on_block=bar.update)
    source = f"{base.manifest.source or base.where}, scaled to {n} vectors (noise {scale.noise:g}) in memory"
    manifest = dataclasses.replace(base.manifest, nlist=nlist, n_vectors=n, source=source, created_at=time.time(), files={})
    log.info("scaled datastore made in %.1f s", time.perf_counter() - started)
    return Datastore(
        manifest,
        centroids=layout.centroids,
        offsets=layout.offsets,
        vectors=vectors.numpy(),  # the array keeps the (pinned) tensor alive
        list_stats=list_stats,
        passages=ReplicaPassages(base, layout.perm % base.n_vectors),
        where=f"{base.where} scaled to {n} vectors in memory",
    )


class ScaledRows(WindowedRows):
    """The scaled vectors in list order, as `write_datastore` reads them, made a window of rows
    at a time (`WindowedRows`): each window by making every block of replicas again and keeping
    the rows whose places fall in it, so that the file is written in one sequential pass."""

    def __init__(self, replicas: Replicas, positions: torch.Tensor, codec: Codec, params: np.ndarray | None, window_rows: int):
        super().__init__((replicas.n_vectors, replicas.dim), np.dtype(codec.numpy_dtype), window_rows)
        self.replicas, self.positions, self.codec, self.params = replicas, positions, codec, params

    def make_window(self, first: int, end: int) -> np.ndarray:
        floats = torch.empty((end - first, self.shape[1]), dtype=torch.float32)
        for rows, block in self.replicas.in_turn():
            places = self.positions[rows]
            inside = (places >= first) & (places < end)
            if inside.any():
                floats[places[inside] - first] = block.cpu()[inside]
        return self.codec.to_codes(floats.numpy(), self.params)


def write_scaled_datastore(
    base: Datastore,
    scale: DatastoreScale,
    out_dir: Path,
    *,
    codec: Codec = Codec.FP32,
    window_bytes: int = 4 << 30,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """The base scaled to `scale.vectors` written to `out_dir` as a datastore of its own, larger
    than memory if need be (TeleRAG's 21M × 384 fp32: 32 GB): the lists trained and every replica
    assigned in a first pass over the blocks, the file then written a window of `window_bytes` of
    float32 rows at a time (`ScaledRows`), each replica's passage the base's passage it copies."""
    nlist = _checked_scale(base, scale)
    check_target(out_dir, overwrite=overwrite)  # before the passes, not after them
    n = scale.vectors
    started = time.perf_counter()
    device = torch.device("cpu")
    replicas = Replicas(base.vectors, n, scale.noise, scale.seed, device)
    layout = _lay_out(replicas, nlist, scale.seed, progress)
    params = codec.train(replicas.block(0).numpy()) if codec.has_params else None
    rows = ScaledRows(replicas, layout.positions, codec, params, window_bytes // (base.dim * 4))
    sources = base.ids_of(layout.perm % base.n_vectors)
    source = f"{base.manifest.source or base.where}, scaled to {n} vectors (noise {scale.noise:g}, seed {scale.seed})"
    manifest = dataclasses.replace(
        base.manifest, nlist=nlist, n_vectors=n, codec=codec.value, source=source, created_at=time.time(), files={}
    )
    path = write_datastore(
        out_dir,
        manifest=manifest,
        centroids=layout.centroids,
        offsets=layout.offsets,
        vectors=rows,
        passages=_passages_of(base, sources),
        codec_params=params,
        documents=_documents_of(base, layout.perm % base.n_vectors),
        overwrite=overwrite,
        progress=progress,
    )
    log.info("scaled datastore written to %s in %.1f s (%d windows)", path, time.perf_counter() - started, rows.windows_made)
    return path


def _documents_of(base: Datastore, sources: np.ndarray) -> Iterator[DocumentEntry]:
    """The base's documents, each holding the scaled rows whose passages copy one of its own (a
    row's passage id is its row; `sources`: each row's base row), written with the datastore so
    that a live one learns its documents from one file, not from every passage it holds."""
    passages = base.passages(base.ids_of(np.arange(base.n_vectors)))
    has_file = base.path is not None and DOCUMENTS in base.manifest.files
    entries = read_documents(base.path / DOCUMENTS) if base.path is not None and has_file else {}
    names = list(dict.fromkeys(passage.doc_id for passage in passages))
    number = {doc_id: i for i, doc_id in enumerate(names)}
    document_of_row = np.array([number[passage.doc_id] for passage in passages], dtype=np.int64)[sources]
    rows = np.argsort(document_of_row, kind="stable")
    ends = np.cumsum(np.bincount(document_of_row, minlength=len(names)))
    titles = {passage.doc_id: passage.title for passage in passages}
    for i, doc_id in enumerate(names):
        held = tuple(rows[ends[i - 1] if i else 0 : ends[i]].tolist())
        built = DocumentEntry(doc_id, titles[doc_id], 1, held, None, {}, 0, None)
        yield dataclasses.replace(entries[doc_id], passage_ids=held) if doc_id in entries else built


def _passages_of(base: Datastore, ids: np.ndarray) -> Iterator[Passage]:
    """The base's passages of `ids`, in their order, read a block at a time."""
    for start in range(0, len(ids), REPLICA_BLOCK):
        yield from base.passages(ids[start : start + REPLICA_BLOCK])


def open_scaled_retriever(
    retrieval: RetrievalSettings, scale: DatastoreScale | None, *, early_stop: bool = False
) -> DirectRetriever:
    """The configured retriever over the configured datastore, or over it scaled up in memory on
    the retrieval device; `early_stop`: its faiss half with exact early stop (`experiments.early_stop`)."""
    embedder = load_embedder(retrieval)
    datastore = load_configured_datastore(retrieval, embedder, early_stop=early_stop)
    if scale is not None:
        try:
            datastore = scaled_datastore(datastore, scale, device=retrieval.device)
        except BaseException:
            datastore.close()
            raise
    return open_configured_retriever(datastore, embedder, retrieval, early_stop=early_stop)
