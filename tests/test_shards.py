"""The retrieval tier's shards searched in process: every list's rows split over the shards, each
shard searched over the given lists, the merge equal to one faiss index at the same nprobe."""

from __future__ import annotations

import numpy as np
import pytest

from telerag.retrieval.codecs import Codec
from telerag.retrieval.ivf import CPUIndex, same_results
from telerag.retrieval.shards import ShardRows, merge_shard_results
from tests.retrieval_helpers import random_datastore, random_queries


def assert_shards_equal_one_index(ds, shards: int, *, queries: int = 40, k: int = 10, seed: int = 0) -> None:
    """Over random queries, nprobe and list choices (some entries -1, as a cooperative search's
    CPU half gets them): the shards' merge against the whole index on the same lists, and with
    each query's own nearest lists against faiss's own search."""
    whole = CPUIndex(ds)
    parts = [CPUIndex(ds, shard=ShardRows.of(ds.offsets, s, shards)) for s in range(shards)]
    rng = np.random.default_rng(seed)
    q = random_queries(queries, ds.dim, seed=seed + 1)
    for nprobe in (1, 3, ds.nlist):
        list_scores, lists = whole.probe(q, nprobe)
        lists = np.where(rng.random(lists.shape) < 0.2, -1, lists)  # lists another half scans
        want = whole.search_lists(q, k, lists, list_scores)
        got = merge_shard_results([part.search_lists(q, k, lists, list_scores) for part in parts], k)
        reference = whole.search(q, k, nprobe)
        merged_own = merge_shard_results([part.search_lists(q, k, *whole.probe(q, nprobe)[::-1]) for part in parts], k)
        for i in range(queries):
            assert same_results(got[1][i], got[0][i], want[1][i], want[0][i]), (shards, nprobe, i)
            assert same_results(merged_own[1][i], merged_own[0][i], reference[1][i], reference[0][i]), (shards, nprobe, i)


def test_every_row_is_in_exactly_one_shard_and_lists_split_evenly():
    offsets = np.array([0, 0, 1, 2, 7, 100, 100, 131], dtype=np.int64)  # empty lists, and lists smaller than the shards
    for shards in (1, 2, 3, 4):
        rows = [ShardRows.of(offsets, s, shards) for s in range(shards)]
        assert sorted(np.concatenate([r.ids for r in rows]).tolist()) == list(range(131))
        for cluster in range(len(offsets) - 1):
            members = [r.ids[r.offsets[cluster] : r.offsets[cluster + 1]] for r in rows]
            sizes = [len(m) for m in members]
            assert max(sizes) - min(sizes) <= 1 and sum(sizes) == offsets[cluster + 1] - offsets[cluster]
            assert all(np.all((m >= offsets[cluster]) & (m < offsets[cluster + 1])) for m in members)
    with pytest.raises(Exception, match="shard must be between 0 and 1"):
        ShardRows.of(offsets, 2, 2)


@pytest.mark.parametrize("shards", [1, 2, 3])
@pytest.mark.parametrize("codec", list(Codec))
def test_shards_merged_equal_one_faiss_index(tmp_path, shards, codec):
    ds = random_datastore(tmp_path / "ds", n=2500, dim=24, nlist=20, codec=codec, empty_lists=2)
    assert_shards_equal_one_index(ds, shards, seed=shards)


@pytest.mark.parametrize("shards", [2, 3])
def test_ties_and_lists_smaller_than_the_shards(tmp_path, shards):
    """Exact duplicates (score ties split across shards) and a k beyond what the lists hold
    (faiss's -1 padding merged last)."""
    ds = random_datastore(tmp_path / "ds", n=300, dim=8, nlist=64, duplicates=12)
    assert_shards_equal_one_index(ds, shards, k=20, seed=7)
    whole = CPUIndex(ds)
    _, first, counts = np.unique(np.asarray(ds.vectors), axis=0, return_index=True, return_counts=True)
    q = np.asarray(ds.vectors[[first[counts.argmax()]]], dtype=np.float32)  # the vector stored 13 times
    list_scores, lists = whole.probe(q, 1)
    parts = [CPUIndex(ds, shard=ShardRows.of(ds.offsets, s, shards)) for s in range(shards)]
    scores, ids = merge_shard_results([part.search_lists(q, 50, lists, list_scores) for part in parts], 50)
    held = int(ds.offsets[lists[0, 0] + 1] - ds.offsets[lists[0, 0]])
    assert (ids[0, :held] >= 0).all() and (ids[0, held:] == -1).all()
    assert held >= 13 and len(set(scores[0, :13])) == 1  # the copies are one list's, tied
    assert list(ids[0, :13]) == sorted(ids[0, :13])  # from both shards, in id order


def test_a_shard_holds_only_its_rows(tmp_path):
    ds = random_datastore(tmp_path / "ds", n=1000, nlist=8)
    shard = CPUIndex(ds, shard=ShardRows.of(ds.offsets, 1, 4))
    assert shard.index.ntotal == len(shard.vectors) < ds.n_vectors // 3
    np.testing.assert_array_equal(shard.vectors, ds.vectors[ShardRows.of(ds.offsets, 1, 4).ids])
