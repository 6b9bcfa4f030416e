"""Compactions and retrains of a live datastore (`retrieval.live`), one at a time, each in a thread
of its own while the datastore serves and takes writes: asked for (`start`), or a compaction begun
by itself once the rows added and deleted since the generation was written pass a share of it
(`after_writes`), since every search scans those rows on the CPU or filters them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import StrEnum

from telerag.documents.errors import RebuildRunning
from telerag.retrieval.errors import DatastoreError
from telerag.retrieval.live import LiveDatastore, Rebuilt

log = logging.getLogger(__name__)

MIN_COMPACT_ROWS = 1024  # rows added and deleted below which no compaction begins by itself, whatever the share


class RebuildKind(StrEnum):
    COMPACT = "compact"  # the same centroids: no result changes
    RETRAIN = "retrain"  # new centroids: results change


class RebuildState(StrEnum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Rebuild:
    """A compaction or retrain: asked for or begun by itself, how it went."""

    kind: RebuildKind
    state: RebuildState
    started_at: float
    automatic: bool = False
    finished_at: float | None = None
    result: Rebuilt | None = None
    error: str | None = None


class Rebuilds:
    """The rebuilds of one live datastore: at most one running; the last one's state kept."""

    def __init__(
        self, live: LiveDatastore, *, compact_share: float | None = None, on_done: Callable[[Rebuilt], None] = lambda r: None
    ) -> None:
        """`compact_share`: the share of the generation's rows added and deleted since, past which
        a compaction begins by itself (None: never by itself). `on_done` hears each rebuild that
        switched the datastore to its new generation."""
        self.live = live
        self.compact_share = compact_share
        self.on_done = on_done
        self._lock = threading.Lock()
        self._last: Rebuild | None = None
        self._ended: Counter[tuple[RebuildKind, RebuildState]] = Counter()
        self._thread: threading.Thread | None = None

    @property
    def last(self) -> Rebuild | None:
        """The running rebuild, or the last one (None: none yet)."""
        return self._last

    def start(self, kind: RebuildKind, *, nlist: int | None = None, automatic: bool = False) -> Rebuild:
        """Begin a rebuild in a thread of its own; refused (`RebuildRunning`) while one runs."""
        with self._lock:
            if self._last is not None and self._last.state is RebuildState.RUNNING:
                raise RebuildRunning(f"a {self._last.kind.value} is running (since {time.ctime(self._last.started_at)})")
            self.live.check_writable()
            self._last = Rebuild(kind, RebuildState.RUNNING, time.time(), automatic)
            self._thread = threading.Thread(target=self._run, args=(kind, nlist), name=f"telerag-{kind.value}", daemon=True)
            self._thread.start()
            return self._last

    def run(self, kind: RebuildKind, *, nlist: int | None = None) -> Rebuilt:
        """Begin a rebuild by itself once none runs, and wait for it to end: what it made
        (`DatastoreError`, with its reason, if it failed)."""
        while True:
            self.join()
            try:
                self.start(kind, nlist=nlist, automatic=True)
                break
            except RebuildRunning:  # another began between: wait for that one too
                continue
        self.join()
        last = self._last
        if last is None or last.result is None:
            raise DatastoreError(f"{self.live.where}: the {kind.value} failed: {last.error if last else 'not begun'}")
        return last.result

    def after_writes(self) -> None:
        """Begin a compaction if the rows added and deleted since the generation passed the share."""
        if self.compact_share is None or not self.live.writable:
            return
        snapshot = self.live.snapshot()
        churned = len(snapshot.delta) + len(snapshot.deleted)
        if churned >= max(MIN_COMPACT_ROWS, self.compact_share * max(1, self.live.datastore.n_vectors)):
            with contextlib.suppress(RebuildRunning):  # one runs already: it folds these rows in too, or the next will
                self.start(RebuildKind.COMPACT, automatic=True)

    def _run(self, kind: RebuildKind, nlist: int | None) -> None:
        try:
            result = self.live.retrain(nlist=nlist) if kind is RebuildKind.RETRAIN else self.live.compact()
        except Exception as exc:  # reported in the rebuild's state, and logged
            log.exception("%s: the %s failed; the datastore serves its generation as before", self.live.where, kind.value)
            self._finish(state=RebuildState.FAILED, error=str(exc) or type(exc).__name__)
            return
        self._finish(state=RebuildState.DONE, result=result)
        self.on_done(result)

    def ended(self) -> dict[tuple[RebuildKind, RebuildState], int]:
        """How many rebuilds have ended, by kind and state (done, failed)."""
        with self._lock:
            return dict(self._ended)

    def _finish(self, **outcome: object) -> None:
        with self._lock:
            assert self._last is not None
            self._last = replace(self._last, finished_at=time.time(), **outcome)  # type: ignore[arg-type]
            self._ended[self._last.kind, self._last.state] += 1

    def join(self, timeout: float | None = None) -> None:
        """Wait for the running rebuild, if any (tests, shutdown)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
