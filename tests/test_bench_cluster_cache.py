"""`telerag bench cluster-cache`: a cache kept full by searches, its table and one JSON line."""

from __future__ import annotations

import json

import pytest

from telerag.cli.main import main


def test_a_full_cache_benchmarked_places_whole_clusters_and_reports_every_field(capsys):
    flags = ["--nlist", "256", "--mean-rows", "60", "--prefetch", "40", "--demand", "8", "--searches", "40", "--json"]
    code = main(["bench", "cluster-cache", *flags])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and out[1].split() == ["acquisition", "p50", "ms", "p99", "ms"]
    report = json.loads(out[-1])
    assert report["config"]["nlist"] == 256 and report["config"]["searches"] == 40
    assert report["prefetch_ms_p50"] > 0 and report["demand_ms_p99"] >= report["demand_ms_p50"] > 0
    assert report["evictions_per_search"] > 0  # a fifth of the lists cached: kept full
    assert 0 < report["hit_rate"] < 1
    assert 0 < report["copies_per_cluster"] < 1.3  # whole clusters, not pieces over the holes


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nlist", "16", "--prefetch", "12", "--demand", "8"], "--prefetch \\+ --demand must be at most --nlist"),
        (["--searches", "0"], "--searches must be at least 1"),
        (["--device", "tpu"], "--device tpu: cpu, or cuda"),
    ],
)
def test_what_cannot_be_run_is_refused_in_one_line_before_anything_runs(flags, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", "cluster-cache", *flags])
