"""`telerag bench soak` against a real server on loopback (fakes behind it): every request is
counted once, 429s apart from failures, and the server's memory is read."""

from __future__ import annotations

import json
import os

import httpx

from telerag.benchmarks.soak import SoakConfig, server_memory_mb, soak
from telerag.cli.main import main
from tests.fake_app import serving_on_fakes


async def test_soak_counts_answers_429s_and_failures_apart_and_reads_memory_from_metrics():
    # long connection timeouts: a pooled connection closed by the server as a user reuses it
    # would be a client error that says nothing about the soak
    # two slots, nothing queues before the first answer: more users than slots get 429s
    with serving_on_fakes(delay=0.2, max_connections=64, timeout_s=60, scheduler={"max_concurrency": 2, "max_queue": 0}) as (
        host,
        port,
    ):
        report = await soak(SoakConfig(url=f"http://{host}:{port}", users=6, duration_s=2.0, ramp_s=0), ["q one?", "q two?"])
    assert report.answered > 0 and report.refused > 0 and not report.failures
    assert report.requests == report.answered + report.refused
    assert report.p50_s is not None and report.p50_s <= report.p99_s
    assert report.refused_p50_ms is not None
    assert len(report.rss_mb) >= 2 and all(mb > 0 for _, mb in report.rss_mb)  # process_resident_memory_bytes
    assert report.rss_growth is not None
    assert report.prefix_cache_mb == []  # the fakes' engine has no prefix cache: none reported


async def test_the_prefix_caches_bytes_are_read_from_metrics_beside_the_memory():
    metrics = "process_resident_memory_bytes 2.097152e+08\ntelerag_prefix_cache_bytes 3.145728e+06\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=metrics))
    async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
        assert await server_memory_mb(client, None) == (200.0, 3.0)


async def test_soak_counts_other_statuses_as_failures_and_reads_memory_from_proc():
    with serving_on_fakes(max_connections=64, timeout_s=60, server={"api_key": "secret"}) as (host, port):
        # no key: every request is a 401, a failure; the pid is this process, which runs the server
        report = await soak(SoakConfig(url=f"http://{host}:{port}", users=2, duration_s=0.5, pid=os.getpid(), ramp_s=0), ["q?"])
    assert report.answered == 0 and report.refused == 0
    assert report.failures == {"401": report.requests} and report.requests > 0
    assert report.rss_mb and report.rss_mb[0][1] > 0


def test_the_command_prints_a_table_and_one_json_line(capsys):
    with serving_on_fakes(delay=0.05, max_connections=64, timeout_s=60) as (host, port):
        assert (
            main(
                [
                    "bench",
                    "soak",
                    "--url",
                    f"http://{host}:{port}",
                    "--users",
                    "2",
                    "--seconds",
                    "0.5",
                    "--ramp-seconds",
                    "0",
                    "--json",
                ]
            )
            == 0
        )
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("refused (429)") for line in lines)
    result = json.loads(lines[-1])
    assert result["users"] == 2 and result["answered"] > 0 and result["failures"] == {}


def test_users_start_evenly_spread_over_the_ramp():
    config = SoakConfig(url="http://unused", users=4, ramp_s=10.0)
    assert [config.start_s(i) for i in range(4)] == [0.0, 2.5, 5.0, 7.5]
    assert SoakConfig(url="http://unused", users=4, ramp_s=0).start_s(3) == 0.0


async def test_a_user_whose_start_comes_after_the_end_sends_nothing():
    with serving_on_fakes(delay=0.05, max_connections=64, timeout_s=60) as (host, port):
        report = await soak(SoakConfig(url=f"http://{host}:{port}", users=2, duration_s=0.5, ramp_s=2.0), ["q?"])
    assert report.answered > 0 and not report.failures
    assert report.answered == report.requests  # one user, one request at a time: nothing refused


async def test_pipelines_are_taken_in_turn_and_each_answer_keeps_its_pipeline():
    with serving_on_fakes(delay=0.05, max_connections=64, timeout_s=60) as (host, port):
        config = SoakConfig(url=f"http://{host}:{port}", users=1, duration_s=1.0, ramp_s=0, pipelines=("naive", "hyde"))
        report = await soak(config, ["q?"])
    pipelines = [a.pipeline for a in report.answers]
    assert len(pipelines) >= 2 and pipelines[:2] == ["naive", "hyde"] and set(pipelines) == {"naive", "hyde"}
    assert all(a.seconds > 0 for a in report.answers) and len(report.answers) == report.answered


async def test_a_burst_sends_one_request_per_user_at_once_and_counts_what_was_in_flight_at_each_429():
    # two slots, no queue (no deadline): of a burst of five, three are refused, each while the two admitted run
    slots = {"max_concurrency": 2, "max_queue": 0, "admission_deadline_s": None}
    with serving_on_fakes(delay=0.3, max_connections=64, timeout_s=60, scheduler=slots) as (
        host,
        port,
    ):
        config = SoakConfig(url=f"http://{host}:{port}", users=5, duration_s=0.0, ramp_s=0, once=True)
        report = await soak(config, ["q?"])
    assert report.requests == 5 and report.answered == 2 and report.refused == 3
    assert all(r.reason == "queue_full" for r in report.refusals)
    assert all(2 <= r.in_flight <= 4 for r in report.refusals)
    assert "answers" not in report.to_dict() and report.to_dict()["answered"] == 2
