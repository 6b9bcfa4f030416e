"""Admission with a deadline: each request's cost is estimated (`workload`), the server's
service rate is measured at each number of requests running (`admission_model.ServiceRate`), and
a request that would not finish within `scheduler.admission_deadline_s` is refused at once (429)
with the time after which it would be admitted as `Retry-After`. The promise is that an accepted
request finishes within the deadline (its p99); the score is goodput, answers within the deadline
per second.

The admitted requests share the server (a batching engine decodes them side by side), so the
model is processor sharing among the `max_concurrency` running, the others taking the slots as
they free, first come first served: the n running share R(n) equally, the one with least work
left finishes first and the next waiting one starts, and each admission delays every request
already admitted. A request is admitted only if, with it, every admitted request (itself
included) is expected to finish within the deadline of its own admission: a request that
arrived in a lull is not pushed past its deadline by the ones admitted after it; where the only
ones it would push are running and late already (most often near the end of their deadline), it is
admitted held, starting once they have ended (`DeadlineAdmission._held`). Each ticket
keeps the finish the model last expected for it, later admissions included, and that is what its
real finish is compared with. Every `Retry-After` comes from the same model: when the request
that blocks this one should be done. A burst that the model expects to finish in time is
admitted whole; only before any request has finished (no rate measured: the server's warm-up
measures it before it is ready, unless `server.warm_up` is off) is one admitted at a time. One
expected past the deadline even alone is admitted on an idle server and cut at the deadline.

The model is still a model: a request may generate more than its estimate, a prompt's prefill
holds up the others' decoding, a busy event loop delays what the estimate does not count, and on
a small machine the clients' own work competes with the server. So each completed request's
time from admission to finish is compared with the finish the model last expected for it, made
again with the work it and the requests that ended beside it really had (`_replanned_s`;
`EstimateError`, at each number admitted), and every estimate, from admission to finish, is
scaled by that error; estimates too short to threaten the deadline are not compared
(`ERROR_COMPARED_SHARE`). A cost that was short is its pipeline's error, which the pipeline's
next costs count (`workload`), not the model's: compared as it was, one Iter-RetGen request that
ran 2-4x the work of the one request its cost came from set the error of every load to 1.4-2.7
in a mix of all seven pipelines, and each refused what fitted. Each request's own finish is
judged with its own work at its cost's quantile, the others' at their share of their sum's
(`_own_tails`); but an admitted request whose cost is tentative (`RequestCost.tentative`, a
guess from its pipeline's first requests) only at its share: guarded at the guess's tail, one
such request held every other out (a traced HyDE: 19 s at its tail, 10 s taken, alone). The
margin (`scheduler.admission_margin`) is for what the error's window has not seen yet.

It is long because every decision here (admit, hold, refuse, and the error's comparison when a
request ends) plans the same admitted requests with the same model: split, each part would pass
the plan and the tickets back and forth.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NoReturn

from telerag.config.settings import DEADLINE_MARGIN
from telerag.server.admission.model import EstimateError, Job, Measured, Rates, ServiceRate, plan_finishes
from telerag.server.admission.workload import RequestCost
from telerag.server.errors import Overloaded, Refusal

logger = logging.getLogger(__name__)

ERROR_COMPARED_SHARE = 0.5  # an estimate under this share of the planned deadline is not compared with its finish:
# it could not break the deadline unless 2x off, and short estimates err most in ratio (in a real soak a request
# estimated at 4.7 s among 8 took 11.6 s, and that one ratio, 2.45, became the factor of every load not measured
# enough, refusing a second request with one running). On the drifting simulated load: +10% goodput at 64 clients
MAX_HELD = 4  # at most this many admitted held (`DeadlineAdmission._held`) at once: those held for the same requests
# start together when they end, and their prompts' prefill stalls every running row at once, which the model counts
# short. On the simulated load (tests/test_admission_load.py, 12 seeds each): naive at 64 clients, 11 of 2,301 answers
# late with no bound, 4 of 2,284 with 4 (2 of 2,292 never held); the mix at 16 clients, 15 of 1,194 and 8 of 1,182
# (8 of 1,177); goodput the same within 2%


@dataclass(eq=False)
class AdmissionTicket:
    """An admitted request."""

    cost: RequestCost
    client: str | None
    admitted_at: float = 0.0
    estimated_s: float | None = None  # seconds from admission to the finish the model expects, unscaled, as
    # of the latest admission (which may have delayed it); None without a rate
    estimated_in_flight: int = 1  # the requests admitted (itself included) when it was last estimated
    plan: Plan | None = None  # what that estimate was made from (`DeadlineAdmission._replanned_s`)
    served: float | None = None  # the work it was served, once it completed
    calibrating: bool = False  # a request of the warm-up, estimated before the rates it ran at were measured
    running: bool = False
    finished: bool = False
    held_by: tuple[AdmissionTicket, ...] = ()  # admitted requests it starts after (`DeadlineAdmission._held`), until it starts
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set when it finished, however
    attention: dict[int, float] = field(default_factory=dict)  # seconds of the whole server it has had (an equal
    # share of the time it ran), by the number of requests running then

    def job(self, rates: Rates, work: float, after: frozenset[int] = frozenset()) -> Job:
        """What the model plans for it at `rates` if its whole work is `work` (held `after` those
        jobs): a running one's prompt counts as prefilled once it has been served as much, not as
        soon as it runs."""
        had = rates.served(self.attention) if rates else 0.0
        left = max(work - had, 0.0)
        return Job(left, min(max(self.cost.prefill_work - had, 0.0), left), self.running, after)


@dataclass(frozen=True)
class Plan:
    """An estimate's inputs: at `at`, with `rates`, the admitted `tickets` and their `jobs` (in
    admission order), the estimated one the `index`th; so that when it ends its estimate can be
    made again with the work it and the others really had."""

    at: float
    rates: Rates
    tickets: tuple[AdmissionTicket, ...]
    jobs: tuple[Job, ...]
    index: int


class AdmittedTickets:
    """What both policies keep of the requests they admitted: the tickets in admission order, the
    running slots, and whether any is left (for the drain); `on_change` hears the counts."""

    max_concurrency: int
    on_change: Callable[[int, int], None]

    def _track(self) -> None:
        self._slots = asyncio.Semaphore(self.max_concurrency)
        self._admitted: list[AdmissionTicket] = []  # in admission order
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def n_running(self) -> int:
        return sum(t.running for t in self._admitted)

    @property
    def n_waiting(self) -> int:
        return len(self._admitted) - self.n_running

    def _changed(self) -> None:
        if self._admitted:
            self._idle.clear()
        else:
            self._idle.set()
        self.on_change(self.n_waiting, self.n_running)

    async def drain(self) -> None:
        """Wait until every admitted request has finished (graceful shutdown)."""
        await self._idle.wait()


@dataclass
class DeadlineAdmission(AdmittedTickets):
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
        self._track()
        self._last = self.clock()

    @property
    def measured(self) -> Measured:
        return Measured(self.rate, self.error)

    # -- decisions ---------------------------------------------------------------------------

    def admit(self, cost: RequestCost, client: str | None = None, *, calibrating: bool = False) -> AdmissionTicket:
        """Admit the request (it then waits for a slot) or raise `Overloaded` with a Retry-After.
        `calibrating`: a request of the server's own warm-up, which measures what the deadline
        needs: admitted whatever it. A request expected past the deadline even alone (its token
        limit, the server's or its own, longer than the server can decode in time) is admitted
        when nothing else runs, and its answer is cut at the deadline: its limit is no reason to
        refuse it, since no schema can say how many tokens a deadline holds on this machine."""
        self._advance()
        rates = self.rate.rates()
        if self.max_in_flight_per_key is not None and client is not None:
            own = [t for t in self._admitted if t.client == client]
            if len(own) >= self.max_in_flight_per_key:
                self._refuse(
                    Refusal.KEY_LIMIT,
                    f"this API key has {len(own)} requests in flight; the limit is {self.max_in_flight_per_key}",
                    self._soonest(rates, own),
                )
        if len(self._admitted) >= self.max_concurrency + self.max_queue:  # counted whether or not they took their slots yet
            self._refuse(
                Refusal.QUEUE_FULL,
                f"server busy: {self.n_running} running and {self.n_waiting} waiting",
                self._soonest(rates, self._admitted),
            )
        ticket = AdmissionTicket(cost, client, admitted_at=self._last, calibrating=calibrating)
        tickets = [*self._admitted, ticket]
        jobs = _jobs(rates, tickets) if rates else ()
        finishes = dict(zip(tickets, plan_finishes(rates, jobs, self.max_concurrency), strict=True)) if rates else None
        if self.deadline_s is not None and self._admitted and not calibrating:
            if finishes is None:
                self._refuse(
                    Refusal.CALIBRATING,
                    "the server is measuring its service rate: one request at a time until one has finished",
                    None,
                )
            jobs, finishes = self._check_deadlines(rates, tickets, jobs, finishes, self.deadline_s)
        if finishes is not None:
            for i, (t, in_s) in enumerate(finishes.items()):
                t.estimated_s = self._last + in_s - t.admitted_at
                t.estimated_in_flight = len(finishes)
                t.plan = Plan(self._last, rates, tuple(tickets), jobs, i)
        self._admitted.append(ticket)
        self._changed()
        return ticket

    def _finishes(self, rates: Rates, tickets: list[AdmissionTicket]) -> dict[AdmissionTicket, float]:
        """Seconds from now until each of `tickets` (in admission order) finishes, nothing else admitted."""
        return dict(zip(tickets, plan_finishes(rates, _jobs(rates, tickets), self.max_concurrency), strict=True))

    def _check_deadlines(
        self,
        rates: Rates,
        tickets: list[AdmissionTicket],
        jobs: tuple[Job, ...],
        finishes: dict[AdmissionTicket, float],
        deadline_s: float,
    ) -> tuple[tuple[Job, ...], dict[AdmissionTicket, float]]:
        """The plan with the last of `tickets` (the new one) admitted, or refuse it: if, with it,
        it or an admitted request would finish past the deadline of its own admission, each at its
        own cost's quantile (`_own_tails`), the estimates scaled by their measured error, it is
        refused, unless it can be admitted held (`_held`). `Retry-After`: how much later the new one
        itself would fit, or, when an admitted request would be late, how long until that one
        finishes (admitting more would only make it later; told when it was expected at its mean,
        d9b5d26's clients came back 5x as often: 0.42x fixed-12's goodput, 64 users)."""
        new = tickets[-1]
        factor = self.error.factor(len(finishes))
        deadline = deadline_s * (1.0 - self.margin)

        def lateness(
            tickets: list[AdmissionTicket], jobs: tuple[Job, ...], finishes: dict[AdmissionTicket, float]
        ) -> dict[AdmissionTicket, float]:
            tails = self._own_tails(rates, tickets, jobs, finishes, deadline / factor)
            return {t: (self._last - t.admitted_at + in_s) * factor - deadline for t, in_s in tails.items()}

        first = lateness(tickets, jobs, finishes)
        blockers = {t: s for t, s in first.items() if s > 0}
        if not blockers:
            return jobs, finishes
        admitted = tickets[:-1]
        jobs_before = _jobs(rates, admitted)
        before = dict(zip(admitted, plan_finishes(rates, jobs_before, self.max_concurrency), strict=True))
        if new not in blockers and all(t.running for t in blockers):
            late_anyway = lateness(admitted, jobs_before, before)
            if all(late_anyway[t] > 0 for t in blockers):
                held = self._held(rates, tickets, list(blockers), lateness, factor, deadline_s)
                if held is not None:
                    return held
        logger.debug(
            "admission: refused with %d admitted: estimates x %.2f, the latest %.1f s past the plan",
            len(admitted),
            factor,
            max(blockers.values()),
        )
        retry = max(s if t is new else before[t] * factor for t, s in blockers.items())
        self._refuse(
            Refusal.DEADLINE,
            f"server busy: this request would finish in about {first[new] + deadline:.0f} s, "
            f"or make an admitted one finish later than the deadline of {deadline_s:g} s",
            retry,
        )

    def _held(
        self,
        rates: Rates,
        tickets: list[AdmissionTicket],
        late: list[AdmissionTicket],
        lateness: Callable[[list[AdmissionTicket], tuple[Job, ...], dict[AdmissionTicket, float]], dict[AdmissionTicket, float]],
        factor: float,
        deadline_s: float,
    ) -> tuple[tuple[Job, ...], dict[AdmissionTicket, float]] | None:
        """The plan with the new one (the last of `tickets`) held until the `late` ones end (running
        requests that would finish past their deadline with or without it, most often near its end),
        so that it cannot make them later; None where it would then finish past its own, or make
        another one late, or where `MAX_HELD` are held already. Its start is judged as late as
        their deadline, where the run stops them, not when the model expects them to end (they run
        later than it expected already). Held for one that is not late anyway, it would take the
        place of one more in a batch that the wait leaves smaller (simulated at 64 clients: chains
        of holds, one or two running, 0.64x the goodput). Refused instead, at 64 users, a server
        drained and refilled in waves (0.57x fixed-8's goodput, in rounds); admitted beside them,
        those near their end were cut at the deadline (41 of 215 answers, branch
        admission-late-anyway)."""
        new = tickets[-1]
        if sum(bool(t.held_by) for t in tickets) >= MAX_HELD:
            return None
        new.held_by = tuple(late)
        jobs = _jobs(rates, tickets)
        finishes = dict(zip(tickets, plan_finishes(rates, jobs, self.max_concurrency), strict=True))
        after = lateness(tickets, jobs, finishes)
        longest_wait = max(t.admitted_at + deadline_s - self._last for t in late)
        after[new] += max(longest_wait - max(finishes[t] for t in late), 0.0) * factor
        if all(s <= 0 or t in late for t, s in after.items()):
            logger.debug("admission: admitted held until %d of %d admitted end", len(late), len(tickets) - 1)
            return jobs, finishes
        new.held_by = ()
        return None

    def _own_tails(
        self,
        rates: Rates,
        tickets: list[AdmissionTicket],
        jobs: tuple[Job, ...],
        finishes: dict[AdmissionTicket, float],
        within_s: float,
    ) -> dict[AdmissionTicket, float]:
        """Seconds until each of `tickets` finishes with its own work at its cost's quantile, and
        that of those it is held for (it waits for them whole), the others' as `jobs` count them
        (their quantile's share, `RequestCost.work_among`): a request waits on its own length whole
        but on the others' only as their sum (an admitted one's tentative cost is not: see the
        module's docstring). The plan is made again only for those that the extra work could make
        finish later than `within_s` of their admission (at the slowest rate a request gets among as
        many), not for the many it cannot."""
        slots = min(len(jobs), self.max_concurrency)
        slowest = min(rates.at(k) / k for k in range(1, slots + 1))
        index = {t: i for i, t in enumerate(tickets)}
        tails = dict(finishes)
        for i, t in enumerate(tickets):
            whole = {i: t} if not t.cost.tentative or t is tickets[-1] else {}
            whole |= {index[b]: b for b in t.held_by if b in index and not b.cost.tentative}
            at_tails = {k: w.job(rates, w.cost.work_among(1), jobs[k].after) for k, w in whole.items()}
            extra = sum(job.left - jobs[k].left for k, job in at_tails.items())
            if extra > 0 and self._last - t.admitted_at + finishes[t] + extra / slowest > within_s:
                replanned = list(jobs)
                for k, job in at_tails.items():
                    replanned[k] = job
                tails[t] = plan_finishes(rates, replanned, self.max_concurrency)[i]
        return tails

    def service_rate(self) -> float | None:
        """The measured service rate at the number of requests running now (at least one), in
        work units per second (None until a request completed)."""
        self._advance()
        rates = self.rate.rates()
        return rates.at(max(1, min(self.n_running, self.max_concurrency))) if rates else None

    def expected_wait_s(self) -> float:
        """How long the work already admitted takes to finish, scaled by the estimates' error (0
        when unknown)."""
        self._advance()
        rates = self.rate.rates()
        if not rates or not self._admitted:
            return 0.0
        return max(self._finishes(rates, self._admitted).values()) * self.error.factor(len(self._admitted))

    def estimate_factor(self) -> float:
        """What estimates at the load admitted now are scaled by (`EstimateError.factor`)."""
        return self.error.factor(len(self._admitted))

    def _soonest(self, rates: Rates, tickets: list[AdmissionTicket]) -> float | None:
        """Expected seconds until the first of `tickets` (admitted ones) finishes, with nothing
        more admitted (None without rates)."""
        if not rates or not tickets:
            return None
        finishes = self._finishes(rates, self._admitted)
        return min(finishes[t] for t in tickets) * self.error.factor(len(self._admitted))

    def _refuse(self, reason: Refusal, message: str, retry_after_s: float | None) -> NoReturn:
        """Count the refusal and raise the 429, whose `Retry-After` is `retry_after_s` by the
        server's one policy (`errors.retry_after_s`: the default without an estimate)."""
        self.on_refuse(reason)
        raise Overloaded(reason, message, retry_after_s)

    # -- the life of an admitted request -------------------------------------------------------

    async def start(self, ticket: AdmissionTicket) -> None:
        """Wait until the requests it is held for have ended, then for a running slot (first come,
        first served)."""
        try:
            for before in ticket.held_by:
                await before.ended.wait()
            await self._slots.acquire()
        except BaseException:
            self._forget(ticket)
            raise
        self._advance()
        ticket.running = True
        ticket.held_by = ()
        self.on_start(self._last - ticket.admitted_at)
        self._changed()

    def finish(self, ticket: AdmissionTicket, *, completed: bool, served_work: float | None = None) -> None:
        """The request ended (idempotent). One that completed counts the work it was served
        (`workload.ServedWork`; its estimate where that is not known); the service one that failed
        or was cancelled took is lost (busy time with no work)."""
        if ticket.finished:
            return
        self._advance()
        served = (ticket.cost.work if served_work is None else served_work) if completed else 0.0
        self.rate.served(served, ticket.attention)
        if completed:
            ticket.served = served
        if completed and ticket.plan is not None:
            took_s = self._last - ticket.admitted_at
            estimated_s = self._replanned_s(ticket.plan, served, self.rate.rates() if ticket.calibrating else ticket.plan.rates)
            logger.debug(
                "admission: finished in %.2f s, estimated %.2f s (%.2f s with the work it had) with %d admitted",
                took_s,
                ticket.estimated_s,
                estimated_s,
                ticket.estimated_in_flight,
            )
            if self.deadline_s is None or estimated_s >= ERROR_COMPARED_SHARE * self.deadline_s * (1 - self.margin):
                self.error.observe(estimated_s, took_s, ticket.estimated_in_flight)
        if ticket.running:
            self._slots.release()
        self._forget(ticket)

    def _replanned_s(self, plan: Plan, served: float, rates: Rates) -> float:
        """The planned ticket's last estimate made again at `rates` with the work it was `served`,
        and the others that completed before it with theirs, in place of their costs (the others
        still running had at least as much left as it: in a shared server they outlasted it); at
        the plan's rates, but a warm-up request's at the rates measured when it ends: it was
        estimated before the rates it ran at were measured (the burst of 16 at the rate of one
        alone, 0.57x in the simulation), and that error is not the model's any more. What is
        left of the error is the model's (the rates, the sharing, what the model does not count),
        which every estimate shares; the costs' errors are their pipelines', whose next costs
        already count the work each had (`workload`)."""
        n = len(plan.jobs)

        def left(ticket: AdmissionTicket, job: Job, work: float) -> float:
            return max(work - (ticket.cost.work_among(n) - job.left), 0.0)

        estimated = plan.tickets[plan.index]
        own = left(estimated, plan.jobs[plan.index], served)

        def replanned(ticket: AdmissionTicket, job: Job) -> Job:
            if ticket is estimated:
                had = own
            elif ticket.served is not None:
                had = left(ticket, job, ticket.served)
            elif not ticket.finished:  # still running: it outlasted the estimated one
                return replace(job, left=max(job.left, own))
            else:  # failed or cancelled: what it was served is not known
                return job
            return replace(job, left=had, prefill=min(job.prefill, had))

        jobs = [replanned(t, job) for t, job in zip(plan.tickets, plan.jobs, strict=True)]
        return plan.at - estimated.admitted_at + plan_finishes(rates, jobs, self.max_concurrency)[plan.index]

    def _forget(self, ticket: AdmissionTicket) -> None:
        ticket.finished = True
        ticket.plan = None  # the others it holds are not needed any more
        ticket.held_by = ()
        ticket.ended.set()
        self._admitted.remove(ticket)
        self._changed()

    def _advance(self) -> None:
        """Bring the running requests' shares of the server and the rate's average up to now."""
        now = self.clock()
        dt, self._last = max(now - self._last, 0.0), now
        running = [t for t in self._admitted if t.running]
        for t in running:
            t.attention[len(running)] = t.attention.get(len(running), 0.0) + dt / len(running)
        self.rate.advance(dt)


def _jobs(rates: Rates, tickets: list[AdmissionTicket]) -> tuple[Job, ...]:
    """The `tickets` as the model plans them, each at its share among them (`RequestCost.work_among`),
    a held one after those of them it is held for."""
    index = {t: i for i, t in enumerate(tickets)}
    return tuple(
        t.job(rates, t.cost.work_among(len(tickets)), frozenset(index[b] for b in t.held_by if b in index)) for t in tickets
    )
