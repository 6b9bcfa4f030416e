"""`telerag bench pipelining` on the tiny LLM and a small datastore scaled up: the rows and JSON
it promises, early stop's and speculative prefill's documents and answers equal to the sequential
mode's (greedy), what the budgeted mode chose, how often speculation prefilled again."""

from __future__ import annotations

import json

import pytest

from telerag.benchmarks.pipelining import MODES, Mode, PipeliningBenchConfig
from telerag.cli.bench_pipelining import MODE_NAMES
from telerag.cli.main import main
from tests.tiny_models import tiny_embedder_dir

ROW_KEYS = {
    "pipeline",
    "mode",
    "requests",
    "latency_ms_p50",
    "latency_ms_p99",
    "ttft_ms_p50",
    "retrieval_ms_p50",
    "gain",
    "ttft_gain",
    "bound",
    "same_documents",
    "same_answers",
    "lists_scanned_fraction",
    "recall_at_k",
    "speculated",
    "reprefilled",
}


def test_bench_pipelining_rows_in_every_mode(base_datastore, capsys):
    code = main(
        [
            *("bench", "pipelining", "--tiny", "--embedder", str(tiny_embedder_dir(32, 0)), "--datastore", str(base_datastore)),
            # 8 lists, a topic each: the top-k settles within the lists probed, so speculative prefill has a stable one
            *("--device", "cpu", "--scale-vectors", "2000", "--nlist", "8", "--pipelines", "iter_retgen,flare"),
            *("--requests", "2", "--warmup", "1", "--max-tokens", "6", "--json"),
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = report["rows"]
    assert [(r["pipeline"], r["mode"]) for r in rows] == [(p, m) for p in ("iter_retgen", "flare") for m in MODE_NAMES]
    for row in rows:
        assert row.keys() >= ROW_KEYS and row["requests"] == 2
        assert row["latency_ms_p50"] <= row["latency_ms_p99"] and row["bound"] >= 1.0
        assert 0 < row["ttft_ms_p50"] <= row["latency_ms_p99"] and row["ttft_gain"] > 0
        assert 0.0 <= row["recall_at_k"] <= 1.0 and 0.0 < row["lists_scanned_fraction"] <= 1.0
    by_mode = {(r["pipeline"], r["mode"]): r for r in rows}
    for pipeline in ("iter_retgen", "flare"):
        sequential, early = by_mode[pipeline, "sequential"], by_mode[pipeline, "early_stop"]
        assert sequential["gain"] == 1.0 and sequential["same_documents"] == 1.0 and sequential["pipelined"] == 0.0
        assert sequential["lists_scanned_fraction"] == 1.0
        assert early["same_documents"] == 1.0 and early["same_answers"] == 1.0  # exact: the same documents and answers
        assert early["pipelined"] == 0.0 and sequential["speculated"] == 0.0
        for name in ("speculative", "early_stop_speculative"):
            speculative = by_mode[pipeline, name]
            assert speculative["same_documents"] == 1.0 and speculative["same_answers"] == 1.0  # speed only
            assert speculative["speculated"] > 0 and 0.0 <= speculative["reprefilled"] <= 1.0
    retgen = by_mode["iter_retgen", "pipelined"]
    assert retgen["pipelined"] > 0 and retgen["search_over_generation_p50"] is not None  # rounds 2 and 3 launched early
    budgeted = by_mode["iter_retgen", "budgeted"]
    assert budgeted["pipelined"] > 0 and 1 <= budgeted["nprobe_p50"] <= 8
    assert report["datastore"]["passages"] == 2000 and report["datastore"]["nlist"] == 8


def test_the_sequential_mode_cannot_be_left_out():
    with pytest.raises(ValueError, match="sequential"):
        PipeliningBenchConfig(pipelines=("flare",), questions=("q",), modes=(Mode.PIPELINED,))
    config = PipeliningBenchConfig(pipelines=("flare",), questions=("q",), modes=(Mode.BUDGETED, Mode.SEQUENTIAL))
    assert config.modes == (Mode.SEQUENTIAL, Mode.BUDGETED)
    assert tuple(m.value for m in MODES) == MODE_NAMES  # the flag's choices, spelled without importing torch


def test_bench_pipelining_over_a_datastore_read_from_disk(base_datastore, capsys, monkeypatch):
    """Every mode searches the datastore as the server would serve it from disk (its lists read,
    never scanned through its memory map), early stop and speculative prefill with the same
    documents and answers as the sequential mode."""
    from telerag.retrieval.disk import DiskListSearch

    read, search_lists = [], DiskListSearch.search_lists
    monkeypatch.setattr(DiskListSearch, "search_lists", lambda self, *args: read.append(1) or search_lists(self, *args))
    code = main(
        [
            *("bench", "pipelining", "--tiny", "--embedder", str(tiny_embedder_dir(32, 0)), "--datastore", str(base_datastore)),
            *("--device", "cpu", "--host-cache-mb", "0.05", "--cold", "--pipelines", "iter_retgen"),
            *("--modes", "sequential", "early_stop", "speculative", "--requests", "2", "--warmup", "1", "--max-tokens", "6"),
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["datastore"]["vectors"] == "read from disk" and read and report["cold"]  # the misses read from the file
    for row in report["rows"]:
        assert row["same_documents"] == 1.0 and row["same_answers"] == 1.0
