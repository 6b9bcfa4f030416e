"""A new generation's files from a snapshot: its living rows (the generation's, less the deleted,
and the delta's), each keeping its passage id and codes, laid out list after list.

A compaction keeps the centroids, so every row stays in its list and a search at any nprobe
returns what it returned before (the same rows, the same scores; only ties at the k-th place may
swap, as `ivf.same_results` allows). A retrain trains new centroids on the living vectors and
assigns every row again: the one operation that changes results.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np

from telerag.retrieval.builder import assign_lists, check_nlist, default_nlist, order_centroids, train_centroids
from telerag.retrieval.codecs import Codec
from telerag.retrieval.corpus import Passage
from telerag.retrieval.datastore_writer import write_datastore
from telerag.retrieval.documents import DocumentEntry
from telerag.retrieval.errors import DatastoreError
from telerag.retrieval.snapshot import Snapshot
from telerag.retrieval.windowed_rows import WindowedRows

log = logging.getLogger(__name__)

PASSAGE_BLOCK = 4096  # passages read from the generation's files at once
DECODE_BLOCK = 65536  # rows decoded at once to train and assign a retrain's lists
TRAIN_POINTS_PER_LIST = 256  # a retrain's k-means sample, as faiss's IVF training caps it
RETRAIN_WINDOW_BYTES = 2 << 30  # a retrain's rows held at once while written in their new order


class LivingRows:
    """A snapshot's living rows in the order given by `source` (>= 0: a row of the generation's
    files; < 0: `-1 - j`, row j of the delta), read a block at a time as the writer asks."""

    def __init__(self, snapshot: Snapshot, source: np.ndarray) -> None:
        self.snapshot, self.source = snapshot, source
        self.shape = (len(source), snapshot.datastore.dim)
        self.dtype = np.dtype(snapshot.datastore.codec.numpy_dtype)

    def __getitem__(self, rows: slice) -> np.ndarray:
        source = self.source[rows]
        out = np.empty((len(source), self.shape[1]), dtype=self.dtype)
        base = source >= 0
        out[base] = self.snapshot.datastore.vectors[source[base]]
        out[~base] = self.snapshot.delta.codes[-1 - source[~base]]
        return out


def living(snapshot: Snapshot) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The snapshot's living rows: (source, passage id, list) of each (`LivingRows`'s source)."""
    datastore, delta = snapshot.datastore, snapshot.delta
    rows = np.arange(datastore.n_vectors, dtype=np.int64)
    base_ids = datastore.ids_of(rows)
    base_lists = np.repeat(np.arange(datastore.nlist, dtype=np.int64), np.diff(datastore.offsets))
    keep_base, keep_delta = ~snapshot.is_deleted(base_ids), ~snapshot.is_deleted(delta.ids)
    source = np.concatenate([rows[keep_base], -1 - np.flatnonzero(keep_delta)])
    ids = np.concatenate([base_ids[keep_base], delta.ids[keep_delta]])
    lists = np.concatenate([base_lists[keep_base], delta.lists[keep_delta]])
    return source, ids, lists


def training_sample(ids: np.ndarray, nlist: int, seed: int) -> np.ndarray:
    """Which living rows (indexes into `ids`) a retrain trains `nlist` lists on, in the order of
    their ids (so the training depends on what the datastore holds, not on where it lies): every
    row where there are at most `TRAIN_POINTS_PER_LIST` a list, else that many a list drawn by
    `seed` (faiss's IVF training would sample as many from the whole set, held in memory)."""
    by_id = np.argsort(ids, kind="stable")
    cap = nlist * TRAIN_POINTS_PER_LIST
    if len(ids) <= cap:
        return by_id
    return by_id[np.sort(np.random.default_rng(seed).choice(len(ids), cap, replace=False))]


def retrained_lists(
    snapshot: Snapshot, source: np.ndarray, ids: np.ndarray, nlist: int | None, seed: int, *, progress: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """New centroids trained on a sample of the living vectors as the codec stores them
    (`training_sample`), ordered so that near ones are adjacent (as a build orders them); and each
    living row's list among them, assigned a block at a time: memory holds the sample, never the
    whole set."""
    datastore = snapshot.datastore
    nlist = nlist or default_nlist(len(source))
    check_nlist(nlist, len(source))
    chosen = source[training_sample(ids, nlist, seed)]
    sample = gathered(
        chosen,
        lambda rows: DecodedRows(LivingRows(snapshot, rows), datastore.codec, datastore.codec_params)[:],
        np.empty((len(chosen), datastore.dim), dtype=np.float32),
    )
    log.info("%s: training %d lists on %d of its %d living rows", datastore.where, nlist, len(chosen), len(source))
    centroids = train_centroids(sample, nlist, seed=seed, max_train_points=TRAIN_POINTS_PER_LIST)
    del sample
    centroids = np.ascontiguousarray(centroids[order_centroids(centroids)])
    every_row = DecodedRows(LivingRows(snapshot, source), datastore.codec, datastore.codec_params)
    return centroids, assign_lists(every_row, centroids, batch=DECODE_BLOCK, progress=progress)


class DecodedRows:
    """Living rows decoded to float32 a block at a time, for the k-means sample and the assignment."""

    def __init__(self, rows: LivingRows, codec: Codec, params: np.ndarray | None) -> None:
        self.rows, self.codec, self.params = rows, codec, params
        self.shape = rows.shape
        self.dtype = np.dtype(np.float32)

    def __getitem__(self, rows: slice) -> np.ndarray:
        return np.asarray(self.codec.decode_exact(self.rows[rows], self.params), dtype=np.float32)


class RetrainedRows(WindowedRows):
    """A retrain's living rows in their new order (list after list), as the writer reads them: the
    new order scatters the old file's rows, so each window of `window_rows` is gathered in one pass
    over the file in its own order (`WindowedRows`), never a row at a time at random."""

    def __init__(self, snapshot: Snapshot, source: np.ndarray, window_rows: int) -> None:
        living_rows = LivingRows(snapshot, source)
        super().__init__(living_rows.shape, living_rows.dtype, window_rows)
        self.snapshot, self.source = snapshot, source

    def make_window(self, first: int, end: int) -> np.ndarray:
        codes = np.empty((end - first, self.shape[1]), dtype=self.dtype)
        return gathered(self.source[first:end], lambda rows: LivingRows(self.snapshot, rows)[:], codes)


def gathered(source: np.ndarray, read: Callable[[np.ndarray], np.ndarray], out: np.ndarray) -> np.ndarray:
    """`out`, its row i `read`'s row for `source[i]` (`LivingRows`'s source), read in the file's
    order `DECODE_BLOCK` rows at a time: one pass over the file, never a row at a time at random."""
    in_file_order = np.argsort(source, kind="stable")
    for start in range(0, len(source), DECODE_BLOCK):
        block = in_file_order[start : start + DECODE_BLOCK]
        out[block] = read(source[block])
    return out


def write_generation(
    out_dir: Path,
    snapshot: Snapshot,
    catalog: Mapping[str, DocumentEntry],
    *,
    retrain: bool = False,
    nlist: int | None = None,
    seed: int = 1234,
    progress: bool = False,
) -> Path:
    """The snapshot's living rows as a datastore at `out_dir` (new or empty), with their passage
    ids and `catalog`'s documents; `retrain`: new centroids (`nlist` of them; default: the
    build's rule for that many rows), else the snapshot's."""
    datastore = snapshot.datastore
    source, ids, lists = living(snapshot)
    if not len(source):
        raise DatastoreError(f"{datastore.where} holds no passages: there is nothing to write a generation of")
    centroids = datastore.centroids
    if retrain:
        centroids, lists = retrained_lists(snapshot, source, ids, nlist, seed, progress=progress)
    order = np.lexsort((ids, lists))  # list after list, each by id
    source, ids, lists = source[order], ids[order], lists[order]
    offsets = np.zeros(len(centroids) + 1, dtype=np.int64)
    np.cumsum(np.bincount(lists, minlength=len(centroids)), out=offsets[1:])
    manifest = replace(
        datastore.manifest,
        nlist=len(centroids),
        n_vectors=len(source),
        n_documents=len(catalog),
        created_at=time.time(),
        files={},
    )
    # a compaction's rows keep their lists: read in the new order, they are read in the old file's, near enough
    rows = RETRAIN_WINDOW_BYTES // (datastore.dim * datastore.codec.numpy_dtype.itemsize)
    return write_datastore(
        out_dir,
        manifest=manifest,
        centroids=np.ascontiguousarray(centroids, dtype=np.float32),
        offsets=offsets,
        vectors=RetrainedRows(snapshot, source, rows) if retrain else LivingRows(snapshot, source),
        passages=_passages(snapshot, ids) if datastore.has_passages else None,
        codec_params=datastore.codec_params,
        ids=ids,
        documents=sorted(catalog.values(), key=lambda entry: entry.doc_id),
        progress=progress,
    )


def _passages(snapshot: Snapshot, ids: np.ndarray) -> Iterator[Passage]:
    for start in range(0, len(ids), PASSAGE_BLOCK):
        yield from snapshot.passages_of(ids[start : start + PASSAGE_BLOCK].tolist())
