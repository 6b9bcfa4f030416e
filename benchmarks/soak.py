"""A soak run: `users` clients send questions back to back to a running server for a while (the
requests' pipelines taken in turn from `pipelines`); what came back is counted (answers, 429s,
failures apart), each answer kept with its pipeline and latency and each 429 with the requests
this run had in flight when it was sent, and the server's resident memory is sampled from start
to end.

Each user is one keep-alive connection and a well-behaved client: after a 429 it waits the
`Retry-After` it was given (never past the end of the run). Users start evenly spread over the
first `ramp_s` seconds, as a load generator's spawn rate spreads them (with all 64 starting in
the same instant, the server answers their first burst one after another, and the last 429s of
that burst wait behind the others'). At the end no new request is sent
and those in flight are waited for (up to the timeout). The latency of an answer is the
time from sending the request to the end of its body, queueing in the server included.
Memory comes from `/proc/<pid>` when the server's pid is given (same machine), else from the
server's `process_resident_memory_bytes` in `/metrics`; what the engine's prefix cache holds
(`telerag_prefix_cache_bytes`, against its budget) is sampled from `/metrics` beside it.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from telerag.benchmarks.report import key_value_table

MEMORY_SAMPLE_S = 10.0
RSS_METRIC = re.compile(r"^process_resident_memory_bytes\s+(\S+)$", re.MULTILINE)
PREFIX_CACHE_METRIC = re.compile(r"^telerag_prefix_cache_bytes\s+(\S+)$", re.MULTILINE)
KEEPALIVE_EXPIRY_S = 2.0  # below any sane server keep-alive timeout


@dataclass(frozen=True)
class SoakConfig:
    url: str
    users: int = 64
    duration_s: float = 300.0
    pipelines: tuple[str, ...] = ("naive",)  # taken in turn, request by request
    max_tokens: int = 32
    api_key: str | None = None
    pid: int | None = None  # the server's process, to read its memory from /proc
    timeout_s: float = 300.0  # a request not answered in this long is a failure (the server's request_timeout_s)
    ramp_s: float = 10.0  # users start evenly spread over this long (0: all at once)
    once: bool = False  # each user sends one request, whatever comes back (with ramp_s 0: a burst)

    def start_s(self, user: int) -> float:
        """When user number `user` (from 0) sends its first request, in seconds into the run."""
        return user * self.ramp_s / self.users


@dataclass
class SoakReport:
    users: int
    duration_s: float
    requests: int = 0
    answered: int = 0  # 200
    stopped_at_deadline: int = 0  # of them, those the server's deadline stopped
    refused: int = 0  # 429
    failures: dict[str, int] = field(default_factory=dict)  # anything else, by status or error
    answered_per_s: float = 0.0
    p50_s: float | None = None  # of answered requests
    p99_s: float | None = None
    refused_p50_ms: float | None = None  # how fast a 429 comes back
    refused_p99_ms: float | None = None
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (seconds into the run, MB)
    prefix_cache_mb: list[tuple[float, float]] = field(default_factory=list)  # the same, where the server reports one
    answers: list[Answer] = field(default_factory=list, repr=False)  # each answer, in the order they came
    refusals: list[Refused] = field(default_factory=list, repr=False)  # each 429

    @property
    def rss_growth(self) -> float | None:
        """Relative growth of the server's memory from the end of the first minute (or the start
        of a shorter run) to the end: what is left once caches and models have warmed up."""
        if len(self.rss_mb) < 2:
            return None
        base = next((mb for t, mb in self.rss_mb if t >= 60.0), self.rss_mb[0][1]) if self.duration_s > 60 else self.rss_mb[0][1]
        return self.rss_mb[-1][1] / base - 1.0

    def to_dict(self) -> dict:
        summary = {k: v for k, v in asdict(self).items() if k not in ("answers", "refusals")}
        return {**summary, "rss_growth": self.rss_growth}


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


@dataclass(frozen=True)
class Answer:
    pipeline: str
    seconds: float  # from sending to the end of its body
    stopped_at_deadline: bool = False  # the server's deadline stopped its generation (`finish_reason` "deadline")


@dataclass(frozen=True)
class Refused:
    seconds: float  # how fast the 429 came back
    in_flight: int  # this run's other requests outstanding when the 429 came back
    reason: str  # the body's error type (deadline, queue_full, ...)


class _Tally:
    def __init__(self, pipelines: Sequence[str]) -> None:
        self.answered: list[Answer] = []
        self.refused: list[Refused] = []
        self.failures: Counter[str] = Counter()
        self.pipelines = itertools.cycle(pipelines)
        self.in_flight = 0


async def _user(
    client: httpx.AsyncClient, config: SoakConfig, questions: itertools.cycle, start: float, end: float, tally: _Tally
) -> None:
    await asyncio.sleep(max(start - time.monotonic(), 0.0))
    sent = 0
    while (now := time.monotonic()) < end or (config.once and not sent):
        sent += 1
        pipeline = next(tally.pipelines)
        body = {"query": next(questions), "pipeline": pipeline, "max_tokens": config.max_tokens}
        tally.in_flight += 1
        try:
            response = await client.post("/v1/rag/query", json=body, timeout=config.timeout_s)
            # counted as the reply comes, not as the request went: requests sent together reach
            # the server in any order, and one sent first may be the one refused
            others = tally.in_flight - 1
        except httpx.HTTPError as exc:
            tally.failures[type(exc).__name__] += 1
            continue
        finally:
            tally.in_flight -= 1
        elapsed = time.monotonic() - now
        if response.status_code == 200:
            tally.answered.append(Answer(pipeline, elapsed, response.json().get("finish_reason") == "deadline"))
        elif response.status_code == 429:
            tally.refused.append(Refused(elapsed, others, response.json().get("error", {}).get("code", "")))
            retry_after = float(response.headers.get("retry-after", 1))
            await asyncio.sleep(min(retry_after, max(end - time.monotonic(), 0.0)))
        else:
            tally.failures[str(response.status_code)] += 1


def _process_rss_mb(pid: int) -> float | None:
    """A process's resident memory from procfs (a read of kernel memory: it never blocks)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


async def server_memory_mb(client: httpx.AsyncClient, pid: int | None) -> tuple[float | None, float | None]:
    """The server's resident memory and its prefix cache's bytes, in MB (None where unknown)."""
    try:
        metrics = (await client.get("/metrics")).text
    except httpx.HTTPError:
        metrics = ""
    cache = PREFIX_CACHE_METRIC.search(metrics)
    rss = RSS_METRIC.search(metrics)
    rss_mb = _process_rss_mb(pid) if pid is not None else (float(rss.group(1)) / 2**20 if rss else None)
    return rss_mb, float(cache.group(1)) / 2**20 if cache else None


async def soak(config: SoakConfig, questions: Sequence[str]) -> SoakReport:
    """Hold `config.users` users for `config.duration_s` against the server at `config.url`."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    # idle connections are dropped before the server's keep-alive timeout (5 s by default) can close
    # them under a request about to be sent: a client's race, not the server's failure
    limits = httpx.Limits(
        max_connections=config.users + 1, max_keepalive_connections=config.users + 1, keepalive_expiry=KEEPALIVE_EXPIRY_S
    )
    report = SoakReport(users=config.users, duration_s=config.duration_s)
    tally = _Tally(config.pipelines)
    cycle = itertools.cycle(questions)
    async with httpx.AsyncClient(base_url=config.url, headers=headers, limits=limits) as client:
        start = time.monotonic()
        end = start + config.duration_s

        async def sample_memory() -> None:
            t = round(time.monotonic() - start, 1)
            measured = await server_memory_mb(client, config.pid)
            for samples, mb in zip((report.rss_mb, report.prefix_cache_mb), measured, strict=True):
                if mb is not None:
                    samples.append((t, round(mb, 1)))

        async def sample_memory_until_cancelled() -> None:
            while True:
                await sample_memory()
                await asyncio.sleep(MEMORY_SAMPLE_S)

        sampler = asyncio.create_task(sample_memory_until_cancelled())
        await asyncio.gather(*(_user(client, config, cycle, start + config.start_s(i), end, tally) for i in range(config.users)))
        took = time.monotonic() - start
        sampler.cancel()
        await sample_memory()
    report.requests = len(tally.answered) + len(tally.refused) + sum(tally.failures.values())
    report.answered, report.refused, report.failures = len(tally.answered), len(tally.refused), dict(tally.failures)
    report.answers, report.refusals = tally.answered, tally.refused
    report.stopped_at_deadline = sum(a.stopped_at_deadline for a in tally.answered)
    report.answered_per_s = report.answered / took
    latencies = [a.seconds for a in tally.answered]
    report.p50_s, report.p99_s = _percentile(latencies, 50), _percentile(latencies, 99)
    refused_ms = [r.seconds * 1e3 for r in tally.refused]
    report.refused_p50_ms, report.refused_p99_ms = _percentile(refused_ms, 50), _percentile(refused_ms, 99)
    return report


def format_table(report: SoakReport) -> str:
    """The report as aligned `name  value` lines, each kind of failure on a line of its own."""
    rss = report.rss_mb
    rows = {
        "users": report.users,
        "seconds": report.duration_s,
        "requests": report.requests,
        "answered (200)": report.answered,
        "stopped at the deadline": report.stopped_at_deadline,
        "refused (429)": report.refused,
        "failures": sum(report.failures.values()),
        "answered/s": report.answered_per_s,
        "answered p50 s": report.p50_s,
        "answered p99 s": report.p99_s,
        "429 p50 ms": report.refused_p50_ms,
        "429 p99 ms": report.refused_p99_ms,
        "rss start MB": rss[0][1] if rss else None,
        "rss end MB": rss[-1][1] if rss else None,
        "rss growth": report.rss_growth,
        "prefix cache max MB": max((mb for _, mb in report.prefix_cache_mb), default=None),
    }
    table = key_value_table(rows)
    if report.failures:
        failures = {f"  failure {kind}": count for kind, count in report.failures.items()}
        table += "\n" + key_value_table(failures, width=max(map(len, rows)))
    return table
