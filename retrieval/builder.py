"""Building a datastore: embed passages, train the IVF centroids, lay the clusters out contiguously."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from telerag.retrieval.codecs import Codec
from telerag.retrieval.corpus import Passage, PassageShape
from telerag.retrieval.datastore import Manifest
from telerag.retrieval.datastore_writer import VectorRows, check_target, write_datastore
from telerag.retrieval.documents import DocumentEntry
from telerag.retrieval.errors import CorpusError, DatastoreError
from telerag.utils.progress import ProgressBar

log = logging.getLogger(__name__)

Encoder = Callable[[Sequence[str]], np.ndarray]
"""Texts -> float32 (n, dim) embeddings, normalised for inner product (the embedder's job)."""

MIN_POINTS_PER_LIST = 39  # faiss warns below this many training points per centroid


def default_nlist(n_vectors: int) -> int:
    """About 4·sqrt(n) lists (the common IVF rule), never fewer than 39 training points per list."""
    return max(1, min(round(4 * math.sqrt(n_vectors)), n_vectors // MIN_POINTS_PER_LIST))


def check_nlist(nlist: int, n_vectors: int) -> None:
    """Refuse an IVF of more lists than vectors (or none)."""
    if not 1 <= nlist <= n_vectors:
        raise DatastoreError(f"nlist must be between 1 and the number of vectors ({n_vectors}), got {nlist}")


def train_centroids(vectors: np.ndarray, nlist: int, *, seed: int = 1234, max_train_points: int = 256) -> np.ndarray:
    """Spherical k-means centroids for an inner-product IVF (faiss's own IVF training)."""
    n, dim = vectors.shape
    check_nlist(nlist, n)
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
    index.cp.seed = seed
    index.cp.max_points_per_centroid = max_train_points
    index.cp.min_points_per_centroid = 1
    index.train(np.ascontiguousarray(vectors, dtype=np.float32))
    return faiss.rev_swig_ptr(quantizer.get_xb(), nlist * dim).reshape(nlist, dim).copy()


def order_centroids(centroids: np.ndarray) -> np.ndarray:
    """A permutation that puts near centroids next to each other (recursive bisection along the
    principal axis), so a query's nearest clusters tend to be adjacent on disk and their
    prefetch coalesces into few large copies."""
    order: list[int] = []
    stack = [np.arange(len(centroids))]
    while stack:
        members = stack.pop()
        if len(members) <= 2:
            order.extend(members.tolist())
            continue
        points = centroids[members] - centroids[members].mean(axis=0)
        axis = np.linalg.svd(points, full_matrices=False)[2][0]
        ranked = members[np.argsort(points @ axis, kind="stable")]
        half = len(ranked) // 2
        stack.append(ranked[half:])
        stack.append(ranked[:half])
    return np.asarray(order, dtype=np.int64)


def assign_lists(
    vectors: np.ndarray | VectorRows, centroids: np.ndarray, *, batch: int = 65536, progress: bool = False
) -> np.ndarray:
    """Each vector's nearest centroid by inner product (`vectors` read `batch` rows at a time)."""
    quantizer = faiss.IndexFlatIP(centroids.shape[1])
    quantizer.add(np.ascontiguousarray(centroids, dtype=np.float32))
    n = vectors.shape[0]
    out = np.empty(n, dtype=np.int64)
    for start in ProgressBar(range(0, n, batch), desc="assign lists", unit="batch", disable=not progress):
        chunk = np.ascontiguousarray(vectors[start : start + batch], dtype=np.float32)
        out[start : start + len(chunk)] = quantizer.search(chunk, 1)[1][:, 0]
    return out


@dataclass(frozen=True)
class ClusterLayout:
    """Where every vector goes in a cluster-contiguous datastore."""

    centroids: np.ndarray  # float32 (nlist, dim), near ones adjacent (`order_centroids`)
    perm: np.ndarray  # int64 (n,): the input row at each position, cluster after cluster
    offsets: np.ndarray  # int64 (nlist + 1,): cluster c is positions offsets[c]:offsets[c+1]


def lay_out_clusters(centroids: np.ndarray, lists: np.ndarray) -> ClusterLayout:
    """Reorder the centroids for locality and sort the rows by their (reordered) list."""
    nlist = len(centroids)
    order = order_centroids(centroids)
    rank = np.empty(nlist, dtype=np.int64)
    rank[order] = np.arange(nlist)
    lists = rank[lists]
    offsets = np.zeros(nlist + 1, dtype=np.int64)
    np.cumsum(np.bincount(lists, minlength=nlist), out=offsets[1:])
    return ClusterLayout(np.ascontiguousarray(centroids[order], dtype=np.float32), np.argsort(lists, kind="stable"), offsets)


class ClusterOrdered:
    """`vectors` in cluster order and encoded, made a block of rows at a time as the datastore
    is written, so the build never holds a second copy of the whole set."""

    def __init__(self, vectors: np.ndarray, perm: np.ndarray, codec: Codec, params: np.ndarray | None) -> None:
        self.vectors, self.perm, self.codec, self.params = vectors, perm, codec, params
        self.shape = (len(perm), vectors.shape[1])
        self.dtype = np.dtype(codec.numpy_dtype)

    def __getitem__(self, rows: slice) -> np.ndarray:
        return self.codec.to_codes(self.vectors[self.perm[rows]], self.params)


def write_clustered(
    out_dir: Path,
    *,
    vectors: np.ndarray,
    lists: np.ndarray,
    centroids: np.ndarray,
    codec: Codec,
    embedder: str,
    passages: Sequence[Passage] | None = None,
    source: str = "",
    shape: PassageShape | None = None,
    content_hashes: Mapping[str, str] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Reorder centroids for locality, sort vectors (and passages) by list, and write the datastore.
    `content_hashes`: each document's (`documents.writer.DocumentText.content_hash`), kept
    with its passages' ids in `documents.jsonl`, so that writing the same document again later
    changes nothing (a passage's id is then its place in `passages`, so that a document's ids run
    in the order of its passages, as a written document's do); None: the documents are read from
    the passages when needed, with no hash (and a passage's id is its row).
    `extra_files`: as `write_datastore`'s."""
    nlist, dim = centroids.shape
    layout = lay_out_clusters(centroids, lists)
    params = codec.train(vectors)
    ordered_passages: Iterable[Passage] | None = None
    documents: list[DocumentEntry] | None = None
    ids: np.ndarray | None = None
    if passages is not None:
        ordered_passages = (passages[i] for i in layout.perm)
        if content_hashes is not None:
            documents, ids = _documents(passages, content_hashes), layout.perm
    manifest = Manifest(
        embedder=embedder,
        dim=dim,
        nlist=nlist,
        n_vectors=len(vectors),
        codec=codec.value,
        n_documents=len({p.doc_id for p in passages}) if passages is not None else 0,
        passage_words=shape.words if shape else None,
        passage_overlap=shape.overlap if shape else 0,
        passage_title=shape.title if shape else False,
        source=source,
    )
    return write_datastore(
        out_dir,
        manifest=manifest,
        centroids=layout.centroids,
        offsets=layout.offsets,
        vectors=ClusterOrdered(vectors, layout.perm, codec, params),
        passages=ordered_passages,
        codec_params=params,
        ids=ids,
        documents=documents,
        extra_files=extra_files,
        overwrite=overwrite,
        progress=progress,
    )


def _documents(passages: Sequence[Passage], content_hashes: Mapping[str, str]) -> list[DocumentEntry]:
    """The documents of `passages` (a passage's id its place among them), by id."""
    ids: dict[str, list[int]] = {}
    titles: dict[str, str] = {}
    for passage_id, passage in enumerate(passages):
        ids.setdefault(passage.doc_id, []).append(passage_id)
        titles.setdefault(passage.doc_id, passage.title)
    return [
        DocumentEntry(doc_id, titles[doc_id], 1, tuple(ids[doc_id]), content_hashes[doc_id], {}, 0, None)
        for doc_id in sorted(ids)
    ]


def build_datastore(
    passages: Iterable[Passage],
    encode: Encoder,
    *,
    embedder: str,
    out_dir: Path,
    nlist: int | None = None,
    codec: Codec = Codec.FP32,
    batch_size: int = 1024,  # texts per encode call: the embedder sorts each call by length, so bigger calls pad less
    source: str = "",
    shape: PassageShape | None = None,
    content_hashes: Mapping[str, str] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    seed: int = 1234,
) -> Path:
    """Embed `passages` with `encode`, train an IVF over them and write the datastore to `out_dir`
    (refused at once, before the embedding, if `out_dir` may not be written). `shape`: how the
    passages were cut and what of each to embed (None: its text, shape unrecorded);
    `content_hashes` and `extra_files`: as `write_clustered`'s."""
    check_target(out_dir, overwrite=overwrite)
    items = list(passages)
    embedding_text = shape.embedding_text if shape else (lambda passage: passage.text)
    if not items:
        raise CorpusError("empty corpus: no passages to index")
    vectors: np.ndarray | None = None  # allocated once the first batch gives the dimension
    for start in ProgressBar(range(0, len(items), batch_size), desc="embed passages", unit="batch", disable=not progress):
        batch = items[start : start + batch_size]
        chunk = np.asarray(encode([embedding_text(p) for p in batch]), dtype=np.float32)
        if chunk.ndim != 2 or len(chunk) != len(batch) or (vectors is not None and chunk.shape[1] != vectors.shape[1]):
            raise DatastoreError(f"the encoder returned shape {chunk.shape} for a batch of {len(batch)}")
        if vectors is None:
            vectors = np.empty((len(items), chunk.shape[1]), dtype=np.float32)
        vectors[start : start + len(batch)] = chunk
    assert vectors is not None  # items is not empty
    nlist = nlist or default_nlist(len(vectors))
    log.info("training %d IVF lists on %d vectors of dim %d", nlist, len(vectors), vectors.shape[1])
    centroids = train_centroids(vectors, nlist, seed=seed)
    lists = assign_lists(vectors, centroids, progress=progress)
    return write_clustered(
        out_dir,
        vectors=vectors,
        lists=lists,
        centroids=centroids,
        codec=codec,
        embedder=embedder,
        passages=items,
        source=source,
        shape=shape,
        content_hashes=content_hashes,
        extra_files=extra_files,
        overwrite=overwrite,
        progress=progress,
    )
