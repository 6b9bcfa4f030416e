"""Batch-throughput sweep: locust headless for each (pipeline, users, prefetch on/off), each run
after a warm-up run of its own, on and off interleaved at every user count (and their order
swapped on every repeat, so drift in the machine does not favour either); a table of answered
requests/s and latency percentiles, 429s and failures counted apart from answers, the mean
prefetched bytes and overlap from the answers themselves, and a PNG of throughput and p99
against users. A run that fails (locust exits 1 on any failed request) is recorded, never
aborts the sweep. `--json` prints one JSON line last.

    python loadtest/sweep.py --host http://127.0.0.1:8000 --users 1 4 8 --pipelines hyde --seconds 60

The locustfile (`loadtest/locustfile.py`) names each request by outcome (see `request_name`) and
writes a `ResponseTally` of the answers' prefetch statistics to `TELERAG_RESPONSE_STATS`.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENDPOINT = "/v1/rag/query"
THROTTLED = "429"  # the name suffix of refused requests (back-pressure: the server working as designed)
ERROR = "error"  # the name suffix of failed requests (any other status, or no response)


def request_name(pipeline: str, outcome: str | None = None) -> str:
    """Locust's stats name for a request: answers, 429s and errors each get their own row, so
    the answers' latency and rate are never mixed with refusals or errors."""
    return f"{ENDPOINT} [{pipeline}]" + (f" {outcome}" if outcome else "")


def outcome_of(status_code: int) -> str | None:
    """None for an answer (200), else the outcome suffix of `request_name`."""
    if status_code == 200:
        return None
    return THROTTLED if status_code == 429 else ERROR


@dataclass
class ResponseTally:
    """What the answers (200s) said about prefetching, summed in the locust process."""

    answers: int = 0
    bytes_prefetched: int = 0
    overlap_sum: float = 0.0
    overlap_count: int = 0  # answers that reported an overlap (none with prefetch off)

    def add(self, body: dict) -> None:
        prefetch = body.get("prefetch") or {}
        self.answers += 1
        self.bytes_prefetched += int(prefetch.get("bytes_prefetched") or 0)
        if prefetch.get("overlap_rate") is not None:
            self.overlap_sum += float(prefetch["overlap_rate"])
            self.overlap_count += 1

    @property
    def bytes_prefetched_mean(self) -> float | None:
        return self.bytes_prefetched / self.answers if self.answers else None

    @property
    def overlap_rate_mean(self) -> float | None:
        return self.overlap_sum / self.overlap_count if self.overlap_count else None

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self)), encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> ResponseTally:
        path = Path(path)
        return cls(**json.loads(path.read_text(encoding="utf-8"))) if path.is_file() else cls()


@dataclass(frozen=True)
class StatsRow:
    """One row of locust's `<prefix>_stats.csv`."""

    name: str
    requests: int
    failures: int
    rps: float
    p50_ms: float | None  # None where locust wrote N/A (no requests)
    p99_ms: float | None


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:  # "N/A"
        return None
    return None if math.isnan(value) else value


def parse_stats_csv(path: Path) -> list[StatsRow]:
    """Locust's per-name stats (the `Aggregated` row left out: it mixes answers, 429s and errors)."""
    with Path(path).open(newline="", encoding="utf-8") as handle:
        return [
            StatsRow(
                name=row["Name"],
                requests=int(row["Request Count"]),
                failures=int(row["Failure Count"]),
                rps=_number(row["Requests/s"]) or 0.0,
                p50_ms=_number(row["50%"]),
                p99_ms=_number(row["99%"]),
            )
            for row in csv.DictReader(handle)
            if row["Name"] != "Aggregated"
        ]


@dataclass(frozen=True)
class RunSpec:
    pipeline: str
    users: int
    prefetch: bool
    repeat: int = 0


def plan_runs(pipelines: Sequence[str], users: Sequence[int], repeats: int = 1) -> list[RunSpec]:
    """Prefetch on and off back to back at every (pipeline, users), on first on even repeats and
    off first on odd ones."""
    return [
        RunSpec(pipeline, n, prefetch, repeat)
        for repeat in range(repeats)
        for pipeline in pipelines
        for n in users
        for prefetch in ((True, False) if repeat % 2 == 0 else (False, True))
    ]


@dataclass
class RunResult:
    pipeline: str
    users: int
    prefetch: bool
    repeat: int
    answered: int  # 200s
    throttled: int  # 429s
    failed: int  # everything else: errors, timeouts, refused connections
    rps: float  # answered requests per second
    p50_ms: float | None  # of the answered requests
    p99_ms: float | None
    bytes_prefetched_mean: float | None  # per answer
    overlap_rate_mean: float | None
    locust_exit_code: int
    error: str | None = None  # why locust gave no stats, if it did not
    stats: list[StatsRow] = field(default_factory=list, repr=False)


def account(spec: RunSpec, rows: Iterable[StatsRow], tally: ResponseTally, exit_code: int, error: str | None = None) -> RunResult:
    """One run's result from locust's rows: answers, 429s and failures apart."""
    rows = list(rows)
    answers = next((r for r in rows if r.name == request_name(spec.pipeline)), None)
    throttled = sum(r.requests for r in rows if r.name == request_name(spec.pipeline, THROTTLED))
    failed = sum(r.failures for r in rows)
    return RunResult(
        pipeline=spec.pipeline,
        users=spec.users,
        prefetch=spec.prefetch,
        repeat=spec.repeat,
        answered=answers.requests - answers.failures if answers else 0,
        throttled=throttled,
        failed=failed,
        rps=answers.rps if answers else 0.0,
        p50_ms=answers.p50_ms if answers else None,
        p99_ms=answers.p99_ms if answers else None,
        bytes_prefetched_mean=tally.bytes_prefetched_mean,
        overlap_rate_mean=tally.overlap_rate_mean,
        locust_exit_code=exit_code,
        error=error,
        stats=rows,
    )


def run_locust(host: str, spec: RunSpec, seconds: int, max_tokens: int, extra_env: dict[str, str] | None = None) -> RunResult:
    """One headless locust run; its exit code is recorded, not raised (it is 1 whenever any
    request failed, and the other numbers still count)."""
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "run"
        tally_path = Path(tmp) / "responses.json"
        env = {
            **os.environ,
            **(extra_env or {}),
            "TELERAG_PIPELINE": spec.pipeline,
            "TELERAG_PREFETCH": "1" if spec.prefetch else "0",
            "TELERAG_MAX_TOKENS": str(max_tokens),
            "TELERAG_RESPONSE_STATS": str(tally_path),
        }
        process = subprocess.run(
            [
                sys.executable,
                "-m",
                "locust",
                "-f",
                str(HERE / "locustfile.py"),
                "--host",
                host,
                "--headless",
                "-u",
                str(spec.users),
                "-r",
                str(spec.users),
                "-t",
                f"{seconds}s",
                "--stop-timeout",
                "60",
                "--csv",
                str(prefix),
                "--only-summary",
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        stats = Path(f"{prefix}_stats.csv")
        if not stats.is_file():
            tail = (process.stderr or process.stdout)[-2000:]
            return account(spec, [], ResponseTally(), process.returncode, f"locust wrote no stats: {tail}")
        return account(spec, parse_stats_csv(stats), ResponseTally.load(tally_path), process.returncode)


def format_row(r: RunResult) -> str:
    def ms(value: float | None) -> str:
        return f"{value:8.0f}" if value is not None else f"{'-':>8}"

    mb = f"{r.bytes_prefetched_mean / 2**20:7.1f}" if r.bytes_prefetched_mean is not None else f"{'-':>7}"
    overlap = f"{r.overlap_rate_mean:5.2f}" if r.overlap_rate_mean is not None else f"{'-':>5}"
    line = (
        f"{r.pipeline:<12} prefetch={'on ' if r.prefetch else 'off'} users={r.users:<3} {r.rps:8.2f} answers/s"
        f"  p50 {ms(r.p50_ms)} ms  p99 {ms(r.p99_ms)} ms  answered {r.answered:<5} 429 {r.throttled:<5}"
        f" failed {r.failed:<4} prefetched {mb} MB  overlap {overlap}"
    )
    return line + (f"  ({r.error[:120]})" if r.error else "")


def write_plot(results: Sequence[RunResult], path: Path) -> Path:
    """Answered requests/s and p99 against users, one line per (pipeline, prefetch); repeats averaged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate_ax, p99_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    series = sorted({(r.pipeline, r.prefetch) for r in results}, key=lambda s: (s[0], not s[1]))
    for pipeline, prefetch in series:
        users = sorted({r.users for r in results if (r.pipeline, r.prefetch) == (pipeline, prefetch)})
        runs = {u: [r for r in results if (r.pipeline, r.prefetch, r.users) == (pipeline, prefetch, u)] for u in users}
        rates = [sum(r.rps for r in runs[u]) / len(runs[u]) for u in users]
        p99s = [[r.p99_ms for r in runs[u] if r.p99_ms is not None] for u in users]
        label = f"{pipeline}, prefetch {'on' if prefetch else 'off'}"
        rate_ax.plot(users, rates, marker="o", label=label)
        p99_ax.plot(
            [u for u, v in zip(users, p99s, strict=True) if v], [sum(v) / len(v) for v in p99s if v], marker="o", label=label
        )
    rate_ax.set(xlabel="users", ylabel="answered requests/s", title="throughput")
    p99_ax.set(xlabel="users", ylabel="p99 latency (ms)", title="p99 latency of answers")
    rate_ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="http://127.0.0.1:8000")
    parser.add_argument("--users", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--pipelines", nargs="+", default=["hyde"], help="default hyde: a pipeline that prefetches")
    parser.add_argument("--seconds", type=int, default=60, help="measured seconds per run")
    parser.add_argument("--warmup-seconds", type=int, default=10, help="unmeasured run before each measured one (0: none)")
    parser.add_argument("--repeats", type=int, default=1, help="every (pipeline, users, on/off) this many times")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--plot", type=Path, default=Path("sweep.png"), help="PNG of throughput and p99 against users")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = []
    for spec in plan_runs(args.pipelines, args.users, args.repeats):
        if args.warmup_seconds > 0:
            run_locust(args.host, spec, args.warmup_seconds, args.max_tokens)
        result = run_locust(args.host, spec, args.seconds, args.max_tokens)
        results.append(result)
        print(format_row(result), flush=True)
    if args.plot:
        print(f"plot: {write_plot(results, args.plot)}")
    if args.json:
        rows = [{k: v for k, v in asdict(r).items() if k != "stats"} for r in results]
        print(json.dumps({"host": args.host, "seconds": args.seconds, "warmup_seconds": args.warmup_seconds, "results": rows}))
    return 1 if results and all(r.answered == 0 for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
