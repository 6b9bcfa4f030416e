"""Exact early stop (`experiments.early_stop`): the list statistics are true bounds of every score
faiss computes, and a search that skips the lists they rule out returns exactly what the full
scan returns, over random datastores of every codec, queries, k and nprobe, with and without a
device half; the statistics are written with every datastore, and an older datastore gets them
from `telerag datastore upgrade` (or, the embedded default's, from the serve path), never silently."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import faiss
import numpy as np
import pytest

from telerag.cli.main import main
from telerag.retrieval import datastore_writer
from telerag.retrieval.builder import write_clustered
from telerag.retrieval.checksums import VERIFIED
from telerag.retrieval.codecs import Codec
from telerag.retrieval.corpus import WIKIPEDIA_SOURCE
from telerag.retrieval.datastore import LIST_STATS, MANIFEST, Datastore
from telerag.retrieval.datastore_writer import add_list_stats
from telerag.retrieval.early_stop import EarlyStopSearch, ListBounds
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.errors import DatastoreError, DatastoreMismatchError
from telerag.retrieval.ivf import CPUIndex, same_results
from telerag.retrieval.shards import ShardRows, merge_shard_results
from telerag.server.ray_serve.tier import ShardReplica
from telerag.utils.storage import file_sha256
from tests.retrieval_helpers import DEVICES, random_datastore, random_queries, stored_vectors


def assert_same(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray], context: object = "") -> None:
    for i in range(len(want[1])):
        assert same_results(got[1][i], got[0][i], want[1][i], want[0][i]), (context, i, got[1][i], want[1][i])


def strip_list_stats(path: Path) -> None:
    """Make `path` a datastore as an older telerag wrote it: no list statistics."""
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest["files"][LIST_STATS]
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2))
    (path / LIST_STATS).unlink()


def mixed_queries(ds: Datastore, n: int, seed: int) -> np.ndarray:
    """Random directions, stored vectors (exact self-matches) and those scaled (norms not 1)."""
    rng = np.random.default_rng(seed)
    stored = stored_vectors(ds, sorted(rng.choice(ds.n_vectors, n // 2, replace=False).tolist()))
    q = np.concatenate([random_queries(n - n // 2, ds.dim, seed), stored])
    return (q * rng.uniform(0.2, 3.0, (len(q), 1))).astype(np.float32)


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("dim", [3, 8, 40])
def test_the_statistics_bound_every_score_faiss_computes(tmp_path, codec, dim):
    rng = np.random.default_rng(dim)
    ds = random_datastore(tmp_path / "ds", n=2000, dim=dim, nlist=24, codec=codec, seed=dim, empty_lists=2)
    index = CPUIndex(ds)
    bounds = ListBounds.of(ds)
    q = mixed_queries(ds, 30, dim) * rng.choice([-1.0, 1.0], (30, 1)).astype(np.float32)
    lists = np.tile(np.arange(ds.nlist), (len(q), 1))
    sizes = np.diff(ds.offsets)
    bound = bounds.of_queries(q, lists)
    for cluster in range(ds.nlist):
        column = np.full((len(q), 1), cluster)
        scores, ids = index.search_lists(q, max(1, int(sizes[cluster])), column, np.zeros((len(q), 1), np.float32))
        if sizes[cluster] == 0:
            assert (ids == -1).all() and (bound[:, cluster] == -np.inf).all()
        else:
            assert (scores[:, 0] <= bound[:, cluster]).all(), cluster
    assert np.isfinite(bound[:, sizes > 0]).all()


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("seed", range(4))
def test_early_stop_returns_what_the_full_scan_returns(tmp_path, codec, seed):
    """The property: any datastore, queries, k and nprobe, lists given with holes (-1, as the
    device half leaves them), the same answer as faiss over the same lists."""
    rng = np.random.default_rng(seed)
    nlist = int(rng.integers(4, 40))
    ds = random_datastore(
        tmp_path / "ds",
        n=int(rng.integers(300, 2500)),
        dim=int(rng.choice([2, 4, 8, 24])),
        nlist=nlist,
        codec=codec,
        seed=seed,
        duplicates=int(rng.integers(0, 8)),
        empty_lists=int(rng.integers(0, 3)),
    )
    index = CPUIndex(ds)
    early = EarlyStopSearch(index, ListBounds.of(ds))
    q = mixed_queries(ds, 12, seed)
    for nprobe in sorted({1, 2, int(rng.integers(1, ds.nlist + 1)), ds.nlist}):
        list_scores, lists = index.probe(q, nprobe)
        holes = np.where(rng.random(lists.shape) < 0.25, -1, lists)
        for k in (1, int(rng.integers(2, 20)), 3 * ds.n_vectors // ds.nlist, ds.n_vectors + 5):
            assert_same(early.search_lists(q, k, lists, list_scores), index.search_lists(q, k, lists, list_scores), (nprobe, k))
            assert_same(early.search_lists(q, k, holes, list_scores), index.search_lists(q, k, holes, list_scores), (nprobe, k))
            assert_same(early.search_lists(q, k, lists, list_scores), index.search(q, k, nprobe), (nprobe, k))
    assert early.counts.probed > 0 and early.counts.scanned <= early.counts.probed


def test_it_skips_lists_where_the_bound_allows(tmp_path):
    """In few dimensions the bound is tight enough to skip most lists at nprobe = nlist: the
    test that early stop does something at all (and still answers exactly)."""
    ds = random_datastore(tmp_path / "ds", n=20000, dim=4, nlist=64)
    index = CPUIndex(ds)
    early = EarlyStopSearch(index, ListBounds.of(ds))
    q = stored_vectors(ds, list(range(0, 20000, 500)))
    list_scores, lists = index.probe(q, ds.nlist)
    assert_same(early.search_lists(q, 10, lists, list_scores), index.search(q, 10, ds.nlist))
    assert early.counts.probed == len(q) * ds.nlist
    assert early.counts.scanned_fraction is not None and early.counts.scanned_fraction < 0.5


def test_ties_at_the_kth_place_across_lists(tmp_path):
    """Vectors that tie exactly with the k-th score in lists the bound reaches exactly: any of
    them may be kept (as in faiss), the scores and the rest of the top-k are the full scan's."""
    unit = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]], dtype=np.float32)
    # lists of one vector each, at their centroids (radius 0: each bound is the score itself)
    vectors = np.concatenate([unit, unit * 0.5, np.array([[0.5, 0.5], [0.5, -0.5]], dtype=np.float32)])
    centroids = vectors.copy()
    write_clustered(
        tmp_path / "ds", vectors=vectors, lists=np.arange(len(vectors)), centroids=centroids, codec=Codec.FP32, embedder="t"
    )
    ds = Datastore.load(tmp_path / "ds")
    index = CPUIndex(ds)
    early = EarlyStopSearch(index, ListBounds.of(ds))
    q = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]], dtype=np.float32)
    for k in range(1, len(vectors) + 2):
        list_scores, lists = index.probe(q, ds.nlist)
        assert_same(early.search_lists(q, k, lists, list_scores), index.search(q, k, ds.nlist), k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("codec", list(Codec))
def test_the_engine_with_early_stop_equals_faiss_with_and_without_a_device_half(tmp_path, device, codec):
    ds = random_datastore(tmp_path / "ds", n=4000, dim=6, nlist=32, codec=codec, seed=3, duplicates=5, empty_lists=2)
    total = int(ds.vectors.nbytes)
    q_in = mixed_queries(ds, 8, 5)
    q_out = q_in + 0.2 * random_queries(8, ds.dim, 9)
    for cache_bytes in (0, total // 3, total):
        engine = RetrievalEngine(ds, device=device, cache_bytes=cache_bytes, early_stop=True)
        assert isinstance(engine.cpu_half, EarlyStopSearch)
        for nprobe in (1, 7, ds.nlist):
            for k in (1, 10, 200):
                handle = engine.prefetch(q_in, cache_bytes // 2)
                result = engine.search(q_out, k, nprobe, prefetch=handle)
                handle.release()
                assert_same((result.scores, result.ids), engine.index.search(q_out, k, nprobe), (cache_bytes, nprobe, k))
                if cache_bytes == total:
                    assert sum(s.clusters_device for s in result.per_query) > 0  # the device half took part
        engine.close()


@pytest.mark.parametrize("shards", [2, 3])
def test_shards_bounded_by_the_whole_lists_statistics_merge_to_the_full_scan(tmp_path, shards):
    ds = random_datastore(tmp_path / "ds", n=3000, dim=5, nlist=20, duplicates=6, empty_lists=1)
    whole = CPUIndex(ds)
    bounds = ListBounds.of(ds)
    parts = [EarlyStopSearch(CPUIndex(ds, shard=ShardRows.of(ds.offsets, s, shards)), bounds) for s in range(shards)]
    q = mixed_queries(ds, 16, shards)
    for nprobe in (1, 5, ds.nlist):
        list_scores, lists = whole.probe(q, nprobe)
        for k in (1, 10, 400):
            merged = merge_shard_results([part.search_lists(q, k, lists, list_scores) for part in parts], k)
            assert_same(merged, whole.search(q, k, nprobe), (nprobe, k))
    assert sum(part.counts.scanned for part in parts) < sum(part.counts.probed for part in parts)


async def test_a_shard_replica_with_early_stop_answers_like_one_without(tmp_path):
    ds = random_datastore(tmp_path / "ds", n=2000, dim=4, nlist=16)
    threads = faiss.omp_get_max_threads()
    plain = ShardReplica(str(ds.path), 1, 2)
    early = ShardReplica(str(ds.path), 1, 2, early_stop=True)
    q = mixed_queries(ds, 10, 0)
    list_scores, lists = CPUIndex(ds).probe(q, ds.nlist)
    try:
        found = await early.search_lists(q, 5, lists, list_scores), await plain.search_lists(q, 5, lists, list_scores)
    finally:
        faiss.omp_set_num_threads(threads)  # a replica takes its share of a node's cores; this process keeps its own
    assert_same(*found)
    strip_list_stats(ds.path)
    with pytest.raises(DatastoreMismatchError, match="telerag datastore upgrade"):
        ShardReplica(str(ds.path), 0, 2, early_stop=True)
    faiss.omp_set_num_threads(threads)


# -- the statistics in the datastore -------------------------------------------------------------


@pytest.mark.parametrize("codec", list(Codec))
def test_every_datastore_is_written_with_its_list_statistics(tmp_path, codec):
    ds = random_datastore(tmp_path / "ds", n=1200, dim=8, nlist=12, codec=codec, empty_lists=1)
    manifest = json.loads((ds.path / MANIFEST).read_text())
    assert manifest["files"][LIST_STATS]["sha256"] == file_sha256(ds.path / LIST_STATS)
    assert ds.list_stats is not None and ds.list_stats.shape == (ds.nlist, 3) and ds.list_stats.dtype == np.float32
    # the statistics of the decoded vectors, rounded outwards
    decoded = stored_vectors(ds, list(range(ds.n_vectors))).astype(np.float64)
    for cluster in range(ds.nlist):
        members = decoded[ds.offsets[cluster] : ds.offsets[cluster + 1]]
        radius, largest, least = ds.list_stats[cluster]
        if not len(members):
            assert (ds.list_stats[cluster] == 0).all()
            continue
        centroid = ds.centroids[cluster].astype(np.float64)
        exact_radius = np.linalg.norm(members - centroid, axis=1).max()
        assert exact_radius <= radius <= exact_radius * (1 + 1e-4) + 1e-4
        assert np.linalg.norm(members, axis=1).max() <= largest
        assert (members @ (centroid / np.linalg.norm(centroid))).min() >= least


def test_a_datastore_without_statistics_is_refused_for_early_stop_in_one_line(tmp_path):
    ds = random_datastore(tmp_path / "ds", n=600, nlist=8)
    strip_list_stats(ds.path)
    old = Datastore.load(ds.path)
    assert old.list_stats is None
    RetrievalEngine(old).close()  # without early stop it is served as before
    with pytest.raises(DatastoreMismatchError) as refused:
        RetrievalEngine(old, early_stop=True)
    message = str(refused.value)
    assert "\n" not in message and f"telerag datastore upgrade {ds.path}" in message and "experiments.early_stop" in message


def test_the_upgrade_command_adds_the_statistics_and_changes_nothing_else(tmp_path, capsys):
    ds = random_datastore(tmp_path / "ds", n=900, dim=8, nlist=10, codec=Codec.SQ8)
    want = np.array(ds.list_stats)
    strip_list_stats(ds.path)
    kept = {MANIFEST, VERIFIED}  # VERIFIED: any open's record of the files that passed their checksums
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in ds.path.iterdir() if p.name not in kept}
    manifest_before = json.loads((ds.path / MANIFEST).read_text())
    assert main(["datastore", "upgrade", str(ds.path)]) == 0
    assert "list statistics added" in capsys.readouterr().out
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in ds.path.iterdir() if p.name not in kept}
    assert set(after) == set(before) | {LIST_STATS}  # one new file, no temporary left
    assert all(after[name] == before[name] for name in before)  # the others untouched
    manifest = json.loads((ds.path / MANIFEST).read_text())
    assert {key: value for key, value in manifest.items() if key != "files"} == {
        key: value for key, value in manifest_before.items() if key != "files"
    }
    assert manifest["files"] == {**manifest_before["files"], LIST_STATS: manifest["files"][LIST_STATS]}
    upgraded = Datastore.load(ds.path)  # checksums verified, the new file's included
    np.testing.assert_array_equal(upgraded.list_stats, want)  # what a fresh build writes
    assert main(["datastore", "upgrade", str(ds.path)]) == 0
    assert "nothing changed" in capsys.readouterr().out


def test_the_upgrade_never_replaces_a_file_it_did_not_write(tmp_path):
    ds = random_datastore(tmp_path / "ds", n=600, nlist=8)
    strip_list_stats(ds.path)
    (ds.path / LIST_STATS).write_bytes(b"someone's notes")
    with pytest.raises(DatastoreError, match="refusing to replace"):
        add_list_stats(ds.path)
    assert (ds.path / LIST_STATS).read_bytes() == b"someone's notes"
    assert LIST_STATS not in json.loads((ds.path / MANIFEST).read_text())["files"]
    # what an upgrade stopped between its two renames leaves (the file, not yet in the manifest)
    # is its own: the next upgrade completes it
    (ds.path / LIST_STATS).unlink()
    add_list_stats(ds.path)
    manifest = json.loads((ds.path / MANIFEST).read_text())
    del manifest["files"][LIST_STATS]
    (ds.path / MANIFEST).write_text(json.dumps(manifest, indent=2))
    assert add_list_stats(ds.path) is True
    assert Datastore.load(ds.path).list_stats is not None


def test_an_upgrade_that_cannot_write_says_so_and_leaves_the_datastore_readable(tmp_path, monkeypatch):
    ds = random_datastore(tmp_path / "ds", n=600, nlist=8)
    strip_list_stats(ds.path)

    def read_only(target: Path, data: bytes) -> None:
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(datastore_writer, "write_by_rename", read_only)
    with pytest.raises(DatastoreError, match=r"could not add list_stats\.npy .*Permission denied.*run the upgrade again"):
        add_list_stats(ds.path)
    assert Datastore.load(ds.path).list_stats is None


class Encoder:
    name, dim = "random", 16


def test_the_serve_path_upgrades_the_embedded_default_and_refuses_a_users_datastore(tmp_path, caplog):
    """An old cache of the built-in Wikipedia datastore (the server's own: it builds it there)
    is upgraded when early stop is asked for, with a log line; a user's datastore is refused
    in one line naming the upgrade; without early stop neither is touched."""
    from telerag.pipelines.datastores import load_datastore

    wiki = random_datastore(tmp_path / "wiki", n=800, nlist=8)
    manifest = json.loads((wiki.path / MANIFEST).read_text())
    (wiki.path / MANIFEST).write_text(json.dumps({**manifest, "source": WIKIPEDIA_SOURCE}))
    strip_list_stats(wiki.path)
    mine = random_datastore(tmp_path / "mine", n=800, nlist=8)
    strip_list_stats(mine.path)

    assert load_datastore(wiki.path, Encoder(), build_if_missing=True).list_stats is None  # early stop off: as it was
    assert not (wiki.path / LIST_STATS).exists()
    with caplog.at_level(logging.INFO, logger="telerag.retrieval.opening"):
        upgraded = load_datastore(wiki.path, Encoder(), build_if_missing=True, early_stop=True)
    assert upgraded.list_stats is not None
    assert any(
        "upgrading the Wikipedia datastore" in r.getMessage() and "list_stats.npy" in r.getMessage() for r in caplog.records
    )
    with pytest.raises(DatastoreMismatchError, match="telerag datastore upgrade"):
        load_datastore(mine.path, Encoder(), build_if_missing=True, early_stop=True)
    with pytest.raises(DatastoreMismatchError, match="telerag datastore upgrade"):
        load_datastore(wiki.path.parent / "mine", Encoder(), build_if_missing=False, early_stop=True)
    assert not (mine.path / LIST_STATS).exists()


def test_list_major_early_stop_asks_for_each_list_in_one_round_only(tmp_path):
    """From disk a round reads each of its lists once for the batch: with `list_major`, a list
    one query's round takes is scanned for every query that has it left, so no list is asked for
    (read) in two rounds, where plain early stop asks for some again; both answer as the full scan."""
    ds = random_datastore(tmp_path / "ds", n=20000, dim=8, nlist=64)
    index = CPUIndex(ds)
    q = stored_vectors(ds, [0, 7000, 14000])
    list_scores, lists = index.probe(q, ds.nlist)
    repeated = {}
    for list_major in (False, True):
        asked: list[set[int]] = []

        early = EarlyStopSearch(Recording(index, asked), ListBounds.of(ds), list_major=list_major)
        assert_same(early.search_lists(q, 50, lists, list_scores), index.search(q, 50, ds.nlist))
        assert len(asked) > 1 and early.counts.scanned < early.counts.probed
        repeated[list_major] = sum(len(round_) for round_ in asked) - len(set().union(*asked))
    assert repeated[False] > 0 and repeated[True] == 0


class Recording:
    """faiss over the lists asked for, each call's lists noted in `asked`."""

    def __init__(self, index: CPUIndex, asked: list[set[int]]) -> None:
        self.index, self.asked = index, asked

    def search_lists(self, queries, k, lists, list_scores):
        self.asked.append(set(lists[lists >= 0].tolist()))
        return self.index.search_lists(queries, k, lists, list_scores)
