"""Ids a fuzzer cannot make up, for schemathesis: files, vector stores that hold them, file batches and
documents, made through a running server's own API, and a config (`loadtest/schemathesis.toml` plus
these) that draws every id parameter from them half the time, so that each route that takes an id is
reached with a real one, and with a made-up one (a 404) the other half. The schema's OpenAPI links
let the stateful phase carry ids from answer to route too; these reach every route in every phase.
Several of each are made, since the routes that delete draw from them too (an operation's own value
would override the stateful phase's linked ids, and schemathesis draws from the project's dictionaries
only), and every store holds every file, so that a route reached before a deletion answers 2xx.

    python loadtest/fuzz_ids.py http://127.0.0.1:8000 [--api-key KEY] > /tmp/fuzz.toml
    schemathesis --config-file /tmp/fuzz.toml run http://127.0.0.1:8000/openapi.json ...   # every check: the file names them
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

CONFIG = Path(__file__).with_name("schemathesis.toml")
SHARE = 0.5  # of generated ids, those drawn from the real ones
COPIES = 4  # of each resource, but stores
STORES = 12  # the routes that delete a store, or a file of one, draw from them too: more of them outlast their draws
TEXT = "Leave policy\n\nStaff get thirty days of leave a year, taken in blocks of at least a week.\n"
DRAWN = {  # an id parameter, and the resources it is drawn from
    "path.file_id": "files",
    "path.vector_store_id": "stores",
    "path.batch_id": "batches",
    "path.doc_id": "documents",
    "body.file_id": "files",
    "body.file_ids[*]": "files",
}


def made_ids(base: str, api_key: str | None = None, copies: int = COPIES, stores: int = STORES) -> dict[str, list[str]]:
    """`copies` files and documents and `stores` stores, each holding every file, with a batch of
    them, through the API at `base`; by the dictionary each is drawn from."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    ids: dict[str, list[str]] = {"files": [], "stores": [], "batches": [], "documents": []}
    with httpx.Client(base_url=base, headers=headers, timeout=120) as client:

        def made(method: str, path: str, **request: Any) -> dict:
            response = client.request(method, path, **request)
            response.raise_for_status()
            return response.json()

        for i in range(copies):
            upload = {"file": (f"policy-{i}.txt", TEXT.encode())}
            ids["files"].append(made("POST", "/v1/files", files=upload, data={"purpose": "assistants"})["id"])
            ids["documents"].append(made("PUT", f"/v1/documents/fuzz-{i}", json={"text": TEXT})["id"])
        for i in range(stores):  # every store holds every file, so that any two drawn name a file of a store
            store_id = made("POST", "/v1/vector_stores", json={"name": f"fuzz-{i}", "file_ids": ids["files"]})["id"]
            ids["stores"].append(store_id)
            batch = made("POST", f"/v1/vector_stores/{store_id}/file_batches", json={"file_ids": ids["files"]})
            ids["batches"].append(batch["id"])
        for store_id in ids["stores"]:  # processed, so that each answers as it will
            while made("GET", f"/v1/vector_stores/{store_id}")["status"] == "in_progress":
                time.sleep(0.1)
    return ids


def config(ids: dict[str, list[str]], base_config: Path = CONFIG) -> str:
    """`base_config` with dictionaries of `ids` and the id parameters drawn from them (`SHARE`)."""
    lines = [base_config.read_text(encoding="utf-8"), "", "# the ids `loadtest/fuzz_ids.py` made on the server"]
    for name, values in ids.items():
        lines += [f"[dictionaries.{name}]", f"values = {json.dumps(values)}"]
    lines.append("[parameters]")
    lines += [f'"{key}" = {{ dictionary = "{name}", probability = {SHARE} }}' for key, name in DRAWN.items()]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("base", help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--api-key", help="its API key, where it has one")
    args = parser.parse_args()
    sys.stdout.write(config(made_ids(args.base.rstrip("/"), args.api_key)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
