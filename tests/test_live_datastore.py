"""A live datastore equals faiss after the same writes: `IndexIVF` with the same centroids, after the
same `add_with_ids` and `remove_ids`, at the same nprobe; durable across reopening; its log's torn
tail discarded, its damage refused."""

from __future__ import annotations

import logging
import zlib
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import pytest

from telerag.benchmarks.ingest import FaissReplay
from telerag.retrieval import compaction
from telerag.retrieval.builder import assign_lists, order_centroids, train_centroids, write_clustered
from telerag.retrieval.codecs import Codec
from telerag.retrieval.compaction import training_sample, write_generation
from telerag.retrieval.corpus import Passage
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.documents import DocumentDelete, DocumentUpsert, WriteOutcome
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.errors import DatastoreBusy, DatastoreCorruptError, DatastoreReadOnly
from telerag.retrieval.generations import wal_name
from telerag.retrieval.ivf import same_results
from telerag.retrieval.live import LiveDatastore
from telerag.retrieval.snapshot import search_snapshot
from tests.retrieval_helpers import random_datastore, random_queries


def passage_datastore(path: Path, *, n: int = 600, dim: int = 16, nlist: int = 16, codec: Codec = Codec.FP32, seed: int = 0):
    """Random unit vectors in `nlist` lists, three passages to a document (`b0`, `b1`, ...)."""
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    centroids = train_centroids(vectors, nlist, seed=seed)
    passages = [Passage(doc_id=f"b{i // 3}", title=f"base {i // 3}", text=f"base passage {i}") for i in range(n)]
    write_clustered(
        path,
        vectors=vectors,
        lists=assign_lists(vectors, centroids),
        centroids=centroids,
        codec=codec,
        embedder="random",
        passages=passages,
    )
    return Datastore.load(path)


class Reference(FaissReplay):
    """faiss's own IVF over the same centroids and codes (`FaissReplay`: the generation's codes added
    to its lists as they lie), then every write as `add_with_ids` and `remove_ids`."""

    def __init__(self, ds: Datastore, documents: dict[str, tuple[int, ...]]) -> None:
        """`documents`: each document's ids in the generation."""
        super().__init__(ds, documents)
        self.codec, self.params = ds.codec, ds.codec_params

    def apply(self, writes, results) -> None:
        """The writes that changed something: the document's old ids removed, its new vectors added."""
        for write, result in zip(writes, results, strict=True):
            if result.outcome in (WriteOutcome.UNCHANGED, WriteOutcome.NOT_FOUND):
                continue
            old = self.documents.pop(write.doc_id, ())
            if old:
                assert self.index.remove_ids(np.asarray(old, dtype=np.int64)) == len(old)
            if isinstance(write, DocumentUpsert):
                ids = result.document.passage_ids
                self.index.add_with_ids(np.ascontiguousarray(write.vectors, dtype=np.float32), np.asarray(ids, dtype=np.int64))
                self.documents[write.doc_id] = ids

    def search(self, queries: np.ndarray, k: int, nprobe: int) -> tuple[np.ndarray, np.ndarray]:
        return self.index.search(queries, k, params=faiss.SearchParametersIVF(nprobe=nprobe))

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (id, code) the index holds, by id."""
        invlists = faiss.downcast_InvertedLists(self.index.invlists)
        ids, codes = [], []
        for cluster in range(self.index.nlist):
            n = invlists.list_size(cluster)
            if n:
                ids.append(faiss.rev_swig_ptr(invlists.get_ids(cluster), n).copy())
                raw = faiss.rev_swig_ptr(invlists.get_codes(cluster), n * invlists.code_size)
                codes.append(np.frombuffer(bytes(raw), dtype=self.codec.numpy_dtype).reshape(n, -1))
        ids_, codes_ = np.concatenate(ids), np.concatenate(codes)
        order = np.argsort(ids_)
        return ids_[order], codes_[order]

    def retrained(self, nlist: int) -> Reference:
        """faiss trained as a retrain trains: k-means over the decoded vectors taken by id (at most
        256 a list, drawn as `training_sample` draws them), the centroids ordered as a build orders
        them; every vector added to its nearest one's list."""
        ids, codes = self.rows()
        decoded = self.codec.decode_exact(codes, self.params).astype(np.float32)
        centroids = train_centroids(decoded[training_sample(ids, nlist, 1234)], nlist, seed=1234)
        centroids = np.ascontiguousarray(centroids[order_centroids(centroids)])
        fresh = Reference.__new__(Reference)
        fresh.documents, fresh.codec, fresh.params = dict(self.documents), self.codec, self.params
        fresh.index, fresh._quantizer = self.codec.empty_faiss_index(centroids, self.params)
        lists = fresh._quantizer.search(decoded, 1)[1][:, 0]
        invlists = faiss.downcast_InvertedLists(fresh.index.invlists)
        for cluster in np.unique(lists):
            members = np.flatnonzero(lists == cluster)
            member_ids, member_codes = np.ascontiguousarray(ids[members]), np.ascontiguousarray(codes[members]).view(np.uint8)
            invlists.add_entries(int(cluster), len(members), faiss.swig_ptr(member_ids), faiss.swig_ptr(member_codes))
        fresh.index.ntotal = len(ids)
        return fresh


def unit_vectors(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def upsert(doc_id: str, vectors: np.ndarray, version: Any = 0) -> DocumentUpsert:
    texts = tuple(f"{doc_id} v{version} passage {i}" for i in range(len(vectors)))
    return DocumentUpsert(doc_id, f"title {doc_id}", texts, vectors, content_hash=f"{doc_id}:{version}")


def assert_equal_to_reference(live: LiveDatastore, engine: RetrievalEngine, reference: Reference, queries, k, nprobe, **options):
    result = search_snapshot(engine, live.snapshot(), queries, k, nprobe, **options)
    ref_scores, ref_ids = reference.search(queries, k, nprobe)
    for i in range(len(queries)):
        assert same_results(result.ids[i], result.scores[i], ref_ids[i], ref_scores[i]), (i, result.ids[i], ref_ids[i])
    return result


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize(
    ("device_half", "sampled"), [(False, False), (True, False), (False, True)], ids=["faiss-only", "with-device-half", "sampled"]
)
def test_random_writes_searches_and_rebuilds_equal_faiss(tmp_path, monkeypatch, codec, device_half, sampled):
    """1,000 random upserts, deletes and searches; a compaction (the same answers) and a retrain
    (new centroids: faiss trained the same way) now and then; reopened from the log at the end.
    A reader opened beside the writer (another process would be: an inference replica) follows
    it and answers every search as faiss does too. `sampled`: a retrain trains on 8 rows a list
    and writes its rows in windows of 8 KB, as it does a datastore larger than memory."""
    if sampled:
        monkeypatch.setattr(compaction, "TRAIN_POINTS_PER_LIST", 8)
        monkeypatch.setattr(compaction, "RETRAIN_WINDOW_BYTES", 64 * 32 * 4)
    rng = np.random.default_rng(zlib.crc32(f"{codec.value} {device_half}".encode()))
    ds = passage_datastore(tmp_path / "ds", codec=codec)
    live = LiveDatastore(ds, writable=True)
    follower = LiveDatastore(Datastore.load(tmp_path / "ds"))

    def engine_of(datastore: Datastore) -> RetrievalEngine:
        return RetrievalEngine(datastore, cache_bytes=datastore.vectors.nbytes // 2 if device_half else 0)

    engine = engine_of(ds)
    follower_engines = {0: RetrievalEngine(follower.datastore)}
    reference = Reference(ds, {e.doc_id: e.passage_ids for e in live.documents(limit=10**6)})
    doc_ids = [f"b{i}" for i in range(200)] + [f"n{i}" for i in range(60)]
    versions: dict[str, int] = {}
    operations = searches = 0
    rebuilds: list[str] = []
    while operations < 1000:
        roll = rng.random()
        if roll < 0.45:
            queries = unit_vectors(rng, int(rng.integers(1, 5)), ds.dim)
            # past the lists sometimes (an nprobe chosen before a retrain left fewer): every list, as faiss's
            k, nprobe = int(rng.integers(1, 12)), int(rng.integers(1, live.datastore.nlist + 9))
            options = {}
            if device_half:
                budget = int(rng.integers(0, live.datastore.vectors.nbytes))
                options = {"prefetch": engine.prefetch(queries + 0.2 * unit_vectors(rng, len(queries), ds.dim), budget)}
            assert_equal_to_reference(live, engine, reference, queries, k, nprobe, **options)
            followed = follower.snapshot()
            assert followed.lsn == live.snapshot().lsn and followed.generation == live.generation
            if followed.generation not in follower_engines:
                follower_engines[followed.generation] = RetrievalEngine(followed.datastore)
            assert_equal_to_reference(follower, follower_engines[followed.generation], reference, queries, k, nprobe)
            searches += 1
            operations += 1
            continue
        if roll < 0.46:
            retrain = len(rebuilds) % 2 == 1  # compactions and retrains in turn
            done = live.retrain(nlist=int(rng.integers(8, 24))) if retrain else live.compact()
            assert done.generation == live.generation == len(rebuilds) + 1 and done.retrained == retrain
            rebuilds.append("retrain" if retrain else "compact")
            engine.close()
            engine = engine_of(live.datastore)
            if retrain:
                reference = reference.retrained(live.datastore.nlist)
            assert not len(live.snapshot().delta) and not len(live.snapshot().deleted)
            continue
        writes = []
        for _ in range(int(rng.integers(1, 4))):  # a batch: one sync
            doc_id = doc_ids[int(rng.integers(len(doc_ids)))]
            if rng.random() < 0.65:
                same = rng.random() < 0.1 and doc_id in versions
                versions[doc_id] = versions.get(doc_id, 0) + (0 if same else 1)
                writes.append(upsert(doc_id, unit_vectors(rng, int(rng.integers(1, 5)), ds.dim), versions[doc_id]))
            else:
                writes.append(DocumentDelete(doc_id))
        results = live.write(writes)
        reference.apply(writes, results)
        operations += len(writes)
    assert searches >= 200 and {"compact", "retrain"} <= set(rebuilds), rebuilds
    snapshot = live.snapshot()
    assert snapshot.passages == reference.index.ntotal
    queries = unit_vectors(rng, 16, ds.dim)
    before = assert_equal_to_reference(live, engine, reference, queries, 10, 4)
    live.close()
    engine.close()
    for follower_engine in follower_engines.values():
        follower_engine.close()
    follower.close()

    # reopened: the last generation's files and every write since replayed from its log, the same answers
    again = LiveDatastore(Datastore.load(tmp_path / "ds"), writable=True)
    assert again.generation == len(rebuilds)
    assert again.snapshot().lsn == snapshot.lsn and again.snapshot().passages == snapshot.passages
    engine = RetrievalEngine(again.datastore)
    after = assert_equal_to_reference(again, engine, reference, queries, 10, 4)
    np.testing.assert_array_equal(after.ids, before.ids)
    again.close()


def test_a_snapshot_keeps_its_version_and_an_upsert_is_atomic(tmp_path):
    ds = passage_datastore(tmp_path / "ds")
    live = LiveDatastore(ds, writable=True)
    engine = RetrievalEngine(ds)
    rng = np.random.default_rng(3)
    target = unit_vectors(rng, 1, ds.dim)
    old = live.write([upsert("doc", np.repeat(target, 3, axis=0) + 1e-3 * unit_vectors(rng, 3, ds.dim), 1)])[0]
    before = live.snapshot()
    new = live.write([upsert("doc", np.repeat(target, 2, axis=0), 2)])[0]
    assert new.outcome is WriteOutcome.REPLACED and new.document.version == 2
    after = live.snapshot()
    found_before = search_snapshot(engine, before, target, 5, ds.nlist).ids[0]
    found_after = search_snapshot(engine, after, target, 5, ds.nlist).ids[0]
    assert set(old.document.passage_ids) <= set(found_before.tolist())
    assert not set(new.document.passage_ids) & set(found_before.tolist())
    assert set(new.document.passage_ids) <= set(found_after.tolist())
    assert not set(old.document.passage_ids) & set(found_after.tolist())
    assert [p.text for p in after.passages_of(list(new.document.passage_ids))] == ["doc v2 passage 0", "doc v2 passage 1"]
    live.close()


def test_outcomes_and_documents(tmp_path):
    ds = passage_datastore(tmp_path / "ds", n=30)
    live = LiveDatastore(ds, writable=True)
    rng = np.random.default_rng(0)
    assert live.document("b0").passage_ids == (*(row for row in range(30) if ds.passages([row])[0].doc_id == "b0"),)
    results = live.write(
        [
            upsert("x", unit_vectors(rng, 2, ds.dim), 1),
            upsert("x", unit_vectors(rng, 2, ds.dim), 1),  # the same hash: unchanged
            DocumentDelete("nope"),
            DocumentDelete("b0"),
            upsert("b1", unit_vectors(rng, 1, ds.dim), 1),
        ]
    )
    assert [r.outcome for r in results] == [
        WriteOutcome.CREATED,
        WriteOutcome.UNCHANGED,
        WriteOutcome.NOT_FOUND,
        WriteOutcome.DELETED,
        WriteOutcome.REPLACED,
    ]
    assert results[0].lsn == 1 and results[3].lsn == 2 and results[4].lsn == 3 and results[2].lsn == 3
    assert live.document("b0") is None and live.document("b1").version == 2 and live.document("x").version == 1
    assert live.snapshot().documents == 10 - 1 + 1
    page = live.documents(limit=3)
    assert [d.doc_id for d in page] == ["b1", "b2", "b3"]
    assert [d.doc_id for d in live.documents(after="b8", limit=5)] == ["b9", "x"]
    stats = live.stats()
    assert stats.lsn == 3 and stats.passages == 30 - 6 + 2 + 1 and stats.tombstones == 6 and stats.wal_bytes > 0
    live.close()


def test_pages_of_documents_after_random_writes_are_the_living_ids_in_order(tmp_path):
    """Paging by `after` and `limit` gives each living document once, in id order, whatever was
    written, replaced or deleted since the generation (its documents and the writes' merged)."""
    ds = passage_datastore(tmp_path / "ds", n=90)  # b0 .. b29
    live = LiveDatastore(ds, writable=True)
    rng = np.random.default_rng(7)
    living = {f"b{i}" for i in range(30)}
    for step in range(120):
        doc_id = f"b{rng.integers(40)}" if rng.random() < 0.5 else f"n{rng.integers(40)}"
        if rng.random() < 0.3:
            live.write([DocumentDelete(doc_id)])
            living.discard(doc_id)
        else:
            live.write([upsert(doc_id, unit_vectors(rng, 1, ds.dim), step)])
            living.add(doc_id)
        if step % 20 == 19:
            limit, after, paged = int(rng.integers(1, 9)), None, []
            while page := live.documents(after=after, limit=limit):
                paged += [d.doc_id for d in page]
                after = page[-1].doc_id
            assert paged == sorted(living)
            middle = sorted(living)[len(living) // 2]
            assert [d.doc_id for d in live.documents(after=middle + "~", limit=3)] == [
                i for i in sorted(living) if i > middle + "~"
            ][:3]  # an id that is no document's starts the page as well
    live.close()


def test_torn_tail_is_discarded_with_one_line_and_damage_is_refused(tmp_path, caplog):
    ds = passage_datastore(tmp_path / "ds", n=30)
    live = LiveDatastore(ds, writable=True)
    rng = np.random.default_rng(0)
    live.write([upsert("a", unit_vectors(rng, 2, ds.dim), 1)])
    live.write([upsert("b", unit_vectors(rng, 2, ds.dim), 1)])
    live.close()
    wal = tmp_path / "ds" / wal_name(0)
    whole = wal.read_bytes()
    wal.write_bytes(whole + whole[16:40])  # a third record cut short
    with caplog.at_level(logging.WARNING, logger="telerag.retrieval.wal"):
        reopened = LiveDatastore(Datastore.load(tmp_path / "ds"), writable=True)
    assert [r.message for r in caplog.records if "torn tail" in r.message]
    assert reopened.snapshot().lsn == 2 and reopened.document("b") is not None
    assert wal.read_bytes() == whole
    reopened.close()

    damaged = bytearray(whole)
    damaged[30] ^= 0xFF  # inside the first record, with the second after it
    wal.write_bytes(bytes(damaged))
    with pytest.raises(DatastoreCorruptError, match="damaged"):
        LiveDatastore(Datastore.load(tmp_path / "ds"), writable=True)


def test_a_reader_follows_the_writer_record_by_record_and_waits_out_a_record_being_appended(tmp_path):
    """A reader applies the writer's records as they become whole: one appended in two pieces
    (a writer's process between two writes of it, or killed there) is not read until it is whole;
    the writer's switch to a new generation is followed, with the writes carried into it."""
    ds = passage_datastore(tmp_path / "ds", n=60)
    writer = LiveDatastore(ds, writable=True)
    reader = LiveDatastore(Datastore.load(tmp_path / "ds"))
    rng = np.random.default_rng(0)
    writer.write([upsert("a", unit_vectors(rng, 2, ds.dim), 1)])
    assert reader.document("a") is not None and reader.snapshot().lsn == 1
    wal = tmp_path / "ds" / wal_name(0)
    before = wal.read_bytes()
    writer.write([upsert("c", unit_vectors(rng, 3, ds.dim), 1)])
    record = wal.read_bytes()[len(before) :]
    wal.write_bytes(before + record[:20])  # the record half appended
    assert reader.document("c") is None and reader.snapshot().lsn == 1
    wal.write_bytes(before + record)  # then whole
    assert reader.document("c") is not None and reader.snapshot().lsn == 2
    assert reader.snapshot().passages == writer.snapshot().passages
    writer.write([DocumentDelete("a")])
    writer.compact()
    writer.write([upsert("d", unit_vectors(rng, 1, ds.dim), 1)])
    followed = reader.snapshot()
    assert (followed.generation, followed.lsn) == (1, 4) and reader.document("a") is None
    assert {e.doc_id for e in reader.documents(limit=1000)} == {e.doc_id for e in writer.documents(limit=1000)}
    with pytest.raises(DatastoreReadOnly):
        reader.write([DocumentDelete("c")])
    writer.close()
    reader.close()


def test_one_writer_at_a_time_and_readers_beside_it(tmp_path):
    ds = passage_datastore(tmp_path / "ds", n=30)
    writer = LiveDatastore(ds, writable=True)
    with pytest.raises(DatastoreBusy, match="held for writing by another process"):
        LiveDatastore(Datastore.load(tmp_path / "ds"), writable=True)
    writer.write([upsert("a", unit_vectors(np.random.default_rng(0), 2, ds.dim), 1)])
    reader = LiveDatastore(Datastore.load(tmp_path / "ds"))
    assert reader.document("a") is not None and not reader.writable
    with pytest.raises(DatastoreReadOnly):
        reader.write([DocumentDelete("a")])
    writer.close()
    LiveDatastore(Datastore.load(tmp_path / "ds"), writable=True).close()  # the lock went with the writer


def test_vectors_only_datastore_refuses_writes(tmp_path):
    ds = random_datastore(tmp_path / "ds", n=200)
    live = LiveDatastore(ds, writable=True)
    with pytest.raises(DatastoreReadOnly, match="vectors only"):
        live.write([upsert("a", random_queries(1, ds.dim), 1)])
    live.close()


def test_a_compaction_changes_no_answer_and_carries_the_writes_made_meanwhile(tmp_path, monkeypatch):
    ds = passage_datastore(tmp_path / "ds")
    live = LiveDatastore(ds, writable=True)
    rng = np.random.default_rng(5)
    for i in range(30):
        live.write([upsert(f"n{i}", unit_vectors(rng, 2, ds.dim), 1), DocumentDelete(f"b{i}")])
    before, old_engine = live.snapshot(), RetrievalEngine(ds)
    queries = unit_vectors(rng, 20, ds.dim)

    from telerag.retrieval import live as live_module

    build = live_module.write_generation

    def build_then_write(*args, **kwargs):
        out = build(*args, **kwargs)
        live.write([upsert("during", unit_vectors(rng, 3, ds.dim), 1)])  # while the new generation was built
        return out

    monkeypatch.setattr(live_module, "write_generation", build_then_write)
    done = live.compact()
    assert (done.generation, done.carried, done.lsn, done.retrained) == (1, 1, before.lsn, False)
    assert live.document("during") is not None and live.snapshot().lsn == before.lsn + 1
    new_engine = RetrievalEngine(live.datastore)
    for nprobe in (1, 4, ds.nlist):
        old = search_snapshot(old_engine, before, queries, 8, nprobe)
        new = search_snapshot(new_engine, live.snapshot(), queries, 8, nprobe)
        during = set(live.document("during").passage_ids)
        for i in range(len(queries)):
            kept = [j for j, passage_id in enumerate(new.ids[i]) if passage_id not in during][:5]
            assert same_results(new.ids[i][kept], new.scores[i][kept], old.ids[i][:5], old.scores[i][:5])
    assert not (tmp_path / "ds" / wal_name(0)).exists() and (tmp_path / "ds" / "gen-000001" / "ids.npy").is_file()
    live.close()
    again = LiveDatastore(Datastore.load(tmp_path / "ds"))
    assert again.generation == 1 and again.document("during").version == 1 and again.document("b3") is None
    assert again.document("n7").content_hash == "n7:1" and again.snapshot().passages == live.snapshot().passages


def test_a_build_killed_before_its_switch_leaves_the_datastore_as_it_was(tmp_path):
    ds = passage_datastore(tmp_path / "ds")
    live = LiveDatastore(ds, writable=True)
    rng = np.random.default_rng(6)
    live.write([upsert("n", unit_vectors(rng, 2, ds.dim), 1), DocumentDelete("b1")])
    write_generation(tmp_path / "ds" / "gen-000001", live.snapshot(), {})  # a build whose switch never came
    (tmp_path / "ds" / wal_name(1)).write_bytes(b"TELERAG-WAL")  # and the start of its log
    live.close()
    again = LiveDatastore(Datastore.load(tmp_path / "ds"), writable=True)
    assert again.generation == 0 and again.document("n") is not None and again.document("b1") is None
    assert sorted(p.name for p in (tmp_path / "ds").iterdir() if p.name.startswith(("gen-", "wal-"))) == [wal_name(0)]
    done = again.compact()  # and the next build goes through
    assert done.generation == 1 and again.document("n") is not None
    again.close()
