"""Locust users for batch-throughput runs against a running server:

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 8 -t 60s

Each request is named by its outcome (see `sweep.request_name`): answers, 429s (counted as
successes, in a row of their own) and errors (failures, in a row of their own). The answers'
prefetch statistics are summed and written, when locust quits, to TELERAG_RESPONSE_STATS if set.

Environment: TELERAG_PIPELINE (default hyde), TELERAG_MAX_TOKENS (default 32), TELERAG_PREFETCH
(1 or 0, default 1), TELERAG_API_KEY, TELERAG_RESPONSE_STATS.
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

from locust import HttpUser, between, events, task
from sweep import ENDPOINT, THROTTLED, ResponseTally, outcome_of, request_name  # locust puts this file's directory on sys.path

QUESTIONS = [
    re.sub(r"\s*(\[[^\]]+\])?\s*(=>.*)?$", "", line).strip()  # drop `[Article] => answer`
    for line in (Path(__file__).resolve().parent.parent / "config" / "questions_wiki_en.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]
_next_question = itertools.cycle(QUESTIONS)
_tally = ResponseTally()


@events.quitting.add_listener
def _save_tally(environment, **kwargs) -> None:
    path = os.environ.get("TELERAG_RESPONSE_STATS")
    if path:
        _tally.save(Path(path))


class RagUser(HttpUser):
    wait_time = between(0, 0.1)

    def on_start(self) -> None:
        key = os.environ.get("TELERAG_API_KEY")
        if key:
            self.client.headers["Authorization"] = f"Bearer {key}"

    @task
    def query(self) -> None:
        pipeline = os.environ.get("TELERAG_PIPELINE", "hyde")
        body = {
            "query": next(_next_question),
            "pipeline": pipeline,
            "max_tokens": int(os.environ.get("TELERAG_MAX_TOKENS", "32")),
            "prefetch": os.environ.get("TELERAG_PREFETCH", "1") == "1",
            "return_documents": False,
        }
        with self.client.post(ENDPOINT, json=body, name=request_name(pipeline), catch_response=True) as response:
            outcome = outcome_of(response.status_code)
            if outcome is None:
                try:
                    _tally.add(response.json())
                except ValueError:
                    response.failure("the answer is not JSON")
                return
            response.request_meta["name"] = request_name(pipeline, outcome)
            if outcome == THROTTLED:
                response.success()  # back-pressure is the server working as designed: counted in its own row
            else:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
