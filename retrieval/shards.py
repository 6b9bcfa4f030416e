"""A datastore split into shards for the retrieval tier, and the exact merge of their results.

Chameleon (§4) spreads every IVF list's rows evenly over its memory nodes, so that one query's
scan is shared by all of them rather than landing on the node that holds its lists. Here list
l's rows are cut into `shards` contiguous parts, part s to shard s; each shard is searched with
faiss's preassigned search over its part of the given lists (`CPUIndex(shard=...)`), and the
per-shard top-k are merged by (score, id). Scores are computed per vector by the same faiss
scanner whatever index holds it, so the merge equals one index at the same nprobe: the same ids
in the same order, except among candidates tied at the k-th place (`ivf.same_results`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from telerag.retrieval.errors import SearchError

FAISS_PAD_SCORE = -np.finfo(np.float32).max  # what faiss puts beside a -1 label for inner product


@dataclass(frozen=True)
class ShardRows:
    """Which datastore rows shard `shard` of `shards` holds: `ids`, list by list, and where each
    list's part starts in them (`offsets`, nlist + 1 entries, like the datastore's)."""

    shard: int
    shards: int
    ids: np.ndarray  # int64 datastore rows (a vector's id is its row)
    offsets: np.ndarray  # int64

    @classmethod
    def of(cls, offsets: np.ndarray, shard: int, shards: int) -> ShardRows:
        """Shard `shard`'s part of every list of a datastore laid out by `offsets`."""
        if not 0 <= shard < shards:
            raise SearchError(f"shard must be between 0 and {shards - 1}, got {shard}")
        offsets = np.asarray(offsets, dtype=np.int64)
        starts, sizes = offsets[:-1], np.diff(offsets)
        low, high = starts + sizes * shard // shards, starts + sizes * (shard + 1) // shards
        counts = high - low
        part_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        # each row's id: its list part's first row plus its place in the part
        ids = np.repeat(low - part_offsets[:-1], counts) + np.arange(part_offsets[-1], dtype=np.int64)
        return cls(shard=shard, shards=shards, ids=ids, offsets=part_offsets)


def merge_shard_results(parts: Sequence[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per query, the `k` best of the shards' (scores, ids) top-k: by score, then by id; faiss's
    padding (id -1, the lowest score) last."""
    if not parts:
        raise SearchError("no shard results to merge")
    scores = np.concatenate([part[0] for part in parts], axis=1)
    ids = np.concatenate([part[1] for part in parts], axis=1)
    order = np.lexsort((ids, -scores), axis=1)[:, :k]  # the last key sorts first
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)
