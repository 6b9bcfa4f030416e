"""`telerag bench keyword`: every engine measured over the same passages and questions, ours
answering as `keyword_search` does (the others' overlap with it reported, not assumed)."""

from __future__ import annotations

import json

from telerag.cli.main import main
from tests.retrieval_helpers import topic_datastore


def test_bench_keyword_measures_each_engine_over_the_datastores_passages(tmp_path, capsys):
    _, path = topic_datastore(tmp_path, per_topic=30, nlist=4)
    questions = tmp_path / "q.txt"
    questions.write_text("river fish boat\nstar planet orbit [space]\npiano concert\nnothing matches this\n")
    assert main(["bench", "keyword", "--datastore", str(path), "--questions", str(questions), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {row["engine"]: row for row in result["rows"]}
    assert result["passages"] == 120 and result["questions"] == 4
    assert {"postings (ours)", "sqlite-fts5"} <= set(rows)
    assert rows["postings (ours)"]["overlap"] == 1.0
    for row in rows.values():
        assert 0.0 <= row["overlap"] <= 1.0 and row["build_s"] >= 0 and row["query_p50_ms"] > 0 and row["write_ms"] > 0
    assert rows["sqlite-fts5"]["overlap"] > 0.5  # the same words found, ranked by the same formula
