"""A client writing documents one after another through a server's `/v1/documents` while a test
breaks the server's processes: which writes were acknowledged, and whether they are all still
there and found by a search. Used by the Ray tests (`tests/test_cluster.py`, on a local cluster,
and `tests/test_node_faults.py`, on the multi-node harness)."""

from __future__ import annotations

import threading
import time

import httpx


class DocumentStream:
    """Documents `stream-0`, `stream-1`, ... written one at a time in a thread of its own; a write
    that fails (a server restarting) is tried again after a pause, under the same id."""

    def __init__(self, url: str, *, repeats: int = 8, pause_s: float = 0.0, timeout_s: float = 60.0) -> None:
        self.url, self.repeats, self.pause_s, self.timeout_s = url, repeats, pause_s, timeout_s
        self.acknowledged: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._write)

    def text(self, doc_id: str) -> str:
        """The written document's text, which a question asks to find it."""
        return f"stream note {doc_id.removeprefix('stream-')} " * self.repeats

    def start(self) -> DocumentStream:
        self._thread.start()
        return self

    def stop(self) -> bool:
        """Stop writing; whether the thread ended."""
        self._stop.set()
        self._thread.join(120)
        return not self._thread.is_alive()

    def wait_for(self, count: int, timeout_s: float) -> bool:
        """Whether `count` writes are acknowledged within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while len(self.acknowledged) < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def missing(self) -> list[str]:
        """The acknowledged documents the server does not hold now."""
        return [d for d in self.acknowledged if httpx.get(f"{self.url}/v1/documents/{d}", timeout=30).status_code != 200]

    def last_found(self, keys: list[str]) -> list[bool]:
        """Whether a question for the last acknowledged document, sent with each routing key (keys
        spread questions over the replicas), has it among its documents."""
        last = self.acknowledged[-1]
        found = []
        for key in keys:
            response = httpx.post(
                f"{self.url}/v1/rag/query",
                json={"query": self.text(last), "pipeline": "naive", "max_tokens": 2},
                headers={"X-Routing-Key": key},
                timeout=60,
            )
            found.append(response.status_code == 200 and last in [d["doc_id"] for d in response.json()["documents"]])
        return found

    def _write(self) -> None:
        while not self._stop.is_set():
            doc_id = f"stream-{len(self.acknowledged)}"
            try:
                response = httpx.post(
                    f"{self.url}/v1/documents",
                    json={"id": doc_id, "text": self.text(doc_id), "title": doc_id},
                    timeout=self.timeout_s,
                )
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            if response.status_code in (200, 201):
                self.acknowledged.append(doc_id)
                time.sleep(self.pause_s)
            else:
                time.sleep(0.2)  # the ingress restarting (503) or not yet ready
