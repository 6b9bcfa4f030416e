"""`telerag datastore scale`: a datastore scaled up and written to disk a window of rows at a time
is the datastore `bench e2e` scales in memory, row for row and passage for passage, loads with its
checksums, and is searched from disk exactly as faiss searches it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np

from telerag.benchmarks.scaled import DatastoreScale, scaled_datastore, write_scaled_datastore
from telerag.cli.main import main
from telerag.retrieval.codecs import Codec
from telerag.retrieval.datastore import DOCUMENTS, Datastore
from telerag.retrieval.documents import DocumentEntry
from telerag.retrieval.engine import RetrievalEngine
from tests.retrieval_helpers import assert_same_as_faiss


def test_written_a_window_at_a_time_it_is_the_one_made_in_memory(base_datastore, tmp_path):
    base = Datastore.load(base_datastore)
    scale = DatastoreScale(vectors=3 * base.n_vectors + 5, nlist=16, noise=0.5)
    window_rows = base.n_vectors // 2  # several windows, one ending inside a block write_datastore reads
    path = write_scaled_datastore(base, scale, tmp_path / "scaled", window_bytes=window_rows * base.dim * 4, progress=False)
    on_disk = Datastore.load(path)  # its checksums verified
    in_memory = scaled_datastore(base, scale, progress=False)
    try:
        assert (on_disk.n_vectors, on_disk.nlist, on_disk.manifest.embedder) == (scale.vectors, 16, base.manifest.embedder)
        assert np.array_equal(np.asarray(on_disk.vectors), np.asarray(in_memory.vectors))
        assert np.array_equal(on_disk.offsets, in_memory.offsets) and np.array_equal(on_disk.centroids, in_memory.centroids)
        np.testing.assert_array_equal(on_disk.list_stats, in_memory.list_stats)
        rows = list(range(0, scale.vectors, 7))
        assert on_disk.passages(rows) == in_memory.passages(rows)  # each replica's passage its source's
        # its documents written beside it (a live datastore need not read every passage to list them)
        documents = [DocumentEntry.from_json(json.loads(line)) for line in (path / DOCUMENTS).open()]
        held = np.concatenate([entry.passage_ids for entry in documents])
        assert np.array_equal(np.sort(held), np.arange(scale.vectors))  # every row in one document
        for entry in documents[:: max(1, len(documents) // 20)]:
            assert {p.doc_id for p in on_disk.passages(list(entry.passage_ids))} == {entry.doc_id}
        assert len(documents) == len({p.doc_id for p in base.passages(range(base.n_vectors))})
    finally:
        on_disk.close()
        in_memory.close()


def test_the_cli_writes_a_datastore_searched_from_disk_as_faiss(base_datastore, tmp_path, capsys):
    out = tmp_path / "scaled"
    base = Datastore.load(base_datastore)
    n = 4 * base.n_vectors
    base.close()
    args = ["datastore", "scale", str(base_datastore), "--out", str(out), "--vectors", str(n), "--nlist", "24",
            "--codec", "fp16", "--window-mb", "1"]  # fmt: skip
    assert main(args) == 0
    assert f"datastore written to {out}" in capsys.readouterr().out
    scaled = Datastore.load(out)
    engine = RetrievalEngine(scaled, cache_bytes=scaled.n_vectors * scaled.dim // 2, on_disk=True)
    try:
        assert scaled.codec is Codec.FP16 and scaled.n_vectors == n
        queries = np.asarray(scaled.vectors[:: n // 6], dtype=np.float32) + 0.01
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        assert_same_as_faiss(engine, queries, 5, 6)
    finally:
        engine.close()
        scaled.close()
    assert main(args) == 1  # refused before any work: the datastore written stays
    assert "already holds a datastore" in capsys.readouterr().err and Datastore.load(out).n_vectors == n


def test_a_read_crossing_into_the_next_window_holds_only_that_one():
    """While the next window is made, nothing is left of the last one (at fp32 the window is the
    codes themselves), even when a read spans both: memory holds one window, not two."""
    import weakref

    import torch

    from telerag.benchmarks.scaled import Replicas, ScaledRows

    replicas = Replicas(np.eye(4, dtype=np.float32), 40, 0.1, 0, torch.device("cpu"))
    rows = ScaledRows(replicas, torch.arange(40), Codec.FP32, None, window_rows=16)
    last: list[weakref.ref] = []
    alive: list[bool] = []
    make_blocks = replicas.in_turn

    def in_turn() -> Iterator[tuple[slice, torch.Tensor]]:  # passed over while a window is made
        for made in make_blocks():
            alive.extend(ref() is not None for ref in last)
            yield made

    replicas.in_turn = in_turn  # type: ignore[method-assign]
    for start, stop in ((0, 10), (10, 30), (30, 40)):  # the second read crosses from the first window into the next
        assert rows[start:stop].shape == (stop - start, 4)
        last[:] = [weakref.ref(rows._codes)]
    assert rows.windows_made == 3 and alive and not any(alive)
