"""A real datastore scaled up to the size retrieval costs at in production: every vector of the
base plus noisy replicas of it, each replica mapped back to its source's passage.

Real pipeline text (queries written by a real LLM, embedded by the real embedder) then meets
clusters of realistic count and size (e.g. 4M vectors in 4096 lists, nprobe 256, as TeleRAG
measured), while every document retrieved is still a real passage. The result is cached: the
directory name holds the base's vectors checksum and every parameter. `open_scaled_retriever`
opens the configured retriever over the configured datastore so scaled (`telerag bench e2e`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from telerag.pipelines.retriever import DirectRetriever
from telerag.retrieval.builder import assign_lists, default_nlist, train_centroids, write_clustered
from telerag.retrieval.codecs import Codec
from telerag.retrieval.corpus import Passage
from telerag.retrieval.datastore import MANIFEST, VECTORS, Datastore
from telerag.retrieval.errors import DatastoreError
from telerag.retrieval.files import user_cache_dir
from telerag.server.runtime import load_datastore, load_embedder, open_configured_retriever
from telerag.server.settings import RetrievalSettings

log = logging.getLogger(__name__)

REPLICA_BLOCK = 1 << 16  # replicas made per step


@dataclass(frozen=True)
class DatastoreScale:
    """How `open_scaled_retriever` scales the configured datastore: to `vectors` vectors, its
    own and noisy replicas of them."""

    vectors: int
    nlist: int | None = None  # None: 4*sqrt(vectors)
    noise: float = 0.5  # replica = normalise(v + noise*g/sqrt(dim))
    seed: int = 0
    directory: Path | None = None  # where scaled datastores are kept; None: the cache dir's bench/


class ReplicaPassages(Sequence[Passage]):
    """Passage `i` of the scaled datastore is the base's passage `sources[i]`."""

    def __init__(self, base: Sequence[Passage], sources: np.ndarray) -> None:
        self.base, self.sources = base, sources

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, i):  # type: ignore[override]
        return self.base[int(self.sources[i])]

    def __iter__(self) -> Iterator[Passage]:
        return (self.base[s] for s in self.sources.tolist())


def replica_sources(n_base: int, n_vectors: int) -> np.ndarray:
    """Row of the base each vector copies: the base itself first (replica 0, no noise), then
    each base row once more per round, so every passage has as many replicas as any other."""
    return np.arange(n_vectors, dtype=np.int64) % n_base


def replicate(base: np.ndarray, sources: np.ndarray, noise: float, seed: int, progress: bool) -> np.ndarray:
    """float32 unit vectors: row i is base[sources[i]] itself for the first len(base) rows, and
    normalise(base[sources[i]] + noise · g / sqrt(dim)) with g standard normal after them (noise
    0.5 keeps a replica at cosine about 0.9 to its source)."""
    n_base, dim = base.shape
    out = np.empty((len(sources), dim), dtype=np.float32)
    rng = np.random.default_rng(seed)
    for start in tqdm(range(0, len(sources), REPLICA_BLOCK), desc="replicate vectors", unit="block", disable=not progress):
        rows = sources[start : start + REPLICA_BLOCK]
        block = np.asarray(base[rows], dtype=np.float32)
        replicas = np.arange(start, start + len(rows)) >= n_base
        block[replicas] += (noise / np.sqrt(dim)) * rng.standard_normal((int(replicas.sum()), dim), dtype=np.float32)
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        out[start : start + len(rows)] = block
    return out


def scaled_datastore(
    base: Datastore,
    cache_dir: Path,
    *,
    n_vectors: int,
    nlist: int | None = None,
    noise: float = 0.5,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """The base scaled to `n_vectors` (built under `cache_dir` once, reused after), with an IVF
    of `nlist` lists (default: the builder's 4·sqrt(n)) trained on the scaled vectors."""
    if base.codec is not Codec.FP32:
        raise DatastoreError(f"{base.path}: scaling needs an fp32 base datastore, not {base.codec.value}")
    if not base.has_passages:
        raise DatastoreError(f"{base.path}: scaling needs a datastore with passages")
    if n_vectors < base.n_vectors:
        raise DatastoreError(f"cannot scale {base.n_vectors} vectors down to {n_vectors}")
    nlist = nlist or default_nlist(n_vectors)
    digest = str(base.manifest.files[VECTORS]["sha256"])[:12]
    out = Path(cache_dir).expanduser() / f"{base.path.name}-{digest}-n{n_vectors}-l{nlist}-z{noise:g}-s{seed}"
    if (out / MANIFEST).is_file():
        log.info("scaled datastore %s (cached)", out)
        return out
    log.info("scaling %s from %d to %d vectors, %d lists (noise %g)", base.path, base.n_vectors, n_vectors, nlist, noise)
    sources = replica_sources(base.n_vectors, n_vectors)
    vectors = replicate(base.vectors, sources, noise, seed, progress)
    centroids = train_centroids(vectors, nlist, seed=seed)
    lists = assign_lists(vectors, centroids, progress=progress)
    passages = base.passages(range(base.n_vectors))
    return write_clustered(
        out,
        vectors=vectors,
        lists=lists,
        centroids=centroids,
        codec=Codec.FP32,
        embedder=base.manifest.embedder,
        passages=ReplicaPassages(passages, sources),
        source=f"{base.manifest.source or base.path.name}, scaled to {n_vectors} vectors (noise {noise:g})",
        shape=base.manifest.shape,
        progress=progress,
    )


def open_scaled_retriever(retrieval: RetrievalSettings, scale: DatastoreScale | None) -> DirectRetriever:
    """The configured retriever over the configured datastore, or over its scaled copy (built
    once, kept under `scale.directory`)."""
    embedder = load_embedder(retrieval)
    datastore = load_datastore(retrieval, embedder)
    if scale is not None:
        try:
            path = scaled_datastore(datastore, scale.directory or user_cache_dir() / "bench", n_vectors=scale.vectors,
                                    nlist=scale.nlist, noise=scale.noise, seed=scale.seed)
        finally:
            datastore.close()
        datastore = Datastore.load(path, embedder=embedder.name, verify_checksums=retrieval.verify_checksums, progress=True)
    return open_configured_retriever(datastore, embedder, retrieval)
