"""Locust users for batch-throughput runs against a running server:

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 8 -t 60s

Environment: TELERAG_PIPELINE (default naive), TELERAG_MAX_TOKENS (default 32),
TELERAG_PREFETCH (1 or 0, default 1), TELERAG_API_KEY.
"""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

from locust import HttpUser, between, task

QUESTIONS = [
    re.sub(r"\s*(\[[^\]]+\])?\s*(=>.*)?$", "", line).strip()  # drop `[Article] => answer`
    for line in (Path(__file__).resolve().parent.parent / "config" / "questions_wiki_en.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]
_next_question = itertools.cycle(QUESTIONS)


class RagUser(HttpUser):
    wait_time = between(0, 0.1)

    def on_start(self) -> None:
        key = os.environ.get("TELERAG_API_KEY")
        if key:
            self.client.headers["Authorization"] = f"Bearer {key}"

    @task
    def query(self) -> None:
        pipeline = os.environ.get("TELERAG_PIPELINE", "naive")
        body = {
            "query": next(_next_question),
            "pipeline": pipeline,
            "max_tokens": int(os.environ.get("TELERAG_MAX_TOKENS", "32")),
            "prefetch": os.environ.get("TELERAG_PREFETCH", "1") == "1",
            "return_documents": False,
        }
        with self.client.post("/v1/rag/query", json=body, name=f"/v1/rag/query [{pipeline}]", catch_response=True) as response:
            if response.status_code == 429:
                response.success()  # back-pressure is the server working as designed; locust counts it apart
                response.request_meta["name"] += " 429"
