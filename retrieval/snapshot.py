"""One version of a live datastore, as a search reads it: the generation's files (immutable), the
rows added since (the delta), and the rows deleted since (tombstones), all as of one LSN.

A snapshot never changes: the live datastore publishes a new one after each durable write, and a
request keeps the one it started with through all its retrievals (what it holds stays alive as
long as it does). `search_snapshot` is the one search of a live datastore, and it is exact: it
returns what faiss's `IndexIVF` returns with the same centroids after the same `add_with_ids` and
`remove_ids`, at the same nprobe:

- the generation is searched by the retrieval engine as ever (the device half from the cluster
  cache, which holds the generation's rows only and so is never stale; faiss for the rest) for
  the top k + t, t being at most the number of deleted rows in any query's probed lists, so that
  once the deleted rows are dropped the top k of the living remain;
- the delta's rows in each query's probed lists (a delta row is in the list of its nearest
  centroid, as `add_with_ids` puts it) are scored on the CPU, the deleted ones skipped;
- the two merge by score, then id (ties as `ivf.same_results` defines them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from telerag.retrieval.corpus import Passage
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.errors import PassageNotFound
from telerag.retrieval.keywords import KeywordIndex
from telerag.retrieval.provisional import UNWATCHED, Provisional, SearchWatch
from telerag.retrieval.shards import FAISS_PAD_SCORE, merge_shard_results

if TYPE_CHECKING:
    from telerag.retrieval.engine import RetrievalEngine, SearchResult


@dataclass(frozen=True)
class DeltaRows:
    """The rows added since the generation was written, in the order they were added (so by
    LSN, and by id: ids are handed out rising). Views of the live datastore's growing arrays:
    what is appended after this snapshot lies past their ends."""

    ids: np.ndarray  # int64 (m,)
    lists: np.ndarray  # int64 (m,): the nearest centroid of each row
    codes: np.ndarray  # the codec's codes, (m, dim)

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, eq=False)
class Snapshot:
    """The datastore as of `lsn`: the generation's rows, plus `delta`, minus `deleted`. (Equal
    only to itself: a batch of searches groups its callers by the snapshot they read.)"""

    lsn: int
    generation: int  # which generation's files (a compaction or retrain makes a new one)
    datastore: Datastore  # the generation's files
    delta: DeltaRows
    deleted: np.ndarray  # int64, sorted: every deleted id (of the generation or of the delta)
    deleted_per_list: np.ndarray  # int64 (nlist,): how many of `deleted` lie in each list
    delta_passages: Mapping[int, Passage]  # the delta's passages by id (holds later ids too; never fewer)
    documents: int  # living documents
    keywords: KeywordIndex  # the keyword half's postings as of `lsn` (`retrieval.keywords`)

    @property
    def passages(self) -> int:
        """Living passages (rows)."""
        return self.datastore.n_vectors + len(self.delta) - len(self.deleted)

    def list_sizes(self) -> np.ndarray:
        """Living rows per list."""
        sizes = np.diff(self.datastore.offsets) + np.bincount(self.delta.lists, minlength=self.datastore.nlist)
        return sizes - self.deleted_per_list

    def imbalance(self) -> float:
        """The largest list over the mean list (1.0: even; appends keep the centroids, so lists
        grow unevenly as documents arrive)."""
        sizes = self.list_sizes()
        mean = float(sizes.mean()) if len(sizes) else 0.0
        return float(sizes.max()) / mean if mean > 0 else 1.0

    def overfetch(self, nprobe: int) -> int:
        """How many more than k the generation's search must return so that k living rows remain
        once the deleted are dropped: the most deleted rows any nprobe lists hold."""
        if not len(self.deleted):
            return 0
        largest = np.sort(self.deleted_per_list)[::-1][: max(1, nprobe)]
        return int(largest.sum())

    def restricted_to(self, ids: Sequence[int] | np.ndarray) -> Snapshot:
        """This snapshot with only the living ones of `ids` searched: every other row is left out
        as the deleted are (`excluding`)."""
        held = self.datastore.ids if self.datastore.ids is not None else np.arange(self.datastore.n_vectors, dtype=np.int64)
        return self.excluding(np.setdiff1d(np.concatenate([held, self.delta.ids]), np.asarray(ids, dtype=np.int64)))

    def excluding(self, ids: Sequence[int] | np.ndarray) -> Snapshot:
        """This snapshot with the living ones of `ids` left out as the deleted are: a search of it
        is exact over the rest, as faiss's with an ID selector that leaves them out (a search's
        filter, `file_search.attribute_filters`)."""
        ids = np.unique(np.asarray(ids, dtype=np.int64))
        ids, lists = self._lists_of(ids[~self.is_deleted(ids)])
        if not len(ids):
            return self
        per_list = self.deleted_per_list + np.bincount(lists, minlength=self.datastore.nlist)
        return replace(self, deleted=np.union1d(self.deleted, ids), deleted_per_list=per_list)

    def _lists_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Those of `ids` this snapshot holds (of the generation, by its row, or of the delta:
        an id written after it is not), and the list of each."""
        rows = self.datastore.rows_of(ids)
        lists = np.searchsorted(self.datastore.offsets, rows, side="right") - 1
        held = rows >= 0
        if len(self.delta):
            at = np.minimum(np.searchsorted(self.delta.ids, ids), len(self.delta) - 1)
            in_delta = ~held & (self.delta.ids[at] == ids)
            lists = np.where(in_delta, self.delta.lists[at], lists)
            held |= in_delta
        return ids[held], lists[held].astype(np.int64)

    def is_deleted(self, ids: np.ndarray) -> np.ndarray:
        if not len(self.deleted):
            return np.zeros(np.shape(ids), dtype=bool)
        return np.isin(ids, self.deleted, assume_unique=False)

    def passages_of(self, ids: Sequence[int]) -> list[Passage]:
        """The passages of living ids, of the generation or of the delta."""
        in_base = [int(i) for i, row in zip(ids, self.datastore.rows_of(ids), strict=True) if row >= 0]
        found = dict(zip(in_base, self.datastore.passages(in_base), strict=True))
        out = []
        for passage_id in ids:
            passage = found.get(int(passage_id)) or self.delta_passages.get(int(passage_id))
            if passage is None:
                raise PassageNotFound(f"passage id {passage_id} is not in the datastore")
            out.append(passage)
        return out

    def scan_delta(self, queries: np.ndarray, k: int, lists: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each query's top-k (scores, ids) among the living delta rows of its probed `lists`
        (-1 entries skipped), padded like faiss."""
        n = len(queries)
        out_scores = np.full((n, k), FAISS_PAD_SCORE, dtype=np.float32)
        out_ids = np.full((n, k), -1, dtype=np.int64)
        delta = self.delta
        if not len(delta):
            return out_scores, out_ids
        probed = np.zeros((n, self.datastore.nlist + 1), dtype=bool)  # the last column takes the -1 entries
        probed[np.arange(n)[:, None], np.where(lists >= 0, lists, self.datastore.nlist)] = True
        rows = np.flatnonzero(probed[:, delta.lists].any(axis=0) & ~self.is_deleted(delta.ids))
        if not len(rows):
            return out_scores, out_ids
        import torch  # here: the server reads snapshots' counts before torch loads

        params = None if self.datastore.codec_params is None else torch.from_numpy(self.datastore.codec_params)
        vectors = self.datastore.codec.decode(torch.from_numpy(np.ascontiguousarray(delta.codes[rows])), params)
        scores = (torch.from_numpy(queries) @ vectors.T).numpy()
        scores = np.where(probed[:, delta.lists[rows]], scores, -np.inf)
        ids = np.broadcast_to(delta.ids[rows], scores.shape)
        order = np.lexsort((ids, -scores), axis=1)[:, :k]
        top_scores, top_ids = np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)
        valid = np.isfinite(top_scores)
        width = top_scores.shape[1]
        out_scores[:, :width] = np.where(valid, top_scores, FAISS_PAD_SCORE)
        out_ids[:, :width] = np.where(valid, top_ids, -1)
        return out_scores, out_ids

    def living(self, scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's first k living entries of a (score, id)-ordered top list, padded like faiss."""
        if not len(self.deleted):
            return scores[:, :k], ids[:, :k]
        dead = self.is_deleted(ids) | (ids < 0)
        order = np.argsort(dead, axis=1, kind="stable")[:, :k]  # the living first, in their order
        scores, ids = np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)
        dropped = np.take_along_axis(dead, order, axis=1)
        return np.where(dropped, FAISS_PAD_SCORE, scores).astype(np.float32), np.where(dropped, -1, ids)


def search_snapshot(
    engine: RetrievalEngine,
    snapshot: Snapshot,
    queries: np.ndarray,
    k: int,
    nprobe: int | None = None,
    *,
    watch: SearchWatch = UNWATCHED,
    **options: Any,
) -> SearchResult:
    """Exact IVF search of `snapshot` at `nprobe` (see the module's docstring); `engine` is the
    retrieval engine over the snapshot's generation, `options` its `search`'s. An nprobe past the
    generation's lists (chosen before a retrain left fewer) probes every list, as faiss does."""
    nprobe = min(nprobe or engine.nprobe, snapshot.datastore.nlist)
    extra = snapshot.overfetch(nprobe)
    # a provisional top-k is heard as the final one is read: its first k living entries
    living = watch.mapped(lambda found: Provisional(*snapshot.living(found.scores, found.ids, k), found.lists_share))
    result = engine.search(queries, k + extra, nprobe, watch=living, **options)
    scores, ids = snapshot.living(result.scores, result.ids, k)
    if len(snapshot.delta):
        queries = engine.index.check(queries, k, nprobe)
        lists = engine.index.probe(queries, nprobe)[1]
        delta = snapshot.scan_delta(queries, k, lists)
        scores, ids = merge_shard_results([(scores, ids), delta], k)
    return replace(result, scores=np.ascontiguousarray(scores), ids=np.ascontiguousarray(ids))
