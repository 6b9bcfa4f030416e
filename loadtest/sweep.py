"""Batch-throughput sweep: run locust headless for each (pipeline, users, prefetch) and print a
table of requests/s and latency percentiles; `--json` prints one JSON line last.

    python loadtest/sweep.py --host http://127.0.0.1:8000 --users 1 4 8 --pipelines naive hyde --seconds 60
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_locust(host: str, users: int, seconds: int, env: dict[str, str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "run"
        subprocess.run(
            [sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--host", host, "--headless",
             "-u", str(users), "-r", str(users), "-t", f"{seconds}s", "--csv", str(prefix), "--only-summary"],
            env={**os.environ, **env}, check=True, capture_output=True,
        )
        rows = list(csv.DictReader((prefix.parent / "run_stats.csv").open()))
    total = next(r for r in rows if r["Name"] == "Aggregated")
    return {
        "requests": float(total["Request Count"]),
        "failures": float(total["Failure Count"]),
        "rps": float(total["Requests/s"]),
        "p50_ms": float(total["50%"]),
        "p99_ms": float(total["99%"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="http://127.0.0.1:8000")
    parser.add_argument("--users", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--pipelines", nargs="+", default=["naive"])
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    for pipeline in args.pipelines:
        for prefetch in ("1", "0"):
            for users in args.users:
                env = {"TELERAG_PIPELINE": pipeline, "TELERAG_PREFETCH": prefetch, "TELERAG_MAX_TOKENS": str(args.max_tokens)}
                row = {"pipeline": pipeline, "prefetch": prefetch == "1", "users": users, **run_locust(args.host, users, args.seconds, env)}
                results.append(row)
                print(f"{pipeline:<12} prefetch={row['prefetch']!s:<5} users={users:<3} {row['rps']:8.2f} req/s"
                      f"  p50 {row['p50_ms']:8.0f} ms  p99 {row['p99_ms']:8.0f} ms  failures {row['failures']:.0f}", flush=True)
    if args.json:
        print(json.dumps({"host": args.host, "seconds": args.seconds, "results": results}))


if __name__ == "__main__":
    main()
