"""Queries before writes on the one embedder: a write's embedding yields to the queries being
embedded and searched (`EmbeddingPriority`), so a stream of writes never holds up a search."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

WRITE_MAX_WAIT_S = 0.5  # how long a write's embedding waits for the queries to pause, at most, each time


class EmbeddingPriority:
    """Queries before writes' embeddings: a write's embedding goes on, before each layer of the
    model, only once no query is embedded or searched (or after `WRITE_MAX_WAIT_S`, so that a
    stream of queries slows writes, never stops them). The embedder runs one call at a time and
    lets go of itself while a write waits, so a query waits for at most one layer of a write's chunk."""

    def __init__(self) -> None:
        self._idle = threading.Condition()
        self._queries = 0

    @contextlib.contextmanager
    def query(self) -> Iterator[None]:
        with self._idle:
            self._queries += 1
        try:
            yield
        finally:
            with self._idle:
                self._queries -= 1
                self._idle.notify_all()

    def write_turn(self) -> None:
        """Wait until no query is embedded or searched (at most `WRITE_MAX_WAIT_S`)."""
        with self._idle:
            self._idle.wait_for(lambda: self._queries == 0, timeout=WRITE_MAX_WAIT_S)
