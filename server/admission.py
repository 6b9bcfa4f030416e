"""Admission with a deadline: each request's cost is estimated, the server's service rate is
measured, and a request that would not finish within `scheduler.admission_deadline_s` is
refused at once (429) with the time after which it would be admitted as `Retry-After`.

Cost is counted in *work units*: per LLM call the pipeline may make, its output tokens
(`max_tokens`, an upper bound) plus its prompt tokens (the query and `top_k` passages) at
`PREFILL_WEIGHT` each, since a prompt token is processed in parallel and costs a fraction of a
generated one. The service rate is measured in the same units (`ServiceRate`): the work of the
requests that completed, their output counted as generated, over the share of the server's time
each had, averaged over about a minute. So estimates err towards refusing (answers are often
shorter than `max_tokens`), a systematic error of the prompt estimate cancels out of
`wait = work / rate`, and the rate is that of the recent load (a batching engine serves more per
second when more run at once).

The admitted requests share the server (a batching engine decodes them side by side), so the
model is processor sharing among the `max_concurrency` running, the others taking the slots as
they free, first come first served: with the rate split equally among the running, the one with
least work left finishes first and the next waiting one starts, and each admission delays every
request already admitted. A request is admitted only if, with it, every admitted request (itself
included) is expected to finish within the deadline of its own admission: a request that
arrived in a lull is not pushed past its deadline by the ones admitted after it. Each ticket
keeps the finish the model last expected for it, later admissions included, and that is what its
real finish is compared with. Every `Retry-After` comes from the same model: when the request
that blocks this one should be done. Until the rate and the error below are measured (a request
finished, then `ERROR_MIN_SAMPLES` more whose finish was estimated), one request is admitted at a
time, so the first measurements come soon and a cold server never takes on more than it can
finish in time; after that, no more requests are in flight than have finished under an estimate,
so the error is measured at each number of requests at once before admission goes past it (the
first few, measured alone, say little of many sharing the engine).

The model is still a model: a batching engine's throughput moves with its load, a prompt's
prefill holds up the others' decoding, a busy event loop delays what the estimate does not
count, and on a small machine the clients' own work competes with the server. So each completed
request's time from admission to finish is compared with the finish the model last expected for
it (`EstimateError`), and every estimate, from admission to finish, is scaled by the largest
of that ratio over the last 100 requests (never below 1): an estimate that ran 1.6x optimistic
here becomes 1.6x more careful. What that window has not seen yet (a burst of arrivals larger
than the recent ones) `DEADLINE_MARGIN` is for: admission plans to finish within 80% of the
deadline.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NoReturn

from telerag.server.errors import Overloaded, Refusal

TOKENS_PER_WORD = 1.5  # prompt tokens per word of a passage (English BPE; its title and separators included)
DEFAULT_PASSAGE_WORDS = 100  # a datastore's passage length when its manifest does not say (the builder's default)
PREFILL_WEIGHT = 0.1  # cost of a prompt token relative to a generated one
RATE_TIME_CONSTANT_S = 60.0  # how long the measured service rate remembers
DEADLINE_MARGIN = 0.2  # the share of the deadline kept in reserve: admission plans to finish within the rest, for
# what the error's window has not seen yet (the simulated load of tests/test_admission_load.py, 20 runs: 0.5% of the
# accepted past the deadline planning for all of it, 0.1% for 90% of it, none for 80%, at 3% fewer answers)
ERROR_WINDOW = 100  # completed requests whose estimate error is remembered
ERROR_QUANTILE = 1.0  # the quantile of that error that scales every estimate: the largest, so that the next request,
# if its error is like theirs, has odds of 1 in ERROR_WINDOW + 1 to be larger (the deadline is to hold for 99 in 100;
# the 99th percentile of 100, their second largest, would hold for 98)
ERROR_MIN_SAMPLES = 3  # below this many, estimates are not scaled (from 3 on, the quantile of few is near their worst)
ERROR_MIN_ESTIMATE_S = (
    1.0  # an estimate shorter than this counts as this long (a 0.1 s estimate that took 0.5 s says little about 30 s)
)


@dataclass(frozen=True)
class RequestCost:
    """What one request asks of the LLM: `llm_calls` calls (at most), each with about
    `prompt_tokens` of prompt and at most `max_tokens` of output."""

    prompt_tokens: int
    max_tokens: int
    llm_calls: int

    @property
    def work(self) -> float:
        return self.llm_calls * (self.max_tokens + PREFILL_WEIGHT * self.prompt_tokens)

    @property
    def prefill_work(self) -> float:
        """The work of one call's prompt, which the engine prefills before the call shares it."""
        return PREFILL_WEIGHT * self.prompt_tokens

    def served(self, tokens_generated: int) -> float:
        """The work it turned out to be: its prompts as estimated, its output as generated."""
        return self.llm_calls * self.prefill_work + tokens_generated


@dataclass(eq=False)
class Ticket:
    """An admitted request."""

    cost: RequestCost
    client: str | None
    admitted_at: float = 0.0
    estimated_s: float | None = None  # seconds from admission to the finish the model expects, unscaled, as
    # of the latest admission (which may have delayed it); None without a rate
    running: bool = False
    finished: bool = False
    attention_s: float = 0.0  # seconds of the whole server it has had (an equal share of the time it ran)

    @property
    def work(self) -> float:
        return self.cost.work

    def remaining(self, rate: float | None) -> float:
        """Work still to do at `rate` (all of it without a rate)."""
        return max(self.work - (rate or 0.0) * self.attention_s, 0.0)


@dataclass
class ServiceRate:
    """Work units per second of the whole server, measured on the requests that ended: their
    work (`RequestCost.served`; none for one cancelled or failed: its service was lost) over the
    share of the server each had while it ran (`Ticket.attention_s`), both summed with weights
    that decay with time (so the rate is that of about the last `time_constant_s`).

    Each request's work counts with the server time that served it, not with all the time the
    server was busy: the time given to requests still running is not set against work that has
    not been counted yet, so the rate does not jump when several finish together (it did, and
    admission then took on more than it could finish in time). A running request that has had
    more time than its work takes at that rate is counted as it stands (its work, its time so
    far): a request that runs over, or a stalled engine, lowers the rate before it ends."""

    time_constant_s: float = RATE_TIME_CONSTANT_S
    work: float = 0.0
    busy_s: float = 0.0

    def advance(self, dt: float) -> None:
        decay = math.exp(-dt / self.time_constant_s)
        self.work *= decay
        self.busy_s *= decay

    def served(self, work: float, attention_s: float) -> None:
        self.work += work
        self.busy_s += attention_s

    def per_s(self, running: Iterable[tuple[float, float]] = ()) -> float | None:
        """The rate, given the (work, attention_s) of the requests running; None until a request
        has completed."""
        if self.work <= 0 or self.busy_s <= 0:
            return None
        ended = self.work / self.busy_s
        work, busy_s = self.work, self.busy_s
        for their_work, attention_s in running:
            if their_work < ended * attention_s:
                work, busy_s = work + their_work, busy_s + attention_s
        return work / busy_s


@dataclass
class EstimateError:
    """How much later than estimated the recent requests finished: the ratio of each completed
    request's time from admission to finish over its unscaled estimate, for the last `window`."""

    window: int = ERROR_WINDOW
    quantile: float = ERROR_QUANTILE
    min_samples: int = ERROR_MIN_SAMPLES
    ratios: deque[float] = field(default_factory=deque)

    def observe(self, estimated_s: float, took_s: float) -> None:
        self.ratios.append(took_s / max(estimated_s, ERROR_MIN_ESTIMATE_S))
        while len(self.ratios) > self.window:
            self.ratios.popleft()

    @property
    def calibrated(self) -> bool:
        return len(self.ratios) >= self.min_samples

    @property
    def factor(self) -> float:
        """What every estimate is multiplied by: the quantile of the ratios, at least 1 (1 until
        `min_samples` are in)."""
        if not self.calibrated or not self.ratios:
            return 1.0
        ordered = sorted(self.ratios)
        return max(1.0, ordered[min(len(ordered) - 1, math.ceil(self.quantile * len(ordered)) - 1)])


@dataclass
class Admission:
    """At most `max_concurrency` requests run and `max_queue` more wait; a request is refused at
    once when that is full, when its key has `max_in_flight_per_key` admitted, or when it would
    finish later than `deadline_s` from now (None: no deadline), less the `margin` kept in reserve."""

    max_concurrency: int
    max_queue: int
    deadline_s: float | None = None
    max_in_flight_per_key: int | None = None
    margin: float = DEADLINE_MARGIN
    clock: Callable[[], float] = time.monotonic
    on_change: Callable[[int, int], None] = lambda waiting, running: None
    on_refuse: Callable[[Refusal], None] = lambda reason: None
    on_start: Callable[[float], None] = lambda waited_s: None  # a request got its slot after waiting this long
    rate: ServiceRate = field(default_factory=ServiceRate)
    error: EstimateError = field(default_factory=EstimateError)

    def __post_init__(self) -> None:
        self._slots = asyncio.Semaphore(self.max_concurrency)
        self._admitted: list[Ticket] = []  # in admission order
        self._last = self.clock()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def n_running(self) -> int:
        return sum(t.running for t in self._admitted)

    @property
    def n_waiting(self) -> int:
        return len(self._admitted) - self.n_running

    # -- decisions ---------------------------------------------------------------------------

    def admit(self, cost: RequestCost, client: str | None = None) -> Ticket:
        """Admit the request (it then waits for a slot) or raise `Overloaded` with a Retry-After."""
        self._advance()
        rate = self._rate()
        if self.max_in_flight_per_key is not None and client is not None:
            own = [t for t in self._admitted if t.client == client]
            if len(own) >= self.max_in_flight_per_key:
                self._refuse(
                    Refusal.KEY_LIMIT,
                    f"this API key has {len(own)} requests in flight; the limit is {self.max_in_flight_per_key}",
                    self._soonest(rate, own),
                )
        if self.n_running >= self.max_concurrency and self.n_waiting >= self.max_queue:
            self._refuse(
                Refusal.QUEUE_FULL,
                f"server busy: {self.n_running} running and {self.n_waiting} waiting",
                self._soonest(rate, self._admitted),
            )
        ticket = Ticket(cost, client, admitted_at=self._last)
        finishes = self._finishes(rate, [*self._admitted, ticket]) if rate else None
        if self.deadline_s is not None and self._admitted:
            measured = len(self.error.ratios)
            if rate is None or finishes is None or not self.error.calibrated or len(self._admitted) >= measured:
                self._refuse(
                    Refusal.CALIBRATING,
                    "the server is measuring its service rate and the error of its "
                    f"estimates: one request at a time until {self.error.min_samples + 1} have finished, then "
                    f"no more at once than have finished under an estimate ({measured})",
                    self._soonest(rate, self._admitted),
                )
            self._check_deadlines(rate, finishes, ticket, self.deadline_s)
        if finishes is not None:
            for t, in_s in finishes.items():
                t.estimated_s = self._last + in_s - t.admitted_at
        self._admitted.append(ticket)
        self._changed()
        return ticket

    def _finishes(self, rate: float, tickets: list[Ticket]) -> dict[Ticket, float]:
        """Seconds from now until each of `tickets` (in admission order) finishes with nothing
        else admitted: the running ones share `rate` equally, and the waiting ones take the slots
        as they free, in order. One that starts has its first prompt prefilled at the whole rate
        while the others wait (the engine prefills a joining prompt between two decode steps), then
        shares. Each running ticket finishes when the work served to every running one since now
        reaches its mark (what it had left when it joined, plus what had been served by then);
        between finishes and prefills that work grows at rate / (tickets running)."""
        order = itertools.count()
        marks: list[tuple[float, int, Ticket]] = []
        served = now = 0.0

        def join(t: Ticket) -> None:
            nonlocal now
            left = t.remaining(rate)
            if not t.running:
                prefill = min(t.cost.prefill_work, left)
                now += prefill / rate
                left -= prefill
            heapq.heappush(marks, (served + left, next(order), t))

        waiting = deque(t for t in tickets if not t.running)
        for t in tickets:
            if t.running:
                join(t)
        while waiting and len(marks) < self.max_concurrency:
            join(waiting.popleft())
        finishes = {}
        while marks:
            mark, _, t = heapq.heappop(marks)
            now += (mark - served) * (len(marks) + 1) / rate
            served = mark
            finishes[t] = now
            if waiting:
                join(waiting.popleft())
        return finishes

    def _check_deadlines(self, rate: float, finishes: dict[Ticket, float], new: Ticket, deadline_s: float) -> None:
        """Refuse `new` if, with it, it or an admitted request would finish past the deadline of
        its own admission, the estimates scaled by their measured error. `Retry-After`: how much
        later `new` itself would fit, or, when an admitted request would be late, how long until
        that one finishes (admitting more would only make it later)."""
        factor = self.error.factor
        deadline = deadline_s * (1.0 - self.margin)
        late = [(t, (self._last - t.admitted_at + in_s) * factor - deadline) for t, in_s in finishes.items()]
        blockers = [(t, lateness) for t, lateness in late if lateness > 0]
        if not blockers:
            return
        without = self._finishes(rate, self._admitted)
        retry = max(lateness if t is new else without[t] * factor for t, lateness in blockers)
        self._refuse(
            Refusal.DEADLINE,
            f"server busy: this request would finish in about {finishes[new] * factor:.0f} s, "
            f"or make an admitted one finish later than the deadline of {self.deadline_s:g} s",
            retry,
        )

    def service_rate(self) -> float | None:
        """The measured service rate, in work units per second (None until a request completed)."""
        self._advance()
        return self._rate()

    def expected_wait_s(self) -> float:
        """How long the work already admitted takes to finish at the measured rate (0 when unknown)."""
        rate = self.service_rate()
        return sum(t.remaining(rate) for t in self._admitted) / rate * self.error.factor if rate else 0.0

    def _soonest(self, rate: float | None, tickets: list[Ticket]) -> float | None:
        """Expected seconds until the first of `tickets` (admitted ones) finishes, with nothing
        more admitted (None without a rate)."""
        if rate is None or not tickets:
            return None
        finishes = self._finishes(rate, self._admitted)
        return min(finishes[t] for t in tickets) * self.error.factor

    def _refuse(self, reason: Refusal, message: str, retry_after_s: float | None) -> NoReturn:
        """Count the refusal and raise the 429, whose `Retry-After` is `retry_after_s` by the
        server's one policy (`errors.retry_after_s`: the default without an estimate)."""
        self.on_refuse(reason)
        raise Overloaded(reason, message, retry_after_s)

    # -- the life of an admitted request -------------------------------------------------------

    async def start(self, ticket: Ticket) -> None:
        """Wait for a running slot (first come, first served)."""
        try:
            await self._slots.acquire()
        except BaseException:
            self._forget(ticket)
            raise
        self._advance()
        ticket.running = True
        self.on_start(self._last - ticket.admitted_at)
        self._changed()

    def finish(self, ticket: Ticket, *, completed: bool, tokens_generated: int | None = None) -> None:
        """The request ended (idempotent). One that completed counts its work as served, with
        the tokens it generated when they are known (its estimate counted `max_tokens`); the
        service one that failed or was cancelled took is lost (busy time with no work)."""
        if ticket.finished:
            return
        self._advance()
        served = (ticket.work if tokens_generated is None else ticket.cost.served(tokens_generated)) if completed else 0.0
        self.rate.served(served, ticket.attention_s)
        if completed and ticket.estimated_s is not None:
            self.error.observe(ticket.estimated_s, self._last - ticket.admitted_at)
        if ticket.running:
            self._slots.release()
        self._forget(ticket)

    def _forget(self, ticket: Ticket) -> None:
        ticket.finished = True
        self._admitted.remove(ticket)
        self._changed()

    def _advance(self) -> None:
        """Bring the running requests' shares of the server and the rate's average up to now."""
        now = self.clock()
        dt, self._last = max(now - self._last, 0.0), now
        running = [t for t in self._admitted if t.running]
        for t in running:
            t.attention_s += dt / len(running)
        self.rate.advance(dt)

    def _rate(self) -> float | None:
        return self.rate.per_s((t.work, t.attention_s) for t in self._admitted if t.running)

    def _changed(self) -> None:
        if self._admitted:
            self._idle.clear()
        else:
            self._idle.set()
        self.on_change(self.n_waiting, self.n_running)

    async def drain(self) -> None:
        """Wait until every admitted request has finished (graceful shutdown)."""
        await self._idle.wait()
