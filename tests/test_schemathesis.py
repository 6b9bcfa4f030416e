"""The published API, fuzzed: schemathesis generates requests from the server's own OpenAPI
schema (valid ones and, per field, invalid ones) and sends them over a real socket to the app
on the tiny random model and a small datastore, with every check on (no 5xx, statuses, content
types, headers and bodies as documented, valid data accepted, invalid data refused, API key
enforced), the stateful phase following the schema's links, every id parameter drawn half the
time from a file, a vector store, a batch and a document made first (`loadtest/fuzz_ids.py`), and
every route that takes an id answering with a 2xx at least once. `TELERAG_FUZZ_EXAMPLES` sets the
examples per operation, mode and phase (default 10: about 3,500 requests in all)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator

import httpx
import pytest

from loadtest import fuzz_ids
from telerag.config.settings import Settings
from telerag.documents.rebuilds import Rebuilds
from telerag.documents.writer import DocumentWriter
from telerag.file_search.vector_store_index import StoreResources
from telerag.pipelines.datastores import open_retriever
from telerag.server.app import create_app, start_serving
from telerag.server.process.runtime import Runtime
from tests.retrieval_helpers import topic_datastore
from tests.serving import serving
from tests.tiny_models import tiny_engine

pytestmark = [pytest.mark.slow, pytest.mark.minutes(3)]  # a few hundred requests, each through the tiny model

KEY = "fuzz-key"
EXAMPLES = int(os.environ.get("TELERAG_FUZZ_EXAMPLES", "10"))
SEED = os.environ.get("TELERAG_FUZZ_SEED", "1")  # fixed, so that CI runs the same requests each time


@pytest.fixture()
def served(tmp_path) -> Iterator[str]:
    """The app over the tiny model and a small datastore (writable: the documents' routes are
    fuzzed too), with an API key and small limits (so that generated requests stay cheap: at most
    4 tokens, 5 documents)."""
    embedder, path = topic_datastore(tmp_path, per_topic=20, nlist=4)
    retriever = open_retriever(path, embedder, device="cpu", cache_bytes=1 << 20, prefetch_budget_bytes=1 << 20, writable=True)
    rebuilds = Rebuilds(retriever.live)
    documents = DocumentWriter(retriever.live, retriever.embed_passages)
    settings = Settings(
        server={"api_key": KEY},
        limits={"max_tokens": 4, "max_top_k": 5, "max_query_chars": 300},
        scheduler={"max_concurrency": 4, "max_queue": 64, "request_timeout_s": 120},
        files={"dir": str(tmp_path / "files")},
        vector_stores={"dir": str(tmp_path / "vector_stores")},
    )
    runtime = Runtime(
        settings=settings,
        engine=tiny_engine(),
        retriever=retriever,
        datastore_info=retriever.datastore_info(),
        cache_stats=retriever.cache_stats,
        closers=[documents.close, rebuilds.join, retriever.close],
        documents=documents,
        rebuilds=rebuilds,
        store_resources=StoreResources.of(retriever),
    )
    app = create_app(settings)
    start_serving(app, runtime)
    with serving(app) as base:
        yield base


def statuses_by_operation(schema: dict, entries: list[dict]) -> dict[tuple[str, str], set[int]]:
    """The statuses each operation of `schema` answered among the HAR's `entries` (a request to an
    id that holds a slash, a document's, is its operation's too)."""
    operations = {}
    for path, item in schema["paths"].items():
        parts = re.split(r"(\{[^/}]+\})", path)  # a document's id may hold slashes; the others may not
        pattern = "".join(("(.+)" if p == "{doc_id}" else "([^/]+)") if p.startswith("{") else re.escape(p) for p in parts)
        for method in item:
            operations[(method.upper(), path)] = re.compile(pattern + "$")
    answered: dict[tuple[str, str], set[int]] = {op: set() for op in operations}
    for entry in entries:
        method, url = entry["request"]["method"], urllib.parse.urlsplit(entry["request"]["url"]).path
        matching = [op for op, pattern in operations.items() if op[0] == method and pattern.match(url)]
        for op in sorted(matching, key=lambda op: "{" in op[1])[:1]:  # a fixed path before a templated one
            answered[op].add(entry["response"]["status"])
    return answered


def test_generated_requests_pass_every_check(served, tmp_path):
    har = tmp_path / "requests.har"
    config = tmp_path / "fuzz.toml"
    config.write_text(fuzz_ids.config(fuzz_ids.made_ids(served, KEY)), encoding="utf-8")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "schemathesis.cli",
            "--config-file",
            str(config),
            "run",
            f"{served}/openapi.json",
            "--max-examples",
            str(EXAMPLES),
            "--seed",
            SEED,
            "--header",
            f"Authorization: Bearer {KEY}",
            "--request-timeout",
            "120",
            "--report",
            "har",
            "--report-har-path",
            str(har),
            "--no-color",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=tmp_path,  # its cache stays out of the repository
        check=False,
    )
    summary = run.stdout[-6000:]
    assert run.returncode == 0, summary
    entries = json.loads(har.read_text())["log"]["entries"]
    print(f"\nschemathesis: {len(entries)} requests, every check passed\n{run.stdout[-1500:]}")
    assert len(entries) >= 2 * EXAMPLES  # the two generating routes were exercised, not just reached
    schema = httpx.get(f"{served}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    answered = statuses_by_operation(schema, entries)
    by_id = [op for op in answered if "{" in op[1]]
    # every route that takes an id was reached with a real one: not left at 404 (nor at the key's 401, or a 422 that
    # may be the path's), the stateful phase following the schema's links, the rest drawing from `fuzz_ids`'s
    unreached = [op for op in by_id if answered[op] <= {401, 404, 422}]
    assert not unreached, {op: answered[op] for op in unreached}
