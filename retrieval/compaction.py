"""A new generation's files from a snapshot: its living rows (the generation's, less the deleted,
and the delta's), each keeping its passage id and codes, laid out list after list.

A compaction keeps the centroids, so every row stays in its list and a search at any nprobe
returns what it returned before (the same rows, the same scores; only ties at the k-th place may
swap, as `ivf.same_results` allows). A retrain trains new centroids on the living vectors and
assigns every row again: the one operation that changes results.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np

from telerag.retrieval.builder import assign_lists, default_nlist, order_centroids, train_centroids
from telerag.retrieval.corpus import Passage
from telerag.retrieval.datastore_writer import write_datastore
from telerag.retrieval.documents import DocumentEntry
from telerag.retrieval.errors import DatastoreError
from telerag.retrieval.snapshot import Snapshot

PASSAGE_BLOCK = 4096  # passages read from the generation's files at once
DECODE_BLOCK = 65536  # rows decoded at once to train and assign a retrain's lists


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


def retrained_lists(
    snapshot: Snapshot, source: np.ndarray, ids: np.ndarray, nlist: int | None, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """New centroids trained on the living vectors as the codec stores them, taken in the order
    of their ids (so the training depends on what the datastore holds, not on where it lies),
    ordered so that near ones are adjacent (as a build orders them); and each living row's list
    among them."""
    datastore = snapshot.datastore
    by_id = np.argsort(ids, kind="stable")
    rows = LivingRows(snapshot, source[by_id])
    decoded = np.empty(rows.shape, dtype=np.float32)
    for start in range(0, len(source), DECODE_BLOCK):
        block = rows[start : start + DECODE_BLOCK]
        decoded[start : start + len(block)] = datastore.codec.decode_exact(block, datastore.codec_params)
    centroids = train_centroids(decoded, nlist or default_nlist(len(decoded)), seed=seed)
    centroids = np.ascontiguousarray(centroids[order_centroids(centroids)])
    lists = np.empty(len(source), dtype=np.int64)
    lists[by_id] = assign_lists(decoded, centroids)
    return centroids, lists


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
        centroids, lists = retrained_lists(snapshot, source, ids, nlist, seed)
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
    return write_datastore(
        out_dir,
        manifest=manifest,
        centroids=np.ascontiguousarray(centroids, dtype=np.float32),
        offsets=offsets,
        vectors=LivingRows(snapshot, source),
        passages=_passages(snapshot, ids) if datastore.has_passages else None,
        codec_params=datastore.codec_params,
        ids=ids,
        documents=sorted(catalog.values(), key=lambda entry: entry.doc_id),
        progress=progress,
    )


def _passages(snapshot: Snapshot, ids: np.ndarray) -> Iterator[Passage]:
    for start in range(0, len(ids), PASSAGE_BLOCK):
        yield from snapshot.passages_of(ids[start : start + PASSAGE_BLOCK].tolist())
