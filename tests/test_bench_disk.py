"""`telerag bench disk` on a small synthetic datastore: every way of searching it times answers as
faiss in memory, early stop and the top-k so far read no more than a scan of every list, the lookahead reads part of
what a search needs before it begins, and `--json` ends with one JSON object."""

from __future__ import annotations

import json

import pytest

from telerag.benchmarks.disk import DiskBenchConfig, run
from telerag.cli.main import main
from tests.retrieval_helpers import DEVICES

WAYS = [
    "faiss on disk, cold",
    "faiss on disk, warm",
    "ours, cold, reads on demand",
    "ours, cold, lookahead",
    "ours, warm, lookahead",
    "ours, cold, top-k so far",
    "ours, cold, early stop",
    "ours, cold, early stop, top-k so far",
    "ours, every list in memory",
]


def test_every_way_of_searching_is_exact_and_the_lookahead_reads_ahead(tmp_path):
    config = DiskBenchConfig(
        vectors=4000, dim=16, nlist=32, nprobe=8, queries=8, host_cache_mb=0.1, llm_ms=5, datastore_dir=tmp_path
    )
    result = run(config, progress=False)
    rows = result["rows"]
    assert [(row["name"], row["batch"]) for row in rows] == [(name, batch) for batch in (1, 8) for name in WAYS]
    assert all(row["identical"] == 1.0 for row in rows)
    lookahead = [row for row in rows if "lookahead" in row["name"]]
    assert all(0.0 < row["masked"] <= 1.0 for row in lookahead)
    assert all(row["mb_read_per_search"] == 0.0 for row in rows if row["name"] == "ours, every list in memory")
    on_demand = [row for row in rows if row["name"] == "ours, cold, reads on demand"]
    for name in ("ours, cold, early stop", "ours, cold, early stop, top-k so far", "ours, cold, top-k so far"):
        rows_of = [row for row in rows if row["name"] == name]
        assert all(r["mb_read_per_search"] <= d["mb_read_per_search"] for r, d in zip(rows_of, on_demand, strict=True))
    assert result["nprobe"] == 8 and result["host_cache_bytes"] == int(0.1 * 2**20)


@pytest.mark.parametrize("device", DEVICES)
def test_through_a_host_tier_every_way_is_exact_and_reports_what_the_lookahead_masked(tmp_path, device):
    """`--cache-mb` (on CUDA, `--device cuda`): a device cache over a host tier; the CPU stands for the device here."""
    config = DiskBenchConfig(
        vectors=4000, dim=16, nlist=32, nprobe=8, queries=8, batches=(1, 8), host_cache_mb=0.05, cache_mb=0.1,
        device=device, llm_ms=5, datastore_dir=tmp_path,
    )  # fmt: skip
    result = run(config, progress=False)
    assert [(row["name"], row["batch"]) for row in result["rows"]] == [(name, batch) for batch in (1, 8) for name in WAYS]
    assert all(row["identical"] == 1.0 for row in result["rows"])
    # a share (how much of it lands within a 5 ms call is the machine's timing, not asserted)
    assert all(0.0 <= row["masked"] <= 1.0 for row in result["rows"] if "lookahead" in row["name"])
    assert result["device"] == device


def test_cli_json_is_the_last_line(tmp_path, capsys):
    args = ["bench", "disk", "--vectors", "3000", "--dim", "8", "--nlist", "16", "--nprobe", "4", "--queries", "4",
            "--batches", "2", "--host-cache-mb", "0.05", "--llm-ms", "1", "--datastore-dir", str(tmp_path), "--json"]  # fmt: skip
    assert main(args) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["config"]["batches"] == [2] and len(last["rows"]) == len(WAYS)
