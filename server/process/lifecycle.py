"""Where the server is in its life: loading (what, and how far), ready, or draining before it
stops. `/ready` reports it and `/v1/*` answers 503 unless it is ready; `telerag serve` moves it
along (`server/process/serve.py`)."""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
import time

from telerag.utils.progress import StepProgress

log = logging.getLogger(__name__)


class Phase(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


class Lifecycle:
    """The server's phase, the load step under way and its progress, and the stop signals.

    `loading` and `report` may be called from the loading thread; the rest on the event loop.
    """

    def __init__(self) -> None:
        self.phase = Phase.LOADING
        self.step = "starting"
        self.progress: StepProgress | None = None
        self.started = self.step_started = time.monotonic()
        self.stop = asyncio.Event()  # the first SIGTERM / SIGINT: drain, then exit
        self.force = asyncio.Event()  # the second: stop at once

    def loading(self, step: str) -> None:
        """A new load step begins ("checking datastore", "loading model", ...)."""
        log.info("start-up: %s", step)
        self.step, self.progress, self.step_started = step, None, time.monotonic()

    def report(self, progress: StepProgress) -> None:
        """The progress of the current step's bar (a `retrieval.progress` observer)."""
        self.progress = progress

    def ready(self) -> None:
        self.phase, self.step, self.progress = Phase.READY, "", None

    def drain(self) -> None:
        self.phase = Phase.DRAINING

    def on_signal(self, signum: int) -> None:
        """SIGTERM / SIGINT, delivered on the event loop: the first asks for a graceful stop,
        the second for an immediate one."""
        name = signal.Signals(signum).name
        if self.stop.is_set():
            log.warning("%s again: stopping now", name)
            self.force.set()
        else:
            log.info("%s: %s", name, "draining accepted requests" if self.phase == Phase.READY else "stopping")
            self.stop.set()

    @property
    def unavailable_reason(self) -> str:
        """Why `/v1/*` answers 503 now (phase not READY)."""
        if self.phase == Phase.DRAINING:
            return "the server is shutting down"
        return f"the server is still loading ({self.step})"
