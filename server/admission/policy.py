"""Admission's interface and its two policies, chosen once in the settings
(`scheduler.admission`): `deadline` (`deadline.DeadlineAdmission`: each request's finish estimated and
refused at once when it would miss `scheduler.admission_deadline_s`; the default) and `fixed`
(`FixedLimit`: at most `max_concurrency` running and `max_queue` waiting, what vLLM, SGLang and
TGI do, with no estimate, no deadline and no warm-up measurement to need).

Both hand out the same `AdmissionTicket`s, and an admitted request's run (`admitted_run.AdmittedRun`)
starts and finishes its ticket through this interface alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, Protocol

from telerag.config.settings import SchedulerSettings
from telerag.server.admission.deadline import AdmissionTicket, AdmittedTickets, DeadlineAdmission
from telerag.server.admission.model import Measured
from telerag.server.admission.workload import RequestCost
from telerag.server.errors import Overloaded, Refusal


class AdmissionPolicy(Protocol):
    """What the service, the runs and the process's drain ask of admission."""

    max_concurrency: int

    @property
    def deadline_s(self) -> float | None:
        """The deadline an admitted request's LLM calls stop at (None: none)."""
        ...

    @property
    def n_running(self) -> int: ...

    @property
    def n_waiting(self) -> int: ...

    def admit(self, cost: RequestCost, client: str | None = None, *, calibrating: bool = False) -> AdmissionTicket:
        """The request's ticket (it then waits for a slot), or `Overloaded` (429) at once."""
        ...

    async def start(self, ticket: AdmissionTicket) -> None:
        """Wait for the ticket's slot."""
        ...

    def finish(self, ticket: AdmissionTicket, *, completed: bool, served_work: float | None = None) -> None:
        """The request ended, however (idempotent)."""
        ...

    async def drain(self) -> None:
        """Wait until every admitted request has finished."""
        ...

    def expected_wait_s(self) -> float:
        """How long the work admitted now takes to finish (0: not known)."""
        ...

    def service_rate(self) -> float | None:
        """Work units a second at the load running now (None: not measured)."""
        ...

    def estimate_factor(self) -> float:
        """What estimates at the load admitted now are scaled by (1: none)."""
        ...

    @property
    def measured(self) -> Measured | None:
        """What it measures of the server (kept across restarts: `calibration`); None: nothing."""
        ...


@dataclass
class FixedLimit(AdmittedTickets):
    """At most `max_concurrency` requests run and `max_queue` more wait, first come first served;
    a request past that, or past its key's `max_in_flight_per_key`, is refused at once (429, the
    server's default `Retry-After`: nothing here estimates when a slot frees). No deadline."""

    max_concurrency: int
    max_queue: int
    max_in_flight_per_key: int | None = None
    clock: Callable[[], float] = time.monotonic
    on_change: Callable[[int, int], None] = lambda waiting, running: None
    on_refuse: Callable[[Refusal], None] = lambda reason: None
    on_start: Callable[[float], None] = lambda waited_s: None  # a request got its slot after waiting this long

    def __post_init__(self) -> None:
        self._track()

    @property
    def deadline_s(self) -> float | None:
        return None

    def admit(self, cost: RequestCost, client: str | None = None, *, calibrating: bool = False) -> AdmissionTicket:
        if self.max_in_flight_per_key is not None and client is not None:
            own = sum(t.client == client for t in self._admitted)
            if own >= self.max_in_flight_per_key:
                self._refuse(
                    Refusal.KEY_LIMIT, f"this API key has {own} requests in flight; the limit is {self.max_in_flight_per_key}"
                )
        if len(self._admitted) >= self.max_concurrency + self.max_queue:
            self._refuse(Refusal.QUEUE_FULL, f"server busy: {self.n_running} running and {self.n_waiting} waiting")
        ticket = AdmissionTicket(cost, client, admitted_at=self.clock(), calibrating=calibrating)
        self._admitted.append(ticket)
        self._changed()
        return ticket

    async def start(self, ticket: AdmissionTicket) -> None:
        try:
            await self._slots.acquire()
        except BaseException:
            self._forget(ticket)
            raise
        ticket.running = True
        self.on_start(self.clock() - ticket.admitted_at)
        self._changed()

    def finish(self, ticket: AdmissionTicket, *, completed: bool, served_work: float | None = None) -> None:
        if ticket.finished:
            return
        if ticket.running:
            self._slots.release()
        self._forget(ticket)

    def expected_wait_s(self) -> float:
        return 0.0

    def service_rate(self) -> float | None:
        return None

    def estimate_factor(self) -> float:
        return 1.0

    @property
    def measured(self) -> None:
        return None

    def _refuse(self, reason: Refusal, message: str) -> NoReturn:
        self.on_refuse(reason)
        raise Overloaded(reason, message)

    def _forget(self, ticket: AdmissionTicket) -> None:
        ticket.finished = True
        ticket.ended.set()
        self._admitted.remove(ticket)
        self._changed()


def admission_policy(
    settings: SchedulerSettings,
    *,
    on_change: Callable[[int, int], None],
    on_refuse: Callable[[Refusal], None],
    on_start: Callable[[float], None],
) -> AdmissionPolicy:
    """The policy the settings choose, with the service's metrics as its callbacks."""
    if settings.admission == "fixed":
        return FixedLimit(
            settings.max_concurrency,
            settings.max_queue,
            max_in_flight_per_key=settings.max_in_flight_per_key,
            on_change=on_change,
            on_refuse=on_refuse,
            on_start=on_start,
        )
    return DeadlineAdmission(
        settings.max_concurrency,
        settings.max_queue,
        deadline_s=settings.admission_deadline_s,
        margin=settings.admission_margin,
        max_in_flight_per_key=settings.max_in_flight_per_key,
        on_change=on_change,
        on_refuse=on_refuse,
        on_start=on_start,
    )
