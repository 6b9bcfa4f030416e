"""`telerag bench tier` on a small random datastore: a local Ray cluster started and stopped by the
command, a row per number of shards and batch, the tier's top-k equal to faiss's in every one."""

from __future__ import annotations

import json

import pytest

from telerag.cli.main import main
from tests.retrieval_helpers import random_datastore

pytest.importorskip("ray", reason="the retrieval tier needs the `ray` extra")


@pytest.mark.slow
def test_the_command_times_the_tier_against_faiss_and_prints_a_table_and_one_json_line(tmp_path, capsys):
    random_datastore(tmp_path / "ds", n=2000, dim=16, nlist=16)
    argv = ["bench", "tier", "--datastore", str(tmp_path / "ds"), "--shards", "1", "2", "--batch", "1", "4"]
    assert main([*argv, "--searches", "4", "--cpus-per-replica", "0.5", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    report = json.loads(lines[-1])
    assert report["nlist"] == 16 and report["n_vectors"] == 2000
    assert [(row["shards"], row["batch"]) for row in report["rows"]] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    for row in report["rows"]:
        assert row["same_documents"] == 1.0 and row["searches"] == 4
        assert row["remote_overhead"] == pytest.approx(row["tier_ms_p50"] / row["local_ms_p50"])
    assert lines[1].split() == [
        "shards",
        "batch",
        "searches",
        "faiss",
        "p50",
        "ms",
        "tier",
        "p50",
        "ms",
        "tier",
        "p99",
        "ms",
        "remote_overhead",
        "same_documents",
    ]
    assert len(lines) == 2 + 4 + 1


def test_a_missing_datastore_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"no datastore at .*build it first"):
        main(["bench", "tier", "--datastore", str(tmp_path / "none")])
