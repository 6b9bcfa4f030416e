"""`telerag bench ingest` on a small datastore: every write visible to the first search after its
acknowledgment, the final state equal to faiss's after the same writes, the searches timed alone
and under writes, and the user's datastore left as it was (the run writes a copy)."""

from __future__ import annotations

import json

from telerag.benchmarks.ingest import IngestConfig, format_table, run_ingest
from telerag.retrieval.datastore import Datastore
from tests.retrieval_helpers import TOPICS, topic_datastore


def test_ingest_on_a_copy_sees_every_write_at_once_and_equals_faiss(tmp_path):
    embedder, path = topic_datastore(tmp_path, per_topic=20, nlist=4)
    before = sorted((p.name, p.stat().st_size) for p in path.iterdir())
    questions = [f"{words} item{i}" for i, words in enumerate(TOPICS.values())] * 5
    report = run_ingest(path, embedder, questions, IngestConfig(writes=30, clients=2, seed=1))
    rows = {row.row: row for row in report.rows}
    alone, under, writes = rows["searches alone"], rows["searches under writes"], rows["writes"]
    assert alone.count == under.count == len(questions) and alone.p99_ms is not None and under.ratio_p99 is not None
    assert writes.count == 30 and writes.passages > 0 and writes.visible_share == 1.0 and writes.freshness_ms_p99 == 0.0
    assert writes.faiss_equal_share == 1.0
    assert 0 < writes.embedding_share < 1 and writes.overhead_ms_p99 is not None
    assert sorted((p.name, p.stat().st_size) for p in path.iterdir()) == before  # the copy was written, not the datastore
    assert Datastore.load(path).n_vectors == 80
    assert "equal to faiss 100%" in format_table(report)
    assert json.loads(json.dumps(report.to_dict()))["rows"][2]["row"] == "writes"
