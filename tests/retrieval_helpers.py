"""Small random datastores for the retrieval tests (built in milliseconds, no models)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from telerag.retrieval.builder import assign_lists, train_centroids, write_clustered
from telerag.retrieval.codecs import Codec
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.demand import DemandCopyPolicy

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_datastore(
    path: Path,
    *,
    n: int = 3000,
    dim: int = 16,
    nlist: int = 32,
    codec: Codec = Codec.FP32,
    seed: int = 0,
    duplicates: int = 0,
    empty_lists: int = 0,
) -> Datastore:
    """Unit vectors in `nlist` lists; `duplicates` copies of one vector make exact score ties;
    `empty_lists` extra centroids far from every vector make empty lists."""
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    if duplicates:
        vectors[1 : 1 + duplicates] = vectors[0]
    centroids = train_centroids(vectors, nlist, seed=seed)
    if empty_lists:
        far = -np.abs(rng.standard_normal((empty_lists, dim))).astype(np.float32) * 1e-3
        centroids = np.concatenate([centroids, far])
    lists = assign_lists(vectors, centroids)
    write_clustered(path, vectors=vectors, lists=lists, centroids=centroids, codec=codec, embedder="random")
    return Datastore.load(path)


def random_queries(n: int, dim: int, seed: int = 1) -> np.ndarray:
    q = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return q / np.linalg.norm(q, axis=1, keepdims=True)


def stored_vectors(ds: Datastore, rows: list[int]) -> np.ndarray:
    """The vectors as the datastore holds them (decoded from its codec), as float32 queries."""
    params = None if ds.codec_params is None else torch.from_numpy(ds.codec_params)
    return ds.codec.decode(torch.from_numpy(np.asarray(ds.vectors[rows])), params).numpy()


class CopyEveryMiss(DemandCopyPolicy):
    """Copies are free and faiss is slow, whatever is measured: every miss that fits is copied
    (the measured rates depend on the machine's load; the tests must not)."""

    def __init__(self) -> None:
        super().__init__(copy_bytes_per_ms=1e15)
        self.cpu_bytes_per_ms = 1e-3

    def observe_copy(self, nbytes: int, ms: float) -> None:
        pass

    def observe_cpu(self, scanned_bytes: int, ms: float) -> None:
        pass
