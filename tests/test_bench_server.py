"""`telerag bench server` on a few Wikipedia articles: every question answered in-process and over
HTTP, the paired overhead reported as a table and one JSON line. Slow: the embedded embedder."""

from __future__ import annotations

import json

import pytest

from telerag.cli.main import main

pytestmark = pytest.mark.slow


def test_the_command_reports_the_paired_overhead(capsys):
    assert main(["bench", "server", "--articles", "10", "--requests", "6", "--max-tokens", "4", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["pipeline"] == "naive" and result["requests"] == 3  # the first three warm up
    for key in ("in_process_ms_p50", "http_ms_p50", "overhead_ms_p50", "overhead_ms_p99", "overhead_ms_mean"):
        assert key in result and any(line.split()[0] == key for line in lines[:-1])
    assert result["http_ms_p50"] > 0 and result["in_process_ms_p50"] > 0
