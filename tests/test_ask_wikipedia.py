"""`telerag ask` end to end with the real Gemma 3 270M and the real built-in Wikipedia datastore.
Slow: on a new machine it builds the datastore first (a few minutes on two cores, cached
afterwards under ~/.cache/telerag, where `telerag serve` finds it too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def test_ask_retrieves_the_article_a_question_is_about():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "telerag.cli",
            "ask",
            "Which instrument did Louis Armstrong play?",
            "--pipeline",
            "naive",
            "--max-tokens",
            "16",
            "--json",
        ],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"answer", "pipeline", "documents", "steps", "timings"} <= result.keys()
    assert result["documents"][0]["title"] == "Louis Armstrong"
    assert result["answer"].strip()
    assert [s["stage"] for s in result["steps"]] == ["prefetch", "search", "generate"]
