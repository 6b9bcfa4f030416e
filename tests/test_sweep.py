"""The load-test sweep without locust's process: locust's CSV stats read into typed rows, answers
counted apart from 429s and failures, the on/off interleaving, the answers' prefetch tally, the
plot, and a failed run recorded instead of aborting the sweep."""

from __future__ import annotations

import json
import subprocess

import pytest

from loadtest import sweep
from loadtest.sweep import ResponseTally, RunSpec, StatsRow, account, outcome_of, parse_stats_csv, plan_runs, request_name

HEADER = (
    "Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,Min Response Time,"
    "Max Response Time,Average Content Size,Requests/s,Failures/s,50%,66%,75%,80%,90%,95%,98%,99%,99.9%,99.99%,100%"
)


def stats_line(name: str, requests: int, failures: int, rps: float, p50: str, p99: str) -> str:
    return f"POST,{name},{requests},{failures},{p50},10,1,99,120,{rps},0.0,{p50},1,1,1,1,1,1,{p99},1,1,1"


@pytest.fixture
def stats_csv(tmp_path):
    path = tmp_path / "run_stats.csv"
    path.write_text(
        "\n".join(
            [
                HEADER,
                stats_line(request_name("hyde"), 40, 1, 4.0, "250", "900"),
                stats_line(request_name("hyde", "429"), 25, 0, 2.5, "3", "9"),
                stats_line(request_name("hyde", "error"), 3, 3, 0.3, "N/A", "N/A"),
                stats_line("Aggregated", 68, 4, 6.8, "200", "900"),
            ]
        )
        + "\n"
    )
    return path


def test_locust_stats_are_read_into_typed_rows(stats_csv):
    rows = parse_stats_csv(stats_csv)
    assert [r.name for r in rows] == [request_name("hyde"), request_name("hyde", "429"), request_name("hyde", "error")]
    assert rows[0] == StatsRow(request_name("hyde"), 40, 1, 4.0, 250.0, 900.0)
    assert rows[2].p50_ms is None and rows[2].p99_ms is None  # N/A: no latency to report


def test_429s_and_failures_are_counted_apart_from_answers(stats_csv):
    tally = ResponseTally()
    tally.add({"prefetch": {"bytes_prefetched": 3 << 20, "overlap_rate": 0.5}})
    tally.add({"prefetch": {"bytes_prefetched": 1 << 20, "overlap_rate": 0.7}})
    result = account(RunSpec("hyde", 8, True), parse_stats_csv(stats_csv), tally, exit_code=1)
    assert (result.answered, result.throttled, result.failed) == (39, 25, 4)
    assert result.rps == 4.0  # answers only: the 429s' 2.5/s do not count as throughput
    assert (result.p50_ms, result.p99_ms) == (250.0, 900.0)  # nor do their 3 ms responses lower the percentiles
    assert result.bytes_prefetched_mean == 2 << 20 and result.overlap_rate_mean == pytest.approx(0.6)
    assert result.locust_exit_code == 1


def test_outcomes_name_requests_apart():
    assert outcome_of(200) is None and outcome_of(429) == "429" and outcome_of(500) == outcome_of(503) == "error"
    assert len({request_name("hyde"), request_name("hyde", "429"), request_name("hyde", "error")}) == 3


def test_prefetch_on_and_off_are_interleaved_and_their_order_alternates():
    plan = plan_runs(["hyde", "naive"], [1, 4], repeats=2)
    assert len(plan) == 2 * 2 * 2 * 2
    for first, second in zip(plan[::2], plan[1::2], strict=True):  # every pair: the same run, on and off
        assert (first.pipeline, first.users, first.repeat) == (second.pipeline, second.users, second.repeat)
        assert first.prefetch != second.prefetch
        assert first.prefetch == (first.repeat % 2 == 0)


def test_the_tally_survives_the_locust_process(tmp_path):
    tally = ResponseTally()
    tally.add({"prefetch": {"bytes_prefetched": 10, "overlap_rate": None}})
    tally.save(tmp_path / "t.json")
    loaded = ResponseTally.load(tmp_path / "t.json")
    assert loaded == tally and loaded.overlap_rate_mean is None and loaded.bytes_prefetched_mean == 10
    assert ResponseTally.load(tmp_path / "missing.json") == ResponseTally()


def test_a_failing_run_is_recorded_and_the_sweep_goes_on(monkeypatch, tmp_path, capsys):
    """Locust exits 1 when any request failed, or writes nothing when it cannot start: every run
    of the plan still gets its row, and the plot and JSON are written."""
    calls = []

    def fake_locust(command, env, capture_output, text, check):
        calls.append(env["TELERAG_PREFETCH"])
        assert command[command.index("-t") + 1] == "1s"  # locust takes whole seconds only
        prefix = command[command.index("--csv") + 1]
        if len(calls) == 2:  # the first measured run: locust could not even start
            return subprocess.CompletedProcess(command, 2, "", "boom")
        with open(f"{prefix}_stats.csv", "w") as handle:
            handle.write(HEADER + "\n" + stats_line(request_name("hyde"), 10, 2, 1.0, "100", "300") + "\n")
        return subprocess.CompletedProcess(command, 1, "", "")

    monkeypatch.setattr(sweep.subprocess, "run", fake_locust)
    code = sweep.main(
        ["--users", "1", "2", "--seconds", "1", "--warmup-seconds", "1", "--plot", str(tmp_path / "s.png"), "--json"]
    )
    assert code == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]
    assert [(r["users"], r["prefetch"]) for r in results] == [(1, True), (1, False), (2, True), (2, False)]
    assert len(calls) == 8  # a warm-up before each measured run
    assert results[0]["answered"] == 0 and results[0]["locust_exit_code"] == 2 and "boom" in results[0]["error"]
    assert all(r["answered"] == 8 and r["failed"] == 2 and r["locust_exit_code"] == 1 for r in results[1:])
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
