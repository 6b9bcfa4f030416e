"""Keyword and hybrid search over a live datastore are exact: after random writes, deletes,
compactions, a retrain and a SIGKILL of the writer, each half and their fusion equal a reference
computed apart from the index (faiss's IVF for the dense half, a plain BM25 over the snapshot's
living passages for the keyword half, the fusion written out again here)."""

from __future__ import annotations

import math
import multiprocessing
import os
import re
import signal
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from telerag.retrieval.builder import assign_lists, train_centroids, write_clustered
from telerag.retrieval.codecs import Codec
from telerag.retrieval.corpus import Passage
from telerag.retrieval.datastore import Datastore
from telerag.retrieval.documents import DocumentDelete, DocumentUpsert
from telerag.retrieval.engine import RetrievalEngine
from telerag.retrieval.ivf import same_results
from telerag.retrieval.keywords import keyword_search
from telerag.retrieval.live import LiveDatastore
from telerag.retrieval.ranking import RRF_K, Fusion, HybridRanking, KeywordRanking
from telerag.retrieval.snapshot import Snapshot, search_snapshot
from tests.test_live_datastore import Reference, unit_vectors

DIM, NLIST = 16, 8
WORDS = [f"w{i}" for i in range(40)] + ["the", "of", "Brelm2q4821"]  # stop words and a made-up name among them
ZIPF = 1.0 / np.arange(1, len(WORDS) + 1)
LUCENE_STOP_WORDS = """a an and are as at be but by for if in into is it no not of on or such that the their then there these
they this to was will with"""
STOP = frozenset(LUCENE_STOP_WORDS.split())


def random_text(rng: np.random.Generator, n: int | None = None) -> str:
    n = int(rng.integers(1, 14)) if n is None else n
    return " ".join(rng.choice(WORDS, size=n, p=ZIPF / ZIPF.sum()))


def text_datastore(path: Path, rng: np.random.Generator, n: int = 300) -> Datastore:
    vectors = unit_vectors(rng, n, DIM)
    centroids = train_centroids(vectors, NLIST, seed=0)
    passages = [Passage(doc_id=f"b{i // 3}", title=f"base {i // 3}", text=random_text(rng)) for i in range(n)]
    write_clustered(
        path,
        vectors=vectors,
        lists=assign_lists(vectors, centroids),
        centroids=centroids,
        codec=Codec.FP32,
        embedder="random",
        passages=passages,
    )
    return Datastore.load(path)


def upsert(rng: np.random.Generator, doc_id: str, version: int) -> DocumentUpsert:
    n = int(rng.integers(1, 4))
    texts = tuple(random_text(rng) for _ in range(n))
    return DocumentUpsert(doc_id, f"title {doc_id}", texts, unit_vectors(rng, n, DIM), content_hash=f"{doc_id}:{version}")


# -- the references ---------------------------------------------------------------------------------


def reference_bm25(snapshot: Snapshot, live: LiveDatastore, text: str, k: int) -> list[tuple[int, float]]:
    """A plain BM25 over every living passage of the snapshot, read one by one (k1 1.2, b 0.75,
    Lucene's idf), ties to the smaller id."""
    passages: dict[int, Counter[str]] = {}
    for entry in live.documents(limit=10**6):
        for passage_id, passage in zip(entry.passage_ids, snapshot.passages_of(list(entry.passage_ids)), strict=True):
            words = [w for w in re.findall(r"\w+", f"{passage.title}\n{passage.text}".casefold()) if w not in STOP]
            passages[passage_id] = Counter(words)
    n = len(passages)
    mean = sum(sum(c.values()) for c in passages.values()) / n
    scores: dict[int, float] = {}
    for term in sorted({w for w in re.findall(r"\w+", text.casefold()) if w not in STOP}):
        holding = {i: c[term] for i, c in passages.items() if c[term]}
        if not holding:
            continue
        idf = float(np.log1p((n - len(holding) + 0.5) / (len(holding) + 0.5)))
        for i, tf in holding.items():
            length = sum(passages[i].values())
            scores[i] = scores.get(i, 0.0) + idf * tf * 2.2 / (tf + 1.2 * (1 - 0.75 + 0.75 * length / mean))
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:k]


def reference_fusion(dense: list[int], keyword: list[int], weights: tuple[float, float], k: int) -> list[int]:
    """Reciprocal rank fusion, written out: weight / (60 + rank), summed, ties to the smaller id."""
    earned: dict[int, float] = {}
    for ids, weight in ((dense, weights[0]), (keyword, weights[1])):
        for rank, i in enumerate(ids, start=1):
            earned[i] = earned.get(i, 0.0) + weight / (RRF_K + rank)
    return [i for i, _ in sorted(earned.items(), key=lambda item: (-item[1], item[0]))[:k]]


def check_against_reference(live: LiveDatastore, engine: RetrievalEngine, reference: Reference | None, rng) -> None:
    """Keyword, hybrid (RRF, uneven weights) and weighted fusion of random queries, each equal to
    the reference's (the dense half: faiss's IVF where `reference` is given, else every list)."""
    snapshot = live.snapshot()
    texts = [random_text(rng, int(rng.integers(1, 4))) for _ in range(3)]
    queries = unit_vectors(rng, len(texts), DIM)
    k, depth = int(rng.integers(1, 8)), 10
    nprobe = int(rng.integers(1, live.datastore.nlist + 1)) if reference is not None else live.datastore.nlist
    scores, ids = keyword_search(snapshot, texts, depth)
    for row, text in enumerate(texts):
        expected = reference_bm25(snapshot, live, text, depth)
        assert ids[row][ids[row] >= 0].tolist() == [i for i, _ in expected], text
        np.testing.assert_allclose(scores[row][: len(expected)], [s for _, s in expected], rtol=1e-5)
    dense_ids = []
    if reference is not None:
        ref_scores, ref_ids = reference.search(queries, depth, nprobe)
    for row in range(len(texts)):
        found = search_snapshot(engine, snapshot, queries[row : row + 1], depth, nprobe)
        if reference is not None:
            assert same_results(found.ids[0], found.scores[0], ref_ids[row], ref_scores[row])
        dense_ids.append(found.ids[0][found.ids[0] >= 0].tolist())

    def dense(at_depth: int, final: bool):
        found = search_snapshot(engine, snapshot, queries, at_depth, nprobe)
        return found.scores, found.ids

    weights = (float(rng.choice([0.0, 0.3, 1.0])), float(rng.choice([0.5, 1.0, 2.0])))
    ranking = HybridRanking(*weights, candidates=depth)
    fused_scores, fused = ranking.rank(snapshot, texts, k, dense)
    for row in range(len(texts)):
        keyword = [i for i, _ in reference_bm25(snapshot, live, texts[row], depth)]
        assert fused[row][fused[row] >= 0].tolist() == reference_fusion(dense_ids[row], keyword, weights, k)
        assert np.all((fused_scores[row][fused[row] >= 0] <= 1.0 + 1e-6) & (fused_scores[row][fused[row] >= 0] >= 0))
    weighted = HybridRanking(*weights, fusion=Fusion.WEIGHTED, candidates=depth).rank(snapshot, texts, k, dense)[1]
    assert all(set(weighted[row][weighted[row] >= 0]) <= set(dense_ids[row]) | set(ids[row].tolist()) for row in range(3))
    assert np.array_equal(KeywordRanking().rank(snapshot, texts, depth, dense)[1], ids)


def test_random_writes_deletes_and_rebuilds_keep_keyword_and_hybrid_search_exact(tmp_path):
    """400 random upserts, deletes and searches, a compaction and a retrain among them, then the
    datastore reopened from its log; a reader following the writer answers the same."""
    rng = np.random.default_rng(zlib.crc32(b"hybrid"))
    ds = text_datastore(tmp_path / "ds", rng)
    live = LiveDatastore(ds, writable=True)
    follower = LiveDatastore(Datastore.load(tmp_path / "ds"))
    engine = RetrievalEngine(ds)
    reference = Reference(ds, {e.doc_id: e.passage_ids for e in live.documents(limit=10**6)})
    doc_ids = [f"b{i}" for i in range(100)] + [f"n{i}" for i in range(40)]
    versions: dict[str, int] = {}
    rebuilds: list[str] = []
    for step in range(400):
        roll = rng.random()
        if roll < 0.15:
            check_against_reference(live, engine, reference, rng)
            assert np.array_equal(
                keyword_search(follower.snapshot(), ["w1 w7 Brelm2q4821"], 9)[1],
                keyword_search(live.snapshot(), ["w1 w7 Brelm2q4821"], 9)[1],
            )
        elif step in (150, 300):
            retrain = step == 300
            live.retrain(nlist=6) if retrain else live.compact()
            rebuilds.append("retrain" if retrain else "compact")
            engine.close()
            engine = RetrievalEngine(live.datastore)
            if retrain:
                reference = reference.retrained(live.datastore.nlist)
        else:
            doc_id = doc_ids[int(rng.integers(len(doc_ids)))]
            if rng.random() < 0.65:
                versions[doc_id] = versions.get(doc_id, 0) + 1
                write = upsert(rng, doc_id, versions[doc_id])
            else:
                write = DocumentDelete(doc_id)
            reference.apply([write], live.write([write]))
    assert rebuilds == ["compact", "retrain"]
    check_against_reference(live, engine, reference, rng)
    live.close()
    engine.close()
    follower.close()
    again = LiveDatastore(Datastore.load(tmp_path / "ds"), writable=True)
    engine = RetrievalEngine(again.datastore)
    check_against_reference(again, engine, reference, rng)
    engine.close()
    again.close()


def _write_until_killed(path: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    live = LiveDatastore(Datastore.load(path), writable=True)
    version = 0
    while True:
        version += 1
        doc_id = f"k{int(rng.integers(30))}"
        live.write([upsert(rng, doc_id, version) if rng.random() < 0.7 else DocumentDelete(doc_id)])


def test_after_a_sigkill_of_the_writer_the_replayed_keyword_half_is_exact(tmp_path):
    """A process writing as fast as it can is killed with SIGKILL; reopened, the log replayed,
    keyword and hybrid search equal the references over what the datastore now holds."""
    rng = np.random.default_rng(7)
    text_datastore(tmp_path / "ds", rng).close()
    child = multiprocessing.get_context("spawn").Process(target=_write_until_killed, args=(str(tmp_path / "ds"), 3))
    child.start()
    wal = tmp_path / "ds" / "wal-000000.log"
    for _ in range(600):
        if wal.exists() and wal.stat().st_size > 20_000:
            break
        child.join(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL
    live = LiveDatastore(Datastore.load(tmp_path / "ds"), writable=True)
    assert live.snapshot().lsn > 0 and any(e.doc_id.startswith("k") for e in live.documents(limit=10**6))
    engine = RetrievalEngine(live.datastore)
    for _ in range(4):
        check_against_reference(live, engine, None, rng)
    engine.close()
    live.close()


@pytest.mark.parametrize("weights", [(1.0, 0.0), (0.0, 1.0)])
def test_a_zero_weight_leaves_the_other_half_alone(tmp_path, weights):
    """All the weight on one half: the hybrid's order is that half's."""
    rng = np.random.default_rng(11)
    live = LiveDatastore(text_datastore(tmp_path / "ds", rng))
    engine = RetrievalEngine(live.datastore)
    snapshot, queries, texts = live.snapshot(), unit_vectors(rng, 2, DIM), ["w3 w9", "Brelm2q4821 w0"]

    def dense(depth: int, final: bool):
        found = search_snapshot(engine, snapshot, queries, depth, NLIST)
        return found.scores, found.ids

    fused = HybridRanking(*weights, candidates=10).rank(snapshot, texts, 5, dense)[1]
    alone = dense(5, True)[1] if weights[0] else keyword_search(snapshot, texts, 5)[1]
    assert np.array_equal(fused, alone)
    assert math.isclose(HybridRanking(*weights).rank(snapshot, texts, 1, dense)[0][0, 0], 1.0, rel_tol=1e-6)
    engine.close()
