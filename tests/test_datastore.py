"""Building and loading datastores: layout, atomic writes, and a clear error for every bad input."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from telerag.cli import main as cli
from telerag.retrieval import codecs as codecs_module
from telerag.retrieval import datastore_writer
from telerag.retrieval.builder import assign_lists, build_datastore, default_nlist, write_clustered
from telerag.retrieval.codecs import Codec
from telerag.retrieval.corpus import Article, Passage, PassageShape, read_jsonl, read_wikipedia, split_passages
from telerag.retrieval.datastore import CODEC_PARAMS, MANIFEST, VECTORS, Datastore, Manifest
from telerag.retrieval.datastore_writer import write_datastore
from telerag.retrieval.errors import (
    CorpusError,
    DatastoreCorruptError,
    DatastoreError,
    DatastoreMismatchError,
    LayoutError,
    PassageNotFound,
)
from tests.retrieval_helpers import hashing_encoder, random_datastore, stored_vectors


def write_corpus(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def good_corpus(path: Path, n: int = 60) -> Path:
    topics = ["river water fish boat", "star planet orbit moon", "piano music song concert", "bread flour oven bake"]
    lines = [
        json.dumps({"id": f"doc{i}", "title": f"Title {i}", "text": " ".join([topics[i % 4]] * (10 + i % 30))}) for i in range(n)
    ]
    return write_corpus(path, lines)


def test_build_and_load_roundtrip(tmp_path):
    passages = list(split_passages(read_jsonl(good_corpus(tmp_path / "c.jsonl")), passage_words=20))
    out = build_datastore(passages, hashing_encoder(), embedder="hash-16", out_dir=tmp_path / "ds", nlist=4, progress=False)
    ds = Datastore.load(out, embedder="hash-16", dim=16)
    assert ds.n_vectors == len(passages) and ds.nlist == 4
    assert ds.offsets[0] == 0 and ds.offsets[-1] == ds.n_vectors and (np.diff(ds.offsets) >= 0).all()
    manifest = json.loads((out / MANIFEST).read_text())
    assert {"embedder", "dim", "metric", "codec", "n_vectors", "nlist", "files", "format_version"} <= manifest.keys()
    assert all("sha256" in meta for meta in manifest["files"].values())
    # every passage is stored once, in cluster order, and its vector is the encoding of its text
    stored = ds.passages(range(ds.n_vectors))
    assert sorted(p.text for p in stored) == sorted(p.text for p in passages)
    with pytest.raises(PassageNotFound):
        ds.passages([ds.n_vectors])
    encode = hashing_encoder()
    np.testing.assert_allclose(ds.vectors[:5], encode([p.text for p in stored[:5]]), rtol=1e-6)
    # vectors of a cluster are nearer to their own centroid than to any other
    for c in range(ds.nlist):
        rows = np.asarray(ds.vectors[ds.offsets[c] : ds.offsets[c + 1]])
        if len(rows):
            scores = rows @ ds.centroids.T
            assert np.all(scores[:, c] >= scores.max(axis=1) - 1e-6)
    # nothing but the datastore is left in the parent directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "ds"]


def test_split_passages_word_count():
    article = Article(id="a", title="A", text=" ".join(f"w{i}" for i in range(230)))
    parts = list(split_passages([article], passage_words=100))
    assert [len(p.text.split()) for p in parts] == [100, 130]  # a short tail joins the previous passage
    assert all(p.doc_id == "a" and p.title == "A" for p in parts)


def test_split_passages_with_overlap():
    article = Article(id="a", title="A", text=" ".join(f"w{i}" for i in range(230)))
    parts = [p.text.split() for p in split_passages([article], passage_words=100, overlap_words=20)]
    # windows of 100 words every 80; the last, with 70 new words, stands alone
    assert [(p[0], len(p)) for p in parts] == [("w0", 100), ("w80", 100), ("w160", 70)]
    # a tail of under a third of a passage of new words joins the passage before it
    short = Article(id="b", title="B", text=" ".join(f"w{i}" for i in range(200)))
    assert [len(p.text.split()) for p in split_passages([short], passage_words=100, overlap_words=20)] == [100, 120]
    assert [len(p.text.split()) for p in split_passages([short], passage_words=100)] == [100, 100]
    for words, overlap in ((100, 100), (100, -1), (0, 0)):
        with pytest.raises(CorpusError):
            PassageShape(words=words, overlap=overlap)
        with pytest.raises(CorpusError):
            list(split_passages([short], passage_words=words, overlap_words=overlap))


def test_a_title_in_front_is_embedded_not_stored(tmp_path):
    articles = list(read_jsonl(good_corpus(tmp_path / "c.jsonl")))
    shape = PassageShape(words=20, overlap=5, title=True)
    passages = list(shape.split(articles))
    out = build_datastore(
        passages, hashing_encoder(), embedder="hash-16", out_dir=tmp_path / "ds", nlist=4, shape=shape, progress=False
    )
    ds = Datastore.load(out, embedder="hash-16", dim=16)
    assert (ds.manifest.passage_words, ds.manifest.passage_overlap, ds.manifest.passage_title) == (20, 5, True)
    stored = ds.passages(range(5))
    assert not any(p.text.startswith(p.title) for p in stored)  # prompts show the passage text alone
    np.testing.assert_allclose(ds.vectors[:5], hashing_encoder()([f"{p.title}\n{p.text}" for p in stored]), rtol=1e-6)


def test_a_datastore_of_another_format_version_says_how_to_rebuild(tmp_path):
    ds = random_datastore(tmp_path / "ds")
    manifest = json.loads((ds.path / MANIFEST).read_text())
    manifest["format_version"] -= 1
    (ds.path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DatastoreMismatchError, match=r"telerag datastore build --wikipedia --out .* --overwrite"):
        Datastore.load(ds.path)


def test_fp16_codec_halves_the_bytes(tmp_path):
    fp32 = random_datastore(tmp_path / "a", codec=Codec.FP32)
    fp16 = random_datastore(tmp_path / "b", codec=Codec.FP16)
    assert (fp16.path / VECTORS).stat().st_size < 0.55 * (fp32.path / VECTORS).stat().st_size
    assert fp16.vectors.dtype == np.float16


def test_sq8_codec_quarters_the_bytes_and_keeps_its_ranges(tmp_path):
    fp32 = random_datastore(tmp_path / "a", codec=Codec.FP32)
    sq8 = random_datastore(tmp_path / "b", codec=Codec.SQ8)
    assert (sq8.path / VECTORS).stat().st_size < 0.3 * (fp32.path / VECTORS).stat().st_size
    assert sq8.vectors.dtype == np.uint8 and sq8.codec_params.shape == (2, sq8.dim)
    decoded = stored_vectors(sq8, list(range(sq8.n_vectors)))
    # the same vectors as fp32's (same seed, same layout) within one quantisation step per dimension
    assert np.all(np.abs(decoded - np.asarray(fp32.vectors)) <= sq8.codec_params[1] / 255 + 1e-6)
    (sq8.path / CODEC_PARAMS).unlink()
    with pytest.raises(DatastoreCorruptError, match="missing"):
        Datastore.load(sq8.path)


def test_codec_parameters_must_match_the_codec(tmp_path):
    ds = random_datastore(tmp_path / "ds")
    manifest = Manifest(embedder="x", dim=ds.dim, nlist=ds.nlist, n_vectors=ds.n_vectors, codec=Codec.SQ8.value)
    codes = np.zeros((ds.n_vectors, ds.dim), dtype=np.uint8)
    with pytest.raises(DatastoreError, match="sq8 needs"):
        write_datastore(
            tmp_path / "out", manifest=manifest, centroids=ds.centroids, offsets=ds.offsets, vectors=codes, passages=None
        )
    assert not (tmp_path / "out").exists()
    with pytest.raises(LayoutError, match="sq8 needs"):
        Codec.SQ8.to_codes(np.asarray(ds.vectors), None)


@pytest.mark.parametrize(("more", "message"), [(-1, "passages for"), (1, "more passages than")])
def test_a_passage_a_vector_or_nothing_is_written(tmp_path, more, message):
    ds = random_datastore(tmp_path / "ds")
    manifest = Manifest(embedder="x", dim=ds.dim, nlist=ds.nlist, n_vectors=ds.n_vectors)
    passages = [Passage(doc_id=f"d{i}", title="t", text=f"passage {i}") for i in range(ds.n_vectors + 1)]
    with pytest.raises(DatastoreError, match=message):
        write_datastore(
            tmp_path / "out",
            manifest=manifest,
            centroids=ds.centroids,
            offsets=ds.offsets,
            vectors=ds.vectors,
            passages=passages[: ds.n_vectors + more],
        )
    assert not (tmp_path / "out").exists()
    written = write_datastore(
        tmp_path / "out",
        manifest=manifest,
        centroids=ds.centroids,
        offsets=ds.offsets,
        vectors=ds.vectors,
        passages=passages[: ds.n_vectors],
    )
    assert Datastore.load(written).passages([0, ds.n_vectors - 1]) == [passages[0], passages[ds.n_vectors - 1]]


@pytest.mark.parametrize(
    ("lines", "message", "line"),
    [
        ([], "empty corpus", None),
        (['{"id": "a", "title": "t", "text": "x"}', "{not json"], "malformed JSON", 2),
        (['{"id": "a", "title": "t"}'], "missing field", 1),
        (['{"id": "a", "title": "t", "text": "x"}', '{"id": "a", "title": "u", "text": "y"}'], "duplicate id", 2),
        (['{"id": "a", "title": 3, "text": "x"}'], "must be a string", 1),
        (['{"id": "a", "title": "t", "text": "  "}'], "empty text", 1),
        (["[1, 2]"], "JSON object", 1),
    ],
)
def test_bad_corpus_names_file_and_line(tmp_path, lines, message, line):
    path = write_corpus(tmp_path / "bad.jsonl", lines)
    with pytest.raises(CorpusError, match=message) as info:
        list(read_jsonl(path))
    assert str(path) in str(info.value)
    assert info.value.line == line


def test_missing_corpus_file(tmp_path):
    with pytest.raises(CorpusError, match="not found"):
        list(read_jsonl(tmp_path / "nope.jsonl"))


def test_refuses_wrong_embedder_or_dim(tmp_path):
    ds = random_datastore(tmp_path / "ds")
    with pytest.raises(DatastoreMismatchError, match="embedder"):
        Datastore.load(ds.path, embedder="another-model")
    with pytest.raises(DatastoreMismatchError, match="-d vectors"):
        Datastore.load(ds.path, dim=ds.dim + 1)


def test_refuses_truncated_or_corrupt_files(tmp_path):
    ds = random_datastore(tmp_path / "ds")
    vectors = ds.path / VECTORS
    data = vectors.read_bytes()
    vectors.write_bytes(data[:-100])
    with pytest.raises(DatastoreCorruptError, match="truncated"):
        Datastore.load(ds.path)
    corrupted = bytearray(data)
    corrupted[-7] ^= 0xFF
    vectors.write_bytes(bytes(corrupted))
    with pytest.raises(DatastoreCorruptError, match="checksum"):
        Datastore.load(ds.path)
    vectors.unlink()
    with pytest.raises(DatastoreCorruptError, match="missing"):
        Datastore.load(ds.path)


def test_long_steps_show_progress(tmp_path, capsys):
    """Embedding, layout and checksums touch every vector: minutes for a large datastore, never
    silent; and quiet when asked to be."""
    passages = list(split_passages(read_jsonl(good_corpus(tmp_path / "c.jsonl")), passage_words=20))
    out = build_datastore(passages, hashing_encoder(), embedder="hash-16", out_dir=tmp_path / "ds", nlist=4, progress=True)
    err = capsys.readouterr().err
    assert all(step in err for step in ("embed passages", "assign lists", "write vectors", "checksum")), err
    Datastore.load(out, progress=True)
    assert "verify checksums" in capsys.readouterr().err
    Datastore.load(out)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("codec", list(Codec))
def test_writing_never_holds_a_second_copy_of_the_vectors(tmp_path, monkeypatch, codec):
    """Sorting by cluster and encoding happen block by block as the file is written: a build's
    peak memory is its embeddings plus a block, not twice the datastore."""
    # the constant-sized parts (a write block, the sq8 training sample) small beside the set
    monkeypatch.setattr(datastore_writer, "WRITE_BLOCK_BYTES", 1 << 20)
    monkeypatch.setattr(codecs_module, "SQ8_TRAIN_SAMPLE", 1 << 14)
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((400_000, 16)).astype(np.float32)  # 25.6 MB: many write blocks
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    centroids = vectors[:8].copy()
    lists = assign_lists(vectors, centroids)
    tracemalloc.start()
    try:
        out = write_clustered(tmp_path / "ds", vectors=vectors, lists=lists, centroids=centroids, codec=codec, embedder="x")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 0.8 * vectors.nbytes, peak
    ds = Datastore.load(out)
    for cluster in range(ds.nlist):  # each list holds its vectors' codes, in input order
        original = int(np.flatnonzero((centroids == ds.centroids[cluster]).all(axis=1))[0])
        stored = ds.vectors[int(ds.offsets[cluster]) : int(ds.offsets[cluster + 1])]
        np.testing.assert_array_equal(stored, codec.to_codes(vectors[lists == original], ds.codec_params))


def test_not_a_datastore(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(DatastoreError, match="not a datastore"):
        Datastore.load(tmp_path / "half")
    with pytest.raises(DatastoreError, match="no datastore"):
        Datastore.load(tmp_path / "absent")


def test_failed_build_leaves_nothing(tmp_path):
    passages = list(split_passages(read_jsonl(good_corpus(tmp_path / "c.jsonl"))))

    def broken(texts):
        raise RuntimeError("encoder crashed")

    with pytest.raises(RuntimeError):
        build_datastore(passages, broken, embedder="x", out_dir=tmp_path / "ds", progress=False)
    with pytest.raises(DatastoreError, match="between 1 and"):
        build_datastore(passages, hashing_encoder(), embedder="x", out_dir=tmp_path / "ds", nlist=10**6, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_existing_datastore_needs_overwrite(tmp_path):
    passages = list(split_passages(read_jsonl(good_corpus(tmp_path / "c.jsonl"))))
    build_datastore(passages, hashing_encoder(), embedder="x", out_dir=tmp_path / "ds", nlist=2, progress=False)
    with pytest.raises(DatastoreError, match="already holds a datastore"):
        build_datastore(passages, hashing_encoder(), embedder="x", out_dir=tmp_path / "ds", nlist=2, progress=False)
    build_datastore(passages, hashing_encoder(), embedder="y", out_dir=tmp_path / "ds", nlist=3, overwrite=True, progress=False)
    assert Datastore.load(tmp_path / "ds").manifest.embedder == "y"


def test_default_nlist():
    assert default_nlist(100) == 2  # never fewer than 39 points per list
    assert default_nlist(1_000_000) == 4000


def test_builtin_wikipedia_source():
    articles = list(read_wikipedia())
    assert len(articles) > 5000
    titles = {a.title for a in articles}
    assert "Albert Einstein" in titles
    assert all(a.text.strip() for a in articles[:100])


def _small_passages(tmp_path: Path):
    return list(split_passages(read_jsonl(good_corpus(tmp_path / "c.jsonl"))))


@pytest.mark.parametrize("overwrite", [False, True])
def test_never_builds_over_a_users_files(tmp_path, overwrite):
    """A directory that is not a datastore, or a datastore with a user's file in it, is refused
    before any embedding, and left exactly as it was; so is a file in the way."""
    calls = []

    def encoder(texts):
        calls.append(len(texts))
        return hashing_encoder()(texts)

    passages = _small_passages(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's notes")
    with pytest.raises(DatastoreError, match=f"{mine} exists and is not a datastore.*manifest.json is missing"):
        build_datastore(passages, encoder, embedder="x", out_dir=mine, nlist=2, overwrite=overwrite, progress=False)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "the user's notes"

    ds = tmp_path / "ds"
    build_datastore(passages, hashing_encoder(), embedder="x", out_dir=ds, nlist=2, progress=False)
    (ds / "extra.txt").write_text("keep me")
    with pytest.raises(DatastoreError, match=r"also holds extra\.txt"):
        build_datastore(passages, encoder, embedder="y", out_dir=ds, nlist=2, overwrite=overwrite, progress=False)
    assert (ds / "extra.txt").read_text() == "keep me" and Datastore.load(ds).manifest.embedder == "x"

    a_file = tmp_path / "file"
    a_file.write_text("data")
    with pytest.raises(DatastoreError, match="is a file"):
        build_datastore(passages, encoder, embedder="x", out_dir=a_file, nlist=2, overwrite=overwrite, progress=False)
    assert a_file.read_text() == "data"
    assert calls == []  # refused before the (long) embedding
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "ds", "file", "mine"]  # no temporary left


def test_builds_into_an_empty_directory(tmp_path):
    (tmp_path / "ds").mkdir()
    build_datastore(_small_passages(tmp_path), hashing_encoder(), embedder="x", out_dir=tmp_path / "ds", nlist=2, progress=False)
    assert Datastore.load(tmp_path / "ds").manifest.embedder == "x"


def test_serving_never_builds_over_a_users_directory(tmp_path):
    """`telerag serve --datastore DIR` with DIR holding a user's files (no manifest): refused,
    naming DIR, nothing deleted (it used to build the Wikipedia datastore over them)."""
    from telerag.pipelines.datastores import open_retriever

    class Encoder:
        name, dim = "hash-16", 16

        def encode(self, texts):
            raise AssertionError("nothing may be embedded")

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    with pytest.raises(DatastoreError, match=f"{mine} exists and is not a datastore"):
        open_retriever(mine, Encoder(), build_if_missing=True)
    assert [p.name for p in mine.iterdir()] == ["thesis.tex"] and (mine / "thesis.tex").read_text() == "years of work"


_KILLED_BUILD = """
import sys, time
from pathlib import Path
from telerag.retrieval import datastore_writer
from telerag.retrieval.builder import build_datastore
from telerag.retrieval.corpus import read_jsonl, split_passages
from tests.retrieval_helpers import hashing_encoder

slow_fsync = datastore_writer.fsync_path
def fsync(path):  # slow the write down so the parent can kill it part-way
    time.sleep(0.2)
    slow_fsync(path)
datastore_writer.fsync_path = fsync
out, corpus = Path(sys.argv[1]), Path(sys.argv[2])
build_datastore(list(split_passages(read_jsonl(corpus))), hashing_encoder(), embedder="new", out_dir=out,
                nlist=2, overwrite=True, progress=False)
"""


def test_a_build_killed_midway_leaves_the_old_datastore(tmp_path):
    """SIGKILL while the new datastore is being written: the old one still loads, and the next
    build removes what the killed one left behind."""
    import subprocess
    import sys
    import time

    passages = _small_passages(tmp_path)
    ds = tmp_path / "ds"
    build_datastore(passages, hashing_encoder(), embedder="old", out_dir=ds, nlist=2, progress=False)
    root = Path(__file__).resolve().parents[1]
    process = subprocess.Popen([sys.executable, "-c", _KILLED_BUILD, str(ds), str(tmp_path / "c.jsonl")], cwd=root)
    deadline = time.monotonic() + 60
    while not any(tmp.is_dir() and any(tmp.iterdir()) for tmp in tmp_path.glob(".ds.tmp-*")):
        assert process.poll() is None and time.monotonic() < deadline, "the build ended before it could be killed"
        time.sleep(0.01)
    process.kill()
    process.wait()
    assert Datastore.load(ds).manifest.embedder == "old"
    assert list(tmp_path.glob(".ds.tmp-*"))  # the killed build's leftovers ...
    build_datastore(passages, hashing_encoder(), embedder="next", out_dir=ds, nlist=2, overwrite=True, progress=False)
    assert Datastore.load(ds).manifest.embedder == "next"
    assert not list(tmp_path.glob(".ds.*"))  # ... are gone after the next build


def test_the_build_command_refuses_bad_input_in_one_line(tmp_path: Path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    assert cli.main(["datastore", "build", "--corpus", str(bad), "--out", str(tmp_path / "ds"), "--passage-words", "0"]) == 1
    assert capsys.readouterr().err.strip() == "telerag datastore: passage words must be at least 1, not 0"
    assert not (tmp_path / "ds").exists()


def test_a_datastore_held_in_memory_is_checked_like_a_loaded_one(tmp_path):
    loaded = random_datastore(tmp_path / "ds", n=500, nlist=8)
    arrays = {
        "centroids": np.asarray(loaded.centroids),
        "offsets": np.asarray(loaded.offsets),
        "vectors": np.array(loaded.vectors),
    }
    held = Datastore(loaded.manifest, **arrays, where="in memory")
    assert held.path is None and held.n_vectors == loaded.n_vectors and not held.has_passages
    with pytest.raises(DatastoreError, match="in memory holds vectors only"):
        held.passages([0])
    for name, bad in (
        ("vectors", arrays["vectors"][:-1]),
        ("centroids", arrays["centroids"].astype(np.float64)),
        ("offsets", arrays["offsets"][:-1]),
    ):
        with pytest.raises(DatastoreCorruptError, match=name):
            Datastore(loaded.manifest, **{**arrays, name: bad}, where="in memory")
    shifted = arrays["offsets"].copy()
    shifted[1] = shifted[2] + 1  # lists that overlap
    with pytest.raises(DatastoreCorruptError, match="offsets do not describe"):
        Datastore(loaded.manifest, **{**arrays, "offsets": shifted}, where="in memory")
